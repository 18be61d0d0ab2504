"""What a preconditioner measured of its curvature's staleness, layer by layer, and the interval
rule applied to it (``measure_staleness=True``; ``kaisa_ray.staleness`` has the arithmetic).

On a factor or decomposition update every rank records each updated layer's factor change since
its last decomposition (the factors are the same on every rank). On a decomposition step the
owner of a layer (the rank that computes its A decomposition) also preconditions its gradient
with the previous decomposition, and after the step compares it with the fresh one; the owners'
numbers are summed over the ranks (one all-reduce, the same readings everywhere) and handed to
the intervals' schedule, which may move layers between rungs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kaisa_ray.intervals import NOT_MEASURED, IntervalChange, IntervalSchedule, Measurement
from kaisa_ray.staleness import VALUES_PER_LAYER, LayerStaleness, angle_degrees
from kaisa_ray.timing import PhaseTimes

if TYPE_CHECKING:
    from kaisa_ray.assignment import Assignment
    from kaisa_ray.comm import Communicator
    from kaisa_ray.kfac_layer import KFACLayer

# The preconditioner's logger: its interval changes are among its log lines, as they were.
logger = logging.getLogger("kaisa_ray.preconditioner")


class StalenessTracker:
    """One preconditioner's staleness readings: per layer, the latest factor change (0-dim
    tensors, read when asked) and the latest decomposition step's measurement; the interval
    changes not yet read."""

    def __init__(
        self,
        layers: Sequence[KFACLayer],
        assignment: Assignment,
        rank: int,
        world_size: int,
        *,
        loglevel: int,
        times: PhaseTimes,
    ) -> None:
        self._layers = list(layers)
        self._by_name = {layer.name: layer for layer in self._layers}
        self._assignment = assignment
        self._rank = rank
        self._world_size = world_size
        self._loglevel = loglevel
        self._times = times
        self._changes_now: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._measured: dict[str, Measurement] = {}
        self._interval_changes: list[IntervalChange] = []

    def owns(self, name: str) -> bool:
        """Whether this rank measures the layer's staleness (it computes its A decomposition)."""
        return self._assignment.placements[name].a_rank == self._rank

    def before_decompositions(
        self,
        updated: frozenset[str],
        decompose: frozenset[str],
        grads_finite: bool,
        damping: float,
        products: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> dict[str, torch.Tensor]:
        """Every rank: each layer's factor change since its last decomposition, for the layers
        whose factors were ``updated`` or that decompose now, and, for the latter, the sketches
        of the factors about to be decomposed. The owner of each decomposing layer: its
        gradient preconditioned with the previous decomposition (returned)."""
        for layer in self._layers:
            if layer.name in updated or layer.name in decompose:
                change = layer.factor_change()
                if change is not None:
                    self._changes_now[layer.name] = change
        stale = {}
        for name in decompose:
            layer = self._by_name[name]
            if (
                grads_finite
                and layer.helper.has_grad()
                and self.owns(name)
                and layer.decomposition.ready
                and layer.sketch_a is not None
            ):
                with products():
                    stale[name] = layer.decomposition.precondition(layer.helper.grad(), damping)
            layer.take_sketches()
        return stale

    def after_decompositions(
        self,
        step: int,
        decompose: frozenset[str],
        stale: Mapping[str, torch.Tensor],
        preconditioned: Mapping[str, torch.Tensor],
        comm: Communicator,
        schedule: IntervalSchedule,
    ) -> None:
        """The decomposing layers' measurements, each from its owner, summed over the ranks
        (one all-reduce: the same numbers everywhere), then the interval rule on them."""
        device = self._layers[0].helper.weight().device
        values = torch.zeros(
            len(self._layers), VALUES_PER_LAYER, dtype=torch.float64, device=device
        )
        missing = torch.tensor(NOT_MEASURED, dtype=torch.float64, device=device)
        rows = []
        for index, layer in enumerate(self._layers):
            name = layer.name
            if name not in decompose or not self.owns(name):
                continue
            moved = self._changes_now.get(name)
            angle = (
                angle_degrees(stale[name], preconditioned[name])
                if name in stale and name in preconditioned
                else missing
            )
            a, g = moved if moved is not None else (missing, missing)
            rows.append((index, torch.stack([a, g, angle])))
        for index, row in rows:
            values[index] = row
        if self._world_size > 1:
            with self._times.phase("communication"):
                comm.reduce_staleness(values.view(-1))
        numbers = values.tolist()
        measured = []
        for index, layer in enumerate(self._layers):
            if layer.name not in decompose:
                continue
            a, g, angle = numbers[index]
            measurement = Measurement(
                layer=layer.name, step=step, change_a=a, change_g=g, angle=angle
            )
            measured.append(measurement)
            self._measured[layer.name] = measurement
            self._changes_now.pop(layer.name, None)  # measured against the new sketches next
        changes = schedule.decide(step, measured)
        for change in changes:
            logger.log(
                self._loglevel,
                "K-FAC step %d: layer %s intervals %d/%d -> %d/%d: %s",
                step,
                change.layer,
                *change.before,
                *change.after,
                change.reason,
            )
        self._interval_changes += changes

    def readings(self, schedule: IntervalSchedule, steps: int) -> list[LayerStaleness]:
        """Each layer's intervals at ``steps``, why, and how stale its curvature was."""
        readings = []
        for layer in self._layers:
            name = layer.name
            rung = schedule.rung_of(name, steps)
            now = self._changes_now.get(name)
            at = self._measured.get(name)
            readings.append(
                LayerStaleness(
                    layer=name,
                    factor_update_steps=rung[0],
                    inv_update_steps=rung[1],
                    change_a=float(now[0]) if now is not None else NOT_MEASURED,
                    change_g=float(now[1]) if now is not None else NOT_MEASURED,
                    measured_step=None if at is None else at.step,
                    measured_change_a=NOT_MEASURED if at is None else at.change_a,
                    measured_change_g=NOT_MEASURED if at is None else at.change_g,
                    angle=NOT_MEASURED if at is None else at.angle,
                    reason=schedule.reason(name),
                )
            )
        return readings

    def interval_changes(self) -> list[IntervalChange]:
        """The layers' moves between rungs since the last call."""
        changes, self._interval_changes = self._interval_changes, []
        return changes

    def clear(self) -> None:
        """Forget the readings (a checkpoint was loaded: its factors are not these)."""
        self._changes_now.clear()
        self._measured.clear()
