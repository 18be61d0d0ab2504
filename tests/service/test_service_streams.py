"""A job's event stream behind the follower: the store is ahead of what the stream has sent,
and the stream still sends every update, ending on the one that says the job finished."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from support.sweep_data import queued

from service.domain.hub import Hub, Update
from service.model.job_data import Job
from service.model.lifecycle import JobState
from service.routes.jobs import _stream


@dataclass
class AheadStore:
    """A store whose job is already finished (the follower wrote it before the stream read
    the updates it published on the way)."""

    job: Job

    def get(self, job_id: str) -> Job:
        return self.job

    def queue_position(self, job: Job) -> int | None:
        return None


def test_a_stream_behind_the_store_sends_every_update_up_to_the_finishing_one() -> None:
    running = replace(queued(), state=JobState.RUNNING, submission_id="kaisa-ray-job-1")
    store = AheadStore(running)
    hub = Hub()
    runtime: Any = SimpleNamespace(jobs=SimpleNamespace(hub=hub), store=store)

    async def run() -> list[tuple[str, Any]]:
        stream = _stream(runtime, "job-1")
        sent = [await anext(stream)]  # subscribed, and the job's state as the store has it
        # The follower goes on: it publishes on its way, and the store is ahead of the stream.
        store.job = replace(running, state=JobState.SUCCEEDED)
        for update in [
            Update("job-1", "state", {"id": "job-1", "state": "RUNNING"}),
            Update("job-1", "progress", {"kind": "step", "step": 10}),
            Update("job-1", "eval", {"kind": "eval", "step": 10}),
            Update("job-1", "state", {"id": "job-1", "state": "SUCCEEDED"}),
        ]:
            hub.publish(update)
        sent += [event async for event in stream]
        return [(str(event.event), json.loads(str(event.data))) for event in sent]

    sent = asyncio.run(asyncio.wait_for(run(), timeout=10))
    kinds = [kind for kind, _ in sent]
    # The RUNNING update, read when the store already said SUCCEEDED, sends nothing: the
    # records after it do, and the stream ends with the finishing state, sent once.
    assert kinds == ["state", "progress", "eval", "state"], sent
    assert [data["state"] for kind, data in sent if kind == "state"] == ["RUNNING", "SUCCEEDED"]
