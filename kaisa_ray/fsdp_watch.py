"""Whether FSDP2 shards the preconditioner's layers now, checked at every step: a model may be
built sharded or be ``fully_shard``-ed after the preconditioner was made. The type of the first
layer's weight decides; while it stays the same the answer is the one found for it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kaisa_ray.comm import Communicator
from kaisa_ray.enums import Parallel
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.kfac_layer import KFACLayer
from kaisa_ray.plan import Plan, build_plan
from kaisa_ray.sharding import RowExchange, ShardedGradients, gradient_keeper, sharded_layers

Keeper = ShardedGradients | RowExchange


class ShardingWatch:
    """The keeper of the layers' whole gradients when FSDP2 shards them (None when it does
    not), found again whenever the first layer's weight changes type."""

    def __init__(self, layers: Sequence[KFACLayer], rank: int, world_size: int) -> None:
        self.layers = list(layers)
        self.rank, self.world_size = rank, world_size
        # The weight's type when last looked, and what was found for it.
        self.seen: tuple[type, Keeper | None] | None = None

    @property
    def keeper(self) -> Keeper | None:
        return None if self.seen is None else self.seen[1]

    def now(
        self, plan: Plan, comm: Communicator, grad_worker_fraction: float, *, cuda_graphs: bool
    ) -> tuple[Keeper | None, Plan]:
        """The keeper for this step, and the plan (rebuilt for FSDP2 where the model was
        sharded after the plan was made)."""
        weight = self.layers[0].helper.weight()
        if self.seen is not None and type(weight) is self.seen[0]:
            return self.seen[1], plan
        modules = [(layer.name, layer.helper.module) for layer in self.layers]
        if not sharded_layers(modules, self.world_size):
            self.seen = (type(weight), None)
            return None, plan
        if cuda_graphs:
            raise ConfigurationError(
                "cuda_graphs=True is not available for a model sharded by FSDP2 (the step "
                "gathers each layer's gradient first): leave cuda_graphs off."
            )
        if plan.options.parallel is not Parallel.FSDP:  # sharded since it was built
            options = dataclasses.replace(plan.options, parallel=Parallel.FSDP)
            plan = build_plan(plan.layers, self.world_size, grad_worker_fraction, options)
        helpers = {layer.name: layer.helper for layer in self.layers}
        keeper = gradient_keeper(helpers, plan, comm, self.rank, self.world_size)
        self.seen = (type(weight), keeper)
        return keeper, plan
