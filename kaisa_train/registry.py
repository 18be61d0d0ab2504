"""Named models and datasets a job can ask for, extensible through Python entry points.

A package adds its own without forking kaisa-ray by declaring entry points::

    [project.entry-points."kaisa_ray.models"]
    my-net = "my_package.models:build_my_net"      # (**params) -> nn.Module

    [project.entry-points."kaisa_ray.datasets"]
    my-data = "my_package.data:load_my_data"       # (DatasetRequest) -> (x, y)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kaisa_train.corpus import DEFAULT_FORTUNES_DIR, load_text_corpus
from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR, load_idx_dataset, synthetic_dataset
from kaisa_train.models import MLP, LeNetCNN, ResNet20, WideMLP
from kaisa_train.models_large import BertLarge, ResNet50
from kaisa_train.transformer import CharTransformer

ModelFactory = Callable[..., nn.Module]


@dataclass(frozen=True, kw_only=True)
class DatasetRequest:
    """What a dataset loader is asked for."""

    split: str
    data_dir: Path | None
    limit: int | None
    seed: int


DatasetLoader = Callable[[DatasetRequest], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class DatasetEntry:
    loader: DatasetLoader
    needs_files: bool  # read from data_dir (checked before a job starts)
    default_dir: Path | None = None
    install_hint: str = ""


def _idx(request: DatasetRequest) -> tuple[torch.Tensor, torch.Tensor]:
    return load_idx_dataset(request.data_dir, request.split, limit=request.limit)  # type: ignore[arg-type]


def _text(request: DatasetRequest) -> tuple[torch.Tensor, torch.Tensor]:
    return load_text_corpus(request.data_dir, request.split, limit=request.limit)


def _synthetic(request: DatasetRequest) -> tuple[torch.Tensor, torch.Tensor]:
    size = request.limit or (2048 if request.split == "train" else 512)
    return synthetic_dataset(size, seed=request.seed + (0 if request.split == "train" else 1))


BUILTIN_MODELS: dict[str, ModelFactory] = {
    "lenet": LeNetCNN,
    "mlp": MLP,
    "wide-mlp": WideMLP,  # K-FAC's state outweighs the job: where the memory budget decides
    "resnet20": ResNet20,
    "resnet50": ResNet50,  # ImageNet; with kaisa-ray plan, priced on the meta device
    "bert-large": BertLarge,  # token ids in: for kaisa-ray plan, or a plugin token dataset
    "char-transformer": CharTransformer,  # byte-level language model, e.g. on fortunes
}
BUILTIN_DATASETS: dict[str, DatasetEntry] = {
    "fashion-mnist": DatasetEntry(
        loader=_idx,
        needs_files=True,
        default_dir=DEFAULT_FASHION_MNIST_DIR,
        install_hint="apt-get install dataset-fashion-mnist (Debian), or set data_dir to a "
        "directory holding the four IDX files",
    ),
    "mnist": DatasetEntry(
        loader=_idx,
        needs_files=True,
        install_hint="set data_dir to a directory holding MNIST's four IDX files",
    ),
    "fortunes": DatasetEntry(
        loader=_text,
        needs_files=True,
        default_dir=DEFAULT_FORTUNES_DIR,
        install_hint="apt-get install fortunes (Debian), or set data_dir to a directory of text "
        "files (any byte-level corpus)",
    ),
    "synthetic": DatasetEntry(loader=_synthetic, needs_files=False),
}


@functools.cache
def _plugins(group: str) -> dict[str, Any]:
    """The installed packages' entry points of ``group``, read once per process (a scan of
    every installed distribution; a spec names a model and a dataset on every validation)."""
    return {ep.name: ep for ep in entry_points(group=group)}


def model_names() -> list[str]:
    return sorted(set(BUILTIN_MODELS) | set(_plugins("kaisa_ray.models")))


def dataset_names() -> list[str]:
    return sorted(set(BUILTIN_DATASETS) | set(_plugins("kaisa_ray.datasets")))


def model_factory(name: str) -> ModelFactory:
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    plugins = _plugins("kaisa_ray.models")
    if name in plugins:
        factory: ModelFactory = plugins[name].load()
        return factory
    raise KeyError(f"unknown model {name!r}; registered models: {', '.join(model_names())}")


def dataset_entry(name: str) -> DatasetEntry:
    if name in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[name]
    plugins = _plugins("kaisa_ray.datasets")
    if name in plugins:
        return DatasetEntry(loader=plugins[name].load(), needs_files=False)
    raise KeyError(f"unknown dataset {name!r}; registered datasets: {', '.join(dataset_names())}")
