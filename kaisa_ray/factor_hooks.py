"""The module hooks that build K-FAC's batch factors on factor steps.

On a step that updates a layer's factors, its forward hook takes the layer's input (the ``A``
side) and registers a hook on its output whose gradient gives the ``G`` side; with
``update_factors_in_hook`` (the default) both are folded into the layer's batch factors at
once, and a layer whose batch is complete starts its share of the factor all-reduce while
backpropagation goes on; without it the hooks keep the tensors until ``step()`` asks for the
factors (``factor_saved``). On every other step the forward hook returns at once (under
``torch.compile``, inside the compiled graph).

Linear layers called on the same input tensor (attention's query, key and value) have the same
A: it is computed for the first of them and copied to the others (``_shared_a``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from kaisa_ray.comm import Communicator, unpack_into
from kaisa_ray.compiling import eager_under_compile
from kaisa_ray.enums import FactorScale
from kaisa_ray.kfac_layer import KFACLayer
from kaisa_ray.layers import LinearHelper
from kaisa_ray.options import GradScalerLike
from kaisa_ray.timing import PhaseTimes


class FactorHooks:
    """The forward and output-gradient hooks of the registered layers, and the factor steps'
    bookkeeping they need: which layers update on the current step (``plan``), the divisor of
    the output gradients, the loss scale read once a step."""

    def __init__(
        self,
        layers: Iterable[tuple[nn.Module, KFACLayer]],
        comm: Communicator,
        times: PhaseTimes,
        products: Callable[[], AbstractContextManager[None]],
        *,
        update_in_hook: bool,
        accumulation_steps: int,
        factor_scale: FactorScale,
        world_size: int,
        symmetry_aware: bool,
        grad_scaler: GradScalerLike | None,
    ) -> None:
        registered = list(layers)
        self._layers = [layer for _, layer in registered]
        self._by_module = dict(registered)
        self._by_name = {layer.name: layer for layer in self._layers}
        self._comm = comm
        self._times = times
        self._products = products
        self.update_in_hook = update_in_hook
        self.accumulation_steps = accumulation_steps
        self.factor_scale = factor_scale
        self.world_size = world_size
        self.symmetry_aware = symmetry_aware
        self._grad_scaler = grad_scaler
        self._scale_cache: tuple[int, float] | None = None
        self.now: frozenset[str] = frozenset()  # the layers whose factors this step updates
        self._step = 0
        # The last input whose A a hook computed: (the input, its version, the layer)
        self._last_a: tuple[weakref.ref[torch.Tensor], int, KFACLayer] | None = None
        self._handles = [module.register_forward_hook(self._forward) for module in self._by_module]

    def plan(self, step: int, layers: frozenset[str]) -> None:
        """Step ``step`` updates the factors of ``layers`` (the forward hooks need it before
        ``step()``)."""
        self._step = step
        self.now = layers
        self._last_a = None

    def remove(self) -> None:
        """Detach every hook from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def grad_scale(self) -> float:
        """The GradScaler's current loss scale (1.0 without one), read once a step."""
        if self._grad_scaler is None:
            return 1.0
        if self._scale_cache is not None and self._scale_cache[0] == self._step:
            return self._scale_cache[1]
        scaler = self._grad_scaler
        get: Callable[[], float] = getattr(scaler, "get_scale", scaler)  # type: ignore[arg-type]
        scale = float(get())
        if not scale > 0:
            scale = 1.0  # a disabled GradScaler reports 1.0; anything else is not a scale
        self._scale_cache = (self._step, scale)
        return scale

    def g_divisor(self) -> float:
        """Divisor of output gradients. Reference scaling: the loss scale, and the world size,
        because each rank's loss is a mean over its own shard: dividing by W gives the
        gradients of the mean over the global batch, so factors (and the meaning of damping)
        do not depend on W. Fisher scaling: the loss scale over the accumulation steps (each
        micro-batch's loss is divided by them); the layer then multiplies by the examples the
        loss averages over, which gives per-example gradients at any W."""
        if self.factor_scale is FactorScale.FISHER:
            return self.grad_scale() / self.accumulation_steps
        return self.grad_scale() * self.world_size

    def _forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not (module.training and self.now and torch.is_grad_enabled()):
            return
        if not isinstance(output, torch.Tensor) or not output.requires_grad or not args:
            return
        layer = self._by_module[module]
        if layer.name not in self.now:
            return
        self.take_input(layer, args[0])
        # EKFAC's diagonal needs this forward's input beside its output gradient
        inputs = args[0] if layer.fits_diagonal else None
        output.register_hook(functools.partial(self.on_grad, layer, inputs))  # type: ignore[no-untyped-call]

    # Factor work runs eagerly under torch.compile: a graph break at the hook, on factor steps
    # only (on other steps the hook returns before it, inside the compiled graph).
    @eager_under_compile
    def take_input(self, layer: KFACLayer, inputs: torch.Tensor) -> None:
        with torch.no_grad(), self._times.phase("factors"), self._products():
            if not self.update_in_hook:
                layer.save_input(inputs)
                return
            source = self._shared_a(layer, inputs)
            if source is not None and source.a_batch.total is not None:
                layer.a_batch.add(source.a_batch.total)
            else:
                layer.add_input(inputs)
            self._last_a = (weakref.ref(inputs), inputs._version, layer)

    def _shared_a(self, layer: KFACLayer, inputs: torch.Tensor) -> KFACLayer | None:
        """The layer whose A of this same input (the same tensor, unchanged since) the last
        hook computed, where ``layer``'s A of it would be the same (Linear layers alike in
        width, bias, token handling, factor dtype and samples), both on their first
        micro-batch; else None."""
        if self._last_a is None:
            return None
        held, version, source = self._last_a
        if held() is not inputs or inputs._version != version:
            return None
        mine, theirs = layer.helper, source.helper
        if type(mine) is not LinearHelper or type(theirs) is not LinearHelper:
            return None
        alike = (
            mine.a_dim == theirs.a_dim
            and mine.has_bias == theirs.has_bias
            and mine.approx is theirs.approx
            and layer.factor_dtype == source.factor_dtype
            and layer.factor_samples == source.factor_samples
            and layer.fisher == source.fisher
        )
        first = layer.a_batch.count == 0 and source.a_batch.count == 1
        return source if alike and first else None

    @eager_under_compile
    def on_grad(self, layer: KFACLayer, inputs: torch.Tensor | None, grad: torch.Tensor) -> None:
        with torch.no_grad():
            if not self.update_in_hook:
                layer.save_grad_output(grad, inputs)
                return
            with self._times.phase("factors"), self._products():
                layer.add_grad_output(grad, self.g_divisor())
                if inputs is not None:
                    layer.add_fitted_diagonal(inputs, grad, self.g_divisor())
            if layer.batch_complete(self.accumulation_steps):
                # Final for this step: start its share of the factor all-reduce now, so
                # communication overlaps the rest of backpropagation.
                with self._times.phase("communication"):
                    self._comm.factor_ready(layer.name, self.batch_part)

    def factor_saved(self) -> None:
        """Without ``update_in_hook``: the batch factors from the tensors the hooks kept."""
        with self._times.phase("factors"), self._products():
            for layer in self._layers:
                layer.factor_saved(self.g_divisor())

    def reduce(self) -> None:
        """The factor all-reduce of this step's batch factors (what the hooks have not started
        yet, then the wait), each reduced factor unpacked into its layer."""
        with self._times.phase("communication"):
            self._comm.reduce_factors(self.batch_part, self._store_reduced)

    def batch_part(self, name: str, part: str) -> torch.Tensor | None:
        return self._by_name[name].batch_part(part)

    def _store_reduced(self, name: str, part: str, flat: torch.Tensor) -> None:
        buffer = self._by_name[name].reduced_buffer(part, flat.dtype, flat.device)
        unpack_into(buffer, flat, self.symmetry_aware and part != "s")
