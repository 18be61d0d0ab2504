"""``nn.Conv2d``'s factor math (``Conv2dHelper``): patches as a strided view, the ``expand``
and ``reduce`` factors of the module docstring of ``kaisa_ray.layers``, one factor pair per
group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray.enums import KFACApprox
from kaisa_ray.layers import Accumulator, LayerHelper, _covariance_features_first


class Conv2dHelper(LayerHelper):
    """``nn.Conv2d`` with any stride, padding (int, tuple, 'same', 'valid'), dilation,
    ``padding_mode`` and ``groups`` (one factor pair per group)."""

    module: nn.Conv2d

    def __init__(self, module: nn.Conv2d, approx: KFACApprox = KFACApprox.EXPAND) -> None:
        super().__init__(module)
        self.approx = approx
        kh, kw = module.kernel_size
        dh, dw = module.dilation
        if isinstance(module.padding, str):
            if module.padding == "valid":
                pads = (0, 0, 0, 0)
            else:  # 'same': PyTorch puts the odd extra pixel on the right/bottom
                th, tw = dh * (kh - 1), dw * (kw - 1)
                pads = (tw // 2, tw - tw // 2, th // 2, th - th // 2)
        else:
            ph, pw = module.padding
            pads = (pw, pw, ph, ph)
        # F.pad order: (left, right, top, bottom)
        self._pads = pads
        mode = module.padding_mode
        self._pad_mode = "constant" if mode == "zeros" else mode

    @property
    def groups(self) -> int:
        return self.module.groups

    @property
    def kernel_numel(self) -> int:
        kh, kw = self.module.kernel_size
        return kh * kw

    @property
    def a_dim(self) -> int:
        in_per_group = self.module.in_channels // self.module.groups
        return in_per_group * self.kernel_numel + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_channels // self.module.groups

    def padded(self, inputs: torch.Tensor) -> torch.Tensor:
        """The input exactly as the convolution sees it, with padding applied explicitly."""
        if any(self._pads):
            return F.pad(inputs, self._pads, mode=self._pad_mode)
        return inputs

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        left, right, top, bottom = self._pads
        (kh, kw), (dh, dw), (sh, sw) = (
            self.module.kernel_size,
            self.module.dilation,
            self.module.stride,
        )
        oh = (height + top + bottom - dh * (kh - 1) - 1) // sh + 1
        ow = (width + left + right - dw * (kw - 1) - 1) // sw + 1
        return oh, ow

    def patch_view(self, inputs: torch.Tensor) -> torch.Tensor:
        """All patches as a strided view ``(in_channels, kh, kw, batch, out_h, out_w)``.

        The leading three dimensions are in the weight's layout, so reshaping gives the
        ``(in_channels * kh * kw, batch * positions)`` patch matrix with a single copy
        (``F.unfold`` plus a permute costs several times more on CPU).
        """
        oh, ow = self.output_size(inputs.shape[-2], inputs.shape[-1])
        x = self.padded(inputs).contiguous()
        batch, channels = x.shape[0], x.shape[1]
        (kh, kw), (dh, dw), (sh, sw) = (
            self.module.kernel_size,
            self.module.dilation,
            self.module.stride,
        )
        s_b, s_c, s_h, s_w = x.stride()
        return x.as_strided(
            (channels, kh, kw, batch, oh, ow),
            (s_c, dh * s_h, dw * s_w, s_b, sh * s_h, sw * s_w),
        )

    def position_sums(self, inputs: torch.Tensor) -> torch.Tensor:
        """Each sample's patch summed over the output positions, ``(batch, C, kh, kw)``:
        ``Σ_{p,q} x[c, i·dh + p·sh, j·dw + q·sw]`` of the padded input, one axis at a time
        (a sum over the patch view itself reads every patch element and is several times
        slower)."""
        x = self.padded(inputs)
        oh, ow = self.output_size(inputs.shape[-2], inputs.shape[-1])
        (kh, kw), (dh, dw), (sh, sw) = (
            self.module.kernel_size,
            self.module.dilation,
            self.module.stride,
        )
        if kh == kw == 1:  # the positions are a strided grid of the input: one reduction
            whole = (sh, sw, oh, ow) == (1, 1, x.shape[-2], x.shape[-1])
            grid = x if whole else x[..., : (oh - 1) * sh + 1 : sh, : (ow - 1) * sw + 1 : sw]
            return grid.sum(dim=(-2, -1), keepdim=True)
        # rows: for each kernel row offset i, the sum over the oh rows i·dh + p·sh
        rows = x.unfold(2, (oh - 1) * sh + 1, dh).narrow(2, 0, kh)
        rows = (rows[..., ::sh] if sh > 1 else rows).sum(-1)
        cols = rows.unfold(3, (ow - 1) * sw + 1, dw).narrow(3, 0, kw)
        return (cols[..., ::sw] if sw > 1 else cols).sum(-1)

    def examples(self, grad_output: torch.Tensor) -> int:
        """A convolution's loss averages over samples, not over output positions."""
        return int(grad_output.shape[0])

    def a_factor(
        self, inputs: torch.Tensor, fisher: bool = False, into: Accumulator | None = None
    ) -> torch.Tensor:
        k, batch = self.groups, inputs.shape[0]
        oh, ow = self.output_size(inputs.shape[-2], inputs.shape[-1])
        positions = oh * ow
        scale = 1.0 if fisher else 1.0 / positions
        if self.approx is KFACApprox.REDUCE:
            # each sample's patch averaged over positions (the sums, over P in the scale);
            # the bias's ones column averages to one as well, so it is ones times P here
            sums = self.position_sums(inputs).reshape(batch, k, -1).permute(1, 2, 0)
            if self.has_bias:
                ones = sums.new_full((k, 1, batch), float(positions))
                sums = torch.cat([sums, ones], dim=1)
            return _covariance_features_first(sums, scale / positions, batch, False, into)
        view = self.patch_view(inputs)  # (C, kh, kw, batch, oh, ow)
        rows = view.reshape(k, -1, batch * positions)
        return _covariance_features_first(rows, scale, batch * positions, self.has_bias, into)

    def g_factor(
        self,
        grad_output: torch.Tensor,
        fisher: bool = False,
        scale: float = 1.0,
        into: Accumulator | None = None,
    ) -> torch.Tensor:
        batch, channels, oh, ow = grad_output.shape
        k, positions = self.groups, oh * ow
        if self.approx is KFACApprox.REDUCE:
            # E_n[(Σ_p d)(Σ_p d)ᵀ] (fisher), or the position means' covariance over P²
            sums = grad_output.sum(dim=(-2, -1)).view(batch, k, -1).permute(1, 2, 0)
            alpha = scale if fisher else scale / positions**2
            return _covariance_features_first(sums, alpha, batch, False, into)
        # (batch, k, g, positions) -> (k, g, batch * positions): features first, one copy
        rows = grad_output.reshape(batch, k, channels // k, positions).permute(1, 2, 0, 3)
        rows = rows.reshape(k, channels // k, batch * positions)
        if fisher:  # P · E_{n,p}[d dᵀ] = Σ_{n,p} d dᵀ / batch
            return _covariance_features_first(rows, scale, batch, False, into)
        return _covariance_features_first(rows, scale / positions, batch * positions, False, into)

    def describe(self) -> str:
        m = self.module
        extra = f", groups={m.groups}" if m.groups > 1 else ""
        return f"Conv2d({m.in_channels}->{m.out_channels}, {m.kernel_size}{extra})"


__all__ = ["Conv2dHelper"]
