"""The per-worker train loop that Ray Train runs: DDP, K-FAC, evaluation and checkpoints.

``train_worker`` is the ``train_loop_per_worker`` of the job's ``TorchTrainer``. Each worker
builds the model and its shard of the data, wraps the model in DDP (gloo on CPU, NCCL on GPU:
Ray Train sets up ``torch.distributed``), adds the K-FAC preconditioner between ``backward()``
and ``optimizer.step()``, and trains until the job's stop condition. Step ``s`` (1-based) always
reads the same mini-batch: epoch ``(s-1) // steps_per_epoch`` of a ``DistributedSampler``
seeded with the job's seed, batch ``(s-1) % steps_per_epoch`` of it. That is the sampler
position a checkpoint records, so a resumed run reads exactly what an uninterrupted one would.

A checkpoint (``state.pt`` in a Ray Train checkpoint directory) holds the model, optimizer,
lr schedule and preconditioner state, the step and sampler position, and every rank's RNG
state. It is written by rank 0 every ``checkpoint.every_steps`` steps and when the job stops.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.exceptions
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

from kaisa_ray.amp import MixedPrecision, optimizer_step
from kaisa_ray.errors import ConfigurationError, KaisaRayError
from kaisa_ray.preconditioner import KFACPreconditioner
from kaisa_ray.timing import PHASES
from kaisa_ray.train.progress import progress_sink
from kaisa_ray.train.registry import DatasetRequest, dataset_entry, model_factory
from kaisa_ray.train.spec import JobSpec, KFACSpec, OptimizerSpec, ScheduleSpec
from kaisa_ray.train.storage import local_checkpoint
from tuner.actor import profile_key, tuner_actor
from tuner.cost import DEFAULT_INTERVALS, Decision, Profile
from tuner.profile import measure_candidate, profile_job

CHECKPOINT_FILE = "state.pt"
CHECKPOINT_VERSION = 1


def build_optimizer(spec: OptimizerSpec, params: Any) -> torch.optim.Optimizer:
    """The optimizer a job asks for."""
    if spec.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=spec.lr,
            momentum=spec.momentum,
            nesterov=spec.nesterov and spec.momentum > 0,
            weight_decay=spec.weight_decay,
        )
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)


def lr_factor(schedule: ScheduleSpec, total_steps: int) -> Callable[[int], float]:
    """The lr multiplier after ``s`` completed steps: linear warm-up, then the schedule.

    Warm-up rises linearly from ``1/(warmup_steps+1)`` to 1 over ``warmup_steps`` steps;
    ``cosine`` then decays to 0 at ``total_steps``; ``step`` multiplies by ``gamma`` every
    ``step_every`` steps after warm-up; ``constant`` stays at 1.
    """
    warmup = schedule.warmup_steps

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        after = s - warmup
        if schedule.kind == "cosine":
            span = max(total_steps - warmup, 1)
            return 0.5 * (1.0 + math.cos(math.pi * min(after, span) / span))
        if schedule.kind == "step" and schedule.step_every:
            return float(schedule.gamma ** (after // schedule.step_every))
        return 1.0

    return factor


class TrainingDivergedError(KaisaRayError):
    """The training loss stopped being a finite number: the run diverged."""


def build_preconditioner(
    spec: KFACSpec,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
) -> KFACPreconditioner:
    """K-FAC as the job asks for it; KL clipping follows the lr schedule; with fp16, the
    GradScaler's scale is taken out of the output gradients."""
    group = optimizer.param_groups[0]
    return KFACPreconditioner(
        model,
        factor_update_steps=spec.factor_update_steps,
        inv_update_steps=spec.inv_update_steps,
        damping=spec.damping,
        factor_decay=spec.factor_decay,
        kl_clip=spec.kl_clip,
        grad_scaler=scaler,
        lr=lambda _step: float(group["lr"]),
        compute_method=spec.compute_method,
        kfac_approx=spec.kfac_approx,
        grad_worker_fraction=spec.strategy,
    )


