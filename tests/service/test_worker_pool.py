"""The service's worker pool (``service.worker_pool``) on its own: real worker processes
(``python -m service.plan_worker``) running a BERT-Large plan on 4096 GPUs (minutes of
work), ended by a stop, by a client that went away, and by the death of their parent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.polling import wait_for

from service.worker_pool import PoolCancelledError, PoolStoppedError, WorkerPool

LONG_PLAN = {
    "kind": "plan",
    "request": {
        "model": "bert-large",
        "params": {},
        "batch_size": 8,
        "workers": 4096,
        "hardware": "a100-80gb-hdr",
        "intervals": [[10, 100]],
    },
}


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


async def started(pool: WorkerPool) -> int:
    """The pid of the pool's busy worker, once its task is running."""
    while not pool._busy:
        await asyncio.sleep(0.05)
    return next(iter(pool._busy)).process.pid


def test_a_stop_ends_a_task_in_flight_at_once() -> None:
    async def scenario() -> tuple[float, int]:
        pool = WorkerPool(what="plans", size=1, timeout_s=600, knob="--max-plans")
        task = asyncio.ensure_future(pool.run(LONG_PLAN))
        pid = await started(pool)
        await asyncio.sleep(0.5)  # planning
        began = time.monotonic()
        pool.stop_now()
        with pytest.raises(PoolStoppedError, match="the service is stopping"):
            await task
        took = time.monotonic() - began
        await pool.close()
        return took, pid

    took, pid = asyncio.run(scenario())
    assert took < 5  # POLL_S is 0.1 s: generous for a loaded machine
    assert not alive(pid)


def test_a_client_that_went_away_ends_its_task() -> None:
    async def scenario() -> tuple[int, dict[str, int]]:
        pool = WorkerPool(what="plans", size=1, timeout_s=600, knob="--max-plans")
        gone = False

        async def cancelled() -> bool:
            return gone

        task = asyncio.ensure_future(pool.run(LONG_PLAN, cancelled=cancelled))
        pid = await started(pool)
        gone = True
        with pytest.raises(PoolCancelledError):
            await task
        assert pool.running == 0
        await pool.close()
        return pid, pool.outcomes

    pid, outcomes = asyncio.run(scenario())
    assert not alive(pid)
    assert outcomes == {"cancelled": 1}


def test_a_client_that_went_away_while_its_worker_started_ends_its_task() -> None:
    """On a loaded machine a worker's start (an interpreter at the lowest priority) can take
    longer than the client waits: the slot is freed and the starting worker killed then, not
    once it has started."""

    async def scenario() -> tuple[set[int], list[bool], dict[str, int]]:
        pool = WorkerPool(what="plans", size=1, timeout_s=600, knob="--max-plans")
        spawned: set[int] = set()
        busy_when_asked: list[bool] = []

        async def cancelled() -> bool:  # gone from the start: asked first while it starts
            spawned.update(pool._pids)
            busy_when_asked.append(bool(pool._busy))
            return bool(spawned)

        with pytest.raises(PoolCancelledError):
            await pool.run(LONG_PLAN, cancelled=cancelled)
        assert pool.running == 0
        assert not pool._pids
        await pool.close()
        return spawned, busy_when_asked, pool.outcomes

    spawned, busy_when_asked, outcomes = asyncio.run(scenario())
    assert spawned
    assert not any(alive(pid) for pid in spawned)
    assert busy_when_asked
    assert not any(busy_when_asked)
    assert outcomes == {"cancelled": 1}


PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from service.worker_pool import WorkerPool
    from test_worker_pool import LONG_PLAN, started

    async def main():
        pool = WorkerPool(what="plans", size=1, timeout_s=600, knob="--max-plans")
        task = asyncio.ensure_future(pool.run(LONG_PLAN))
        print(await started(pool), flush=True)
        await task

    asyncio.run(main())
    """
)


def test_a_worker_dies_with_its_parent() -> None:
    """A service killed with -9 runs no lifespan: its workers go by themselves
    (PR_SET_PDEATHSIG), not on planning for minutes."""
    here = Path(__file__).parent  # this module, and tests/ (its support package)
    paths = [str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert alive(pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
    wait_for(lambda: not alive(pid), f"worker {pid} to die with its parent", timeout_s=10)
