"""``factor_reduction='deferred'``: each rank folds its own batch factors and the running
averages are all-reduced on decomposition steps only. What the plan says it sends and
holds, the options that refuse it, one process unchanged, and the JobSpec's field (the ranks
against one process, the skip that every rank agrees on and the resume: test_distributed.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.assignment import LayerShape
from kaisa_ray.buckets import Purpose, StepType
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.plan import plan
from kaisa_train.planning import PlanRequest, plan_job, request_from_spec
from kaisa_train.spec import KFACSpec, parse_job_spec

LAYERS = [
    LayerShape(name="conv", a_dim=28, g_dim=16),
    LayerShape(name="fc1", a_dim=785, g_dim=128),
    LayerShape(name="fc2", a_dim=129, g_dim=10),
]


@pytest.mark.parametrize("strategy", ["comm-opt", "hybrid-opt", "mem-opt"])
def test_the_plan_moves_the_factor_all_reduce_to_decomposition_steps(strategy: str) -> None:
    """A factor step sends one number (whether every rank folds); a decomposition step the
    same factor all-reduces as before, and everything else is unchanged: memory, the plain
    step, the decompositions and gradients. At intervals 5/50 the mean bytes a step fall by
    the factor all-reduces of the nine factor steps out of ten that no longer send them."""
    every = plan(LAYERS, 4, strategy)
    deferred = plan(LAYERS, 4, strategy, factor_reduction="deferred")
    factors = every.factor_calls
    assert factors  # the batch factors, every factor step
    assert deferred.factor_calls == factors  # the same buckets: the running averages
    agree = deferred.agree_calls
    assert [(c.purpose, c.op, c.group, c.nbytes) for c in agree] == [
        (Purpose.FACTORS, "all_reduce", (0, 1, 2, 3), 8)
    ]
    assert every.agree_calls == ()
    for rank in range(4):
        ours, theirs = deferred.ranks[rank], every.ranks[rank]
        assert ours.memory == theirs.memory
        assert ours.calls[StepType.PLAIN] == theirs.calls[StepType.PLAIN]
        plain = theirs.calls[StepType.PLAIN]
        assert ours.calls[StepType.FACTOR_UPDATE] == agree + plain
        assert theirs.calls[StepType.FACTOR_UPDATE] == factors + plain
        assert ours.calls[StepType.INVERSE_UPDATE] == agree + theirs.calls[StepType.INVERSE_UPDATE]
        saved = every.mean_bytes_per_step(rank, 5, 50) - deferred.mean_bytes_per_step(rank, 5, 50)
        factor_bytes = sum(c.nbytes for c in factors)
        assert saved == pytest.approx(factor_bytes * (1 / 5 - 1 / 50) - 8 / 5)


def test_one_process_has_nothing_to_defer() -> None:
    every, deferred = plan(LAYERS, 1), plan(LAYERS, 1, factor_reduction="deferred")
    assert deferred.ranks[0] == every.ranks[0]
    trained = [_train("every-update"), _train("deferred")]
    for a, b in zip(*trained, strict=True):
        assert torch.equal(a, b)


def _train(factor_reduction: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    preconditioner = KFACPreconditioner(
        model, factor_update_steps=2, inv_update_steps=4, factor_reduction=factor_reduction
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(9):
        optimizer.zero_grad()
        x = torch.randn(16, 6, generator=generator)
        y = torch.randint(0, 3, (16,), generator=generator)
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_what_reads_the_factors_between_decompositions_refuses_it_naming_the_fix() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    fix = "use factor_reduction='every-update'"
    with pytest.raises(ConfigurationError, match=f"scaling='ekfac' reduces .*{fix}"):
        KFACPreconditioner(
            model,
            compute_method="eigen",
            scaling="ekfac",
            pi_damping=False,
            factor_reduction="deferred",
        )
    with pytest.raises(ConfigurationError, match=f"measured staleness .*{fix}"):
        KFACPreconditioner(model, measure_staleness=True, factor_reduction="deferred")
    with pytest.raises(ConfigurationError, match=f"FSDP2 .*{fix}"):
        plan(LAYERS, 2, parallel="fsdp", factor_reduction="deferred")
    with pytest.raises(ConfigurationError, match="factor_reduction='sometimes' is not valid"):
        KFACPreconditioner(model, factor_reduction="sometimes")


def test_the_job_spec_field_its_refusals_and_its_plan() -> None:
    spec = KFACSpec(factor_reduction="deferred")
    assert spec.preconditioner_options()["factor_reduction"] == "deferred"
    assert KFACSpec().preconditioner_options()["factor_reduction"] == "every-update"
    with pytest.raises(ValueError, match=r"scaling: ekfac .* set factor_reduction: every-update"):
        KFACSpec(compute_method="eigen", scaling="ekfac", factor_reduction="deferred")
    with pytest.raises(ValueError, match=r"measure_staleness .* set factor_reduction: every-upd"):
        KFACSpec(measure_staleness=True, factor_reduction="deferred")
    job = {
        "name": "deferred",
        "model": {"name": "lenet"},
        "dataset": {"name": "fashion-mnist", "batch_size": 64},
        "kfac": {"factor_reduction": "deferred"},
        "scaling": {"workers": 2},
        "stop": {"max_steps": 10},
    }
    assert request_from_spec(parse_job_spec(job), "a100-80gb").factor_reduction == "deferred"
    sharded = {**job, "scaling": {"workers": 2, "parallel": "fsdp"}}
    with pytest.raises(ValueError, match=r"kfac\.factor_reduction: deferred yet: set kfac\.factor"):
        parse_job_spec(sharded)


def test_kaisa_ray_plan_prices_the_deferred_all_reduce_on_inverse_updates_only() -> None:
    """The forecast a team reads: at 10/100 on 64 GPUs every strategy's communication a step
    falls (its factor all-reduces priced once an inverse update instead of once a factor
    update), nothing else changes, and the report says which reduction it priced."""
    reports = {
        mode: plan_job(
            PlanRequest(
                model="resnet50",
                batch_size=32,
                workers=64,
                hardware="a100-80gb-hdr",
                intervals=((10, 100),),
                factor_reduction=mode,
            )
        ).to_json()
        for mode in ("every-update", "deferred")
    }
    every, deferred = reports["every-update"], reports["deferred"]
    assert deferred["inputs"]["factor_reduction"] == "deferred"
    assert "factor_reduction" not in every["inputs"]
    for ours, theirs in zip(deferred["strategies"], every["strategies"], strict=True):
        assert ours["memory"] == theirs["memory"]
        (mine,), (reference,) = ours["candidates"], theirs["candidates"]
        assert mine["parts_s"]["communication"] < reference["parts_s"]["communication"]
        for part in ("factors", "decompositions", "precondition"):
            assert mine["parts_s"][part] == reference["parts_s"][part]
