"""Preconditioning by shape: the layers a rank preconditions, grouped so that layers of the
same shapes share one batched product instead of a Python loop over layers.

A ``ShapeGroup`` holds ``n`` layers with the same decomposition method, group count ``k``,
``g_dim``, ``a_dim`` and dtypes. Their decompositions live in the group's stacked storage
(each layer's tensors are views into it, ``Decomposition.attach``), so a step's products are
one batched matmul per factor for the whole group, without copying the decompositions:

- ``raw``: the members' gradients ``(n, k, g, a)`` in the decompositions' dtype (the weight's
  gradient with the bias's as the last column, as ``LayerHelper.grad``);
- storage: ``a_inv`` ``(n, k, a, a)``, ``g_inv`` ``(n, k, g, g)`` (inverse method), or ``qa``,
  ``da`` ``(n, k, a)``, ``qg``, ``dg`` and ``dgda`` ``(n, k, g, a)`` (eigen method), or
  ``qa``, ``qg`` and Adam's ``m``, ``v`` ``(n, k, g, a)`` and ``steps`` ``(n, k)`` (the
  adam-eigenbasis scaling: its moments are updated in the storage in place), or ``qa``,
  ``qg`` and EKFAC's fitted diagonal ``s`` ``(n, k, g, a)`` (folded in place on factor
  updates). A group of diagonal A factors (``ShapeKey.diagonal_a``) holds no ``qa`` (the
  identity) and its ``a_inv`` as diagonals ``(n, k, a)``.

The storage is the members' decompositions exactly (the same bytes as one tensor per layer),
allocated when the first member keeps one. Decompositions are batched the same way
(``decompose``): the factors of one shape that a rank decomposes go through one batched
``eigh`` or Cholesky, in chunks whose temporaries are no larger than the largest layer's
alone, so a decomposition step's peak memory does not grow with batching.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kaisa_ray.decomposition import EigenDecomposition, InverseDecomposition
from kaisa_ray.eigenbasis import (
    AdamEigenbasis,
    EKFACEigenbasis,
    adam_eigenbasis_precondition_many,
)
from kaisa_ray.enums import ComputeMethod
from kaisa_ray.kfac_layer import KFACLayer
from kaisa_ray.layers import LayerHelper
from kaisa_ray.products import eigen_denominator, eigen_precondition, inverse_precondition

Solver = Callable[..., Sequence[Any]]


@dataclass(frozen=True)
class ShapeKey:
    """What layers must share to be preconditioned in one batched product."""

    method: ComputeMethod
    groups: int
    g_dim: int
    a_dim: int
    inv_dtype: torch.dtype
    device: torch.device
    outer_product: bool
    pi: bool
    adam: tuple[tuple[float, float], float] | None = None  # (betas, eps) of AdamEigenbasis
    ekfac: bool = False  # EKFAC's fitted diagonal in place of the eigenvalue products
    diagonal_a: bool = False  # A diagonal: its basis the identity, its inverse diagonal


def shape_key(layer: KFACLayer) -> ShapeKey:
    d = layer.decomposition
    eigen = isinstance(d, EigenDecomposition)
    outer_product = isinstance(d, EigenDecomposition) and d.outer_product
    pi = isinstance(d, EigenDecomposition) and d.pi
    adam = (d.betas, d.eps) if isinstance(d, AdamEigenbasis) else None
    ekfac = isinstance(d, EKFACEigenbasis)
    return ShapeKey(
        method=ComputeMethod.EIGEN if eigen else ComputeMethod.INVERSE,
        groups=layer.helper.groups,
        g_dim=layer.helper.g_dim,
        a_dim=layer.helper.a_dim,
        inv_dtype=d.inv_dtype,
        device=layer.helper.weight().device,
        outer_product=outer_product,
        pi=pi,
        adam=adam,
        ekfac=ekfac,
        diagonal_a=d.diagonal_a,
    )


class StackedStorage(dict[str, torch.Tensor]):
    """Each decomposition part of ``members`` layers, stacked: ``(members, *part's shape)``.
    It refers to no layer, so the layers' decompositions can refer to it without a cycle."""

    def __init__(self, members: int) -> None:
        super().__init__()
        self.members = members

    def store(self, index: int, part: str, value: torch.Tensor) -> torch.Tensor:
        """Copy ``value`` into member ``index``'s share of ``part``; that share (a view)."""
        buffer = self.get(part)
        if buffer is None or buffer.shape[1:] != value.shape or buffer.dtype != value.dtype:
            buffer = torch.empty(
                (self.members, *value.shape), dtype=value.dtype, device=value.device
            )
            self[part] = buffer
        view = buffer[index]
        view.copy_(value)
        return view


class ShapeGroup:
    """Layers of one ``ShapeKey`` whose decompositions share stacked storage."""

    def __init__(self, key: ShapeKey, layers: Sequence[KFACLayer]) -> None:
        self.key = key
        self.layers = tuple(layers)
        self.names = frozenset(layer.name for layer in layers)
        self.storage = StackedStorage(len(self.layers))
        self._stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, layer in enumerate(self.layers):
            layer.decomposition.attach(partial(self.storage.store, index))

    def _parts(self) -> tuple[str, ...]:
        if self.key.method is ComputeMethod.INVERSE:
            return ("a_inv", "g_inv")
        if self.key.adam is not None:
            parts: tuple[str, ...] = ("qa", "qg", "m", "v", "steps")
        elif self.key.ekfac:
            parts = ("qa", "qg", "s")
        else:
            parts = ("qa", "qg", "dgda") if self.key.outer_product else ("qa", "qg", "da", "dg")
        return parts[1:] if self.key.diagonal_a else parts  # a diagonal A's basis: not held

    def ready(self) -> bool:
        """Whether every member's decomposition is in the storage (else precondition them one
        by one: a member never decomposed is decomposed first by ``KFACLayer.precondition``)."""
        for part in self._parts():
            buffer = self.storage.get(part)
            if buffer is None:
                return False
            stride = buffer.stride(0) * buffer.element_size()
            for index, layer in enumerate(self.layers):
                held = getattr(layer.decomposition, part)
                if held is None or held.data_ptr() != buffer.data_ptr() + index * stride:
                    return False
        return True

    def stacked(self, part: str) -> torch.Tensor:
        """``part`` of the storage with members and groups in one leading dimension
        ``(n·k, ...)``; the view is kept while the storage keeps its buffer."""
        buffer = self.storage[part]
        cached = self._stacked.get(part)
        if cached is not None and cached[0] is buffer:
            return cached[1]
        n, k = len(self.layers), self.key.groups
        view = buffer.reshape(n * k, *buffer.shape[2:])
        self._stacked[part] = (buffer, view)
        return view

    def gather(self) -> torch.Tensor:
        """The members' gradients ``(n, k, g, a)`` in the decompositions' dtype."""
        return gather([self])[0]

    def precondition(
        self, raw: torch.Tensor, damping: float | torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The members' preconditioned gradients ``(n, k, g, a)`` from ``gather()``'s (into
        ``out`` where given, a contiguous tensor of that shape); ``damping`` a float or a
        scalar on the device."""
        if self.key.adam is not None:
            (adam,) = precondition_adam([self], [raw])
            return adam if out is None else out.copy_(adam)
        n, k, g, a = raw.shape
        grads = raw.reshape(n * k, g, a)
        into = None if out is None else out.view(n * k, g, a)
        if self.key.method is ComputeMethod.INVERSE:
            done = inverse_precondition(
                grads,
                self.stacked("a_inv"),
                self.stacked("g_inv"),
                out=into,
                diagonal_a=self.key.diagonal_a,
            )
        else:
            # a diagonal A's basis is the identity: its products are skipped
            qa = None if self.key.diagonal_a else self.stacked("qa")
            qg = self.stacked("qg")
            if self.key.outer_product:
                done = eigen_precondition(grads, qa, qg, dgda=self.stacked("dgda"), out=into)
            elif self.key.ekfac:
                denominator = self.stacked("s") + damping
                done = eigen_precondition(grads, qa, qg, denominator=denominator, out=into)
            else:
                denominator = eigen_denominator(
                    self.stacked("da"), self.stacked("dg"), damping, self.key.pi
                )
                done = eigen_precondition(grads, qa, qg, denominator=denominator, out=into)
        return done.view(n, k, g, a) if out is None else out


ALIGN = 64  # elements: where each group's share of a flat buffer may start


@dataclass(frozen=True)
class _Span:
    """Where a tensor lies in a flat buffer: ``flat.as_strided(shape, stride, offset)``."""

    arena: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def of(self, flats: Sequence[torch.Tensor]) -> torch.Tensor:
        return flats[self.arena].as_strided(self.shape, self.stride, self.offset)


@dataclass
class Gathered:
    """One step's gradients of a ``GradientLayout``'s ``groups``: ``raws`` and ``outs`` (each
    group's ``(n, k, g, a)``) are views into the flat buffers ``raw_flats`` and ``out_flats``
    (one per dtype and device), ``grads`` the parameters' gradients in the layout's order,
    ``into`` their views in ``raw_flats`` (shaped like each gradient)."""

    groups: tuple[ShapeGroup, ...]
    raw_flats: list[torch.Tensor]
    out_flats: list[torch.Tensor]
    raws: list[torch.Tensor]
    outs: list[torch.Tensor]
    grads: list[torch.Tensor]
    into: list[torch.Tensor]


class GradientLayout:
    """Where ``groups``' gradients go in flat buffers, worked out once: each group's raw and
    preconditioned gradients ``(n, k, g, a)`` lie in one flat buffer per dtype and device,
    and each member's weight (and bias) gradient has a view there shaped like it. A step then
    costs a fixed number of operations per group and per parameter (views, no copies of its
    own): one multi-tensor copy gathers the gradients, the products write into their group's
    share, finiteness is one multi-tensor reduction over the groups' outputs, and clipping
    and the fallback to the raw gradients run once over each flat buffer."""

    def __init__(self, groups: Sequence[ShapeGroup]) -> None:
        self.groups = tuple(groups)
        arenas: dict[tuple[torch.dtype, torch.device], int] = {}
        sizes: list[int] = []
        self.group_spans: list[_Span] = []
        # (helper, whether the bias) and where its gradient lies in the raw buffer
        self.params: list[tuple[LayerHelper, bool, _Span]] = []
        for group in self.groups:
            key = (group.key.inv_dtype, group.key.device)
            arena = arenas.setdefault(key, len(arenas))
            if arena == len(sizes):
                sizes.append(0)
            start = sizes[arena]
            n, k, g, a = len(group.layers), group.key.groups, group.key.g_dim, group.key.a_dim
            shape = (n, k, g, a)
            self.group_spans.append(_Span(arena, shape, (k * g * a, g * a, a, 1), start))
            member = torch.empty(shape, device="meta").as_strided(
                shape, (k * g * a, g * a, a, 1), start
            )
            for index, layer in enumerate(group.layers):
                helper = layer.helper
                weight = helper.weight()
                columns = weight.numel() // (k * g)
                view = helper.matrix_as_weight(member[index, :, :, :columns])
                self.params.append((helper, False, _span_of(arena, view)))
                bias = helper.bias()
                if bias is not None:
                    view = member[index, :, :, columns].view(bias.shape)
                    self.params.append((helper, True, _span_of(arena, view)))
            sizes[arena] = -(-(start + n * k * g * a) // ALIGN) * ALIGN
        self.arenas = [(dtype, device, sizes[i]) for (dtype, device), i in arenas.items()]
        self.kept: Gathered | None = None  # the buffers of ``gather(keep=True)``

    def gather(self, keep: bool = False) -> Gathered:
        """This step's gradients in fresh flat buffers (what lies between groups' shares is
        left as it is: nothing reads it); with ``keep``, in the same buffers every step
        (allocated on the first such call and kept, as a CUDA graph needs them)."""
        grads = []
        for helper, is_bias, _ in self.params:
            grad = helper.bias_grad() if is_bias else helper.weight_grad()
            if grad is None:
                what = "bias gradient" if is_bias else "gradient; call backward() first"
                raise RuntimeError(f"{helper.describe()} has no {what}.")
            grads.append(grad)
        kept = self.kept
        if kept is None or not keep:
            raw_flats = [torch.empty(n, dtype=dt, device=dev) for dt, dev, n in self.arenas]
            out_flats = [torch.empty(n, dtype=dt, device=dev) for dt, dev, n in self.arenas]
            into = [span.of(raw_flats) for _, _, span in self.params]
            kept = Gathered(
                self.groups,
                raw_flats,
                out_flats,
                [span.of(raw_flats) for span in self.group_spans],
                [span.of(out_flats) for span in self.group_spans],
                [],
                into,
            )
            if keep:
                self.kept = kept
        kept.grads = grads
        copy_all(list(zip(kept.into, grads, strict=True)))
        return kept


def _span_of(arena: int, view: torch.Tensor) -> _Span:
    return _Span(arena, tuple(view.shape), tuple(view.stride()), int(view.storage_offset()))


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair, in as few operations as possible: the pairs whose
    tensors are alike (dtype, strides, dense) in one multi-tensor copy, the rest in another
    (``_foreach_copy_`` takes its fast path only when every pair qualifies)."""
    fast: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    slow: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for dst, src in pairs:
        alike = (
            dst.dtype == src.dtype
            and dst.stride() == src.stride()
            and dst.is_contiguous()
            and src.is_contiguous()
        )
        chosen = fast if alike else slow
        chosen[0].append(dst)
        chosen[1].append(src)
    for dsts, srcs in (fast, slow):
        if dsts:
            torch._foreach_copy_(dsts, srcs)


def precondition(
    groups: Sequence[ShapeGroup],
    raws: Sequence[torch.Tensor],
    damping: float | torch.Tensor,
    outs: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Each group's preconditioned gradients (``ShapeGroup.precondition`` of its ``raws``
    entry, into its ``outs`` entry where given); the groups with Adam's moments in the
    eigenbasis together, by their betas and eps (``precondition_adam``)."""
    out: list[torch.Tensor | None] = [None] * len(groups)
    adam: dict[tuple[tuple[float, float], float], list[int]] = {}
    for index, group in enumerate(groups):
        if group.key.adam is not None:
            adam.setdefault(group.key.adam, []).append(index)
        else:
            into = None if outs is None else outs[index]
            out[index] = group.precondition(raws[index], damping, into)
    for indices in adam.values():
        done = precondition_adam([groups[i] for i in indices], [raws[i] for i in indices])
        for index, result in zip(indices, done, strict=True):
            out[index] = result if outs is None else outs[index].copy_(result)
    results = [result for result in out if result is not None]
    assert len(results) == len(groups)
    return results


def precondition_adam(
    groups: Sequence[ShapeGroup], raws: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The preconditioned gradients ``(n, k, g, a)`` of adam-eigenbasis groups of one
    ``(betas, eps)``, their moments updated in multi-tensor operations over all of them
    (``adam_eigenbasis_precondition_many``)."""
    grads, bases, moments = [], [], []
    for group, raw in zip(groups, raws, strict=True):
        n, k, g, a = raw.shape
        s = group.storage
        grads.append(raw.reshape(n * k, g, a))
        qa = None if group.key.diagonal_a else s["qa"].reshape(n * k, a, a)
        bases.append((qa, s["qg"].reshape(n * k, g, g)))
        moments.append((s["m"].view(n * k, g, a), s["v"].view(n * k, g, a), s["steps"].view(n * k)))
    adam = groups[0].key.adam
    assert adam is not None
    betas, eps = adam
    done = adam_eigenbasis_precondition_many(grads, bases, moments, betas, eps)
    return [out.reshape(raw.shape) for out, raw in zip(done, raws, strict=True)]


def gather(groups: Sequence[ShapeGroup]) -> list[torch.Tensor]:
    """Each group's gradients ``(n, k, g, a)`` (``ShapeGroup.gather``), copied in together
    (a ``GradientLayout`` worked out for this call: for timing the products, not for a step,
    which keeps its layouts)."""
    return GradientLayout(groups).gather().raws if groups else []


def shape_groups(layers: Sequence[KFACLayer]) -> list[ShapeGroup]:
    """``layers`` grouped by ``ShapeKey`` (in the order of each key's first layer); every
    layer's decomposition is attached to its group's storage."""
    by_key: dict[ShapeKey, list[KFACLayer]] = {}
    for layer in layers:
        by_key.setdefault(shape_key(layer), []).append(layer)
    return [ShapeGroup(key, members) for key, members in by_key.items()]


def decompose(
    work: Sequence[tuple[KFACLayer, str, torch.Tensor, float | torch.Tensor]],
) -> None:
    """Decompose ``(layer, 'A' or 'G', factor, damping)`` items, batched by method (a basis
    refreshed by a power iteration being a method of its own) and factor shape, each chunk's
    stacked factors no larger than the largest factor alone (so that the temporaries of a
    batched ``eigh``, Cholesky or QR stay those of one layer). A diagonal factor
    (``Decomposition.diagonal_a``) is decomposed from its diagonal, on its own."""
    Key = tuple[ComputeMethod, bool, tuple[int, ...], torch.dtype, torch.device]
    by_shape: dict[Key, list[int]] = {}
    for index, (layer, which, factor, damping) in enumerate(work):
        d = layer.decomposition
        if which == "A" and d.diagonal_a:  # from its diagonal, no dense solver to batch
            d.compute_a(factor, damping)
            continue
        eigen = isinstance(d, EigenDecomposition)
        method = ComputeMethod.EIGEN if eigen else ComputeMethod.INVERSE
        refresh = isinstance(d, EigenDecomposition) and d.refreshes(which)
        key = (method, refresh, tuple(factor.shape), factor.dtype, factor.device)
        by_shape.setdefault(key, []).append(index)
    largest = max((item[2].numel() for item in work), default=0)
    for (method, refresh, shape, _, _), indices in by_shape.items():
        per_chunk = max(1, largest // max(1, torch.Size(shape).numel()))
        solve: Solver = (
            EigenDecomposition.solve_many
            if method is ComputeMethod.EIGEN
            else InverseDecomposition.solve_many
        )
        for start in range(0, len(indices), per_chunk):
            chunk = [work[i] for i in indices[start : start + per_chunk]]
            # One member: its factor as it is (no copy); several: a stacked copy, which the
            # solver may then use as its workspace.
            owned = len(chunk) > 1
            factors = (
                torch.stack([item[2] for item in chunk]) if owned else chunk[0][2].unsqueeze(0)
            )
            if refresh:
                results = _refresh(factors, chunk)
            else:
                results = solve(factors, [item[3] for item in chunk], owned=owned)
            del factors
            for (layer, which, factor, damping), result in zip(chunk, results, strict=True):
                if result is None:  # on its own in float64, as an unbatched layer would be
                    result = layer.decomposition.retry(factor, damping)
                layer.decomposition.accept(which, result, factor, damping)


def _refresh(
    factors: torch.Tensor,
    chunk: Sequence[tuple[KFACLayer, str, torch.Tensor, float | torch.Tensor]],
) -> Sequence[Any]:
    """Each member's basis refreshed from the one it holds (``refresh_many``), stacked."""
    bases = torch.stack([_eigen(layer).basis(which) for layer, which, _, _ in chunk])
    return EigenDecomposition.refresh_many(factors, bases)


def _eigen(layer: KFACLayer) -> EigenDecomposition:
    d = layer.decomposition
    if not isinstance(d, EigenDecomposition):
        raise TypeError(f"layer {layer.name!r} has no eigen bases to refresh")
    return d
