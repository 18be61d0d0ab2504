"""The service's client commands (``kaisa-ray submit``, ``jobs``, ``cancel`` in ``service.cli``)
against a real HTTP server: the app under uvicorn in a background thread on a loopback port,
with ``FakeRunner`` in place of Ray, so each test scripts what Ray and the progress sink say
and the commands talk to the service over real HTTP and server-sent events.

One server for the module (starting one takes half a second): every test makes jobs of its
own names and looks at those, whatever other tests left in the store."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from click.testing import CliRunner, Result
from fastapi import FastAPI
from pydantic import SecretStr
from support.fake_runner import FakeRunner
from support.polling import wait_for, wait_for_job
from support.served import serve

from kaisa_train.records import KFACChoice, TunerRecord
from service.app import create_app
from service.cli import main
from service.runner import RayJobStatus, submission_id
from service.settings import Settings

TOKEN = "cli-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fashion_mnist.yaml"
HEADER = ["ID", "NAME", "STATE", "PROGRESS", "LOSS", "TEST ACC", "STRATEGY", "CREATED"]
T = TypeVar("T")


def example_spec(name: str) -> dict[str, Any]:
    """The example job (``examples/fashion_mnist.yaml``) on the synthetic dataset."""
    spec: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    spec.update(name=name, dataset={"name": "synthetic", "batch_size": 8})
    return spec


@dataclass
class Service:
    url: str
    app: FastAPI
    fake: FakeRunner
    api: httpx.Client  # checks what the commands did, past the client under test

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.api.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def jobs(self) -> list[dict[str, Any]]:
        response = self.api.get("/v1/jobs")
        assert response.status_code == 200, response.text
        jobs: list[dict[str, Any]] = response.json()["jobs"]
        return jobs

    def create(self, name: str) -> dict[str, Any]:
        response = self.api.post("/v1/jobs", json=example_spec(name))
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def wait(
        self, job_id: str, what: str, check: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any]:
        return wait_for_job(self.job, job_id, what, check)

    def submitted(self, job_id: str) -> dict[str, Any]:
        """Wait until the job has reached the (fake) Ray."""
        return self.wait(job_id, "submitted", lambda job: job["submission_id"] is not None)

    def subscribed(self, job_id: str) -> None:
        """Wait until an event stream follows the job (from then on it misses nothing)."""
        hub = self.app.state.runtime.jobs.hub
        wait_for(lambda: hub.subscribers(job_id) > 0, f"a stream following job {job_id}")

    def named(self, name: str) -> list[dict[str, Any]]:
        return [job for job in self.jobs() if job["name"] == name]

    def job_named(self, name: str) -> Callable[[], str]:
        """The id of the job called ``name``, once the command under test has created it."""

        def found() -> str:
            jobs = wait_for(lambda: self.named(name), f"a job called {name}")
            assert len(jobs) == 1, jobs
            job_id: str = jobs[0]["id"]
            return job_id

        return found

    def run_to_the_end(
        self, job_id: Callable[[], str], status: RayJobStatus, message: str = ""
    ) -> str:
        """Once a stream follows the job: it runs to step 20 of 100 (test accuracy 0.5), then
        Ray reports ``status``. Ray reports it even if the script fails, so the command
        following the job ends rather than hang."""
        found = job_id()
        try:
            self.subscribed(found)
            self.fake.push(
                found,
                {"kind": "worker", "rank": 0},
                {"kind": "start", "total_steps": 100},
                {"kind": "step", "step": 10, "loss": 2.0},
                {"kind": "step", "step": 20, "loss": 1.0},
                {"kind": "eval", "step": 20, "test_loss": 1.2, "test_accuracy": 0.5},
            )
        finally:
            self.fake.finish(found, status, message)
        return found


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    fake = FakeRunner()
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("service"),
        token=SecretStr(TOKEN),
        poll_interval_s=0.02,
        status_interval_s=0.02,
        post_rate=1e6,  # the rate limit has its own test (test_service_abuse.py)
        post_burst=10**6,
    )
    app = create_app(settings, runner=fake)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        server, thread, url = serve(app, sock)
        with httpx.Client(base_url=url, headers=AUTH, timeout=10) as api:
            health = api.get("/healthz")
            assert (health.status_code, health.json()) == (200, {"status": "ok", "checks": {}})
            yield Service(url, app, fake, api)
        server.should_exit = True
        thread.join(timeout=15)
        assert not thread.is_alive(), "uvicorn did not shut down"


@pytest.fixture(autouse=True)
def no_service_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands read $KAISA_RAY_URL and $KAISA_RAY_TOKEN: none from outside the test."""
    monkeypatch.delenv("KAISA_RAY_URL", raising=False)
    monkeypatch.delenv("KAISA_RAY_TOKEN", raising=False)


