"""Per-module factor math: how a layer's inputs and output gradients become K-FAC factors.

Shapes, named once for the whole file (``k`` is the number of groups, 1 unless a Conv2d has
``groups > 1``; each group gets its own factor pair, stacked along the leading dimension):

- ``a_factor``: ``(k, a_dim, a_dim)`` with ``a_dim = in_per_group [* kh * kw] (+ 1 for bias)``,
  or its diagonal ``(k, a_dim)`` where A is diagonal by construction (``diagonal_a``: an
  embedding's);
- ``g_factor``: ``(k, g_dim, g_dim)`` with ``g_dim = out_per_group``;
- ``grad_out_by_in``: ``(k, g_dim, a_dim)``: the weight gradient flattened row-major with the
  bias gradient as the last column, which is the layout ``(G ⊗ A + γI)⁻¹ vec(∇W)`` refers to.

Two scalings (``FactorScale``). ``reference`` follows the reference implementation
(kfac-pytorch) so that a damping value means the same thing to users who switch: A and G are
means over rows; for Conv2d the rows are (sample, output position) pairs and both the patches
(with their bias column of ones) and the output gradients are divided by the number of output
positions ``P``. ``fisher`` gives the Kronecker factors of the Fisher itself, from output
gradients that the caller has already turned into per-example gradients (times
``examples()``): for Linear the same means over rows; for Conv2d ``expand`` the factors of
Grosse & Martens (2016), ``A = E_{n,p}[a aᵀ]`` and ``G = P · E_{n,p}[d dᵀ]``, and for
``reduce`` those of Eschenhagen et al. (2023), ``A = E_n[ā āᵀ]`` (``ā`` the sample's mean
patch) and ``G = E_n[(Σ_p d)(Σ_p d)ᵀ]``. With one example and a Linear layer, ``G ⊗ A`` is
then exactly that example's gradient outer product.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray.enums import KFACApprox
from kaisa_ray.products import cpu_bfloat16, gram


class Accumulator(Protocol):
    """Where a batch factor goes: ``kaisa_ray.kfac_layer.BatchFactor``."""

    def accumulate(self, rows: torch.Tensor, alpha: float) -> torch.Tensor:
        """Add ``alpha · rows rowsᵀ`` (``rows`` ``(k, d, n)``) in place; the running total."""

    def add(self, factor: torch.Tensor) -> None:
        """Add a factor computed elsewhere."""


def _covariance(
    rows: torch.Tensor, scale: float, count: int, into: Accumulator | None = None
) -> torch.Tensor:
    """Mean outer product of the scaled rows of ``rows`` ``(k, n, d)`` (rows first)."""
    return _covariance_features_first(rows.transpose(-1, -2), scale, count, False, into)


def _covariance_features_first(
    rows: torch.Tensor,
    scale: float,
    count: int,
    bias: bool,
    into: Accumulator | None = None,
) -> torch.Tensor:
    """Mean outer product of ``scale·[rows, 1]`` over ``count`` rows; ``rows`` is ``(k, d, n)``.

    Features-first is the layout the patch view reshapes into without a transpose. One
    product ``rows rowsᵀ`` with the scale as its ``alpha``, added straight into ``into``'s
    buffer where given (a factor step's hook: one kernel for the factor); it is symmetric up
    to rounding, and the decompositions read one triangle. The bias's ones become one more
    row where there are fewer rows than features; otherwise the ones column is folded in with
    a row sum instead of a copy of ``rows``.
    """
    k, d, n = rows.shape
    factor = scale * scale / count
    if bias and n < d:
        rows = torch.cat([rows, rows.new_ones((k, 1, n))], dim=1)
        bias = False
    if not bias:
        if into is not None:
            return into.accumulate(rows, factor)
        return gram(rows, rows.new_empty((k, rows.shape[1], rows.shape[1])), alpha=factor)
    out = rows.new_empty((k, d + 1, d + 1))
    if cpu_bfloat16(rows):
        out[:, :d, :d] = gram(rows, rows.new_empty((k, d, d)), alpha=factor)
    else:
        out[:, :d, :d] = torch.matmul(rows, rows.transpose(-1, -2)).mul_(factor)
    sums = rows.sum(dim=-1) * factor
    out[:, :d, d] = sums
    out[:, d, :d] = sums
    out[:, d, d] = factor * count
    if into is not None:
        into.add(out)
    return out


class LayerHelper(ABC):
    """What the preconditioner needs to know about one module type."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # During a step of a sharded model (FSDP2): the whole weight and bias gradients,
        # standing in for the parameters' shards (``kaisa_ray/sharding.py``); else None.
        self.whole: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @property
    def has_bias(self) -> bool:
        return getattr(self.module, "bias", None) is not None

    @property
    def groups(self) -> int:
        return 1

    @property
    def diagonal_a(self) -> bool:
        """Whether the A factor is diagonal by construction: held as its diagonal ``(k, a)``
        (not ``(k, a, a)``) and decomposed from it (``kaisa_ray.decomposition``)."""
        return False

    @property
    @abstractmethod
    def a_dim(self) -> int:
        """Width of one group's A factor (including the bias column)."""

    @property
    @abstractmethod
    def g_dim(self) -> int:
        """Width of one group's G factor."""

    @abstractmethod
    def a_factor(
        self, inputs: torch.Tensor, fisher: bool = False, into: Accumulator | None = None
    ) -> torch.Tensor:
        """Batch A factor ``(k, a_dim, a_dim)`` from the module's input (added into ``into``
        where given); a ``diagonal_a`` layer's is its diagonal, ``(k, a_dim)``."""

    @abstractmethod
    def g_factor(
        self,
        grad_output: torch.Tensor,
        fisher: bool = False,
        scale: float = 1.0,
        into: Accumulator | None = None,
    ) -> torch.Tensor:
        """Batch G factor ``(k, g_dim, g_dim)`` from the gradient w.r.t. the module's output
        times ``scale`` (with ``fisher``, per-example gradients: see the module docstring);
        the scale is applied to the factor, not to the gradient."""

    def examples(self, grad_output: torch.Tensor) -> int:
        """How many examples a mean loss averages ``grad_output`` over: every leading index
        (samples, or samples × tokens for a sequence model) unless a subclass says otherwise."""
        return grad_output.numel() // max(1, grad_output.shape[-1])

    def weight(self) -> torch.Tensor:
        weight = self.module.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{self.describe()} has no weight tensor.")
        return weight

    def bias(self) -> torch.Tensor | None:
        bias = getattr(self.module, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def weight_as_matrix(self, weight: torch.Tensor, k: int, g: int, columns: int) -> torch.Tensor:
        """A tensor laid out as the weight (its gradient, or a sharded rank's rows of it, which
        may be none) as the view ``(k, g, columns)`` that ``grad_out_by_in`` holds without
        the bias column."""
        return weight.view(k, g, columns)

    def matrix_as_weight(self, matrix: torch.Tensor) -> torch.Tensor:
        """The inverse of ``weight_as_matrix``: a ``(k, g_dim, columns)`` view laid out as
        the weight."""
        return matrix.view(self.weight().shape)

    def weight_grad(self) -> torch.Tensor | None:
        """The weight's gradient (whole, also where the parameter is sharded)."""
        return self.weight().grad if self.whole is None else self.whole[0]

    def bias_grad(self) -> torch.Tensor | None:
        """The bias's gradient (whole), None without a bias."""
        if self.whole is not None:
            return self.whole[1]
        bias = self.bias()
        return None if bias is None else bias.grad

    def has_grad(self) -> bool:
        return self.weight_grad() is not None and (
            self.bias() is None or self.bias_grad() is not None
        )

    def grad(self) -> torch.Tensor:
        """The gradient as ``grad_out_by_in`` ``(k, g_dim, a_dim)``."""
        weight_grad = self.weight_grad()
        if weight_grad is None:
            raise RuntimeError(f"{self.describe()} has no gradient; call backward() first.")
        k = self.groups
        grad = weight_grad.reshape(k, self.g_dim, -1)
        if self.bias() is not None:
            bias_grad = self.bias_grad()
            if bias_grad is None:
                raise RuntimeError(f"{self.describe()} has no bias gradient.")
            grad = torch.cat([grad, bias_grad.reshape(k, self.g_dim, 1)], dim=-1)
        return grad

    def set_grad(self, grad_out_by_in: torch.Tensor) -> None:
        """Write ``(k, g_dim, a_dim)`` back into the weight's gradient (and the bias's)."""
        weight_grad, bias_grad = self.weight_grad(), self.bias_grad()
        if weight_grad is None or (self.bias() is not None and bias_grad is None):
            raise RuntimeError(f"{self.describe()} has no gradient to replace.")
        if bias_grad is not None:
            bias_grad.copy_(grad_out_by_in[..., -1].reshape(bias_grad.shape))
            grad_out_by_in = grad_out_by_in[..., :-1]
        weight_grad.copy_(grad_out_by_in.reshape(weight_grad.shape))

    def describe(self) -> str:
        return type(self.module).__name__


class LinearHelper(LayerHelper):
    """``nn.Linear``: rows are every leading index of the input (batch, sequence, ...).

    ``approx`` (``sequence_approx``) says what an input of more than two dimensions, a
    sequence's ``(N, T, ..., d)``, contributes. ``expand``: every token is a row, as the
    reference builds the factors. ``reduce`` (Eschenhagen et al. 2023's K-FAC-reduce for
    weight sharing, as ``Conv2dHelper`` forms it over positions): one row per sequence,
    ``A = E_n[ā āᵀ]`` with ``ā`` the sequence's mean input and ``G = E_n[(Σ_t g)(Σ_t g)ᵀ]``
    from its output gradients ``g`` (per token under the Fisher's scaling), a product over
    ``N`` rows instead of ``N·T``. Where a sequence's tokens have uncorrelated gradients this
    ``G`` is ``T`` times ``expand``'s, so a damping value weighs less against it; with
    ``T = 1`` (a two-dimensional input) the two forms are one.
    """

    module: nn.Linear

    def __init__(self, module: nn.Linear, approx: KFACApprox = KFACApprox.EXPAND) -> None:
        super().__init__(module)
        self.approx = approx

    @property
    def a_dim(self) -> int:
        return self.module.in_features + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_features

    def reduces(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s positions (every dimension between the first and the last)
        are reduced to one row per example."""
        return self.approx is KFACApprox.REDUCE and tensor.dim() > 2

    def input_rows(self, inputs: torch.Tensor) -> torch.Tensor:
        """The A factor's rows ``(n, in_features)``: every token, or each sequence's mean."""
        if self.reduces(inputs):
            return inputs.mean(dim=tuple(range(1, inputs.dim() - 1)))
        return inputs.reshape(-1, inputs.shape[-1])

    def grad_rows(self, grad_output: torch.Tensor) -> torch.Tensor:
        """The G factor's rows ``(n, out_features)``: every token, or each sequence's sum."""
        if self.reduces(grad_output):
            return grad_output.sum(dim=tuple(range(1, grad_output.dim() - 1)))
        return grad_output.reshape(-1, grad_output.shape[-1])

    def a_factor(
        self, inputs: torch.Tensor, fisher: bool = False, into: Accumulator | None = None
    ) -> torch.Tensor:
        rows = self.input_rows(inputs).t().unsqueeze(0)
        return _covariance_features_first(rows, 1.0, rows.shape[-1], self.has_bias, into)

    def g_factor(
        self,
        grad_output: torch.Tensor,
        fisher: bool = False,
        scale: float = 1.0,
        into: Accumulator | None = None,
    ) -> torch.Tensor:
        rows = self.grad_rows(grad_output)
        return _covariance(rows.unsqueeze(0), scale, rows.shape[0], into)


class EmbeddingHelper(LinearHelper):
    """``nn.Embedding`` as the Linear layer of one-hot inputs it is: a row for every index of
    its input (every token, always expanded), ``A = E[e_i e_iᵀ]`` the diagonal of the indices'
    frequencies (formed by counting, not by a product) and ``G`` the output gradients' as a
    Linear layer's. The weight is ``(num_embeddings, embedding_dim)``, the transpose of a
    Linear layer's ``(out, in)``, so ``grad_out_by_in`` is its gradient transposed.

    The input's leading dimension is its examples (``factor_samples`` takes the first ones): a
    layer called with an index shared by the batch (positions from ``arange`` without a batch
    dimension) has the batch's summed gradient for every row; skip it (``skip_layers``) where
    that is not wanted. The A factor is diagonal (``diagonal_a``) and held as its diagonal,
    ``(1, num_embeddings)``: its memory, communication and decomposition grow with the
    vocabulary, not with its square."""

    module: nn.Embedding  # type: ignore[assignment]

    def __init__(self, module: nn.Embedding) -> None:
        LayerHelper.__init__(self, module)
        self.approx = KFACApprox.EXPAND
        # the A factor's dtype (the layer's factor dtype, set by ``KFACLayer``): the input is
        # indices, which are counted, not cast
        self.factor_dtype = torch.promote_types(module.weight.dtype, torch.float32)

    @property
    def has_bias(self) -> bool:
        return False

    @property
    def diagonal_a(self) -> bool:
        return True

    @property
    def a_dim(self) -> int:
        return self.module.num_embeddings

    @property
    def g_dim(self) -> int:
        return self.module.embedding_dim

    def input_rows(self, inputs: torch.Tensor) -> torch.Tensor:
        """The one-hot rows ``(n, num_embeddings)`` of every index (EKFAC's diagonal)."""
        return F.one_hot(inputs.reshape(-1).long(), self.a_dim).to(self.factor_dtype)

    def a_factor(
        self, inputs: torch.Tensor, fisher: bool = False, into: Accumulator | None = None
    ) -> torch.Tensor:
        ids = inputs.reshape(-1).long()
        counts = torch.bincount(ids, minlength=self.a_dim).to(self.factor_dtype)
        diagonal = counts.div_(max(1, ids.numel())).unsqueeze(0)  # (1, a)
        factor = diagonal if self.diagonal_a else torch.diag_embed(diagonal)
        if into is not None:
            into.add(factor)
        return factor

    def weight_as_matrix(
        self, weight: torch.Tensor, k: int = 1, g: int = 0, columns: int = 0
    ) -> torch.Tensor:
        return weight.t().unsqueeze(0)  # (one group, embedding_dim, num_embeddings)

    def matrix_as_weight(self, matrix: torch.Tensor) -> torch.Tensor:
        return matrix[0].t()

    def grad(self) -> torch.Tensor:
        weight_grad = self.weight_grad()
        if weight_grad is None:
            raise RuntimeError(f"{self.describe()} has no gradient; call backward() first.")
        return self.weight_as_matrix(weight_grad)

    def set_grad(self, grad_out_by_in: torch.Tensor) -> None:
        weight_grad = self.weight_grad()
        if weight_grad is None:
            raise RuntimeError(f"{self.describe()} has no gradient to replace.")
        self.weight_as_matrix(weight_grad).copy_(grad_out_by_in)

    def describe(self) -> str:
        m = self.module
        return f"Embedding({m.num_embeddings}, {m.embedding_dim})"


def describe_shapes(helper: LayerHelper) -> str:
    k = helper.groups
    prefix = f"{k}x" if k > 1 else ""
    return f"A {prefix}{helper.a_dim}, G {prefix}{helper.g_dim}"


__all__ = [
    "EmbeddingHelper",
    "LayerHelper",
    "LinearHelper",
    "describe_shapes",
]
