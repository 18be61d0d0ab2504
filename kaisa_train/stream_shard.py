"""One worker's share of a streamed dataset (``streaming.py`` builds the pipelines): batches
for step ``s`` as the in-memory ``Shard`` gives them, read from Ray Train's split of each
pipeline. The one module of the streamed path that needs torch: Ray Data's tasks and actors,
which run the pipelines' functions, import ``streaming.py`` without it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kaisa_ray.errors import ConfigurationError
from kaisa_train.stream_files import StreamCounts

if TYPE_CHECKING:
    from ray.data import DataIterator

__all__ = ["StreamShard"]


@dataclass
class StreamShard:
    """One worker's share of a streamed dataset, with ``Shard``'s step-to-batch contract."""

    train: DataIterator
    validation: DataIterator
    batch_size: int
    steps_per_epoch: int
    seed: int
    rank: int
    world: int
    shuffle_buffer: int
    ledger: Any = None  # bad_records: skip's count; an epoch that comes up short is refilled
    epochs: int = 1  # the epochs one iteration of the training split reads (one execution)
    waited_s: float = 0.0  # in ``batch``: seconds this worker waited for its data
    _next: int | None = None  # the step the open iteration's next batch is for
    _left: int = 0  # the batches the open iteration has left to give
    _batches: Iterator[dict[str, torch.Tensor]] | None = field(default=None, repr=False)

    @classmethod
    def open(
        cls,
        train: DataIterator,
        validation: DataIterator,
        counts: StreamCounts,
        *,
        batch_size: int,
        seed: int,
        rank: int,
        world: int,
        shuffle_buffer: int,
    ) -> StreamShard:
        steps_per_epoch = (counts.train_rows // world) // batch_size
        if steps_per_epoch == 0:
            raise ConfigurationError(
                f"dataset.batch_size={batch_size} is larger than each worker's share of the "
                f"training set ({counts.train_rows // world} rows over {world} workers); lower "
                "batch_size or add data"
            )
        return cls(
            train=train,
            validation=validation,
            batch_size=batch_size,
            steps_per_epoch=steps_per_epoch,
            seed=seed,
            rank=rank,
            world=world,
            shuffle_buffer=shuffle_buffer,
            ledger=counts.ledger,
            epochs=counts.epochs,
        )

    def window_bytes(self, row_bytes: int) -> int:
        """What this worker's stream holds, estimated: its shuffle window and a batch being
        read beside the one it hands out (Ray Data's prefetch), at ``row_bytes`` a row."""
        return (self.shuffle_buffer + 2 * self.batch_size) * row_bytes

    def skipped(self) -> int | None:
        """Records the job's pipelines skipped so far (``bad_records: skip``), or None."""
        if self.ledger is None:
            return None
        import ray

        count, _ = ray.get(self.ledger.total.remote())
        return int(count)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) that step ``step`` (1-based) reads."""
        return divmod(step - 1, self.steps_per_epoch)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = self.position(step)
        started = time.perf_counter()
        if self._batches is None or self._next != step:
            # The first step, the end of the epochs an iteration reads, or a jump (a resume,
            # the tuner's profile before training): a new iteration of the split, from the
            # first of its epochs (every worker starts one at the same step).
            self._batches = self._iteration(epoch, index)
        try:
            batch = next(self._batches)
        except StopIteration:
            if self.ledger is None:
                raise ConfigurationError(
                    f"the training split ran out at batch {index} of epoch {epoch} on worker "
                    f"{self.rank}, before the {self.epochs * self.steps_per_epoch} batches "
                    f"({self.epochs} epoch(s)) its rows counted for: the files changed while "
                    "the job ran, or rows were unreadable "
                    "(dataset.bad_records: skip leaves those out)"
                ) from None
            # Rows skipped as unreadable left the epoch short (every worker as short: the
            # split is equal): its last batches come from its start, read again.
            self._batches = self._iteration(epoch, index)
            refill = next(self._batches, None)
            if refill is None:
                raise ConfigurationError(
                    f"every record of the training split was skipped as unreadable (worker "
                    f"{self.rank}, epoch {epoch}): see the job's skipped records' reasons"
                ) from None
            batch = refill
        self.waited_s += time.perf_counter() - started
        self._left -= 1
        if self._left == 0:  # the rest (under a batch) is left
            self._batches, self._next = None, None
        else:
            self._next = step + 1
        return _pair(batch)

    def _iteration(self, epoch: int, index: int) -> Iterator[dict[str, torch.Tensor]]:
        """A new iteration of the split for batch ``index`` of ``epoch`` on: its epochs, or,
        from within an epoch (a resume), the rest of that one (the next starts a new one, so
        that every epoch after it reads every row once)."""
        self._left = self.steps_per_epoch - index if index else self.epochs * self.steps_per_epoch
        return iter(
            self.train.iter_torch_batches(
                batch_size=self.batch_size,
                drop_last=True,
                device="cpu",
                local_shuffle_buffer_size=self.shuffle_buffer or None,
                local_shuffle_seed=(self.seed * 1_000_003 + epoch) * self.world + self.rank
                if self.shuffle_buffer
                else None,
            )
        )

    def validation_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This worker's share of the validation split, in batches (every worker as many)."""
        for batch in self.validation.iter_torch_batches(batch_size=batch_size, device="cpu"):
            yield _pair(batch)


def _pair(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of a pipeline's batch: a classifier's ``x`` and ``y``, or a language
    model's windows as (their first ``context`` tokens, the same shifted by one), int64."""
    if "window" in batch:
        window = batch["window"].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
    return batch["x"], batch["y"]