@pytest.fixture
def in_background() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="script") as pool:
        yield pool


def kaisa_ray(service: Service, *args: str, token: str = TOKEN) -> Result:
    """``kaisa-ray ARGS --url URL --token TOKEN``; an unexpected exception fails the test."""
    runner = CliRunner(catch_exceptions=False)
    return runner.invoke(main, [*args, "--url", service.url, "--token", token])


def job_file(
    directory: Path,
    name: str = "cli-job",
    *,
    kfac: dict[str, Any] | None = None,
    suffix: str = ".yaml",
) -> Path:
    """``example_spec(name)`` (its ``kfac`` updated by ``kfac``) in a YAML or JSON file."""
    spec = example_spec(name)
    spec["kfac"].update(kfac or {})
    path = directory / f"{name}{suffix}"
    path.write_text(json.dumps(spec) if suffix == ".json" else yaml.safe_dump(spec))
    return path


def failed_with(result: Result, code: int = 1) -> str:
    """The command's error output, once it has exited with ``code``."""
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    return result.stderr


def table(output: str) -> list[list[str]]:
    """The rows of ``kaisa-ray jobs``: cells are two or more spaces apart."""
    return [re.split(r"\s{2,}", line.strip()) for line in output.splitlines()]


# -- kaisa-ray submit --------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_submit_prints_the_queued_job_and_stores_it(
    service: Service, tmp_path: Path, suffix: str
) -> None:
    name = f"first{suffix.replace('.', '-')}"
    result = kaisa_ray(service, "submit", str(job_file(tmp_path, name, suffix=suffix)))
    assert result.exit_code == 0, result.output
    match = re.fullmatch(rf"job (\S+) \({name}\): QUEUED\n", result.stdout)
    assert match is not None, result.stdout
    job = service.job(match.group(1))
    assert (job["name"], job["state"]) == (name, "QUEUED")
    assert job["spec"]["dataset"]["name"] == "synthetic"
    assert job["spec"]["kfac"]["strategy"] == "comm-opt"
    assert job["spec"]["stop"]["max_steps"] == 1000
    assert [j["id"] for j in service.named(name)] == [job["id"]]
    submitted = service.submitted(job["id"])
    assert service.fake.submitted[submission_id(job["id"])] == submitted["spec"]


def test_the_url_and_token_come_from_the_environment(service: Service, tmp_path: Path) -> None:
    runner = CliRunner(
        catch_exceptions=False, env={"KAISA_RAY_URL": service.url, "KAISA_RAY_TOKEN": TOKEN}
    )
    result = runner.invoke(main, ["submit", str(job_file(tmp_path, "from-env"))])
    assert result.exit_code == 0, result.output
    (job,) = service.named("from-env")
    assert result.stdout == f"job {job['id']} (from-env): QUEUED\n"

    listed = runner.invoke(main, ["jobs"])
    assert listed.exit_code == 0, listed.output
    rows = table(listed.stdout)
    assert rows[0] == HEADER
    assert [row[:3] for row in rows if row[0] == job["id"]] == [[job["id"], "from-env", "QUEUED"]]


