"""The K-FAC state of one registered layer: running factors, batch buffers, decomposition.

Shapes as in ``layers.py``. The running averages start from the identity (the reference's
convention, and what keeps an early ``eigh`` well-conditioned):

    A ← decay·A + (1 − decay)·A_batch,    G ← decay·G + (1 − decay)·G_batch

where ``A_batch`` is the mean of the factors of the micro-batches seen since the last factor
update, so ``accumulation_steps`` micro-batches give the factors of one combined batch.
"""

from __future__ import annotations

from typing import Any

import torch

from kaisa_ray.decomposition import Decomposition, EigenDecomposition, InverseDecomposition
from kaisa_ray.enums import ComputeMethod
from kaisa_ray.layers import LayerHelper


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class BatchFactor:
    """A running sum of one factor over micro-batches, in a buffer reused across steps."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, factor: torch.Tensor) -> None:
        if self.total is None:
            self.total = factor.clone()
        elif self.count == 0:
            self.total.copy_(factor)
        else:
            self.total.add_(factor)
        self.count += 1

    def mean(self) -> torch.Tensor | None:
        """The mean over micro-batches (in place in the buffer), or None if nothing was added."""
        if self.total is None or self.count == 0:
            return None
        if self.count > 1:
            self.total.div_(self.count)
            self.count = 1
        return self.total

    def reset(self) -> None:
        self.count = 0

    def nbytes(self) -> int:
        return _nbytes(self.total)


class KFACLayer:
    """Everything K-FAC keeps for one module."""

    def __init__(
        self,
        name: str,
        helper: LayerHelper,
        *,
        compute_method: ComputeMethod,
        outer_product: bool,
        factor_dtype: torch.dtype,
        inv_dtype: torch.dtype,
    ) -> None:
        self.name = name
        self.helper = helper
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.a_factor: torch.Tensor | None = None
        self.g_factor: torch.Tensor | None = None
        self.a_batch = BatchFactor()
        self.g_batch = BatchFactor()
        # Only used with update_factors_in_hook=False: raw tensors, factored in step().
        self.saved_inputs: list[torch.Tensor] = []
        self.saved_grad_outputs: list[torch.Tensor] = []
        self.decomposition: Decomposition
        if compute_method is ComputeMethod.EIGEN:
            self.decomposition = EigenDecomposition(
                name=name, inv_dtype=inv_dtype, outer_product=outer_product
            )
        else:
            self.decomposition = InverseDecomposition(name=name, inv_dtype=inv_dtype)

    # -- factors ---------------------------------------------------------------------------

    def add_input(self, inputs: torch.Tensor) -> None:
        self.a_batch.add(self.helper.a_factor(inputs.detach().to(self.factor_dtype)))

    def add_grad_output(self, grad_output: torch.Tensor, scale: float) -> None:
        g = grad_output.detach().to(self.factor_dtype)
        if scale != 1.0:
            g = g / scale
        self.g_batch.add(self.helper.g_factor(g))

    def factor_saved(self, grad_scale: float) -> None:
        """Turn the tensors kept by the hooks into batch factors (update_factors_in_hook off)."""
        for inputs in self.saved_inputs:
            self.add_input(inputs)
        for grad_output in self.saved_grad_outputs:
            self.add_grad_output(grad_output, grad_scale)
        self.saved_inputs.clear()
        self.saved_grad_outputs.clear()

    def batch_factors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean batch factors since the last update, or None unless both A and G were seen."""
        a, g = self.a_batch.mean(), self.g_batch.mean()
        if a is None or g is None:
            return None
        return a, g

    def _identity(self, dim: int, device: torch.device) -> torch.Tensor:
        eye = torch.eye(dim, dtype=self.factor_dtype, device=device)
        return eye.expand(self.helper.groups, dim, dim).clone()

    def fold(self, a_new: torch.Tensor, g_new: torch.Tensor, decay: float) -> None:
        """Update the running averages (identity start) with this step's batch factors."""
        if self.a_factor is None:
            self.a_factor = self._identity(a_new.shape[-1], a_new.device)
        if self.g_factor is None:
            self.g_factor = self._identity(g_new.shape[-1], g_new.device)
        self.a_factor.mul_(decay).add_(a_new, alpha=1.0 - decay)
        self.g_factor.mul_(decay).add_(g_new, alpha=1.0 - decay)

    def reset_batch(self) -> None:
        self.a_batch.reset()
        self.g_batch.reset()
        self.saved_inputs.clear()
        self.saved_grad_outputs.clear()

    # -- second-order information ----------------------------------------------------------

    def factors_or_identity(self) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.helper.weight().device
        if self.a_factor is None:
            self.a_factor = self._identity(self.helper.a_dim, device)
        if self.g_factor is None:
            self.g_factor = self._identity(self.helper.g_dim, device)
        return self.a_factor, self.g_factor

    def update_decomposition(self, damping: float) -> None:
        a, g = self.factors_or_identity()
        self.decomposition.compute_a(a, damping)
        self.decomposition.compute_g(g, damping)
        self.decomposition.finish(damping)

    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor:
        """The preconditioned gradient of this layer (decomposing first if never done)."""
        if not self.decomposition.ready:
            self.update_decomposition(damping)
        return self.decomposition.precondition(grad_out_by_in, damping)

    def part_shape(self, part: str) -> tuple[int, ...]:
        """Shape of a named tensor of this layer (decomposition parts and ``grad``)."""
        k, a, g = self.helper.groups, self.helper.a_dim, self.helper.g_dim
        shapes = {
            "qa": (k, a, a),
            "a_inv": (k, a, a),
            "da": (k, a),
            "qg": (k, g, g),
            "g_inv": (k, g, g),
            "dg": (k, g),
            "dgda": (k, g, a),
            "grad": (k, g, a),
        }
        return shapes[part]

    # -- accounting and checkpoints --------------------------------------------------------

    def memory_usage(self) -> dict[str, int]:
        saved = sum(_nbytes(t) for t in self.saved_inputs + self.saved_grad_outputs)
        return {
            "factors": _nbytes(self.a_factor) + _nbytes(self.g_factor),
            "decompositions": self.decomposition.nbytes(),
            "buffers": self.a_batch.nbytes() + self.g_batch.nbytes() + saved,
        }

    def state_dict(self) -> dict[str, Any]:
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().clone()

        return {
            "a_factor": copy(self.a_factor),
            "g_factor": copy(self.g_factor),
            "decomposition": {
                k: v.detach().clone() for k, v in self.decomposition.tensors().items()
            },
        }
