"""What a K-FAC step does once the gradients are preconditioned: the KL clip, the guard
against values that are not finite, and the write into the parameters' gradients, all decided
on the device (nothing is read back on a step that updates nothing).

``GradientSetter`` holds the state this keeps across steps (the clip's last scale, the count of
steps whose raw gradients were kept); ``Block`` and ``Outputs`` are how the preconditioner
hands it the step's gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from kaisa_ray import batching
from kaisa_ray.errors import user_stacklevel
from kaisa_ray.kfac_layer import KFACLayer


@dataclass(frozen=True)
class Block:
    """Layers' raw and preconditioned gradients ``(n, k, g, a)``, set together."""

    layers: Sequence[KFACLayer]
    raw: torch.Tensor
    out: torch.Tensor


class Outputs(Mapping[str, torch.Tensor]):
    """Preconditioned gradients by layer name; a shape group's member is selected from the
    group's ``(n, k, g, a)`` output only when asked for (most steps never ask)."""

    def __init__(self) -> None:
        self._of: dict[str, tuple[torch.Tensor, int | None]] = {}

    def put(self, name: str, tensor: torch.Tensor, index: int | None = None) -> None:
        self._of[name] = (tensor, index)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor, index = self._of[name]
        return tensor if index is None else tensor[index]

    def __contains__(self, name: object) -> bool:
        return name in self._of

    def __iter__(self) -> Iterator[str]:
        return iter(self._of)

    def __len__(self) -> int:
        return len(self._of)


def sum_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ a·b`` (float32 at least), without an elementwise temporary."""
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()
    return torch.vdot(a.reshape(-1), b.to(a.dtype).reshape(-1))


def group_dot(out: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """``Σ out[i]·raw[i]`` for each member ``i`` of ``(n, ...)`` stacks (float32 at least),
    in one operation."""
    if out.dtype in (torch.float16, torch.bfloat16):
        out, raw = out.float(), raw.float()
    flat = out.reshape(out.shape[0], -1)
    dots: torch.Tensor = torch.linalg.vecdot(flat, raw.to(out.dtype).reshape(flat.shape))
    return dots


def _over_ranks(
    values: torch.Tensor, over_ranks: Callable[[torch.Tensor], torch.Tensor] | None
) -> torch.Tensor:
    return values if over_ranks is None else over_ranks(values)


def finite_flags(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each tensor's values are all finite, waiting for the device once: a norm per
    tensor, all in one multi-tensor operation (a NaN or an infinity makes it non-finite), an
    exact check only where a norm is not finite (an overflow of finite values)."""
    if not tensors:
        return []
    norms = torch.stack(torch._foreach_norm(list(tensors))).isfinite().tolist()
    return [bool(ok) or bool(torch.isfinite(t).all()) for ok, t in zip(norms, tensors, strict=True)]


def param_grads(layers: Sequence[KFACLayer]) -> list[torch.Tensor]:
    """The layers' weight and bias gradients (whole, also where the parameters are sharded)."""
    grads = []
    for layer in layers:
        for grad in (layer.helper.weight_grad(), layer.helper.bias_grad()):
            if grad is not None:
                grads.append(grad)
    return grads


