"""KAISA's work assignment: which ranks hold and compute each layer's second-order state.

A pure function of layer shapes and the strategy; no process group needed. With world size
``W`` and gradient worker fraction ``f``, ``n = f·W`` ranks (a divisor of W) precondition each
layer. Ranks form a grid of ``n`` rows by ``W/n`` columns, numbered row by row:

- a **gradient-worker group** is a column: ``{j, j + W/n, j + 2W/n, ...}`` (n ranks). All ranks
  of the column that a layer is placed on hold its decomposition (computed by one of them and
  broadcast to the rest on inverse-update steps) and precondition its gradient;
- a **receiver group** is a row: ``{i·W/n, ..., (i+1)·W/n − 1}`` (W/n ranks). Each row holds
  exactly one worker of every layer, which broadcasts the preconditioned gradient to the row
  every step.

COMM-OPT (f = 1) is one column of all ranks and rows of one rank (no gradient broadcast);
MEM-OPT (f = 1/W) is W columns of one rank and one row of all ranks. Layers go to columns
and their factors to ranks by greedy load balancing, biggest first, with cost ``n³`` per
factor for ``'compute'`` and ``n²`` for ``'memory'`` (times the number of groups).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from kaisa_ray.enums import AssignmentStrategy

if TYPE_CHECKING:
    import torch

DType: TypeAlias = "torch.dtype | str"
"""A layer's state dtype: torch's (what the preconditioner registers) or its name, e.g.
``'float32'`` (what the planner reads from stored shapes, without importing torch)."""

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def itemsize(dtype: DType) -> int:
    """Bytes per element of ``dtype`` (a torch dtype or a name in ``ITEMSIZE``)."""
    if isinstance(dtype, str):
        try:
            return ITEMSIZE[dtype]
        except KeyError:
            raise ValueError(f"dtype {dtype!r}: name one of {', '.join(ITEMSIZE)}") from None
    return int(dtype.itemsize)


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """What the assignment and the plan need to know about a layer."""

    name: str
    a_dim: int
    g_dim: int
    groups: int = 1
    # A is diagonal (an embedding's): held as its diagonal, decomposed from it, its basis the
    # identity (``kaisa_ray.decomposition``), so no dense solver and no A-side product prices
    # it, and its factor and decomposition are ``a_dim`` elements a group, not ``a_dim²``
    diagonal_a: bool = False

    def __post_init__(self) -> None:
        if min(self.a_dim, self.g_dim, self.groups) < 1:
            raise ValueError(f"layer {self.name!r}: dimensions must be positive, got {self}")

    def cost(self, part: str, strategy: AssignmentStrategy) -> int:
        """The weight of factor ``part`` ('a' or 'g') in balancing the assignment: its
        decomposition's work (cubic in its width) or its size (quadratic); a diagonal A's
        both linear."""
        if part == "a" and self.diagonal_a:
            return self.groups * self.a_dim
        dim = self.a_dim if part == "a" else self.g_dim
        return self.groups * dim ** (3 if strategy is AssignmentStrategy.COMPUTE else 2)

    @property
    def largest_solve(self) -> int:
        """The width of the layer's largest dense decomposition (a diagonal A needs none)."""
        return self.g_dim if self.diagonal_a else max(self.a_dim, self.g_dim)

    @property
    def factor_elements(self) -> int:
        """Elements of the two factors as held (a diagonal A: its diagonal)."""
        a = self.a_dim if self.diagonal_a else self.a_dim**2
        return self.groups * (a + self.g_dim**2)


@dataclass(frozen=True, kw_only=True)
class PlannedLayer(LayerShape):
    """A layer's shape plus the dtypes of its state."""

    factor_dtype: DType = "float32"
    inv_dtype: DType = "float32"
    grad_dtype: DType = "float32"


