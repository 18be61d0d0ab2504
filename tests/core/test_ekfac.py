"""EKFAC (``scaling='ekfac'``): the fitted diagonal equals its definition from per-example
gradients computed by autograd in float64; with the diagonal set to the eigenvalue products
the whole step is the eigen method's; memory and bytes are the plan's; checkpoints resume
bit for bit; placements that cannot hold it are refused with the fix.
(2 and 4 gloo ranks against one process: ``test_distributed.py``'s EKFAC combinations.)"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.models import small_cnn
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.conv_layers import Conv2dHelper
from kaisa_ray.eigenbasis import EKFACEigenbasis
from kaisa_ray.ekfac import fitted_diagonal
from kaisa_ray.enums import KFACApprox
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.layers import LinearHelper
from kaisa_ray.plan import plan
from kaisa_train.footprint import footprint
from kaisa_train.planning import PlanRequest, plan_job
from kaisa_train.records import Record
from kaisa_train.session import LocalSession
from kaisa_train.spec import KFACSpec, parse_job_spec
from kaisa_train.training import Training
from kaisa_train.worker import train
from kaisa_train.worker_config import TrainConfig

N = 6


def _orthogonal(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(k, n, n, generator=generator, dtype=torch.float64))
    return q


def _per_example_grads(module: nn.Module, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """``∇_W ℓ_i`` of each example's own loss (weight, bias as the last column), ``(N, k, g,
    a)``, by autograd one example at a time: the definition, independent of the hooks."""
    grads = []
    for i in range(x.shape[0]):
        module.zero_grad()
        out = module(x[i : i + 1])
        (out * head[i : i + 1]).sum().backward()
        weight = module.weight.grad
        assert weight is not None
        k = getattr(module, "groups", 1)
        g = weight.shape[0] // k
        columns = [weight.reshape(k, g, -1)]
        if module.bias is not None:
            assert module.bias.grad is not None
            columns.append(module.bias.grad.reshape(k, g, 1))
        grads.append(torch.cat(columns, dim=-1))
    return torch.stack(grads)


CASES: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "linear": lambda: (nn.Linear(5, 4), torch.randn(N, 5)),
    "linear-no-bias": lambda: (nn.Linear(5, 3, bias=False), torch.randn(N, 5)),
    "conv": lambda: (nn.Conv2d(2, 3, 3, padding=1, stride=2), torch.randn(N, 2, 5, 5)),
    "conv-groups": lambda: (nn.Conv2d(4, 6, 2, groups=2, bias=False), torch.randn(N, 4, 4, 4)),
    "conv-reduce": lambda: (nn.Conv2d(2, 3, 3, dilation=2), torch.randn(N, 2, 6, 6)),
}


@pytest.mark.parametrize("fisher", [False, True], ids=["reference", "fisher"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_fitted_diagonal_is_the_projected_per_example_second_moment(
    case: str, fisher: bool
) -> None:
    """Float64, random orthogonal bases: the batch's diagonal equals ``mean_i (Q_Gᵀ J_i
    Q_A)² / c`` with ``J_i`` example i's gradient from autograd in the factors' units (the
    mean loss's share ``∇ℓ_i / N`` times the rows' scales; ``ekfac.py`` says which)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    module, x = CASES[case]()
    module, x = module.double(), x.double()
    reduce = case == "conv-reduce"
    helper: Any = LinearHelper(module) if isinstance(module, nn.Linear) else Conv2dHelper(module)
    if reduce:
        helper.approx = type(helper.approx)("reduce")
    k, a, g = helper.groups, helper.a_dim, helper.g_dim
    qa, qg = _orthogonal(a, k, generator), _orthogonal(g, k, generator)
    out = module(x)
    head = torch.randn(out.shape, dtype=torch.float64)
    # the hooks' view: the input, and the output gradient of the batch's mean loss
    inputs = x.detach()
    grad_output = head / N
    scale = float(N) if fisher else 1.0  # KFACLayer.add_grad_output at one rank, no scaler
    got = fitted_diagonal(helper, inputs, grad_output, qa, qg, fisher=fisher, scale=scale)

    if reduce:  # the reduce approximation's example: position sums of patches and gradients
        patches = F.unfold(F.pad(x, (0, 0, 0, 0)), 3, dilation=2)  # (N, a - 1, P)
        positions = patches.shape[-1]
        mean_patch = torch.cat([patches.sum(-1), torch.full((N, 1), float(positions))], 1)
        mean_patch = mean_patch.double() * ((1.0 if fisher else 1.0 / positions) / positions)
        g_alpha = scale if fisher else scale / positions**2
        d = grad_output.sum(dim=(-2, -1)) * g_alpha
        per_example = (d[:, :, None] * mean_patch[:, None, :]).unsqueeze(1)  # (N, 1, g, a)
        divisor = 1.0
    else:
        share = _per_example_grads(module, x, head) / N  # ∇ℓ_i / N in the layer's units
        positions = 1 if isinstance(module, nn.Linear) else out.shape[-2] * out.shape[-1]
        per_position = 1.0 if fisher else 1.0 / positions
        per_example = share * scale * per_position * per_position  # g rows' and a rows' scales
        divisor = 1.0 if fisher else float(positions)
    rotated = qg.transpose(-1, -2) @ per_example @ qa
    expected = rotated.square().mean(dim=0) / divisor
    assert got.shape == (k, g, a)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("fisher", [False, True], ids=["reference", "fisher"])
