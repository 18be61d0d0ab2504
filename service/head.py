"""A local Ray head with the job server: ``ray start --head --block`` in its own process group.

The service starts one when no Ray address is configured (the embedded head), and the tests
start one per pytest run. The head runs in its own process group, so a killed service (or a
Ctrl-C to the terminal's group) leaves it and the jobs on it running; the next service on the
same data directory finds it through ``head.json`` and adopts it, and a graceful shutdown
stops it. It stays in the service's session: with the kernel's autogroup scheduling, a new
session would be a scheduling group of its own, sharing the CPU equally with the service, and
the nice level Ray gives its workers (15) would no longer make them yield to the service.

One head, one cluster: the head gets a Ray temp directory of its own (``/tmp/kaisa-ray-*``:
Ray's sockets need a short path), where ``ray start`` records its address, and every process it
starts has ``RAY_ADDRESS`` pinned to it, so that nothing on it ever looks for "the latest
cluster" among other Ray instances on the machine. The service's own variables
(``KAISA_RAY_*``: its token above all) are removed from the head's environment, which every
Ray process inherits. Its dashboard (the job server) listens on loopback only; Ray 2.60's GCS
and raylet listen on every interface (no option changes that) and require the head's token.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from kaisa_train.head import RAY as RAY  # re-exported: the tests start heads with it
from kaisa_train.head import (
    descendants,
    free_ports,
    listening,
    once_more_if_transient,
    ray_start_command,
    running,
)
from kaisa_train.ray_logs import quiet_environment

logger = logging.getLogger(__name__)


def venv_path() -> str:
    """PATH with this interpreter's bin first, so that job entrypoints find ``kaisa-ray``."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


SERVICE_PREFIX = "KAISA_RAY_"
"""The service's environment variables: never handed to Ray's processes."""


def ray_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a Ray process it starts: without the service's own
    variables and without ``RAY_ADDRESS`` (the caller pins its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SERVICE_PREFIX)}
    env.update(extra or {})
    env.pop("RAY_ADDRESS", None)
    return env


@dataclass
class RayHead:
    gcs_address: str
    dashboard_url: str
    token: str
    pid: int
    log: str
    temp_dir: str = ""  # the head's own Ray temp directory (empty: Ray's default)

    def alive(self) -> bool:
        """The head answers on its dashboard (with the token)."""
        request = urllib.request.Request(
            f"{self.dashboard_url}/api/version",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def client_env(self, *, with_token: bool = True) -> dict[str, str]:
        """Environment for a CLI/SDK client of this head (token auth, as on a cluster)."""
        env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": venv_path()}
        env.pop("RAY_AUTH_TOKEN", None)
        env.pop("RAY_ADDRESS", None)
        if with_token:
            env["RAY_AUTH_TOKEN"] = self.token
        return env

    def stop(self, grace_s: float = 5) -> None:
        """Stop this head and every process it started (its own process group).

        A graceful stop waits about 30 s for the GCS to drain; nothing here needs that, so
        after ``grace_s`` the group is killed (at once where ``grace_s`` is 0).
        """
        # Ray's job drivers run in sessions of their own (Ray starts them so): found by descent
        # from the head before it goes, and killed with it.
        family = descendants(self.pid)
        if grace_s > 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and running(self.pid):
                time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in family:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        # Like `ray stop`: forget this head as the machine's default cluster, so that a later
        # local ray.init() starts its own instead of trying to reach this dead one.
        address_file = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        with contextlib.suppress(OSError):
            port = self.gcs_address.rsplit(":", 1)[1]
            if address_file.read_text().strip().endswith(f":{port}"):
                address_file.unlink()
        # The head's own temp directory (sockets, session logs): nothing reads it once the
        # head is gone. Its private parent (``start_head``) goes with it.
        if self.temp_dir:
            ours = Path(self.temp_dir)
            if ours.name == "ray" and ours.parent.name.startswith("kaisa-ray-"):
                shutil.rmtree(ours.parent, ignore_errors=True)
            elif ours.name.startswith("kaisa-ray-"):  # a head started before the parent
                shutil.rmtree(ours, ignore_errors=True)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))
        path.chmod(0o600)  # it holds the token

    @classmethod
    def load(cls, path: Path) -> RayHead | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def start_head(
    log_dir: Path,
    *,
    token: str | None = None,
    num_cpus: int | None = None,
    object_store_bytes: int | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 120,
) -> RayHead:
    """Start ``ray start --head --block`` (job server on, token auth on) on free ports; once
    more where the first try failed as a loaded machine or a port race can make it fail."""
    token = token or secrets.token_hex(16)
    return once_more_if_transient(
        lambda: _start_once(log_dir, token, num_cpus, object_store_bytes, env, timeout_s),
        RuntimeError,
    )


def _start_once(
    log_dir: Path,
    token: str,
    num_cpus: int | None,
    object_store_bytes: int | None,
    env: dict[str, str] | None,
    timeout_s: float,
) -> RayHead:
    """One try of ``start_head``."""
    gcs, dashboard, client = free_ports(3)
    head_env = ray_environment(env)
    head_env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, PATH=venv_path())
    head_env["RAY_ADDRESS"] = f"127.0.0.1:{gcs}"  # every Ray process of this head: this head
    quiet_environment(head_env)  # Ray Data's INFO lines stay in its log, out of the job's
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "ray-head.log"
    # Short (Ray's socket paths), and private: every Ray process that starts or connects
    # makes its temp directory world-writable (chmod 0777), so it lives in a folder of its
    # own that only this user can enter (mkdtemp's 0700), removed when the head stops.
    temp_dir = os.path.join(tempfile.mkdtemp(prefix="kaisa-ray-", dir="/tmp"), "ray")
    command = ray_start_command(temp_dir, gcs, dashboard, client, num_cpus, object_store_bytes)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=head_env, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )
    head = RayHead(
        gcs_address=f"127.0.0.1:{gcs}",
        dashboard_url=f"http://127.0.0.1:{dashboard}",
        token=token,
        pid=process.pid,
        log=str(log),
        temp_dir=temp_dir,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            head.stop(grace_s=1)  # what it started, and its temp directory
            raise RuntimeError(f"ray start exited with {process.returncode}:\n{log.read_text()}")
        if head.alive() and listening(client):
            logger.info("Ray head up at %s (dashboard %s)", head.gcs_address, head.dashboard_url)
            return head
        time.sleep(0.5)
    head.stop()
    raise RuntimeError(f"the Ray head did not come up in {timeout_s} s:\n{log.read_text()}")


def adopt_or_start(data_dir: Path, *, num_cpus: int | None = None) -> tuple[RayHead, bool]:
    """The embedded head of a service on ``data_dir``: the one an earlier service started
    there, if it still runs (a restart after a crash), else a new one. Returns it and
    whether it was adopted."""
    record = data_dir / "ray" / "head.json"
    head = RayHead.load(record)
    if head is not None and head.alive():
        logger.info("adopting the running Ray head at %s", head.gcs_address)
        return head, True
    token = os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(16)
    head = start_head(data_dir / "ray", token=token, num_cpus=num_cpus)
    head.save(record)
    return head, False
