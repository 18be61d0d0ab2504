"""The per-worker entry point that Ray Train runs (``train_worker``), and the train loop.

``train_worker`` is the ``train_loop_per_worker`` of the job's ``TorchTrainer``: its config
holds one ``WorkerConfig`` (``worker_config.py``), which says what the workers do: train the
job (``train``, the loop below), profile it for ``kfac: auto`` (``profile``) or measure
candidate strategies (``measure``). The loop runs on a ``Session`` (``session.py``): a rank
of the Ray Train worker group here, this process alone for ``kaisa-ray example``.

Rank 0 sends the progress records (``kaisa_train.records``): ``worker`` (every rank), ``profiling``,
``tuner``, ``start``, a ``step`` record every ``progress_every`` steps, ``eval`` at every
evaluation and ``end``; Ray Train's controller sends ``checkpoint`` (``trainer.py``).
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from kaisa_ray.enums import EvalMetric
from kaisa_ray.errors import ConfigurationError, KaisaRayError
from kaisa_ray.preconditioner import KFACPreconditioner
from kaisa_ray.quadratic import StepInfo
from kaisa_ray.timing import PHASES
from kaisa_train.ray_logs import quiet_train_reports
from kaisa_train.records import (
    EndRecord,
    EvalRecord,
    IntervalChangeRow,
    IntervalsRecord,
    KFACChoice,
    LayerIntervals,
    MeasuredRecord,
    ProfilingRecord,
    StartRecord,
    StepRecord,
    TunerErrorRecord,
    WorkerRecord,
)
from kaisa_train.session import RaySession, Session
from kaisa_train.shard import evaluate_shard
from kaisa_train.spec import JobSpec, KFACSpec
from kaisa_train.state import restore, snapshot
from kaisa_train.streaming import StreamCounts
from kaisa_train.training import Training
from kaisa_train.worker_config import MeasureConfig, ProfileConfig, TrainConfig

__all__ = ["TrainingDivergedError", "Window", "intervals_record", "train", "train_worker"]


class TrainingDivergedError(KaisaRayError):
    """The training loss stopped being a finite number: the run diverged."""


def train_worker(config: dict[str, Any]) -> None:
    """``train_loop_per_worker``: what ``config["worker"]`` says."""
    quiet_train_reports()
    worker = config["worker"]
    counts = config.get("stream")  # a streamed dataset's (StreamCounts), else None
    if isinstance(worker, ProfileConfig):
        _profile(worker, counts)
    elif isinstance(worker, MeasureConfig):
        _measure(worker, counts)
    elif isinstance(worker, TrainConfig):
        session = RaySession(worker.run, worker.resume_from, counts)
        _announce(session)
        train(worker, session)
    else:
        raise TypeError(f"not a worker configuration: {type(worker).__name__}")


def _announce(session: RaySession) -> None:
    """Before anything slow (data, tuning): the service sees the workers start."""
    import ray

    session.push(
        WorkerRecord(
            rank=session.rank,
            world=session.world,
            pid=os.getpid(),
            device=str(session.device),
            node=ray.get_runtime_context().get_node_id(),
        )
    )


def _build(spec: JobSpec, session: Session, decided: KFACChoice | None = None) -> Training:
    return Training.build(
        spec,
        rank=session.rank,
        world=session.world,
        device=session.device,
        decided=decided,
        stream=session.stream(),
    )


def _profile(config: ProfileConfig, counts: StreamCounts | None = None) -> None:
    """``kfac: auto`` profiles and decides; rank 0 reports the decision (or why nothing
    fits, which the driver raises), and the workers stop."""
    import ray.train

    session = RaySession(config.run, counts=counts)
    try:
        training = _build(config.spec, session)
    except ConfigurationError as error:
        if session.rank == 0:
            session.push(TunerErrorRecord(error=str(error)), wait=True)
        raise
    if session.rank == 0 and training.tuning is not None:
        session.push(training.tuning, wait=True)  # the worker stops next
    ray.train.report({"done": True})


def _measure(config: MeasureConfig, counts: StreamCounts | None = None) -> None:
    """Each candidate's peak memory per worker (from the first round) and median time per
    step (``tuner.profile.measure_candidate``), from the same weights; rank 0 reports them."""
    import ray.train

    from tuner.profile import measure_candidate

    kfac = config.spec.kfac
    if not isinstance(kfac, KFACSpec):
        raise ConfigurationError("measuring a K-FAC strategy needs a job with kfac on")
    session = RaySession(config.run, counts=counts)
    training = _build(config.spec.model_copy(update={"kfac": "off"}), session)
    candidates = config.candidates
    memory: dict[int, int] = {}
    times: dict[int, list[float]] = {i: [] for i in range(len(candidates))}
    steps: dict[int, int] = {}
    for round_, (index, candidate) in itertools.product(
        range(config.rounds), enumerate(candidates)
    ):
        measured = measure_candidate(
            training.net,
            training.optimizer,
            lambda i: training.shard.batch(i + 1),
            nn.functional.cross_entropy,
            training.device,
            grad_worker_fraction=candidate.grad_worker_fraction,
            factor_update_steps=candidate.factor_update_steps,
            inv_update_steps=candidate.inv_update_steps,
            min_steps=config.min_steps,
            count_memory=round_ == 0,
            precision=training.precision,
            kfac_options=kfac.preconditioner_options(),
        )
        if round_ == 0:
            memory[index], steps[index] = measured.memory_bytes, measured.steps
        times[index].append(1000 * measured.step_s)
    if session.rank == 0:  # Ray Train keeps metrics only with checkpoints: the sink has them
        session.push(
            *(
                MeasuredRecord(
                    candidate=candidate,
                    memory_bytes=memory[index],
                    ms_per_step=statistics.median(times[index]),
                    ms_per_step_rounds=times[index],
                    steps=steps[index],
                )
                for index, candidate in enumerate(candidates)
            ),
            wait=True,
        )
    ray.train.report({"done": True})


@dataclass
class Window:
    """Step metrics accumulated between two step records."""

    steps: int = 0
    loss: float = 0.0
    correct: int = 0
    samples: int = 0
    step_s: float = 0.0
    data_s: float = 0.0  # waiting for the batches (a streamed dataset's)
    kfac_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add_kfac(self, seconds: dict[str, float]) -> None:
        for phase, value in seconds.items():
            self.kfac_s[phase] += value

    def record(
        self,
        *,
        step: int,
        epoch: int,
        lr: float,
        world: int,
        quadratic: StepInfo | None = None,
        skipped_rows: int | None = None,
    ) -> StepRecord:
        """The window as a step record; ``quadratic``: the quadratic model's last step, whose
        λ and μ go along (its α is ``lr``)."""
        n = max(self.steps, 1)
        ms = {phase: 1000 * value / n for phase, value in self.kfac_s.items()}
        return StepRecord(
            step=step,
            epoch=epoch,
            loss=self.loss / n,
            accuracy=self.correct / max(self.samples, 1),
            lr=lr,
            samples_per_s=world * self.samples / max(self.step_s, 1e-9),
            ms_per_step=1000 * self.step_s / n,
            data_wait_ms=1000 * self.data_s / n,
            kfac_ms_per_step=1000 * sum(self.kfac_s.values()) / n,
            kfac_factors_ms=ms["factors"],
            kfac_decompositions_ms=ms["decompositions"],
            kfac_precondition_ms=ms["precondition"],
            kfac_communication_ms=ms["communication"],
            kfac_staleness_ms=ms["staleness"],
            damping=None if quadratic is None else quadratic.damping,
            momentum=None if quadratic is None else quadratic.mu,
            skipped_rows=skipped_rows,
        )


def intervals_record(
    preconditioner: KFACPreconditioner | None, step: int
) -> IntervalsRecord | None:
    """Each layer's K-FAC intervals and staleness now, and the changes since the last call
    (every rank drains its changes; rank 0 sends the record). None: staleness not measured."""
    if preconditioner is None or not preconditioner.measures_staleness:
        return None
    changes = [
        IntervalChangeRow(
            step=c.step,
            layer=c.layer,
            before=c.before,
            after=c.after,
            angle=c.angle,
            gap=c.gap,
            reason=c.reason,
        )
        for c in preconditioner.interval_changes()
    ]
    layers = [
        LayerIntervals(
            layer=r.layer,
            factor_update_steps=r.factor_update_steps,
            inv_update_steps=r.inv_update_steps,
            change_a=r.change_a,
            change_g=r.change_g,
            measured_step=r.measured_step,
            interval_change_a=r.measured_change_a,
            interval_change_g=r.measured_change_g,
            angle=r.angle,
            reason=r.reason,
        )
        for r in preconditioner.staleness()
    ]
    return IntervalsRecord(
        step=step,
        adaptive=preconditioner.schedule.adaptive_policy,
        layers=layers,
        changes=changes,
    )


def _target_met(spec: JobSpec, test_loss: float, test_accuracy: float) -> bool:
    target = spec.stop.target
    if target is None:
        return False
    if target.metric is EvalMetric.TEST_ACCURACY:
        return test_accuracy >= target.value
    return test_loss <= target.value


def train(config: TrainConfig, session: Session) -> None:
    """Train ``config.spec`` on ``session`` to its stop condition: from its checkpoint if the
    session resumes one, else from scratch (with ``kfac: auto``, after the tuner chose)."""
    spec = config.spec
    state, source = session.resume()
    decided = config.decided
    if state is not None and state.get("kfac_decision") is not None:
        decided = KFACChoice.model_validate(state["kfac_decision"])
    auto = isinstance(spec.kfac, KFACSpec) and spec.kfac.auto
    if auto and decided is None and session.rank == 0:
        session.push(ProfilingRecord())
    training = _build(spec, session, decided)
    if state is None and config.tuning is not None:
        training.tuning = config.tuning
    if state is not None:
        restore(training, state, str(source))
    if session.rank == 0:
        if training.tuning is not None:
            session.push(training.tuning)
        total, at = training.max_steps, training.step
        session.push(
            StartRecord(total_steps=total, from_step=at)
            if source is None
            else StartRecord(total_steps=total, from_step=at, resumed_from=source)
        )
    _loop(training, session, config)
    if session.rank == 0:  # waited for: what rank 0 sent is in the sink when the run ends
        session.push(EndRecord(step=training.step), wait=True)


@dataclass
class Report:
    """What every rank reports to Ray Train after a step that checkpoints or (in a sweep's
    trial) evaluates: Ray Tune's metrics of the trial."""

    step: int
    finished: bool  # the job met its stop condition ("done" is Ray Tune's own key)
    train_s: float  # seconds in training steps since this attempt began
    last_eval: tuple[float, float] | None  # (test loss, test accuracy)
    reached: bool  # the stop target was met

    def metrics(self) -> dict[str, Any]:
        metrics: dict[str, Any] = {
            "step": self.step,
            "finished": self.finished,
            "train_s": self.train_s,
        }
        if self.last_eval is not None:
            loss, accuracy = self.last_eval
            metrics[EvalMetric.TEST_LOSS.value] = loss
            metrics[EvalMetric.TEST_ACCURACY.value] = accuracy
        if self.reached:
            metrics["time_to_target_s"] = self.train_s
        return metrics