class GradientSetter:
    """Sets each step's preconditioned gradients (``set``) and keeps what that decides on the
    device: the KL clip's last scale and the steps whose raw gradients were kept."""

    def __init__(self) -> None:
        self._skipped_count = 0  # before the first step, or as a checkpoint said
        self._skipped: torch.Tensor | None = None  # on the device from the first step on
        self._warned = 0
        self._last_scale: torch.Tensor | None = None

    @property
    def skipped_steps(self) -> int:
        """Steps whose gradients were left as they were because one was not finite (reading
        it waits for the device)."""
        return self._skipped_count if self._skipped is None else int(self._skipped)

    @property
    def last_grad_scale(self) -> float:
        """The KL clip's scale on the last step that set the gradients (1.0 without a clip;
        reading it waits for the device)."""
        return 1.0 if self._last_scale is None else float(self._last_scale)

    @property
    def nbytes(self) -> int:
        """Bytes of the state held on the device."""
        return sum(t.nbytes for t in (self._skipped, self._last_scale) if t is not None)

    def state(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The skipped-step count and the clip's last scale on ``device``, made on the first
        call (before a CUDA graph captures what updates them in place)."""
        if self._skipped is None or self._last_scale is None:
            self._skipped = torch.full((), self._skipped_count, device=device)
            self._last_scale = torch.ones((), dtype=torch.float64, device=device)
        return self._skipped, self._last_scale

    def restart_count(self, skipped: int) -> None:
        """The count of skipped steps a checkpoint holds (already warned about)."""
        self._skipped_count = self._warned = skipped
        if self._skipped is not None:
            self._skipped.fill_(skipped)

    def warn_skipped(self, step: int) -> None:
        """Warn about steps skipped since the last warning (where the step waits anyway)."""
        skipped = self.skipped_steps
        if skipped > self._warned:
            self._warned = skipped
            warnings.warn(
                f"K-FAC step {step}: a preconditioned gradient was not finite on "
                f"{skipped} step(s) so far; the raw gradients were kept on those steps. Raise "
                "damping if this repeats.",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

    def set(
        self,
        blocks: Sequence[Block],
        gathered: batching.Gathered | None,
        order: Sequence[KFACLayer],
        kl_clip: float | torch.Tensor | None,
        lr: float | torch.Tensor,
        write_grads: bool = True,
        *,
        group_dots: bool = False,
        over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """KL clipping (scale by min(1, sqrt(kl_clip / |lr² Σ p·g|))), then set the grads;
        where a gradient or a preconditioned gradient is not finite, the raw gradients stay.
        Decided on the device: no value is read back here, and the state kept changes in
        place (so that a CUDA graph can hold this). ``gathered``: the shape groups'
        gradients in flat buffers (``batching.GradientLayout``), ``blocks`` the rest;
        ``order``: every layer, in the order the clip's sum adds them up; ``kl_clip`` and
        ``lr`` floats or scalars on the device. Without ``write_grads`` the result is left in
        ``gathered``'s raw buffers for the caller to copy to the gradients. ``group_dots``:
        the clip's products a shape group at a time (one operation for its members), for
        steps where every rank groups every layer alike (one rank, or COMM-OPT); elsewhere a
        layer preconditioned in a group on one rank arrives alone on another, and its
        product must be the same operation on both. ``over_ranks``: where each rank holds
        only some rows of every layer (FSDP2's ``rows_mode``), the per-block sums (one a
        layer, every rank in the same order) summed over ranks before they are added up."""
        if not blocks and gathered is None:
            return
        if kl_clip is not None and group_dots:  # Σ p·g a shape group (or a block) at a time
            pairs = [(block.out, block.raw) for block in blocks]
            if gathered is not None:
                pairs += zip(gathered.outs, gathered.raws, strict=True)
            total = torch.cat([group_dot(out, raw) for out, raw in pairs]).double().sum()
        elif kl_clip is not None:
            # Σ p·g per layer (one product each, the same on every rank however the layer was
            # preconditioned there), summed in layer order in float64: not finite if any p or
            # g is (a NaN or an infinity spreads through the products).
            pieces: list[tuple[Sequence[KFACLayer], torch.Tensor, torch.Tensor]] = [
                (block.layers, block.out, block.raw) for block in blocks
            ]
            if gathered is not None:
                pieces += [
                    (group.layers, out, raw)
                    for group, out, raw in zip(
                        gathered.groups, gathered.outs, gathered.raws, strict=True
                    )
                ]
            dot_of = {
                layer.name: sum_dot(out[index], raw[index])
                for layers, out, raw in pieces
                for index, layer in enumerate(layers)
            }
            dots = [dot_of[layer.name] for layer in order if layer.name in dot_of]
            total = _over_ranks(torch.stack(dots).to(torch.float64), over_ranks).sum()
        else:  # only whether everything is finite (the products spread a raw gradient's
            # NaN or infinity into its preconditioned one): one float64 sum per block and per
            # shape group's output, which no float32, bfloat16 or float16 values overflow (a
            # NaN or an infinity makes it non-finite)
            outs = [block.out for block in blocks]
            if gathered is not None:
                outs += gathered.outs
            sums = torch.stack([out.sum(dtype=torch.float64) for out in outs])
            total = _over_ranks(sums, over_ranks).sum()
        ok = torch.isfinite(total)
        skipped, last = self.state(total.device)
        if kl_clip is not None:
            scale = torch.sqrt(kl_clip / (total * lr**2).abs()).clamp(max=1.0)
            torch.where(ok, scale, last, out=last)
        else:
            last.masked_fill_(ok, 1.0)
        skipped += (~ok).to(skipped.dtype)
        self._write(blocks, gathered, ok, kl_clip is not None, write_grads)

    def _write(
        self,
        blocks: Sequence[Block],
        gathered: batching.Gathered | None,
        ok: torch.Tensor,
        clipped: bool,
        write_grads: bool,
    ) -> None:
        assert self._last_scale is not None
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if gathered is not None:
            # the result into the raw buffers (the outputs stay as preconditioned, unclipped)
            for out, raw in zip(gathered.out_flats, gathered.raw_flats, strict=True):
                if clipped:
                    out = out * self._last_scale.to(out.dtype)
                torch.where(ok, out, raw, out=raw)
            if write_grads:
                pairs += zip(gathered.grads, gathered.into, strict=True)
        for block in blocks:
            out = block.out
            if clipped:
                out = out * self._last_scale.to(out.dtype)
            out = torch.where(ok, out, block.raw.to(out.dtype))
            for index, layer in enumerate(block.layers):
                helper = layer.helper
                weight_grad, bias_grad = helper.weight_grad(), helper.bias_grad()
                if weight_grad is None:
                    continue
                # (k, g) of the layer's whole gradient, or (1, rows) of a rank's rows
                k, g, width = out.shape[1:]
                columns = width - (bias_grad is not None)
                weight_view = helper.weight_as_matrix(weight_grad, k, g, columns)
                pairs.append((weight_view, out[index, :, :, : weight_view.shape[-1]]))
                if bias_grad is not None:
                    pairs.append((bias_grad.view(k, g), out[index, :, :, -1]))
        batching.copy_all(pairs)
