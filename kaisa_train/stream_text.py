"""Text files streamed by Ray Data as a language model's byte windows (``TextWindows``), every
``validation_every``-th run of ``TEXT_RUN`` windows held out for validation.

Torch-free: Ray Data's tasks import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kaisa_ray.errors import ConfigurationError
from kaisa_train.stream_files import (
    TRAIN,
    VALIDATION,
    Order,
    StreamCounts,
    bytes_of,
    cut_windows,
    list_folder,
    open_filesystem,
    path_addresser,
    train_order,
)
from kaisa_train.stream_read import Horizon

if TYPE_CHECKING:
    from ray.data import Dataset

    from kaisa_train.spec import DatasetSpec

__all__ = ["TEXT_EXTENSION", "TEXT_RUN", "TextWindows", "held_windows", "text_source"]


TEXT_EXTENSION = ".txt"


TEXT_RUN = 64  # windows held out together by validation_every (a run of text, not scattered)


def held_windows(windows: int, every: int) -> int:
    """How many of windows ``0 .. windows - 1`` fall in every ``every``-th run of ``TEXT_RUN``
    (the runs ``every - 1``, ``2 every - 1``, ...)."""
    cycle = TEXT_RUN * every
    return (windows // cycle) * TEXT_RUN + max(0, windows % cycle - TEXT_RUN * (every - 1))


@dataclass(frozen=True)
class TextWindows:
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
            windows = cut_windows(np.frombuffer(raw, np.uint8), self.context)
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
    (``located``: ``open_filesystem(path)``)."""
    import pyarrow.fs

    fs, root = located
    info = fs.get_file_info(root)
    if info.type == pyarrow.fs.FileType.File:
        return [(root, info.size)]
    _, files = list_folder(path, split, (fs, root))
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
    file's first window's number, and the split's windows; where it lies (``open_filesystem``)."""

    files: list[str]
    root: str
    first: dict[str, int]
    rows: int
    origin: str
    located: tuple[Any, str]


def _text_split(dataset: DatasetSpec, path: str, split: str, held: bool) -> _TextSplit:
    """``path``'s windows (with ``validation_every``: its held-out runs, or the rest)."""
    context, every = dataset.window, dataset.validation_every
    located = open_filesystem(path)
    files = _text_files(path, split, located)
    root = located[1]
    address = path_addresser(path, root)
    if len(files) == 1 and files[0][0] == root:  # a file named, not a folder
        root = os.path.dirname(root)
    first, total = {}, 0
    for name, size in files:
        first[_relative(name, root)] = total
        total += max(0, (size - 1) // context)
    rows = total
    if every is not None:
        rows = held_windows(total, every) if held else total - held_windows(total, every)
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
    dataset: DatasetSpec, text: _TextSplit, held: bool, order: Order | None
) -> tuple[Dataset, int]:
    """A text split's pipeline (``order``: a training split's; None: one epoch in file order)
    and the epochs one execution reads."""
    shuffle = order is not None
    ds, epochs = bytes_of(text.origin, text.located, text.files, order or Order(), 1)
    windows = TextWindows(
        context=dataset.window,
        root=text.root,
        first=text.first,
        every=dataset.validation_every,
        keep=held,
        shuffle=shuffle,
    )
    return ds.map_batches(windows, batch_format="numpy"), epochs


def text_source(dataset: DatasetSpec, horizon: Horizon) -> tuple[dict[str, Dataset], StreamCounts]:
    assert dataset.train is not None  # the spec's check
    train = _text_split(dataset, dataset.train, TRAIN, held=False)
    if dataset.validation_every is not None:
        validation = _text_split(dataset, dataset.train, VALIDATION, held=True)
    else:
        assert dataset.validation is not None
        validation = _text_split(dataset, dataset.validation, VALIDATION, held=False)
    order = train_order(dataset, horizon, train.rows)
    train_ds, epochs = _text_pipeline(dataset, train, held=False, order=order)
    val_ds, _ = _text_pipeline(dataset, validation, held=True, order=None)
    counts = StreamCounts(train.rows, validation.rows, epochs=epochs)
    return {TRAIN: train_ds, VALIDATION: val_ds}, counts
