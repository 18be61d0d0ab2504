"""The job's small sections: ``dataset``, ``optimizer`` (and its ``schedule``), ``scaling``,
``stop`` (and its ``target``) and ``checkpoint``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    field_validator,
    model_validator,
)

from kaisa_ray.enums import (
    EvalMetric,
    OptimizerName,
    Parallel,
    ShardUnits,
)
from kaisa_train.data_roots import check_root, check_uri
from kaisa_train.registry import dataset_entry, dataset_names
from kaisa_train.spec.bounds import (
    LIMITS,
    MAX_GPUS_PER_WORKER,
    MAX_STEPS,
    MAX_WORKERS,
    Steps,
    StrictModel,
)
from kaisa_train.stream_sources import (
    BadRecords,
    ImageMode,
    StreamSource,
    is_uri,
    local_path,
)

Side = Annotated[int, Field(gt=0, le=65536)]  # an image's height or width, in pixels
Spread = Annotated[float, Field(gt=0)]  # a channel's standard deviation


class ImageSpec(StrictModel):
    """How a streamed dataset's images become the model's input: converted to ``mode``
    (``L``: one channel, ``RGB``: three), resized to ``size`` ([height, width]; unset: as
    stored, every image the same size), scaled to [0, 1] and normalised by ``mean`` and
    ``std`` (one value, or one per channel)."""

    mode: ImageMode = ImageMode.GRAY
    size: (
        tuple[Annotated[int, Field(gt=0, le=65536)], Annotated[int, Field(gt=0, le=65536)]] | None
    ) = None
    mean: Annotated[tuple[float, ...], Field(min_length=1, max_length=3)] = (0.5,)
    std: Annotated[tuple[Annotated[float, Field(gt=0)], ...], Field(min_length=1, max_length=3)] = (
        0.5,
    )

    @model_validator(mode="after")
    def _channels(self) -> ImageSpec:
        channels = 1 if self.mode is ImageMode.GRAY else 3
        for name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, channels):
                raise ValueError(
                    f"image.{name} has {len(values)} values for mode {self.mode.value} "
                    f"({channels} channel(s)): give one value, or one per channel"
                )
        return self


ColumnName = Annotated[str, Field(min_length=1, max_length=256)]


class ColumnsSpec(StrictModel):
    """A Parquet dataset's columns: ``input`` (encoded images, or numbers) and ``label``
    (integer class indices from 0); or ``tokens`` alone, a language model's rows of token ids
    (every row as long), cut into windows of ``dataset.context + 1`` tokens."""

    input: ColumnName = "image"
    label: ColumnName = "label"
    tokens: ColumnName | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> ColumnsSpec:
        if self.tokens is not None and (self.input != "image" or self.label != "label"):
            raise ValueError(
                "columns.tokens is a language model's input and target at once: give it alone, "
                "without columns.input and columns.label"
            )
        return self


STREAM_ONLY = (
    "train",
    "validation",
    "validation_every",
    "image",
    "columns",
    "shuffle_buffer",
    "classes",
    "context",
    "bad_records",
)
SEQUENCE_CONTEXT = 64  # a text window's default length, as the built-in corpus cuts it


class DatasetSpec(StrictModel):
    """The data. A built-in or plugin dataset (``fashion-mnist``, ``fortunes``, ...) is read
    whole into each worker from ``data_dir``. ``image-folder``, ``parquet`` and ``text``
    stream a user's own files through Ray Data (docs/data.md): ``train`` and ``validation``
    name the two splits (a folder, a file, or a URI such as ``s3://bucket/train`` that the
    cluster reads), or ``validation_every: k`` holds out every k-th file (text: every k-th run
    of windows) of ``train`` instead; ``image`` and ``columns`` say how rows become the
    model's input, ``context`` how long a language model's windows are, ``shuffle_buffer``
    how many rows each worker shuffles within, ``bad_records`` whether a record that cannot be
    read fails the job (naming its file) or is skipped and counted."""

    name: Annotated[str, Field(max_length=64)]
    data_dir: Path | None = None
    batch_size: Annotated[int, Field(gt=0, le=65536)] = 128
    limit: Annotated[int, Field(gt=0, le=10**9)] | None = None
    train: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    validation: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    image: ImageSpec = ImageSpec()
    columns: ColumnsSpec = ColumnsSpec()
    shuffle_buffer: Annotated[int, Field(ge=0, le=10**7)] = 4096
    classes: Annotated[int, Field(gt=0, le=10**7)] | None = None
    validation_every: Annotated[int, Field(ge=2, le=10**6)] | None = None
    context: Annotated[int, Field(gt=0, le=10**6)] | None = None
    bad_records: BadRecords = BadRecords.FAIL

    @field_validator("data_dir")
    @classmethod
    def _short_path(cls, path: Path | None) -> Path | None:
        if path is not None and len(str(path)) > 4096:
            raise ValueError(f"a path of {len(str(path))} characters: {LIMITS['dataset.data_dir']}")
        return path

    @property
    def streamed(self) -> bool:
        """Read by Ray Data from the user's files (``image-folder``, ``parquet``, ``text``)."""
        return self.name in {source.value for source in StreamSource}

    @property
    def sequences(self) -> bool:
        """A language model's windows (``text``, or Parquet's ``columns.tokens``)."""
        return self.name == StreamSource.TEXT or (
            self.name == StreamSource.PARQUET and self.columns.tokens is not None
        )

    @property
    def window(self) -> int:
        """A sequence's length in tokens (bytes for text): ``context``, or its default."""
        return self.context or SEQUENCE_CONTEXT

    @model_validator(mode="after")
    def _available(self) -> DatasetSpec:
        if self.streamed:
            return self._stream_paths()
        defaults = DatasetSpec.model_fields
        given = [f for f in STREAM_ONLY if getattr(self, f) != defaults[f].get_default()]
        if given:
            raise ValueError(
                f"dataset.{given[0]} is for the streamed datasets "
                f"({', '.join(s.value for s in StreamSource)}), not {self.name!r}: remove it, "
                "or stream your files with one of those"
            )
        try:
            entry = dataset_entry(self.name)
        except KeyError:
            raise ValueError(
                f"unknown dataset {self.name!r}; choose one of "
                f"{', '.join([*dataset_names(), *(s.value for s in StreamSource)])}, "
                "or register your own under the 'kaisa_ray.datasets' entry point"
            ) from None
        directory = self.data_dir or entry.default_dir
        if directory is not None and (self.data_dir is not None or entry.needs_files):
            # A service's data roots, before anything looks at the folder: a refusal must not
            # tell whether it exists (kaisa_train.data_roots).
            check_root(directory)
        if entry.needs_files:
            if directory is None:
                raise ValueError(f"dataset {self.name!r} needs data_dir: {entry.install_hint}")
            if not directory.is_dir():
                raise ValueError(
                    f"data directory {directory} of dataset {self.name!r} does not exist: "
                    f"{entry.install_hint}"
                )
        return self

    def _stream_fields(self) -> None:
        """Each source's own fields: an image's for images, a window's for sequences."""
        wrong = []
        if self.sequences:
            wrong = ["image"] if self.image != ImageSpec() else []
        elif self.context is not None:
            wrong = ["context"]
        if self.name == StreamSource.TEXT and self.columns != ColumnsSpec():
            wrong.append("columns")
        if wrong:
            kind = "a language model's windows" if self.sequences else "images"
            raise ValueError(
                f"dataset.{wrong[0]} does not apply to {self.name!r} read as {kind}: remove it"
                + (
                    " (dataset.context is the length of a text or token window)"
                    if wrong[0] == "context"
                    else ""
                )
            )

    def _stream_paths(self) -> DatasetSpec:
        if self.data_dir is not None:
            raise ValueError(
                f"dataset {self.name!r} streams from dataset.train and dataset.validation, "
                "not data_dir: name the two splits' folders (or files, or URIs) there"
            )
        self._stream_fields()
        splits = ["train"]
        if self.validation_every is None:
            splits.append("validation")
        elif self.validation is not None:
            raise ValueError(
                f"dataset.validation ({self.validation}) and dataset.validation_every "
                f"({self.validation_every}) both name a validation split: keep one"
            )
        for split in splits:
            path = getattr(self, split)
            if path is None:
                raise ValueError(
                    f"dataset {self.name!r} needs dataset.{split}: the {split} split's folder, "
                    f"file or URI (e.g. s3://bucket/fashion-mnist/{split})"
                    + (
                        ", or dataset.validation_every: k to hold out a k-th of train for it"
                        if split == "validation"
                        else ""
                    )
                )
            if is_uri(path):
                try:
                    check_uri(path)  # under a service: only under its URI roots
                except ValueError as error:
                    raise ValueError(f"dataset.{split}: {error}") from None
                continue  # read by the cluster; nothing here can check it
            local = Path(local_path(path))
            check_root(local)  # before anything looks at it (kaisa_train.data_roots)
            if not local.exists():
                raise ValueError(
                    f"dataset.{split}: {path} does not exist. Point it at the {split} split's "
                    "folder or file (an absolute path where the workers read it)"
                )
        return self