@dataclass(frozen=True, kw_only=True)
class LayerPlacement:
    """Where one layer's work happens."""

    a_rank: int  # computes the A decomposition
    g_rank: int  # computes the G decomposition
    workers: tuple[int, ...]  # the gradient-worker group (a column of the grid)


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """The grid and every layer's placement; the same on every rank."""

    world_size: int
    grad_workers: int
    placements: dict[str, LayerPlacement] = field(default_factory=dict)

    @property
    def columns(self) -> int:
        return self.world_size // self.grad_workers

    def worker_groups(self) -> list[tuple[int, ...]]:
        """The gradient-worker groups (columns), in creation order."""
        c = self.columns
        return [tuple(range(j, self.world_size, c)) for j in range(c)]

    def receiver_groups(self) -> list[tuple[int, ...]]:
        """The receiver groups (rows), in creation order."""
        c = self.columns
        return [tuple(range(i * c, (i + 1) * c)) for i in range(self.grad_workers)]

    def receiver_group_of(self, rank: int) -> tuple[int, ...]:
        c = self.columns
        row = rank // c
        return tuple(range(row * c, (row + 1) * c))

    def column_of(self, name: str) -> int:
        """The column (gradient-worker group) ``name`` is placed on: its index in
        ``worker_groups()``, which is also its lowest rank."""
        return self.placements[name].workers[0] % self.columns

    def is_grad_worker(self, name: str, rank: int) -> bool:
        return rank in self.placements[name].workers

    def grad_source(self, name: str, rank: int) -> int:
        """The worker of ``name`` in ``rank``'s receiver group (row)."""
        (source,) = set(self.placements[name].workers) & set(self.receiver_group_of(rank))
        return source

    @property
    def broadcasts_decompositions(self) -> bool:
        return self.grad_workers > 1

    @property
    def broadcasts_gradients(self) -> bool:
        return self.columns > 1


def assign(
    layers: list[LayerShape],
    *,
    world_size: int,
    grad_workers: int,
    strategy: AssignmentStrategy = AssignmentStrategy.COMPUTE,
    colocate_factors: bool = True,
) -> Assignment:
    """Greedy load balancing of decomposition work over the grid.

    Layers are taken biggest first (ties in the given order). Each goes to the column with
    the least load so far; within it, its factors go to the least-loaded ranks (both to one
    rank with ``colocate_factors``), ties broken by the lowest rank.

    Raises:
        ValueError: if ``grad_workers`` does not divide ``world_size`` or a name repeats.
    """
    if world_size < 1 or grad_workers < 1 or world_size % grad_workers != 0:
        raise ValueError(
            f"grad_workers={grad_workers} must be a positive divisor of world_size={world_size}"
        )
    names = [layer.name for layer in layers]
    if len(set(names)) != len(names):
        raise ValueError(f"layer names must be unique, got {names}")
    columns = world_size // grad_workers
    built: dict[int, tuple[int, ...]] = {}  # the columns given a layer, each built once
    loaded_columns = _LeastLoaded(first=0, count=columns, step=1)
    loaded_ranks: dict[int, _LeastLoaded] = {}
    order = sorted(
        range(len(layers)),
        key=lambda i: -(layers[i].cost("a", strategy) + layers[i].cost("g", strategy)),
    )
    placements: dict[str, LayerPlacement] = {}
    for index in order:
        layer = layers[index]
        a_cost = layer.cost("a", strategy)
        g_cost = layer.cost("g", strategy)
        column = loaded_columns.add(a_cost + g_cost)
        members = built.get(column)
        if members is None:
            members = built[column] = tuple(range(column, world_size, columns))
        ranks = loaded_ranks.get(column)
        if ranks is None:
            ranks = loaded_ranks[column] = _LeastLoaded(
                first=column, count=grad_workers, step=columns
            )
        if colocate_factors:
            a_rank = g_rank = ranks.add(a_cost + g_cost)
        else:
            a_rank = ranks.add(a_cost)
            g_rank = ranks.add(g_cost)
        placements[layer.name] = LayerPlacement(a_rank=a_rank, g_rank=g_rank, workers=members)
    return Assignment(
        world_size=world_size,
        grad_workers=grad_workers,
        placements={name: placements[name] for name in names},
    )


class _LeastLoaded:
    """The least-loaded of ``count`` slots ``first, first + step, ...`` (columns, or the ranks
    of a column), ties to the lowest: ``min(slots, key=lambda s: (load[s], s))`` in
    O(log loaded) rather than O(count). Every slot starts at load 0 and loads only grow, so
    the unloaded slots are those from the next fresh one on; the loaded ones are in a heap."""

    def __init__(self, *, first: int, count: int, step: int) -> None:
        self._first, self._count, self._step = first, count, step
        self._fresh = 0  # slots from this index on have load 0
        self._heap: list[tuple[int, int]] = []  # (load, slot) of the loaded slots

    def add(self, cost: int) -> int:
        """Add ``cost`` to the least-loaded slot; return that slot."""
        if self._fresh < self._count:
            fresh = (0, self._first + self._fresh * self._step)
            if not self._heap or fresh < self._heap[0]:
                self._fresh += 1
                heapq.heappush(self._heap, (cost, fresh[1]))
                return fresh[1]
        load, slot = self._heap[0]
        heapq.heapreplace(self._heap, (load + cost, slot))
        return slot