def _diverged(training: Training, step: int, loss: float) -> TrainingDivergedError:
    fix = (
        "Raise kfac.min_damping (the floor of the quadratic model's adapted damping, "
        f"now {training.quadratic.min_damping:g}) or kfac.damping (its start), or set "
        "kfac.update: optimizer: the quadratic-model step is for large batches"
        if training.quadratic is not None
        else "Lower optimizer.lr, raise kfac.damping or tighten kfac.kl_clip"
    )
    return TrainingDivergedError(
        f"the training loss is {loss} at step {step} on rank {training.rank}: "
        f"the run diverged. {fix}"
    )


def _train_step(training: Training, criterion: nn.Module, step: int, window: Window) -> float:
    """One optimizer step on the step's batch, added to ``window``; its seconds."""
    tick = time.perf_counter()
    waited = training.shard.waited_s
    x, y = training.shard.batch(step)
    window.data_s += training.shard.waited_s - waited
    x = x.to(training.device, non_blocking=True)
    y = y.to(training.device, non_blocking=True)
    training.optimizer.zero_grad(set_to_none=True)
    with training.precision.autocast():
        logits = training.net(x)
        loss = criterion(logits, y)
    loss_value = float(loss.detach())
    if not math.isfinite(loss_value):
        raise _diverged(training, step, loss_value)
    training.update(loss, x, y)
    if training.preconditioner is not None:
        window.add_kfac(training.preconditioner.times.reset())
    training.step = step
    window.steps += 1
    window.loss += loss_value
    window.correct += int((logits.detach().argmax(dim=1) == y).sum())
    window.samples += y.shape[0]
    took = time.perf_counter() - tick
    window.step_s += took
    return took