@pytest.mark.timeout(60)
def test_submit_follow_shows_the_job_until_it_succeeds(
    service: Service, tmp_path: Path, in_background: ThreadPoolExecutor
) -> None:
    script: Future[str] = in_background.submit(
        service.run_to_the_end, service.job_named("followed"), RayJobStatus.SUCCEEDED
    )
    result = kaisa_ray(service, "submit", str(job_file(tmp_path, "followed")), "--follow")
    job_id = script.result(timeout=30)
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"job {job_id} (followed): QUEUED\n"
        f"job {job_id} SUCCEEDED at step 20, test accuracy 0.5000\n"
    )
    # The progress bar and the evaluations went to stderr, as the stream brought them.
    assert "step 20: test accuracy 0.5000" in result.stderr
    lines = result.stderr.splitlines()
    # Not a terminal: a line per state (nothing twice, no time left to guess at the end); it
    # stopped at its target (step 20 of 100), so it is done, not 20% of the way.
    assert f"job {job_id}: SUCCEEDED: target met at step 20 of 100" in lines
    assert len(lines) == len(set(lines)), lines
    assert "<" not in result.stderr  # no ETA
    assert service.job(job_id)["state"] == "SUCCEEDED"


@pytest.mark.timeout(60)
def test_submit_follow_exits_1_with_the_reason_when_the_job_fails(
    service: Service, tmp_path: Path, in_background: ThreadPoolExecutor
) -> None:
    script: Future[str] = in_background.submit(
        service.run_to_the_end,
        service.job_named("doomed"),
        RayJobStatus.FAILED,
        "CUDA out of memory",
    )
    result = kaisa_ray(service, "submit", str(job_file(tmp_path, "doomed")), "--follow")
    job_id = script.result(timeout=30)
    failed_with(result, 1)
    assert result.stdout == (
        f"job {job_id} (doomed): QUEUED\n"
        f"job {job_id} FAILED at step 20, test accuracy 0.5000: "
        "the Ray Job failed: CUDA out of memory\n"
    )
    job = service.job(job_id)
    assert job["state"] == "FAILED"
    assert job["failure_reason"] == "the Ray Job failed: CUDA out of memory"


@pytest.mark.timeout(60)
def test_submit_follow_id_follows_a_job_submitted_earlier(
    service: Service, in_background: ThreadPoolExecutor
) -> None:
    job = service.create("earlier")
    count = len(service.jobs())
    script: Future[str] = in_background.submit(
        service.run_to_the_end, lambda: job["id"], RayJobStatus.SUCCEEDED
    )
    result = kaisa_ray(service, "submit", "--follow-id", job["id"])
    assert script.result(timeout=30) == job["id"]
    assert result.exit_code == 0, result.output
    # Nothing submitted: only the end of the job it followed.
    assert result.stdout == f"job {job['id']} SUCCEEDED at step 20, test accuracy 0.5000\n"
    assert len(service.jobs()) == count


def test_submit_follow_id_of_an_unknown_job_is_an_error(service: Service) -> None:
    error = failed_with(kaisa_ray(service, "submit", "--follow-id", "no-such-job"))
    assert error.splitlines()[-1] == (
        "Error: 404: no job 'no-such-job'; GET /v1/jobs lists the jobs there are"
    )


def test_an_invalid_job_file_is_refused_naming_the_field(service: Service, tmp_path: Path) -> None:
    path = job_file(tmp_path, "bad-damping", kfac={"damping": -1})
    error = failed_with(kaisa_ray(service, "submit", str(path)))
    assert error.startswith("Error: 422: 1 problem(s): kfac.damping: "), error
    assert service.named("bad-damping") == []


