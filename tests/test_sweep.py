"""Hyperparameter sweeps: the JobSpec's sweep section, checked field by field, and a real
sweep on Ray Tune (ASHA stops a weak trial, a diverging trial fails with its reason, the best
spec comes out as a job file and reproduces the best trial)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from ray_head import RayHead

from kaisa_ray.train.cli import main
from kaisa_ray.train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_ray.train.job import run_job
from kaisa_ray.train.progress import read_progress
from kaisa_ray.train.spec import JobSpecError, parse_job_spec, trial_spec
from kaisa_ray.train.sweep import TrialTable, search_space


def job(sweep: dict[str, Any] | None, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "sweep",
        "model": {"name": "lenet"},
        "dataset": {"name": "synthetic", "batch_size": 32},
        "kfac": {"strategy": "auto"},
        "stop": {"max_steps": 60},
    }
    spec.update(overrides)
    if sweep is not None:
        spec["sweep"] = sweep
    return spec


SPACE = {"optimizer.lr": {"loguniform": [0.001, 0.1]}, "kfac.damping": {"uniform": [0.01, 0.3]}}


def problems(sweep: dict[str, Any], **overrides: Any) -> dict[str, str]:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(job(sweep, **overrides))
    return dict(p.split(": ", 1) for p in caught.value.problems)


def test_a_sweep_over_lr_damping_kl_clip_and_factor_decay_is_accepted() -> None:
    space = {
        **SPACE,
        "kfac.kl_clip": {"choice": [0.001, 0.01]},
        "kfac.factor_decay": {"uniform": [0.9, 0.99]},
        "dataset.batch_size": {"randint": [16, 64]},
    }
    spec = parse_job_spec(job({"space": space, "trials": 16, "concurrent": 2}))
    assert spec.sweep is not None
    assert spec.sweep.direction == "max"
    assert spec.sweep.scheduler == "asha"
    assert set(search_space(spec.sweep)) == set(space)
    assert spec.without_sweep().sweep is None
    one = trial_spec(spec.without_sweep().model_dump(mode="json"), {"kfac.damping": 0.2})
    assert isinstance(one.kfac, type(spec.kfac))
    assert one.kfac.damping == 0.2  # type: ignore[union-attr]


def test_metrics_have_their_own_direction() -> None:
    loss = parse_job_spec(job({"space": SPACE, "metric": "test_loss"})).sweep
    time_ = parse_job_spec(
        job(
            {"space": SPACE, "metric": "time_to_target"},
            stop={"max_steps": 60, "target": {"value": 0.88}},
        )
    ).sweep
    assert loss is not None
    assert loss.direction == "min"
    assert time_ is not None
    assert time_.direction == "min"


def test_an_unknown_field_is_named_with_the_fields_there_are() -> None:
    found = problems({"space": {"kfac.dampin": {"uniform": [0.01, 0.1]}}})
    assert "kfac has no field 'dampin'" in found["sweep.space.kfac.dampin"]
    assert "damping" in found["sweep.space.kfac.dampin"]
    found = problems({"space": {"optimizer.name": {"choice": [1, 2]}}})
    assert "not a number" in found["sweep.space.optimizer.name"]


def test_an_empty_range_is_refused_naming_the_field() -> None:
    found = problems({"space": {"optimizer.lr": {"uniform": [0.1, 0.1]}}})
    assert "range [0.1, 0.1] of uniform is empty" in found["sweep.space.optimizer.lr"]
    found = problems({"space": {"optimizer.lr": {"loguniform": [0, 0.1]}}})
    assert "positive low end" in found["sweep.space.optimizer.lr"]
    found = problems({"space": {"optimizer.lr": {"choice": []}}})
    assert "at least 1 item" in found["sweep.space.optimizer.lr.choice"]
    found = problems({"space": {"optimizer.lr": {"uniform": [0.1, 0.2], "choice": [1]}}})
    assert "exactly one of" in found["sweep.space.optimizer.lr"]


def test_a_negative_or_zero_trial_count_is_refused() -> None:
    assert "greater than 0" in problems({"space": SPACE, "trials": -1})["sweep.trials"]
    assert "greater than 0" in problems({"space": SPACE, "trials": 0})["sweep.trials"]
    assert "greater than 0" in problems({"space": SPACE, "concurrent": 0})["sweep.concurrent"]


def test_values_the_field_refuses_are_named() -> None:
    found = problems({"space": {"kfac.damping": {"uniform": [-0.1, 0.3]}}})
    assert "-0.1 is not a valid kfac.damping" in found["sweep.space.kfac.damping"]
    found = problems({"space": {"kfac.factor_decay": {"choice": [0.9, 1.0]}}})
    assert "less than 1" in found["sweep.space.kfac.factor_decay"]
    found = problems({"space": {"dataset.batch_size": {"uniform": [8, 64]}}})
    assert "integer" in found["sweep.space.dataset.batch_size"]


def test_what_the_tuner_decides_and_fixed_strategies_are_refused() -> None:
    found = problems({"space": {"kfac.inv_update_steps": {"randint": [10, 100]}}})
    assert "the tuner chooses the intervals" in found["sweep.space.kfac.inv_update_steps"]
    found = problems({"space": SPACE}, kfac={"strategy": "comm-opt"})
    assert "kfac.strategy: auto" in found["kfac.strategy"]
    found = problems({"space": {"kfac.damping": {"uniform": [0.01, 0.3]}}}, kfac="off")
    assert "kfac is off" in found["sweep.space.kfac.damping"]
    found = problems({"space": SPACE, "metric": "time_to_target"})
    assert "needs stop.target" in found["sweep.metric"]


def test_the_table_says_what_changed() -> None:
    table = TrialTable(["optimizer.lr", "kfac.damping"])
    params = {"optimizer.lr": 0.05, "kfac.damping": 0.1}
    start = {"kind": "trial", "trial": "t1", "state": "RUNNING", "params": params}
    assert table.update(start) == "trial t1 RUNNING (lr=0.05, damping=0.1)"
    assert table.update({"kind": "trial", "trial": "t1", "state": "RUNNING", "step": 20}) is None
    stopped = table.update({"kind": "trial", "trial": "t1", "state": "STOPPED"})
    assert stopped == (
        "trial t1 STOPPED (lr=0.05, damping=0.1) at step 20: stopped early by the scheduler"
    )
    lines = table.render().splitlines()
    assert lines[0].split() == [
        "trial",
        "state",
        "lr",
        "damping",
        "step",
        "test_accuracy",
        "test_loss",
        "train_s",
    ]
    assert lines[1].split() == ["t1", "STOPPED", "0.05", "0.1", "20", "-", "-", "-"]


# -- a real sweep on Ray Tune -------------------------------------------------------------

# With the search seed 2, the trials draw these learning rates, in this order (Ray 2.60's
# BasicVariantGenerator; one trial at a time): 1e4 (diverges), 0.05, 3e-4 (far behind at
# the first rung: ASHA stops it), 0.05. The damping is drawn too.
SWEEP = {
    "space": {
        "optimizer.lr": {"choice": [0.05, 0.0003, 10000.0]},
        "kfac.damping": {"loguniform": [0.05, 0.3]},
    },
    "trials": 4,
    "concurrent": 1,
    "asha": {"grace_steps": 20, "reduction_factor": 2},
    "seed": 2,
}


@pytest.mark.slow
@pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
)
def test_a_sweep_stops_weak_trials_survives_a_diverging_one_and_its_best_spec_reproduces(
    ray_head: RayHead, tmp_path: Path
) -> None:
    spec = job(
        SWEEP,
        name="sweep-e2e",
        dataset={"name": "fashion-mnist", "batch_size": 64, "limit": 2048},
        optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        kfac={"strategy": "auto", "kl_clip": None},  # no clip: a large lr really diverges
        memory_budget="2GiB",
        scaling={"workers": 1},
        eval_every=10,
        checkpoint={"every_steps": 30, "keep": 2},
        seed=3,
    )
    config, best_file = tmp_path / "sweep.yaml", tmp_path / "best.yaml"
    config.write_text(yaml.safe_dump(spec, sort_keys=False))  # the space's order: the draws'
    run = f"sweep-e2e-{time.time_ns()}"
    began = time.monotonic()
    out = CliRunner().invoke(
        main,
        [
            "sweep",
            "--config",
            str(config),
            "--storage-path",
            str(tmp_path / "runs"),
            "--run-name",
            run,
            "--output",
            str(best_file),
        ],
        catch_exceptions=False,
    )
    took = time.monotonic() - began
    assert out.exit_code == 0, out.output
    (record,) = read_progress(run, kinds=["sweep"])["records"]
    trials = {t["trial_id"]: t for t in record["trials"]}
    assert len(trials) == 4
    by_lr = {}
    for trial in trials.values():
        by_lr.setdefault(trial["params"]["optimizer.lr"], []).append(trial)
    # The diverging trial failed with its reason; the sweep went on.
    (diverged,) = by_lr[10000.0]
    assert diverged["state"] == "FAILED"
    assert "TrainingDivergedError" in diverged["error"]
    assert "diverged" in diverged["error"]
    assert "FAILED" in out.output
    assert "diverged" in out.output, out.output
    # ASHA stopped the slow one at its first rung.
    (slow,) = by_lr[0.0003]
    assert slow["state"] == "STOPPED"
    assert slow["step"] < 60
    assert "stopped early by the scheduler" in out.output
    # The others trained to the end; the best of them is the sweep's best.
    finished = by_lr[0.05]
    assert [t["state"] for t in finished] == ["SUCCEEDED", "SUCCEEDED"]
    best = record["best"]
    assert best["value"] == max(t["metrics"]["test_accuracy"] for t in finished)
    assert best["trial_id"] in {t["trial_id"] for t in finished}
    assert Path(best["checkpoint"], "state.pt").is_file()
    # Every trial's events reached the sink as they happened.
    events = read_progress(run, kinds=["trial"])["records"]
    assert {e["state"] for e in events} == {"RUNNING", "SUCCEEDED", "STOPPED", "FAILED"}
    assert max(e.get("step", 0) for e in events if e["trial"] == best["trial_id"]) == 60

    # The best spec is a ready-to-run job file: running it reproduces the best trial.
    text = best_file.read_text()
    assert text.startswith(f"# The best trial of sweep {run}: {best['trial_id']}")
    best_spec = parse_job_spec(yaml.safe_load(text))
    assert best_spec.sweep is None
    assert best_spec.optimizer.lr == best["params"]["optimizer.lr"]
    assert best_spec.kfac.damping == best["params"]["kfac.damping"]  # type: ignore[union-attr]
    again = run_job(best_spec, storage_path=tmp_path / "again", progress=False)
    assert again.succeeded, again.error
    assert again.metrics["step"] == 60
    assert again.metrics["test_accuracy"] == pytest.approx(best["value"], abs=0.01)
    print(f"sweep of 4 trials took {took:.0f} s")
