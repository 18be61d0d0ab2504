"""K-FAC's math against dense, independently built references, in float64.

Factors are rebuilt here from the layer's input and the gradient w.r.t. its output (captured
with ``retain_grad``, not through the preconditioner's hooks), with patches from an explicit
``F.pad`` + ``F.unfold`` using PyTorch's own padding arithmetic. The preconditioned gradient
is compared to the dense solve of ``(G ⊗ A + γI) x = vec(∇W)`` built with ``torch.kron``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner

DAMPING = 0.03


@pytest.fixture(autouse=True)
def _float64_default() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@dataclass
class Reference:
    a: torch.Tensor  # (k, a_dim, a_dim)
    g: torch.Tensor  # (k, g_dim, g_dim)
    grad: torch.Tensor  # (k, g_dim, a_dim)


def _conv_padding(conv: nn.Conv2d) -> tuple[int, int, int, int]:
    """F.pad order (left, right, top, bottom), from PyTorch's own computation."""
    if conv.padding == "same" or conv.padding_mode != "zeros":
        pads = conv._reversed_padding_repeated_twice
        return (pads[0], pads[1], pads[2], pads[3])
    if conv.padding == "valid":
        return (0, 0, 0, 0)
    ph, pw = conv.padding  # type: ignore[misc]
    return (pw, pw, ph, ph)


def reference_for(layer: nn.Module, x: torch.Tensor, reduce: bool = False) -> Reference:
    """Run forward/backward outside K-FAC and build the factors the reference way."""
    layer.zero_grad()
    out = layer(x)
    out.retain_grad()
    torch.manual_seed(123)
    target = torch.randn_like(out)
    ((out - target) ** 2).mean().backward()
    gout = out.grad
    assert gout is not None
    weight_grad = layer.weight.grad
    assert weight_grad is not None
    has_bias = layer.bias is not None
    if isinstance(layer, nn.Linear):
        rows_a = x.reshape(-1, x.shape[-1])
        if has_bias:
            rows_a = torch.cat([rows_a, torch.ones(rows_a.shape[0], 1)], 1)
        rows_g = gout.reshape(-1, gout.shape[-1])
        grad = weight_grad
        if has_bias:
            grad = torch.cat([grad, layer.bias.grad[:, None]], 1)
        n = rows_a.shape[0]
        return Reference((rows_a.T @ rows_a / n)[None], (rows_g.T @ rows_g / n)[None], grad[None])
    assert isinstance(layer, nn.Conv2d)
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    xp = F.pad(x, _conv_padding(layer), mode=mode)
    patches = F.unfold(xp, layer.kernel_size, dilation=layer.dilation, stride=layer.stride)
    batch, _, positions = patches.shape
    k = layer.groups
    cin_g, cout_g = layer.in_channels // k, layer.out_channels // k
    d = cin_g * layer.kernel_size[0] * layer.kernel_size[1]
    g_rows_all = gout.reshape(batch, layer.out_channels, positions)
    a_list, g_list, grad_list = [], [], []
    for group in range(k):
        p = patches[:, group * d : (group + 1) * d, :]  # (B, d, L)
        gg = g_rows_all[:, group * cout_g : (group + 1) * cout_g, :]  # (B, cout_g, L)
        # Sanity check of this very construction: Σ_rows g pᵀ is the weight gradient.
        wg = torch.einsum("bol,bdl->od", gg, p)
        torch.testing.assert_close(
            wg, weight_grad[group * cout_g : (group + 1) * cout_g].reshape(cout_g, d)
        )
        if reduce:
            rows_a = p.mean(-1)  # (B, d)
            rows_g = gg.mean(-1)  # (B, cout_g)
        else:
            rows_a = p.permute(0, 2, 1).reshape(batch * positions, d)
            rows_g = gg.permute(0, 2, 1).reshape(batch * positions, cout_g)
        if has_bias:
            rows_a = torch.cat([rows_a, torch.ones(rows_a.shape[0], 1)], 1)
        rows_a, rows_g = rows_a / positions, rows_g / positions
        n = rows_a.shape[0]
        a_list.append(rows_a.T @ rows_a / n)
        g_list.append(rows_g.T @ rows_g / n)
        grad = weight_grad[group * cout_g : (group + 1) * cout_g].reshape(cout_g, d)
        if has_bias:
            grad = torch.cat(
                [grad, layer.bias.grad[group * cout_g : (group + 1) * cout_g, None]], 1
            )
        grad_list.append(grad)
    return Reference(torch.stack(a_list), torch.stack(g_list), torch.stack(grad_list))


