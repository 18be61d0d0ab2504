"""Where a worker's loop runs, behind one small interface (``Session``): as a rank of a job's
Ray Train worker group (``RaySession``: records to the progress sink, checkpoints through
``ray.train.report``), or in this process alone (``LocalSession``: ``kaisa-ray example``).
The loop (``worker.py``) is the same in both.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kaisa_train.records import Record
from kaisa_train.shard import StreamData
from kaisa_train.state import CHECKPOINT_FILE, load_checkpoint_file
from kaisa_train.storage import local_checkpoint
from kaisa_train.stream_files import TRAIN, VALIDATION, StreamCounts

__all__ = ["LocalSession", "RaySession", "Session"]


class Session(Protocol):
    """What the loop needs from where it runs."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def keeps_checkpoints(self) -> bool:
        """Whether a checkpoint reported here is kept (else the loop skips making one)."""

    def stream(self) -> StreamData | None:
        """A streamed dataset's splits for this worker, or None (the data is in memory)."""

    def push(self, *records: Record, wait: bool = False) -> None:
        """Send records (from rank 0) where the job's followers read them; ``wait``: until
        they are there (the worker stops next)."""

    def report(self, metrics: dict[str, Any], state: dict[str, Any] | None) -> None:
        """Every rank: ``metrics`` of this step; rank 0 with a checkpoint's ``state``."""

    def resume(self) -> tuple[dict[str, Any] | None, str | None]:
        """The checkpoint state this attempt starts from and where it is (None: none)."""


class RaySession:
    """A rank of the job's Ray Train worker group."""

    def __init__(
        self, run: str, resume_from: str | None = None, counts: StreamCounts | None = None
    ) -> None:
        import ray.train
        import ray.train.torch

        from kaisa_train.progress import progress_sink

        context = ray.train.get_context()
        self.run = run
        self.resume_from = resume_from
        self._rank = int(context.get_world_rank())
        self._world = int(context.get_world_size())
        self._device = ray.train.torch.get_device()
        self._sink = progress_sink()
        self._counts = counts

    def stream(self) -> StreamData | None:
        import ray.train

        if self._counts is None:
            return None
        train = ray.train.get_dataset_shard(TRAIN)
        validation = ray.train.get_dataset_shard(VALIDATION)
        assert train is not None  # the trainer's datasets
        assert validation is not None
        return train, validation, self._counts

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world(self) -> int:
        return self._world

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def keeps_checkpoints(self) -> bool:
        return True

    def push(self, *records: Record, wait: bool = False) -> None:
        # Fire-and-forget: training never waits on the sink (unless told to).
        call = self._sink.push.remote(self.run, [r.wire() for r in records])
        if wait:
            import ray

            ray.get(call)

    def report(self, metrics: dict[str, Any], state: dict[str, Any] | None) -> None:
        import ray.train

        if state is None:
            ray.train.report(metrics)
            return
        directory = tempfile.mkdtemp(prefix="kaisa-ray-ckpt-")
        try:
            torch.save(state, os.path.join(directory, CHECKPOINT_FILE))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def resume(self) -> tuple[dict[str, Any] | None, str | None]:
        """Ray Train's own checkpoint after a restart, else the run's ``resume_from``."""
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:
                return load_checkpoint_file(directory), checkpoint.path
        if self.resume_from is not None:
            with local_checkpoint(self.resume_from) as directory:
                return load_checkpoint_file(directory), self.resume_from
        return None, None


class LocalSession:
    """This process alone, on the CPU: records go to ``on_record``, checkpoints nowhere."""

    def __init__(self, on_record: Callable[[Record], None]) -> None:
        self.on_record = on_record
        self.rank, self.world = 0, 1
        self.device = torch.device("cpu")
        self.keeps_checkpoints = False

    def stream(self) -> StreamData | None:
        return None  # a streamed dataset's jobs run on Ray Train (load_shard says so)

    def push(self, *records: Record, wait: bool = False) -> None:
        for record in records:
            self.on_record(record)

    def report(self, metrics: dict[str, Any], state: dict[str, Any] | None) -> None:
        return None

    def resume(self) -> tuple[dict[str, Any] | None, str | None]:
        return None, None
