"""Hyperparameter sweeps: the JobSpec's sweep section, checked field by field; the CLI around
a sweep (faked at its seam); and real sweeps as a user runs them: a trial whose workers cannot
be placed fails saying so, and Ctrl-C ends a sweep without a result. (A sweep through the
service: test_service_e2e.py; the README's, beside other Ray instances:
test_shared_machine.py.)"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from support.cli_process import KAISA_RAY, own_heads_left, run, user_env
from support.ray_head import RayHead

from kaisa_train.records import TrialOutcome, TrialRecord, TrialState
from kaisa_train.spec import JobSpecError, parse_job_spec, trial_spec
from kaisa_train.sweep import SweepResult, search_space
from kaisa_train.tables import TrialTable
from service.cli import main


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
    assert found["kfac.strategy"].endswith("set it instead of 'comm-opt'")  # the value, no repr
    found = problems({"space": {"kfac.damping": {"uniform": [0.01, 0.3]}}}, kfac="off")
    assert "kfac is off" in found["sweep.space.kfac.damping"]
    found = problems({"space": SPACE, "metric": "time_to_target"})
    assert "needs stop.target" in found["sweep.metric"]


def test_the_table_says_what_changed() -> None:
    table = TrialTable(["optimizer.lr", "kfac.damping"])
    params = {"optimizer.lr": 0.05, "kfac.damping": 0.1}
    start = TrialRecord(trial="t1", state=TrialState.RUNNING, params=params)
    assert table.update(start) == "trial t1 RUNNING (lr=0.05, damping=0.1)"
    assert table.update(TrialRecord(trial="t1", state=TrialState.RUNNING, step=20)) is None
    stopped = table.update(TrialRecord(trial="t1", state=TrialState.STOPPED))
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


# -- the CLI around a sweep (the real sweep: test_service_e2e.py, through the service) ------


def test_the_cli_prints_the_trials_and_writes_the_best_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kaisa-ray sweep`` with the sweep itself faked at its seam (``run_sweep``): the table
    of trials with each one's fate, and the best spec as a job file, printed and written."""
    spec = parse_job_spec(job({"space": SPACE, "trials": 3}))
    best = TrialOutcome(
        trial_id="t2",
        run="run.t2",
        params={"optimizer.lr": 0.02, "kfac.damping": 0.1},
        state=TrialState.SUCCEEDED,
        step=60,
        metrics={"test_accuracy": 0.81},
        value=0.81,
        checkpoint="/runs/run.t2/checkpoint",
    )
    trials = [
        TrialOutcome(
            trial_id="t1",
            run="run.t1",
            params={"optimizer.lr": 0.09, "kfac.damping": 0.2},
            state=TrialState.FAILED,
            error="TrainingDivergedError: the loss diverged at step 3",
        ),
        best,
        TrialOutcome(
            trial_id="t3",
            run="run.t3",
            params={"optimizer.lr": 0.001, "kfac.damping": 0.3},
            state=TrialState.STOPPED,
            step=20,
        ),
    ]
    asked: dict[str, Any] = {}

    def fake_run_sweep(given: Any, storage_path: Any, run_name: str) -> SweepResult:
        asked.update(spec=given, storage_path=storage_path, run_name=run_name)
        best_spec = trial_spec(given.without_sweep().model_dump(mode="json"), best.params)
        return SweepResult(run_name, "test_accuracy", "max", trials, best, best_spec, 42.0)

    monkeypatch.setattr("kaisa_train.sweep.run_sweep", fake_run_sweep)
    monkeypatch.setattr(
        "kaisa_train.progress.read_progress", lambda *a, **k: {"records": [], "next": 0}
    )
    config, output = tmp_path / "sweep.yaml", tmp_path / "best.yaml"
    config.write_text(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    args = ["sweep", "--config", str(config), "--run-name", "run", "--output", str(output)]
    out = CliRunner().invoke(main, [*args, "--storage-path", str(tmp_path / "runs")])
    assert out.exit_code == 0, out.output
    assert asked["run_name"] == "run"
    assert asked["storage_path"] == str(tmp_path / "runs")
    assert "sweep run: 3 trials in 42 s" in out.output
    table = [line.split() for line in out.output.splitlines()]
    rows = {words[0]: words[1:] for words in table if words and words[0] in {"t1", "t2", "t3"}}
    assert rows["t1"][:4] == ["FAILED", "0.09", "0.2", "-"]
    assert rows["t2"][:5] == ["SUCCEEDED", "0.02", "0.1", "60", "0.81"]
    assert rows["t3"][:4] == ["STOPPED", "0.001", "0.3", "20"]
    text = output.read_text()
    assert text.startswith(
        "# The best trial of sweep run: t2, test_accuracy 0.81 (max); its checkpoint: "
        "/runs/run.t2/checkpoint\n"
    )
    assert text in out.output  # printed too
    assert f"run it with `kaisa-ray train --config {output}`" in out.output
    written = parse_job_spec(yaml.safe_load(text))
    assert written.sweep is None
    assert written.optimizer.lr == 0.02
    assert written.kfac.damping == 0.1  # type: ignore[union-attr]

    # No trial with the metric: the command fails saying where to look.
    monkeypatch.setattr(
        "kaisa_train.sweep.run_sweep",
        lambda given, storage_path, run_name: SweepResult(
            run_name, "test_accuracy", "max", trials[:1], None, None, 1.0
        ),
    )
    failed = CliRunner().invoke(main, args)
    assert failed.exit_code == 1
    assert "no trial reported test_accuracy" in failed.output


# -- a real sweep ends every trial, or says why not (a command as a user runs it) ----------


def tiny_sweep(tmp_path: Path, trials: int, **overrides: Any) -> Path:
    spec: dict[str, Any] = {
        "name": "tiny-sweep",
        "model": {"name": "mlp"},
        "dataset": {"name": "synthetic", "batch_size": 32},
        "kfac": {"strategy": "auto"},
        "scaling": {"workers": 1},
        "stop": {"max_steps": 2000},
        "eval_every": 50,
        "sweep": {
            "space": {"optimizer.lr": {"loguniform": [0.001, 0.1]}},
            "trials": trials,
            "scheduler": "none",
        },
    }
    spec.update(overrides)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_trial_whose_workers_cannot_be_placed_fails_saying_so(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """Five workers on a 4-CPU cluster: the trial fails after scaling.resource_timeout_s with
    the reason (the workers' and the cluster's resources) instead of waiting forever."""
    config = tiny_sweep(
        tmp_path, 1, scaling={"workers": 5, "cpus_per_worker": 1, "resource_timeout_s": 3}
    )
    env = {**user_env(tmp_path / "home"), "RAY_ADDRESS": ray_head.gcs_address}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ray_head.token)
    done = run([KAISA_RAY, "sweep", "--config", str(config)], env, tmp_path, 300)
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, output[-4000:]
    assert "FAILED" in output
    assert (
        "WorkersNotPlacedError: the job's 5 workers (1 CPU each, placement pack) did not get "
        "their resources within scaling.resource_timeout_s=3 s (the cluster has 4 CPU in all"
    ) in output
    assert "no trial reported time_to_target" in output or "no trial reported" in output


@pytest.mark.ray
def test_ctrl_c_ends_a_sweep_without_a_result(tmp_path: Path) -> None:
    """Ctrl-C while a trial runs: the sweep says it was interrupted, exits 130 (not 0), writes
    no best spec, and its Ray of its own is gone."""
    config = tiny_sweep(tmp_path, 4)
    env = user_env(tmp_path / "home")
    process = subprocess.Popen(
        [KAISA_RAY, "sweep", "--config", str(config), "--output", "best.yaml"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    assert process.stdout is not None
    deadline = time.monotonic() + 240
    for line in process.stdout:
        lines.append(line)
        if re.match(r"trial \S+ RUNNING", line) or time.monotonic() > deadline:
            break
    assert any(re.match(r"trial \S+ RUNNING", line) for line in lines), "".join(lines)[-4000:]
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=180)
    output = "".join(lines) + rest
    assert process.returncode == 130, output[-4000:]
    assert "was interrupted before its 4 trials ended: no best spec is written" in output
    assert "did not end: the sweep was interrupted" in output
    assert not (tmp_path / "best.yaml").exists()
    assert own_heads_left(output) == []
