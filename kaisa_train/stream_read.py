"""The files a streamed split's pipeline reads, and the Ray Data tasks that read them.

A training split reads every epoch its job needs in one execution of its pipeline, each
epoch's files in a new order drawn from the job's seed, one epoch after the other, so that the
rows stream from one epoch into the next. A new execution an epoch waits seconds for its first
batch while all of its read tasks start at once on the cores the training uses (docs/data.md,
measured), and a union of one read an epoch starts every epoch's read at once. Ray Data's
``read_parquet`` reads a file once however often it is listed, so the pipeline starts from one
small item a read task (``from_items``: an epoch and the task's place in it) and its
``map_batches`` tasks read the files that fall to them: the bytes of an image or a text file
(the rows ``read_binary_files`` gives), or a Parquet file's columns in slices of ``rows``. A
validation split is one epoch in file order.

Torch-free: Ray Data's tasks import it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kaisa_ray.errors import ConfigurationError

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.data import Dataset

__all__ = [
    "MAX_READS",
    "PARQUET_TASKS",
    "Horizon",
    "ReadBytes",
    "ReadParquet",
    "epoch_order",
    "parquet_per_task",
    "read_files",
]

MAX_READS = 1024
"""The most read tasks (epochs x a split's tasks an epoch) one execution lists; a job that
needs more epochs than fit reads the listed ones again, in the same orders, in a new one. The
driver puts one block a task into the object store before the first batch (about 1.7 ms each
on a 2-core node: docs/data.md), so the list stays short."""

PARQUET_TASKS = 256
"""The most read tasks an epoch of a Parquet split: a split of more files reads several in a
task (each still handed on in slices of ``rows`` rows)."""


@dataclass(frozen=True)
class Horizon:
    """How much of its training split a job reads: its workers, its stop (``max_steps`` or
    ``max_epochs``, as ``stop`` gives them) and the seed of each epoch's file order."""

    workers: int = 1
    max_steps: int | None = None
    max_epochs: int | None = None
    seed: int = 0

    def epochs(self, rows: int, batch_size: int) -> int:
        """The epochs of a split of ``rows`` rows the job reads (every worker ``batch_size``
        rows a step, as many rows each), at least one."""
        per_epoch = (rows // max(1, self.workers)) // max(1, batch_size)
        if per_epoch < 1:
            return 1
        if self.max_steps is not None:
            return max(1, math.ceil(self.max_steps / per_epoch))
        return self.max_epochs or 1


@dataclass(frozen=True)
class _Files:
    """A split's files and how one task reads its share: the filesystem the driver resolved
    (pyarrow's) and the prefix the listed paths carry beyond that filesystem's own names
    (``s3://``; empty for local paths); with ``seed``, each epoch's files in a new order
    drawn from it (None: as listed), ``per_task`` files a task."""

    files: tuple[str, ...]
    filesystem: Any
    prefix: str
    seed: int | None
    per_task: int

    def local(self, path: str) -> str:
        return path[len(self.prefix) :] if self.prefix and path.startswith(self.prefix) else path

    def tasks(self) -> int:
        """Read tasks an epoch."""
        return max(1, math.ceil(len(self.files) / self.per_task))

    def paths(self, batch: pa.Table) -> list[str]:
        """The files of a task's items (``{"epoch", "task"}``), in their order."""
        chosen: list[str] = []
        for epoch, task in zip(
            batch.column("epoch").to_pylist(), batch.column("task").to_pylist(), strict=True
        ):
            ordered = epoch_order(len(self.files), self.seed, int(epoch))
            start = int(task) * self.per_task
            chosen += [self.files[i] for i in ordered[start : start + self.per_task]]
        return chosen


def parquet_per_task(files: int) -> int:
    """Files a read task of a Parquet split of ``files`` files reads: one, or as many as keep
    an epoch within ``PARQUET_TASKS`` tasks."""
    return max(1, math.ceil(files / PARQUET_TASKS))


def epoch_order(files: int, seed: int | None, epoch: int) -> np.ndarray:
    """The order of a split's ``files`` in ``epoch``: a permutation drawn from ``seed`` and
    the epoch (None: as listed)."""
    if seed is None:
        return np.arange(files)
    return np.random.default_rng((seed, epoch)).permutation(files)


def read_files(
    read: ReadBytes | ReadParquet, epochs: int, max_reads: int = MAX_READS
) -> tuple[Dataset, int]:
    """A Ray Data pipeline of what ``read`` makes of its files, ``epochs`` epochs in a row
    (at most as many as ``max_reads`` tasks hold), one item a read task; and its epochs."""
    import ray.data

    tasks = read.tasks()
    epochs = max(1, min(epochs, max_reads // tasks))
    items = [{"epoch": e, "task": t} for e in range(epochs) for t in range(tasks)]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    return ds.map_batches(read, batch_size=None, batch_format="pyarrow"), epochs


@dataclass(frozen=True)
class ReadBytes(_Files):
    """A task's paths as ``{"bytes", "path"}`` rows, a whole file each (``read_binary_files``'
    rows)."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow as pa

        paths = self.paths(batch)
        data = []
        for path in paths:
            try:
                with self.filesystem.open_input_stream(self.local(path)) as opened:
                    data.append(opened.read())
            except OSError as err:
                raise ConfigurationError(
                    f"{path} cannot be read ({err}): the files changed while the job ran, or "
                    "they are not readable by the cluster's nodes. Restore or remove it"
                ) from None
        return pa.table({"bytes": pa.array(data, pa.binary()), "path": pa.array(paths)})


@dataclass(frozen=True)
class ReadParquet(_Files):
    """A task's Parquet files as their ``columns`` and a ``path`` column, in slices of up to
    ``rows`` rows."""

    columns: tuple[str, ...] = ()
    rows: int = 1024

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for path in self.paths(batch):
            try:
                opened = pq.ParquetFile(self.filesystem.open_input_file(self.local(path)))
                for part in opened.iter_batches(batch_size=self.rows, columns=list(self.columns)):
                    table = pa.Table.from_batches([part])
                    yield table.append_column("path", pa.array([path] * len(table), pa.string()))
            except (OSError, ValueError) as err:
                raise ConfigurationError(
                    f"{path} is not a readable Parquet file ({err}). Fix or remove it"
                ) from None