def test_a_file_without_a_mapping_is_refused_before_any_request(
    service: Service, tmp_path: Path
) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- name: not-a-job\n")
    count = len(service.jobs())
    error = failed_with(kaisa_ray(service, "submit", str(path)))
    assert error == f"Error: {path} does not hold a job (a mapping of fields)\n"
    assert len(service.jobs()) == count


@pytest.mark.parametrize(
    "args",
    [[], ["JOB_FILE", "--follow-id", "some-job"]],
    ids=["neither-file-nor-id", "both"],
)
def test_submit_needs_a_file_or_an_id_to_follow(
    service: Service, tmp_path: Path, args: list[str]
) -> None:
    path = str(job_file(tmp_path, "usage"))
    args = [path if arg == "JOB_FILE" else arg for arg in args]
    error = failed_with(kaisa_ray(service, "submit", *args), 2)
    assert "Usage: " in error
    assert "give a JOB_FILE to submit, or --follow-id ID to follow" in error
    assert service.named("usage") == []


def test_the_same_idempotency_key_gives_the_same_job(service: Service, tmp_path: Path) -> None:
    path = str(job_file(tmp_path, "once"))
    first = kaisa_ray(service, "submit", path, "--idempotency-key", "retry-1")
    again = kaisa_ray(service, "submit", path, "--idempotency-key", "retry-1")
    other = kaisa_ray(service, "submit", path, "--idempotency-key", "retry-2")
    for result in (first, again, other):
        assert result.exit_code == 0, result.output
    assert first.stdout == again.stdout
    assert first.stdout != other.stdout
    assert len(service.named("once")) == 2


# -- kaisa-ray jobs ----------------------------------------------------------------------


def test_jobs_lists_the_jobs_as_a_table(service: Service) -> None:
    queued = service.create("waiting")
    running = service.create("training")
    service.submitted(running["id"])
    service.fake.push(
        running["id"],
        {"kind": "worker", "rank": 0},
        TunerRecord(
            cache="miss",
            profile_s=1.0,
            budget_bytes=None,
            base_memory_bytes=2**20,
            kfac_transient_bytes=0,
            plain_ms_per_step=8.0,
            chosen=KFACChoice(grad_worker_fraction=0.5, factor_update_steps=5, inv_update_steps=50),
            candidates=[],
        ).wire(),
        {"kind": "start", "total_steps": 100},
        {"kind": "step", "step": 10, "loss": 2.25},
        {"kind": "eval", "step": 10, "test_accuracy": 0.375},
    )
    shown = service.wait(running["id"], "at step 10", lambda j: j["progress"]["step"] == 10)

    result = kaisa_ray(service, "jobs")
    assert result.exit_code == 0, result.output
    rows = table(result.stdout)
    assert rows[0] == HEADER
    assert len(rows) == 1 + len(service.jobs())  # under the default --limit of 50
    ours = [row for row in rows if row[0] in (queued["id"], running["id"])]
    created = shown["created_at"][:19].replace("T", " ")
    assert ours == [  # newest first
        [
            running["id"],
            "training",
            "RUNNING",
            "10/100",
            "2.2500",
            "0.3750",
            "auto→0.5",
            created,
        ],
        [queued["id"], "waiting", "QUEUED", "-", "-", "-", "comm-opt", ours[1][-1]],
    ]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", ours[1][-1])

    only_running = kaisa_ray(service, "jobs", "--state", "running")
    assert only_running.exit_code == 0, only_running.output
    rows = table(only_running.stdout)
    assert rows[0] == HEADER
    assert {row[2] for row in rows[1:]} == {"RUNNING"}
    assert [running["id"], "training", "RUNNING"] in [row[:3] for row in rows]

    states = ["QUEUED", "RUNNING"]
    total = service.api.get("/v1/jobs", params={"state": states}).json()["total"]
    assert total >= 2
    newest = kaisa_ray(service, "jobs", "--state", states[0], "--state", states[1], "--limit", "1")
    assert newest.exit_code == 0, newest.output
    assert [row[:3] for row in table(newest.stdout)] == [
        HEADER[:3],
        [running["id"], "training", "RUNNING"],
        [f"(1 of {total}; --limit shows more)"],
    ]
    none = kaisa_ray(service, "jobs", "--state", "RECOVERING")
    assert none.exit_code == 0, none.output
    assert table(none.stdout) == [HEADER]