def test_on_reduced_tokens_the_diagonal_takes_a_sequence_as_the_example(fisher: bool) -> None:
    """``sequence_approx='reduce'``: the example is a sequence, its gradient the outer product
    of its summed output gradient and its mean input, and the diagonal their rotated squares'
    mean over the sequences (one row an example: ``c = 1``)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    module = nn.Linear(5, 4).double()
    tokens = 7
    x = torch.randn(N, tokens, 5, dtype=torch.float64)
    helper = LinearHelper(module, KFACApprox.REDUCE)
    qa, qg = _orthogonal(helper.a_dim, 1, generator), _orthogonal(helper.g_dim, 1, generator)
    grad_output = torch.randn(N, tokens, 4, dtype=torch.float64) / (N * tokens)
    scale = float(N * tokens) if fisher else 1.0
    got = fitted_diagonal(helper, x, grad_output, qa, qg, fisher=fisher, scale=scale)

    mean_input = torch.cat([x.mean(dim=1), torch.ones(N, 1, dtype=torch.float64)], dim=1)
    summed = grad_output.sum(dim=1) * scale
    per_example = (summed[:, :, None] * mean_input[:, None, :]).unsqueeze(1)  # (N, 1, g, a)
    rotated = qg.transpose(-1, -2) @ per_example @ qa
    expected = rotated.square().mean(dim=0)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


def _model() -> nn.Module:
    return small_cnn(classes=4)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 1, 8, 8, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 4, (16,), generator=generator)


def _train(
    model: nn.Module, preconditioner: KFACPreconditioner, steps: range
) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in steps:
        x, y = _batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
        optimizer.step()
    return optimizer


OPTIONS: dict[str, Any] = {
    "factor_update_steps": 1,
    "inv_update_steps": 3,
    "damping": 0.01,
    "kl_clip": 0.01,
    "lr": 0.1,
}


def _products(d: EKFACEigenbasis) -> torch.Tensor:
    assert d.dg is not None
    assert d.da is not None
    return d.dg.unsqueeze(-1) * d.da.unsqueeze(-2)


@pytest.mark.parametrize("outer_product", [False, True])
def test_with_the_diagonal_set_to_the_eigenvalue_products_it_is_the_eigen_method(
    monkeypatch: pytest.MonkeyPatch, outer_product: bool
) -> None:
    """Every fit and every new basis set the diagonal to ``λ_G λ_Aᵀ`` instead: the whole
    trajectory (hooks, batched groups, KL clip) is the eigen method's."""

    def as_products(self: EKFACEigenbasis, *args: Any) -> None:
        self._rotations()
        self._keep("s", _products(self))

    monkeypatch.setattr(EKFACEigenbasis, "fold", as_products)
    monkeypatch.setattr(EKFACEigenbasis, "finish", as_products)
    eigen_model, ekfac_model = _model(), _model()
    eigen = KFACPreconditioner(
        eigen_model, compute_eigenvalue_outer_product=outer_product, **OPTIONS
    )
    ekfac = KFACPreconditioner(ekfac_model, scaling="ekfac", **OPTIONS)
    _train(eigen_model, eigen, range(8))
    _train(ekfac_model, ekfac, range(8))
    for a, b in zip(eigen_model.parameters(), ekfac_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_diagonal_starts_as_the_products_then_takes_the_fits() -> None:
    """After the first decomposition the diagonal is ``λ_G λ_Aᵀ``; a factor update folds the
    batch's fit in with the factors' decay (so the step is no longer the eigen method's)."""
    model = _model()
    preconditioner = KFACPreconditioner(model, scaling="ekfac", **OPTIONS)
    _train(model, preconditioner, range(1))
    decompositions = [layer.decomposition for layer in preconditioner.layers]
    diagonals = []
    for d in decompositions:
        assert isinstance(d, EKFACEigenbasis)
        assert d.s is not None
        torch.testing.assert_close(d.s, _products(d))
        diagonals.append((d, d.s.clone()))
    _train(model, preconditioner, range(1, 2))
    for d, old in diagonals:
        assert d.s is not None
        assert not torch.allclose(d.s, old), f"{d.name}: the fit did not move the diagonal"
        assert (d.s >= 0).all()


def test_memory_equals_the_plan_and_the_checkpoint_resumes_bit_for_bit() -> None:
    model = _model()
    preconditioner = KFACPreconditioner(model, scaling="ekfac", **OPTIONS)
    optimizer = _train(model, preconditioner, range(5))
    planned = plan(model, 1, scaling="ekfac", compute_eigenvalue_outer_product=True)
    assert preconditioner.memory_usage() == planned.ranks[0].memory
    assert preconditioner.memory_usage() == preconditioner.plan.ranks[0].memory
    # a checkpoint between two basis refreshes (steps 3 and 6), loaded by fresh objects
    state = copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "kfac": preconditioner.state_dict(),
        }
    )
    assert all("s" in layer["decomposition"] for layer in state["kfac"]["layers"].values())
    uninterrupted = copy.deepcopy(model)
    twin = KFACPreconditioner(uninterrupted, scaling="ekfac", **OPTIONS)
    twin.load_state_dict(state["kfac"])
    continued = torch.optim.SGD(uninterrupted.parameters(), lr=0.1, momentum=0.9)
    continued.load_state_dict(state["optimizer"])
    for step in range(5, 10):
        for m, p, o in ((model, preconditioner, optimizer), (uninterrupted, twin, continued)):
            x, y = _batch(step)
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            p.step()
            o.step()
    for a, b in zip(model.parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_factor_all_reduce_carries_the_diagonal_in_the_plan() -> None:
    """At 4 ranks under COMM-OPT each layer's factor pieces are A, G and the diagonal."""
    model = _model()
    kronecker = plan(model, 4)
    ekfac = plan(model, 4, scaling="ekfac")
    extra = sum(
        layer.groups * layer.g_dim * layer.a_dim * 8 for layer in ekfac.layers
    )  # float64 factors
    sent = ekfac.ranks[0].bytes("factor_update") - kronecker.ranks[0].bytes("factor_update")
    assert sent == extra
    pieces = {(p.layer, p.part) for b in ekfac.schedule.factor_buckets for p in b.pieces}
    assert {part for _, part in pieces} == {"a", "g", "s"}


@pytest.mark.parametrize("strategy", ["mem-opt", "hybrid-opt", 0.25])
def test_a_placement_without_the_bases_on_every_rank_is_refused_with_the_fix(
    strategy: str | float,
) -> None:
    with pytest.raises(ConfigurationError, match=r"every rank must hold them.*comm-opt"):
        plan(_model(), 4, strategy, scaling="ekfac")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"compute_method": "inverse"}, r"scaling='ekfac' keeps its diagonal.*compute_method"),
        ({"pi_damping": True}, r"pi_damping=False"),
    ],
)
def test_options_it_cannot_use_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        KFACPreconditioner(_model(), scaling="ekfac", **options)