def _share(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (itself when not distributed)."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def candidate_rows(candidates: Any) -> list[dict[str, Any]]:
    """The candidate table as progress records carry it (plain numbers, ms per step)."""
    return [
        {
            "grad_worker_fraction": c.grad_worker_fraction,
            "factor_update_steps": c.factor_update_steps,
            "inv_update_steps": c.inv_update_steps,
            "memory_bytes": c.memory_bytes,
            "kfac_state_bytes": c.kfac_state_bytes,
            "ms_per_step": 1000 * c.step_s,
            "rejected": c.rejected,
        }
        for c in candidates
    ]


def tune(
    spec: JobSpec,
    kfac: KFACSpec,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    shard: Shard,
    device: torch.device,
    precision: MixedPrecision,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kfac: auto``: profile on these workers (collective), then ask the tuner to choose.

    The tuner actor caches profiles by ``profile_key`` (model, batch, K-FAC options, cluster
    shape): when it has this job's, nobody profiles. Rank 0 talks to the actor and shares
    the answer, so every rank makes the same choice. Returns the chosen KFACSpec fields and
    the record for the progress sink (the decision and the whole candidate table, with the
    reason for each rejection).
    """
    options = {
        "compute_method": kfac.compute_method,
        "kfac_approx": kfac.kfac_approx,
        "precision": spec.precision,
    }
    model = net.module if isinstance(net, DistributedDataParallel) else net
    key = profile_key(model, shard.batch(1)[0], device, options)
    rank = dist.get_rank() if _distributed() else 0
    tuner = tuner_actor() if rank == 0 else None
    cached: Profile | None = _share(ray.get(tuner.lookup.remote(key)) if tuner else None)
    seconds = 0.0
    profile = cached
    if profile is None:
        result = profile_job(
            net,
            optimizer,
            lambda i: shard.batch(i + 1),
            nn.functional.cross_entropy,
            device,
            compute_method=kfac.compute_method,
            kfac_options={"kfac_approx": kfac.kfac_approx},
            precision=precision,
        )
        profile, seconds = result.profile, result.seconds
    budget = int(spec.memory_budget) if spec.memory_budget is not None else None
    outcome: Decision | ConfigurationError | None = None
    if tuner is not None:
        call = tuner.decide.remote(
            key,
            None if cached is not None else profile,
            budget,
            kfac.max_overhead,
            kfac.ladder() or DEFAULT_INTERVALS,
        )
        try:
            outcome = ray.get(call)
        except ray.exceptions.RayTaskError as error:
            if not isinstance(error.cause, ConfigurationError):
                raise
            outcome = type(error.cause)(*error.cause.args)  # a plain, picklable copy
    outcome = _share(outcome)
    if isinstance(outcome, ConfigurationError):
        raise outcome
    assert isinstance(outcome, Decision)
    chosen = outcome.chosen
    decided = {
        "strategy": chosen.grad_worker_fraction,
        "factor_update_steps": chosen.factor_update_steps,
        "inv_update_steps": chosen.inv_update_steps,
    }
    record = {
        "kind": "tuner",
        "how": outcome.how,
        "cache": "hit" if cached is not None else "miss",
        "profile_s": seconds,
        "budget_bytes": budget,
        "base_memory_bytes": profile.base_memory_bytes,
        "kfac_transient_bytes": profile.kfac_transient_bytes,
        "plain_ms_per_step": 1000 * profile.step_s,
        "chosen": decided,
        "candidates": candidate_rows(outcome.candidates),
    }
    return decided, record


@dataclass
class Window:
    """Step metrics accumulated between two progress records."""

    steps: int = 0
    loss: float = 0.0
    correct: int = 0
    samples: int = 0
    step_s: float = 0.0
    kfac_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add_kfac(self, seconds: dict[str, float]) -> None:
        for phase, value in seconds.items():
            self.kfac_s[phase] += value

    def record(self, *, step: int, epoch: int, lr: float, world: int) -> dict[str, Any]:
        n = max(self.steps, 1)
        return {
            "kind": "step",
            "step": step,
            "epoch": epoch,
            "loss": self.loss / n,
            "accuracy": self.correct / max(self.samples, 1),
            "lr": lr,
            "samples_per_s": world * self.samples / max(self.step_s, 1e-9),
            "ms_per_step": 1000 * self.step_s / n,
            "kfac_ms_per_step": 1000 * sum(self.kfac_s.values()) / n,
            **{f"kfac_{phase}_ms": 1000 * value / n for phase, value in self.kfac_s.items()},
        }


@dataclass
class Shard:
    """One worker's view of the data: its batches in sampler order, and its test slice."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    sampler: DistributedSampler[Any]
    batch_size: int
    steps_per_epoch: int
    _epoch: int = -1
    _order: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) that step ``step`` (1-based) reads."""
        return divmod(step - 1, self.steps_per_epoch)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = self.position(step)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._order = torch.tensor(list(iter(self.sampler)), dtype=torch.long)
            self._epoch = epoch
        rows = self._order[index * self.batch_size : (index + 1) * self.batch_size]
        return self.train_x[rows], self.train_y[rows]


def load_shard(spec: JobSpec, rank: int, world: int) -> Shard:
    entry = dataset_entry(spec.dataset.name)
    data_dir = spec.dataset.data_dir or entry.default_dir

    def load(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        request = DatasetRequest(
            split=split, data_dir=data_dir, limit=spec.dataset.limit, seed=spec.seed
        )
        return entry.loader(request)

    train_x, train_y = load("train")
    test_x, test_y = load("test")
    sampler: DistributedSampler[Any] = DistributedSampler(
        TensorDataset(train_y), num_replicas=world, rank=rank, shuffle=True, seed=spec.seed
    )
    batch = spec.dataset.batch_size
    steps_per_epoch = len(sampler) // batch
    if steps_per_epoch == 0:
        raise ConfigurationError(
            f"dataset.batch_size={batch} is larger than each worker's share of the training "
            f"set ({len(sampler)} samples over {world} workers); lower batch_size or raise "
            "dataset.limit"
        )
    per_rank = math.ceil(test_x.shape[0] / world)
    lo, hi = rank * per_rank, min((rank + 1) * per_rank, test_x.shape[0])
    return Shard(
        train_x=train_x,
        train_y=train_y,
        test_x=test_x[lo:hi],
        test_y=test_y[lo:hi],
        sampler=sampler,
        batch_size=batch,
        steps_per_epoch=steps_per_epoch,
    )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@torch.no_grad()
def evaluate_shard(
    model: nn.Module,
    shard: Shard,
    device: torch.device,
    batch_size: int = 1000,
    precision: MixedPrecision | None = None,
) -> tuple[float, float]:
    """(test loss, test accuracy) over the whole test split, summed over every rank's slice."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    autocast = precision or MixedPrecision(device_type=device.type)
    for start in range(0, shard.test_x.shape[0], batch_size):
        x = shard.test_x[start : start + batch_size].to(device)
        y = shard.test_y[start : start + batch_size].to(device)
        with autocast.autocast():
            logits = model(x).float()
        totals[0] += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        totals[1] += int((logits.argmax(dim=1) == y).sum())
        totals[2] += y.shape[0]
    model.train(was_training)
    if _distributed():
        on_device = totals.to(device)
        dist.all_reduce(on_device)
        totals = on_device.cpu()
    count = max(float(totals[2]), 1.0)
    return float(totals[0]) / count, float(totals[1]) / count


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
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


@dataclass
class Job:
    """Everything one worker trains with (built by ``Job.build``)."""

    spec: JobSpec
    rank: int
    world: int
    device: torch.device
    model: nn.Module
    net: nn.Module  # the DDP wrapper when distributed, else the model itself
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    preconditioner: KFACPreconditioner | None
    shard: Shard
    max_steps: int
    precision: MixedPrecision
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    kfac_decision: dict[str, Any] | None = None  # what kfac: auto chose (kept in checkpoints)
    tuning: dict[str, Any] | None = None  # the tuner's record, when it ran in this attempt
    step: int = 0
    best: dict[str, float] = field(default_factory=dict)

    @classmethod
    def build(cls, spec: JobSpec, decided: dict[str, Any] | None = None) -> Job:
        """Everything a worker trains with. With ``kfac: auto`` the tuner profiles this job on
        these workers and chooses, unless ``decided`` (from a checkpoint) says what it chose."""
        context = ray.train.get_context()
        rank, world = context.get_world_rank(), context.get_world_size()
        device = ray.train.torch.get_device()
        shard = load_shard(spec, rank, world)
        if spec.stop.max_steps is not None:
            max_steps = spec.stop.max_steps
        else:
            max_steps = (spec.stop.max_epochs or 1) * shard.steps_per_epoch
        torch.manual_seed(spec.seed)
        random.seed(spec.seed)
        model = model_factory(spec.model.name)(**spec.model.params).to(device)
        net: nn.Module = model
        if _distributed() and world > 1:
            net = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None
            )
        optimizer = build_optimizer(spec.optimizer, model.parameters())
        precision = MixedPrecision(mode=spec.precision, device_type=device.type)
        scaler = precision.grad_scaler()
        kfac = spec.kfac if isinstance(spec.kfac, KFACSpec) else None
        tuning = None
        if kfac is not None and kfac.strategy == "auto":
            if decided is None:
                decided, tuning = tune(spec, kfac, net, optimizer, shard, device, precision)
            kfac = kfac.model_copy(update=decided)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_factor(spec.optimizer.schedule, max_steps)
        )
        preconditioner = (
            build_preconditioner(kfac, net, optimizer, scaler) if kfac is not None else None
        )
        return cls(
            spec=spec,
            rank=rank,
            world=world,
            device=device,
            model=model,
            net=net,
            optimizer=optimizer,
            scheduler=scheduler,
            preconditioner=preconditioner,
            shard=shard,
            max_steps=max_steps,
            precision=precision,
            scaler=scaler,
            kfac_decision=decided,
            tuning=tuning,
        )

    # -- checkpoints -------------------------------------------------------------------------

    def state(self) -> dict[str, Any] | None:
        """The checkpoint's content on rank 0 (None elsewhere); collective on every rank."""
        kfac = self.preconditioner.state_dict() if self.preconditioner is not None else None
        rngs = _gather(_rng_state(), self.world)
        if self.rank != 0:
            return None
        epoch, batch = self.shard.position(self.step + 1)
        return {
            "version": CHECKPOINT_VERSION,
            "step": self.step,
            "sampler": {"epoch": epoch, "batch": batch, "seed": self.spec.seed},
            "world_size": self.world,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "preconditioner": kfac,
            "rng": rngs,
            "best": dict(self.best),
            "kfac_decision": self.kfac_decision,
            "spec": self.spec.model_dump(mode="json"),
        }

    def load(self, state: dict[str, Any], source: str) -> None:
        if state.get("version") != CHECKPOINT_VERSION:
            raise ConfigurationError(
                f"checkpoint {source} has version {state.get('version')!r}; this kaisa-ray "
                f"reads version {CHECKPOINT_VERSION}"
            )
        if (state["preconditioner"] is None) != (self.preconditioner is None):
            raise ConfigurationError(
                f"checkpoint {source} was written with kfac "
                f"{'off' if state['preconditioner'] is None else 'on'}; resume it with the same "
                "kfac setting"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):  # empty for a disabled scaler (fp32, bf16)
            self.scaler.load_state_dict(state["scaler"])
        if self.preconditioner is not None:
            self.preconditioner.load_state_dict(state["preconditioner"])
        self.step = int(state["step"])
        self.best = dict(state["best"])
        rngs = state["rng"]
        _set_rng_state(rngs[self.rank] if self.rank < len(rngs) else rngs[0])


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


