"""``kfac: auto`` end to end on a real Ray head: the tuner profiles a job on its own 2 workers,
chooses and trains (and caches the profile: a second job skips it); ``kaisa-ray tune
--verify 2`` measures the best candidates in Ray Tune trials and prints the table without
training (a job without ``kfac: auto`` refused); and a budget below the job itself fails
saying so."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import ray
import yaml
from click.testing import CliRunner
from support.ray_head import RayHead, actors_alive
from support.ray_jobs import job, records

from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_train.job import run_job
from kaisa_train.spec import parse_job_spec
from kaisa_train.state import load_checkpoint_file
from service.cli import main
from tuner.actor import tuner_actor

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.skipif(
        not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
    ),
]


def test_kfac_auto_profiles_on_the_workers_chooses_and_trains(
    ray_head: RayHead, tmp_path: Path
) -> None:
    ray.get(tuner_actor().forget.remote())  # no profile cached by an earlier test
    kfac = {"strategy": "auto", "adapt": True}
    spec = job(kfac=kfac, memory_budget="1GiB", stop={"max_steps": 20}, eval_every=10)
    handler = signal.getsignal(signal.SIGINT)
    result = run_job(parse_job_spec(spec), storage_path=tmp_path, progress=False)
    assert result.succeeded, result.error
    assert signal.getsignal(signal.SIGINT) is handler
    assert actors_alive(ray_head, "TrainController") == 0
    (tuning,) = records(result.run_name, "tuner")
    assert tuning["cache"] == "miss"
    assert tuning["budget_bytes"] == 2**30
    assert 0 < tuning["profile_s"] < 60
    table = tuning["candidates"]
    assert len(table) == 2 * 3  # f in {1/2, 1} at 2 workers x three interval pairs
    feasible = [row for row in table if row["rejected"] is None]
    chosen = tuning["chosen"]
    # Adapted intervals (adapt: true): every layer starts where the fixed choice would be,
    # the fastest step that fits (its fraction, its rung); the ladder and each layer's cost
    # go along.
    fastest = min(feasible, key=lambda row: (row["ms_per_step"], -row["grad_worker_fraction"]))
    for key in ("grad_worker_fraction", "factor_update_steps", "inv_update_steps"):
        assert chosen[key] == fastest[key], (key, chosen, fastest)
    adaptive = chosen["adaptive"]
    rungs = [tuple(rung) for rung in adaptive["rungs"]]
    assert rungs[adaptive["start"]] == (fastest["factor_update_steps"], fastest["inv_update_steps"])
    assert {tuple(rung) for rung in adaptive["rungs"]} == {
        (row["factor_update_steps"], row["inv_update_steps"]) for row in table
    }
    assert set(adaptive["layer_costs"]) == {"conv1", "conv2", "fc1", "fc2"}
    assert result.checkpoint is not None
    kept = load_checkpoint_file(result.checkpoint)["kfac_decision"]
    assert json.loads(json.dumps(kept)) == chosen  # pairs as tuples there, lists in the record

    # The same job again: the tuner actor has its profile, so nobody profiles.
    again = run_job(parse_job_spec(spec), storage_path=tmp_path, progress=False)
    assert again.succeeded, again.error
    (cached,) = records(again.run_name, "tuner")
    assert cached["cache"] == "hit"
    assert cached["profile_s"] == 0
    assert cached["candidates"] == table
    assert cached["chosen"] == chosen


def test_kaisa_ray_tune_verifies_the_best_candidates_and_prints_the_table_without_training(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """``kaisa-ray tune --verify 2``: the two best predicted candidates measured in Ray Tune
    trials, the fastest measured one chosen, the table printed with the measured columns,
    and nothing trained. (How a verified choice reaches the workers, ``decided``, is in
    ``test_adaptive_job.py``; a decision kept in the checkpoint, above.)"""
    spec = tmp_path / "auto.yaml"
    # One worker (one fraction, f = 1): a trial's worker group costs a process a worker.
    kfac = {"strategy": "auto", "intervals": [[1, 4], [2, 8], [4, 16]]}
    one_worker = job(kfac=kfac, memory_budget="1GiB", scaling={"workers": 1})
    spec.write_text(yaml.safe_dump(one_worker))
    run = CliRunner().invoke(
        main,
        ["tune", "--config", str(spec), "--verify", "2", "--storage-path", str(tmp_path / "runs")],
    )
    assert run.exit_code == 0, run.output
    lines = run.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["f", "intervals"])
    assert "measured MiB" in lines[header]
    # f, intervals, MiB/worker, K-FAC MiB, ms/step, measured MiB, measured ms, then the verdict
    rows = [line.split() for line in lines[header + 1 : header + 1 + 3]]  # f = 1 x 3 pairs
    assert all(len(row) >= 8 for row in rows), rows
    measured = [row for row in rows if row[6] != "-"]
    assert len(measured) == 2  # the two best predicted
    predicted_best = sorted(rows, key=lambda row: float(row[4]))[:2]
    assert {tuple(row[:2]) for row in measured} == {tuple(row[:2]) for row in predicted_best}
    for row in measured:
        # Predicted memory per worker is the measured peak to within 10% (exact on CPU), and
        # within the budget.
        assert 0 < float(row[5]) <= 1024
        assert float(row[2]) == pytest.approx(float(row[5]), rel=0.10)
    # The fastest measured one is chosen. The table prints milliseconds to 0.1 while the
    # choice compares the unrounded times, so two rows may print the same time: the chosen
    # one is then one of them.
    chosen = [row for row in rows if row[7:] == ["CHOSEN"]]
    assert len(chosen) == 1, rows
    assert chosen[0] in measured, rows
    assert float(chosen[0][6]) == min(float(row[6]) for row in measured), rows
    assert "(measured:" in lines[-1]
    assert "s of verification trials" in lines[-1]
    assert "kfac: auto chose grad_worker_fraction=" in lines[-1]
    assert not any(path.name.startswith("checkpoint_") for path in (tmp_path / "runs").rglob("*"))

    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(yaml.safe_dump(job()))
    refused = CliRunner().invoke(main, ["tune", "--config", str(fixed)])
    assert refused.exit_code == 1
    assert "tuning needs a job with kfac: auto" in refused.output


def test_kfac_auto_with_a_budget_below_the_model_fails_saying_so(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """The job fails before training, saying by how much the budget is short. (The CLI's
    ``kaisa-ray tune`` raises the same ``ConfigurationError`` as a usage error: exit code 1
    with the message, as for the fixed job above.)"""
    # One worker: what fails is the profile's base memory, whatever the fraction.
    spec = job(kfac="auto", memory_budget="100KiB", stop={"max_steps": 5}, scaling={"workers": 1})
    handler = signal.getsignal(signal.SIGINT)
    result = run_job(parse_job_spec(spec), storage_path=tmp_path, progress=False)
    assert not result.succeeded
    # Ray Train's SIGINT handler (it aborts the run, and holds its controller) went with the
    # run: the one before is back, and no controller outlives its run.
    assert signal.getsignal(signal.SIGINT) is handler
    assert actors_alive(ray_head, "TrainController") == 0
    error = result.error or ""
    assert "the memory budget 0.10 MiB is smaller than the job itself" in error, error
    assert "MiB over, before any K-FAC state" in error, error
    assert not records(result.run_name, "step")  # nothing trained
