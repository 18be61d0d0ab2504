"""Workers for the FSDP2 tests (``run_distributed`` spawns them: module-level functions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.errors import ConfigurationError


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _train(model: nn.Module, preconditioner: KFACPreconditioner, rank: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 5, generator=generator)
        y = torch.randint(0, 3, (4,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
        optimizer.step()


def _shard(model: nn.Sequential) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)


def sharded_after_build(rank: int, world_size: int) -> tuple[str, float]:
    """A model sharded after its preconditioner was built, against one sharded before: the
    plan's parallelism, and the largest difference of their parameters after 4 steps."""
    before, after = _model(), _model()
    _shard(before)
    first = KFACPreconditioner(before, factor_update_steps=1, inv_update_steps=2)
    second = KFACPreconditioner(after, factor_update_steps=1, inv_update_steps=2)
    _shard(after)
    _train(before, first, rank)
    _train(after, second, rank)
    difference = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()  # type: ignore[operator]
        for a, b in zip(before.parameters(), after.parameters(), strict=True)
    )
    return str(second.plan.options.parallel), difference


def partly_sharded(rank: int, world_size: int) -> str:
    """What the preconditioner says of a model whose first K-FAC layer is sharded and whose
    second is not."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model[0])
    try:
        KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    except ConfigurationError as err:
        return str(err)
    return "no error"
