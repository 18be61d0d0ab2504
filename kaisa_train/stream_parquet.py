"""Parquet files streamed by Ray Data: a feature and a label column made into image batches
(``TableBatches``), or a token column cut into a language model's windows (``TokenWindows``);
the driver checks the schema and counts the rows from the files' footers.

Torch-free: Ray Data's tasks import it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kaisa_ray.errors import ConfigurationError
from kaisa_train.stream_files import (
    ROWS_PER_BLOCK,
    TRAIN,
    VALIDATION,
    Order,
    StreamCounts,
    cut_windows,
    held_out_files,
    list_folder,
    open_filesystem,
    path_addresser,
    refuse,
    train_order,
    uri_prefix,
)
from kaisa_train.stream_images import decode_images, normalise
from kaisa_train.stream_read import Horizon, ReadParquet, parquet_per_task, read_files

if TYPE_CHECKING:
    from ray.data import Dataset

    from kaisa_train.spec import DatasetSpec

__all__ = [
    "FOOTER_ACTORS",
    "FOOTER_BATCH",
    "TableBatches",
    "TokenWindows",
    "footer_readers",
    "parquet_source",
]


@dataclass(frozen=True)
class TableBatches:
    """A Parquet batch as the model's input: the input column's encoded images decoded (or
    its numbers taken as they are, uint8 ones scaled as image pixels), the label checked."""

    input: str
    label: str
    mode: str
    size: tuple[int, int] | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    classes: int | None
    ledger: Any = None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        paths = batch["path"]
        labels = np.asarray(batch[self.label])
        if labels.dtype.kind not in "iu":
            raise ConfigurationError(
                f"{paths[0]}: column {self.label!r} holds {labels.dtype} values; the labels "
                "must be integers (class indices from 0)"
            )
        bad = (labels < 0) | (labels >= (self.classes or np.iinfo(np.int64).max))
        limit = f"0 to {self.classes - 1}" if self.classes else "0 or more"
        reasons = [
            f"{paths[i]}: label {int(labels[i])} in column {self.label!r} is outside the "
            f"classes ({limit}). Fix the file, or set dataset.classes to the model's classes"
            for i in np.flatnonzero(bad)
        ]
        keep = ~bad
        values = batch[self.input]
        if len(values) and isinstance(values[0], bytes | bytearray):
            images, readable, unreadable = decode_images(
                values, paths, self.mode, self.size, f"column {self.input!r}"
            )
            reasons += [f"{r}. Fix or remove the row" for r in unreadable]
            refuse(self.ledger, reasons)
            x = normalise(images[keep[readable]], self.mean, self.std)
            keep &= readable
        else:
            refuse(self.ledger, reasons)
            array = np.stack([np.asarray(v) for v in values[keep]])
            if self.size is not None:
                array = array.reshape(array.shape[0], -1, *self.size)
            x = (
                normalise(array, self.mean, self.std)
                if array.dtype == np.uint8 and array.ndim == 4
                else array.astype(np.float32)
            )
        return {"x": x, "y": labels[keep].astype(np.int64)}


@dataclass(frozen=True)
class TokenWindows:
    """A Parquet batch of token rows (every row ``length`` tokens, ids below ``vocabulary``
    when it is set) as windows of ``context + 1`` tokens (``{"window": (n, context + 1)}``)."""

    column: str
    context: int
    length: int
    vocabulary: int | None
    ledger: Any = None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        paths = batch["path"]
        rows, reasons = [], []
        top = self.vocabulary or np.iinfo(np.int64).max
        for i, value in enumerate(batch[self.column]):
            tokens = np.asarray(value)
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or len(tokens) != self.length:
                reasons.append(
                    f"{paths[i]}: a row of column {self.column!r} holds {tokens.dtype} "
                    f"{tuple(tokens.shape)}; every row must be a list of {self.length} integer "
                    "token ids (the first row's length; write the tokens packed into rows of "
                    "one length)"
                )
                continue
            bad = (tokens < 0) | (tokens >= top)
            if bad.any():
                limit = f"0 to {self.vocabulary - 1}" if self.vocabulary else "0 or more"
                reasons.append(
                    f"{paths[i]}: token {int(tokens[bad][0])} in column {self.column!r} is "
                    f"outside the vocabulary ({limit}). Fix the file, or set dataset.classes to "
                    "the model's vocabulary"
                )
                continue
            rows.append(tokens)
        refuse(self.ledger, reasons)
        windows = [cut_windows(row, self.context) for row in rows]
        if not windows:
            return {"window": np.empty((0, self.context + 1), np.int64)}
        return {"window": np.concatenate(windows)}


FOOTER_ACTORS = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"


FOOTER_BATCH = 10  # the files a footer reader reads in one call (Ray Data's default)


@contextmanager
def footer_readers(files: int) -> Iterator[None]:
    """Ray Data (2.60) reads Parquet footers on a pool of 32 new actor processes for a
    listing of a ``read_parquet`` (here, the driver's count of a split's rows). More
    readers than batches of files is only process start-ups (seconds of CPU each, where a
    small cluster's cores are the training's too), so the read made inside this block asks
    for one a batch of ``files``, up to Ray's 32 (the reader takes the number when it is
    made). A number the user set in the environment is kept."""
    if FOOTER_ACTORS in os.environ:
        yield
        return
    os.environ[FOOTER_ACTORS] = str(max(1, min(32, math.ceil(files / FOOTER_BATCH))))
    try:
        yield
    finally:
        del os.environ[FOOTER_ACTORS]


def _parquet_pipeline(
    dataset: DatasetSpec,
    origin: str,
    located: tuple[Any, str],
    files: list[str],
    horizon: Horizon | None,
    ledger: Any,
) -> tuple[Dataset, int, int]:
    """A Parquet split's pipeline, its rows (windows, for a token column) and the epochs one
    execution reads; ``files``: its files, the first of which has its schema (and first
    row's tokens) checked here. ``horizon``: the job's, for a training split (None: a
    validation split, one epoch in file order)."""
    import pyarrow.parquet as pq
    import ray.data

    first = files[0]
    split = TRAIN if horizon is not None else VALIDATION
    columns = dataset.columns
    wanted = [columns.tokens] if columns.tokens is not None else [columns.input, columns.label]
    fs, prefix = located[0], uri_prefix(origin, located[1])
    try:
        with fs.open_input_file(first[len(prefix) :]) as opened:
            table = pq.ParquetFile(opened)
            names = set(table.schema_arrow.names)
            missing = [c for c in wanted if c not in names]
            first_row = (
                next(table.iter_batches(batch_size=1, columns=wanted), None)
                if not missing and columns.tokens is not None
                else None
            )
    except (OSError, ValueError) as err:
        raise ConfigurationError(
            f"dataset.{split}: {first} is not a readable Parquet file ({err}). Fix or remove it"
        ) from None
    if missing:
        hint = (
            "Set dataset.columns.tokens to its name"
            if columns.tokens is not None
            else "Set dataset.columns.input and dataset.columns.label to its names"
        )
        raise ConfigurationError(
            f"dataset.{split}: {first} has no column {missing[0]!r} (it has "
            f"{', '.join(sorted(names))}). {hint}"
        )
    with footer_readers(len(files)):
        rows = ray.data.read_parquet(files).count()  # from the files' footers

    def read(counted: int) -> tuple[Dataset, int]:
        order = Order() if horizon is None else train_order(dataset, horizon, counted)
        per_task = parquet_per_task(len(files))
        reader = ReadParquet(
            tuple(files), fs, prefix, order.seed, per_task, tuple(wanted), rows=ROWS_PER_BLOCK
        )
        return read_files(reader, order.epochs)

    if columns.tokens is not None:
        length = 0 if first_row is None else len(first_row.column(0)[0])
        per_row = (length - 1) // dataset.window
        if per_row < 1:
            raise ConfigurationError(
                f"dataset.{split}: {first}'s rows hold {length} tokens, fewer than one window of "
                f"dataset.context + 1 = {dataset.window + 1}. Lower dataset.context, or write "
                "longer rows"
            )
        windows = TokenWindows(
            column=columns.tokens,
            context=dataset.window,
            length=length,
            vocabulary=dataset.classes,
            ledger=ledger,
        )
        ds, epochs = read(rows * per_row)
        return ds.map_batches(windows, batch_format="numpy"), rows * per_row, epochs
    image = dataset.image
    prepare = TableBatches(
        input=columns.input,
        label=columns.label,
        mode=image.mode.value,
        size=None if image.size is None else (image.size[0], image.size[1]),
        mean=tuple(image.mean),
        std=tuple(image.std),
        classes=dataset.classes,
        ledger=ledger,
    )
    ds, epochs = read(rows)
    return ds.map_batches(prepare, batch_format="numpy"), rows, epochs


def _parquet_files(path: str, split: str) -> tuple[list[str], tuple[Any, str]]:
    """A Parquet split's files and ``open_filesystem(path)``."""
    located = open_filesystem(path)
    _, files = list_folder(path, split, located)
    address = path_addresser(path, located[1])
    parquet = [address(f) for f in files if f.endswith(".parquet")]
    if not parquet:
        raise ConfigurationError(
            f"dataset.{split}: {path} holds no .parquet files. Point it at a Parquet file or "
            "a folder of them"
        )
    return parquet, located


def parquet_source(
    dataset: DatasetSpec, ledger: Any, horizon: Horizon
) -> tuple[dict[str, Dataset], StreamCounts]:
    assert dataset.train is not None  # the spec's check
    train, located = _parquet_files(dataset.train, TRAIN)
    if dataset.validation_every is not None:
        kept, held = held_out_files(train, dataset.validation_every, dataset.train)
        held_origin, held_located = dataset.train, located
    else:
        assert dataset.validation is not None
        held, held_located = _parquet_files(dataset.validation, VALIDATION)
        kept, held_origin = train, dataset.validation
    train_ds, train_rows, epochs = _parquet_pipeline(
        dataset, dataset.train, located, kept, horizon, ledger
    )
    val_ds, val_rows, _ = _parquet_pipeline(dataset, held_origin, held_located, held, None, ledger)
    counts = StreamCounts(train_rows, val_rows, epochs=epochs)
    return {TRAIN: train_ds, VALIDATION: val_ds}, counts
