"""Training functions run on every rank by the distributed tests (and once without ranks).

Everything is float64 and deterministic: batch ``k`` of the global data stream is the same
for every world size, and rank ``r`` of ``W`` takes the ``r``-th contiguous shard of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa_ray import KFACPreconditioner, sharding
from kaisa_ray.intervals import AdaptiveIntervals
from kaisa_ray.plan import StepType

GLOBAL_BATCH = 16
STEPS = 26
FACTOR_EVERY, INVERSE_EVERY = 2, 6


class Embedded(nn.Module):
    """Token ids cut from the input's first 12 pixels (9 buckets of unequal widths, so the
    ids' frequencies, A's eigenvalues, differ) -> an embedding -> a mean over the tokens ->
    two Linear layers: a model whose first K-FAC layer is an ``nn.Embedding``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer(
            "edges", torch.tensor([-1.6, -0.9, -0.5, -0.2, 0.0, 0.3, 0.8, 1.4], dtype=torch.float64)
        )
        self.embed = nn.Embedding(9, 5)
        self.hidden = nn.Linear(5, 6)
        self.out = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.bucketize(x.flatten(1)[:, :12].contiguous(), self.edges)
        h = torch.tanh(self.embed(ids)).mean(dim=1)
        out: torch.Tensor = self.out(torch.tanh(self.hidden(h)))
        return out


def build_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "embedded":
        return Embedded().double()
    if kind == "pooled":
        # Factors of full rank with distinct eigenvalues from the first batch (A 5x5 and 7x7,
        # G 6x6 from 32 examples; the last G's one zero eigenvalue, from the softmax, has a
        # unique eigenvector): its eigenbases are determined by the factors, so that
        # per-coordinate scaling in them is as reproducible as the factors.
        model: nn.Module = nn.Sequential(
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(4, 6),
            nn.Tanh(),
            nn.Linear(6, 4),
        )
    elif kind == "mlp":
        model = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, 24),
            nn.Tanh(),
            nn.Linear(24, 16),
            nn.Tanh(),
            nn.Linear(16, 4),
        )
    else:
        model = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 6, 3, padding="same", bias=False),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(6 * 16, 12),
            nn.ReLU(),
            nn.Linear(12, 4),
        )
    return model.double()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator)
    return x, y


# The curvature options of issue 19 (Fisher-scale factors, debiased averages, pi-damping).
NATURAL = {"running_average": "debiased", "factor_scale": "fisher", "pi_damping": True}
# Adaptive intervals whose target lies among these models' staleness (2-10 degrees over 4
# steps), so that within the run some layers lengthen, some shorten, and some come back.
ADAPTIVE = AdaptiveIntervals(rungs=((1, 2), (2, 4), (2, 8)), start=1, target_angle=5.0)


def _adam(combo: dict[str, Any]) -> bool:
    return combo.get("scaling") == "adam-eigenbasis"


def kfac_options(combo: dict[str, Any]) -> dict[str, Any]:
    """``schedule``: ``fixed`` (every 2 and 6 steps), ``measured`` (the same, measuring
    staleness) or ``adaptive`` (per-layer intervals, ``ADAPTIVE``)."""
    curvature = NATURAL if combo.get("curvature") == "natural" else {}
    schedule = combo.get("schedule", "fixed")
    intervals: dict[str, Any] = {
        "factor_update_steps": FACTOR_EVERY,
        "inv_update_steps": INVERSE_EVERY,
    }
    if schedule == "adaptive":
        intervals = {"intervals": ADAPTIVE}
    elif schedule == "measured":
        intervals["measure_staleness"] = True
    return (
        curvature
        | intervals
        | {
            "damping": 0.01,
            "kl_clip": 0.05,
            "lr": 0.1,
            "compute_method": combo["method"],
            "grad_worker_fraction": combo["strategy"],
            "symmetry_aware": combo.get("symmetry_aware", False),
            "colocate_factors": combo.get("colocate", True),
            "allreduce_bucket_cap_mb": combo.get("bucket_mb", 25.0),
            "update_factors_in_hook": combo.get("in_hook", True),
        }
        | (
            # Adam's moments in the eigenbasis: the direction is Adam's, so no KL clip.
            {"scaling": combo["scaling"], "kl_clip": None} if _adam(combo) else {}
        )
        | ({"scaling": combo["scaling"]} if combo.get("scaling") == "ekfac" else {})
        | ({"basis_update": combo["basis_update"]} if "basis_update" in combo else {})
        | ({"factor_reduction": combo["deferral"]} if "deferral" in combo else {})
        | ({"embeddings": True} if combo["model"] == "embedded" else {})
    )