def test_jobs_refuses_a_state_that_does_not_exist(service: Service) -> None:
    error = failed_with(kaisa_ray(service, "jobs", "--state", "DONE"), 2)
    assert "Invalid value for '--state'" in error


def test_a_wrong_token_is_refused(service: Service, tmp_path: Path) -> None:
    count = len(service.jobs())
    for args in (["jobs"], ["submit", str(job_file(tmp_path))], ["cancel", "some-job"]):
        error = failed_with(kaisa_ray(service, *args, token="not-the-token"))
        assert error.startswith("Error: 401: missing or wrong token: "), (args, error)
        assert "$KAISA_RAY_TOKEN" in error
    assert len(service.jobs()) == count


# -- kaisa-ray cancel --------------------------------------------------------------------


def test_cancel_stops_the_job_on_ray(service: Service) -> None:
    job = service.create("to-cancel")
    service.submitted(job["id"])
    result = kaisa_ray(service, "cancel", job["id"])
    assert result.exit_code == 0, result.output
    assert result.stdout in (f"job {job['id']}: CANCELLING\n", f"job {job['id']}: CANCELLED\n")
    sid = submission_id(job["id"])
    wait_for(lambda: sid in service.fake.stopped, "the fake Ray to be asked to stop the job")
    service.wait(job["id"], "cancelled", lambda j: j["state"] == "CANCELLED")
    # Cancelling again is no error, and stops nothing more.
    again = kaisa_ray(service, "cancel", job["id"])
    assert again.exit_code == 0, again.output
    assert again.stdout == f"job {job['id']}: CANCELLED\n"
    assert service.fake.stopped.count(sid) == 1


def test_cancel_of_an_unknown_job_is_an_error(service: Service) -> None:
    error = failed_with(kaisa_ray(service, "cancel", "no-such-job"))
    assert error == "Error: 404: no job 'no-such-job'; GET /v1/jobs lists the jobs there are\n"


def test_serve_submit_needs_a_port_it_can_post_to(tmp_path: Path) -> None:
    """``--port 0`` (a port the OS picks) serves, but ``--submit`` posts to the service's own
    port, which it cannot name before uvicorn binds: refused before anything starts."""
    result = CliRunner().invoke(
        main,
        ["serve", "--port", "0", "--data-dir", str(tmp_path), "--submit", str(job_file(tmp_path))],
    )
    assert result.exit_code == 2, result.output
    assert "--submit posts to the service's own port: give --port a number" in result.output
    assert not (tmp_path / "head.json").exists()  # no Ray head was started


def test_help_lists_the_training_commands_without_importing_them() -> None:
    """``kaisa-ray --help`` lists every command with its own short help, the training
    commands' from ``TRAINING_HELP`` (which must equal each command's docstring's), and
    imports neither torch nor Ray to do so."""
    import click

    from service.cli import TRAINING_COMMANDS, TRAINING_HELP

    assert set(TRAINING_HELP) == set(TRAINING_COMMANDS)
    context = click.Context(main)
    for name, text in TRAINING_HELP.items():
        command = main.get_command(context, name)
        assert command is not None
        assert command.get_short_help_str(10**6) == text, name
    script = (
        "import sys\n"
        "from service.cli import main\n"
        "sys.argv = ['kaisa-ray', '--help']\n"
        "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code\n"
        "print(code, sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=root
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "0 []", done.stdout[-2000:]
    for name in TRAINING_COMMANDS:
        assert re.search(rf"^  {re.escape(name)} +\S", done.stdout, re.MULTILINE), name
