"""A job whose ``kfac: auto`` adapts its intervals, through the worker's own loop in this
process (no Ray: the tuner's decision is given, as ``kfac.verify`` gives it): rank 0 sends an
``intervals`` record with each step record (every layer's intervals, staleness and the changes
with their reasons), the checkpoint keeps the decision and the schedule, and a job resumed
from it continues bit for bit: the same parameters and the same interval changes.
"""

from __future__ import annotations

from typing import Any

import torch
from support.capturing_session import CapturingSession

from kaisa_train.records import (
    AdaptiveChoice,
    KFACChoice,
    StepRecord,
    TunerRecord,
)
from kaisa_train.spec import parse_job_spec
from kaisa_train.worker import train
from kaisa_train.worker_config import TrainConfig

STEPS = 60
SPLIT = 24  # a checkpoint mid-interval for some layers: the schedule comes from it

SPEC = parse_job_spec(
    {
        "name": "adaptive",
        "model": {"name": "lenet"},
        "dataset": {"name": "synthetic", "batch_size": 32, "limit": 512},
        "optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.9},
        "kfac": {"strategy": "auto", "intervals": [[1, 4], [2, 8], [4, 16]]},
        "stop": {"max_steps": STEPS},
        "eval_every": 1000,
        "checkpoint": {"every_steps": SPLIT},
    }
)
# A decision as the tuner hands it over: f = 1, every layer from the shortest rung (the tuner
# starts on the fixed choice's rung; this one has room to lengthen), with a target among this
# job's staleness (some layers lengthen, some stay).
DECIDED = KFACChoice(
    grad_worker_fraction=1.0,
    factor_update_steps=1,
    inv_update_steps=4,
    adaptive=AdaptiveChoice(rungs=[(1, 4), (2, 8), (4, 16)], start=0, target_angle=4.0),
)
TUNING = TunerRecord(
    cache="miss",
    profile_s=0.0,
    budget_bytes=None,
    base_memory_bytes=0,
    kfac_transient_bytes=0,
    plain_ms_per_step=1.0,
    chosen=DECIDED,
    candidates=[],
)


def run(state: dict[str, Any] | None = None) -> CapturingSession:
    session = CapturingSession(state)
    config = TrainConfig(
        spec=SPEC, run="adaptive", progress_every=4, decided=DECIDED, tuning=TUNING
    )
    train(config, session)
    return session


def test_an_adaptive_job_reports_its_intervals_and_resumes_them_bit_for_bit() -> None:
    whole = run()
    records = whole.intervals()
    assert [r.step for r in records] == list(range(4, STEPS + 1, 4))
    assert all(r.adaptive for r in records)
    assert {layer.layer for layer in records[-1].layers} == {"conv1", "conv2", "fc1", "fc2"}
    changes = [c for r in records for c in r.changes]
    assert changes, "no layer's intervals changed"
    for change in changes:
        assert change.before != change.after
        assert "of staleness after" in change.reason
    # A record's intervals are the last change's of each layer.
    last = {c.layer: c.after for c in changes}
    now = {
        layer.layer: (layer.factor_update_steps, layer.inv_update_steps)
        for layer in records[-1].layers
    }
    assert {name: now[name] for name in last} == last
    steps = [r for r in whole.records if isinstance(r, StepRecord)]
    assert all((s.kfac_staleness_ms or 0) > 0 for s in steps)  # measured on every window

    saved = whole.saved[SPLIT]
    assert saved["kfac_decision"] == DECIDED.model_dump()
    assert saved["preconditioner"]["intervals"]  # each layer's rung and last decomposition
    resumed = run(saved)
    after = [c for r in resumed.intervals() for c in r.changes]
    assert after == [c for c in changes if c.step >= SPLIT]
    assert resumed.intervals()[-1] == records[-1]
    final = whole.saved[STEPS]["model"]
    for name, tensor in resumed.saved[STEPS]["model"].items():
        assert torch.equal(tensor, final[name]), name
