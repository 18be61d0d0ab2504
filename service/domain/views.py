"""A read cache for the API's hot reads (``GET /v1/jobs/{id}``, ``GET /v1/jobs``).

Clients poll these; between two writes to the store every poll would read and serialise the
same rows again. ``ViewCache`` keeps each answer's JSON bytes with the store version it was
read at and serves it while the version stands, on the event loop (no thread hop, no
query). Concurrent misses for one key share one read. Any write moves the version, so an
answer is never older than the last write the asking request could know of.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable

from starlette.concurrency import run_in_threadpool


class ViewCache:
    def __init__(self, version: Callable[[], int], *, max_entries: int = 4096) -> None:
        self._version = version
        self._max_entries = max_entries
        self._done: dict[Hashable, tuple[int, bytes]] = {}
        self._reading: dict[Hashable, tuple[int, asyncio.Future[bytes]]] = {}
        self.hits = 0
        self.misses = 0

    async def get(self, key: Hashable, read: Callable[[], bytes]) -> bytes:
        """The answer for ``key``: cached when no write came since it was read, else
        ``read()`` in a worker thread (its exceptions, such as a 404, are not cached)."""
        version = self._version()
        done = self._done.get(key)
        if done is not None and done[0] == version:
            self.hits += 1
            return done[1]
        reading = self._reading.get(key)
        if reading is not None and reading[0] == version:
            self.hits += 1
            return await asyncio.shield(reading[1])
        self.misses += 1
        task: asyncio.Future[bytes] = asyncio.ensure_future(run_in_threadpool(read))
        task.add_done_callback(_retrieve)  # a failure nobody waits for any more is not logged
        self._reading[key] = (version, task)
        try:
            value = await asyncio.shield(task)
        finally:
            if self._reading.get(key, (None, None))[1] is task:
                del self._reading[key]
        if len(self._done) >= self._max_entries:
            self._done.clear()
        self._done[key] = (version, value)
        return value


def _retrieve(task: asyncio.Future[bytes]) -> None:
    if not task.cancelled():
        task.exception()
