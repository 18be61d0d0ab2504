"""The job service end to end: the real ``kaisa-ray serve`` process on the test's Ray head
(as on a cluster), a SQLite file, 2-worker K-FAC jobs and a sweep on real Fashion-MNIST. The
service with
its embedded head, killed and restarted under a running job, is in ``test_dashboard_e2e.py``
(with the browser that watches it)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import takewhile
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ray.job_submission import JobStatus, JobSubmissionClient
from ray.util.state import list_actors
from support.ray_head import RayHead
from support.service_process import ServiceProcess, start_service

from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_train.job import run_job
from kaisa_train.spec import parse_job_spec
from service.client import ServiceClient

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.skipif(
        not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
    ),
]

TOKEN = "e2e-service-token"
YAML_KEY = re.compile(r"[a-z_]+:")  # a top-level line of a job file


def small_job(name: str, steps: int, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "model": {"name": "lenet"},
        "dataset": {"name": "fashion-mnist", "batch_size": 64, "limit": 2048},
        "kfac": {"strategy": "comm-opt", "factor_update_steps": 5, "inv_update_steps": 10},
        "scaling": {"workers": 2},
        "stop": {"max_steps": steps},
        "eval_every": 20,
        "checkpoint": {"every_steps": 20},
        "seed": 1,
    }
    spec.update(overrides)
    return spec


def wait_for(
    check: Callable[[], dict[str, Any] | None], what: str, timeout_s: float = 300
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found is not None:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def state_is(client: ServiceClient, job_id: str, *states: str, min_step: int = 0) -> Any:
    def check() -> dict[str, Any] | None:
        job = client.job(job_id)
        return job if job["state"] in states and job["progress"]["step"] >= min_step else None

    return check


@pytest.fixture(scope="module")
def service(
    ray_head: RayHead, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """The service on the test head (as on a cluster: --ray-address), started once for the
    module's tests (each runs its own jobs on it)."""
    where = tmp_path_factory.mktemp("service-e2e")
    started = start_service(
        where / "service",
        token=TOKEN,
        ray_address=ray_head.gcs_address,
        env={"KAISA_RAY_STORAGE": str(where / "runs")},  # the cluster's shared storage
    )
    try:
        yield started
    finally:
        started.stop()


def _train_workers_alive(head: RayHead, ray_job_id: str) -> int:
    """The live TrainWorker actors of one Ray Job (the workers an actor of a job creates
    belong to that job): other jobs' workers may be alive beside them."""
    # The head's own address: other Ray clusters may run on the machine (a second pytest
    # worker's, another service's), and Ray would not guess which one is meant.
    actors = list_actors(
        address=head.dashboard_url,
        filters=[("state", "=", "ALIVE"), ("job_id", "=", ray_job_id)],
        limit=1000,
    )
    return sum(1 for a in actors if "TrainWorker" in (a.class_name or ""))


