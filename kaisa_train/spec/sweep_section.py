"""DOC_sweep"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    model_validator,
)

from kaisa_train.records import Direction, SweepMetric
from kaisa_train.spec.bounds import Big, Seed, Steps, StrictModel

_End = Annotated[float, Field(ge=-Big, le=Big)]


_IntEnd = Annotated[int, Field(ge=-(2**31), le=2**31)]


class Distribution(StrictModel):
    """Where a sweep draws one field from: exactly one of ``loguniform: [low, high]``,
    ``uniform: [low, high]``, ``randint: [low, high]`` (integers, both ends included) or
    ``choice: [v1, v2, ...]``."""

    loguniform: tuple[_End, _End] | None = None
    uniform: tuple[_End, _End] | None = None
    randint: tuple[_IntEnd, _IntEnd] | None = None
    choice: Annotated[list[_IntEnd | _End], Field(min_length=1, max_length=64)] | None = None

    @model_validator(mode="after")
    def _one_nonempty_range(self) -> Distribution:
        given = [name for name in DISTRIBUTIONS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of {', '.join(DISTRIBUTIONS)} (got "
                f"{', '.join(given) or 'none'}), e.g. {{loguniform: [0.001, 0.1]}}"
            )
        if self.kind != "choice":
            low, high = getattr(self, self.kind)  # as written: [low, high]
            if low > high:
                raise ValueError(
                    f"the range [{low:g}, {high:g}] of {self.kind} is reversed: write it as "
                    f"[low, high], [{high:g}, {low:g}]"
                )
            if not low < high:
                raise ValueError(
                    f"the range [{low:g}, {high:g}] of {self.kind} is empty: its low end must be "
                    "below its high end (for one value, leave the field out of the sweep)"
                )
            if self.kind == "loguniform" and low <= 0:
                raise ValueError(f"loguniform needs a positive low end, got {low:g}")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in DISTRIBUTIONS if getattr(self, name) is not None)

    @property
    def ends(self) -> tuple[float, float]:
        """The range's low and high end (a choice's smallest and largest value)."""
        values = getattr(self, self.kind)
        return (min(values), max(values))

    def extremes(self) -> list[int | float]:
        """The values a trial can take at the edges: every choice, or the two ends."""
        return list(self.choice) if self.choice is not None else list(self.ends)


DISTRIBUTIONS = ("loguniform", "uniform", "randint", "choice")


class AshaSpec(StrictModel):
    """ASHA's rungs: the first at ``grace_steps`` (default: an eighth of the stop's steps, at
    least ``eval_every``), each next one ``reduction_factor`` times further; at each rung a trial
    continues only if it is in the best 1/``reduction_factor`` of the trials that reached it."""

    grace_steps: Steps | None = None
    reduction_factor: Annotated[float, Field(gt=1, le=100)] = 2


class SweepSpec(StrictModel):
    """A hyperparameter sweep over the job's own fields, run on Ray Tune.

    ``space`` maps dotted fields of the job (``optimizer.lr``, ``kfac.damping``,
    ``kfac.kl_clip``, ``kfac.factor_decay``, any numeric field) to a ``Distribution``. Each of
    ``trials`` trials trains the job with one draw (``concurrent`` at once). ``metric``: the
    final ``test_accuracy`` (max), ``test_loss`` (min) or ``time_to_target`` (min: training
    seconds until ``stop.target`` is met; a trial that never meets it ranks last). With
    ``scheduler: asha`` weak trials stop early, judged at each evaluation on the test metric.
    """

    space: Annotated[
        dict[Annotated[str, Field(max_length=128)], Distribution],
        Field(min_length=1, max_length=32),
    ]
    metric: SweepMetric = SweepMetric.TEST_ACCURACY
    mode: Direction | None = None
    trials: Annotated[int, Field(gt=0, le=1024)] = 8
    concurrent: Annotated[int, Field(gt=0, le=64)] = 1
    scheduler: Literal["asha", "none"] = "asha"
    asha: AshaSpec = AshaSpec()
    seed: Seed = 0

    @property
    def direction(self) -> Direction:
        """``mode``, or the metric's own (``SweepMetric.direction``)."""
        return self.mode or self.metric.direction
