"""The service as an operator runs it, with real parts (issue 18): two ``kaisa-ray serve``
processes, each with its embedded Ray head, side by side on one machine; their Ray
processes' environments; and SIGTERM. Two service start-ups, at once, for the module (the
README's service quickstart, with its own, is ``test_service_quickstart.py``)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.service_process import ServiceProcess, start_service

from service.head import RayHead, descendants

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "ops-token-0123456789"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # a colour escape in a log line
MARKER = "KAISA_RAY_MAX_WORKERS"  # a service variable set in the services' environment


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
    env = {MARKER: "8", "KAISA_RAY_EMBEDDED_CPUS": "3"}
    started: dict[str, ServiceProcess] = {}
    dirs = {name: tmp_path_factory.mktemp(f"ops-{name}") for name in ("a", "b")}
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once: the start-ups overlap
            futures = {
                name: pool.submit(start_service, where, token=TOKEN, env=env, timeout_s=180)
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
        for service in started.values():
            if service.process.poll() is None:
                service.stop()
                head = RayHead.load(service.log.parent / "ray" / "head.json")
                if head is not None:
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


@pytest.mark.timeout(900)  # two services' jobs, beside the suite's heaviest modules
def test_two_services_side_by_side_each_job_sees_only_its_own_cluster(
    services: dict[str, ServiceProcess],
) -> None:
    """A job on each service: b's runs to SUCCEEDED, a's (long) trains; neither log mentions
    other Ray instances or the other cluster's address; while the long job runs, no Ray
    process of either head (head, raylet, workers, the job's driver and train worker) has a
    service variable or the service's token in its environment; then SIGTERM stops service a,
    its head and every process it started, the long job's among them, while service b goes
    on."""
    a, b = services["a"], services["b"]
    heads = {name: head_of(service) for name, service in services.items()}
    assert heads["a"].gcs_address != heads["b"].gcs_address
    assert heads["a"].temp_dir != heads["b"].temp_dir
    clients = {name: service.client() for name, service in services.items()}
    jobs = {
        "a": clients["a"].submit(quick_job("long", 1_000_000)),
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
    done = wait_for(
        lambda: (j := clients["b"].job(jobs["b"]["id"]))["state"] in ("SUCCEEDED", "FAILED") and j,
        "job b to end",
        timeout_s=300,
    )
    assert done["state"] == "SUCCEEDED", done["failure_reason"]
    logs = {name: clients[name].logs(jobs[name]["id"]) for name in services}
    assert "finished at step 30" in logs["b"]
    assert "Running entrypoint for job" in logs["a"]  # the long job's log, as far as it got
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
    assert b.process.poll() is None

    # SIGTERM, what systemd, Docker and Kubernetes send, to service a while its long job
    # trains: within 20 s the service, its Ray head and every process below them (the job's
    # driver and train worker too) are gone, and the log says the shutdown completed (the
    # stop's phases are bounded at about 12 s, docs/service.md; on a quiet machine it takes
    # 3-4 s, and the rest is for a CI machine busy with other tests). (A cancel on the real
    # Ray: tests/service/test_service_e2e.py.)
    assert clients["a"].job(long["id"])["state"] == "RUNNING"
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
    assert took < 20
    assert a.process.returncode == 0
    assert "shutdown complete" in a.log.read_text()
    print(f"SIGTERM: {len(family)} processes gone in {took:.1f} s")
    assert b.process.poll() is None  # the other service did not notice