def kfac_step(layer: nn.Module, x: torch.Tensor, **kwargs: object) -> KFACPreconditioner:
    """One K-FAC step with decay 0 (so running factors equal batch factors), no clipping."""
    options: dict[str, object] = {
        "factor_decay": 0.0,
        "damping": DAMPING,
        "kl_clip": None,
        "factor_dtype": torch.float64,
        "inv_dtype": torch.float64,
    }
    options.update(kwargs)
    preconditioner = KFACPreconditioner(layer, **options)  # type: ignore[arg-type]
    layer.zero_grad()
    out = layer(x)
    torch.manual_seed(123)
    target = torch.randn_like(out)
    ((out - target) ** 2).mean().backward()
    preconditioner.step()
    return preconditioner


def assert_factors_and_step(
    preconditioner: KFACPreconditioner, layer: nn.Module, ref: Reference
) -> None:
    """The one layer's factors are ``ref``'s, and its gradient now the dense solve with them."""
    (kfac_layer,) = preconditioner.layers
    torch.testing.assert_close(kfac_layer.a_factor, ref.a, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kfac_layer.g_factor, ref.g, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        current_grad(layer), dense_eigen_solution(ref, DAMPING), rtol=1e-10, atol=1e-10
    )


def current_grad(layer: nn.Module) -> torch.Tensor:
    """The layer's gradient now, as (k, g_dim, a_dim)."""
    k = getattr(layer, "groups", 1)
    out_channels = layer.weight.shape[0]
    grad = layer.weight.grad.reshape(k, out_channels // k, -1)
    if layer.bias is not None:
        grad = torch.cat([grad, layer.bias.grad.reshape(k, out_channels // k, 1)], -1)
    return grad


def dense_eigen_solution(ref: Reference, damping: float) -> torch.Tensor:
    blocks = []
    for a, g, grad in zip(ref.a, ref.g, ref.grad, strict=True):
        matrix = torch.kron(g, a) + damping * torch.eye(g.shape[0] * a.shape[0])
        blocks.append(torch.linalg.solve(matrix, grad.reshape(-1)).reshape(grad.shape))
    return torch.stack(blocks)


def dense_inverse_solution(ref: Reference, damping: float) -> torch.Tensor:
    blocks = []
    for a, g, grad in zip(ref.a, ref.g, ref.grad, strict=True):
        g_inv = torch.linalg.inv(g + damping * torch.eye(g.shape[0]))
        a_inv = torch.linalg.inv(a + damping * torch.eye(a.shape[0]))
        blocks.append(g_inv @ grad @ a_inv)
    return torch.stack(blocks)


def _linear(bias: bool) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(7, 5, bias=bias), torch.randn(11, 7)


def _linear_3d() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(6, 4), torch.randn(3, 5, 6)  # sequence dims become rows


CONVS: dict[str, dict[str, object]] = {
    "plain": {},
    "no_bias": {"bias": False},
    "stride2_pad1": {"stride": 2, "padding": 1},
    "dilation2": {"dilation": 2, "padding": 2},
    "tuple_padding": {"padding": (1, 2), "stride": (2, 1)},
    "same_even_kernel": {"padding": "same", "kernel_size": 4},
    "same_dilated": {"padding": "same", "dilation": (2, 1)},
    "valid": {"padding": "valid", "stride": 2},
    "reflect": {"padding": 1, "padding_mode": "reflect"},
    "replicate": {"padding": 2, "padding_mode": "replicate", "stride": 2},
    "circular": {"padding": 1, "padding_mode": "circular", "dilation": 2},
    "groups2": {"groups": 2, "padding": 1},
    "depthwise": {"groups": 4, "padding": 1, "out_channels": 8},
    # 1x1 kernels: their position sums take one reduction over the (strided) grid
    "pointwise": {"kernel_size": 1, "bias": False},
    "pointwise_stride2": {"kernel_size": 1, "stride": 2},
    "pointwise_padded": {"kernel_size": 1, "padding": 1, "stride": (2, 3)},
}


def _conv(case: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    options: dict[str, object] = {"in_channels": 4, "out_channels": 6, "kernel_size": 3}
    options.update(CONVS[case])
    return nn.Conv2d(**options), torch.randn(3, 4, 9, 8)  # type: ignore[arg-type]


LAYERS = {
    "linear_bias": lambda: _linear(True),
    "linear_no_bias": lambda: _linear(False),
    "linear_3d_input": _linear_3d,
    **{f"conv_{case}": (lambda c=case: _conv(c)) for case in CONVS},
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_factors_match_independent_construction(name: str) -> None:
    layer, x = LAYERS[name]()
    ref = reference_for(layer, x)
    preconditioner = kfac_step(layer, x)
    (kfac_layer,) = preconditioner.layers
    torch.testing.assert_close(kfac_layer.a_factor, ref.a, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kfac_layer.g_factor, ref.g, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("outer_product", [True, False])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_eigen_method_equals_dense_kronecker_solve(name: str, outer_product: bool) -> None:
    layer, x = LAYERS[name]()
    ref = reference_for(layer, x)
    kfac_step(layer, x, compute_method="eigen", compute_eigenvalue_outer_product=outer_product)
    expected = dense_eigen_solution(ref, DAMPING)
    torch.testing.assert_close(current_grad(layer), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_inverse_method_equals_dense_formula(name: str) -> None:
    layer, x = LAYERS[name]()
    ref = reference_for(layer, x)
    kfac_step(layer, x, compute_method="inverse")
    expected = dense_inverse_solution(ref, DAMPING)
    torch.testing.assert_close(current_grad(layer), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "no_bias",
        "stride2_pad1",
        "same_even_kernel",
        "circular",
        "groups2",
        "depthwise",
        "dilation2",
        "pointwise",
        "pointwise_stride2",
        "pointwise_padded",
    ],
)
def test_conv_reduce_factors_match_position_means(case: str) -> None:
    layer, x = _conv(case)
    ref = reference_for(layer, x, reduce=True)
    assert_factors_and_step(kfac_step(layer, x, kfac_approx="reduce"), layer, ref)


def test_reduce_equals_expand_when_positions_are_identical() -> None:
    """The reduce factors are scaled so that constant feature maps give the expand factors."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 1, 1).expand(5, 3, 6, 6).contiguous()
    conv_a = nn.Conv2d(3, 4, 1)
    conv_b = nn.Conv2d(3, 4, 1)
    conv_b.load_state_dict(conv_a.state_dict())
    expand = kfac_step(conv_a, x, kfac_approx="expand").layers[0]
    reduce = kfac_step(conv_b, x, kfac_approx="reduce").layers[0]
    torch.testing.assert_close(expand.a_factor, reduce.a_factor, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("factor_scale", ["reference", "fisher"])
def test_sequence_reduce_factors_are_each_sequences_mean_input_and_summed_gradient(
    bias: bool, factor_scale: str
) -> None:
    """``sequence_approx='reduce'`` on a Linear layer over ``(N, T, d)`` tokens: A from each
    sequence's mean input, G from its output gradients summed over the tokens, both means over
    the N sequences; the step is the dense solve with those factors."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 3, bias=bias).double()
    x = torch.randn(4, 7, 5, dtype=torch.float64)
    expected = nn.Linear(5, 3, bias=bias).double()
    expected.load_state_dict(layer.state_dict())
    out = expected(x)
    torch.manual_seed(123)
    target = torch.randn_like(out)
    ((out - target) ** 2).mean().backward()
    grad_output = 2 * (out - target).detach() / out.numel()
    if factor_scale == "fisher":  # per-token gradients: the loss is a mean over the tokens
        grad_output = grad_output * 4 * 7
    means = x.mean(dim=1)
    if bias:
        means = torch.cat([means, torch.ones(4, 1, dtype=torch.float64)], dim=1)
    sums = grad_output.sum(dim=1)
    ref = Reference(
        a=(means.t() @ means / 4)[None],
        g=(sums.t() @ sums / 4)[None],
        grad=current_grad(expected),
    )

    preconditioner = kfac_step(layer, x, sequence_approx="reduce", factor_scale=factor_scale)
    assert_factors_and_step(preconditioner, layer, ref)


def test_sequence_reduce_changes_nothing_on_two_dimensional_inputs_and_convolutions() -> None:
    """Rows that are already one per example (an MLP's) and a CNN's Linear head give the
    same factors and step under either ``sequence_approx``; on tokens the two differ."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).double()
    twin = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).double()
    twin.load_state_dict(net.state_dict())
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    expand = kfac_step(net, x, kfac_approx="reduce")
    reduce = kfac_step(twin, x, kfac_approx="reduce", sequence_approx="reduce")
    for a, b in zip(expand.layers, reduce.layers, strict=True):
        torch.testing.assert_close(a.a_factor, b.a_factor, rtol=0, atol=0)
        torch.testing.assert_close(a.g_factor, b.g_factor, rtol=0, atol=0)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)

    tokens = torch.randn(4, 6, 5, dtype=torch.float64)
    layers = [nn.Linear(5, 3).double() for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    expand_l = kfac_step(layers[0], tokens).layers[0]
    reduce_l = kfac_step(layers[1], tokens, sequence_approx="reduce").layers[0]
    assert not torch.allclose(expand_l.a_factor, reduce_l.a_factor)


def test_inplace_activation_after_layer_gives_the_same_g_factor() -> None:
    def build(inplace: bool) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(2, 3, 3), nn.ReLU(inplace=inplace), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)
        )

    torch.manual_seed(1)
    x = torch.randn(4, 2, 6, 6)
    factors = []
    for inplace in (False, True):
        model = build(inplace)
        preconditioner = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None)
        model(x).square().sum().backward()
        preconditioner.step()
        factors.append([layer.g_factor for layer in preconditioner.layers])
    for plain, inplace_factor in zip(*factors, strict=True):
        torch.testing.assert_close(plain, inplace_factor, rtol=0, atol=0)
