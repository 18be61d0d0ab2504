"""The real service as a child process (``kaisa-ray serve``) for the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.client import ServiceClient
from service.head import venv_path

KAISA_RAY = str(Path(sys.executable).with_name("kaisa-ray"))


@dataclass
class ServiceProcess:
    process: subprocess.Popen[bytes]
    url: str
    token: str | None  # None: the loopback default, no token
    log: Path

    def client(self) -> ServiceClient:
        return ServiceClient(self.url, self.token)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the service's log, for a failure's message."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL: the service dies without any clean-up (a crash)."""
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self, timeout: float = 60) -> int:
        """SIGINT, as Ctrl-C: uvicorn shuts down and the lifespan cleans up."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
                raise
        return self.process.returncode


def start_service(
    data_dir: Path,
    *,
    token: str | None,
    ray_address: str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 120,
    log_name: str = "service.log",
    port: int | None = None,
) -> ServiceProcess:
    """``kaisa-ray serve`` on ``port``, or by default on a port the OS picks as uvicorn binds
    (``--port 0``: no port is chosen, released and bound again); returns once ``/readyz`` says
    ready. A given port (a restart's) that something else took meanwhile fails with
    ``PortTakenError``."""
    return _start_service(data_dir, port or 0, token, ray_address, env, timeout_s, log_name)


def _written_since(log: Path, offset: int) -> str:
    with log.open("rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


class PortTakenError(RuntimeError):
    """The service exited because its port was taken before it could bind it."""


def _start_service(
    data_dir: Path,
    port: int,
    token: str | None,
    ray_address: str | None,
    env: dict[str, str] | None,
    timeout_s: float,
    log_name: str,
) -> ServiceProcess:
    command = [
        KAISA_RAY,
        "serve",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
    ]
    if ray_address is not None:
        command += ["--ray-address", ray_address]
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / log_name
    # The token in the environment, as the README says (a command line is visible to all).
    child_env = {**os.environ, **(env or {}), "PATH": venv_path()}
    child_env.pop("KAISA_RAY_TOKEN", None)
    if token is not None:
        child_env["KAISA_RAY_TOKEN"] = token
    child_env.pop("RAY_ADDRESS", None)
    with log.open("ab") as out:
        start = out.tell()  # a restart appends: only what this process writes counts
        process = subprocess.Popen(command, env=child_env, stdout=out, stderr=subprocess.STDOUT)
    service = ServiceProcess(process, f"http://127.0.0.1:{port}", token, log)
    # Its own uvicorn's start line (a service of another test may answer on a port before
    # this one binds it): the port, when the OS picked it.
    bound = str(port) if port else r"\d+"
    running = re.compile(rf"Uvicorn running on (http://127\.0\.0\.1:{bound}) ")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            text = _written_since(log, start)
            error = (
                PortTakenError
                if f"address ('127.0.0.1', {port}): address already in use" in text
                else RuntimeError
            )
            raise error(f"kaisa-ray serve exited with {process.returncode}:\n{text}")
        found = running.search(_written_since(log, start))
        if found:
            service.url = found[1]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{service.url}/readyz", timeout=2).status_code == 200:
                    return service
        time.sleep(0.5)
    service.stop()
    raise RuntimeError(f"the service was not ready in {timeout_s} s:\n{log.read_text()}")
