"""Live updates for the event streams: the follower thread publishes, each SSE client has a
queue on the event loop. Publishing never blocks; a client too slow to keep up loses the
oldest updates (its next ``state`` event still says where the job is)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Update:
    job_id: str
    kind: str  # "state", "progress", "eval", "tuner", "intervals", "trial", "sweep", "deleted"
    data: dict[str, Any]


EVERY_JOB = "*"
"""Subscribe to this to get the updates of every job (the dashboard's job list)."""


class Hub:
    def __init__(self, queue_size: int = 1000) -> None:
        self._queue_size = queue_size
        self._lock = threading.Lock()
        self._subscribers: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Update]]]]
        self._subscribers = {}

    def publish(self, update: Update) -> None:
        """Hand ``update`` to every subscriber of its job; safe from any thread."""
        with self._lock:
            targets = [
                *self._subscribers.get(update.job_id, ()),
                *self._subscribers.get(EVERY_JOB, ()),
            ]
        for loop, queue in targets:
            try:
                loop.call_soon_threadsafe(_offer, queue, update)
            except RuntimeError:  # the loop is closed: the client is gone
                continue

    @asynccontextmanager
    async def subscribe(self, job_id: str) -> AsyncIterator[asyncio.Queue[Update]]:
        queue: asyncio.Queue[Update] = asyncio.Queue(self._queue_size)
        entry = (asyncio.get_running_loop(), queue)
        with self._lock:
            self._subscribers.setdefault(job_id, set()).add(entry)
        try:
            yield queue
        finally:
            with self._lock:
                subscribers = self._subscribers.get(job_id, set())
                subscribers.discard(entry)
                if not subscribers:
                    self._subscribers.pop(job_id, None)

    def subscribers(self, job_id: str) -> int:
        with self._lock:
            return len(self._subscribers.get(job_id, ()))


def _offer(queue: asyncio.Queue[Update], update: Update) -> None:
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(update)
