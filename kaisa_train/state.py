"""The checkpoint format: what a worker saves, and how it restores it.

A checkpoint is one file, ``state.pt``, in a Ray Train checkpoint directory
(``<storage>/<run>/checkpoint_*``): the model, optimizer, lr schedule, GradScaler and
preconditioner state, the step and sampler position, every rank's RNG state, the best test
accuracy so far, what ``kfac: auto`` chose, and the job's spec. The model and optimizer are
saved whole, as one process holds them, also from a job sharded by FSDP2 (gathered to rank 0
first), so a checkpoint resumes a job of either kind. It is written by rank 0 every
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
    from kaisa_train.training import Training

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


def _whole_states(training: Training) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state as one process holds them (torch's formats):
    under FSDP2 every sharded tensor gathered whole (collective: every rank, in the same
    order), so that a sharded job's checkpoint is a DDP job's too."""
    model, optimizer = training.model.state_dict(), training.optimizer.state_dict()
    if not training.sharded:
        return model, optimizer
    whole_model = {name: _whole(value) for name, value in model.items()}
    whole_optimizer = {
        "state": {
            index: {key: _whole(value) for key, value in state.items()}
            for index, state in optimizer["state"].items()
        },
        "param_groups": optimizer["param_groups"],
    }
    return whole_model, whole_optimizer


def _whole(value: Any) -> Any:
    full_tensor = getattr(value, "full_tensor", None)  # a DTensor's
    return value if full_tensor is None else full_tensor().cpu()


def _load_whole_states(training: Training, model: dict[str, Any], optimizer: Any) -> None:
    """Load what ``_whole_states`` saved (from a sharded job or not) into ``training``:
    under FSDP2, each rank's rows of every sharded tensor."""
    if not training.sharded:
        training.model.load_state_dict(model)
        training.optimizer.load_state_dict(optimizer)
        return
    own = training.model.state_dict()
    training.model.load_state_dict({name: _rows(value, own[name]) for name, value in model.items()})
    params = [p for group in training.optimizer.param_groups for p in group["params"]]
    training.optimizer.load_state_dict(
        {
            "state": {
                index: {key: _rows(value, params[int(index)]) for key, value in state.items()}
                for index, state in optimizer["state"].items()
            },
            "param_groups": optimizer["param_groups"],
        }
    )


def _rows(value: Any, like: Any) -> Any:
    """This rank's rows of a whole tensor, as a DTensor sharded as ``like`` is (a tensor of
    another shape, such as Adam's step count, or a plain ``like``: as it is)."""
    mesh = getattr(like, "device_mesh", None)
    if mesh is None or not isinstance(value, torch.Tensor) or value.shape != like.shape:
        return value
    from torch.distributed.tensor import DTensor

    from kaisa_ray.sharding import rows_of

    start, end = rows_of(value.shape[0], mesh.get_local_rank(), mesh.size())
    return DTensor.from_local(
        value[start:end].to(like.device),
        mesh,
        like.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def snapshot(training: Training) -> dict[str, Any] | None:
    """The checkpoint's content on rank 0 (None elsewhere); collective on every rank."""
    kfac = training.preconditioner.state_dict() if training.preconditioner is not None else None
    rngs = _gather(_rng_state(), training.world)
    model, optimizer = _whole_states(training)
    if training.rank != 0:
        return None
    epoch, batch = training.shard.position(training.step + 1)
    spec = training.spec
    return {
        "version": CHECKPOINT_VERSION,
        "step": training.step,
        "sampler": {"epoch": epoch, "batch": batch, "seed": spec.seed},
        "world_size": training.world,
        "model": model,
        "optimizer": optimizer,
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
    _load_whole_states(training, state["model"], state["optimizer"])
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
