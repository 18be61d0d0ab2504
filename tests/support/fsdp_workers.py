"""Workers for the FSDP2 tests (``run_distributed`` spawns them: module-level functions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.errors import ConfigurationError


def sharded_refused(rank: int, world_size: int, *, shard_first: bool) -> str:
    """What the preconditioner says about a ``fully_shard`` model: built on one that is
    already sharded (``shard_first``), or on one sharded after it was built."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))

    def shard() -> None:
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)

    try:
        if shard_first:
            shard()
        preconditioner = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
        if not shard_first:
            shard()
        x, y = torch.randn(4, 5) + rank, torch.randint(0, 3, (4,))
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
    except ConfigurationError as err:
        return str(err)
    return "no error"
