"""Datasets streamed to the workers by Ray Data: a user's own image folder, Parquet files or
text files, read and preprocessed on the cluster's CPUs, each worker holding a bounded window.

The driver opens the sources (``open_stream``; each source in a module of its own:
``stream_images``, ``stream_parquet``, ``stream_text``, on what ``stream_files`` gives them
all): it lists the files, checks what it can before anything starts (an empty folder, a
missing column, validation classes training lacks), counts the rows, and builds one Ray Data
pipeline per split, its files read by Ray Data tasks
(``stream_read.py``: the training split's epochs one after the other in one execution, each
epoch's files in a new order drawn from the job's seed) and preprocessed by ``map_batches``
tasks into ``{"x": float32, "y": int64}`` batches (a language model's:
``{"window": (n, context + 1)}``, input and target in one).
Ray Train splits both pipelines over the workers (``streaming_split``, every worker as many
rows); a worker reads its share through ``StreamShard`` (``stream_shard.py``, so that Ray
Data's tasks and actors, which import this module for the pipelines' functions, need no
torch), which keeps the in-memory
``Shard``'s contract: step ``s`` is batch ``(s-1) % steps_per_epoch`` of epoch
``(s-1) // steps_per_epoch``, and the rows come through a shuffle window of
``dataset.shuffle_buffer`` rows (which spans an epoch's end: the first batches of an epoch
hold a few of the last one's rows).

What streaming does not give: which rows fill a batch depends on the order in which the
pipeline's blocks reach the workers, so two runs of a streamed job are not bit for bit the
same, and a resumed run continues at its step and epoch with the rest of that epoch drawn
afresh from the epoch's data (the batches it had read before the stop are not skipped over,
and some rows are seen twice that epoch, others not at all). Up to ``workers - 1`` rows of each
execution are left out so that every worker reads as many (Ray Train's equal split), and the
rest under a batch at its end.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from kaisa_train.ray_logs import quiet_here
from kaisa_train.stream_files import (
    ROWS_PER_BLOCK,
    TRAIN,
    VALIDATION,
    SkipLedger,
    StreamCounts,
)
from kaisa_train.stream_images import IMAGE_EXTENSIONS as IMAGE_EXTENSIONS
from kaisa_train.stream_images import image_source
from kaisa_train.stream_parquet import parquet_source
from kaisa_train.stream_read import Horizon
from kaisa_train.stream_sources import BadRecords, ImageMode, StreamSource
from kaisa_train.stream_text import text_source

if TYPE_CHECKING:
    from ray.data import Dataset

    from kaisa_train.spec import DatasetSpec

__all__ = [
    "IMAGE_EXTENSIONS",
    "ROWS_PER_BLOCK",
    "TRAIN",
    "VALIDATION",
    "SkipLedger",
    "StreamCounts",
    "block_bytes",
    "open_stream",
    "spare_cpus_message",
]


def open_stream(
    dataset: DatasetSpec, horizon: Horizon | None = None
) -> tuple[dict[str, Dataset], StreamCounts]:
    """The job's two pipelines (``train``, ``validation``) and their counts, checked; the
    validation split read once into Ray's object store (bad data in it fails here). The
    training pipeline reads the epochs ``horizon`` needs (default: one, seed 0) in one
    execution (``stream_read``).

    Raises:
        ConfigurationError: a folder that is missing or empty, a class folder without images,
            validation classes training lacks, a missing Parquet column, a ``validation_every``
            that leaves a split empty, text too short for one window (each names the path and
            the fix).
    """
    from ray.data import DataContext

    quiet_here()  # Ray Data's INFO lines in ray-data.log, not on the job's terminal
    DataContext.get_current().enable_progress_bars = False
    source = StreamSource(dataset.name)
    ledger = None
    if dataset.bad_records is BadRecords.SKIP and source is not StreamSource.TEXT:
        import ray

        ledger = ray.remote(num_cpus=0)(SkipLedger).remote()  # the driver's, as long as it runs
    horizon = horizon or Horizon()
    if source is StreamSource.IMAGE_FOLDER:
        pipelines, counts = image_source(dataset, ledger, horizon)
    elif source is StreamSource.PARQUET:
        pipelines, counts = parquet_source(dataset, ledger, horizon)
    else:
        pipelines, counts = text_source(dataset, horizon)  # every byte is a text's: nothing to skip
    if dataset.limit is not None:
        pipelines = {name: ds.limit(dataset.limit) for name, ds in pipelines.items()}
        counts = replace(
            counts,
            train_rows=min(counts.train_rows, dataset.limit),
            validation_rows=min(counts.validation_rows, dataset.limit),
        )
    counts = replace(counts, ledger=ledger)
    block = block_bytes(dataset, pipelines[TRAIN].context.target_max_block_size)
    if block is not None:
        pipelines[TRAIN].context.target_max_block_size = block
    # The validation split is read every evaluation: read and decoded once, into Ray's object
    # store (which spills to disk), not again each time (a new execution of the pipeline
    # costs seconds before its first batch). In file order: Ray Data otherwise hands on
    # whichever read task finishes first, so the rows a limit keeps (and the order of the
    # evaluation's batches) would change run to run.
    ordered = pipelines[VALIDATION]
    ordered.context.execution_options.preserve_order = True
    pipelines[VALIDATION] = ordered.materialize()
    return pipelines, counts


MIN_BLOCK_BYTES = 1 << 20


def block_bytes(dataset: DatasetSpec, default: int | None) -> int | None:
    """The largest block the training pipeline's tasks hand on, in bytes: about
    ``ROWS_PER_BLOCK`` rows as the model reads them (at least ``MIN_BLOCK_BYTES``), where a
    row's size is known before reading (windows of tokens; images resized by
    ``dataset.image.size``); None (Ray Data's ``default``) otherwise, or where that is smaller.

    Ray Data's default (128 MiB) makes one block of a whole Parquet file or read task, and a
    worker's first batch of an execution waits until a block is whole: with tasks reading at
    once on the same CPUs, nearly the epoch's whole read (docs/data.md, measured)."""
    if StreamSource(dataset.name) is StreamSource.TEXT or dataset.columns.tokens is not None:
        row = (dataset.window + 1) * 8  # a window of tokens (input and target), <= 8 bytes each
    elif dataset.image.size is not None:
        channels = 1 if dataset.image.mode is ImageMode.GRAY else 3
        row = channels * dataset.image.size[0] * dataset.image.size[1] * 4 + 8  # float32 + label
    else:
        return None
    wanted = max(ROWS_PER_BLOCK * row, MIN_BLOCK_BYTES)
    return wanted if default is None or wanted < default else None


def spare_cpus_message(
    cluster_cpus: float, workers: int, cpus_per_worker: float, trials: int = 1
) -> str | None:
    """Why a streamed job cannot run on a cluster of ``cluster_cpus`` CPUs (its workers, those
    of ``trials`` trials of a sweep at once, would leave Ray Data none to read with), or
    None."""
    taken = trials * workers * cpus_per_worker
    if cluster_cpus - taken >= 1:
        return None
    why = (
        "a streamed dataset is read and preprocessed by Ray Data on CPUs the workers do not "
        f"hold, and the cluster has {cluster_cpus:g} CPUs, all taken by"
    )
    held = f"{workers} workers x {cpus_per_worker:g} CPUs"
    if trials > 1 and cluster_cpus - workers * cpus_per_worker >= 1:  # one trial at a time fits
        fits = max(1, math.floor((cluster_cpus - 1) / (workers * cpus_per_worker)))
        return (
            f"{why} {trials} trials at once (sweep.concurrent) of {held}. Lower "
            f"sweep.concurrent (e.g. to {fits}) or scaling.cpus_per_worker, use fewer workers, "
            "or add CPUs"
        )
    return (
        f"{why} {held}. Lower scaling.cpus_per_worker (e.g. to "
        f"{max((cluster_cpus - 1) / workers, 0.1):.2g}), use fewer workers, or add CPUs"
    )