class Counter:
    """Wraps torch.distributed's all_reduce and broadcast, and the all-gathers, gathers and
    scatters of a sharded model's gradient rows (``kaisa_ray.sharding``), to record what this
    rank sends (a gather's or a scatter's call: one member's share)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.calls: list[tuple[str, tuple[int, ...], int]] = []
        self.paused = False

    def _record(self, op: str, tensor: torch.Tensor, group: Any) -> None:
        if self.paused:
            return
        ranks = (
            tuple(range(self.world_size))
            if group is None
            else tuple(dist.get_process_group_ranks(group))
        )
        self.calls.append((op, ranks, tensor.numel() * tensor.element_size()))

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        real_all_reduce, real_broadcast = dist.all_reduce, dist.broadcast
        real = sharding.all_gather_rows, sharding.gather_rows, sharding.scatter_rows

        def all_gather_rows(gathered: torch.Tensor, mine: torch.Tensor, group: Any = None) -> None:
            self._record("all_gather", mine, group)
            real[0](gathered, mine, group)

        def gather_rows(mine: torch.Tensor, parts: Any, dst: int, group: Any) -> None:
            self._record("gather", mine, group)  # each member's share
            real[1](mine, parts, dst, group)

        def scatter_rows(mine: torch.Tensor, parts: Any, src: int, group: Any) -> None:
            self._record("scatter", mine, group)  # each member's share
            real[2](mine, parts, src, group)

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._record("all_reduce", tensor, kwargs.get("group"))
            return real_all_reduce(tensor, *args, **kwargs)

        def broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._record("broadcast", tensor, kwargs.get("group"))
            return real_broadcast(tensor, *args, **kwargs)

        dist.all_reduce, dist.broadcast = all_reduce, broadcast  # type: ignore[assignment]
        sharding.all_gather_rows = all_gather_rows
        sharding.gather_rows, sharding.scatter_rows = gather_rows, scatter_rows
        try:
            yield
        finally:
            dist.all_reduce, dist.broadcast = real_all_reduce, real_broadcast
            sharding.all_gather_rows, sharding.gather_rows, sharding.scatter_rows = real


def step_type(step: int) -> StepType:
    if step % INVERSE_EVERY == 0:
        return StepType.INVERSE_UPDATE
    if step % FACTOR_EVERY == 0:
        return StepType.FACTOR_UPDATE
    return StepType.PLAIN


def whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value on this rank (gathered where FSDP2 shards it)."""
    full_tensor = getattr(param, "full_tensor", None)
    return (param if full_tensor is None else full_tensor()).detach().cpu().clone()


def make(
    combo: dict[str, Any], distributed: bool
) -> tuple[nn.Module, nn.Module, KFACPreconditioner, torch.optim.Optimizer]:
    model = build_model(combo["model"])
    if combo.get("device", "cpu") == "cuda":  # the rank's own GPU (the harness set it)
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    cuda = next(model.parameters()).device.type == "cuda"
    if distributed and combo.get("fsdp", False):
        sharding.shard_layers(model)  # FSDP2: each K-FAC layer its own unit, then the model
        wrapped = model
    else:
        wrapped = (
            DistributedDataParallel(
                model, device_ids=[torch.cuda.current_device()] if cuda else None
            )
            if distributed and combo.get("ddp", True)
            else model
        )
    preconditioner = KFACPreconditioner(wrapped, **kfac_options(combo))
    # Adam's directions are of order one in every coordinate: a step of its size, and no
    # momentum on top of its own.
    adam = _adam(combo)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.001 if adam else 0.1, momentum=0.0 if adam else 0.9
    )
    return model, wrapped, preconditioner, optimizer