def _report(job: Job, metrics: dict[str, Any], with_checkpoint: bool) -> None:
    """``ray.train.report`` on every rank; rank 0 attaches the checkpoint."""
    state = job.state() if with_checkpoint else None
    if state is None:
        ray.train.report(metrics)
        return
    directory = tempfile.mkdtemp(prefix="kaisa-ray-ckpt-")
    try:
        torch.save(state, os.path.join(directory, CHECKPOINT_FILE))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _target_met(spec: JobSpec, test_loss: float, test_accuracy: float) -> bool:
    target = spec.stop.target
    if target is None:
        return False
    if target.metric == "test_accuracy":
        return test_accuracy >= target.value
    return test_loss <= target.value


def _profile_worker(spec: JobSpec, run: str) -> None:
    """``mode: profile``: build the job (``kfac: auto`` profiles and decides), report, stop."""
    sink = progress_sink()
    try:
        job = Job.build(spec)
    except ConfigurationError as error:  # nothing fits: the driver reports this message
        if ray.train.get_context().get_world_rank() == 0:
            ray.get(sink.push.remote(run, [{"kind": "tuner-error", "error": str(error)}]))
        raise
    if job.rank == 0 and job.tuning is not None:
        ray.get(sink.push.remote(run, [job.tuning]))  # waited for: the worker stops next
    ray.train.report({"done": True})