class ScheduleSpec(StrictModel):
    kind: Literal["constant", "cosine", "step"] = "constant"
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 0
    step_every: Steps | None = None
    gamma: Annotated[float, Field(gt=0, le=1)] = 0.1


PEER_OPTIMIZERS = tuple(name for name in OptimizerName if name.peer)


"""Optimizers that precondition the gradient themselves, from heavyball (the ``peers``
extra), for comparing K-FAC with what a user would try instead: SOAP, Muon (with AdamW for
the parameters of fewer than 2 dimensions) and PSGD Kron, at heavyball's defaults but
``lr`` and ``weight_decay``. They run with ``kfac: off``."""


def _trained_here(name: OptimizerName) -> OptimizerName:
    if not name.trainable:
        trainable = ", ".join(n for n in OptimizerName if n.trainable)
        raise ValueError(
            f"optimizer {name} is priced by kaisa-ray plan but no job here trains with it: "
            f"name one of {trainable} (adamw is the closest)"
        )
    return name


class OptimizerSpec(StrictModel):
    name: Annotated[
        OptimizerName,
        AfterValidator(_trained_here),
        Field(
            description=(
                "``sgd``, ``adam`` or ``adamw``, from torch, preconditioned by K-FAC; "
                "``soap``, ``muon`` or ``psgd-kron``, the peers, with ``kfac: off`` (the "
                "``peers`` extra); ``lamb`` is for ``kaisa-ray plan`` only (no job trains with it)."
            )
        ),
    ] = OptimizerName.SGD
    lr: Annotated[float, Field(gt=0, le=1e4)] = 0.05
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    nesterov: bool = True
    weight_decay: Annotated[float, Field(ge=0, le=10)] = 0.0
    schedule: ScheduleSpec = ScheduleSpec()
    precondition_frequency: Annotated[
        int | None,
        Field(
            gt=0,
            le=10**6,
            description="``soap`` only: refresh its eigenbases every so many steps (heavyball's "
            "``precondition_frequency``; unset, heavyball's default, 2)",
        ),
    ] = None

    @model_validator(mode="after")
    def _soap_only(self) -> OptimizerSpec:
        if self.precondition_frequency is not None and self.name is not OptimizerName.SOAP:
            raise ValueError(
                f"precondition_frequency is SOAP's eigenbasis interval, and optimizer {self.name} "
                "has none: set name: soap, or leave precondition_frequency out (K-FAC's own "
                "interval is kfac.inv_update_steps)"
            )
        return self


