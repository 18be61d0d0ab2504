"""A plan's ranks priced by class: the slowest rank of 65,536 without pricing each one.

The cost model (``tuner.cost``) prices a strategy on its slowest rank. A rank's seconds per
step come from where it sits in KAISA's grid (``kaisa_ray.plan.Plan``: rank = row · columns +
column):

- decompositions: those placed on the rank itself (at most two ranks per layer: the
  *placed* ranks);
- preconditioning and the decomposition broadcasts: its column's layers;
- the gradient broadcasts: its row's, the same calls in every row, each row's group moved by
  whole rows. The collective pricer costs a group by where its ranks are, and is unchanged
  when every rank moves by a multiple of its ``period`` (a node's GPUs; 1 without a
  topology), so rows ``period / gcd(columns, period)`` apart cost the same: there are at
  most that many classes of rows, fewer once their prices are compared;
- the factor and staleness all-reduces: every rank's.

So every rank that no layer is placed on costs what the lowest rank of its class costs, a class
being (a column that some layer is placed on, or any one column without layers) × (a class of
rows); a placed rank costs that and its decompositions. ``RankClasses`` prices the placed
ranks and each class's lowest rank with the very sums (same terms, same order) the cost model
used to run over every rank, so the slowest rank and its breakdown are exactly those of
pricing all W, ties to the lowest rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kaisa_ray.buckets import Collective
from kaisa_ray.plan import Plan

PARTS = ("factors", "decompositions", "precondition", "communication")
"""The parts of a rank's K-FAC seconds per step, in the order they are summed."""

Pricer = Callable[[str, tuple[int, ...]], Callable[[int], float]]
"""``(op, group)`` -> seconds of one call of that many bytes over that group."""


@dataclass(frozen=True, kw_only=True)
class LayerSeconds:
    """One layer's K-FAC work: decomposing A and G once, preconditioning its gradient."""

    name: str
    a_s: float
    g_s: float
    precondition_s: float


