"""Training helpers: Fashion-MNIST IDX loading, small models, and the end-to-end example."""

from kaisa_ray.train.datasets import (
    DEFAULT_FASHION_MNIST_DIR,
    DatasetNotFoundError,
    IDXFormatError,
    load_idx_dataset,
    read_idx,
    synthetic_dataset,
    train_pixel_stats,
)
from kaisa_ray.train.example import evaluate, run_example
from kaisa_ray.train.models import MLP, LeNetCNN

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
