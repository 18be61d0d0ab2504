"""Collectives priced by where their ranks are: inside one node, or across nodes.

Ranks fill nodes in order (rank ``r`` on node ``r // gpus_per_node``), as launchers and Ray's
``PACK`` placement put them. KAISA's grid then decides what each collective spans: the
gradient-worker groups are columns ``{j, j + W/n, ...}`` (stride ``W/n``), so once the stride
reaches the node size every member sits on a different node; the receiver groups are rows of
``W/n`` consecutive ranks, inside one node while ``W/n`` is at most the node size. COMM-OPT's
decomposition broadcasts and MEM-OPT's gradient broadcasts therefore cross nodes at scale,
and a HYBRID fraction of ``1/gpus_per_node`` keeps the per-step gradient broadcast on NVLink.

The time of one call is ``latency + bytes_on_the_bus / bandwidth`` (nccl-tests' model):

- all-reduce over ``p`` ranks moves ``2(p-1)/p · S`` bytes per rank, broadcast ``S``;
- inside a node the bandwidth is the intra-node bus bandwidth;
- across nodes it is the inter-node bus bandwidth of full nodes, scaled by the share of each
  node's GPUs (and so of its network adapters, one per GPU on DGX-class nodes) that the group
  uses, never above the intra-node figure: a column with one rank per node gets one adapter.

Concurrent groups on disjoint GPUs (the columns, the rows) use disjoint links and are priced
independently; the cost model adds up the calls each rank makes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tuner.hardware import Hardware, LinkLevel


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Ranks on nodes of ``gpus_per_node`` GPUs, and the links between them."""

    gpus_per_node: int
    intra_node: LinkLevel
    inter_node: LinkLevel
    _cache: dict[tuple[str, tuple[int, ...], int], float] = field(
        default_factory=dict, compare=False, repr=False
    )
    _spans: dict[tuple[int, ...], tuple[int, int]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must be at least 1")

    @classmethod
    def of(cls, hardware: Hardware, gpus_per_node: int | None = None) -> Topology:
        return cls(
            gpus_per_node=gpus_per_node or hardware.node_size,
            intra_node=hardware.intra_node,
            inter_node=hardware.inter_node,
        )

    @property
    def period(self) -> int:
        """Moving every rank of a group by a multiple of this many ranks (whole nodes) leaves
        the group's price unchanged."""
        return self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def span(self, group: Sequence[int]) -> tuple[int, int]:
        """``(nodes, most ranks on one node)`` of a group."""
        if isinstance(group, tuple):
            found = self._spans.get(group)
            if found is None:
                found = self._spans[group] = self._span(group)
            return found
        return self._span(group)

    def _span(self, group: Sequence[int]) -> tuple[int, int]:
        size, p = self.gpus_per_node, len(group)
        if p > 1 and group[1] > group[0]:
            # Evenly spaced ranks (a row, a column, all of them): by formula, not rank by rank.
            first, step = group[0], group[1] - group[0]
            if tuple(group) == tuple(range(first, first + step * p, step)):
                if step >= size:
                    return p, 1
                if step == 1:
                    last = first + p - 1
                    nodes = last // size - first // size + 1
                    if nodes == 1:
                        return 1, p
                    return nodes, max(
                        size - first % size, last % size + 1, size if nodes > 2 else 0
                    )
        counts: dict[int, int] = {}
        for rank in group:
            node = rank // size
            counts[node] = counts.get(node, 0) + 1
        return len(counts), max(counts.values(), default=0)

    def bandwidth(self, op: str, group: Sequence[int]) -> float:
        """Bus bandwidth (bytes/s) a collective over ``group`` gets."""
        return self._bandwidth(op, *self.span(group))

    def _bandwidth(self, op: str, nodes: int, per_node: int) -> float:
        intra = (
            self.intra_node.allreduce_busbw
            if op == "all_reduce"
            else self.intra_node.broadcast_busbw
        )
        if nodes <= 1:
            return intra.value
        inter = (
            self.inter_node.allreduce_busbw
            if op == "all_reduce"
            else self.inter_node.broadcast_busbw
        )
        share = min(per_node, self.gpus_per_node) / self.gpus_per_node
        return min(inter.value * share, intra.value)

    def pricer(self, op: str, group: tuple[int, ...]) -> Callable[[int], float]:
        """``seconds(op, group, ·)``, the group's link found once: for pricing many calls over
        one group."""
        p = len(group)
        if p <= 1:
            return _free
        nodes, per_node = self.span(group)
        level = self.intra_node if nodes <= 1 else self.inter_node
        return _Link(
            all_reduce=op == "all_reduce",
            ranks=p,
            latency_s=level.latency_s.value,
            bytes_per_s=self._bandwidth(op, nodes, per_node),
        ).seconds

    def seconds(self, op: str, group: tuple[int, ...], nbytes: int) -> float:
        """Seconds of one ``op`` (``all_reduce`` or ``broadcast``) of ``nbytes`` over ``group``."""
        if len(group) <= 1 or nbytes <= 0:
            return 0.0
        key = (op, group, nbytes)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self.pricer(op, group)(nbytes)
        return cached


def _free(nbytes: int) -> float:
    return 0.0


@dataclass(frozen=True, kw_only=True)
class _Link:
    """One group's link: ``latency + bytes_on_the_bus / bandwidth`` (the module docstring)."""

    all_reduce: bool
    ranks: int
    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        p = self.ranks
        on_bus = 2.0 * (p - 1) / p * nbytes if self.all_reduce else float(nbytes)
        return self.latency_s + on_bus / self.bytes_per_s
