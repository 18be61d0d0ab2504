"""What a job's workers are told to do: one typed configuration per mode, the
``train_loop_config`` of the job's ``TorchTrainer`` (``{"worker": <config>}``).

- ``TrainConfig``: train the job (the default; also each trial of a sweep);
- ``ProfileConfig``: ``kfac: auto`` profiles on the workers and decides, then they stop;
- ``MeasureConfig``: measure each candidate strategy's memory and time per step.

The workers get the job's ``JobSpec`` as the driver validated it (a frozen model: nothing in
a worker changes it or validates it again).
"""

from __future__ import annotations

from dataclasses import dataclass

from kaisa_train.records import KFACChoice, TunerRecord
from kaisa_train.spec import JobSpec

__all__ = ["MeasureConfig", "ProfileConfig", "TrainConfig", "WorkerConfig"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Train ``spec`` as run ``run``.

    Attributes:
        resume_from: a checkpoint (a path or a URI) to start from.
        progress_every: steps between the step records rank 0 sends.
        report_evals: report every evaluation through ``ray.train.report`` (a sweep's trials,
            whose scheduler judges them by it), not only those with checkpoints.
        decided: what ``kfac: auto`` chose before the job started (``kfac.verify``), and
            ``tuning``, the tuner's record of it.
    """

    spec: JobSpec
    run: str
    resume_from: str | None = None
    progress_every: int = 10
    report_evals: bool = False
    decided: KFACChoice | None = None
    tuning: TunerRecord | None = None

    def __post_init__(self) -> None:
        if self.progress_every < 1:
            raise ValueError(f"progress_every must be at least 1, got {self.progress_every}")
        if (self.decided is None) != (self.tuning is None):
            raise ValueError("decided and tuning come together (the tuner's choice and record)")


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """``kfac: auto``: profile ``spec`` on the workers, decide, report the decision, stop."""

    spec: JobSpec
    run: str


@dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    """Train a few steps with each of ``candidates`` in turn (from the same weights),
    ``rounds`` times interleaved, for about ``min_steps`` steps each."""

    spec: JobSpec
    run: str
    candidates: tuple[KFACChoice, ...]
    min_steps: int = 50
    rounds: int = 1

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("measure at least one candidate")
        if self.min_steps < 1 or self.rounds < 1:
            raise ValueError(
                f"min_steps and rounds must be at least 1, got {self.min_steps}, {self.rounds}"
            )


WorkerConfig = TrainConfig | ProfileConfig | MeasureConfig
