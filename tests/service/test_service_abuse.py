"""The service probed as an attacker would and tried as a careless user would (issue 18), in
process: FastAPI's ``TestClient`` with the app's lifespan and ``FakeRunner`` in place of Ray,
so the whole battery runs in seconds. The real-Ray side (Ray's processes' environment,
SIGTERM, two services side by side, the README run verbatim) is ``test_service_ops.py``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from pydantic import ValidationError
from support.fake_runner import FakeRunner
from support.polling import wait_for
from support.service_app import Service, spec, start

from kaisa_train.records import LatestMetrics
from kaisa_train.reference import DOC, render
from service.cli import main
from service.domain.admission import Capacity, admit
from service.errors import DatabaseInUseError
from service.model.job_data import Job
from service.model.lifecycle import JobState
from service.runner import RayJobStatus, entrypoint, submission_id
from service.settings import Settings
from service.store.database import sole_writer, sqlite_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    fake = FakeRunner()
    app, client = start(tmp_path, fake, max_workers=16, max_gpus_per_worker=4)
    with client:
        yield Service(app, client, fake)


def deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


# Each case: the body's overrides (dotted paths), the field the answer must name, and words
# of the fix it must say. Numbers a user may send but no job can use, floats that are not
# finite, fields that do not exist, and model parameters the model does not take.
BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "workers-1e20": ({"scaling.workers": 10**20}, "scaling.workers", "4096 workers"),
    "workers-over-the-service": ({"scaling.workers": 17}, "scaling.workers", "--max-workers"),
    "gpus-1e9": ({"scaling.gpus_per_worker": 1e9}, "scaling.gpus_per_worker", "GPUs"),
    "gpus-over-the-service": (
        {"scaling.gpus_per_worker": 5},
        "scaling.gpus_per_worker",
        "--max-gpus-per-worker",
    ),
    "max-steps-2**63": ({"stop.max_steps": 2**63}, "stop.max_steps", "billion steps"),
    "max-epochs": ({"stop": {"max_epochs": 10**12}}, "stop.max_epochs", "million epochs"),
    "batch-1e9": ({"dataset.batch_size": 10**9}, "dataset.batch_size", "65536"),
    "limit-1e12": ({"dataset.limit": 10**12}, "dataset.limit", "billion samples"),
    "max-failures-1e9": ({"max_failures": 10**9}, "max_failures", "restarts"),
    "keep-1e9": ({"checkpoint": {"keep": 10**9, "every_steps": 1}}, "checkpoint.keep", "100"),
    "concurrent-1e6": (
        {
            "kfac": "auto",
            "sweep": {"space": {"optimizer.lr": {"choice": [0.1]}}, "concurrent": 10**6},
        },
        "sweep.concurrent",
        "64 trials",
    ),
    "choice-20k": (
        {"kfac": "auto", "sweep": {"space": {"optimizer.lr": {"choice": [0.1] * 2000}}}},
        "sweep.space.optimizer.lr.choice",
        "64 values",
    ),
    "eval-every": ({"eval_every": 2**63}, "eval_every", "billion steps"),
    "seed": ({"seed": 2**70}, "seed", "32-bit"),
    "budget": ({"memory_budget": "10EiB"}, "memory_budget", "1 PiB"),
    "timeout": ({"scaling.resource_timeout_s": 1e300}, "scaling.resource_timeout_s", "a week"),
    "accuracy-target": ({"stop.target": {"value": 88}}, "stop.target", "0.88"),
    "interval": ({"kfac.inv_update_steps": 10**12}, "kfac.inv_update_steps", "million"),
    "unknown-field": ({"kfac.dampng": 0.1}, "kfac.dampng", "did you mean 'damping'"),
    "unknown-param": ({"model.params": {"foo": 1}}, "model.params.foo", "takes no parameter"),
    "param-name": (
        {"model": {"name": "mlp", "params": {"hiden": [64]}}},
        "model.params.hiden",
        "did you mean 'hidden'",
    ),
    "param-range": (
        {"model": {"name": "mlp", "params": {"hidden": [10**9]}}},
        "model.params.hidden.0",
        "65536",
    ),
    "param-type": (
        {"model": {"name": "mlp", "params": {"in_features": {"a": 1}}}},
        "model.params.in_features",
        "valid integer",
    ),
    "params-nested-900": ({"model.params": deep(900)}, "body", "levels deep"),
    "name": ({"name": "x" * 1000}, "name", "64"),
}


def body_with(overrides: dict[str, Any]) -> dict[str, Any]:
    body = spec("bad")
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node = body
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # kfac: "auto" and then a kfac field
                raise AssertionError(path)
        node[leaf] = value
    return body


def test_the_bad_input_battery_is_refused_fast_naming_the_field_and_the_fix(
    service: Service,
) -> None:
    """Every case gets a 4xx naming its field and its fix, at once (the whole battery in a
    fraction of the suite's second), and nothing is stored."""
    began = time.monotonic()
    for case, (overrides, field, fix) in BAD.items():
        response = service.client.post("/v1/jobs", json=body_with(overrides))
        assert response.status_code == 422, (case, response.text)
        problems = {p["field"]: p["message"] for p in response.json()["problems"]}
        assert field in problems, (case, problems)
        assert fix in problems[field], (case, problems[field])
    # Not finite: JSON's Infinity and NaN, and 1e309 (read as infinity), as Python sends them.
    for field, literal in [
        ("optimizer.lr", "Infinity"),
        ("kfac.damping", "1e309"),
        ("stop.target.value", "NaN"),
    ]:
        body = json.dumps(body_with({field: 0.5})).replace("0.5", literal)
        response = service.client.post(
            "/v1/jobs", content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 422, (field, response.text)
        problems = {p["field"]: p["message"] for p in response.json()["problems"]}
        assert "finite number" in problems[field], problems
    # 200 KiB (once accepted, and then unlaunchable): over the body limit.
    response = service.client.post(
        "/v1/jobs", json=body_with({"model.params": {"x": "y" * 200_000}})
    )
    assert response.status_code == 413, response.text
    assert "--max-body-bytes" in response.json()["detail"]
    took = time.monotonic() - began
    assert service.client.get("/v1/jobs").json()["total"] == 0  # nothing stored
    assert service.fake.submitted == {}
    assert service.client.get("/healthz").status_code == 200
    print(f"{len(BAD) + 3} bad bodies refused in {took:.2f} s")


def test_yaml_bodies_are_accepted_and_other_types_are_415(service: Service) -> None:
    text = yaml.safe_dump(spec("from-yaml"))
    created = service.client.post(
        "/v1/jobs", content=text, headers={"Content-Type": "application/yaml"}
    )
    assert created.status_code == 201, created.text
    assert created.json()["name"] == "from-yaml"
    refused = service.client.post("/v1/jobs", content=text, headers={"Content-Type": "text/plain"})
    assert refused.status_code == 415
    assert "application/yaml" in refused.json()["detail"]
    assert "application/json" in refused.json()["detail"]
    # YAML aliases (a billion laughs) and bad YAML: 422 naming the body.
    bomb = 'a: &a ["x", "x"]\nb: &b [*a, *a]\nc: [*b, *b]\n'
    for bad, words in [(bomb, "aliases"), ("name: [unclosed", "not valid YAML")]:
        response = service.client.post(
            "/v1/jobs", content=bad, headers={"Content-Type": "application/yaml"}
        )
        assert response.status_code == 422, response.text
        assert words in response.json()["problems"][0]["message"]
    assert service.client.get("/v1/jobs").json()["total"] == 1


def test_the_body_limit_is_below_what_a_launch_carries(tmp_path: Path) -> None:
    """The default limit (64 KiB) is far below one argument's 128 KiB, and the spec does
    not travel on the command line anyway: the entrypoint is the same length for any spec."""
    assert Settings(data_dir=tmp_path).max_body_bytes == 64 * 1024
    small = entrypoint("j1", spec("a"), None)
    large = entrypoint(
        "j1", spec("a", model={"name": "mlp", "params": {"hidden": [64] * 64}}), None
    )
    assert len(small) == len(large) < 200


def test_concurrent_cancels_of_one_job_never_5xx(service: Service) -> None:
    service.fake.stop_takes_effect = False  # it stays CANCELLING while the cancels race
    for _ in range(3):
        job = service.submitted()
        answers: list[int] = []
        go = threading.Barrier(8)

        def cancel(job_id: str, go: threading.Barrier, answers: list[int]) -> None:
            go.wait()
            answers.append(service.client.post(f"/v1/jobs/{job_id}/cancel").status_code)

        threads = [threading.Thread(target=cancel, args=(job["id"], go, answers)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert answers == [200] * 8
        history = [t["to_state"] for t in service.job(job["id"])["transitions"]]
        assert history == ["QUEUED", "CANCELLING"]  # one transition, however many asked


def test_idempotency_keys_expire_after_a_day(service: Service) -> None:
    headers = {"Idempotency-Key": "run-42"}
    first = service.client.post("/v1/jobs", json=spec("a"), headers=headers).json()
    again = service.client.post("/v1/jobs", json=spec("a"), headers=headers).json()
    assert again["id"] == first["id"]
    store = service.store
    with store._writing() as session:  # the job was made yesterday
        from service.store.rows import JobRow

        row = session.get(JobRow, first["id"])
        assert row is not None
        row.created_at -= 24 * 3600 + 1
    later = service.client.post("/v1/jobs", json=spec("a"), headers=headers).json()
    assert later["id"] != first["id"]
    assert service.job(first["id"])["name"] == "a"  # the old job is kept


def test_posts_are_rate_limited_per_client(tmp_path: Path) -> None:
    # A token every 100 s: none comes back while the five posts run, however loaded the machine.
    _, client = start(tmp_path, FakeRunner(), post_rate=0.01, post_burst=3)
    with client:
        codes = [client.post("/v1/jobs", json=spec(f"j{i}")).status_code for i in range(5)]
        assert codes == [201, 201, 201, 429, 429]
        refused = client.post("/v1/jobs", json=spec("late"))
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert "--post-rate" in refused.json()["detail"]
        assert client.get("/v1/jobs").status_code == 200  # reads are not limited
        assert client.get("/v1/jobs").json()["total"] == 3


def test_admission_keeps_at_most_max_running_in_ray_and_shows_the_queue(
    tmp_path: Path,
) -> None:
    fake = FakeRunner()
    app, client = start(tmp_path, fake, max_running=2)
    with client:
        service = Service(app, client, fake)
        jobs = [service.submit(f"q{i}") for i in range(5)]
        wait_for(lambda: len(fake.submitted) == 2, "two jobs in Ray")
        follower = app.state.runtime.follower
        passes = follower.passes
        wait_for(lambda: follower.passes >= passes + 3, "three more passes")  # no third one
        assert len(fake.submitted) == 2
        views = [service.job(j["id"]) for j in jobs]
        assert [v["queue_position"] for v in views] == [None, None, 1, 2, 3]
        listed = {j["id"]: j["queue_position"] for j in client.get("/v1/jobs").json()["jobs"]}
        assert listed[jobs[4]["id"]] == 3
        fake.finish(jobs[0]["id"], RayJobStatus.SUCCEEDED)
        service.wait(jobs[2]["id"], "admitted", lambda j: j["submission_id"] is not None)
        assert len(fake.submitted) == 3
        assert service.job(jobs[3]["id"])["queue_position"] == 1


def test_admission_counts_the_cluster_cpus_of_workers_and_drivers() -> None:
    def job(name: str, workers: int) -> Job:
        return Job(
            id=name, name=name, state=JobState.QUEUED,
            spec={"scaling": {"workers": workers, "cpus_per_worker": 1}},
            idempotency_key=None, submission_id=None, created_at=0, updated_at=0,
            started_at=None, finished_at=None, failure_reason=None, step=0, total_steps=None,
            latest=LatestMetrics(), tuner=None, sweep=None, cursor=0, attempts=0,
        )  # fmt: skip

    capacity = Capacity(cpus=4, driver_cpus=0.25)
    assert capacity.limit == 3  # each job needs a CPU and its driver's quarter
    queue = [job("a", 2), job("b", 1), job("c", 1)]
    assert [j.id for j in admit(queue, [], capacity)] == ["a", "b"]  # 2.25 + 1.25 <= 4
    assert [j.id for j in admit(queue[1:], [job("a", 2)], capacity)] == ["b"]
    assert admit([job("huge", 64)], [], capacity)[0].id == "huge"  # alone, it runs
    assert admit([job("x", 1)], [job("huge", 64)], capacity) == []  # first come, first served
    assert [j.id for j in admit(queue, [], Capacity(cpus=None, max_running=1))] == ["a"]


# -- the follower: no job can stop it ------------------------------------------------------


def test_a_poisoned_job_and_a_vanished_one_never_stop_the_others(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """One job sends an out-of-range record on every pass, one job's Ray Job is gone from Ray
    (a cancelled one and a running one), one job's progress cannot be read: a third job is
    still followed live to SUCCEEDED; the vanished ones resolve (CANCELLED, and FAILED as
    lost after the grace period), and each repeated error is logged once, with its count."""
    caplog.set_level(logging.WARNING, logger="service.domain.follower")
    poisoned = service.running("poisoned")
    cancelled = service.running("cancelled")
    lost = service.running("lost")
    unreadable = service.running("unreadable")
    healthy = service.running("healthy", total_steps=30)
    service.fake.fail_progress[unreadable["id"]] = RuntimeError("the sink is gone")
    for n in range(20):
        service.fake.push(poisoned["id"], {"kind": "step", "step": 2**63 + n, "loss": 1.0})
        service.fake.push(poisoned["id"], {"kind": "start", "total_steps": -5})
    service.fake.vanish(cancelled["id"])
    cancel = service.client.post(f"/v1/jobs/{cancelled['id']}/cancel")
    assert cancel.status_code == 200
    service.fake.vanish(lost["id"])
    for step in (10, 20, 30):
        service.fake.push(healthy["id"], {"kind": "step", "step": step, "loss": 1 / step})
        service.wait(healthy["id"], f"step {step}", lambda j, s=step: j["progress"]["step"] == s)
    service.fake.finish(healthy["id"], RayJobStatus.SUCCEEDED)
    assert service.wait_state(healthy["id"], "SUCCEEDED")["progress"]["step"] == 30
    assert service.wait_state(cancelled["id"], "CANCELLED")["failure_reason"] is None
    gone = service.wait_state(lost["id"], "FAILED")
    assert gone["failure_reason"].startswith("lost with its cluster: the Ray cluster at fake")
    # The poisoned job is still followed; its bad values never reached the store.
    view = service.job(poisoned["id"])
    assert view["state"] == "RUNNING"
    assert view["progress"]["total"] == 100
    service.fake.push(poisoned["id"], {"kind": "step", "step": 7, "loss": 0.5})
    service.wait(poisoned["id"], "a good record", lambda j: j["progress"]["step"] == 7)
    # Logged once per job and kind of trouble, not once per pass.
    records = [r.getMessage() for r in caplog.records]
    assert sum(f"job {poisoned['id']}: records" in m for m in records) == 1, records
    assert sum(f"job {unreadable['id']}: follow" in m for m in records) == 1, records
    assert service.app.state.runtime.follower.passes > 20


def test_a_job_whose_progress_cannot_be_stored_fails_with_the_reason(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy.exc import OperationalError

    job = service.running("doomed")
    other = service.running("fine")
    store = service.store
    add = store.add_progress

    def broken(job_id: str, progress: Any) -> Job:
        if job_id == job["id"]:
            raise OperationalError("INSERT ...", {}, Exception("disk I/O error"))
        return add(job_id, progress)

    monkeypatch.setattr(store, "add_progress", broken)
    service.fake.push(job["id"], {"kind": "step", "step": 1, "loss": 1.0})
    service.fake.push(other["id"], {"kind": "step", "step": 5, "loss": 1.0})
    service.wait(other["id"], "its progress", lambda j: j["progress"]["step"] == 5)
    failed = service.wait_state(job["id"], "FAILED")
    assert "could not store this job's progress" in failed["failure_reason"]
    assert "disk I/O error" in failed["failure_reason"]


# -- secure defaults -----------------------------------------------------------------------


def test_a_public_bind_without_a_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"refusing to serve on 0\.0\.0\.0 without a token"):
        Settings(host="0.0.0.0", data_dir=tmp_path)
    assert Settings(host="0.0.0.0", insecure=True, data_dir=tmp_path).token is None
    assert Settings(host="::1", data_dir=tmp_path).token is None  # loopback: fine
    result = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "refusing to serve on 0.0.0.0 without a token" in result.output
    assert "--insecure" in result.output
    assert "Traceback" not in result.output


def test_the_token_comes_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("file-token-0123\n")
    settings = Settings(host="0.0.0.0", token_file=secret, data_dir=tmp_path)
    assert settings.secret == "file-token-0123"
    with pytest.raises(ValidationError, match="not both"):
        Settings(token="a", token_file=secret, data_dir=tmp_path)
    with pytest.raises(ValidationError, match="cannot read the token file"):
        Settings(token_file=tmp_path / "missing", data_dir=tmp_path)


def test_every_page_carries_the_csp_and_the_docs_use_no_cdn(service: Service) -> None:
    modules = sorted(p.name for p in (ROOT / "service" / "static" / "js").glob("*.js"))
    assert "main.js" in modules
    scripts = [f"/static/js/{name}" for name in modules]
    for path in ("/", "/docs", *scripts, "/static/docs.js", "/openapi.json", "/healthz"):
        response = service.client.get(path)
        assert response.status_code == 200, path
        if path.endswith(".js"):  # an ES module needs a JavaScript type to load
            assert "javascript" in response.headers["content-type"], path
        policy = response.headers["Content-Security-Policy"]
        assert "default-src 'self'" in policy, path
        assert "script-src 'self';" in policy, path
    docs = service.client.get("/docs").text
    assert "http" not in docs  # every script and style is the service's own
    for asset in (
        "/static/vendor/swagger/swagger-ui-bundle.js",
        "/static/vendor/swagger/swagger-ui.css",
    ):
        assert service.client.get(asset).status_code == 200, asset
    unauthorized = service.client.get("/v1/jobs", headers={"Authorization": "Bearer wrong"})
    assert unauthorized.status_code == 401
    assert "Content-Security-Policy" in unauthorized.headers


def test_the_lock_resolves_the_url_and_covers_the_data_directory(tmp_path: Path) -> None:
    file = tmp_path / "db" / "jobs.db"
    for url in (
        f"sqlite:///{file}",
        f"sqlite+pysqlite:///{file}",
        f"sqlite:///{tmp_path}/db/../db/jobs.db",
    ):
        assert sqlite_file(url) == file.resolve(), url
    assert sqlite_file("sqlite://") is None
    assert sqlite_file("sqlite:///:memory:") is None
    with (
        sole_writer(f"sqlite+pysqlite:///{file}"),
        pytest.raises(DatabaseInUseError, match="uses the database"),
        sole_writer(f"sqlite:///{tmp_path}/db/./jobs.db"),
    ):
        pass
    with (
        sole_writer("sqlite:///:memory:", tmp_path / "data"),
        pytest.raises(DatabaseInUseError, match="uses the data directory"),
        sole_writer(f"sqlite:///{tmp_path / 'other.db'}", tmp_path / "data"),
    ):
        pass


# -- the README's promises that need no Ray ---------------------------------------------------


@pytest.mark.parametrize("command", ["jobs", "submit", "follow", "cancel"])
def test_client_commands_do_not_import_torch(command: str, tmp_path: Path) -> None:
    """Neither torch nor Ray: the client reads the records and shows them with kaisa_ray's
    torch-free modules (errors, enums, records, the follower), which it may import."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec("c")))
    args = {
        "jobs": ["jobs"],
        "submit": ["submit", str(job)],
        "follow": ["submit", "--follow-id", "someid"],
        "cancel": ["cancel", "someid"],
    }
    script = (
        "import sys\n"
        "from service.cli import main\n"
        f"sys.argv = ['kaisa-ray', *{args[command]!r}, '--url', 'http://127.0.0.1:9']\n"
        "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code\n"
        "print(code, sorted(m for m in ('torch', 'ray', 'ray.train') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "1 []", done.stdout  # refused (no service), no torch
    refused = "the event stream from" if command == "follow" else "cannot reach the service"
    assert refused in done.stderr


def test_the_jobspec_reference_is_current() -> None:
    """docs/jobspec.md is generated from the schema: regenerate it with
    ``python -m kaisa_train.reference --write`` when this fails."""
    assert DOC.read_text() == render()
    text = DOC.read_text()
    for field in ("scaling.workers", "stop.max_steps", "kfac.damping", "sweep.concurrent"):
        assert f"| `{field}` |" in text, field


def test_a_succeeded_job_that_met_its_target_is_done(service: Service) -> None:
    job = service.submitted("early", stop={"max_steps": 1000, "target": {"value": 0.5}})
    service.fake.push(
        job["id"],
        {"kind": "worker", "rank": 0},
        {"kind": "start", "total_steps": 1000},
        {"kind": "step", "step": 250, "loss": 0.3},
    )
    service.wait(job["id"], "step 250", lambda j: j["progress"]["step"] == 250)
    service.fake.finish(job["id"], RayJobStatus.SUCCEEDED)
    done = service.wait_state(job["id"], "SUCCEEDED")
    assert done["progress"] == {"step": 250, "total": 1000, "percent": 100.0, "target_met": True}
    assert submission_id(job["id"]) in service.fake.submitted