def _send_progress(training: Training, session: Session, step: int, window: Window) -> None:
    """The window's step record and, where staleness is measured, the intervals record."""
    if session.rank == 0:
        epoch, _ = training.shard.position(step)
        quadratic = None if training.quadratic is None else training.quadratic.last
        session.push(
            window.record(
                step=step,
                epoch=epoch,
                lr=training.lr,
                world=training.world,
                quadratic=quadratic,
                skipped_rows=training.shard.skipped(),
            )
        )
    intervals = intervals_record(training.preconditioner, step)  # every rank drains its own
    if session.rank == 0 and intervals is not None:
        session.push(intervals)


def _evaluate(
    training: Training, session: Session, step: int, began: float, train_s: float
) -> tuple[float, float]:
    """The test loss and accuracy now (every rank), kept as the best so far and sent."""
    test_loss, test_accuracy = evaluate_shard(
        training.net, training.shard, training.device, precision=training.precision
    )
    training.best[EvalMetric.TEST_ACCURACY.value] = max(
        training.best.get(EvalMetric.TEST_ACCURACY.value, 0.0), test_accuracy
    )
    if session.rank == 0:
        session.push(
            EvalRecord(
                step=step,
                test_loss=test_loss,
                test_accuracy=test_accuracy,
                elapsed_s=time.perf_counter() - began,
                train_s=train_s,
            )
        )
    return test_loss, test_accuracy


