"""An image folder streamed by Ray Data: class subfolders listed and checked by the driver,
each image's bytes read by the read tasks, decoded, resized or cropped and normalised by
``map_batches`` tasks (``ImageBatches``; Parquet's image columns use the same decoding).

Torch-free: Ray Data's tasks import it.
"""

from __future__ import annotations

import io
import os
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
    bytes_of,
    held_out_files,
    list_folder,
    open_filesystem,
    path_addresser,
    refuse,
    train_order,
    uri_prefix,
)
from kaisa_train.stream_read import Horizon
from kaisa_train.stream_sources import ImageMode

if TYPE_CHECKING:
    from ray.data import Dataset

    from kaisa_train.spec import DatasetSpec

__all__ = ["IMAGE_EXTENSIONS", "ImageBatches", "decode_images", "image_source", "normalise"]


IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "gif", "tif", "tiff")


def _image_classes(path: str, split: str, located: tuple[Any, str]) -> dict[str, list[str]]:
    """An image folder's classes (its subfolders, sorted) and each one's images, sorted
    (``located``: ``open_filesystem(path)``)."""
    root = located[1]
    address = path_addresser(path, root)
    folders, files = list_folder(path, split, located)
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


def _image_pipeline(
    dataset: DatasetSpec,
    origin: str,
    located: tuple[Any, str],
    files: list[str],
    classes: tuple[str, ...],
    order: Order,
    ledger: Any,
) -> tuple[Dataset, int]:
    """An image split's pipeline and the epochs one execution reads."""
    image = dataset.image
    root = uri_prefix(origin, located[1]) + located[1]  # as the listed paths begin
    ds, epochs = bytes_of(origin, located, files, order, ROWS_PER_BLOCK)
    prepare = ImageBatches(
        root=root.rstrip("/"),
        classes=classes,
        mode=image.mode.value,
        size=None if image.size is None else (image.size[0], image.size[1]),
        mean=tuple(image.mean),
        std=tuple(image.std),
        ledger=ledger,
    )
    return ds.map_batches(prepare, batch_format="numpy"), epochs


def image_source(
    dataset: DatasetSpec, ledger: Any, horizon: Horizon
) -> tuple[dict[str, Dataset], StreamCounts]:
    assert dataset.train is not None  # the spec's check
    located = open_filesystem(dataset.train)
    train = _image_classes(dataset.train, TRAIN, located)
    classes = tuple(train)
    every = [f for images in train.values() for f in images]
    if dataset.validation_every is not None:
        kept, held = held_out_files(every, dataset.validation_every, dataset.train)
        held_origin, held_located = dataset.train, located
    else:
        assert dataset.validation is not None
        held_origin, held_located = dataset.validation, open_filesystem(dataset.validation)
        validation = _image_classes(dataset.validation, VALIDATION, held_located)
        unknown = sorted(set(validation) - set(train))
        if unknown:
            raise ConfigurationError(
                f"dataset.validation: class folders {', '.join(unknown)} of "
                f"{dataset.validation} are not in the training split {dataset.train}. Give "
                "both splits the same class folders"
            )
        kept, held = every, [f for images in validation.values() for f in images]
    order = train_order(dataset, horizon, len(kept))
    train_ds, epochs = _image_pipeline(
        dataset, dataset.train, located, kept, classes, order, ledger
    )
    val_ds, _ = _image_pipeline(dataset, held_origin, held_located, held, classes, Order(), ledger)
    counts = StreamCounts(len(kept), len(held), classes, epochs=epochs)
    return {TRAIN: train_ds, VALIDATION: val_ds}, counts


@dataclass(frozen=True)
class ImageBatches:
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
        images, keep, reasons = decode_images(batch["bytes"], batch["path"], self.mode, self.size)
        refuse(self.ledger, [f"{r}. Fix or remove the file" for r in reasons])
        y = np.asarray(labels, np.int64)[keep]
        return {"x": normalise(images, self.mean, self.std), "y": y}


def decode_images(
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


def normalise(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
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
