"""Where Debian's packages install the built-in datasets (torch-free: the JobSpec and the
service name them)."""

from __future__ import annotations

from pathlib import Path

#: Where Debian's ``dataset-fashion-mnist`` package installs the four gzipped IDX files.
DEFAULT_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
#: Where Debian's ``fortunes`` package installs its text files.
DEFAULT_FORTUNES_DIR = Path("/usr/share/games/fortunes")
