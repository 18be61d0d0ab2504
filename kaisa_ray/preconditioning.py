"""One rank's preconditioning of a step: the layers it preconditions, batched by shape where a
whole shape group is ready (the groups' flat-buffer layouts kept for each set of groups a step
preconditions, and replayed from a CUDA graph where asked), the rest layer by layer; the
results sent to the layers' receivers; then the KL clip and the gradients set in place.

``KFACPreconditioner.step`` calls ``Preconditioning.run`` once a step, after the factors and
the decompositions are up to date.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from kaisa_ray import batching
from kaisa_ray.apply import Block, GradientSetter, Outputs
from kaisa_ray.comm import Communicator
from kaisa_ray.graphs import GraphedPreconditioning
from kaisa_ray.kfac_layer import KFACLayer
from kaisa_ray.sharding import RowExchange
from kaisa_ray.timing import PhaseTimes

__all__ = ["Preconditioning"]


class Preconditioning:
    """This rank's part of every step's preconditioning.

    Args:
        layers: every registered layer, in the model's order.
        comm: the communicator whose gradient buckets send the results to receivers.
        mine: whether this rank preconditions a layer (it is one of its gradient workers).
        times: where the phases' host seconds go.
        setter: clips and sets the gradients (and counts the steps it skipped).
        products: the context the preconditioning products run in (their matmul precision).
        cuda_graphs: replay a step made of shape groups alone from a CUDA graph.
    """

    def __init__(
        self,
        layers: Sequence[KFACLayer],
        comm: Communicator,
        mine: Callable[[KFACLayer], bool],
        times: PhaseTimes,
        setter: GradientSetter,
        products: Callable[[], contextlib.AbstractContextManager[None]],
        *,
        cuda_graphs: bool = False,
    ) -> None:
        self.layers = list(layers)
        self._by_name = {layer.name: layer for layer in self.layers}
        self._comm = comm
        self._mine = mine
        self._times = times
        self._setter = setter
        self._products = products
        self.cuda_graphs = cuda_graphs
        # The layers this rank preconditions, grouped by shape for batched products.
        self.groups = batching.shape_groups([lay for lay in self.layers if mine(lay)])
        # where the groups' gradients lie in flat buffers, by the groups a step preconditions
        self.layouts: dict[tuple[batching.ShapeGroup, ...], batching.GradientLayout] = {}
        self.graphs: dict[batching.GradientLayout, GraphedPreconditioning] = {}

    @property
    def graph_bytes(self) -> int:
        """Bytes the CUDA graphs keep (their copies of the gradients)."""
        return sum(graph.nbytes for graph in self.graphs.values())

    def run(
        self,
        active: list[KFACLayer],
        damping: float,
        kl_clip: float | None,
        lr: float,
        rows: RowExchange | None = None,
    ) -> Outputs:
        """Precondition ``active`` (by shape group where a whole group is active and
        decomposed, else layer by layer), send to receivers, clip and set (under FSDP2 with
        fewer gradient workers than ranks: each rank's ``rows``); returns the preconditioned
        gradients before clipping."""
        preconditioned = Outputs()
        blocks: list[Block] = []
        gathered: batching.Gathered | None = None
        names = {layer.name for layer in active}
        with self._times.phase("precondition"), self._products():
            groups = tuple(g for g in self.groups if g.names <= names and g.ready())
            if groups:
                layout = self.layouts.get(groups)
                if layout is None:
                    layout = self.layouts[groups] = batching.GradientLayout(groups)
                graphed = None
                if self.cuda_graphs and self._graphable(active, groups):
                    graphed = self.graphs.get(layout)
                    if graphed is None:
                        graphed = self.graphs[layout] = GraphedPreconditioning(layout, self._setter)
                    # the groups are the whole step: clipped and set inside the graph
                    gathered = graphed.run(damping, kl_clip, lr, self.layers)
                else:
                    gathered = layout.gather()
                    batching.precondition(groups, gathered.raws, damping, gathered.outs)
                for group, out in zip(groups, gathered.outs, strict=True):
                    for index, layer in enumerate(group.layers):
                        preconditioned.put(layer.name, out, index)
                if graphed is not None:
                    return preconditioned
            for layer in active:  # the rest of this rank's layers, one by one
                if layer.name in preconditioned or not self._mine(layer):
                    continue
                raw = layer.helper.grad()
                out = layer.precondition(raw, damping)
                blocks.append(Block((layer,), raw.unsqueeze(0), out.unsqueeze(0)))
                preconditioned.put(layer.name, out)
        if rows is not None:
            self._set_rows(rows, preconditioned, kl_clip, lr)
            return preconditioned

        def get(name: str, part: str) -> torch.Tensor:
            if name in preconditioned:
                return preconditioned[name]
            layer = self._by_name[name]  # no gradient here this step: send zeros
            return torch.zeros(
                layer.part_shape("grad"),
                dtype=layer.helper.weight().dtype,
                device=layer.helper.weight().device,
            )

        received: dict[str, torch.Tensor] = {}

        def put(name: str, part: str, flat: torch.Tensor) -> None:
            received[name] = flat.view(self._by_name[name].part_shape("grad"))

        with self._times.phase("communication"):
            self._comm.broadcast(self._comm.gradient_buckets, get, put)
        with self._times.phase("precondition"):
            for layer in active:
                if layer.name in received:
                    out = received[layer.name]
                    blocks.append(Block((layer,), layer.helper.grad().unsqueeze(0), out[None]))
                    preconditioned.put(layer.name, out)
            self._setter.set(
                blocks,
                gathered,
                self.layers,
                kl_clip,
                lr,
                group_dots=not self._comm.gradient_buckets,  # every rank groups alike
            )
        return preconditioned

    def _set_rows(
        self, rows: RowExchange, preconditioned: Outputs, kl_clip: float | None, lr: float
    ) -> None:
        """FSDP2 with fewer gradient workers than ranks: the workers' preconditioned
        gradients scattered by rows, then every rank clips (the sums over all ranks' rows)
        and sets its own rows of every layer."""
        with self._times.phase("communication"):
            mine = rows.scatter(preconditioned)
        with self._times.phase("precondition"):
            raws = rows.lend_rows()
            blocks = [
                Block((layer,), raws[layer.name][None, None], mine[layer.name][None, None])
                for layer in self.layers
            ]
            self._setter.set(blocks, None, self.layers, kl_clip, lr, over_ranks=rows.sum_over_ranks)

    def _graphable(self, active: list[KFACLayer], groups: tuple[batching.ShapeGroup, ...]) -> bool:
        """Whether the shape groups are this step's whole preconditioning: no layer alone,
        none received from another rank (one rank, or every layer preconditioned on every
        rank as COMM-OPT does)."""
        grouped = set().union(*(group.names for group in groups))
        alone = any(lay.name not in grouped and self._mine(lay) for lay in active)
        return not alone and not self._comm.gradient_buckets
