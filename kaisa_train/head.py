"""A Ray head of its own: ``ray start --head --block`` that nothing of another Ray instance
on the machine can reach, and that reaches nothing of theirs.

Several Ray instances on one machine meet in three places, and a head from ``start_head``
avoids each:

- **Ports.** ``ray start`` has fixed defaults (GCS 6379, dashboard 8265, the dashboard agent
  52365, the Ray client server 10001): a second head on the defaults fails to bind some of
  them (a dashboard agent on a taken port leaves the job server answering "No available
  agent to submit job"). The GCS's, the dashboard's and the client server's are chosen free
  here, outside the kernel's ephemeral range (``free_port``); the agent binds one of its own
  choosing and registers it; the others are Ray's own choices already.
- **The address.** A Ray process that is not told its cluster looks for one: ``RAY_ADDRESS``,
  else the ``ray_current_cluster`` file in ``/tmp/ray`` (left by the last ``ray start``, even
  a dead one), else every GCS it sees in the process table ("Found multiple active Ray
  instances"). Ray Train's placement-group cleaner and the State API clients inside a
  cluster's workers do exactly that. Every process of this head has ``RAY_ADDRESS`` pinned to
  it (the head's environment, which its workers inherit).
- **Files.** The head gets a temp directory of its own (``/tmp/kaisa-ray-head-*``: short,
  for Ray's socket paths), where ``ray start`` writes its ``ray_current_cluster``, and which
  ``stop`` removes: ``/tmp/ray`` is never touched.

The head runs in its own process group; ``Head.stop`` ends that group and every process
below the head (Ray starts some in sessions of their own).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from kaisa_ray.errors import ConfigurationError
from kaisa_train.ray_logs import quiet_environment

__all__ = [
    "Head",
    "HeadStartError",
    "free_port",
    "free_ports",
    "head_environment",
    "reachable",
    "start_head",
]

logger = logging.getLogger(__name__)

RAY = str(Path(sys.executable).with_name("ray"))
HEAD_PREFIX = "kaisa-ray-head-"
SERVICE_PREFIX = "KAISA_RAY_"  # the service's and the clients' variables (its token): never Ray's


class HeadStartError(ConfigurationError):
    """``ray start`` failed or the head did not come up; the message has its log's tail."""


# Ports handed to servers that another process binds later: below the kernel's ephemeral range
# (which every outgoing connection draws from, so a port the kernel chose for us and we
# released can be taken by a client socket before the server binds it: a dashboard agent that
# lost its port leaves the job server answering "No available agent") and above Ray's worker
# ports (10002-19999 by default).
SERVER_PORTS = (20000, 32768)


