"""A worker's data: its shard of the training set in sampler order, its slice of the test
set, and the one evaluator (a model's loss and accuracy over the test split).

Step ``s`` (1-based) always reads the same mini-batch: epoch ``(s-1) // steps_per_epoch`` of a
``DistributedSampler`` seeded with the job's seed, batch ``(s-1) % steps_per_epoch`` of it.
That is the sampler position a checkpoint records, so a resumed run reads exactly what an
uninterrupted one would.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from kaisa_ray.amp import MixedPrecision
from kaisa_ray.errors import ConfigurationError
from kaisa_train.registry import DatasetRequest, dataset_entry
from kaisa_train.spec import DatasetSpec
from kaisa_train.stream_shard import StreamShard
from kaisa_train.streaming import StreamCounts

if TYPE_CHECKING:
    from ray.data import DataIterator

__all__ = [
    "AnyShard",
    "Shard",
    "StreamData",
    "distributed",
    "evaluate",
    "evaluate_shard",
    "load_shard",
]


def distributed() -> bool:
    """Whether this process is one rank of a ``torch.distributed`` group."""
    return dist.is_available() and dist.is_initialized()


@dataclass
class Shard:
    """One worker's view of the data: its batches in sampler order, and its test slice."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    sampler: DistributedSampler[Any]
    batch_size: int
    steps_per_epoch: int
    waited_s: float = 0.0  # in ``batch``: seconds spent gathering this worker's batches
    _epoch: int = -1
    _order: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) that step ``step`` (1-based) reads."""
        return divmod(step - 1, self.steps_per_epoch)

    def skipped(self) -> int | None:
        """Records skipped as unreadable: none here (a streamed dataset's may be)."""
        return None

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        epoch, index = self.position(step)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._order = torch.tensor(list(iter(self.sampler)), dtype=torch.long)
            self._epoch = epoch
        rows = self._order[index * self.batch_size : (index + 1) * self.batch_size]
        batch = self.train_x[rows], self.train_y[rows]
        self.waited_s += time.perf_counter() - started
        return batch


AnyShard = Shard | StreamShard
StreamData = tuple["DataIterator", "DataIterator", StreamCounts]
"""A streamed job's worker: its train and validation splits (``ray.train.get_dataset_shard``)
and what the driver counted."""


def load_shard(
    dataset: DatasetSpec, seed: int, rank: int, world: int, stream: StreamData | None = None
) -> AnyShard:
    """Rank ``rank`` of ``world``'s shard of the job's dataset (``stream``: a streamed one's
    splits, from Ray Train)."""
    if dataset.streamed:
        if stream is None:
            raise ConfigurationError(
                f"dataset {dataset.name!r} is streamed by Ray Data to a Ray Train job's "
                "workers: run it with kaisa-ray train (or submit it to the service), not in "
                "one process"
            )
        train, validation, counts = stream
        return StreamShard.open(
            train,
            validation,
            counts,
            batch_size=dataset.batch_size,
            seed=seed,
            rank=rank,
            world=world,
            shuffle_buffer=dataset.shuffle_buffer,
        )
    entry = dataset_entry(dataset.name)
    data_dir = dataset.data_dir or entry.default_dir

    def load(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        request = DatasetRequest(split=split, data_dir=data_dir, limit=dataset.limit, seed=seed)
        return entry.loader(request)

    train_x, train_y = load("train")
    test_x, test_y = load("test")
    sampler: DistributedSampler[Any] = DistributedSampler(
        TensorDataset(train_y), num_replicas=world, rank=rank, shuffle=True, seed=seed
    )
    batch = dataset.batch_size
    steps_per_epoch = len(sampler) // batch
    if steps_per_epoch == 0:
        raise ConfigurationError(
            f"dataset.batch_size={batch} is larger than each worker's share of the training "
            f"set ({len(sampler)} samples over {world} workers); lower batch_size or raise "
            "dataset.limit"
        )
    per_rank = math.ceil(test_x.shape[0] / world)
    lo, hi = rank * per_rank, min((rank + 1) * per_rank, test_x.shape[0])
    return Shard(
        train_x=train_x,
        train_y=train_y,
        test_x=test_x[lo:hi],
        test_y=test_y[lo:hi],
        sampler=sampler,
        batch_size=batch,
        steps_per_epoch=steps_per_epoch,
    )


@torch.no_grad()
def _totals(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    device: torch.device,
    batch_size: int,
    precision: MixedPrecision,
    batches: int | None = None,
) -> torch.Tensor:
    """(summed cross-entropy, correct predictions, predictions) over ``images``, in float64.

    A prediction is a target: one per sample for a classifier, one per position for a
    sequence model (logits ``(batch, classes, positions)``), so the loss is a mean per token.
    ``batches``: forward passes to make (more than ``images`` fill: empty ones), so that every
    rank of a model whose forward is collective (DDP's buffers, FSDP2's gathers) makes as many.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    if batches is None:
        batches = -(-images.shape[0] // batch_size)
    for start in range(0, batches * batch_size, batch_size):
        x = images[start : start + batch_size].to(device)
        y = labels[start : start + batch_size].to(device)
        with precision.autocast():
            logits = model(x).float()
        totals[0] += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        totals[1] += int((logits.argmax(dim=1) == y).sum())
        totals[2] += y.numel()
    model.train(was_training)
    return totals


def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 1000
) -> float:
    """Classification accuracy of a model over a whole data set (0.0 for an empty set).

    The model is put in eval mode and back into the mode it was in.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    totals = _totals(model, images, labels, device, batch_size, MixedPrecision())
    return float(totals[1]) / max(float(totals[2]), 1.0)


def evaluate_shard(
    model: nn.Module,
    shard: AnyShard,
    device: torch.device,
    batch_size: int = 1000,
    precision: MixedPrecision | None = None,
) -> tuple[float, float]:
    """(test loss, test accuracy) over the whole test split, summed over every rank's slice
    (a streamed one's: every worker's share of the validation split, as many rows each)."""
    autocast = precision or MixedPrecision(device_type=device.type)
    batches = None
    if isinstance(shard, StreamShard):
        totals = torch.zeros(3, dtype=torch.float64)
        for x, y in shard.validation_batches(batch_size):
            totals += _totals(model, x, y, device, batch_size, autocast)
    elif distributed():  # the most any rank makes (a rank's slice may be one batch shorter)
        most = torch.tensor([-(-shard.test_x.shape[0] // batch_size)], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        batches = int(most.item())
        totals = _totals(model, shard.test_x, shard.test_y, device, batch_size, autocast, batches)
    else:
        totals = _totals(model, shard.test_x, shard.test_y, device, batch_size, autocast)
    if distributed():
        on_device = totals.to(device)
        dist.all_reduce(on_device)
        totals = on_device.cpu()
    count = max(float(totals[2]), 1.0)
    return float(totals[0]) / count, float(totals[1]) / count
