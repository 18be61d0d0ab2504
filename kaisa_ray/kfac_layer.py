"""The K-FAC state of one registered layer: running factors, batch buffers, decomposition.

Shapes as in ``layers.py``. The running averages are

    A ← decay·A + (1 − decay)·A_batch,    G ← decay·G + (1 − decay)·G_batch

where ``A_batch`` is the mean of the factors of the micro-batches seen since the last factor
update, so ``accumulation_steps`` micro-batches give the factors of one combined batch. With
``RunningAverage.IDENTITY`` (the reference's convention) they start from the identity; with
``DEBIASED`` they start from zero and the factors used are ``A / w`` with
``w ← decay·w + (1 − decay)`` (``w = 1 − decayⁿ`` for a constant decay), Adam's bias
correction: after one update the factor is exactly the first batch's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kaisa_ray.decomposition import (
    Decomposition,
    EigenDecomposition,
    InverseDecomposition,
)
from kaisa_ray.eigenbasis import AdamEigenbasis, EKFACEigenbasis
from kaisa_ray.ekfac import fitted_diagonal
from kaisa_ray.enums import BasisUpdate, ComputeMethod, FactorScale, RunningAverage, Scaling
from kaisa_ray.layers import EmbeddingHelper, LayerHelper
from kaisa_ray.products import gram
from kaisa_ray.solvers import pi_ratio
from kaisa_ray.staleness import relative_change, sketch


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``; indices (an embedding's input) as they are, to be counted."""
    if tensor.dtype == dtype or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


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

    def accumulate(self, rows: torch.Tensor, alpha: float) -> torch.Tensor:
        """Add ``alpha · rows rowsᵀ`` (``rows`` ``(k, d, n)``) with one product straight into
        the buffer (the first micro-batch overwrites it); the running total."""
        k, d, _ = rows.shape
        fresh = (
            self.total is None or self.total.shape != (k, d, d) or self.total.dtype != rows.dtype
        )
        if fresh:
            self.total = rows.new_empty((k, d, d))
        total = self.total
        assert total is not None
        beta = 0.0 if fresh or self.count == 0 else 1.0
        gram(rows, total, alpha=alpha, beta=beta)
        self.count += 1
        return total

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

    def overwrite(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The buffer, for a value written into it that counts as one micro-batch."""
        if self.total is None or tuple(self.total.shape) != shape or self.total.dtype != dtype:
            self.total = torch.zeros(shape, dtype=dtype, device=device)
        self.count = 1
        return self.total

    def nbytes(self) -> int:
        return _nbytes(self.total)


def fold_all(
    batches: list[tuple[KFACLayer, tuple[torch.Tensor, torch.Tensor]]], decay: float
) -> None:
    """``F ← decay·F + (1 − decay)·F_batch`` for every layer's A and G: two multi-tensor
    operations for all of them (``_foreach``), the same arithmetic as one layer at a time."""
    olds: list[torch.Tensor] = []
    news: list[torch.Tensor] = []
    for layer, (a_new, g_new) in batches:
        olds += layer.running(a_new, g_new)
        news += (a_new, g_new)
        layer.average_weight = decay * layer.average_weight + (1.0 - decay)
    if olds:
        torch._foreach_mul_(olds, decay)
        torch._foreach_add_(olds, news, alpha=1.0 - decay)


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
        running_average: RunningAverage = RunningAverage.IDENTITY,
        factor_scale: FactorScale = FactorScale.REFERENCE,
        pi_damping: bool = False,
        factor_samples: int | None = None,
        staleness_probes: int = 0,
        scaling: Scaling = Scaling.KRONECKER,
        adam_betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        basis_update: BasisUpdate = BasisUpdate.EIGH,
    ) -> None:
        self.name = name
        self.helper = helper
        self.factor_dtype = factor_dtype
        if isinstance(helper, EmbeddingHelper):  # its A factor counts indices in this dtype
            helper.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.running_average = running_average
        self.fisher = factor_scale is FactorScale.FISHER
        self.pi_damping = pi_damping
        self.factor_samples = factor_samples
        self.a_factor: torch.Tensor | None = None
        self.g_factor: torch.Tensor | None = None
        # Weight of the measured batches in the running averages (bias correction).
        self.average_weight = 0.0
        self.a_batch = BatchFactor()
        self.g_batch = BatchFactor()
        # EKFAC: the batch's fitted diagonal (kaisa_ray.ekfac), where this rank has bases.
        self.s_batch = BatchFactor()
        # With staleness measured: each factor's sketch F·Ω at the last decomposition.
        self.staleness_probes = staleness_probes
        self.sketch_a: torch.Tensor | None = None
        self.sketch_g: torch.Tensor | None = None
        # Only used with update_factors_in_hook=False: raw tensors, factored in step().
        self._saved_inputs: list[torch.Tensor] = []
        self._saved_grad_outputs: list[tuple[torch.Tensor, float]] = []
        self._saved_pairs: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        self.decomposition: Decomposition
        if scaling is not Scaling.KRONECKER and compute_method is not ComputeMethod.EIGEN:
            raise ValueError(f"the {scaling} scaling needs the eigen method's bases")
        if scaling is Scaling.ADAM_EIGENBASIS:
            self.decomposition = AdamEigenbasis(
                name=name,
                inv_dtype=inv_dtype,
                betas=adam_betas,
                eps=adam_eps,
                basis_update=basis_update,
            )
        elif scaling is Scaling.EKFAC:
            self.decomposition = EKFACEigenbasis(
                name=name, inv_dtype=inv_dtype, basis_update=basis_update
            )
        elif compute_method is ComputeMethod.EIGEN:
            self.decomposition = EigenDecomposition(
                name=name, inv_dtype=inv_dtype, outer_product=outer_product, pi=pi_damping
            )
        else:
            self.decomposition = InverseDecomposition(name=name, inv_dtype=inv_dtype)
        self.decomposition.diagonal_a = helper.diagonal_a

    # -- factors ---------------------------------------------------------------------------

    def _sampled(self, tensor: torch.Tensor) -> torch.Tensor:
        """The first ``factor_samples`` examples of a batch (an unbiased estimate of the
        batch's factor at a fraction of its cost)."""
        n = self.factor_samples
        return tensor if n is None or tensor.shape[0] <= n else tensor[:n]

    def _in_factor_dtype(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s first ``factor_samples`` examples in the factors' dtype (no operation
        where nothing changes: the hooks run under ``no_grad``, so nothing is recorded)."""
        return _in_dtype(self._sampled(tensor), self.factor_dtype)

    def add_input(self, inputs: torch.Tensor) -> None:
        """Add the A factor of a layer's input (under ``no_grad``, as the hooks call it)."""
        self.helper.a_factor(self._in_factor_dtype(inputs), self.fisher, into=self.a_batch)

    def add_grad_output(self, grad_output: torch.Tensor, divisor: float) -> None:
        """Add the G factor of an output gradient.

        ``divisor``: what the gradient is divided by: the loss scale times the world size
        under the reference scaling (gradients of the global batch's mean loss), the loss
        scale over ``accumulation_steps`` under the Fisher's, where the gradient is then
        multiplied by the number of examples the loss averages over (per-example gradients).
        """
        scale = self._g_scale(self.helper.examples(grad_output), divisor)
        g = self._in_factor_dtype(grad_output)
        self.helper.g_factor(g, self.fisher, scale, into=self.g_batch)

    @property
    def fits_diagonal(self) -> bool:
        """Whether this layer fits EKFAC's diagonal (``Scaling.EKFAC``)."""
        return isinstance(self.decomposition, EKFACEigenbasis)

    def _g_scale(self, examples: float, divisor: float) -> float:
        """What multiplies a batch's output gradients of ``examples`` examples."""
        return (examples if self.fisher else 1.0) / divisor

    def add_fitted_diagonal(
        self, inputs: torch.Tensor, grad_output: torch.Tensor, divisor: float
    ) -> None:
        """Add the batch's EKFAC diagonal from one forward's input and output gradient, in
        the current bases (nothing where this rank has none yet); ``divisor`` as for
        ``add_grad_output``."""
        self._fit(inputs, grad_output, self._g_scale(self.helper.examples(grad_output), divisor))

    def _fit(self, inputs: torch.Tensor, grad_output: torch.Tensor, scale: float) -> None:
        d = self.decomposition
        if not isinstance(d, EKFACEigenbasis) or not d.has_bases() or d.qg is None:
            return
        diagonal = fitted_diagonal(
            self.helper,
            self._sampled(inputs),
            self._sampled(grad_output),
            d.qa,  # None for a diagonal A: its basis is the identity
            d.qg,
            fisher=self.fisher,
            scale=scale,
        )
        self.s_batch.add(diagonal.to(self.factor_dtype))

    def fitted_batch(self) -> torch.Tensor | None:
        """The mean fitted diagonal since the last update (EKFAC), or None."""
        return self.s_batch.mean()

    def save_input(self, inputs: torch.Tensor) -> None:
        """Keep an input until ``factor_saved`` (update_factors_in_hook off)."""
        self._saved_inputs.append(self._sampled(inputs.detach()).clone())

    def save_grad_output(
        self, grad_output: torch.Tensor, inputs: torch.Tensor | None = None
    ) -> None:
        """Keep an output gradient, with its batch's example count, until ``factor_saved``
        (and, for EKFAC's diagonal, the input of the same forward: ``inputs``)."""
        examples = float(self.helper.examples(grad_output))
        kept = self._sampled(grad_output.detach()).clone()
        self._saved_grad_outputs.append((kept, examples))
        if inputs is not None and self.fits_diagonal:
            self._saved_pairs.append((self._sampled(inputs.detach()).clone(), kept, examples))

    def factor_saved(self, divisor: float) -> None:
        """Turn the tensors kept by the hooks into batch factors (update_factors_in_hook off)."""
        for inputs in self._saved_inputs:
            self.helper.a_factor(
                _in_dtype(inputs, self.factor_dtype), self.fisher, into=self.a_batch
            )
        for grad_output, examples in self._saved_grad_outputs:
            scale = self._g_scale(examples, divisor)
            g = grad_output.to(self.factor_dtype)
            self.helper.g_factor(g, self.fisher, scale, into=self.g_batch)
        for inputs, grad_output, examples in self._saved_pairs:
            self._fit(inputs, grad_output, self._g_scale(examples, divisor))
        self._saved_inputs.clear()
        self._saved_grad_outputs.clear()
        self._saved_pairs.clear()

    def batch_complete(self, micro_batches: int) -> bool:
        """Whether this step's G factor has seen all its micro-batches."""
        return self.g_batch.count >= micro_batches

    def reduced_buffer(self, part: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer that receives the all-reduced batch factor ``part`` ('a' or 'g', or EKFAC's
        diagonal 's'), which then counts as this step's only micro-batch."""
        k, a, g = self.helper.groups, self.helper.a_dim, self.helper.g_dim
        if part == "s":
            return self.s_batch.overwrite((k, g, a), dtype, device)
        if part == "a":
            return self.a_batch.overwrite(self.factor_shape("a"), dtype, device)
        return self.g_batch.overwrite((k, g, g), dtype, device)

    def factor_shape(self, part: str) -> tuple[int, ...]:
        """The shape of factor ``part`` ('a' or 'g'): ``(k, n, n)``, or a diagonal A's
        diagonal ``(k, a)`` (``LayerHelper.diagonal_a``)."""
        k = self.helper.groups
        if part == "a":
            a = self.helper.a_dim
            return (k, a) if self.helper.diagonal_a else (k, a, a)
        return (k, self.helper.g_dim, self.helper.g_dim)

    def batch_part(self, part: str) -> torch.Tensor | None:
        """This step's batch ``part`` ('a', 'g' or 's') to reduce over ranks, or None."""
        if part == "s":
            return self.fitted_batch()
        factors = self.batch_factors()
        return None if factors is None else factors[0 if part == "a" else 1]

    def batch_factors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean batch factors since the last update, or None unless both A and G were seen."""
        a, g = self.a_batch.mean(), self.g_batch.mean()
        if a is None or g is None:
            return None
        return a, g

    def _identity(self, part: str, device: torch.device) -> torch.Tensor:
        """Factor ``part`` ('a' or 'g') as the identity (a diagonal A's: ones)."""
        shape = self.factor_shape(part)
        if len(shape) == 2:
            return torch.ones(shape, dtype=self.factor_dtype, device=device)
        eye = torch.eye(shape[-1], dtype=self.factor_dtype, device=device)
        return eye.expand(shape).clone()

    def running(
        self, a_new: torch.Tensor, g_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The running averages about to take this step's batch factors (created at their
        start: zero when debiased, else the identity)."""
        debiased = self.running_average is RunningAverage.DEBIASED
        if self.a_factor is None:
            self.a_factor = (
                torch.zeros_like(a_new) if debiased else self._identity("a", a_new.device)
            )
        if self.g_factor is None:
            self.g_factor = (
                torch.zeros_like(g_new) if debiased else self._identity("g", g_new.device)
            )
        return self.a_factor, self.g_factor

    def fold(self, a_new: torch.Tensor, g_new: torch.Tensor, decay: float) -> None:
        """Update the running averages with this step's batch factors."""
        fold_all([(self, (a_new, g_new))], decay)

    def reset_batch(self) -> None:
        self.a_batch.reset()
        self.g_batch.reset()
        self.s_batch.reset()
        self._saved_inputs.clear()
        self._saved_grad_outputs.clear()
        self._saved_pairs.clear()

    # -- second-order information ----------------------------------------------------------

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The factors to decompose: the running averages (bias-corrected when debiased), or
        the identity before any factor update."""
        device = self.helper.weight().device
        if self.running_average is RunningAverage.DEBIASED:
            if self.a_factor is None or self.g_factor is None or self.average_weight <= 0.0:
                return self._identity("a", device), self._identity("g", device)
            if self.average_weight == 1.0:
                return self.a_factor, self.g_factor
            return self.a_factor / self.average_weight, self.g_factor / self.average_weight
        if self.a_factor is None:
            self.a_factor = self._identity("a", device)
        if self.g_factor is None:
            self.g_factor = self._identity("g", device)
        return self.a_factor, self.g_factor

    def factor_dampings(
        self, a: torch.Tensor, g: torch.Tensor, damping: float
    ) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """The damping added to A and to G by the inverse method: γ on each (the reference's
        factored Tikhonov damping) or, with ``pi_damping``, ``π√γ`` and ``√γ/π`` per group
        with ``π = sqrt((tr A / dim A) / (tr G / dim G))`` (Martens & Grosse 2015, §6.3)."""
        if not self.pi_damping:
            return damping, damping
        a_diagonal = a if self.helper.diagonal_a else a.diagonal(dim1=-2, dim2=-1)
        pi = pi_ratio(a_diagonal, g.diagonal(dim1=-2, dim2=-1))
        root = math.sqrt(damping)
        return pi * root, root / pi

    def update_decomposition(self, damping: float) -> None:
        self.decomposition.leave_basis()
        a, g = self.factors()
        damp_a, damp_g = self.factor_dampings(a, g, damping)
        self.decomposition.compute_a(a, damp_a)
        self.decomposition.compute_g(g, damp_g)
        self.decomposition.finish(damping)

    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor:
        """The preconditioned gradient of this layer (decomposing first if never done)."""
        if not self.decomposition.ready:
            self.update_decomposition(damping)
        return self.decomposition.precondition(grad_out_by_in, damping)

    # -- staleness (kaisa_ray.staleness) ----------------------------------------------------

    def take_sketches(self) -> None:
        """Remember the factors being decomposed now, as sketches."""
        a, g = self.factors()
        self.sketch_a = sketch(a, self.staleness_probes)
        self.sketch_g = sketch(g, self.staleness_probes)

    def factor_change(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Relative change of A and of G since the sketches were taken (0-dim float64
        tensors), or None before the first."""
        if self.sketch_a is None or self.sketch_g is None:
            return None
        a, g = self.factors()
        return relative_change(a, self.sketch_a), relative_change(g, self.sketch_g)

    def part_shape(self, part: str) -> tuple[int, ...]:
        """Shape of a named tensor of this layer (decomposition parts and ``grad``)."""
        k, a, g = self.helper.groups, self.helper.a_dim, self.helper.g_dim
        shapes = {
            "qa": (k, a, a),
            "a_inv": (k, a) if self.helper.diagonal_a else (k, a, a),
            "da": (k, a),
            "qg": (k, g, g),
            "g_inv": (k, g, g),
            "dg": (k, g),
            "dgda": (k, g, a),
            "m": (k, g, a),
            "s": (k, g, a),
            "v": (k, g, a),
            "steps": (k,),
            "grad": (k, g, a),
        }
        return shapes[part]

    # -- accounting and checkpoints --------------------------------------------------------

    def memory_usage(self) -> dict[str, int]:
        saved = sum(_nbytes(t) for t in self._saved_inputs)
        saved += sum(_nbytes(t) for t, _ in self._saved_grad_outputs)
        saved += sum(_nbytes(t) for t, _, _ in self._saved_pairs)
        return {
            "factors": _nbytes(self.a_factor) + _nbytes(self.g_factor),
            "decompositions": self.decomposition.nbytes(),
            "buffers": self.a_batch.nbytes()
            + self.g_batch.nbytes()
            + self.s_batch.nbytes()
            + saved
            + _nbytes(self.sketch_a)
            + _nbytes(self.sketch_g),
        }

    def state_dict(self) -> dict[str, Any]:
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().clone()

        state: dict[str, Any] = {
            "a_factor": copy(self.a_factor),
            "g_factor": copy(self.g_factor),
            "average_weight": self.average_weight,
            "decomposition": {
                k: v.detach().clone() for k, v in self.decomposition.tensors().items()
            },
        }
        if self.staleness_probes:
            state["sketch_a"], state["sketch_g"] = copy(self.sketch_a), copy(self.sketch_g)
        return state
