"""A sweep job and its records, batch by batch, as the service reads them: what the service's
sweep tests share."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kaisa_train.records import LatestMetrics
from kaisa_train.spec import parse_job_spec
from service.domain.interpretation import Reading, interpret
from service.model.job_data import Job
from service.model.lifecycle import JobState, transition

SPACE: dict[str, Any] = {
    "optimizer.lr": {"loguniform": [0.001, 0.1]},
    "kfac.damping": {"uniform": [0.01, 0.3]},
}


def sweep_spec(**sweep: Any) -> dict[str, Any]:
    """A sweep job as the service stores it: validated, every default filled in."""
    body = {
        "name": "swept",
        "model": {"name": "lenet"},
        "dataset": {"name": "synthetic", "batch_size": 8},
        "kfac": {"strategy": "auto"},
        "stop": {"max_steps": 60},
        "sweep": {"space": SPACE, "trials": 3, "concurrent": 2, **sweep},
    }
    return parse_job_spec(body).model_dump(mode="json")


def plain_spec() -> dict[str, Any]:
    spec = sweep_spec()
    del spec["sweep"]
    return parse_job_spec(spec).model_dump(mode="json")


A, B, C = "5a1c2_00000", "5a1c2_00001", "5a1c2_00002"


START: dict[str, Any] = {
    "kind": "sweep-start",
    "trials": 3,
    "concurrent": 2,
    "metric": "test_accuracy",
    "mode": "max",
    "space": SPACE,
}


A_PARAMS: dict[str, Any] = {"optimizer.lr": 0.05, "kfac.damping": 0.1}


B_PARAMS: dict[str, Any] = {"optimizer.lr": 0.002, "kfac.damping": 0.25}


C_PARAMS: dict[str, Any] = {"optimizer.lr": 0.09, "kfac.damping": 0.011}


DIVERGED = "TrainingDivergedError: the training loss is nan at step 3 (lr 0.09)"


FIRST: list[dict[str, Any]] = [
    START,
    {"kind": "trial", "trial": A, "state": "RUNNING", "params": A_PARAMS},
    {"kind": "trial", "trial": B, "state": "RUNNING", "params": B_PARAMS},
    {"kind": "trial", "trial": A, "state": "RUNNING", "step": 20, "test_accuracy": 0.6,
     "test_loss": 1.1, "train_s": 4.0},
    {"kind": "trial", "trial": B, "state": "RUNNING", "step": 20, "test_accuracy": 0.3,
     "test_loss": 2.0, "train_s": 4.2},
]  # fmt: skip


SECOND: list[dict[str, Any]] = [
    {"kind": "trial", "trial": B, "state": "STOPPED"},
    {"kind": "trial", "trial": A, "state": "RUNNING", "step": 60, "test_accuracy": 0.8,
     "test_loss": 0.6, "train_s": 11.5},
    {"kind": "trial", "trial": C, "state": "RUNNING", "params": C_PARAMS},
    {"kind": "trial", "trial": A, "state": "SUCCEEDED"},
    {"kind": "trial", "trial": C, "state": "FAILED", "error": DIVERGED},
]  # fmt: skip


BEST_SPEC: dict[str, Any] = {"name": "swept", "optimizer": {"lr": 0.05}, "kfac": {"damping": 0.1}}


def outcome(trial: str, params: dict[str, float], state: str, **fields: Any) -> dict[str, Any]:
    """A trial as the ``sweep`` record lists it (``TrialOutcome`` as a dict)."""
    return {
        "trial_id": trial,
        "run": f"job-1.{trial}",
        "params": params,
        "state": state,
        "step": None,
        "metrics": {},
        "value": None,
        "error": None,
        "checkpoint": None,
        **fields,
    }


BEST = outcome(
    A,
    A_PARAMS,
    "SUCCEEDED",
    step=60,
    metrics={"step": 60, "test_accuracy": 0.8, "test_loss": 0.6, "train_s": 11.5, "finished": True},
    value=0.8,
    checkpoint="/runs/job-1.5a1c2_00000/checkpoint_000001",
)


RESULT: dict[str, Any] = {
    "kind": "sweep",
    "metric": "test_accuracy",
    "mode": "max",
    "seconds": 42.5,
    "trials": [
        BEST,
        outcome(
            B,
            B_PARAMS,
            "STOPPED",
            step=20,
            metrics={"step": 20, "test_accuracy": 0.3, "test_loss": 2.0, "train_s": 4.2},
            value=0.3,
            checkpoint="/runs/job-1.5a1c2_00001/checkpoint_000000",
        ),
        outcome(C, C_PARAMS, "FAILED", error=DIVERGED),
    ],
    "best": BEST,
    "best_spec": BEST_SPEC,
}


def queued(spec: dict[str, Any] | None = None) -> Job:
    return Job(
        id="job-1",
        name="swept",
        state=JobState.QUEUED,
        spec=spec or sweep_spec(),
        idempotency_key=None,
        submission_id="kaisa-ray-job-1",
        created_at=1.8e9,
        updated_at=1.8e9,
        started_at=None,
        finished_at=None,
        failure_reason=None,
        step=0,
        total_steps=None,
        latest=LatestMetrics(),
        tuner=None,
        sweep=None,
        cursor=0,
        attempts=0,
    )


def numbered(records: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    """Records as the progress sink hands them out: with ``seq`` and ``time``."""
    return [{**r, "seq": first + i, "time": 1.8e9 + first + i} for i, r in enumerate(records)]


def read(job: Job, records: list[dict[str, Any]]) -> tuple[Reading, Job]:
    """``interpret`` one batch, then the job as ``JobStore.add_progress`` stores it."""
    batch = numbered(records, job.cursor)
    reading = interpret(job, batch, job.cursor + len(batch))
    progress = reading.progress
    state = job.state
    for event in progress.events:
        state = transition(state, event)
    stored = replace(
        job,
        state=state,
        cursor=progress.cursor,
        step=job.step if progress.step is None else progress.step,
        total_steps=job.total_steps if progress.total_steps is None else progress.total_steps,
        sweep=job.sweep if progress.sweep is None else progress.sweep,
    )
    return reading, stored
