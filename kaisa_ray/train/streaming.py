"""Datasets streamed to the workers by Ray Data: a user's own image folder or Parquet files,
read and preprocessed on the cluster's CPUs, each worker holding a bounded window.

The driver opens the sources (``open_stream``): it lists the files, checks what it can before
anything starts (an empty folder, a missing column, validation classes training lacks), counts
the rows, and builds one Ray Data pipeline per split, read with the files in a new random
order each epoch and preprocessed by ``map_batches`` tasks into ``{"x": float32, "y": int64}``
batches. Ray Train splits both pipelines over the workers (``streaming_split``, every worker as
many rows); a worker reads its share through ``StreamShard``, which keeps the in-memory
``Shard``'s contract: step ``s`` is batch ``(s-1) % steps_per_epoch`` of epoch
``(s-1) // steps_per_epoch``, and within an epoch the rows come through a shuffle window of
``dataset.shuffle_buffer`` rows.

What streaming does not give: which rows fill a batch depends on the order in which the
pipeline's blocks reach the workers, so two runs of a streamed job are not bit for bit the
same, and a resumed run continues at its step and epoch with the rest of that epoch drawn
afresh from the epoch's data (the batches it had read before the stop are not skipped over,
and some rows are seen twice that epoch, others not at all). Up to ``workers - 1`` rows of each
split are left out of an epoch so that every worker reads as many (Ray Train's equal split).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kaisa_ray.errors import ConfigurationError
from kaisa_ray.train.stream_sources import StreamSource, is_uri

if TYPE_CHECKING:
    from ray.data import DataIterator, Dataset

    from kaisa_ray.train.spec import DatasetSpec

__all__ = [
    "IMAGE_EXTENSIONS",
    "TRAIN",
    "VALIDATION",
    "StreamCounts",
    "StreamShard",
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


# -- the driver: listing, checking, and the pipelines ------------------------------------------


def _filesystem(path: str) -> tuple[Any, str]:
    import pyarrow.fs

    if is_uri(path):
        return pyarrow.fs.FileSystem.from_uri(path)  # type: ignore[no-any-return]
    return pyarrow.fs.LocalFileSystem(), os.path.abspath(path)


def _listing(path: str, split: str) -> tuple[list[str], list[str]]:
    """(subfolders, files below) of ``path``, each sorted; refused where nothing is there."""
    import pyarrow.fs

    fs, root = _filesystem(path)
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


def _image_classes(path: str, split: str) -> dict[str, int]:
    """An image folder's classes (its subfolders, sorted) and its images' count per class."""
    _, root = _filesystem(path)
    folders, files = _listing(path, split)
    counts = {
        os.path.relpath(f, root): 0 for f in folders if os.path.dirname(f) == root.rstrip("/")
    }
    stray = []
    for name in files:
        if name.rsplit(".", 1)[-1].lower() not in IMAGE_EXTENSIONS:
            continue
        parts = os.path.relpath(name, root).split(os.sep)
        if len(parts) < 2:
            stray.append(name)
            continue
        counts[parts[0]] = counts.get(parts[0], 0) + 1
    if stray:
        raise ConfigurationError(
            f"dataset.{split}: {stray[0]} (and {len(stray) - 1} more) is not in a class "
            f"subfolder of {path}. An image folder holds one subfolder per class "
            "(train/cat/1.png, train/dog/2.png); move the images into their class's folder"
        )
    empty = [name for name, n in counts.items() if n == 0]
    if not counts or sum(counts.values()) == 0:
        raise ConfigurationError(
            f"dataset.{split}: {path} holds no images ({', '.join(IMAGE_EXTENSIONS)}) in "
            "class subfolders. Point it at a folder with one subfolder per class"
        )
    if empty:
        raise ConfigurationError(
            f"dataset.{split}: the class folder {os.path.join(path, empty[0])} holds no images "
            f"({len(empty)} empty in all). Remove the empty class folders or add their images"
        )
    return dict(sorted(counts.items()))


def _image_pipeline(
    dataset: DatasetSpec, path: str, classes: tuple[str, ...], shuffle: bool
) -> Dataset:
    import ray.data

    image = dataset.image
    ds = ray.data.read_images(
        path,
        mode=image.mode.value,
        size=None if image.size is None else (image.size[0], image.size[1]),
        include_paths=True,
        shuffle="files" if shuffle else None,
        file_extensions=list(IMAGE_EXTENSIONS),
    )
    _, root = _filesystem(path)
    prepare = _ImageBatches(
        root=root.rstrip("/"),
        classes=classes,
        mean=tuple(image.mean),
        std=tuple(image.std),
    )
    return ds.map_batches(prepare, batch_format="numpy")


@dataclass(frozen=True)
class _ImageBatches:
    """An image folder's batch as the model's input: ``x`` (n, C, H, W) scaled to [0, 1] and
    normalised by the spec's mean and std, ``y`` the class folder's index."""

    root: str
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

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
        images = _stack_images(batch["image"], batch["path"])
        return {"x": _normalise(images, self.mean, self.std), "y": np.asarray(labels, np.int64)}


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

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        paths = batch["path"]
        labels = np.asarray(batch[self.label])
        if labels.dtype.kind not in "iu":
            raise ConfigurationError(
                f"{paths[0]}: column {self.label!r} holds {labels.dtype} values; the labels "
                "must be integers (class indices from 0)"
            )
        bad = (labels < 0) | (labels >= (self.classes or np.iinfo(np.int64).max))
        if bad.any():
            i = int(np.argmax(bad))
            limit = f"0 to {self.classes - 1}" if self.classes else "0 or more"
            raise ConfigurationError(
                f"{paths[i]}: label {int(labels[i])} in column {self.label!r} is outside the "
                f"classes ({limit}). Fix the file, or set dataset.classes to the model's classes"
            )
        values = batch[self.input]
        first = values[0]
        if isinstance(first, bytes | bytearray):
            x = _normalise(self._decode(values, paths), self.mean, self.std)
        else:
            array = np.stack([np.asarray(v) for v in values])
            if self.size is not None:
                array = array.reshape(array.shape[0], -1, *self.size)
            x = (
                _normalise(array, self.mean, self.std)
                if array.dtype == np.uint8 and array.ndim == 4
                else array.astype(np.float32)
            )
        return {"x": x, "y": labels.astype(np.int64)}

    def _decode(self, values: Any, paths: Any) -> np.ndarray:
        from PIL import Image

        images = []
        for i, raw in enumerate(values):
            try:
                with Image.open(io.BytesIO(raw)) as opened:
                    picture = opened.convert(self.mode)
                    if self.size is not None:
                        picture = picture.resize((self.size[1], self.size[0]))
                    images.append(np.asarray(picture))
            except (OSError, ValueError) as err:
                raise ConfigurationError(
                    f"{paths[i]}: row {i} of a batch of column {self.input!r} is not a readable "
                    f"image ({err}). Fix or remove the row"
                ) from None
        return _stack_images(images, paths)


def _parquet_pipeline(dataset: DatasetSpec, path: str, shuffle: bool) -> tuple[Dataset, int]:
    import ray.data

    split = TRAIN if shuffle else VALIDATION
    _, files = _listing(path, split)
    parquet = [f for f in files if f.endswith(".parquet")]
    if not parquet:
        raise ConfigurationError(
            f"dataset.{split}: {path} holds no .parquet files. Point it at a Parquet file or "
            "a folder of them"
        )
    columns = dataset.columns
    import pyarrow.parquet as pq

    fs, _ = _filesystem(path)
    try:
        with fs.open_input_file(parquet[0]) as opened:
            names = set(pq.read_schema(opened).names)
    except (OSError, ValueError) as err:
        raise ConfigurationError(
            f"dataset.{split}: {parquet[0]} is not a readable Parquet file ({err}). Fix or "
            "remove it"
        ) from None
    missing = [c for c in (columns.input, columns.label) if c not in names]
    if missing:
        raise ConfigurationError(
            f"dataset.{split}: {parquet[0]} has no column {missing[0]!r} (it has "
            f"{', '.join(sorted(names))}). Set dataset.columns.input and dataset.columns.label "
            "to its names"
        )
    ds = ray.data.read_parquet(
        path,
        columns=[columns.input, columns.label],
        include_paths=True,
        shuffle="files" if shuffle else None,
    )
    rows = ds.count()
    image = dataset.image
    prepare = _TableBatches(
        input=columns.input,
        label=columns.label,
        mode=image.mode.value,
        size=None if image.size is None else (image.size[0], image.size[1]),
        mean=tuple(image.mean),
        std=tuple(image.std),
        classes=dataset.classes,
    )
    return ds.map_batches(prepare, batch_format="numpy"), rows


def open_stream(dataset: DatasetSpec) -> tuple[dict[str, Dataset], StreamCounts]:
    """The job's two pipelines (``train``, ``validation``) and their counts, checked; the
    validation split read once into Ray's object store (bad data in it fails here).

    Raises:
        ConfigurationError: a folder that is missing or empty, a class folder without images,
            validation classes training lacks, a missing Parquet column (each names the path
            and the fix).
    """
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    assert dataset.train is not None  # the spec's check
    assert dataset.validation is not None
    source = StreamSource(dataset.name)
    if source is StreamSource.IMAGE_FOLDER:
        train = _image_classes(dataset.train, TRAIN)
        validation = _image_classes(dataset.validation, VALIDATION)
        unknown = sorted(set(validation) - set(train))
        if unknown:
            raise ConfigurationError(
                f"dataset.validation: class folders {', '.join(unknown)} of "
                f"{dataset.validation} are not in the training split {dataset.train}. Give "
                "both splits the same class folders"
            )
        classes = tuple(train)
        pipelines = {
            TRAIN: _image_pipeline(dataset, dataset.train, classes, shuffle=True),
            VALIDATION: _image_pipeline(dataset, dataset.validation, classes, shuffle=False),
        }
        counts = StreamCounts(sum(train.values()), sum(validation.values()), classes)
    else:
        train_ds, train_rows = _parquet_pipeline(dataset, dataset.train, shuffle=True)
        val_ds, val_rows = _parquet_pipeline(dataset, dataset.validation, shuffle=False)
        pipelines = {TRAIN: train_ds, VALIDATION: val_ds}
        counts = StreamCounts(train_rows, val_rows)
    if dataset.limit is not None:
        pipelines = {name: ds.limit(dataset.limit) for name, ds in pipelines.items()}
        counts = StreamCounts(
            min(counts.train_rows, dataset.limit),
            min(counts.validation_rows, dataset.limit),
            counts.classes,
        )
    # The validation split is read every evaluation: read and decoded once, into Ray's object
    # store (which spills to disk), not again each time (a new execution of the pipeline
    # costs seconds before its first batch).
    # In file order: Ray Data otherwise hands on whichever read task finishes first, so the
    # rows a limit keeps (and the order of the evaluation's batches) would change run to run.
    ordered = pipelines[VALIDATION]
    ordered.context.execution_options.preserve_order = True
    pipelines[VALIDATION] = ordered.materialize()
    return pipelines, counts


def spare_cpus_message(cluster_cpus: float, workers: int, cpus_per_worker: float) -> str | None:
    """Why a streamed job cannot run on a cluster of ``cluster_cpus`` CPUs (its workers would
    leave Ray Data none to read with), or None."""
    taken = workers * cpus_per_worker
    if cluster_cpus - taken >= 1:
        return None
    return (
        f"a streamed dataset is read and preprocessed by Ray Data on CPUs the workers do not "
        f"hold, and the cluster has {cluster_cpus:g} CPUs, all taken by {workers} workers x "
        f"{cpus_per_worker:g} CPUs. Lower scaling.cpus_per_worker (e.g. to "
        f"{max((cluster_cpus - 1) / workers, 0.1):.2g}), use fewer workers, or add CPUs"
    )


# -- a worker's share ------------------------------------------------------------------------


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
    waited_s: float = 0.0  # in ``batch``: seconds this worker waited for its data
    _next: tuple[int, int] | None = None  # (epoch, batch) the open iteration reads next
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
        )

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) that step ``step`` (1-based) reads."""
        return divmod(step - 1, self.steps_per_epoch)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = self.position(step)
        started = time.perf_counter()
        if self._batches is None or self._next != (epoch, index):
            # A new epoch, or a jump (a resume, the tuner's profile before training): a new
            # iteration of the split (every worker starts one at the same step).
            self._batches = iter(
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
        try:
            batch = next(self._batches)
        except StopIteration:
            raise ConfigurationError(
                f"the training split ran out at batch {index} of epoch {epoch} on worker "
                f"{self.rank}, before the {self.steps_per_epoch} batches its rows counted for: "
                "the files changed while the job ran, or rows were unreadable"
            ) from None
        self.waited_s += time.perf_counter() - started
        following = index + 1
        if following == self.steps_per_epoch:  # the epoch's rest (under a batch) is left
            self._batches, self._next = None, None
        else:
            self._next = (epoch, following)
        return batch["x"], batch["y"]

    def validation_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This worker's share of the validation split, in batches (every worker as many)."""
        for batch in self.validation.iter_torch_batches(batch_size=batch_size, device="cpu"):
            yield batch["x"], batch["y"]