def train_steps(
    wrapped: nn.Module,
    model: nn.Module,
    preconditioner: KFACPreconditioner,
    optimizer: torch.optim.Optimizer,
    steps: range,
    rank: int,
    world_size: int,
    *,
    average_by_hand: bool,
    on_step: Callable[[int], None] | None = None,
    counter: Counter | None = None,
) -> None:
    shard = GLOBAL_BATCH // world_size
    device = next(model.parameters()).device
    for step in steps:
        x, y = global_batch(step)
        x, y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        if average_by_hand:
            if counter is not None:
                counter.paused = True
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
            if counter is not None:
                counter.paused = False
        preconditioner.step()
        optimizer.step()
        if on_step is not None:
            on_step(step)


def reference_params(combo: dict[str, Any], steps: int = STEPS) -> list[torch.Tensor]:
    """Single-process K-FAC on the whole global batch (no process group)."""
    model, wrapped, preconditioner, optimizer = make(combo, distributed=False)
    train_steps(
        wrapped, model, preconditioner, optimizer, range(steps), 0, 1, average_by_hand=False
    )
    return [p.detach().clone() for p in model.parameters()]


def equivalence_worker(
    rank: int, world_size: int, combos: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Train every combo; return parameters, memory, and counted vs planned collectives."""
    results = []
    for combo in combos:
        model, wrapped, preconditioner, optimizer = make(combo, distributed=True)
        counter = Counter(world_size)
        mismatches: list[str] = []
        planned_bytes: dict[str, int] = {}
        sent_bytes: dict[str, int] = {}

        trace: list[tuple[int, list[str], list[str]]] = []
        rungs = {
            layer.name: preconditioner.schedule.rung_of(layer.name)
            for layer in preconditioner.layers
        }

        def check(
            step: int,
            counter: Counter = counter,
            preconditioner: KFACPreconditioner = preconditioner,
            mismatches: list[str] = mismatches,
            planned_bytes: dict[str, int] = planned_bytes,
            sent_bytes: dict[str, int] = sent_bytes,
            trace: list[tuple[int, list[str], list[str]]] = trace,
            rungs: dict[str, tuple[int, int]] = rungs,
            adaptive: bool = combo.get("schedule", "fixed") == "adaptive",
        ) -> None:
            factors, decompositions = preconditioner.last_updates
            # What the layers' intervals before this step said it would update.
            expected = (
                {name for name, (f, _) in rungs.items() if step % f == 0},
                {name for name, (_, d) in rungs.items() if step % d == 0},
            )
            if (set(factors), set(decompositions)) != expected:
                mismatches.append(
                    f"step {step}: updated {factors}, {decompositions}; the "
                    f"intervals said {expected}"
                )
            planned_calls = preconditioner.plan.calls_at(rank, factors, decompositions)
            kind = step_type(step)
            if not adaptive:
                by_kind = preconditioner.plan.ranks[rank].calls[kind]
                if by_kind != planned_calls:
                    mismatches.append(f"step {step}: calls_at {planned_calls} != calls[{kind}]")
            else:
                kind = (
                    StepType.INVERSE_UPDATE
                    if decompositions
                    else StepType.FACTOR_UPDATE
                    if factors
                    else StepType.PLAIN
                )
            planned = [(c.op, c.group, c.nbytes) for c in planned_calls]
            if counter.calls != planned:
                mismatches.append(f"step {step} ({kind}): sent {counter.calls}, planned {planned}")
            planned_bytes[kind] = sum(c[2] for c in planned)
            sent_bytes[kind] = sum(c[2] for c in counter.calls)
            counter.calls = []
            trace.append((step, sorted(factors), sorted(decompositions)))
            for name in rungs:
                rungs[name] = preconditioner.schedule.rung_of(name)

        by_hand = not combo.get("ddp", True)
        with counter.installed():
            train_steps(
                wrapped,
                model,
                preconditioner,
                optimizer,
                range(STEPS),
                rank,
                world_size,
                average_by_hand=by_hand,
                on_step=check,
                counter=counter,
            )
        results.append(
            {
                "params": [whole(p) for p in model.parameters()],
                "memory": preconditioner.memory_usage(),
                "planned_memory": preconditioner.plan.ranks[rank].memory,
                "mismatches": mismatches,
                "planned_bytes": planned_bytes,
                "sent_bytes": sent_bytes,
                "trace": trace,
                "schedule": preconditioner.state_dict()["intervals"],
                "staleness": preconditioner.staleness(),
            }
        )
    return results


def checkpoint_worker(
    rank: int, world_size: int, combo: dict[str, Any], path: str, phase: str, split: int
) -> list[torch.Tensor]:
    """``save``: train to ``split``, checkpoint (collectively), go on to the end.
    ``resume``: load the checkpoint and train from ``split`` to the end."""
    model, wrapped, preconditioner, optimizer = make(combo, distributed=True)
    if phase == "save":
        train_steps(
            wrapped,
            model,
            preconditioner,
            optimizer,
            range(split),
            rank,
            world_size,
            average_by_hand=False,
        )
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "kfac": preconditioner.state_dict(),
        }
        if rank == 0:
            torch.save(state, path)
    else:
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        preconditioner.load_state_dict(state["kfac"])
    train_steps(
        wrapped,
        model,
        preconditioner,
        optimizer,
        range(split, STEPS),
        rank,
        world_size,
        average_by_hand=False,
    )
    return [p.detach().clone() for p in model.parameters()]


def resume_worker(
    rank: int, world_size: int, combo: dict[str, Any], path: str, split: int
) -> list[dict[str, Any]]:
    """Train to the end without stopping, then again from a checkpoint taken at ``split``
    (saved collectively, loaded by a fresh model and preconditioner): the parameters and the
    schedule of both (its state and what it measured), for a bit-for-bit comparison."""
    outcomes = []
    for phase in ("uninterrupted", "resumed"):
        model, wrapped, preconditioner, optimizer = make(combo, distributed=True)
        start = 0
        if phase == "resumed":
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            preconditioner.load_state_dict(state["kfac"])
            start = split

        def save(
            step: int,
            model: nn.Module = model,
            preconditioner: KFACPreconditioner = preconditioner,
            optimizer: torch.optim.Optimizer = optimizer,
            phase: str = phase,
        ) -> None:
            if phase == "uninterrupted" and step == split - 1:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "kfac": preconditioner.state_dict(),
                }
                if rank == 0:
                    torch.save(state, path)
                dist.barrier()

        train_steps(
            wrapped,
            model,
            preconditioner,
            optimizer,
            range(start, STEPS),
            rank,
            world_size,
            average_by_hand=False,
            on_step=save,
        )
        outcomes.append(
            {
                "params": [p.detach().cpu().clone() for p in model.parameters()],
                "schedule": preconditioner.state_dict()["intervals"],
                "staleness": preconditioner.staleness(),
            }
        )
    return outcomes


def deferred_skip_worker(rank: int, world_size: int, combo: dict[str, Any]) -> dict[str, Any]:
    """Deferred factor reduction where one rank's batch factor is not finite on one factor
    step (its gradients finite, as DDP's averaged ones are): what each rank skipped, and its
    parameters and running factors at the end."""
    from kaisa_ray.kfac_layer import KFACLayer

    model, wrapped, preconditioner, optimizer = make(combo, distributed=True)
    real = KFACLayer.batch_factors
    poisoned_step = 2 * FACTOR_EVERY  # a factor step, not a decomposition step

    def batch_factors(layer: KFACLayer) -> tuple[torch.Tensor, torch.Tensor] | None:
        found = real(layer)
        if found is not None and rank == 1 and preconditioner.steps == poisoned_step:
            found[0].fill_(float("nan"))
        return found

    KFACLayer.batch_factors = batch_factors  # type: ignore[method-assign]
    try:
        train_steps(wrapped, model, preconditioner, optimizer, range(STEPS), rank, world_size,
                    average_by_hand=False)  # fmt: skip
    finally:
        KFACLayer.batch_factors = real  # type: ignore[method-assign]
    return {
        "skipped": preconditioner.skipped_factor_updates,
        "params": [p.detach().clone() for p in model.parameters()],
        "factors": [layer.factors()[0].clone() for layer in preconditioner.layers],
        "weights": [layer.average_weight for layer in preconditioner.layers],
    }