def _measure_worker(
    spec: JobSpec, run: str, candidates: list[dict[str, Any]], min_steps: int, rounds: int
) -> None:
    """``mode: measure``: train a few steps with each candidate strategy in turn (from the
    same weights), ``rounds`` times interleaved; push each one's peak memory per worker (from
    the first round) and median time per step to the sink
    (``tuner.profile.measure_candidate``)."""
    kfac = spec.kfac
    if not isinstance(kfac, KFACSpec):
        raise ConfigurationError("measuring a K-FAC strategy needs a job with kfac on")
    job = Job.build(spec.model_copy(update={"kfac": "off"}))
    sink = progress_sink()
    memory: dict[int, int] = {}
    times: dict[int, list[float]] = {i: [] for i in range(len(candidates))}
    steps: dict[int, int] = {}
    for round_, (index, candidate) in itertools.product(range(rounds), enumerate(candidates)):
        measured = measure_candidate(
            job.net,
            job.optimizer,
            lambda i: job.shard.batch(i + 1),
            nn.functional.cross_entropy,
            job.device,
            grad_worker_fraction=candidate["strategy"],
            factor_update_steps=candidate["factor_update_steps"],
            inv_update_steps=candidate["inv_update_steps"],
            min_steps=min_steps,
            count_memory=round_ == 0,
            precision=job.precision,
            kfac_options={
                "compute_method": kfac.compute_method,
                "kfac_approx": kfac.kfac_approx,
                "damping": kfac.damping,
                "factor_decay": kfac.factor_decay,
                "kl_clip": kfac.kl_clip,
            },
        )
        if round_ == 0:
            memory[index], steps[index] = measured.memory_bytes, measured.steps
        times[index].append(1000 * measured.step_s)
    if job.rank == 0:  # Ray Train keeps metrics only with checkpoints: the sink has them
        records = [
            {
                "kind": "measured",
                "candidate": candidate,
                "memory_bytes": memory[index],
                "ms_per_step": statistics.median(times[index]),
                "ms_per_step_rounds": times[index],
                "steps": steps[index],
            }
            for index, candidate in enumerate(candidates)
        ]
        ray.get(sink.push.remote(run, records))
    ray.train.report({"done": True})


