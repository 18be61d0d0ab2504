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

from collections.abc import Sequence
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

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def span(self, group: Sequence[int]) -> tuple[int, int]:
        """``(nodes, most ranks on one node)`` of a group."""
        counts: dict[int, int] = {}
        for rank in group:
            node = self.node_of(rank)
            counts[node] = counts.get(node, 0) + 1
        return len(counts), max(counts.values(), default=0)

    def bandwidth(self, op: str, group: Sequence[int]) -> float:
        """Bus bandwidth (bytes/s) a collective over ``group`` gets."""
        nodes, per_node = self.span(group)
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

    def seconds(self, op: str, group: tuple[int, ...], nbytes: int) -> float:
        """Seconds of one ``op`` (``all_reduce`` or ``broadcast``) of ``nbytes`` over ``group``."""
        p = len(group)
        if p <= 1 or nbytes <= 0:
            return 0.0
        key = (op, group, nbytes)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        nodes, _ = self.span(group)
        level = self.intra_node if nodes <= 1 else self.inter_node
        on_bus = 2.0 * (p - 1) / p * nbytes if op == "all_reduce" else float(nbytes)
        seconds = level.latency_s.value + on_bus / self.bandwidth(op, group)
        self._cache[key] = seconds
        return seconds
