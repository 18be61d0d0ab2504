"""The planner's figures, pinned: what ``kaisa-ray plan``, ``kaisa_ray.plan`` and the tuner said
for ResNet-50 and BERT-Large before the planner was made fast (commit a85ad65), compared
exactly: every byte, call, memory figure and predicted time.

``plan_figures.json`` was written by this module's ``figures()`` on that commit
(``python tests/tuner/test_plan_figures.py --write``); rewrite it only for a change that is meant to
change a figure, and say so in the commit. Rewritten once since: when the forecast priced
products at the size of their volume and added K-FAC's fixed costs (issue 32), which changed
the predicted times and the choices made from them; and when the quiet step and the factor
update were made to dispatch fewer operations per layer (the estimated fixed costs,
``OVERHEAD_OPERATIONS``: the predicted times and the adaptive case's choice); and when the quiet
step's products became ``bmm`` calls and the KL clip's products one per shape group (the same
counts, 9 → 3.5 per layer and 6 → 10 per group: predicted times only). Every byte, call and
memory figure stayed a85ad65's. The cases cover world sizes whose receiver groups
straddle nodes (24 and 12 ranks on nodes of 8, and 5 per node), the nothing-fits account,
the inverse method, and the tuner's adaptive choice.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kaisa_ray.plan import Plan, StepType, plan
from kaisa_ray.strategy import valid_fractions
from kaisa_train.planning import PlanRequest, load_hardware, plan_job
from kaisa_train.shapes import workload
from tuner.choice import Decision, choose
from tuner.forecast import forecast_profile

FIXTURE = Path(__file__).with_name("plan_figures.json")
GIB = 2**30

# name -> PlanRequest arguments
REPORTS: dict[str, dict[str, Any]] = {
    "resnet50-64": {"model": "resnet50", "batch_size": 32, "workers": 64},
    "bert-large-64": {"model": "bert-large", "batch_size": 8, "workers": 64},
    "resnet50-24-inverse": {
        "model": "resnet50",
        "batch_size": 32,
        "workers": 24,
        "compute_method": "inverse",
        "budgets": (4 * GIB, 80 * GIB),  # 4 GiB: nothing fits, the tuner says what would
    },
    "resnet50-12-5-per-node": {
        "model": "resnet50",
        "batch_size": 32,
        "workers": 12,
        "gpus_per_node": 5,
        "intervals": ((1, 10), (1, 1)),
    },
}


def report(name: str) -> dict[str, Any]:
    args = REPORTS[name]
    data: dict[str, Any] = plan_job(PlanRequest(hardware="a100-80gb-hdr", **args)).to_json()
    return json.loads(json.dumps(data))  # tuples as lists, as the fixture holds them


def rank_figures(p: Plan) -> dict[str, Any]:
    """Per rank: memory, and per step type bytes and calls, run-length coded over the ranks;
    and a digest of every call of every rank (purpose, op, group, source, bytes)."""
    runs: list[list[Any]] = []
    digest = hashlib.sha256()
    for r in p.ranks:
        figures = [r.memory[k] for k in ("factors", "decompositions", "buffers", "total")]
        figures += [r.bytes(t) for t in StepType] + [len(r.calls[t]) for t in StepType]
        if runs and runs[-1][1] == figures:
            runs[-1][0] += 1
        else:
            runs.append([1, figures])
        for t in StepType:
            for c in r.calls[t]:
                digest.update(
                    repr((t.value, c.purpose.value, c.op, c.group, c.src, c.nbytes)).encode()
                )
    return {"runs": runs, "calls_sha256": digest.hexdigest()}


def core(world: int, **options: Any) -> dict[str, Any]:
    layers = list(workload("resnet50", batch_size=32).layers)
    return {str(f): rank_figures(plan(layers, world, f, **options)) for f in valid_fractions(world)}


def decision_figures(decision: Decision) -> dict[str, Any]:
    adaptive = decision.adaptive
    return {
        "chosen": list(decision.chosen.key),
        "candidates": [
            [*c.key, c.memory_bytes, c.kfac_state_bytes, c.step_s, c.breakdown, c.rejected]
            for c in decision.candidates
        ],
        "adaptive": None
        if adaptive is None
        else {
            "start": adaptive.start,
            "max_seconds": adaptive.max_seconds,
            "layer_costs": {
                name: [cost.factor_s, cost.decomposition_s]
                for name, cost in adaptive.layer_costs.items()
            },
        },
    }


def adaptive_choice() -> dict[str, Any]:
    job = workload("resnet50", batch_size=32)
    profile, _ = forecast_profile(job, load_hardware("a100-80gb-hdr"), 24)
    decision = choose(profile, 80 * GIB, adaptive=True, max_overhead=1.0)
    return json.loads(json.dumps(decision_figures(decision)))


CASES = {
    **{f"report {name}": lambda name=name: report(name) for name in REPORTS},
    "core resnet50 64": lambda: core(64),
    "core resnet50 24 inverse, symmetric, factors apart, staleness": lambda: json.loads(
        json.dumps(
            core(
                24,
                compute_method="inverse",
                symmetry_aware=True,
                colocate_factors=False,
                staleness_probes=8,
            )
        )
    ),
    "tuner adaptive resnet50 24": adaptive_choice,
}


def figures() -> dict[str, Any]:
    return {name: case() for name, case in CASES.items()}


@pytest.fixture(scope="module")
def pinned() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    return data


@pytest.mark.parametrize("name", list(CASES))
def test_the_figures_are_those_pinned(name: str, pinned: dict[str, Any]) -> None:
    assert CASES[name]() == pinned[name]


def test_the_pins_hold_what_they_should(pinned: dict[str, Any]) -> None:
    # Every strategy of each world size, with its memory and collectives and candidates.
    assert set(pinned) == set(CASES)
    assert len(pinned["report resnet50-64"]["strategies"]) == 7
    assert len(pinned["report resnet50-24-inverse"]["strategies"]) == 8
    assert pinned["report resnet50-24-inverse"]["choices"][0]["chosen"] is None
    assert "skip_layers" in pinned["report resnet50-24-inverse"]["choices"][0]["reason"]
    runs = pinned["core resnet50 64"]["0.125"]["runs"]
    assert sum(count for count, _ in runs) == 64
    assert len({tuple(figures) for _, figures in runs}) > 1  # the columns differ


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/tuner/test_plan_figures.py --write  (only on purpose)")
    cases = figures()
    lines = [f"{json.dumps(name)}: {json.dumps(cases[name], sort_keys=True)}" for name in cases]
    FIXTURE.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # a case a line
    print(f"wrote {FIXTURE}")
