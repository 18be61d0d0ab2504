"""Sweep jobs through the API: their plan, trials, best trial and best spec.

The job service's HTTP API (``service.app``) in-process: FastAPI's ``TestClient`` with the
app's lifespan (store on a SQLite file, the follower thread) and ``FakeRunner`` in place of
Ray, so each test scripts what Ray and the progress sink say and watches the API follow."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from support import sweep_data as sweeps
from support.service_app import Service, events

from service.runner import RayJobStatus, submission_id

if TYPE_CHECKING:
    pass

from support.service_app import history

# -- sweep jobs --------------------------------------------------------------------------


def sweep_job(service: Service) -> dict[str, Any]:
    """A submitted sweep of 3 trials, 2 at once, over the learning rate and the damping."""
    return service.submitted(
        "swept",
        kfac={"strategy": "auto"},
        sweep={"space": sweeps.SPACE, "trials": 3, "concurrent": 2},
    )


def sweep_result(job: dict[str, Any]) -> dict[str, Any]:
    """The sweep's last record, its best spec the job's own with the best trial's params."""
    best_spec = {k: v for k, v in job["spec"].items() if k != "sweep"}
    best_spec["optimizer"] = {**best_spec["optimizer"], "lr": 0.05}
    best_spec["kfac"] = {**best_spec["kfac"], "damping": 0.1}
    return {**sweeps.RESULT, "best_spec": best_spec}


def test_a_sweep_job_shows_its_trials_and_best_spec(service: Service) -> None:
    job = sweep_job(service)
    words = shlex.split(service.fake.entrypoints[submission_id(job["id"])])
    assert words[:2] == ["kaisa-ray", "sweep"]
    assert words[words.index("--spec-key") + 1] == f"spec/{job['id']}"
    assert service.fake.submitted[submission_id(job["id"])] == job["spec"]
    assert words[words.index("--run-name") + 1] == job["id"]
    assert "--no-progress" in words
    # Before its first record, the plan from the spec, and no trials.
    planned = service.job(job["id"])["sweep"]
    assert planned == {
        "metric": "test_accuracy",
        "mode": "max",
        "trials_planned": 3,
        "concurrent": 2,
        "space": sweeps.SPACE,
        "trials_ended": 0,
        "trials": [],
        "best": None,
        "best_spec": None,
        "best_spec_yaml": None,
        "seconds": None,
    }

    service.fake.push(job["id"], *sweeps.FIRST)
    running = service.wait(
        job["id"],
        "two trials at step 20",
        lambda j: j["state"] == "RUNNING" and [t["step"] for t in j["sweep"]["trials"]] == [20, 20],
    )
    assert running["progress"] == {"step": 0, "total": 3, "percent": 0.0, "target_met": False}
    assert history(running) == [(None, "QUEUED", "submit"), ("QUEUED", "RUNNING", "run")]
    assert running["sweep"]["trials"] == [
        {
            "trial_id": sweeps.A,
            "state": "RUNNING",
            "params": sweeps.A_PARAMS,
            "step": 20,
            "metrics": {"test_accuracy": 0.6, "test_loss": 1.1, "train_s": 4.0},
            "value": None,
            "error": None,
            "checkpoint": None,
        },
        {
            "trial_id": sweeps.B,
            "state": "RUNNING",
            "params": sweeps.B_PARAMS,
            "step": 20,
            "metrics": {"test_accuracy": 0.3, "test_loss": 2.0, "train_s": 4.2},
            "value": None,
            "error": None,
            "checkpoint": None,
        },
    ]
    assert running["sweep"]["best"] is None

    result = sweep_result(job)
    service.fake.push(job["id"], *sweeps.SECOND, result)
    ended = service.wait(job["id"], "the sweep's result", lambda j: j["sweep"]["best"] is not None)
    assert ended["state"] == "RUNNING"  # until Ray says the Ray Job ended
    assert ended["progress"] == {"step": 3, "total": 3, "percent": 100.0, "target_met": False}
    shown = ended["sweep"]
    assert shown["trials_ended"] == 3
    assert shown["seconds"] == 42.5
    trials = {t["trial_id"]: t for t in shown["trials"]}
    assert [t["trial_id"] for t in shown["trials"]] == [sweeps.A, sweeps.B, sweeps.C]
    assert [t["state"] for t in shown["trials"]] == ["SUCCEEDED", "STOPPED", "FAILED"]
    assert trials[sweeps.C]["error"] == sweeps.DIVERGED
    assert (trials[sweeps.C]["params"], trials[sweeps.C]["value"]) == (sweeps.C_PARAMS, None)
    assert (trials[sweeps.B]["step"], trials[sweeps.B]["value"]) == (20, 0.3)
    assert shown["best"] == {
        "trial_id": sweeps.A,
        "params": sweeps.A_PARAMS,
        "value": 0.8,
        "step": 60,
        "metrics": {"test_accuracy": 0.8, "test_loss": 0.6, "train_s": 11.5},
        "checkpoint": sweeps.BEST["checkpoint"],
        "run": sweeps.BEST["run"],
    }
    assert shown["best_spec"] == result["best_spec"]
    # ... and as the job file the CLI prints (the dashboard shows this text).
    assert yaml.safe_load(shown["best_spec_yaml"]) == result["best_spec"]

    service.fake.finish(job["id"], RayJobStatus.SUCCEEDED)
    done = service.wait_state(job["id"], "SUCCEEDED")
    assert done["sweep"] == shown
    assert done["progress"] == ended["progress"]
    # The best spec is a job of its own: submitted as it is, it trains.
    again = service.client.post("/v1/jobs", json=shown["best_spec"])
    assert again.status_code == 201, again.text
    assert again.json()["spec"]["optimizer"]["lr"] == 0.05
    best_job = service.wait(again.json()["id"], "submitted", lambda j: j["submission_id"])
    assert best_job["sweep"] is None
    assert shlex.split(service.fake.entrypoints[best_job["submission_id"]])[1] == "train"