def free_port() -> int:
    """A TCP port nothing is bound to now, outside the ports the kernel hands to outgoing
    connections (``SERVER_PORTS``; the kernel's choice where none of those is free)."""
    low, high = SERVER_PORTS[0], min(SERVER_PORTS[1], _ephemeral_low())
    for _ in range(64 if high - low > 100 else 0):
        port = secrets.randbelow(high - low) + low
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        chosen: int = s.getsockname()[1]
        return chosen


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports, each as ``free_port`` gives one (one head's servers: drawn
    one by one, two could be the same port, which ``ray start`` refuses)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def reachable(address: str, timeout_s: float = 3.0) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` (a GCS, say)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def head_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (this process's environment) for a head: the venv's ``bin`` first on PATH (job
    entrypoints find ``kaisa-ray``), without ``KAISA_RAY_*`` (a service token must not reach
    Ray's processes) and without ``RAY_ADDRESS`` (``start_head`` pins the head's own)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()}
    env = {k: v for k, v in env.items() if not k.startswith(SERVICE_PREFIX)}
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@dataclass(frozen=True)
class Head:
    """A running head: where it is, and what ``stop`` needs."""

    gcs_address: str  # host:port, what RAY_ADDRESS and ray.init(address=...) take
    dashboard_url: str  # http://127.0.0.1:port, what `ray job submit --address` takes
    pid: int  # `ray start --block`, leader of the head's process group
    temp_dir: str
    log: str

    def running(self) -> bool:
        """The head's ``ray start`` process still runs."""
        return running(self.pid)

    def up(self) -> bool:
        """The head has started (``ray start`` wrote its address) and its dashboard answers."""
        if not (Path(self.temp_dir) / "ray_current_cluster").is_file():
            return False
        try:
            with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2):
                return True
        except urllib.error.HTTPError:  # it answers (401 without the token): it is up
            return True
        except OSError:
            return False

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop this head and every process it started, and remove its temp directory.

        SIGTERM to its process group, SIGKILL after ``grace_s`` (a GCS drains for about 30 s
        on SIGTERM; nothing here needs that) to the group and to every process found below the
        head before (Ray starts job drivers in sessions of their own).
        """
        family = descendants(self.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and running(self.pid):
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in family:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        running(self.pid)  # reap it, if it is our child
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Head:
        return cls(**json.loads(text))


def descendants(pid: int) -> list[int]:
    """The ids of every process below ``pid`` now (from /proc: each process's parent)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def running(pid: int) -> bool:
    """Whether process ``pid`` is alive (reaping it if it is our own exited child)."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)  # our own child: reap it
        return reaped == 0
    except ChildProcessError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """SIGTERM this process when the process that started it dies (Linux), so that a head
    started for one command does not outlive a command killed with SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


TRANSIENT = (
    "timed out during startup",
    "Timed out waiting for node info",
    "address already in use",
    "Address already in use",
)
"""What a second try may not meet: Ray's raylet not registered within Ray's fixed 30 s (an
overloaded machine; the raylet's own start, or the Ray Client server's wait for it, after which
``ray start --block`` kills the whole head), or a port chosen free taken by someone else before
Ray bound it."""


_Started = TypeVar("_Started")


def once_more_if_transient(
    attempt: Callable[[], _Started], failure: type[Exception] = HeadStartError
) -> _Started:
    """``attempt()`` (one try of starting a head), and once more where it raised ``failure``
    naming one of the ``TRANSIENT`` causes; any other failure, or a second one, is raised."""
    try:
        return attempt()
    except failure as err:
        if not any(sign in str(err) for sign in TRANSIENT):
            raise
        logger.warning("starting a Ray head failed (%s); trying once more", str(err)[-200:])
        return attempt()


def listening(port: int) -> bool:
    """Something on this machine listens on TCP ``port``, on any address (read from
    ``/proc/net``, never by binding it: a bind would race the process about to bind it).
    True where ``/proc/net`` is absent (not Linux): nothing to wait for there."""
    found = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        found = True
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                return True
    return not found


def ray_start_command(
    temp_dir: str,
    gcs: int,
    dashboard: int,
    client: int,
    num_cpus: float | None = None,
    object_store_bytes: int | None = None,
) -> list[str]:
    """``ray start --head --block`` on the given ports (the dashboard agent's: a free one), in
    ``temp_dir``, dashboard on loopback only. ``client`` is the Ray Client server's port: Ray
    starts one wherever its client extra is installed, and nothing here turns it off; the head
    is up once it listens (it waits up to 30 s for the raylet, and ends the head when that
    runs out)."""
    command = [
        RAY,
        "start",
        "--head",
        "--block",
        f"--temp-dir={temp_dir}",
        f"--port={gcs}",
        # The dashboard: the job server, and the State API that Ray Train's placement-group
        # cleaner asks whether a run's controller still lives.
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        "--dashboard-agent-listen-port=0",  # the agent binds a port of its own and registers it
        f"--ray-client-server-port={client}",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus:g}")
    if object_store_bytes is not None:
        command.append(f"--object-store-memory={object_store_bytes}")
    return command


def start_head(
    *,
    env: Mapping[str, str] | None = None,
    num_cpus: float | None = None,
    object_store_bytes: int | None = None,
    tied_to_this_process: bool = False,
    timeout_s: float = 120,
    temp_root: str = "/tmp",
) -> Head:
    """Start ``ray start --head --block`` on free ports in a temp directory of its own, with
    ``RAY_ADDRESS`` pinned to it in its environment, and wait until it is up.

    Args:
        env: The head's environment [default: ``head_environment()``]; Ray's auth settings
            (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``) come from it.
        num_cpus: Logical CPUs [default: Ray's, the machine's cores].
        object_store_bytes: The object store's size [default: Ray's].
        tied_to_this_process: The head stops when this process dies, even by SIGKILL.
        timeout_s: How long to wait for it.
        temp_root: Where its temp directory goes (short: Ray's socket paths are limited).

    Raises:
        HeadStartError: ``ray start`` exited or the head did not come up in ``timeout_s``
            (the message has the end of its log), twice when the first failure was transient.
    """
    attempt = functools.partial(
        _start_once,
        env=env,
        num_cpus=num_cpus,
        object_store_bytes=object_store_bytes,
        tied_to_this_process=tied_to_this_process,
        timeout_s=timeout_s,
        temp_root=temp_root,
    )
    return once_more_if_transient(attempt)


def _start_once(
    *,
    env: Mapping[str, str] | None = None,
    num_cpus: float | None = None,
    object_store_bytes: int | None = None,
    tied_to_this_process: bool = False,
    timeout_s: float = 120,
    temp_root: str = "/tmp",
) -> Head:
    """One try of ``start_head``."""
    head_env = dict(head_environment() if env is None else env)
    quiet_environment(head_env)  # Ray Data's INFO lines stay in its log, out of the job's
    gcs, dashboard, client = free_ports(3)
    head_env["RAY_ADDRESS"] = f"127.0.0.1:{gcs}"  # every process of this head: this head
    temp_dir = tempfile.mkdtemp(prefix=HEAD_PREFIX, dir=temp_root)
    log = Path(temp_dir) / "ray-start.log"
    command = ray_start_command(temp_dir, gcs, dashboard, client, num_cpus, object_store_bytes)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            env=head_env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=_die_with_parent if tied_to_this_process else None,
        )
    head = Head(
        gcs_address=f"127.0.0.1:{gcs}",
        dashboard_url=f"http://127.0.0.1:{dashboard}",
        pid=process.pid,
        temp_dir=temp_dir,
        log=str(log),
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = _tail(log)
            head.stop()
            raise HeadStartError(f"`ray start --head` exited with {process.returncode}:\n{tail}")
        if head.up() and listening(client):
            logger.info("Ray head up at %s (dashboard %s)", head.gcs_address, head.dashboard_url)
            return head
        time.sleep(0.25)
    tail = _tail(log)
    head.stop()
    raise HeadStartError(f"the Ray head did not come up within {timeout_s:g} s:\n{tail}")


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
