"""What every streamed source shares: the driver's listing of a split's files (local or on any
filesystem pyarrow opens), the held-out rule, the order and the horizon of a training split's
reads, the counts handed to the workers, and the bad-records rule of the map tasks (fail, or
skip and count in the job's ``SkipLedger``).

Torch-free: Ray Data's tasks and actors import it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kaisa_ray.errors import ConfigurationError
from kaisa_train.stream_read import Horizon, ReadBytes, read_files
from kaisa_train.stream_sources import is_uri, local_path

if TYPE_CHECKING:
    from ray.data import Dataset

    from kaisa_train.spec import DatasetSpec

__all__ = [
    "ROWS_PER_BLOCK",
    "TRAIN",
    "VALIDATION",
    "Order",
    "SkipLedger",
    "StreamCounts",
    "bytes_of",
    "cut_windows",
    "held_out_files",
    "list_folder",
    "open_filesystem",
    "path_addresser",
    "refuse",
    "train_order",
    "uri_prefix",
]


TRAIN, VALIDATION = "train", "validation"


@dataclass(frozen=True)
class StreamCounts:
    """What the driver found, for the workers: rows per split (before the equal split)."""

    train_rows: int
    validation_rows: int
    classes: tuple[str, ...] = ()  # an image folder's class names, in label order
    ledger: Any = field(default=None, compare=False)  # bad_records: skip's count (an actor)
    epochs: int = 1  # the training split's epochs one execution of its pipeline reads


class SkipLedger:
    """The records a job's pipelines skipped (``dataset.bad_records: skip``): how many, and the
    first few reasons (each naming its file). One Ray actor per job, told by the map tasks."""

    KEPT = 5

    def __init__(self) -> None:
        self.count = 0
        self.reasons: list[str] = []

    def add(self, count: int, reasons: list[str]) -> None:
        self.count += count
        self.reasons.extend(reasons[: self.KEPT - len(self.reasons)])

    def total(self) -> tuple[int, list[str]]:
        return self.count, list(self.reasons)


def refuse(ledger: Any, reasons: list[str]) -> None:
    """Bad records: the first one's error (``bad_records: fail``, no ledger), or counted."""
    if not reasons:
        return
    if ledger is None:
        raise ConfigurationError(reasons[0])
    import ray

    # Counted before the batch goes on (a batch with bad records is rare: one round trip).
    ray.get(ledger.add.remote(len(reasons), reasons[: SkipLedger.KEPT]))


def open_filesystem(path: str) -> tuple[Any, str]:
    import pyarrow.fs

    if is_uri(path):
        return pyarrow.fs.FileSystem.from_uri(path)  # type: ignore[no-any-return]
    return pyarrow.fs.LocalFileSystem(), os.path.abspath(local_path(path))


def path_addresser(origin: str, root: str) -> Callable[[str], str]:
    """Turns a path listed on ``origin``'s filesystem (``root``: ``origin`` as that filesystem
    names it) into what Ray Data and this module read it by: a local path as it is; on another
    system (``s3://bucket/data``, whose filesystem lists ``bucket/data/part-0.parquet``) the
    URI, ``s3://bucket/data/part-0.parquet``."""
    if not is_uri(origin):
        return lambda path: path
    prefix = uri_prefix(origin, root)
    return lambda path: path if "://" in path else prefix + path


def uri_prefix(origin: str, root: str) -> str:
    """What ``path_addresser`` puts before a name on ``origin``'s filesystem (empty: a local
    path's)."""
    if not is_uri(origin):
        return ""
    given, listed = origin.rstrip("/"), root.rstrip("/")
    scheme = origin.split("://", 1)[0] + "://"
    return given[: len(given) - len(listed)] if listed and given.endswith(listed) else scheme


def list_folder(
    path: str, split: str, located: tuple[Any, str] | None = None
) -> tuple[list[str], list[str]]:
    """(subfolders, files below) of ``path``, each sorted; refused where nothing is there.
    ``located``: ``open_filesystem(path)``, where the caller has it already."""
    import pyarrow.fs

    fs, root = located or open_filesystem(path)
    info = fs.get_file_info(root)
    if info.type == pyarrow.fs.FileType.NotFound:
        raise ConfigurationError(
            f"dataset.{split}: {path} does not exist. Point it at the {split} split's folder "
            "(or file)"
        )
    if info.type == pyarrow.fs.FileType.File:
        return [], [root]
    entries = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
    folders = sorted(e.path for e in entries if e.type == pyarrow.fs.FileType.Directory)
    files = sorted(e.path for e in entries if e.type == pyarrow.fs.FileType.File)
    return folders, files


def held_out_files(files: list[str], every: int, path: str) -> tuple[list[str], list[str]]:
    """(training, validation) files of ``path``: every ``every``-th file, in path order, held
    out for validation. Refused where that leaves either split without a file."""
    ordered = sorted(files)
    validation = ordered[every - 1 :: every]
    if not validation or len(validation) == len(ordered):
        raise ConfigurationError(
            f"dataset.validation_every={every}: {path} has {len(ordered)} file(s), so every "
            f"{every}th leaves {'no validation' if not validation else 'no training'} file. "
            "Write the data into more files, lower validation_every, or name a validation "
            "split in dataset.validation"
        )
    held = set(validation)
    return [f for f in ordered if f not in held], validation


@dataclass(frozen=True)
class Order:
    """How a split's pipeline reads its files: ``epochs`` epochs in a row, each in a new
    order drawn from ``seed`` (None: one epoch in file order, a validation split's)."""

    epochs: int = 1
    seed: int | None = None


def bytes_of(
    origin: str, located: tuple[Any, str], files: list[str], order: Order, per_task: int
) -> tuple[Dataset, int]:
    """``files`` of the split at ``origin`` as ``{"bytes", "path"}`` rows, read in ``order``;
    and the epochs one execution reads."""
    fs, root = located
    read = ReadBytes(tuple(files), fs, uri_prefix(origin, root), order.seed, per_task)
    return read_files(read, order.epochs)


def train_order(dataset: DatasetSpec, horizon: Horizon, rows: int) -> Order:
    """How the training split of ``rows`` rows is read: the job's epochs in one execution
    (one, with ``dataset.limit``, whose rows are the first of the stream), each epoch's files
    in an order drawn from the job's seed."""
    epochs = 1 if dataset.limit is not None else horizon.epochs(rows, dataset.batch_size)
    return Order(epochs, horizon.seed)


ROWS_PER_BLOCK = 1024  # a training pipeline's blocks, in rows (``block_bytes``)


def cut_windows(values: np.ndarray, context: int) -> np.ndarray:
    """``values`` (one sequence) cut into windows of ``context + 1``, each starting where the
    last one's inputs end (so every value but the first is a target once): (n, context + 1)."""
    count = (len(values) - 1) // context
    if count < 1:
        return np.empty((0, context + 1), values.dtype)
    view = np.lib.stride_tricks.sliding_window_view(values[: count * context + 1], context + 1)
    return view[::context]