def train_worker(config: dict[str, Any]) -> None:
    """``train_loop_per_worker``. ``config`` holds ``spec`` (JSON) and ``run``, and:

    - ``mode``: ``train`` (the default), ``profile`` (``kfac: auto`` profiles and decides,
      then stops) or ``measure`` (measure each of ``candidates`` for ``min_steps``);
    - ``resume_from``: a checkpoint to start from;
    - ``decided`` and ``tuning``: what ``kfac: auto`` chose before the job started (with
      ``verify``), and the tuner's record of it;
    - ``report_evals``: report every evaluation through ``ray.train.report`` (a sweep's
      trials), not only those with checkpoints.
    """
    spec = JobSpec.model_validate(config["spec"])
    mode = config.get("mode", "train")
    if mode == "profile":
        _profile_worker(spec, config["run"])
        return
    if mode == "measure":
        _measure_worker(
            spec,
            config["run"],
            config["candidates"],
            config.get("min_steps", 50),
            config.get("rounds", 1),
        )
        return
    run: str = config["run"]
    progress_every: int = config.get("progress_every", 10)
    # A sweep's trials report every evaluation (Tune's schedulers judge them by it); a job
    # reports only with its checkpoints (each report waits for Ray Train's controller).
    report_evals: bool = config.get("report_evals", False)
    reached = False  # the stop target was met
    checkpoint = ray.train.get_checkpoint()
    source = checkpoint.path if checkpoint is not None else config.get("resume_from")
    state: dict[str, Any] | None = None
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = load_checkpoint_file(directory)
    elif source is not None:
        with local_checkpoint(source) as directory:
            state = load_checkpoint_file(directory)
    # Before anything slow (data, tuning): the service sees the workers start.
    context = ray.train.get_context()
    sink = progress_sink()
    sink.push.remote(
        run,
        [
            {
                "kind": "worker",
                "rank": context.get_world_rank(),
                "world": context.get_world_size(),
                "pid": os.getpid(),
                "device": str(ray.train.torch.get_device()),
                "node": ray.get_runtime_context().get_node_id(),
            }
        ],
    )
    decided = state.get("kfac_decision") if state else config.get("decided")
    auto = isinstance(spec.kfac, KFACSpec) and spec.kfac.strategy == "auto"
    if auto and decided is None and context.get_world_rank() == 0:
        sink.push.remote(run, [{"kind": "profiling"}])
    job = Job.build(spec, decided=decided)
    if state is None and config.get("tuning") is not None:
        job.tuning = config["tuning"]
    if state is not None:
        job.load(state, str(source))

    if job.rank == 0 and job.tuning is not None:
        sink.push.remote(run, [job.tuning])
    if job.rank == 0:
        start = {"kind": "start", "total_steps": job.max_steps, "from_step": job.step}
        if source is not None:
            start["resumed_from"] = str(source)
        sink.push.remote(run, [start])

    criterion = nn.CrossEntropyLoss()
    window = Window()
    began = time.perf_counter()
    train_s = 0.0  # seconds in training steps since this attempt began (no eval, checkpoints)
    last_eval: tuple[float, float] | None = None
    job.net.train()
    while job.step < job.max_steps:
        step = job.step + 1
        tick = time.perf_counter()
        x, y = job.shard.batch(step)
        x, y = x.to(job.device, non_blocking=True), y.to(job.device, non_blocking=True)
        job.optimizer.zero_grad(set_to_none=True)
        with job.precision.autocast():
            logits = job.net(x)
            loss = criterion(logits, y)
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise TrainingDivergedError(
                f"the training loss is {loss_value} at step {step} on rank {job.rank}: the run "
                "diverged. Lower optimizer.lr, raise kfac.damping or tighten kfac.kl_clip"
            )
        optimizer_step(loss, job.optimizer, job.preconditioner, job.scaler)
        if job.preconditioner is not None:
            window.add_kfac(job.preconditioner.times.reset())
        job.scheduler.step()
        job.step = step
        window.steps += 1
        window.loss += loss_value
        window.correct += int((logits.detach().argmax(dim=1) == y).sum())
        window.samples += y.shape[0]
        took = time.perf_counter() - tick
        window.step_s += took
        train_s += took

        done = step >= job.max_steps
        if step % progress_every == 0 or done:
            if job.rank == 0:
                epoch, _ = job.shard.position(step)
                lr = float(job.optimizer.param_groups[0]["lr"])
                record = window.record(step=step, epoch=epoch, lr=lr, world=job.world)
                sink.push.remote(run, [record])
            window = Window()

        evaluated = step % spec.eval_every == 0 or done
        if evaluated:
            last_eval = evaluate_shard(job.net, job.shard, job.device, precision=job.precision)
            test_loss, test_accuracy = last_eval
            job.best["test_accuracy"] = max(job.best.get("test_accuracy", 0.0), test_accuracy)
            if job.rank == 0:
                sink.push.remote(
                    run,
                    [
                        {
                            "kind": "eval",
                            "step": step,
                            "test_loss": test_loss,
                            "test_accuracy": test_accuracy,
                            "elapsed_s": time.perf_counter() - began,
                            "train_s": train_s,
                        }
                    ],
                )
            if _target_met(spec, test_loss, test_accuracy):
                done = reached = True

        checkpoint_due = done or step % spec.checkpoint.every_steps == 0
        if checkpoint_due or (report_evals and evaluated):
            # "finished": the job met its stop condition ("done" is Ray Tune's own key).
            metrics: dict[str, Any] = {"step": step, "finished": done, "train_s": train_s}
            if last_eval is not None:
                metrics["test_loss"], metrics["test_accuracy"] = last_eval
            if reached:
                metrics["time_to_target_s"] = train_s
            _report(job, metrics, with_checkpoint=checkpoint_due)
            if job.rank == 0 and checkpoint_due:
                sink.push.remote(run, [{"kind": "checkpoint", "step": step}])
        if done:
            break

    if job.rank == 0:
        sink.push.remote(run, [{"kind": "end", "step": job.step}])