JOB: dict[str, Any] = {
    "name": "ekfac",
    "model": {"name": "lenet"},
    "dataset": {"name": "synthetic", "batch_size": 32, "limit": 256},
    "optimizer": {"name": "sgd", "lr": 0.05},
    "kfac": {"scaling": "ekfac", "compute_method": "eigen", "factor_update_steps": 1},
    "stop": {"max_steps": 12},
    "eval_every": 12,
}


def test_the_job_spec_option_and_its_errors() -> None:
    spec = parse_job_spec(JOB)
    assert isinstance(spec.kfac, KFACSpec)
    assert spec.kfac.curvature()["scaling"] == "ekfac"
    kfac = JOB["kfac"]
    with pytest.raises(ValueError, match=r"its diagonal.*set compute_method: eigen"):
        parse_job_spec({**JOB, "kfac": {**kfac, "compute_method": "inverse"}})
    with pytest.raises(ValueError, match="set pi_damping: false"):
        parse_job_spec({**JOB, "kfac": {**kfac, "pi_damping": True}})
    two = {**JOB, "scaling": {"workers": 2}}
    parse_job_spec({**two, "kfac": {**kfac, "strategy": "comm-opt"}})
    with pytest.raises(ValueError, match=r"keeps them on 1 of 2: set kfac.strategy: comm-opt"):
        parse_job_spec({**two, "kfac": {**kfac, "strategy": "mem-opt"}})