class RankClasses:
    """The per-step seconds of a plan's ranks, one class of ranks at a time (module docstring).

    Args:
        strategy: the plan.
        layers: every layer's work, in the plan's layer order.
        pricer: seconds of a collective by ``(op, group)`` then bytes.
        period: shifting a group by a multiple of this many ranks leaves its price unchanged.
        contention: as ``tuner.cost.Profile.contention``.
    """

    def __init__(
        self,
        strategy: Plan,
        layers: Sequence[LayerSeconds],
        *,
        pricer: Pricer,
        period: int,
        contention: float,
    ) -> None:
        if period < 1:
            raise ValueError(f"period={period} must be at least 1")
        self.plan = strategy
        grid = strategy.assignment
        self.columns, self.rows = grid.columns, grid.grad_workers
        self._pricer = pricer
        self._links: dict[tuple[str, int], tuple[tuple[int, ...], Callable[[int], float]]] = {}

        placed: dict[int, float] = {}  # a placed rank's decompositions, added in layer order
        precondition: dict[int, float] = {}  # a column's preconditioning
        for layer in layers:
            place = grid.placements[layer.name]
            placed[place.a_rank] = placed.get(place.a_rank, 0.0) + layer.a_s
            placed[place.g_rank] = placed.get(place.g_rank, 0.0) + layer.g_s
            column = grid.column_of(layer.name)
            precondition[column] = precondition.get(column, 0.0) + layer.precondition_s
        world = grid.world_size
        self.placed = _uncontended_placed(placed, world, contention)
        self.precondition = _uncontended_columns(precondition, self.columns, self.rows, contention)
        self.decompositions_max = max(
            [*self.placed.values(), *([0.0] if world > len(self.placed) else [])]
        )

        # Classes of rows: rows this many apart are a whole number of periods apart, so cost
        # the same; of the first of them, those whose gradient broadcasts cost the same merge.
        self._apart = period // math.gcd(self.columns, period)
        by_prices: dict[tuple[float, ...], int] = {}
        self.row_class: list[int] = []  # by row number modulo ``_apart``
        self.row_prices: list[list[float]] = []  # by class
        for row in range(min(self.rows, self._apart)):
            # (FSDP2 with fewer workers than ranks: its gathers of the gradient rows too)
            prices = self._prices(strategy.row_gather_calls(row) + strategy.row_calls(row))
            key = tuple(prices)
            if key not in by_prices:
                by_prices[key] = len(self.row_prices)
                self.row_prices.append(prices)
            self.row_class.append(by_prices[key])

        factors = self._prices(strategy.factor_calls)
        # deferred factor reduction: one number on every factor step, the factors (their
        # running averages) on decomposition steps only
        agree = self._prices(strategy.agree_calls)
        batches = [] if strategy.options.deferred else factors
        # FSDP2's gradient rows, every step: COMM-OPT's all-gather, or the clip's sums over
        # the ranks' rows (and, on factor steps, whether they are finite)
        gathers = self._prices(strategy.gather_calls + strategy.clip_calls)
        finite = self._prices(strategy.finite_calls)
        staleness = self._prices(strategy.staleness_calls)
        # Per (column, class of rows): the seconds of communication of a plain step, a
        # factor-update step and an inverse-update step, summed call by call in the order
        # the rank issues them.
        self.communication: dict[tuple[int, int], tuple[float, float, float]] = {}
        for column in strategy.representatives:
            decompositions = self._prices(strategy.column_calls(column))
            every = gathers + self._prices(strategy.column_gather_calls(column))
            for row_class, gradients in enumerate(self.row_prices):
                self.communication[column, row_class] = (
                    sum(every + gradients),
                    sum(agree + batches + every + finite + gradients),
                    sum(agree + factors + every + finite + decompositions + gradients + staleness),
                )
        self.candidates = self._lowest_of_each_class()

    def _prices(self, calls: Sequence[Collective]) -> list[float]:
        """Seconds of each call, each group's link found once (a group is one tuple per
        plan, priced by identity: hashing 65,536 ranks per call was most of a plan's time)."""
        prices = []
        for call in calls:
            if call.op == "all_gather":
                # A ring all-gather of every rank's share is the second half of a ring
                # all-reduce of all the shares: priced as half of that, on the same link.
                reduce = self._link("all_reduce", call.group)
                prices.append(reduce(call.nbytes * len(call.group)) / 2)
            elif call.op in ("gather", "scatter"):
                # every other member's share into (or out of) one rank: its link carries them
                # all, priced as a broadcast of as many bytes
                link = self._link("broadcast", call.group)
                prices.append(link(call.nbytes * (len(call.group) - 1)))
            else:
                prices.append(self._link(call.op, call.group)(call.nbytes))
        return prices

    def _link(self, op: str, group: tuple[int, ...]) -> Callable[[int], float]:
        key = (op, id(group))
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = (group, self._pricer(op, group))
        return link[1]

    def class_of_row(self, row: int) -> int:
        return self.row_class[row % self._apart]

    def _lowest_of_each_class(self) -> list[tuple[int, int, int]]:
        """``(rank, column, row class)`` of every placed rank and of the lowest rank of every
        (representative column, class of rows), by rank. A placed rank costs no less than the
        others of its column and class of rows (decompositions only add), so when it is the
        lowest of them, none of the others can be the slowest rank."""
        first_row: dict[int, int] = {}
        for row, row_class in enumerate(self.row_class):
            first_row.setdefault(row_class, row)
        found = {
            (row * self.columns + column, column, row_class)
            for column in self.plan.representatives
            for row_class, row in first_row.items()
        }
        for rank in self.placed:
            row, column = divmod(rank, self.columns)
            found.add((rank, column, self.class_of_row(row)))
        return sorted(found)

    def slowest(
        self, *, step_s: float, factor_s: float, fus: int, ius: int
    ) -> tuple[float, dict[str, float]]:
        """The slowest rank's seconds per step and their parts, at intervals ``fus``/``ius``
        (the lowest such rank's, as a pass over every rank finds it)."""
        worst: tuple[float, tuple[float, float, float, float]] | None = None
        factors = factor_s / fus
        for rank, column, row_class in self.candidates:
            plain, factor, inverse = self.communication[column, row_class]
            parts = (
                factors,
                self.placed.get(rank, 0.0) / ius,
                self.precondition.get(column, 0.0),
                plain + (factor - plain) / fus + (inverse - factor) / ius,
            )
            total = step_s + sum(parts)  # as the parts' dict summed
            if worst is None or total > worst[0]:
                worst = (total, parts)
        if worst is None:
            raise ValueError("a plan has at least one rank")
        return worst[0], dict(zip(PARTS, worst[1], strict=True))

    def communication_max(self) -> tuple[float, float, float]:
        """The most seconds any rank spends in the collectives of a plain step, and in the
        extra ones of a factor-update step and of an inverse-update step (each from 0)."""
        plain = factor = inverse = 0.0
        for p, f, i in self.communication.values():
            plain, factor, inverse = max(plain, p), max(factor, f - p), max(inverse, i - f)
        return plain, factor, inverse


def _scale(total: float, count: int, busiest: float, contention: float) -> float | None:
    """``tuner.cost``'s repricing of work that only some ranks do; None: left as it is."""
    if contention <= 1.0 or busiest <= 0.0:
        return None
    busy = total / (count * busiest)  # 1 when every rank does as much as the busiest
    return (1.0 + (contention - 1.0) * busy) / contention


def _uncontended_placed(
    placed: dict[int, float], world: int, contention: float
) -> dict[int, float]:
    """The placed ranks' decompositions, repriced for contention as a list of every rank's
    would be (the others' are 0: they add nothing to the sum, in rank order)."""
    ordered = sorted(placed.items())
    busiest = max([s for _, s in ordered] + ([0.0] if world > len(ordered) else []), default=0.0)
    scale = _scale(sum(s for _, s in ordered), world, busiest, contention)
    if scale is None:
        return dict(ordered)
    return {rank: seconds * scale for rank, seconds in ordered}


def _uncontended_columns(
    by_column: dict[int, float], columns: int, rows: int, contention: float
) -> dict[int, float]:
    """Every column's ranks' preconditioning, repriced for contention as a list of every
    rank's would be (rank order: row after row of the columns)."""
    if contention <= 1.0 or not by_column:
        return dict(by_column)
    row = [0.0] * columns
    for column, seconds in by_column.items():
        row[column] = seconds
    scale = _scale(sum(row * rows), columns * rows, max(row), contention)
    if scale is None:
        return dict(by_column)
    return {column: seconds * scale for column, seconds in by_column.items()}
