"""Datasets streamed to the workers by Ray Data: a user's own image folder, Parquet files or
text files, read and preprocessed on the cluster's CPUs, each worker holding a bounded window.

The driver opens the sources (``open_stream``): it lists the files, checks what it can before
anything starts (an empty folder, a missing column, validation classes training lacks), counts
the rows, and builds one Ray Data pipeline per split, its files read by Ray Data tasks
(``stream_read.py``: the training split's epochs one after the other in one execution, each
epoch's files in a new order drawn from the job's seed) and preprocessed by ``map_batches``
tasks into ``{"x": float32, "y": int64}`` batches (a language model's:
``{"window": (n, context + 1)}``, input and target in one).
Ray Train splits both pipelines over the workers (``streaming_split``, every worker as many
rows); a worker reads its share through ``StreamShard`` (``stream_shard.py``, so that Ray
Data's tasks and actors, which import this module for the pipelines' functions, need no
torch), which keeps the in-memory
``Shard``'s contract: step ``s`` is batch ``(s-1) % steps_per_epoch`` of epoch
``(s-1) // steps_per_epoch``, and the rows come through a shuffle window of
``dataset.shuffle_buffer`` rows (which spans an epoch's end: the first batches of an epoch
hold a few of the last one's rows).

What streaming does not give: which rows fill a batch depends on the order in which the
pipeline's blocks reach the workers, so two runs of a streamed job are not bit for bit the
same, and a resumed run continues at its step and epoch with the rest of that epoch drawn
afresh from the epoch's data (the batches it had read before the stop are not skipped over,
and some rows are seen twice that epoch, others not at all). Up to ``workers - 1`` rows of each
execution are left out so that every worker reads as many (Ray Train's equal split), and the
rest under a batch at its end.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kaisa_ray.errors import ConfigurationError
from kaisa_train.ray_logs import quiet_here
from kaisa_train.stream_read import Horizon, ReadBytes, ReadParquet, parquet_per_task, read_files
from kaisa_train.stream_sources import (
    BadRecords,
    ImageMode,
    StreamSource,
    is_uri,
    local_path,
)

if TYPE_CHECKING:
    from ray.data import Dataset

    from kaisa_train.spec import DatasetSpec

__all__ = [
    "IMAGE_EXTENSIONS",
    "ROWS_PER_BLOCK",
    "TRAIN",
    "VALIDATION",
    "SkipLedger",
    "StreamCounts",
    "block_bytes",
    "open_stream",
    "spare_cpus_message",
]

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "gif", "tif", "tiff")
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


def _refuse(ledger: Any, reasons: list[str]) -> None:
    """Bad records: the first one's error (``bad_records: fail``, no ledger), or counted."""
    if not reasons:
        return
    if ledger is None:
        raise ConfigurationError(reasons[0])
    import ray

    # Counted before the batch goes on (a batch with bad records is rare: one round trip).
    ray.get(ledger.add.remote(len(reasons), reasons[: SkipLedger.KEPT]))


# -- the driver: listing, checking, and the pipelines ------------------------------------------


def _filesystem(path: str) -> tuple[Any, str]:
    import pyarrow.fs

    if is_uri(path):
        return pyarrow.fs.FileSystem.from_uri(path)  # type: ignore[no-any-return]
    return pyarrow.fs.LocalFileSystem(), os.path.abspath(local_path(path))


def _addresser(origin: str, root: str) -> Callable[[str], str]:
    """Turns a path listed on ``origin``'s filesystem (``root``: ``origin`` as that filesystem
    names it) into what Ray Data and this module read it by: a local path as it is; on another
    system (``s3://bucket/data``, whose filesystem lists ``bucket/data/part-0.parquet``) the
    URI, ``s3://bucket/data/part-0.parquet``."""
    if not is_uri(origin):
        return lambda path: path
    prefix = _prefix(origin, root)
    return lambda path: path if "://" in path else prefix + path


