"""Collectives of the KAISA strategies, executing ``plan.Schedule`` on torch.distributed.

Works on whatever process group is current (gloo on CPU, NCCL on GPU). Every rank creates
every subgroup, in the same order, at construction (a torch.distributed requirement). The
factor all-reduce uses its own group over all ranks so that its asynchronous calls, launched
from backward hooks, never interleave with DDP's gradient all-reduces on the default group.

Buckets launch strictly in schedule order, each as soon as all its layers' batch factors are
final, so every rank issues the same calls in the same order even if hooks fire differently.
With per-layer intervals a step's factor and decomposition buckets are those of the layers that
update on it (``Schedule.restricted``): ``use_factor_buckets`` sets them before the step's
forward pass, and ``broadcast`` takes the step's decomposition buckets.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from kaisa_ray.assignment import DType
from kaisa_ray.buckets import Bucket
from kaisa_ray.schedule import Schedule

logger = logging.getLogger(__name__)


def torch_dtype(dtype: DType) -> torch.dtype:
    """A plan's dtype as torch's (plans name it, e.g. ``'float64'``, where no torch was loaded)."""
    if isinstance(dtype, str):
        found = getattr(torch, dtype)
        assert isinstance(found, torch.dtype), dtype
        return found
    return dtype


@functools.cache
def _triu(dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = torch.triu_indices(dim, dim, device=device)
    return rows, cols


def pack(tensor: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """Flatten a ``(k, n, n)`` factor; with ``symmetric`` only its upper triangle (a diagonal
    factor held as its diagonal ``(k, n)``: flattened as it is)."""
    if not symmetric or tensor.dim() < 3:
        return tensor.reshape(-1)
    rows, cols = _triu(tensor.shape[-1], tensor.device)
    return tensor[..., rows, cols].reshape(-1)


def unpack_into(out: torch.Tensor, flat: torch.Tensor, symmetric: bool) -> None:
    """Inverse of ``pack``: write ``flat`` into ``out`` (``(k, n, n)``, or a diagonal
    ``(k, n)``), mirroring if needed."""
    if not symmetric or out.dim() < 3:
        out.copy_(flat.view_as(out))
        return
    rows, cols = _triu(out.shape[-1], out.device)
    values = flat.view(out.shape[0], -1)
    out[..., rows, cols] = values
    out[..., cols, rows] = values


# How long to wait for a process group's thread to let go of a finished collective's buffer
# before going on without it (it takes microseconds; a stalled thread must not stall training).
RELEASE_TIMEOUT_S = 0.2

InFlight = list[tuple[Bucket, torch.Tensor, dist.Work | None]]

# A layer's batch part to reduce ('a', 'g', or EKFAC's diagonal 's'), None if it has none.
BatchPart = Callable[[str, str], torch.Tensor | None]


def _holders(tensor: torch.Tensor) -> int:
    """References to ``tensor``'s C++ object (this Python tensor is one, each view another, and
    each unfinished or not yet dropped collective's work holds more); 1 where this torch does
    not say (``Tensor._use_count`` is torch's own, for tests): then nothing is waited for."""
    count = getattr(tensor, "_use_count", None)
    return int(count()) if count is not None else 1


def released(buffer: torch.Tensor, timeout: float = RELEASE_TIMEOUT_S) -> bool:
    """Wait until only the caller holds ``buffer`` (a CPU tensor with no views); ``False`` if
    ``timeout`` passed first.

    gloo's worker thread marks a collective complete (``wait()`` returns) and drops its own
    reference to the work, and with it to the work's tensors, a moment later. A buffer the
    caller lets go of in between is freed by that thread whenever it runs again, so whether
    the buffer is still allocated when the step reaches its peak would depend on thread
    timing (on a loaded machine, for milliseconds: the peak then holds one more buffer, and a
    memory budget set from a measured peak can be crossed). Waiting for the reference to go
    makes every buffer free where the code lets go of it, so a step's peak is the same on
    every run. (CUDA tensors are not waited for: the caching allocator's peak is the device's
    concern, and NCCL's watchdog thread holds works for much longer.)
    """
    if buffer.device.type != "cpu" or _holders(buffer) <= 1:
        return True
    deadline = time.monotonic() + timeout
    pause = 0.0
    while _holders(buffer) > 1:
        if time.monotonic() > deadline:
            logger.warning(
                "a finished collective's buffer of %d bytes is still held elsewhere after "
                "%.2f s; going on (a step's peak memory may hold it for longer)",
                buffer.nbytes,
                timeout,
            )
            return False
        time.sleep(pause)  # lets the process group's thread run
        pause = min(max(pause * 2, 1e-5), 1e-3)
    return True


def completed(in_flight: InFlight) -> Iterator[tuple[Bucket, torch.Tensor]]:
    """Each collective of ``in_flight`` in order, once finished and its buffer released by
    the process group (``released``); empties the list as it goes, so that no reference to
    a work is left behind."""
    in_flight.reverse()
    while in_flight:
        bucket, buffer, work = in_flight.pop()
        if work is not None:
            work.wait()
        del work  # the last handle here: the process group's thread may still hold one
        released(buffer)
        yield bucket, buffer


class Communicator:
    """Runs one rank's part of a schedule."""

    def __init__(
        self, sched: Schedule, rank: int, *, symmetric: bool, device: torch.device
    ) -> None:
        self.schedule = sched
        self.device = device
        self.rank = rank
        self.world_size = sched.assignment.world_size
        self.symmetric = symmetric
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        if self.world_size > 1:
            wanted: list[tuple[int, ...]] = [tuple(range(self.world_size))]
            if sched.assignment.broadcasts_decompositions:
                wanted += sched.assignment.worker_groups()
            if sched.assignment.broadcasts_gradients:
                wanted += sched.assignment.receiver_groups()
            for group in wanted:  # same order on every rank
                if len(group) > 1 and group not in self._groups:
                    self._groups[group] = dist.new_group(list(group))
        # This rank's part of each schedule, filtered once rather than every step (by the
        # identity of the buckets' tuple, kept alive here).
        self._mine: dict[int, tuple[tuple[Bucket, ...], list[Bucket]]] = {}
        self._factor_buckets = self.mine(sched.factor_buckets)
        self._agree_buckets = self.mine(sched.agree_buckets)
        self.decomposition_buckets = self.mine(sched.decomposition_buckets)
        self.gradient_buckets = self.mine(sched.gradient_buckets)
        self.staleness_buckets = self.mine(sched.staleness_buckets)
        self._ready: set[str] = set()
        self._launched: InFlight = []
        self._next = 0

    def group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        return self._groups[ranks]

    def mine(self, buckets: tuple[Bucket, ...]) -> list[Bucket]:
        """The buckets this rank takes part in, in order (filtered once per tuple)."""
        found = self._mine.get(id(buckets))
        if found is None or found[0] is not buckets:
            found = (buckets, [b for b in buckets if self.rank in b.members])
            self._mine[id(buckets)] = found
        return found[1]

    def use_factor_buckets(self, sched: Schedule) -> None:
        """The factor buckets of the coming step (before its forward pass); with deferred
        factor reduction, none (its factors are reduced when decomposed), and the agreement
        to fold where the step folds factors."""
        self._factor_buckets = self.mine(sched.factor_buckets)
        self._agree_buckets = self.mine(sched.agree_buckets)

    # -- deferred factor reduction ---------------------------------------------------------

    def agree(self, folds: bool) -> bool:
        """Whether every rank folds this step's batch factors (``folds``: this rank's batch
        factors and gradients are finite): one all-reduce of the count, so that the ranks'
        running averages skip the same steps. This rank's answer where it has no agreement
        to take part in (one rank, or factors reduced every update)."""
        if not self._agree_buckets:
            return folds
        (bucket,) = self._agree_buckets
        count = torch.tensor([1.0 if folds else 0.0], dtype=torch.float64, device=self.device)
        in_flight: InFlight = [
            (bucket, count, dist.all_reduce(count, group=self.group(bucket.group), async_op=True))
        ]
        for _ in completed(in_flight):
            pass
        return bool(count.item() == len(bucket.group))

    def reduce_averages(
        self,
        buckets: Sequence[Bucket],
        get: Callable[[str, str], torch.Tensor | None],
        put: Callable[[str, str, torch.Tensor], None],
    ) -> None:
        """Average the running factors of ``buckets``' layers over their ranks (deferred
        factor reduction, before a decomposition): ``get`` gives a layer's 'a' or 'g' (None:
        zeros), ``put`` takes the average, unpacked."""
        in_flight: InFlight = []
        for bucket in buckets:
            dtype = torch_dtype(bucket.dtype)
            parts = []
            for piece in bucket.pieces:
                value = get(piece.layer, piece.part)
                if value is None:
                    parts.append(torch.zeros(piece.numel, dtype=dtype, device=self.device))
                else:
                    parts.append(pack(value, self.symmetric))
            flat = torch.cat([p.to(dtype) for p in parts])
            work = dist.all_reduce(flat, group=self.group(bucket.group), async_op=True)
            in_flight.append((bucket, flat, work))
            del work
        for bucket, flat in completed(in_flight):
            flat.div_(len(bucket.group))
            offset = 0
            for piece in bucket.pieces:
                put(piece.layer, piece.part, flat[offset : offset + piece.numel])
                offset += piece.numel

    # -- factor all-reduce -----------------------------------------------------------------

    def reset(self) -> None:
        self._ready.clear()
        self._launched.clear()
        self._next = 0

    def factor_ready(self, layer: str, batch: BatchPart) -> None:
        """Note that ``layer``'s batch factors are final; launch every complete bucket."""
        if self.world_size == 1:
            return
        self._ready.add(layer)
        self._launch(batch, force=False)

    def _launch(self, batch: BatchPart, *, force: bool) -> None:
        while self._next < len(self._factor_buckets):
            bucket = self._factor_buckets[self._next]
            if not force and any(p.layer not in self._ready for p in bucket.pieces):
                return
            parts = []
            dtype = torch_dtype(bucket.dtype)
            for piece in bucket.pieces:
                value = batch(piece.layer, piece.part)
                if value is None:  # the layer did not run (or has no bases yet): zeros
                    parts.append(torch.zeros(piece.numel, dtype=dtype, device=self.device))
                else:  # A and G are symmetric, EKFAC's diagonal 's' is not
                    parts.append(pack(value, self.symmetric and piece.part != "s"))
            flat = torch.cat([p.to(dtype) for p in parts])
            work = dist.all_reduce(flat, group=self.group(bucket.group), async_op=True)
            self._launched.append((bucket, flat, work))
            self._next += 1

    def reduce_factors(
        self, batch: BatchPart, store: Callable[[str, str, torch.Tensor], None]
    ) -> None:
        """Finish the all-reduce: launch what is left, wait, and store the rank averages."""
        if self.world_size == 1:
            return
        self._launch(batch, force=True)
        for bucket, flat in completed(self._launched):
            flat.div_(self.world_size)
            offset = 0
            for piece in bucket.pieces:
                store(piece.layer, piece.part, flat[offset : offset + piece.numel])
                offset += piece.numel
        self.reset()

    def reduce_staleness(self, values: torch.Tensor) -> None:
        """Sum ``values`` (the staleness numbers of every layer, in layer order, float64) over
        all ranks, in place: one all-reduce per staleness bucket."""
        offset = 0
        for bucket in self.staleness_buckets:
            part = values[offset : offset + bucket.numel]
            in_flight: InFlight = [
                (bucket, part, dist.all_reduce(part, group=self.group(bucket.group), async_op=True))
            ]
            for _ in completed(in_flight):  # freed where this rank lets go of it, as above
                pass
            offset += bucket.numel

    # -- broadcasts ------------------------------------------------------------------------

    def broadcast(
        self,
        buckets: Sequence[Bucket],
        get: Callable[[str, str], torch.Tensor],
        put: Callable[[str, str, torch.Tensor], None],
    ) -> None:
        """Broadcast each of this rank's ``buckets`` from its source within its group;
        receivers ``put`` the pieces."""
        in_flight: InFlight = []
        for bucket in buckets:
            dtype = torch_dtype(bucket.dtype)
            if bucket.src == self.rank:
                flat = torch.cat(
                    [get(p.layer, p.part).reshape(-1).to(dtype) for p in bucket.pieces]
                )
            else:
                flat = torch.empty(bucket.numel, dtype=dtype, device=self.device)
            if bucket.src is None:
                raise RuntimeError(f"broadcast bucket without a source rank: {bucket}")
            work = dist.broadcast(
                flat, src=bucket.src, group=self.group(bucket.group), async_op=True
            )
            in_flight.append((bucket, flat, work))
            del work
        for bucket, flat in completed(in_flight):
            if bucket.src == self.rank:
                continue
            offset = 0
            for piece in bucket.pieces:
                put(piece.layer, piece.part, flat[offset : offset + piece.numel])
                offset += piece.numel
