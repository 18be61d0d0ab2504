"""EKFAC's fitted diagonal (George et al. 2018): a batch's second moments of the per-example
gradients in K-FAC's eigenbasis, ``(k, g_dim, a_dim)`` (shapes as in ``layers.py``).

With ``Q_A`` and ``Q_G`` the eigenvectors of A and G, example ``i``'s gradient ``J_i`` (in the
factors' units: the rows the factors are built from, with their scales) is rotated into
``Q_Gᵀ J_i Q_A`` and squared element by element; the batch's diagonal is the mean over
examples divided by ``c``, the number such that, were a layer's inputs and output gradients
independent (the Kronecker approximation's assumption), the diagonal would be ``λ_G λ_Aᵀ``
exactly: ``c = 1`` where an example is one row (``nn.Linear``, whose rows are every leading
index, or one a sequence under ``sequence_approx='reduce'``, as its factors take them;
``Conv2d`` with ``kfac_approx='reduce'``), and for ``Conv2d`` with ``'expand'`` ``c = P``
(output positions) under the reference scaling, whose factors are
means over the ``N·P`` rows, and ``c = 1`` under the Fisher's, whose G is ``P`` times that
mean. With that, ``Scaling.EKFAC``'s diagonal set to ``λ_G λ_Aᵀ`` is the eigen method.

Where a ``Conv2d`` example is several rows, its gradient is the sum of their outer products,
formed in the eigenbasis for a chunk of examples at a time (at most ``CHUNK_ELEMENTS``
elements of ``(examples, k, g, a)`` at once).
"""

from __future__ import annotations

import torch

from kaisa_ray.conv_layers import Conv2dHelper
from kaisa_ray.enums import KFACApprox
from kaisa_ray.layers import EmbeddingHelper, LayerHelper, LinearHelper

# The largest block of per-example rotated gradients formed at once (float32: 64 MiB).
CHUNK_ELEMENTS = 2**24


def _with_ones(rows: torch.Tensor, value: float) -> torch.Tensor:
    """``rows`` ``(k, d, ...)`` with one more feature of ``value`` (the bias's column)."""
    ones = rows.new_full((rows.shape[0], 1, *rows.shape[2:]), value)
    return torch.cat([rows, ones], dim=1)


def _rowwise(
    a_rows: torch.Tensor, g_rows: torch.Tensor, qa: torch.Tensor, qg: torch.Tensor, count: int
) -> torch.Tensor:
    """The diagonal where each row is an example: ``a_rows`` ``(k, a, n)`` and ``g_rows``
    ``(k, g, n)`` (scaled), ``Σ_n (Q_Gᵀ g)² (Q_Aᵀ a)²ᵀ / count``: one product, as a factor."""
    rotated_a = qa.transpose(-1, -2) @ a_rows
    rotated_g = qg.transpose(-1, -2) @ g_rows
    return torch.matmul(rotated_g.square_(), rotated_a.square_().transpose(-1, -2)).div_(count)