def _prefix(origin: str, root: str) -> str:
    """What ``_addresser`` puts before a name on ``origin``'s filesystem (empty: a local
    path's)."""
    if not is_uri(origin):
        return ""
    given, listed = origin.rstrip("/"), root.rstrip("/")
    scheme = origin.split("://", 1)[0] + "://"
    return given[: len(given) - len(listed)] if listed and given.endswith(listed) else scheme


def _listing(
    path: str, split: str, located: tuple[Any, str] | None = None
) -> tuple[list[str], list[str]]:
    """(subfolders, files below) of ``path``, each sorted; refused where nothing is there.
    ``located``: ``_filesystem(path)``, where the caller has it already."""
    import pyarrow.fs

    fs, root = located or _filesystem(path)
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


def _image_classes(path: str, split: str, located: tuple[Any, str]) -> dict[str, list[str]]:
    """An image folder's classes (its subfolders, sorted) and each one's images, sorted
    (``located``: ``_filesystem(path)``)."""
    root = located[1]
    address = _addresser(path, root)
    folders, files = _listing(path, split, located)
    classes: dict[str, list[str]] = {
        os.path.relpath(f, root): [] for f in folders if os.path.dirname(f) == root.rstrip("/")
    }
    stray = []
    for name in files:
        if name.rsplit(".", 1)[-1].lower() not in IMAGE_EXTENSIONS:
            continue
        parts = os.path.relpath(name, root).split(os.sep)
        if len(parts) < 2:
            stray.append(name)
            continue
        classes.setdefault(parts[0], []).append(address(name))
    if stray:
        raise ConfigurationError(
            f"dataset.{split}: {stray[0]} (and {len(stray) - 1} more) is not in a class "
            f"subfolder of {path}. An image folder holds one subfolder per class "
            "(train/cat/1.png, train/dog/2.png); move the images into their class's folder"
        )
    empty = [name for name, images in classes.items() if not images]
    if not classes or len(empty) == len(classes):
        raise ConfigurationError(
            f"dataset.{split}: {path} holds no images ({', '.join(IMAGE_EXTENSIONS)}) in "
            "class subfolders. Point it at a folder with one subfolder per class"
        )
    if empty:
        raise ConfigurationError(
            f"dataset.{split}: the class folder {os.path.join(path, empty[0])} holds no images "
            f"({len(empty)} empty in all). Remove the empty class folders or add their images"
        )
    return dict(sorted(classes.items()))


def _held_out(files: list[str], every: int, path: str) -> tuple[list[str], list[str]]:
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
class _Order:
    """How a split's pipeline reads its files: ``epochs`` epochs in a row, each in a new
    order drawn from ``seed`` (None: one epoch in file order, a validation split's)."""

    epochs: int = 1
    seed: int | None = None


def _bytes_of(
    origin: str, located: tuple[Any, str], files: list[str], order: _Order, per_task: int
) -> tuple[Dataset, int]:
    """``files`` of the split at ``origin`` as ``{"bytes", "path"}`` rows, read in ``order``;
    and the epochs one execution reads."""
    fs, root = located
    read = ReadBytes(tuple(files), fs, _prefix(origin, root), order.seed, per_task)
    return read_files(read, order.epochs)


def _image_pipeline(
    dataset: DatasetSpec,
    origin: str,
    located: tuple[Any, str],
    files: list[str],
    classes: tuple[str, ...],
    order: _Order,
    ledger: Any,
) -> tuple[Dataset, int]:
    """An image split's pipeline and the epochs one execution reads."""
    image = dataset.image
    root = _prefix(origin, located[1]) + located[1]  # as the listed paths begin
    ds, epochs = _bytes_of(origin, located, files, order, ROWS_PER_BLOCK)
    prepare = _ImageBatches(
        root=root.rstrip("/"),
        classes=classes,
        mode=image.mode.value,
        size=None if image.size is None else (image.size[0], image.size[1]),
        mean=tuple(image.mean),
        std=tuple(image.std),
        ledger=ledger,
    )
    return ds.map_batches(prepare, batch_format="numpy"), epochs