@pytest.mark.timeout(60)
def test_the_events_of_a_sweep_job_carry_its_trials_and_result(service: Service) -> None:
    job = sweep_job(service)
    result = sweep_result(job)
    received: list[tuple[str, Any]] = []
    with service.client.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
        for kind, data in events(stream.iter_lines()):
            received.append((kind, json.loads(data)))
            if len(received) == 1:  # subscribed: the sweep runs, in two batches, and ends
                service.fake.push(job["id"], *sweeps.FIRST)
                service.wait(job["id"], "running", lambda j: j["state"] == "RUNNING")
                service.fake.push(job["id"], *sweeps.SECOND, result)
                service.fake.finish(job["id"], RayJobStatus.SUCCEEDED)
    others = [(kind, data) for kind, data in received if kind != "state"]
    trial_records = [r for r in [*sweeps.FIRST, *sweeps.SECOND] if r["kind"] == "trial"]
    assert [kind for kind, _ in others] == ["trial"] * len(trial_records) + ["sweep"]
    assert [data for _, data in others[:-1]] == [{**r, "time": 1.8e9} for r in trial_records]
    failed = [data for kind, data in others if kind == "trial" and data["state"] == "FAILED"]
    assert failed == [
        {"kind": "trial", "trial": sweeps.C, "state": "FAILED", "error": sweeps.DIVERGED}
        | {"time": 1.8e9}
    ]
    _, last = others[-1]
    assert last["best"] == sweeps.BEST
    assert last["best_spec"] == result["best_spec"]
    assert [t["trial_id"] for t in last["trials"]] == [sweeps.A, sweeps.B, sweeps.C]
    states = [data["state"] for kind, data in received if kind == "state"]
    assert states[0] == "QUEUED"
    assert states[-1] == "SUCCEEDED"
    assert "RUNNING" in states
    assert received[-1][1]["progress"] == {
        "step": 3,
        "total": 3,
        "percent": 100.0,
        "target_met": False,
    }
