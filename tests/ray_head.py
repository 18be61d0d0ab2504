"""A real Ray head for the tests: ``ray start --head --block`` with the job server, token auth on.

One head serves the whole pytest run (a session fixture in ``conftest.py``): the tests connect
with ``ray.init(address=...)``, submit Ray Jobs to its dashboard, and the teardown stops exactly
this head (SIGTERM to the blocking ``ray start``), not other Ray clusters on the machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))

# ENVIRONMENT.md: fast, reliable Ray in tests.
TEST_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_memory_monitor_refresh_ms": "0",
}


def _path() -> str:
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RayHead:
    gcs_address: str
    dashboard_url: str
    token: str
    process: subprocess.Popen[bytes]
    log: Path

    def client_env(self, *, with_token: bool = True) -> dict[str, str]:
        """Environment for a CLI/SDK client of this head (token auth, as on a cluster)."""
        env = {**os.environ, **TEST_ENV, "RAY_AUTH_MODE": "token", "PATH": _path()}
        env.pop("RAY_AUTH_TOKEN", None)
        env.pop("RAY_ADDRESS", None)
        if with_token:
            env["RAY_AUTH_TOKEN"] = self.token
        return env

    def stop(self, grace_s: float = 5) -> None:
        """Stop this head and every process it started (its own process group).

        A graceful stop waits about 30 s for the GCS to drain; nothing here needs that, so
        after ``grace_s`` the group is killed.
        """
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        # Like `ray stop`: forget this head as the machine's default cluster, so that a later
        # local ray.init() starts its own instead of trying to reach this dead one.
        address_file = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        with contextlib.suppress(OSError):
            port = self.gcs_address.rsplit(":", 1)[1]
            if address_file.read_text().strip().endswith(f":{port}"):
                address_file.unlink()


def start_head(
    log_dir: Path, *, token: str | None = None, num_cpus: int = 4, timeout_s: float = 120
) -> RayHead:
    token = token or secrets.token_hex(16)
    gcs, dashboard = free_port(), free_port()
    env = {**os.environ, **TEST_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env["PATH"] = _path()  # as with an activated venv: job entrypoints find `kaisa-ray`
    env.pop("RAY_ADDRESS", None)
    log = log_dir / "ray-head.log"
    command = [
        RAY,
        "start",
        "--head",
        "--block",
        f"--port={gcs}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        f"--num-cpus={num_cpus}",
        f"--object-store-memory={100 * 2**20}",
        "--disable-usage-stats",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    head = RayHead(
        gcs_address=f"127.0.0.1:{gcs}",
        dashboard_url=f"http://127.0.0.1:{dashboard}",
        token=token,
        process=process,
        log=log,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}:\n{log.read_text()}")
        request = urllib.request.Request(
            f"{head.dashboard_url}/api/version", headers={"Authorization": f"Bearer {token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return head
        except OSError:
            pass
        time.sleep(0.5)
    head.stop()
    raise RuntimeError(f"the Ray head did not come up in {timeout_s} s:\n{log.read_text()}")