class ScalingSpec(StrictModel):
    """The job's workers. ``placement`` spreads them over Ray's nodes: ``pack`` (fill a node
    first, the default), ``spread`` (one per node where possible), ``strict-pack`` (all on
    one node) or ``strict-spread`` (one per node, or wait for enough nodes).
    ``resource_timeout_s``: how long the worker group may wait for its resources, at the start
    and after losing a node, before the job fails saying so; unset, it waits as long as it
    takes (an autoscaling cluster adds nodes), except in a sweep's trials (120 s).
    ``parallel``: ``ddp`` (every worker holds the whole model) or ``fsdp`` (FSDP2 shards the
    parameters, gradients and optimizer state by rows over the workers; docs/fsdp.md).
    ``shard_units`` (``fsdp`` only): what FSDP2 wraps before the whole model, each gathered
    around its own forward and backward: ``layers`` (each Linear and Conv2d), ``blocks`` (each
    child module of the model with parameters) or ``model`` (nothing: one unit)."""

    workers: Annotated[int, Field(gt=0, le=MAX_WORKERS)] = 1
    gpus_per_worker: Annotated[float, Field(ge=0, le=MAX_GPUS_PER_WORKER)] = 0
    cpus_per_worker: Annotated[float, Field(gt=0, le=1024)] = 1
    placement: Literal["pack", "spread", "strict-pack", "strict-spread"] = "pack"
    resource_timeout_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None
    parallel: Parallel = Parallel.DDP
    shard_units: ShardUnits = ShardUnits.LAYERS

    @model_validator(mode="after")
    def _units_shard(self) -> ScalingSpec:
        if self.shard_units is not ShardUnits.LAYERS and self.parallel is not Parallel.FSDP:
            raise ValueError(
                f"shard_units: {self.shard_units} says how FSDP2 shards the model, but parallel "
                "is ddp: set parallel: fsdp, or leave shard_units out"
            )
        return self

    @property
    def placement_strategy(self) -> str:
        """Ray's name for ``placement`` (``STRICT_SPREAD``...)."""
        return self.placement.upper().replace("-", "_")


class TargetSpec(StrictModel):
    metric: EvalMetric = EvalMetric.TEST_ACCURACY
    value: Annotated[float, Field(ge=0, le=1e6)]

    @model_validator(mode="after")
    def _in_range(self) -> TargetSpec:
        if self.metric is EvalMetric.TEST_ACCURACY and self.value > 1:
            raise ValueError(
                f"a test_accuracy target of {self.value:g} is never met: accuracy is between 0 "
                "and 1 (write 0.88 for 88%)"
            )
        return self


class StopSpec(StrictModel):
    max_steps: Steps | None = None
    max_epochs: Annotated[int, Field(gt=0, le=10**6)] | None = None
    target: TargetSpec | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> StopSpec:
        if (self.max_steps is None) == (self.max_epochs is None):
            raise ValueError("give exactly one of max_steps and max_epochs")
        return self


class CheckpointSpec(StrictModel):
    every_steps: Steps = 200
    keep: Annotated[int, Field(gt=0, le=100)] = 2
