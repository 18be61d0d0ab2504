"""Other people's Ray on this machine, for the tests of kaisa-ray beside them: a ``ray start
--head`` on Ray's default ports and temp directory, as a user types it (it writes
``/tmp/ray/ray_current_cluster``), and a second ``kaisa-ray serve`` with its embedded head.

Each is stopped by its own process group in teardown (never ``ray stop``: it would stop every
Ray on the machine), and ``/tmp/ray/ray_current_cluster`` is put back as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kaisa_train.head import free_port
from service.head import venv_path
from support.ray_head import RAY, TEST_ENV
from support.service_process import KAISA_RAY

ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")
DEFAULT_PORTS = {"gcs": 6379, "dashboard": 8265, "dashboard agent": 52365, "client server": 10001}


def _taken(port: int) -> bool:
    """Something listens on ``port`` (a bind would also fail on a port in TIME_WAIT, which Ray
    itself reuses)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


@dataclass
class DefaultPortsRay:
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def up(self, timeout_s: float = 120) -> bool:
        """Wait until it answers on the default ports and names itself in /tmp/ray (True), or
        it exits or the time is up (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            if (
                ADDRESS_FILE.is_file()
                and ADDRESS_FILE.read_text().strip().endswith(":6379")
                and _answers("http://127.0.0.1:8265/api/version")
            ):
                return True
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@contextlib.contextmanager
def ray_on_default_ports(log_dir: Path) -> Iterator[DefaultPortsRay]:
    """``ray start --head --block`` with Ray's defaults (ports 6379, 8265, 52365, 10001; temp
    dir /tmp/ray) and no token (a client that wrongly connects to it is not even refused).
    The agent's 52365 alone may be another free port (``_agent_port``)."""
    taken = [
        f"{name} {port}"
        for name, port in DEFAULT_PORTS.items()
        if name != "dashboard agent" and _taken(port)
    ]
    if taken:
        raise RuntimeError(
            f"Ray's default ports are taken ({', '.join(taken)}): another Ray on the defaults "
            "runs here; these tests start their own there"
        )
    agent_port = _agent_port()
    before = ADDRESS_FILE.read_text() if ADDRESS_FILE.is_file() else None
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[DefaultPortsRay] = []
    try:
        for attempt in (1, 2):  # Ray gives its raylet a fixed 30 s: a loaded machine may miss it
            log = log_dir / f"ray-on-default-ports-{attempt}.log"
            started.append(_start_on_default_ports(log, agent_port))
            if started[-1].up():
                break
            started[-1].stop()
        else:
            raise RuntimeError(f"ray start on the default ports failed:\n{started[-1].output()}")
        yield started[-1]
    finally:
        for other in started:
            other.stop()
            # Its session's logs (Ray names the folder after the `ray start` process).
            for session in ADDRESS_FILE.parent.glob(f"session_*_{other.process.pid}"):
                shutil.rmtree(session, ignore_errors=True)
        with contextlib.suppress(OSError):
            if before is None:
                ADDRESS_FILE.unlink()
            else:
                ADDRESS_FILE.write_text(before)


def _agent_port(wait_s: float = 30) -> int:
    """The dashboard agent's port: Ray's default, 52365, unless something else holds it.

    52365 lies inside the kernel's ephemeral range, so a port the kernel chose for one of the
    suite's own heads (their raylets, object managers and agents bind ports of the kernel's
    choosing) can sit on it; that is no other Ray on the defaults. After ``wait_s`` for it to
    be let go, the neighbour's agent takes a free port instead: it stays a Ray on the default
    GCS, dashboard and client-server ports and in /tmp/ray, which is what the tests are about.
    """
    default = DEFAULT_PORTS["dashboard agent"]
    deadline = time.monotonic() + wait_s
    while _taken(default):
        if time.monotonic() > deadline:
            return free_port()
        time.sleep(1)
    return default


def _start_on_default_ports(log: Path, agent_port: int) -> DefaultPortsRay:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "KAISA_RAY_"))}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                RAY,
                "start",
                "--head",
                "--block",
                "--num-cpus=1",
                f"--dashboard-agent-listen-port={agent_port}",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    return DefaultPortsRay(process, log)


@dataclass
class MakeRun:
    """``kaisa-ray serve --submit JOB``, what ``make run`` runs, with its terminal's output."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        """Ctrl-C (SIGINT), as in its terminal; its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        return self.process.returncode


@contextlib.contextmanager
def make_run(data_dir: Path, job: Path, *, timeout_s: float = 120) -> Iterator[MakeRun]:
    """``kaisa-ray serve --submit JOB`` (no token, on loopback: as ``make run``) on a data
    directory and a port of its own, up once ``/readyz`` answers."""
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "make-run.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAISA_RAY_", "RAY_"))}
    env.update(TEST_ENV, PATH=venv_path())
    command = [KAISA_RAY, "serve", "--port", str(port), "--data-dir", str(data_dir)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, "--submit", str(job)], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    served = MakeRun(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + timeout_s
        # Its own uvicorn on the port (not another test's service there) before /readyz.
        bound = f"Uvicorn running on {served.url} "
        while not (bound in served.output() and _answers(f"{served.url}/readyz")):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kaisa-ray serve did not come up:\n{served.output()}")
            time.sleep(0.5)
        yield served
    finally:
        served.stop()


@contextlib.contextmanager
def neighbours(log_dir: Path, job: Path) -> Iterator[tuple[DefaultPortsRay, MakeRun]]:
    """Another user's ``ray start --head`` on the default ports, and another ``kaisa-ray
    serve`` (its embedded head on ports of its own) running ``job`` as ``make run`` does."""
    with ray_on_default_ports(log_dir) as other, make_run(log_dir / "service", job) as served:
        yield other, served
