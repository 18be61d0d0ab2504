"""What a K-FAC step does to the curvature when it updates it: on a factor step, the reduced
batch factors folded into the running averages (unless a factor or a gradient is not finite);
on a decomposition step, each layer's factors decomposed on the ranks the plan assigns them
(batched by shape) and broadcast in the layer's worker group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from kaisa_ray import batching
from kaisa_ray.apply import finite_flags, param_grads
from kaisa_ray.assignment import Assignment
from kaisa_ray.comm import Communicator, unpack_into
from kaisa_ray.eigenbasis import EKFACEigenbasis
from kaisa_ray.kfac_layer import KFACLayer, fold_all
from kaisa_ray.products import matmul_precision
from kaisa_ray.schedule import Schedule
from kaisa_ray.sharding import RowExchange
from kaisa_ray.timing import PhaseTimes


def all_finite(
    active: Sequence[KFACLayer], factors: list[torch.Tensor], rows: RowExchange | None
) -> tuple[bool, bool]:
    """Whether every gradient of ``active`` (over all ranks' rows where FSDP2 leaves each
    rank only some rows of each layer: ``rows``) and whether every one of ``factors`` is
    finite (one wait for the device)."""
    if rows is not None:
        factors_finite = all(finite_flags(factors))
        return rows.grads_finite(), factors_finite
    grads = param_grads(list(active))
    flags = finite_flags(grads + factors)
    return all(flags[: len(grads)]), all(flags[len(grads) :])


def fold_factors(
    layers: Sequence[KFACLayer],
    active: Sequence[KFACLayer],
    rows: RowExchange | None,
    factor_decay: float,
    agree: Callable[[bool], bool] | None = None,
) -> tuple[bool, bool]:
    """Fold this step's (reduced) batch factors, and EKFAC's fitted diagonals in the bases
    this rank holds, into the running averages, unless a factor or a gradient is not finite.
    Returns whether every gradient is finite, and whether the averages skipped this step
    (there were factors, and something was not finite). ``agree`` (deferred factor
    reduction, where each rank folds its own batch factors): every rank's verdict from this
    rank's (``Communicator.agree``), called on every factor step."""
    ready = [(layer, b) for layer in layers if (b := layer.batch_factors()) is not None]
    fitted = [
        (layer.decomposition, s)
        for layer in layers
        if isinstance(layer.decomposition, EKFACEigenbasis)
        and layer.decomposition.s is not None
        and (s := layer.fitted_batch()) is not None
    ]
    factors = [t for _, pair in ready for t in pair] + [s for _, s in fitted]
    grads_finite, factors_finite = all_finite(active, factors, rows)
    folds = grads_finite and factors_finite
    if agree is not None:
        folds = agree(folds)
    if not ready:
        return grads_finite, False
    if not folds:
        return grads_finite, True
    fold_all(ready, factor_decay)
    for decomposition, diagonal in fitted:
        decomposition.fold(diagonal, factor_decay)
    return grads_finite, False


def update_decompositions(
    layers: Sequence[KFACLayer],
    decompose: frozenset[str],
    damping: float,
    *,
    assignment: Assignment,
    rank: int,
    comm: Communicator,
    schedule: Schedule,
    times: PhaseTimes,
) -> None:
    """Each of ``decompose``'s layers' A and G decomposed on their assigned ranks (batched by
    shape, at matmul precision 'highest'), then broadcast in the worker groups as ``schedule``
    (the step's restricted schedule) says; its gradient workers finish the new state."""
    by_name = {layer.name: layer for layer in layers}
    if schedule.options.deferred:
        with times.phase("communication"):
            reduce_averages(by_name, comm, schedule)
    with times.phase("decompositions"), matmul_precision("highest"):
        work: list[tuple[KFACLayer, str, torch.Tensor, float | torch.Tensor]] = []
        for layer in layers:
            if layer.name not in decompose:
                continue
            if assignment.is_grad_worker(layer.name, rank):
                layer.decomposition.leave_basis()
            place = assignment.placements[layer.name]
            if rank not in (place.a_rank, place.g_rank):
                continue
            a, g = layer.factors()
            damp_a, damp_g = layer.factor_dampings(a, g, damping)
            if rank == place.a_rank:
                work.append((layer, "A", a, damp_a))
            if rank == place.g_rank:
                work.append((layer, "G", g, damp_g))
        batching.decompose(work)
        del work

    def get(name: str, part: str) -> torch.Tensor:
        return by_name[name].decomposition.tensors()[part]

    def put(name: str, part: str, flat: torch.Tensor) -> None:
        layer = by_name[name]
        layer.decomposition.set_part(part, flat.view(layer.part_shape(part)).clone())

    with times.phase("communication"):
        comm.broadcast(comm.mine(schedule.decomposition_buckets), get, put)
    with times.phase("decompositions"):
        for layer in layers:
            if layer.name in decompose and assignment.is_grad_worker(layer.name, rank):
                layer.decomposition.finish(damping)


def reduce_averages(by_name: Mapping[str, KFACLayer], comm: Communicator, sched: Schedule) -> None:
    """Deferred factor reduction: the running factors of ``sched``'s factor buckets averaged
    over the ranks in place, so that every rank holds what the reduction of every batch would
    have given it (collective: every rank calls it with the same schedule)."""

    def get(name: str, part: str) -> torch.Tensor | None:
        layer = by_name[name]
        return layer.a_factor if part == "a" else layer.g_factor

    def put(name: str, part: str, flat: torch.Tensor) -> None:
        layer = by_name[name]
        held = get(name, part)
        if held is None:
            shape = layer.factor_shape(part)
            held = torch.empty(shape, dtype=layer.factor_dtype, device=flat.device)
            if part == "a":
                layer.a_factor = held
            else:
                layer.g_factor = held
        unpack_into(held, flat, comm.symmetric)

    comm.reduce_averages(comm.mine(sched.factor_buckets), get, put)
