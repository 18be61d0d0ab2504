"""Live progress of running jobs: a named, detached Ray actor that every process can read.

Rank 0 of a job pushes records (fire-and-forget ``.remote()`` calls, so training never waits
on it); the CLI, the service or a user's notebook read them while the job runs::

    sink = progress_sink()                       # get or create, in namespace "kaisa-ray"
    page = ray.get(sink.read.remote(run, since=0))
    page["records"], page["next"]                 # pass "next" as since to read only new ones

The records are defined in ``kaisa_train.records`` (one class per ``RecordKind``); the
sink holds them as their ``wire()`` dicts, with the run's ``seq`` number and the wall-clock
``time`` added, and ``parse_record`` turns one back into its class. Memory is bounded: each
run keeps its newest ``max_records`` records, and at most ``max_runs`` runs are kept (oldest
dropped first). ``SinkReader`` follows one run from a thread (the driver's progress bar).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import ray

from kaisa_train.records import Record, try_record
from tuner.singleton import cluster_singleton

logger = logging.getLogger(__name__)

SINK_NAME = "kaisa-ray-progress"
SINK_NAMESPACE = "kaisa-ray"

Entry = dict[str, Any]  # a record as the sink holds it (``Record.wire()`` with seq and time)


class ProgressStore:
    """The sink's state, a plain class so that it can be tested without Ray."""

    def __init__(self, *, max_records: int = 20_000, max_runs: int = 200) -> None:
        if max_records < 1 or max_runs < 1:
            raise ValueError("max_records and max_runs must be at least 1")
        self.max_records = max_records
        self.max_runs = max_runs
        self._runs: OrderedDict[str, deque[Entry]] = OrderedDict()
        self._next_seq: dict[str, int] = {}

    def push(self, run: str, records: list[Entry]) -> int:
        """Append records to a run; returns the run's next sequence number."""
        if run not in self._runs:
            while len(self._runs) >= self.max_runs:
                dropped, _ = self._runs.popitem(last=False)
                self._next_seq.pop(dropped, None)
            self._runs[run] = deque(maxlen=self.max_records)
            self._next_seq[run] = 0
        log = self._runs[run]
        for record in records:
            entry = dict(record)
            entry["seq"] = self._next_seq[run]
            entry.setdefault("time", time.time())
            self._next_seq[run] += 1
            log.append(entry)
        return self._next_seq[run]

    def read(self, run: str, since: int = 0, kinds: list[str] | None = None) -> dict[str, Any]:
        """Records of a run with ``seq >= since`` (optionally only some kinds)."""
        log = self._runs.get(run, deque())
        records = [r for r in log if r["seq"] >= since and (kinds is None or r["kind"] in kinds)]
        return {"run": run, "records": records, "next": self._next_seq.get(run, 0)}

    def runs(self) -> list[str]:
        return list(self._runs)

    def forget(self, run: str) -> bool:
        self._next_seq.pop(run, None)
        return self._runs.pop(run, None) is not None


@ray.remote(num_cpus=0, max_restarts=-1)
class ProgressSink(ProgressStore):
    """``ProgressStore`` as a named Ray actor (no CPU reserved: it must never block a job)."""


def progress_sink() -> Any:
    """The cluster's progress sink (an actor handle), created on first use; needs Ray."""
    # Typed Any: Ray's stubs give actor method calls the result type Never.
    handle: Any = ProgressSink.options(  # type: ignore[attr-defined]
        name=SINK_NAME, namespace=SINK_NAMESPACE, **cluster_singleton()
    ).remote()
    return handle


def read_progress(run: str, since: int = 0, kinds: list[str] | None = None) -> dict[str, Any]:
    """Blocking read of one run's records from the sink (see ``ProgressStore.read``)."""
    sink = progress_sink()
    page: dict[str, Any] = ray.get(sink.read.remote(run, since, kinds))
    return page


class SinkReader(threading.Thread):
    """Reads one run's records from the sink every ``interval_s`` and hands each, as its
    class, to ``take``, until ``stop()``; which reads once more, so that everything pushed
    before ``stop()`` was called is taken."""

    def __init__(
        self,
        run: str,
        take: Callable[[Record], None],
        *,
        kinds: list[str] | None = None,
        interval_s: float = 0.5,
    ) -> None:
        super().__init__(name=f"progress-{run}", daemon=True)
        self.run_name = run
        self.take = take
        self.kinds = kinds
        self.interval_s = interval_s
        self._stop_event = threading.Event()
        self._since = 0

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)

    def run(self) -> None:
        while True:
            stopping = self._stop_event.wait(self.interval_s)
            try:
                self._poll()
            except Exception as err:  # the sink is best effort: never fail the job
                logger.debug("reading progress failed: %s", err)
            if stopping:
                break

    def _poll(self) -> None:
        if not ray.is_initialized():  # the driver connects first (reading would start a Ray)
            return
        page = read_progress(self.run_name, self._since, self.kinds)
        self._since = page["next"]
        for data in page["records"]:
            record, problem = try_record(data)
            if record is None:
                logger.debug("run %s: %s", self.run_name, problem)
                continue
            self.take(record)
