"""The peers a user would try instead of K-FAC (SOAP, Muon with AdamW, PSGD Kron, from
heavyball) as a job's ``optimizer.name``: refused with K-FAC and without heavyball, each one
trains LeNet on Fashion-MNIST with the job's lr schedule reaching it. (A 2-worker SOAP job on
a real Ray head, submitted with ``ray job submit``: ``test_ray_train.py``.)"""

from __future__ import annotations

import importlib.util
from typing import Any

import heavyball
import pytest
import torch
from torch import nn

from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR, load_idx_dataset
from kaisa_train.models import LeNetCNN
from kaisa_train.optimizers import build_optimizer
from kaisa_train.spec import PEER_OPTIMIZERS, OptimizerSpec, parse_job_spec

needs_data = pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
)
CLASSES = {"soap": heavyball.SOAP, "muon": heavyball.MuonAdamW, "psgd-kron": heavyball.PSGDKron}
LR = {"soap": 3e-3, "muon": 2e-2, "psgd-kron": 3e-3}


def job(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "peer",
        "model": {"name": "lenet"},
        "dataset": {"name": "fashion-mnist", "batch_size": 64, "limit": 2048},
        "optimizer": {"name": "soap", "lr": 3e-3},
        "kfac": "off",
        "scaling": {"workers": 2},
        "stop": {"max_steps": 30},
        "eval_every": 30,
        "seed": 1,
    }
    spec.update(overrides)
    return spec


@pytest.mark.parametrize("name", PEER_OPTIMIZERS)
def test_a_peer_with_kfac_is_refused_naming_the_fix(name: str) -> None:
    with pytest.raises(ValueError, match=f"optimizer {name} preconditions the gradient itself"):
        parse_job_spec(job(optimizer={"name": name, "lr": 1e-3}, kfac={"strategy": "comm-opt"}))
    parse_job_spec(job(optimizer={"name": name, "lr": 1e-3}))  # with kfac: off


def test_a_peer_without_heavyball_is_refused_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "heavyball" else real(n, *a)
    )
    with pytest.raises(ValueError, match=r"pip install 'kaisa-ray\[peers\]'"):
        parse_job_spec(job())


@needs_data
@pytest.mark.parametrize("name", PEER_OPTIMIZERS)
def test_each_peer_trains_lenet_and_follows_the_job_s_lr(name: str) -> None:
    """heavyball's class at the spec's lr and weight decay; 40 steps of batch 64 on
    Fashion-MNIST halve the loss; with the lr set to 0 in the param groups (what the job's
    schedule does) a step moves nothing but the optimizer's state."""
    x, y = load_idx_dataset(None, "train", limit=2560)
    torch.manual_seed(0)
    model = LeNetCNN()
    optimizer = build_optimizer(
        OptimizerSpec(name=name, lr=LR[name], weight_decay=0.0),  # type: ignore[arg-type]
        model.parameters(),
    )
    assert type(optimizer) is CLASSES[name]
    assert {g["lr"] for g in optimizer.param_groups} == {LR[name]}

    def step(i: int) -> float:
        batch = slice(64 * i, 64 * (i + 1))
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return float(loss)

    first = step(0)
    losses = [step(i) for i in range(1, 40)]
    assert sum(losses[-5:]) / 5 < 0.5 * first, (first, losses[-5:])
    before = [p.detach().clone() for p in model.parameters()]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    step(0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_soap_s_eigenbasis_interval_reaches_heavyball_and_only_soap_has_one() -> None:
    """``optimizer.precondition_frequency``: SOAP's bases every so many steps (heavyball's
    ``precondition_frequency``, default 2); on another optimizer an error naming the fix."""
    net = nn.Linear(4, 3)
    every = build_optimizer(
        OptimizerSpec(name="soap", lr=3e-3, precondition_frequency=1), net.parameters()
    )
    default = build_optimizer(OptimizerSpec(name="soap", lr=3e-3), net.parameters())
    assert (every.precond_schedule, default.precond_schedule) == (1.0, 0.5)  # type: ignore[attr-defined]
    for name in ("adamw", "muon"):
        with pytest.raises(ValueError, match="set name: soap, or leave precondition_frequency"):
            OptimizerSpec(name=name, precondition_frequency=1)
    with pytest.raises(ValueError, match="greater than 0"):
        OptimizerSpec(name="soap", precondition_frequency=0)
