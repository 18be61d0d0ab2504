"""Named models and datasets a job can ask for, extensible through Python entry points.

A package adds its own without forking kaisa-ray by declaring entry points::

    [project.entry-points."kaisa_ray.models"]
    my-net = "my_package.models:build_my_net"      # (**params) -> nn.Module

    [project.entry-points."kaisa_ray.datasets"]
    my-data = "my_package.data:load_my_data"       # (DatasetRequest) -> (x, y)
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kaisa_train.data_dirs import DEFAULT_FASHION_MNIST_DIR, DEFAULT_FORTUNES_DIR

if TYPE_CHECKING:
    import torch
    from torch import nn

# Torch-free: the JobSpec names models and datasets through this module, and the service and
# ``kaisa-ray validate`` check a spec without importing torch. A built-in model is named by
# ``"module:class"`` and imported when it is built (``model_factory``); its constructor's
# parameters are read from its source until then (``kaisa_train.spec.model_params``).
ModelFactory = Callable[..., "nn.Module"]


@dataclass(frozen=True, kw_only=True)
class DatasetRequest:
    """What a dataset loader is asked for."""

    split: str
    data_dir: Path | None
    limit: int | None
    seed: int


DatasetLoader = Callable[[DatasetRequest], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True, kw_only=True)
class DatasetEntry:
    loader: DatasetLoader
    needs_files: bool  # read from data_dir (checked before a job starts)
    default_dir: Path | None = None
    install_hint: str = ""


def _idx(request: DatasetRequest) -> tuple[torch.Tensor, torch.Tensor]:
    from kaisa_train.datasets import load_idx_dataset

    return load_idx_dataset(request.data_dir, request.split, limit=request.limit)  # type: ignore[arg-type]


def _text(request: DatasetRequest) -> tuple[torch.Tensor, torch.Tensor]:
    from kaisa_train.corpus import load_text_corpus

    return load_text_corpus(request.data_dir, request.split, limit=request.limit)


def _synthetic(request: DatasetRequest) -> tuple[torch.Tensor, torch.Tensor]:
    from kaisa_train.datasets import synthetic_dataset

    size = request.limit or (2048 if request.split == "train" else 512)
    return synthetic_dataset(size, seed=request.seed + (0 if request.split == "train" else 1))


# A built-in model: ``"module:class"``, imported when built (a factory itself also works: a
# test may register one).
BUILTIN_MODELS: dict[str, str | ModelFactory] = {
    "lenet": "kaisa_train.models:LeNetCNN",
    "mlp": "kaisa_train.models:MLP",
    # K-FAC's state outweighs the job: where the memory budget decides
    "wide-mlp": "kaisa_train.models:WideMLP",
    "resnet20": "kaisa_train.models:ResNet20",
    # ImageNet; with kaisa-ray plan, priced on the meta device
    "resnet50": "kaisa_train.models_large:ResNet50",
    # token ids in: for kaisa-ray plan, or a plugin token dataset
    "bert-large": "kaisa_train.models_large:BertLarge",
    # byte-level language model, e.g. on fortunes
    "char-transformer": "kaisa_train.transformer:CharTransformer",
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
        found = BUILTIN_MODELS[name]
        if isinstance(found, str):
            module, attribute = found.split(":")
            built: ModelFactory = getattr(importlib.import_module(module), attribute)
            return built
        return found
    plugins = _plugins("kaisa_ray.models")
    if name in plugins:
        factory: ModelFactory = plugins[name].load()
        return factory
    raise KeyError(f"unknown model {name!r}; registered models: {', '.join(model_names())}")


def builtin_model_reference(name: str) -> str | None:
    """``"module:class"`` of a built-in model not imported yet, else None (a plugin, or a
    factory registered as an object)."""
    found = BUILTIN_MODELS.get(name)
    return found if isinstance(found, str) else None


def dataset_entry(name: str) -> DatasetEntry:
    if name in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[name]
    plugins = _plugins("kaisa_ray.datasets")
    if name in plugins:
        return DatasetEntry(loader=plugins[name].load(), needs_files=False)
    raise KeyError(f"unknown dataset {name!r}; registered datasets: {', '.join(dataset_names())}")
