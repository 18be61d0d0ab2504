"""Adam's moments in K-FAC's eigenbasis (``scaling='adam-eigenbasis'``), against its definition
computed densely in float64, and what it holds."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.models import repeated_shapes
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.plan import plan
from kaisa_train.footprint import footprint
from kaisa_train.optimizers import EigenbasisAdam, build_optimizer
from kaisa_train.records import Record
from kaisa_train.session import LocalSession
from kaisa_train.spec import KFACSpec, OptimizerSpec, parse_job_spec
from kaisa_train.training import Training
from kaisa_train.worker import train
from kaisa_train.worker_config import TrainConfig

BETAS = (0.9, 0.95)
EPS = 1e-8


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(count):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 2, 6, 6, generator=g, dtype=torch.float64)
        out.append((x, torch.randint(0, 5, (16,), generator=g)))
    return out


def full_grad(module: nn.Module, grads: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A layer's gradient as ``(k, g, a)``: the weight's rows, the bias as the last column."""
    weight = grads[f"{name}.weight"]
    k = getattr(module, "groups", 1)
    rows = weight.reshape(k, weight.shape[0] // k, -1)
    if f"{name}.bias" in grads:
        rows = torch.cat([rows, grads[f"{name}.bias"].reshape(k, -1, 1)], dim=-1)
    return rows


class DenseAdam:
    """The definition, one layer at a time in float64: the rotated gradient
    ``R = Q_Gᵀ ∇W Q_A``, Adam's moments of R (m rotated into each new basis as
    ``Q_G'ᵀ Q_G m Q_Aᵀ Q_A'``, v spread over the new coordinates elementwise), bias-corrected,
    and ``Q_G [m̂ / (√v̂ + ε)] Q_Aᵀ``."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, Any]] = {}

    def direction(
        self, name: str, grad: torch.Tensor, qa: torch.Tensor, qg: torch.Tensor
    ) -> torch.Tensor:
        state = self.state.setdefault(
            name, {"m": torch.zeros_like(grad), "v": torch.zeros_like(grad), "t": 0}
        )
        if "qa" in state and not (torch.equal(state["qa"], qa) and torch.equal(state["qg"], qg)):
            # m through the parameters' coordinates; v, coordinate by coordinate, as the
            # variance of a sum of independent old coordinates
            unrotated = state["qg"] @ state["m"] @ state["qa"].transpose(-1, -2)
            state["m"] = qg.transpose(-1, -2) @ unrotated @ qa
            v = torch.zeros_like(state["v"])
            for k in range(v.shape[0]):
                r_g = state["qg"][k].T @ qg[k]  # old coordinate i's share of new one j
                r_a = state["qa"][k].T @ qa[k]
                for i in range(v.shape[1]):
                    for j in range(v.shape[2]):
                        v[k, i, j] = (
                            r_g[:, i, None] ** 2 * state["v"][k] * r_a[None, :, j] ** 2
                        ).sum()
            state["v"] = v
        state["qa"], state["qg"] = qa.clone(), qg.clone()
        rotated = qg.transpose(-1, -2) @ grad @ qa
        state["m"] = BETAS[0] * state["m"] + (1 - BETAS[0]) * rotated
        state["v"] = BETAS[1] * state["v"] + (1 - BETAS[1]) * rotated**2
        state["t"] += 1
        t = state["t"]
        m_hat = state["m"] / (1 - BETAS[0] ** t)
        v_hat = state["v"] / (1 - BETAS[1] ** t)
        return qg @ (m_hat / (v_hat.sqrt() + EPS)) @ qa.transpose(-1, -2)


def test_each_step_is_adam_in_the_eigenbasis_as_defined_in_float64() -> None:
    """Seven steps with decompositions every third (two refreshes that rotate m), layers of
    shared shapes (the batched path, which updates the moments in the group's storage) and
    lone ones (the layer-by-layer path): every preconditioned gradient equals the dense
    definition's."""
    model = repeated_shapes().double()
    modules = dict(model.named_modules())
    preconditioner = KFACPreconditioner(
        model,
        compute_method="eigen",
        scaling="adam-eigenbasis",
        factor_update_steps=1,
        inv_update_steps=3,
        damping=0.01,
        kl_clip=None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dense = DenseAdam()
    batched = []
    for x, y in batches(7):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        groups = preconditioner._preconditioning.groups
        batched.append(sum(len(g.layers) for g in groups if g.ready()))
        preconditioner.step()
        for layer in preconditioner.layers:
            d = layer.decomposition
            assert d.qa is not None
            assert d.qg is not None
            want = dense.direction(
                layer.name, full_grad(modules[layer.name], raw, layer.name), d.qa, d.qg
            )
            module = modules[layer.name]
            got = full_grad(
                module,
                {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                layer.name,
            )
            # Relative to the whole direction: a coordinate whose moments are both near
            # zero has a ratio m̂/√v̂ sensitive to the products' rounding.
            error = float((got - want).norm() / want.norm())
            assert error < 1e-9, (layer.name, error)
        optimizer.step()
    # The first step's moments start one layer at a time; from then on every layer goes
    # through its shape's group
    assert batched == [0] + [len(preconditioner.layers)] * 6


def test_it_refuses_the_inverse_method_and_bad_betas_naming_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="Pass compute_method='eigen'"):
        KFACPreconditioner(repeated_shapes(), compute_method="inverse", scaling="adam-eigenbasis")
    with pytest.raises(ConfigurationError, match=r"adam_betas=\(0.9, 1.0\) must be two decays"):
        KFACPreconditioner(repeated_shapes(), scaling="adam-eigenbasis", adam_betas=(0.9, 1.0))
    with pytest.raises(ConfigurationError, match="scaling='adam' is not valid"):
        KFACPreconditioner(repeated_shapes(), scaling="adam")


@pytest.mark.parametrize("strategy", ["comm-opt", "mem-opt"])
def test_the_plan_counts_the_moments_exactly(strategy: str) -> None:
    """m, v and their count are held with the decompositions: what ``plan()`` says a rank
    holds is what the preconditioner holds after training, and the moments are two
    gradients' worth more than the eigen method's bases without a table."""
    model = repeated_shapes()
    preconditioner = KFACPreconditioner(
        model, compute_method="eigen", scaling="adam-eigenbasis", grad_worker_fraction=strategy
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x.float()), y).backward()
        preconditioner.step()
        optimizer.step()
    held = preconditioner.memory_usage()
    planned = plan(model, 1, strategy, compute_method="eigen", scaling="adam-eigenbasis")
    assert planned.ranks[0].memory == held
    bases = plan(model, 1, strategy, compute_method="eigen", compute_eigenvalue_outer_product=False)
    extra = sum(
        4
        * (2 * layer.helper.groups * layer.helper.g_dim * layer.helper.a_dim + layer.helper.groups)
        for layer in preconditioner.layers
    )
    assert held["decompositions"] == bases.ranks[0].memory["decompositions"] + extra


def test_a_gradient_that_is_not_finite_leaves_its_layers_moments_as_they_were() -> None:
    """The step keeps the raw gradients, and the moments of the layer (with the layers
    batched with it) skip that gradient, decided on the device."""
    model = repeated_shapes()
    preconditioner = KFACPreconditioner(
        model,
        compute_method="eigen",
        scaling="adam-eigenbasis",
        kl_clip=None,
        factor_update_steps=10,
        inv_update_steps=10,  # the second step keeps the bases (nothing rotates m)
    )
    (x, y), (x2, y2) = batches(2)
    F.cross_entropy(model(x.float()), y).backward()
    preconditioner.step()
    first = preconditioner.layers[0]
    before = {k: v.clone() for k, v in first.decomposition.tensors().items()}
    model.zero_grad()
    F.cross_entropy(model(x2.float()), y2).backward()
    weight = first.helper.weight()
    assert weight.grad is not None
    weight.grad.view(-1)[0] = float("nan")
    preconditioner.step()
    assert preconditioner.skipped_steps == 1
    assert torch.isnan(weight.grad.view(-1)[0])  # the raw gradient, for the scaler to skip
    for part, value in first.decomposition.tensors().items():
        assert torch.equal(value, before[part]), part


JOB = {
    "name": "adam-eigenbasis",
    "model": {"name": "lenet"},
    "dataset": {"name": "synthetic", "batch_size": 32, "limit": 256},
    "optimizer": {"name": "sgd", "lr": 0.003, "momentum": 0.0},
    "kfac": {"scaling": "adam-eigenbasis", "compute_method": "eigen", "factor_update_steps": 1},
    "stop": {"max_steps": 12},
    "eval_every": 12,
}


def test_the_job_spec_option_and_its_errors() -> None:
    spec = parse_job_spec(JOB)
    assert isinstance(spec.kfac, KFACSpec)
    assert spec.kfac.kl_clip is None  # Adam's direction has its own scale
    assert spec.kfac.curvature()["scaling"] == "adam-eigenbasis"
    kfac = JOB["kfac"]
    assert isinstance(kfac, dict)
    with pytest.raises(ValueError, match="set compute_method: eigen"):
        parse_job_spec({**JOB, "kfac": {**kfac, "compute_method": "inverse"}})
    with pytest.raises(ValueError, match="set update: optimizer"):
        parse_job_spec({**JOB, "kfac": {**kfac, "update": "quadratic-model"}})
    with pytest.raises(ValueError, match=r"sgd with momentum 0\.9 would add moments"):
        parse_job_spec({**JOB, "optimizer": {"name": "sgd", "lr": 0.003}})
    with pytest.raises(ValueError, match="adamw would add moments of its own"):
        parse_job_spec({**JOB, "optimizer": {"name": "adamw", "lr": 0.003}})
    with pytest.raises(ValueError, match="kronecker"):
        parse_job_spec({**JOB, "kfac": {**kfac, "scaling": "shampoo"}})


def test_a_job_trains_with_it_and_its_forecast_holds_the_moments() -> None:
    """The worker's own training loop (no Ray: ``train`` with a local session) runs the job to
    its last step; the job's preconditioner holds the moments the planner's footprint
    counts, two gradients' worth and a count per layer more than K-FAC's own."""
    records: list[Record] = []
    spec = parse_job_spec(JOB)
    train(TrainConfig(spec=spec, run="adam-eigenbasis"), LocalSession(records.append))
    assert records[-1].kind == "end"
    assert max(getattr(r, "step", 0) for r in records) == 12
    training = Training.build(spec, rank=0, world=1, device=torch.device("cpu"))
    assert training.preconditioner is not None
    assert str(training.preconditioner.scaling) == "adam-eigenbasis"
    layers = training.preconditioner.layers
    moments = sum(
        4
        * (2 * layer.helper.groups * layer.helper.g_dim * layer.helper.a_dim + layer.helper.groups)
        for layer in layers
    )
    adam = footprint("lenet", batch_size=32, compute_method="eigen",
                     scaling="adam-eigenbasis")  # fmt: skip
    kron = footprint("lenet", batch_size=32, compute_method="eigen")
    table = sum(
        4 * layer.helper.groups * layer.helper.g_dim * layer.helper.a_dim for layer in layers
    )
    assert adam.worker_bytes - kron.worker_bytes == moments - table


def test_the_layers_it_leaves_alone_take_adams_step_and_the_others_their_direction() -> None:
    """``EigenbasisAdam``: K-FAC's layers move by ``-lr·d`` (their gradient, already Adam's
    direction in the eigenbasis); the embedding and the norm exactly as ``torch.optim.Adam``
    with the same betas, ε and lr would move them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    twin = copy.deepcopy(model)
    optimizer = build_optimizer(
        OptimizerSpec(name="sgd", lr=0.01, momentum=0.0),
        model.parameters(),
        model,
        KFACSpec(scaling="adam-eigenbasis", compute_method="eigen"),
    )
    assert isinstance(optimizer, EigenbasisAdam)
    linear = list(twin[2].parameters())
    others = list(twin[0].parameters()) + list(twin[1].parameters())
    adam = torch.optim.Adam(others, lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            grad = torch.randn(mine.shape, generator=generator)
            mine.grad, theirs.grad = grad.clone(), grad.clone()
        optimizer.step()
        adam.step()
        with torch.no_grad():
            for param in linear:
                assert param.grad is not None
                param.add_(param.grad, alpha=-0.01)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-8)


def test_a_transformer_job_trains_its_embeddings_and_norms_with_adam() -> None:
    """A model with layers K-FAC leaves alone (the char-transformer's embeddings and
    LayerNorms) trains under the option: the job runs to its last step, and those
    parameters, only those, hold Adam's moments."""
    job = {
        "name": "lm-adam-eigenbasis",
        "model": {"name": "char-transformer"},
        "dataset": {"name": "fortunes", "batch_size": 8},
        "optimizer": {"name": "sgd", "lr": 0.003, "momentum": 0.0},
        "kfac": {"scaling": "adam-eigenbasis", "compute_method": "eigen"},
        "stop": {"max_steps": 4},
        "eval_every": 4,
    }
    spec = parse_job_spec(job)
    records: list[Record] = []
    train(TrainConfig(spec=spec, run="lm-adam-eigenbasis"), LocalSession(records.append))
    assert records[-1].kind == "end"
    training = Training.build(spec, rank=0, world=1, device=torch.device("cpu"))
    optimizer = training.optimizer
    assert isinstance(optimizer, EigenbasisAdam)
    directed, others = optimizer.param_groups
    assert training.preconditioner is not None
    registered = {
        id(p) for layer in training.preconditioner.layers for p in layer.helper.module.parameters()
    }
    assert {id(p) for p in directed["params"]} == registered
    embeddings = {
        id(p)
        for m in training.model.modules()
        if isinstance(m, nn.Embedding | nn.LayerNorm)
        for p in m.parameters()
    }
    assert embeddings
    assert embeddings <= {id(p) for p in others["params"]}