def _image_source(
    dataset: DatasetSpec, ledger: Any, horizon: Horizon
) -> tuple[dict[str, Dataset], StreamCounts]:
    assert dataset.train is not None  # the spec's check
    located = _filesystem(dataset.train)
    train = _image_classes(dataset.train, TRAIN, located)
    classes = tuple(train)
    every = [f for images in train.values() for f in images]
    if dataset.validation_every is not None:
        kept, held = _held_out(every, dataset.validation_every, dataset.train)
        held_origin, held_located = dataset.train, located
    else:
        assert dataset.validation is not None
        held_origin, held_located = dataset.validation, _filesystem(dataset.validation)
        validation = _image_classes(dataset.validation, VALIDATION, held_located)
        unknown = sorted(set(validation) - set(train))
        if unknown:
            raise ConfigurationError(
                f"dataset.validation: class folders {', '.join(unknown)} of "
                f"{dataset.validation} are not in the training split {dataset.train}. Give "
                "both splits the same class folders"
            )
        kept, held = every, [f for images in validation.values() for f in images]
    order = _train_order(dataset, horizon, len(kept))
    train_ds, epochs = _image_pipeline(
        dataset, dataset.train, located, kept, classes, order, ledger
    )
    val_ds, _ = _image_pipeline(dataset, held_origin, held_located, held, classes, _Order(), ledger)
    counts = StreamCounts(len(kept), len(held), classes, epochs=epochs)
    return {TRAIN: train_ds, VALIDATION: val_ds}, counts


def _train_order(dataset: DatasetSpec, horizon: Horizon, rows: int) -> _Order:
    """How the training split of ``rows`` rows is read: the job's epochs in one execution
    (one, with ``dataset.limit``, whose rows are the first of the stream), each epoch's files
    in an order drawn from the job's seed."""
    epochs = 1 if dataset.limit is not None else horizon.epochs(rows, dataset.batch_size)
    return _Order(epochs, horizon.seed)


@dataclass(frozen=True)
class _ImageBatches:
    """An image folder's batch (Ray Data's ``bytes`` and ``path`` rows) as the model's input:
    ``x`` (n, C, H, W) decoded, converted to ``mode``, resized to ``size``, scaled to [0, 1]
    and normalised by the spec's mean and std, ``y`` the class folder's index."""

    root: str
    classes: tuple[str, ...]
    mode: str
    size: tuple[int, int] | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    ledger: Any = None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        index = {name: i for i, name in enumerate(self.classes)}
        labels = []
        for path in batch["path"]:
            name = str(path)
            relative = name[len(self.root) :] if name.startswith(self.root) else name
            folder = relative.lstrip("/").split("/", 1)[0]
            if folder not in index:
                raise ConfigurationError(
                    f"{path}: its class folder {folder!r} is not one of the training split's "
                    f"classes ({', '.join(self.classes)}). Give both splits the same class "
                    "folders"
                )
            labels.append(index[folder])
        images, keep, reasons = _decode(batch["bytes"], batch["path"], self.mode, self.size)
        _refuse(self.ledger, [f"{r}. Fix or remove the file" for r in reasons])
        y = np.asarray(labels, np.int64)[keep]
        return {"x": _normalise(images, self.mean, self.std), "y": y}


