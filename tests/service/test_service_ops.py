"""The service as an operator runs it, with real parts (issues 18 and 30): two ``kaisa-ray
serve`` processes, each with its embedded Ray head, side by side on one machine; their Ray
processes' environments; SIGTERM while a job trains, and the next ``kaisa-ray serve`` on the
same data directory resuming that job from its latest checkpoint to the end, its step records
going on with no step twice and none missing. Three service start-ups for the module (the
README's service quickstart, with its own, is ``test_service_quickstart.py``; the same
restart in process, with a fake Ray, is ``test_service_resume.py``)."""

from __future__ import annotations

import contextlib
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.service_process import ServiceProcess, start_service

from service.head import RayHead, descendants
from service.runner import submission_id

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "ops-token-0123456789"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # a colour escape in a log line
MARKER = "KAISA_RAY_MAX_WORKERS"  # a service variable set in the services' environment
ENV = {MARKER: "8", "KAISA_RAY_EMBEDDED_CPUS": "3", "KAISA_RAY_STATUS_INTERVAL_S": "0.5"}
STEPS, EVERY = 1500, 100  # the resumed job's


def resumed_job() -> dict[str, Any]:
    return {
        "name": "resumed",
        "model": {"name": "lenet"},
        "dataset": {"name": "synthetic", "batch_size": 32, "limit": 1024},
        "kfac": "off",
        "scaling": {"workers": 1},
        "stop": {"max_steps": STEPS},
        "eval_every": EVERY,
        "checkpoint": {"every_steps": EVERY, "keep": 2},
    }


def quick_job(name: str, steps: int) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"name": "mlp", "params": {"hidden": [32]}},
        "dataset": {"name": "synthetic", "batch_size": 32, "limit": 512},
        "kfac": "off",
        "scaling": {"workers": 1},
        "stop": {"max_steps": steps},
        "eval_every": 10,
        "checkpoint": {"every_steps": 1000},
    }


def wait_for(check: Any, what: str, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def head_of(service: ServiceProcess) -> RayHead:
    head = RayHead.load(service.log.parent / "ray" / "head.json")
    assert head is not None, service.log.read_text()
    return head


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServiceProcess]]:
    """Two services, each on its own data directory with its own embedded Ray head."""
    started: dict[str, ServiceProcess] = {}
    dirs = {name: tmp_path_factory.mktemp(f"ops-{name}") for name in ("a", "b")}
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once: the start-ups overlap
            futures = {
                name: pool.submit(start_service, where, token=TOKEN, env=ENV, timeout_s=180)
                for name, where in dirs.items()
            }
            failed: list[BaseException] = []
            for name, future in futures.items():
                error = future.exception()
                if error is None:
                    started[name] = future.result()
                else:
                    failed.append(error)
        if failed:  # the other one is stopped below
            raise failed[0]
        yield started
    finally:
        for service in started.values():  # a restarted one too (its data directory's head)
            if service.process.poll() is None:
                service.stop()
        for where in dirs.values():
            head = RayHead.load(where / "ray" / "head.json")
            if head is not None and head.alive():
                head.stop(grace_s=1)


def ray_processes(head: RayHead) -> list[int]:
    return [head.pid, *descendants(head.pid)]