def _loop(training: Training, session: Session, config: TrainConfig) -> None:
    """Steps to the stop condition: train, send progress, evaluate, report (with a checkpoint
    when one is due), each a step of its own."""
    spec = training.spec
    criterion = nn.CrossEntropyLoss()
    window = Window()
    began = time.perf_counter()
    train_s = 0.0  # seconds in training steps since this attempt began (no eval, checkpoints)
    last_eval: tuple[float, float] | None = None
    reached = False  # the stop target was met
    training.net.train()
    while training.step < training.max_steps:
        step = training.step + 1
        train_s += _train_step(training, criterion, step, window)

        done = step >= training.max_steps
        if step % config.progress_every == 0 or done:
            _send_progress(training, session, step, window)
            window = Window()

        evaluated = step % spec.eval_every == 0 or done
        if evaluated:
            last_eval = _evaluate(training, session, step, began, train_s)
            if _target_met(spec, *last_eval):
                done = reached = True

        checkpoint_due = done or step % spec.checkpoint.every_steps == 0
        if checkpoint_due or (config.report_evals and evaluated):
            report = Report(
                step=step, finished=done, train_s=train_s, last_eval=last_eval, reached=reached
            )
            keep = checkpoint_due and session.keeps_checkpoints
            session.report(report.metrics(), snapshot(training) if keep else None)
        if done:
            break