def _decode(
    values: Any, paths: Any, mode: str, size: tuple[int, int] | None, what: str = "file"
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Encoded images (PNG, JPEG, ...) as (n, C, H, W) uint8, converted to ``mode`` and
    resized to ``size`` ([height, width]); with the rows kept (a mask) and why the others were
    not (each naming its ``paths`` entry)."""
    from PIL import Image

    images, keep, reasons = [], [], []
    for i, raw in enumerate(values):
        try:
            with Image.open(io.BytesIO(raw)) as opened:
                picture = opened.convert(mode)
                if size is not None:
                    picture = picture.resize((size[1], size[0]))
                images.append(np.asarray(picture))
                keep.append(True)
        except (OSError, ValueError) as err:
            keep.append(False)
            where = f"row {i} of a batch of {what}" if what != "file" else "the file"
            reasons.append(f"{paths[i]}: {where} is not a readable image ({err})")
    decoded: Any = images
    if not images:  # every one unreadable: an empty batch of the size asked for
        channels = () if mode == ImageMode.GRAY.value else (3,)
        decoded = np.empty((0, *(size or (1, 1)), *channels), np.uint8)
    return _stack_images(decoded, paths), np.asarray(keep, bool), reasons


def _stack_images(images: Any, paths: Any) -> np.ndarray:
    """(n, C, H, W) uint8 from Ray Data's image column: (n, H, W) or (n, H, W, C), or a list of
    arrays when the sizes differ (refused: the fix is ``dataset.image.size``)."""
    if isinstance(images, np.ndarray) and images.dtype != object:
        array = images
    else:
        shapes = {tuple(np.shape(i)) for i in images}
        if len(shapes) > 1:
            raise ConfigurationError(
                f"images of different sizes in one batch ({sorted(shapes)[:3]}, e.g. "
                f"{paths[0]}): set dataset.image.size: [height, width] to resize them all"
            )
        array = np.stack(list(images))
    return array[:, None, :, :] if array.ndim == 3 else array.transpose(0, 3, 1, 2)


def _normalise(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    channels = images.shape[1]
    if len(mean) not in (1, channels):
        raise ConfigurationError(
            f"dataset.image.mean has {len(mean)} values for images of {channels} channels: "
            "give one value, or one per channel"
        )
    x = images.astype(np.float32) / 255.0
    m = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
    return (x - m) / s


@dataclass(frozen=True)
class _TableBatches:
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
            images, readable, unreadable = _decode(
                values, paths, self.mode, self.size, f"column {self.input!r}"
            )
            reasons += [f"{r}. Fix or remove the row" for r in unreadable]
            _refuse(self.ledger, reasons)
            x = _normalise(images[keep[readable]], self.mean, self.std)
            keep &= readable
        else:
            _refuse(self.ledger, reasons)
            array = np.stack([np.asarray(v) for v in values[keep]])
            if self.size is not None:
                array = array.reshape(array.shape[0], -1, *self.size)
            x = (
                _normalise(array, self.mean, self.std)
                if array.dtype == np.uint8 and array.ndim == 4
                else array.astype(np.float32)
            )
        return {"x": x, "y": labels[keep].astype(np.int64)}


def _windows(values: np.ndarray, context: int) -> np.ndarray:
    """``values`` (one sequence) cut into windows of ``context + 1``, each starting where the
    last one's inputs end (so every value but the first is a target once): (n, context + 1)."""
    count = (len(values) - 1) // context
    if count < 1:
        return np.empty((0, context + 1), values.dtype)
    view = np.lib.stride_tricks.sliding_window_view(values[: count * context + 1], context + 1)
    return view[::context]


@dataclass(frozen=True)
class _TokenWindows:
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
        _refuse(self.ledger, reasons)
        windows = [_windows(row, self.context) for row in rows]
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
    fs, prefix = located[0], _prefix(origin, located[1])
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
        order = _Order() if horizon is None else _train_order(dataset, horizon, counted)
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
        windows = _TokenWindows(
            column=columns.tokens,
            context=dataset.window,
            length=length,
            vocabulary=dataset.classes,
            ledger=ledger,
        )
        ds, epochs = read(rows * per_row)
        return ds.map_batches(windows, batch_format="numpy"), rows * per_row, epochs
    image = dataset.image
    prepare = _TableBatches(
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
    """A Parquet split's files and ``_filesystem(path)``."""
    located = _filesystem(path)
    _, files = _listing(path, split, located)
    address = _addresser(path, located[1])
    parquet = [address(f) for f in files if f.endswith(".parquet")]
    if not parquet:
        raise ConfigurationError(
            f"dataset.{split}: {path} holds no .parquet files. Point it at a Parquet file or "
            "a folder of them"
        )
    return parquet, located


def _parquet_source(
    dataset: DatasetSpec, ledger: Any, horizon: Horizon
) -> tuple[dict[str, Dataset], StreamCounts]:
    assert dataset.train is not None  # the spec's check
    train, located = _parquet_files(dataset.train, TRAIN)
    if dataset.validation_every is not None:
        kept, held = _held_out(train, dataset.validation_every, dataset.train)
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


TEXT_EXTENSION = ".txt"
TEXT_RUN = 64  # windows held out together by validation_every (a run of text, not scattered)


def _held_windows(windows: int, every: int) -> int:
    """How many of windows ``0 .. windows - 1`` fall in every ``every``-th run of ``TEXT_RUN``
    (the runs ``every - 1``, ``2 every - 1``, ...)."""
    cycle = TEXT_RUN * every
    return (windows // cycle) * TEXT_RUN + max(0, windows % cycle - TEXT_RUN * (every - 1))


@dataclass(frozen=True)
class _TextWindows:
    """Whole text files (Ray Data's ``bytes`` rows) cut into byte windows of ``context + 1``
    (``{"window": uint8 (n, context + 1)}``), each file's windows numbered from ``first``
    (its first window's place among all of them, in path order); with ``every``, only the
    windows of this split's runs (``keep``: the held-out ones, or the rest). ``shuffle``: in a
    new random order (a training split's; files hold their text in order)."""

    context: int
    root: str
    first: dict[str, int]
    every: int | None
    keep: bool
    shuffle: bool

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        parts = []
        for raw, path in zip(batch["bytes"], batch["path"], strict=True):
            windows = _windows(np.frombuffer(raw, np.uint8), self.context)
            if self.every is not None:
                start = self.first[_relative(str(path), self.root)]
                run = (start + np.arange(len(windows))) // TEXT_RUN
                windows = windows[(run % self.every == self.every - 1) == self.keep]
            parts.append(windows)
        out = np.concatenate(parts) if parts else np.empty((0, self.context + 1), np.uint8)
        if self.shuffle:
            out = out[np.random.default_rng().permutation(len(out))]
        return {"window": np.ascontiguousarray(out)}


def _relative(path: str, root: str) -> str:
    """``path`` below ``root`` (Ray Data's path column and a listing's agree below it)."""
    position = path.find(root)
    return path[position + len(root) :].lstrip("/") if position >= 0 else path


def _text_files(path: str, split: str, located: tuple[Any, str]) -> list[tuple[str, int]]:
    """(file, size in bytes) of a text split: the file named, or a folder's ``*.txt`` files
    (``located``: ``_filesystem(path)``)."""
    import pyarrow.fs

    fs, root = located
    info = fs.get_file_info(root)
    if info.type == pyarrow.fs.FileType.File:
        return [(root, info.size)]
    _, files = _listing(path, split, (fs, root))
    text = [f for f in files if f.lower().endswith(TEXT_EXTENSION)]
    if not text:
        raise ConfigurationError(
            f"dataset.{split}: {path} holds no {TEXT_EXTENSION} files. Point it at a text "
            f"file, or a folder of {TEXT_EXTENSION} files"
        )
    return [(f, e.size) for f, e in zip(text, fs.get_file_info(text), strict=True)]


@dataclass(frozen=True)
class _TextSplit:
    """A text split, listed and counted: its files in path order, their common folder, each
    file's first window's number, and the split's windows; where it lies (``_filesystem``)."""

    files: list[str]
    root: str
    first: dict[str, int]
    rows: int
    origin: str
    located: tuple[Any, str]


def _text_split(dataset: DatasetSpec, path: str, split: str, held: bool) -> _TextSplit:
    """``path``'s windows (with ``validation_every``: its held-out runs, or the rest)."""
    context, every = dataset.window, dataset.validation_every
    located = _filesystem(path)
    files = _text_files(path, split, located)
    root = located[1]
    address = _addresser(path, root)
    if len(files) == 1 and files[0][0] == root:  # a file named, not a folder
        root = os.path.dirname(root)
    first, total = {}, 0
    for name, size in files:
        first[_relative(name, root)] = total
        total += max(0, (size - 1) // context)
    rows = total
    if every is not None:
        rows = _held_windows(total, every) if held else total - _held_windows(total, every)
    if rows < 1:
        raise ConfigurationError(
            f"dataset.{split}: {path} holds {total} window(s) of dataset.context + 1 = "
            f"{context + 1} bytes"
            + (f", none of them in every {every}th run of {TEXT_RUN}" if every else "")
            + ". Add text, lower dataset.context"
            + (", or lower validation_every" if every else "")
        )
    return _TextSplit([address(name) for name, _ in files], root, first, rows, path, located)


def _text_pipeline(
    dataset: DatasetSpec, text: _TextSplit, held: bool, order: _Order | None
) -> tuple[Dataset, int]:
    """A text split's pipeline (``order``: a training split's; None: one epoch in file order)
    and the epochs one execution reads."""
    shuffle = order is not None
    ds, epochs = _bytes_of(text.origin, text.located, text.files, order or _Order(), 1)
    windows = _TextWindows(
        context=dataset.window,
        root=text.root,
        first=text.first,
        every=dataset.validation_every,
        keep=held,
        shuffle=shuffle,
    )
    return ds.map_batches(windows, batch_format="numpy"), epochs


def _text_source(dataset: DatasetSpec, horizon: Horizon) -> tuple[dict[str, Dataset], StreamCounts]:
    assert dataset.train is not None  # the spec's check
    train = _text_split(dataset, dataset.train, TRAIN, held=False)
    if dataset.validation_every is not None:
        validation = _text_split(dataset, dataset.train, VALIDATION, held=True)
    else:
        assert dataset.validation is not None
        validation = _text_split(dataset, dataset.validation, VALIDATION, held=False)
    order = _train_order(dataset, horizon, train.rows)
    train_ds, epochs = _text_pipeline(dataset, train, held=False, order=order)
    val_ds, _ = _text_pipeline(dataset, validation, held=True, order=None)
    counts = StreamCounts(train.rows, validation.rows, epochs=epochs)
    return {TRAIN: train_ds, VALIDATION: val_ds}, counts


def open_stream(
    dataset: DatasetSpec, horizon: Horizon | None = None
) -> tuple[dict[str, Dataset], StreamCounts]:
    """The job's two pipelines (``train``, ``validation``) and their counts, checked; the
    validation split read once into Ray's object store (bad data in it fails here). The
    training pipeline reads the epochs ``horizon`` needs (default: one, seed 0) in one
    execution (``stream_read``).

    Raises:
        ConfigurationError: a folder that is missing or empty, a class folder without images,
            validation classes training lacks, a missing Parquet column, a ``validation_every``
            that leaves a split empty, text too short for one window (each names the path and
            the fix).
    """
    from ray.data import DataContext

    quiet_here()  # Ray Data's INFO lines in ray-data.log, not on the job's terminal
    DataContext.get_current().enable_progress_bars = False
    source = StreamSource(dataset.name)
    ledger = None
    if dataset.bad_records is BadRecords.SKIP and source is not StreamSource.TEXT:
        import ray

        ledger = ray.remote(num_cpus=0)(SkipLedger).remote()  # the driver's, as long as it runs
    horizon = horizon or Horizon()
    if source is StreamSource.IMAGE_FOLDER:
        pipelines, counts = _image_source(dataset, ledger, horizon)
    elif source is StreamSource.PARQUET:
        pipelines, counts = _parquet_source(dataset, ledger, horizon)
    else:
        pipelines, counts = _text_source(
            dataset, horizon
        )  # every byte is a text's: nothing to skip
    if dataset.limit is not None:
        pipelines = {name: ds.limit(dataset.limit) for name, ds in pipelines.items()}
        counts = replace(
            counts,
            train_rows=min(counts.train_rows, dataset.limit),
            validation_rows=min(counts.validation_rows, dataset.limit),
        )
    counts = replace(counts, ledger=ledger)
    block = block_bytes(dataset, pipelines[TRAIN].context.target_max_block_size)
    if block is not None:
        pipelines[TRAIN].context.target_max_block_size = block
    # The validation split is read every evaluation: read and decoded once, into Ray's object
    # store (which spills to disk), not again each time (a new execution of the pipeline
    # costs seconds before its first batch). In file order: Ray Data otherwise hands on
    # whichever read task finishes first, so the rows a limit keeps (and the order of the
    # evaluation's batches) would change run to run.
    ordered = pipelines[VALIDATION]
    ordered.context.execution_options.preserve_order = True
    pipelines[VALIDATION] = ordered.materialize()
    return pipelines, counts


ROWS_PER_BLOCK = 1024  # a training pipeline's blocks, in rows (``block_bytes``)
MIN_BLOCK_BYTES = 1 << 20


def block_bytes(dataset: DatasetSpec, default: int | None) -> int | None:
    """The largest block the training pipeline's tasks hand on, in bytes: about
    ``ROWS_PER_BLOCK`` rows as the model reads them (at least ``MIN_BLOCK_BYTES``), where a
    row's size is known before reading (windows of tokens; images resized by
    ``dataset.image.size``); None (Ray Data's ``default``) otherwise, or where that is smaller.

    Ray Data's default (128 MiB) makes one block of a whole Parquet file or read task, and a
    worker's first batch of an execution waits until a block is whole: with tasks reading at
    once on the same CPUs, nearly the epoch's whole read (docs/data.md, measured)."""
    if StreamSource(dataset.name) is StreamSource.TEXT or dataset.columns.tokens is not None:
        row = (dataset.window + 1) * 8  # a window of tokens (input and target), <= 8 bytes each
    elif dataset.image.size is not None:
        channels = 1 if dataset.image.mode is ImageMode.GRAY else 3
        row = channels * dataset.image.size[0] * dataset.image.size[1] * 4 + 8  # float32 + label
    else:
        return None
    wanted = max(ROWS_PER_BLOCK * row, MIN_BLOCK_BYTES)
    return wanted if default is None or wanted < default else None


def spare_cpus_message(
    cluster_cpus: float, workers: int, cpus_per_worker: float, trials: int = 1
) -> str | None:
    """Why a streamed job cannot run on a cluster of ``cluster_cpus`` CPUs (its workers, those
    of ``trials`` trials of a sweep at once, would leave Ray Data none to read with), or
    None."""
    taken = trials * workers * cpus_per_worker
    if cluster_cpus - taken >= 1:
        return None
    why = (
        "a streamed dataset is read and preprocessed by Ray Data on CPUs the workers do not "
        f"hold, and the cluster has {cluster_cpus:g} CPUs, all taken by"
    )
    held = f"{workers} workers x {cpus_per_worker:g} CPUs"
    if trials > 1 and cluster_cpus - workers * cpus_per_worker >= 1:  # one trial at a time fits
        fits = max(1, math.floor((cluster_cpus - 1) / (workers * cpus_per_worker)))
        return (
            f"{why} {trials} trials at once (sweep.concurrent) of {held}. Lower "
            f"sweep.concurrent (e.g. to {fits}) or scaling.cpus_per_worker, use fewer workers, "
            "or add CPUs"
        )
    return (
        f"{why} {held}. Lower scaling.cpus_per_worker (e.g. to "
        f"{max((cluster_cpus - 1) / workers, 0.1):.2g}), use fewer workers, or add CPUs"
    )