def test_a_job_trains_with_it_and_its_forecast_holds_the_diagonal() -> None:
    """The worker's own loop (no Ray) runs the job to its last step; its preconditioner
    holds the diagonal, and the planner's footprint counts it and its batch buffer in place
    of the eigenvalue table."""
    records: list[Record] = []
    spec = parse_job_spec(JOB)
    train(TrainConfig(spec=spec, run="ekfac"), LocalSession(records.append))
    assert records[-1].kind == "end"
    assert max(getattr(r, "step", 0) for r in records) == 12
    training = Training.build(spec, rank=0, world=1, device=torch.device("cpu"))
    assert training.preconditioner is not None
    assert str(training.preconditioner.scaling) == "ekfac"
    ekfac = footprint("lenet", batch_size=32, compute_method="eigen", scaling="ekfac")
    kron = footprint("lenet", batch_size=32, compute_method="eigen")
    batch_diagonals = sum(
        4 * layer.helper.groups * layer.helper.g_dim * layer.helper.a_dim
        for layer in training.preconditioner.layers
    )  # the diagonal replaces the table (same size); its batch buffer is new
    assert ekfac.worker_bytes - kron.worker_bytes == batch_diagonals


def test_the_planner_prices_only_comm_opt_for_it() -> None:
    """``kaisa-ray plan`` (and ``kfac: auto``'s candidates) offer EKFAC only where it can be
    placed; Kronecker's plan of the same job offers every fraction."""
    request = PlanRequest(
        model="resnet50", batch_size=32, workers=8, hardware="a100-80gb-hdr", scaling="ekfac"
    )
    strategies = {row["strategy"] for row in plan_job(request).to_json()["strategies"]}
    assert strategies == {"COMM-OPT"}
    kronecker = dataclasses.replace(request, scaling="kronecker")
    assert len({row["strategy"] for row in plan_job(kronecker).to_json()["strategies"]}) == 4