def _embedding(
    helper: EmbeddingHelper,
    inputs: torch.Tensor,
    grad_output: torch.Tensor,
    qg: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``_rowwise`` for an embedding, whose A basis is the identity: its rows are one-hot, so
    each rotated output gradient's square is added to its index's column (no product with
    the one-hot rows, no ``(rows, num_embeddings)`` tensor)."""
    ids = inputs.reshape(-1).long()
    g_rows = helper.grad_rows(grad_output).t().unsqueeze(0).to(qg.dtype)
    rotated_g = (qg.transpose(-1, -2) @ (g_rows * scale)).square_()
    total = rotated_g.new_zeros((1, helper.g_dim, helper.a_dim))
    return total.index_add_(2, ids, rotated_g).div_(ids.numel())


def _linear(
    helper: LinearHelper,
    inputs: torch.Tensor,
    grad_output: torch.Tensor,
    qa: torch.Tensor | None,
    qg: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if qa is None:  # a diagonal A (an embedding's): its basis the identity
        if not isinstance(helper, EmbeddingHelper):
            raise TypeError(f"{helper.describe()} has no diagonal A to fit without its basis")
        return _embedding(helper, inputs, grad_output, qg, scale)
    a_rows = helper.input_rows(inputs).t().unsqueeze(0).to(qa.dtype)
    if helper.has_bias:
        a_rows = _with_ones(a_rows, 1.0)
    g_rows = helper.grad_rows(grad_output).t().unsqueeze(0).to(qg.dtype)
    return _rowwise(a_rows, g_rows * scale, qa, qg, a_rows.shape[-1])


def _conv(
    helper: Conv2dHelper,
    inputs: torch.Tensor,
    grad_output: torch.Tensor,
    qa: torch.Tensor,
    qg: torch.Tensor,
    scale: float,
    fisher: bool,
) -> torch.Tensor:
    k, batch = helper.groups, inputs.shape[0]
    oh, ow = helper.output_size(inputs.shape[-2], inputs.shape[-1])
    positions = oh * ow
    a_scale = 1.0 if fisher else 1.0 / positions
    g_dim = helper.g_dim
    if helper.approx is KFACApprox.REDUCE:  # one row an example, as the factors take them
        sums = helper.position_sums(inputs).reshape(batch, k, -1).permute(1, 2, 0)
        sums = sums.to(qa.dtype)
        if helper.has_bias:
            sums = _with_ones(sums, float(positions))
        g_sums = grad_output.sum(dim=(-2, -1)).view(batch, k, g_dim).permute(1, 2, 0)
        g_scale = scale if fisher else scale / positions**2
        return _rowwise(sums * (a_scale / positions), g_sums.to(qg.dtype) * g_scale, qa, qg, batch)
    patches = helper.patch_view(inputs).reshape(k, -1, batch, positions).to(qa.dtype)
    if helper.has_bias:
        patches = _with_ones(patches, 1.0)
    a_dim = patches.shape[1]
    g_rows = grad_output.reshape(batch, k, g_dim, positions).permute(1, 2, 0, 3).to(qg.dtype)
    g_scale = scale if fisher else scale / positions
    # rotated: (k, a, N, P) and (k, g, N, P), then per example (k, N, g, P) @ (k, N, P, a)
    rotated_a = (qa.transpose(-1, -2) @ patches.reshape(k, a_dim, -1)).mul_(a_scale)
    rotated_a = rotated_a.view(k, a_dim, batch, positions).permute(0, 2, 3, 1)
    rotated_g = (qg.transpose(-1, -2) @ g_rows.reshape(k, g_dim, -1)).mul_(g_scale)
    rotated_g = rotated_g.view(k, g_dim, batch, positions).permute(0, 2, 1, 3)
    total = qa.new_zeros((k, g_dim, a_dim))
    chunk = max(1, CHUNK_ELEMENTS // (k * g_dim * a_dim))
    for start in range(0, batch, chunk):
        block = rotated_g[:, start : start + chunk] @ rotated_a[:, start : start + chunk]
        total += block.square_().sum(dim=1)
    return total.div_(batch if fisher else batch * positions)


def fitted_diagonal(
    helper: LayerHelper,
    inputs: torch.Tensor,
    grad_output: torch.Tensor,
    qa: torch.Tensor | None,
    qg: torch.Tensor,
    *,
    fisher: bool,
    scale: float,
) -> torch.Tensor:
    """The batch's diagonal ``(k, g, a)`` in the bases ``qa`` ``(k, a, a)`` and ``qg``
    ``(k, g, g)``, in their dtype, from a layer's input and output gradient as the hooks see
    them (``qa`` None: A's basis is the identity, a diagonal A's); ``scale`` multiplies the
    output gradients as it does G's rows (``KFACLayer.add_grad_output``)."""
    if isinstance(helper, LinearHelper):
        return _linear(helper, inputs, grad_output, qa, qg, scale)
    if isinstance(helper, Conv2dHelper) and qa is not None:
        return _conv(helper, inputs, grad_output, qa, qg, scale, fisher)
    raise TypeError(f"EKFAC has no per-example gradients for {helper.describe()}")


__all__ = ["CHUNK_ELEMENTS", "fitted_diagonal"]
