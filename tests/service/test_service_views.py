"""The read cache behind GET /v1/jobs and GET /v1/jobs/{id}: served while the store's
version stands, read again after any write, one read for concurrent misses, errors never
cached; and, on the real store, an answer is never older than the last write."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from service.domain.views import ViewCache
from service.errors import JobNotFoundError
from service.model.lifecycle import IllegalTransitionError, JobEvent
from service.store.repository import JobStore


class Counter:
    def __init__(self, value: bytes = b"v") -> None:
        self.calls = 0
        self.value = value
        self.gate: threading.Event | None = None

    def __call__(self) -> bytes:
        self.calls += 1
        if self.gate is not None:
            assert self.gate.wait(5)
        return self.value + str(self.calls).encode()


def test_served_from_cache_until_the_version_moves() -> None:
    version = [0]
    cache = ViewCache(lambda: version[0])
    read = Counter()

    async def run() -> list[bytes]:
        answers = [await cache.get("k", read) for _ in range(3)]
        version[0] += 1
        answers.append(await cache.get("k", read))
        answers.append(await cache.get("other", read))
        return answers

    assert asyncio.run(run()) == [b"v1", b"v1", b"v1", b"v2", b"v3"]
    assert (read.calls, cache.hits, cache.misses) == (3, 2, 3)


def test_concurrent_misses_share_one_read() -> None:
    cache = ViewCache(lambda: 0)
    read = Counter()
    read.gate = threading.Event()

    async def run() -> list[bytes]:
        tasks = [asyncio.ensure_future(cache.get("k", read)) for _ in range(20)]
        await asyncio.sleep(0.05)
        read.gate.set()  # type: ignore[union-attr]
        return list(await asyncio.gather(*tasks))

    assert asyncio.run(run()) == [b"v1"] * 20
    assert read.calls == 1


def test_errors_are_not_cached() -> None:
    cache = ViewCache(lambda: 0)
    calls = []

    def missing() -> bytes:
        calls.append(1)
        raise JobNotFoundError("nope")

    async def run() -> None:
        for _ in range(2):
            with pytest.raises(JobNotFoundError):
                await cache.get("k", missing)

    asyncio.run(run())
    assert len(calls) == 2


def test_a_cancelled_asker_does_not_break_the_others() -> None:
    cache = ViewCache(lambda: 0)
    read = Counter()
    read.gate = threading.Event()

    async def run() -> bytes:
        first = asyncio.ensure_future(cache.get("k", read))
        second = asyncio.ensure_future(cache.get("k", read))
        await asyncio.sleep(0.05)
        first.cancel()  # the client that caused the read went away
        read.gate.set()  # type: ignore[union-attr]
        return await second

    assert asyncio.run(run()) == b"v1"
    assert read.calls == 1


def test_bounded() -> None:
    cache = ViewCache(lambda: 0, max_entries=4)
    read = Counter()

    async def run() -> None:
        for key in range(10):
            await cache.get(key, read)

    asyncio.run(run())
    assert len(cache._done) <= 4


def test_every_write_of_the_store_moves_its_version(tmp_path: Path) -> None:
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    try:
        seen = [store.version_now()]
        job, _ = store.create({"name": "a"})
        seen.append(store.version_now())
        store.set_submission(job.id, "kaisa-ray-x")
        seen.append(store.version_now())
        store.apply(job.id, JobEvent.RUN)
        seen.append(store.version_now())
        with pytest.raises(IllegalTransitionError):
            store.apply(job.id, JobEvent.PROFILE)  # illegal from RUNNING: rolled back
        seen.append(store.version_now())
        store.get(job.id)
        store.page()
        store.detail(job.id)
        seen.append(store.version_now())  # reads do not move it
        assert seen[:5] == sorted(set(seen[:5]))  # each write moved it
        assert seen[5] == seen[4]
    finally:
        store.close()


def test_cached_answers_follow_the_store(tmp_path: Path) -> None:
    """Reads through the cache, interleaved with writes, always see the latest state."""
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    cache = ViewCache(store.version_now)
    try:
        job, _ = store.create({"name": "a"})

        async def state() -> bytes:
            return await cache.get(job.id, lambda: store.get(job.id).state.value.encode())

        async def run() -> list[bytes]:
            answers = [await state(), await state()]
            store.set_submission(job.id, "kaisa-ray-x")
            store.apply(job.id, JobEvent.RUN)
            answers.append(await state())
            store.apply(job.id, JobEvent.CANCEL, "by a test")
            answers.append(await state())
            return answers

        assert asyncio.run(run()) == [b"QUEUED", b"QUEUED", b"RUNNING", b"CANCELLING"]
    finally:
        store.close()
