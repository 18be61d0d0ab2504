"""A byte-level text corpus for language models: Debian's ``fortunes``, or any directory of text.

The corpus is every regular text file of a directory (symlinks and fortune's ``.dat`` index
files skipped), in name order, read as bytes: the vocabulary is the 256 byte values, so any
UTF-8 text works and nothing is fitted to the data. The last tenth of the bytes is the
validation split ("test", as the jobs call it), the rest the training split, so the two never
share text. A sample is a window of ``context + 1`` bytes, cut without overlap: ``x`` the first
``context`` bytes, ``y`` the same window shifted by one (next-byte targets).

Debian's ``fortunes`` package (``apt-get install fortunes``) puts about 2.4 MB of English text in
:data:`DEFAULT_FORTUNES_DIR`; nothing is downloaded at run time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kaisa_train.data_dirs import DEFAULT_FORTUNES_DIR
from kaisa_train.datasets import DatasetNotFoundError

VOCABULARY = 256
VALIDATION_SHARE = 0.1
CONTEXT = 64

__all__ = ["CONTEXT", "DEFAULT_FORTUNES_DIR", "VOCABULARY", "load_text_corpus"]


def _files(directory: Path) -> list[Path]:
    return sorted(
        path
        for path in directory.iterdir()
        if path.is_file() and not path.is_symlink() and path.suffix != ".dat"
    )


def read_corpus(data_dir: str | Path | None = None) -> bytes:
    """Every text file of ``data_dir`` (default: Debian's fortunes), concatenated in name order.

    Raises:
        DatasetNotFoundError: if the directory is missing or holds no text files.
    """
    directory = Path(data_dir) if data_dir is not None else DEFAULT_FORTUNES_DIR
    hint = (
        "install Debian's fortunes package (apt-get install fortunes) or set data_dir to a "
        "directory of text files"
    )
    if not directory.is_dir():
        raise DatasetNotFoundError(f"text corpus directory {directory} does not exist: {hint}")
    files = _files(directory)
    if not files:
        raise DatasetNotFoundError(f"text corpus directory {directory} has no text files: {hint}")
    return b"".join(path.read_bytes() for path in files)


def load_text_corpus(
    data_dir: str | Path | None = None,
    split: str = "train",
    *,
    limit: int | None = None,
    context: int = CONTEXT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-byte windows of a split: ``(x, y)``, both int64 ``(N, context)``.

    Args:
        data_dir: a directory of text files (default: Debian's fortunes).
        split: ``"train"`` (the first 90% of the bytes) or ``"test"`` (the last 10%).
        limit: keep only the first ``limit`` windows.
        context: window length in bytes.

    Raises:
        DatasetNotFoundError: if the corpus is missing.
        ValueError: if ``split``, ``limit`` or ``context`` is invalid, or the split is
            shorter than one window.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} is not valid; use 'train' or 'test'")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be a positive number of windows, or None")
    if context < 1:
        raise ValueError(f"context={context} must be a positive number of bytes")
    data = read_corpus(data_dir)
    cut = int(len(data) * (1 - VALIDATION_SHARE))
    part = data[:cut] if split == "train" else data[cut:]
    windows = (len(part) - 1) // context
    if windows < 1:
        raise ValueError(
            f"the {split} split has {len(part)} bytes, less than one window of {context + 1}: "
            "use a larger corpus or a shorter context"
        )
    if limit is not None:
        windows = min(windows, limit)
    tokens = torch.frombuffer(bytearray(part[: windows * context + 1]), dtype=torch.uint8).long()
    x = tokens[:-1].reshape(windows, context)
    y = tokens[1:].reshape(windows, context)
    return x.clone(), y.clone()