def environ(pid: int) -> dict[str, str] | None:
    """A process's environment (None: it ended meanwhile)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running, and not a zombie (ended, waiting for its parent to read its status)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.timeout(1200)  # two services' jobs and a restart, beside the heaviest modules
def test_two_services_side_by_side_then_sigterm_and_a_restart_that_resumes_the_job(
    services: dict[str, ServiceProcess],
) -> None:
    """A job on each service: b's runs to SUCCEEDED, a's (long, checkpointing) trains;
    neither log mentions other Ray instances or the other cluster's address; while the long
    job runs, no Ray process of either head (head, raylet, workers, the job's driver and train
    worker) has a service variable or the service's token in its environment. Then SIGTERM
    stops service a, its head and every process it started, the long job's among them, while
    service b goes on; the job is INTERRUPTED, not failed. The next service on a's data
    directory resumes it from its latest checkpoint to the end."""
    a, b = services["a"], services["b"]
    heads = {name: head_of(service) for name, service in services.items()}
    assert heads["a"].gcs_address != heads["b"].gcs_address
    assert heads["a"].temp_dir != heads["b"].temp_dir
    clients = {name: service.client() for name, service in services.items()}
    jobs = {
        "a": clients["a"].submit(resumed_job()),
        "b": clients["b"].submit(quick_job("short", 30)),
    }
    long = jobs["a"]
    # Generous limits: beside the heaviest modules of the suite (another worker's Ray
    # instances and jobs), a finished Ray Job's driver took over 2 minutes to exit.
    wait_for(
        lambda: clients["a"].job(long["id"])["progress"]["step"] >= 10,
        "the long job to train",
        timeout_s=300,
    )
    checked = 0
    for name, head in heads.items():
        for pid in ray_processes(head):
            found = environ(pid)
            if found is None:  # it ended meanwhile
                continue
            leaked = sorted(k for k in found if k.startswith("KAISA_RAY_"))
            assert not leaked, (name, cmdline(pid)[:80], leaked)
            assert TOKEN not in "\0".join(f"{k}={v}" for k, v in found.items())
            checked += 1
    drivers = [pid for pid in ray_processes(heads["a"]) if "kaisa-ray train" in cmdline(pid)]
    assert drivers, "the long job's driver is not among the head's processes"
    assert checked > 10

    trained = wait_for(
        lambda: (
            (j := clients["a"].job(long["id"]))["metrics"].get("checkpoint_step", 0) >= 2 * EVERY
            and j
        ),
        "two checkpoints",
        timeout_s=300,
    )
    assert trained["state"] == "RUNNING"
    logs = {"a": clients["a"].logs(long["id"])}  # the long job's log, as far as it got
    assert "Running entrypoint for job" in logs["a"]

    # SIGTERM, what systemd, Docker and Kubernetes send, to service a while its long job
    # trains: within 20 s the service, its Ray head and every process below them (the job's
    # driver and train worker too) are gone, and the log says the shutdown completed (the
    # stop's phases are bounded at about 12 s, docs/service.md; on a quiet machine it takes
    # 3-4 s, and the rest is for a CI machine busy with other tests). (A cancel on the real
    # Ray: tests/service/test_service_e2e.py.)
    family = [a.process.pid, *descendants(a.process.pid)]
    assert any("kaisa-ray train" in cmdline(pid) for pid in family)  # the job's driver
    assert len(family) > 5
    began = time.monotonic()
    a.process.send_signal(signal.SIGTERM)
    try:
        a.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"20 s after SIGTERM the service still runs; its log:\n{a.log_tail()}")
    try:
        wait_for(
            lambda: not [pid for pid in family if alive(pid)],
            "every process to go",
            timeout_s=max(0.1, 20 - (time.monotonic() - began)),
        )
    except AssertionError:
        left = [f"{pid} {cmdline(pid)[:100]}" for pid in family if alive(pid)]
        pytest.fail(
            f"20 s after SIGTERM (the service exited {a.process.returncode}) these still run:"
            f"\n{chr(10).join(left)}\nthe service's log:\n{a.log_tail()}"
        )
    took = time.monotonic() - began
    stopped_at = time.time()
    assert took < 20
    assert a.process.returncode == 0
    assert "shutdown complete" in a.log.read_text()
    at = trained["progress"]["step"]
    print(f"SIGTERM at step {at}: {len(family)} processes gone in {took:.1f} s")
    assert b.process.poll() is None  # the other service did not notice

    done = wait_for(
        lambda: (j := clients["b"].job(jobs["b"]["id"]))["state"] in ("SUCCEEDED", "FAILED") and j,
        "job b to end",
        timeout_s=300,
    )
    assert done["state"] == "SUCCEEDED", done["failure_reason"]
    logs["b"] = clients["b"].logs(jobs["b"]["id"])
    assert "finished at step 30" in logs["b"]
    for name, log in logs.items():
        other = heads["b" if name == "a" else "a"]
        assert "multiple active Ray instances" not in log
        assert other.gcs_address.rsplit(":", 1)[1] not in log
        # Ray Train's own controller actor may log a traceback of its own under load (its
        # autoscaling coordinator call, retried by Ray): lines it prefixes with its name are
        # Ray's, not the job's. A traceback anywhere else in the job's log is a failure.
        # Ray colours that prefix (an ANSI escape before the name) where its output is a tty.
        plain = [ANSI.sub("", line) for line in log.splitlines()]
        ours = [line for line in plain if not line.startswith("(TrainController")]
        assert not [line for line in ours if "Traceback" in line], log

    data_dir = a.log.parent
    with contextlib.closing(sqlite3.connect(data_dir / "jobs.db")) as database:
        state, reason = database.execute(
            "SELECT state, failure_reason FROM jobs WHERE id = ?", (long["id"],)
        ).fetchone()
        interrupted_at_step = database.execute(
            "SELECT max(step) FROM metrics WHERE job_id = ? AND kind = 'step'", (long["id"],)
        ).fetchone()[0]
    assert (state, reason) == ("INTERRUPTED", None)
    assert (data_dir / "logs" / f"{long['id']}.log").is_file()  # kept before the head went

    # The next service on a's data directory resumes the job from its latest checkpoint.
    again = services["a again"] = start_service(data_dir, token=TOKEN, env=ENV, timeout_s=180)
    client = again.client()
    ended = wait_for(
        lambda: (j := client.job(long["id"]))["state"] in ("SUCCEEDED", "FAILED") and j,
        "the resumed job to end",
        timeout_s=400,
    )
    assert ended["state"] == "SUCCEEDED", ended["failure_reason"]
    assert ended["progress"]["step"] == STEPS
    history = [(t["from_state"], t["to_state"]) for t in ended["transitions"]]
    assert ("RUNNING", "INTERRUPTED") in history
    assert ("INTERRUPTED", "QUEUED") in history
    assert "FAILED" not in str(history)
    points = client.metrics(long["id"], kinds=["step"])["points"]
    client.close()
    assert again.stop() == 0
    steps = [p["step"] for p in points]
    assert steps == list(range(10, STEPS + 1, 10))  # no step twice, none missing
    # The first life's records up to its checkpoint were kept, the rest done again: a
    # resume from the checkpoint, not from the start.
    before = [p["step"] for p in points if time_of(p) < stopped_at]
    after = [p["step"] for p in points if time_of(p) > stopped_at]
    assert before == steps[: len(before)]
    assert before[-1] % EVERY == 0  # ended at a checkpoint
    assert 2 * EVERY <= before[-1] <= interrupted_at_step
    assert after[0] == before[-1] + 10
    # Both lives' logs are kept in the service's copy, in order, past Ray's (which went with
    # each head); that a later start serves this copy is test_service_resume.py's.
    kept = (data_dir / "logs" / f"{long['id']}.log").read_text()
    first_life, second_life = submission_id(long["id"]), submission_id(long["id"], 1)
    assert f"Ray Job {first_life} -----" in kept
    assert f"Ray Job {second_life} -----" in kept
    assert kept.index(first_life) < kept.index(second_life)
    assert f"finished at step {STEPS}" in kept


def time_of(point: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(point["at"]).timestamp()
