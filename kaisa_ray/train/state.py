"""The checkpoint format: what a worker saves, and how it restores it.

A checkpoint is one file, ``state.pt``, in a Ray Train checkpoint directory
(``<storage>/<run>/checkpoint_*``): the model, optimizer, lr schedule, GradScaler and
preconditioner state, the step and sampler position, every rank's RNG state, the best test
accuracy so far, what ``kfac: auto`` chose, and the job's spec. It is written by rank 0 every
``checkpoint.every_steps`` steps and when the job stops; a resumed run is bit for bit the run
that did not stop (``tests/train/test_ray_train.py``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kaisa_ray.errors import ConfigurationError

if TYPE_CHECKING:
    from kaisa_ray.train.training import Training

__all__ = ["CHECKPOINT_FILE", "CHECKPOINT_VERSION", "load_checkpoint_file", "restore", "snapshot"]

CHECKPOINT_FILE = "state.pt"
CHECKPOINT_VERSION = 1


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate())}
    state["python"][1] = list(state["python"][1])
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _gather(obj: Any, world: int) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def snapshot(training: Training) -> dict[str, Any] | None:
    """The checkpoint's content on rank 0 (None elsewhere); collective on every rank."""
    kfac = training.preconditioner.state_dict() if training.preconditioner is not None else None
    rngs = _gather(_rng_state(), training.world)
    if training.rank != 0:
        return None
    epoch, batch = training.shard.position(training.step + 1)
    spec = training.spec
    return {
        "version": CHECKPOINT_VERSION,
        "step": training.step,
        "sampler": {"epoch": epoch, "batch": batch, "seed": spec.seed},
        "world_size": training.world,
        "model": training.model.state_dict(),
        "optimizer": training.optimizer.state_dict(),
        "scheduler": training.scheduler.state_dict(),
        "scaler": training.scaler.state_dict(),
        "preconditioner": kfac,
        "rng": rngs,
        "best": dict(training.best),
        "kfac_decision": None if training.decided is None else training.decided.model_dump(),
        "quadratic_model": None if training.quadratic is None else training.quadratic.state_dict(),
        "spec": spec.model_dump(mode="json"),
    }


def restore(training: Training, state: dict[str, Any], source: str) -> None:
    """Put a checkpoint's state into ``training`` (built for the same job)."""
    if state.get("version") != CHECKPOINT_VERSION:
        raise ConfigurationError(
            f"checkpoint {source} has version {state.get('version')!r}; this kaisa-ray "
            f"reads version {CHECKPOINT_VERSION}"
        )
    if (state["preconditioner"] is None) != (training.preconditioner is None):
        raise ConfigurationError(
            f"checkpoint {source} was written with kfac "
            f"{'off' if state['preconditioner'] is None else 'on'}; resume it with the same "
            "kfac setting"
        )
    training.model.load_state_dict(state["model"])
    training.optimizer.load_state_dict(state["optimizer"])
    training.scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):  # empty for a disabled scaler (fp32, bf16)
        training.scaler.load_state_dict(state["scaler"])
    if training.preconditioner is not None:
        training.preconditioner.load_state_dict(state["preconditioner"])
    if training.quadratic is not None and state.get("quadratic_model") is not None:
        training.quadratic.load_state_dict(state["quadratic_model"])
    training.step = int(state["step"])
    training.best = dict(state["best"])
    rngs = state["rng"]
    _set_rng_state(rngs[training.rank] if training.rank < len(rngs) else rngs[0])


def load_checkpoint_file(directory: str | Path) -> dict[str, Any]:
    """Read a kaisa-ray checkpoint directory (``state.pt``) onto the CPU."""
    path = Path(directory) / CHECKPOINT_FILE
    if not path.is_file():
        raise ConfigurationError(
            f"{directory} is not a kaisa-ray checkpoint: it has no {CHECKPOINT_FILE}; pass the "
            "checkpoint_* directory of a run"
        )
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state
