"""A bounded pool of worker processes for the service's CPU-bound work (``plan_worker``).

A plan for BERT-Large on 4096 GPUs is minutes of pure Python; on the request thread pool, 40
of them held every thread and the GIL, so ``/v1/jobs``, ``/readyz`` and even a SIGTERM waited
for them (issue 30). Here each task runs in a process of its own (at the lowest CPU priority,
so requests go first), and:

- at most ``size`` run at once; one more is refused at once with ``PoolBusyError`` (429 with
  ``Retry-After``: when the soonest running task must end), or, with ``wait_s``, waits that
  long for a worker first;
- a task that runs past ``timeout_s`` is ended (its process killed): ``PoolTimeoutError``;
- a task whose client has gone (``cancelled()`` answers True), while it runs or while its
  worker starts, is ended: the work is lost to no one (``PoolCancelledError``);
- ``stop_now()`` (safe in a signal handler: SIGTERM) kills every worker at once, and every
  task in flight ends with ``PoolStoppedError``, so a stopping service waits for no plan.

Workers are started when first needed and kept for the next task; one idle for
``idle_s`` exits by itself. Everything runs on the event loop: no lock, no thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from service.errors import ServiceError

__all__ = [
    "PoolBusyError",
    "PoolCancelledError",
    "PoolStoppedError",
    "PoolTimeoutError",
    "WorkRefusedError",
    "WorkerPool",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

POLL_S = 0.1  # how often a task in flight looks at its client and at a stop
SECRET_PREFIXES = ("KAISA_RAY_", "RAY_AUTH_TOKEN")  # what a worker never needs to see


class PoolBusyError(ServiceError):
    status = 429

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(retry_after_s)}

    def __reduce__(self) -> tuple[type[PoolBusyError], tuple[str, int]]:
        return (type(self), (str(self), self.retry_after_s))


class PoolTimeoutError(ServiceError):
    status = 504


class PoolCancelledError(ServiceError):
    """The client went away; nobody reads the answer."""

    status = 499


class PoolStoppedError(ServiceError):
    status = 503


class WorkRefusedError(ServiceError):
    """The task cannot be done as asked (``ConfigurationError`` in the worker): 422."""

    status = 422


@dataclass(eq=False)  # a worker is itself: hashed by identity
class _Worker:
    process: asyncio.subprocess.Process
    started: float = field(default_factory=time.monotonic)
    busy_since: float | None = None

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


class WorkerPool:
    """See the module docstring. ``what`` names the work in messages ("plans")."""

    def __init__(
        self,
        *,
        what: str,
        size: int,
        timeout_s: float,
        knob: str,
        wait_s: float = 0,
        start_timeout_s: float = 120,
        idle_s: float = 600,
    ) -> None:
        if size < 1 or timeout_s <= 0:
            raise ValueError(f"a pool needs size >= 1 and timeout_s > 0, got {size}, {timeout_s}")
        self.what, self.size, self.timeout_s, self.knob = what, size, timeout_s, knob
        self.wait_s, self.start_timeout_s, self.idle_s = wait_s, start_timeout_s, idle_s
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._starting = 0
        self._pids: set[int] = set()  # every worker's, for stop_now
        self.stopping = False
        self.outcomes: dict[str, int] = {}  # for /metrics: ok, refused, busy, timeout, ...

    @property
    def running(self) -> int:
        return len(self._busy) + self._starting

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    # -- the task ----------------------------------------------------------------------------

    async def run(
        self, task: dict[str, Any], *, cancelled: Callable[[], Awaitable[bool]] | None = None
    ) -> Any:
        """The worker's result for ``task``; raises the pool's errors (module docstring)."""
        if self.stopping:
            raise PoolStoppedError("the service is stopping; retry when it is back")
        await self._free_slot()
        self._starting += 1
        starting = asyncio.ensure_future(self._worker())
        try:  # a worker's start can take long on a loaded machine: its client may go meanwhile
            worker = await self._watched(starting, cancelled, None)
        except BaseException:
            if starting.done() and not starting.cancelled() and starting.exception() is None:
                await self._kill(starting.result())  # started as its client went
            raise
        finally:
            self._starting -= 1
        self._busy.add(worker)
        worker.busy_since = time.monotonic()
        done = False
        try:
            answer = await self._exchange(worker, task, cancelled)
            done = True
        finally:
            self._busy.discard(worker)
            worker.busy_since = None
            if done and worker.alive and not self.stopping:
                self._idle.append(worker)
            else:
                await self._kill(worker)  # timed out, cancelled, stopped, or the task raised
        if "ok" in answer:
            self._count("ok")
            return answer["ok"]
        if "refused" in answer:
            self._count("refused")
            raise WorkRefusedError(str(answer["refused"]))
        self._count("error")
        raise RuntimeError(f"the {self.what} worker failed:\n{answer.get('error')}")

    async def _free_slot(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while self.running >= self.size:
            if self.stopping:
                raise PoolStoppedError("the service is stopping; retry when it is back")
            if time.monotonic() >= deadline:
                self._count("busy")
                retry = self._retry_after()
                raise PoolBusyError(
                    f"{self.size} {self.what} already running, the most this service runs at "
                    f"once ({self.knob}); retry in {retry} s",
                    retry,
                )
            await asyncio.sleep(POLL_S)

    def _retry_after(self) -> int:
        """Seconds until the soonest running task ends, at the latest (its time limit)."""
        now = time.monotonic()
        ends = [w.busy_since + self.timeout_s - now for w in self._busy if w.busy_since]
        return max(1, math.ceil(min(ends, default=1.0)))

    async def _exchange(
        self,
        worker: _Worker,
        task: dict[str, Any],
        cancelled: Callable[[], Awaitable[bool]] | None,
    ) -> dict[str, Any]:
        stdin, stdout = worker.process.stdin, worker.process.stdout
        if stdin is None or stdout is None:  # started with both piped: never
            raise RuntimeError("a worker without its pipes")
        stdin.write(json.dumps(task).encode() + b"\n")
        await stdin.drain()
        line = await self._watched(
            asyncio.ensure_future(stdout.readline()), cancelled, time.monotonic() + self.timeout_s
        )
        if not line and self.stopping:  # killed by stop_now before we looked
            self._count("stopped")
            raise PoolStoppedError("the service is stopping; retry when it is back")
        if not line:
            self._count("error")
            raise RuntimeError(
                f"the {self.what} worker (pid {worker.process.pid}) ended without an answer; "
                "see the service's log"
            )
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def _watched(
        self,
        work: asyncio.Future[T],
        cancelled: Callable[[], Awaitable[bool]] | None,
        deadline: float | None,
    ) -> T:
        """``work``'s result, unless the service stops, the client goes or ``deadline``
        passes first: then ``work`` is cancelled and the pool's error raised."""
        try:
            while True:
                left = POLL_S if deadline is None else deadline - time.monotonic()
                finished, _ = await asyncio.wait({work}, timeout=max(0.0, min(POLL_S, left)))
                if finished:
                    return work.result()
                if self.stopping:
                    self._count("stopped")
                    raise PoolStoppedError("the service is stopping; retry when it is back")
                if cancelled is not None and await cancelled():
                    self._count("cancelled")
                    raise PoolCancelledError("the client went away")
                if deadline is not None and time.monotonic() >= deadline:
                    self._count("timeout")
                    raise PoolTimeoutError(
                        f"over this service's time limit of {self.timeout_s:g} s ({self.knob})"
                    )
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work

    # -- the workers -------------------------------------------------------------------------

    async def _worker(self) -> _Worker:
        while self._idle:
            worker = self._idle.pop()
            if worker.alive and time.monotonic() - worker.started < self.idle_s * 0.9:
                return worker
            await self._kill(worker)  # exited on its own, or about to
        return await self._start()

    async def _start(self) -> _Worker:
        env = {k: v for k, v in os.environ.items() if not k.startswith(SECRET_PREFIXES)}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "service.plan_worker",
            f"--idle-s={self.idle_s:g}",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=2**26,  # a plan's JSON is one line
        )
        self._pids.add(process.pid)
        worker = _Worker(process)
        try:
            if process.stdout is None:  # started piped: never
                raise RuntimeError("a worker without its pipes")
            line = await asyncio.wait_for(process.stdout.readline(), self.start_timeout_s)
            if self.stopping:
                raise PoolStoppedError("the service is stopping; retry when it is back")
            if not line or "ready" not in json.loads(line):
                raise RuntimeError(f"a {self.what} worker did not start (see the service's log)")
        except BaseException:
            await self._kill(worker)
            raise
        logger.info("started a %s worker (pid %d)", self.what, process.pid)
        return worker

    async def _kill(self, worker: _Worker) -> None:
        process = worker.process
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        try:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(process.wait(), 5)
        finally:
            self._pids.discard(process.pid)

    def stop_now(self) -> None:
        """Kill every worker now and refuse new tasks. Plain calls only: safe in a signal
        handler (the tasks in flight see ``stopping`` within ``POLL_S``)."""
        self.stopping = True
        for pid in list(self._pids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    async def close(self) -> None:
        """``stop_now`` and reap the workers."""
        self.stop_now()
        for worker in [*self._idle, *self._busy]:
            await self._kill(worker)
        self._idle.clear()
