"""Training on Ray Train: the JobSpec, models and datasets, the worker, the driver, progress.

The names below are imported when first used, so that torch-free modules of this package
(``records``, ``follow``) load without torch: the service's client commands use them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kaisa_train.datasets import (
        DEFAULT_FASHION_MNIST_DIR,
        DatasetNotFoundError,
        IDXFormatError,
        load_idx_dataset,
        read_idx,
        synthetic_dataset,
        train_pixel_stats,
    )
    from kaisa_train.example import evaluate, run_example
    from kaisa_train.models import MLP, LeNetCNN

_WHERE = {
    "DEFAULT_FASHION_MNIST_DIR": "datasets",
    "DatasetNotFoundError": "datasets",
    "IDXFormatError": "datasets",
    "load_idx_dataset": "datasets",
    "read_idx": "datasets",
    "synthetic_dataset": "datasets",
    "train_pixel_stats": "datasets",
    "evaluate": "example",
    "run_example": "example",
    "MLP": "models",
    "LeNetCNN": "models",
}

__all__ = [
    "DEFAULT_FASHION_MNIST_DIR",
    "MLP",
    "DatasetNotFoundError",
    "IDXFormatError",
    "LeNetCNN",
    "evaluate",
    "load_idx_dataset",
    "read_idx",
    "run_example",
    "synthetic_dataset",
    "train_pixel_stats",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kaisa_train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kaisa_train.{module}"), name)
