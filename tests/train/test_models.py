"""Tests for kaisa_train.models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kaisa_train.models import MLP, LeNetCNN


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_lenet_output_shape() -> None:
    model = LeNetCNN()
    out = model(torch.randn(5, 1, 28, 28))
    assert out.shape == (5, 10)
    assert out.dtype == torch.float32


def test_lenet_parameter_counts() -> None:
    model = LeNetCNN()
    assert n_params(model.conv1) == 1 * 8 * 25 + 8
    assert n_params(model.conv2) == 8 * 16 * 25 + 16
    assert n_params(model.fc1) == 784 * 128 + 128
    assert n_params(model.fc2) == 128 * 10 + 10
    expected = (1 * 8 * 25 + 8) + (8 * 16 * 25 + 16) + (784 * 128 + 128) + (128 * 10 + 10)
    assert n_params(model) == expected


def test_lenet_layer_configuration() -> None:
    model = LeNetCNN()
    for conv in (model.conv1, model.conv2):
        assert conv.kernel_size == (5, 5)
        assert conv.padding == (2, 2)
    assert (model.conv1.in_channels, model.conv1.out_channels) == (1, 8)
    assert (model.conv2.in_channels, model.conv2.out_channels) == (8, 16)
    assert (model.fc1.in_features, model.fc1.out_features) == (784, 128)
    assert (model.fc2.in_features, model.fc2.out_features) == (128, 10)


def test_lenet_backward_reaches_every_parameter() -> None:
    model = LeNetCNN()
    model(torch.randn(3, 1, 28, 28)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    ("hidden", "expected"),
    [((128,), 784 * 128 + 128 + 128 * 10 + 10), ((), 784 * 10 + 10), ((32, 16), None)],
)
def test_mlp_shapes_and_counts(hidden: tuple[int, ...], expected: int | None) -> None:
    model = MLP(hidden=hidden)
    assert model(torch.randn(4, 1, 28, 28)).shape == (4, 10)
    if expected is not None:
        assert n_params(model) == expected
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == len(hidden) + 1


def test_mlp_custom_sizes() -> None:
    model = MLP(in_features=12, hidden=(8,), num_classes=3)
    assert model(torch.randn(2, 3, 4)).shape == (2, 3)


def test_resnet20_shapes_parameters_and_kfac_registration() -> None:
    from kaisa_ray import KFACPreconditioner
    from kaisa_train.models import ResNet20

    model = ResNet20(in_channels=1)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert ResNet20()(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    # 19 convolutions + 1 linear layer: the 20 of ResNet-20; about 0.27M parameters
    preconditioner = KFACPreconditioner(ResNet20())
    assert len(preconditioner.layers) == 20
    assert 260_000 < sum(p.numel() for p in ResNet20().parameters()) < 280_000