def test_two_jobs_side_by_side_one_cancelled_while_it_trains_the_other_followed_to_success(
    service: ServiceProcess, ray_head: RayHead
) -> None:
    """Two jobs in Ray at once on the head's 4 CPUs: one, cancelled once it trains, stops in
    Ray (its Ray Job STOPPED, its train worker gone, the other job's workers not counted);
    the other is followed by its event stream, opened before it started, to SUCCEEDED
    (metrics, log, Ray's own status)."""
    client = service.client()
    job = client.submit(small_job("svc-e2e", 40), idempotency_key="e2e-once")
    assert job["state"] == "QUEUED"
    again = client.submit(small_job("svc-e2e", 40), idempotency_key="e2e-once")
    assert again["id"] == job["id"]  # a retried POST: the same job, not a second one
    # The stream sends the job's state once subscribed, then what happens from then on (no
    # replay): its first event is read here, the rest in a thread while the other job runs.
    stream = service.client().events(job["id"])  # ends when the job finishes
    first = next(stream)
    # One worker: with its driver 1.25 CPUs, beside the first job's 2.25 within the head's 4
    # (two 2-worker jobs do not fit: the service would queue the second until the first ends).
    endless = client.submit(small_job("svc-cancel", 100_000, scaling={"workers": 1}))
    ray_client = JobSubmissionClient(ray_head.dashboard_url)

    with ThreadPoolExecutor(1) as pool:
        following = pool.submit(list, stream)

        # Cancel the other job once it trains (the first one is in Ray too).
        running = wait_for(
            state_is(client, endless["id"], "RUNNING", min_step=10), "the second job to train"
        )
        ray_job_id = ray_client.get_job_info(running["submission_id"]).job_id
        assert ray_job_id is not None  # its driver runs
        wait_for(
            lambda: {} if _train_workers_alive(ray_head, ray_job_id) == 1 else None,
            "its train worker",
            60,
        )
        cancelling = client.cancel(endless["id"])
        assert cancelling["state"] in ("CANCELLING", "CANCELLED")
        assert client.cancel(endless["id"])["state"] in ("CANCELLING", "CANCELLED")  # idempotent
        done = wait_for(state_is(client, endless["id"], "CANCELLED"), "CANCELLED", timeout_s=60)
        assert [t["to_state"] for t in done["transitions"]][-2:] == ["CANCELLING", "CANCELLED"]
        assert ray_client.get_job_status(done["submission_id"]) == JobStatus.STOPPED
        wait_for(
            lambda: {} if _train_workers_alive(ray_head, ray_job_id) == 0 else None,
            "its train worker to go",
            60,
        )
        step = client.job(endless["id"])["progress"]["step"]
        time.sleep(1)
        assert client.job(endless["id"])["progress"]["step"] == step  # nothing trains any more

        events = [first, *following.result(timeout=300)]

    states = [data["state"] for kind, data in events if kind == "state"]
    assert states[0] in ("QUEUED", "RUNNING")
    assert states[-1] == "SUCCEEDED", events[-1]
    assert "RUNNING" in states
    steps = [data["step"] for kind, data in events if kind == "progress"]
    assert steps == [10, 20, 30, 40]
    evals = [data for kind, data in events if kind == "eval"]
    assert [e["step"] for e in evals] == [20, 40]

    final = client.job(job["id"])
    assert final["state"] == "SUCCEEDED"
    assert final["progress"] == {"step": 40, "total": 40, "percent": 100.0, "target_met": False}
    assert final["metrics"]["test_accuracy"] == pytest.approx(evals[-1]["test_accuracy"])
    assert final["metrics"]["samples_per_s"] > 0
    assert [t["to_state"] for t in final["transitions"]] == ["QUEUED", "RUNNING", "SUCCEEDED"]
    assert final["started_at"] is not None
    assert final["finished_at"] is not None

    history = client.metrics(job["id"])
    step_points = [p for p in history["points"] if p["kind"] == "step"]
    assert [p["step"] for p in step_points] == [10, 20, 30, 40]
    assert step_points[-1]["values"]["loss"] < step_points[0]["values"]["loss"]
    assert [p["step"] for p in history["points"] if p["kind"] == "eval"] == [20, 40]
    assert "finished at step 40" in client.logs(job["id"])

    assert ray_client.get_job_status(final["submission_id"]) == JobStatus.SUCCEEDED
    # Side by side: the cancelled job was in Ray before this one ended.
    first_ended = ray_client.get_job_info(final["submission_id"]).end_time
    cancelled_started = ray_client.get_job_info(done["submission_id"]).start_time
    assert first_ended is not None
    assert cancelled_started is not None
    assert cancelled_started < first_ended
    # (The module's service is shared: the other test's jobs may be there too.)
    listed = client.jobs(["SUCCEEDED"])
    assert job["id"] in [j["id"] for j in listed["jobs"]]
    assert {j["state"] for j in listed["jobs"]} == {"SUCCEEDED"}
    scrape = httpx.get(f"{service.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert f'kaisa_ray_jobs{{state="SUCCEEDED"}} {float(listed["total"])}' in scrape


# With the search seed 2 the trials draw these learning rates, in this order (Ray 2.60's
# BasicVariantGenerator; one trial at a time): 1e4 (it diverges: no KL clip), 0.05, 3e-4 (far
# behind at the first rung: ASHA stops it). The damping is drawn too. ASHA's rungs are at 30
# and 60 steps, and Ray never judges the last (it is the end): one rung, where 3e-4 meets the
# cutoff set by 0.05 alone. (A fourth trial, a second 0.05, once raced the first at a rung at
# 40: which of two near-equal accuracies is higher is a coin toss a test must not depend on.)
SWEEP = {
    "space": {
        "optimizer.lr": {"choice": [0.05, 0.0003, 10000.0]},
        "kfac.damping": {"loguniform": [0.05, 0.3]},
    },
    "trials": 3,
    "concurrent": 1,
    "asha": {"grace_steps": 30, "reduction_factor": 2},
    "seed": 2,
}


@pytest.mark.timeout(900)  # three trials and a run of the best spec: minutes under load
def test_a_sweep_job_stops_weak_trials_survives_a_diverging_one_and_its_best_spec_reproduces(
    service: ServiceProcess, tmp_path: Path
) -> None:
    """A sweep submitted over REST runs ``kaisa-ray sweep`` as its Ray Job. Its view shows
    the plan and every trial live: ASHA stopped the weak trial early, the diverging one
    failed with its reason and the sweep went on; the best trial's checkpoint and spec are
    in the result, the CLI printed the trials and that spec as a job file in the driver's
    log, the service takes it as a job, and training it reproduces the best trial's
    accuracy."""
    client = service.client()
    spec = small_job(
        "svc-sweep",
        60,
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        # No clip: a large lr really diverges. The reference's curvature (a damping-dominated
        # preconditioner) and fixed intervals keep lr 0.05 and 3e-4 far apart at the first rung.
        kfac={
            "strategy": "auto",
            "adapt": False,
            "kl_clip": None,
            "running_average": "identity",
            "factor_scale": "reference",
            "pi_damping": False,
        },
        memory_budget="2GiB",
        scaling={"workers": 1},
        eval_every=10,
        checkpoint={"every_steps": 30, "keep": 2},
        seed=3,
        sweep=SWEEP,
    )
    job = client.submit(spec)
    planned = client.job(job["id"])["sweep"]
    assert planned["trials_planned"] == 3
    assert planned["space"] == SWEEP["space"]

    events = list(client.events(job["id"]))  # ends when the sweep ends
    trial_events = [data for kind, data in events if kind == "trial"]
    assert {e["state"] for e in trial_events} == {"RUNNING", "SUCCEEDED", "STOPPED", "FAILED"}
    assert [kind for kind, _ in events].count("sweep") == 1

    final = client.job(job["id"])
    assert final["state"] == "SUCCEEDED", final["failure_reason"]
    assert final["progress"]["step"] == final["progress"]["total"] == 3  # trials over, of 3
    sweep = final["sweep"]
    assert sweep["trials_ended"] == 3
    by_lr: dict[float, list[dict[str, Any]]] = {}
    for trial in sweep["trials"]:
        by_lr.setdefault(trial["params"]["optimizer.lr"], []).append(trial)
    # The diverging trial failed with its reason; the sweep went on.
    (diverged,) = by_lr[10000.0]
    assert diverged["state"] == "FAILED"
    assert "TrainingDivergedError" in diverged["error"]
    # ASHA stopped the slow one at its first rung.
    (slow,) = by_lr[0.0003]
    assert slow["state"] == "STOPPED"
    assert slow["step"] < 60
    # The other trained to the end, and is the sweep's best.
    finished = by_lr[0.05]
    assert [t["state"] for t in finished] == ["SUCCEEDED"]
    assert all(t["step"] == 60 for t in finished)
    best = sweep["best"]
    assert best["value"] == max(t["metrics"]["test_accuracy"] for t in finished)
    assert best["trial_id"] in {t["trial_id"] for t in finished}
    assert Path(best["checkpoint"], "state.pt").is_file()

    # The driver's log is the CLI's: the table of trials, and the best spec as a job file.
    log = client.logs(job["id"])
    rows = [line.split() for line in log.splitlines()]
    for trial in sweep["trials"]:
        assert [trial["trial_id"], trial["state"]] in [row[:2] for row in rows], log
    header = f"# The best trial of sweep {job['id']}: {best['trial_id']}"
    assert header in log
    after = log[log.index(header) :].splitlines()[1:]
    yaml_lines = takewhile(lambda line: line.startswith(" ") or YAML_KEY.match(line), after)
    printed = yaml.safe_load("\n".join(yaml_lines))
    best_spec = sweep["best_spec"]
    assert printed == best_spec
    assert best_spec.get("sweep") is None
    assert best_spec["optimizer"]["lr"] == best["params"]["optimizer.lr"]
    assert best_spec["kfac"]["damping"] == best["params"]["kfac.damping"]

    # The best spec is a job the service takes as it is (the dashboard's "Submit best spec")...
    rerun = client.submit(best_spec)
    assert rerun["state"] == "QUEUED"
    assert client.job(rerun["id"])["sweep"] is None
    client.cancel(rerun["id"])
    wait_for(state_is(client, rerun["id"], "CANCELLED"), "the rerun to be cancelled", 60)
    # ... and training it reproduces the best trial.
    again = run_job(parse_job_spec(best_spec), storage_path=tmp_path / "again", progress=False)
    assert again.succeeded, again.error
    assert again.metrics["step"] == 60
    assert again.metrics["test_accuracy"] == pytest.approx(best["value"], abs=0.01)
