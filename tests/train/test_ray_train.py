"""End to end on a real Ray head: 2-worker K-FAC jobs on Fashion-MNIST, a killed worker
resumed bit for bit, `ray job submit` of a 2-worker SOAP job that stops at its target
(``kfac: auto``: ``test_kfac_auto.py``)."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from ray.job_submission import JobStatus, JobSubmissionClient
from support.ray_head import RAY, RayHead
from support.ray_jobs import LIMIT, job, records

from kaisa_ray import KFACPreconditioner
from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR, load_idx_dataset
from kaisa_train.example import evaluate
from kaisa_train.job import JobResult, run_job
from kaisa_train.models import LeNetCNN
from kaisa_train.spec import parse_job_spec
from kaisa_train.state import load_checkpoint_file
from service.cli import main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.skipif(
        not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
    ),
]


def _final_model(result: JobResult) -> dict[str, torch.Tensor]:
    assert result.checkpoint is not None
    model: dict[str, torch.Tensor] = load_checkpoint_file(result.checkpoint)["model"]
    return model


@pytest.mark.timeout(1200)
def test_killed_worker_of_a_sharded_job_resumes_from_its_checkpoint(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """A job sharded by FSDP2 (``scaling.parallel: fsdp``) under MEM-OPT (each layer's gradient
    rows gathered to its one worker and scattered back), with Adam's moments in K-FAC's
    eigenbasis (``kfac.scaling``: state beyond the factors and decompositions, held by each
    layer's worker, that the checkpoint gathers and the resume restores to it): a worker
    killed mid-run, the job resumed from
    its checkpoint (the model and optimizer gathered whole), ending with the parameters of an
    uninterrupted run from that checkpoint; the checkpoint is a DDP job's (a plain LeNet loads
    it and reproduces the reported accuracy)."""
    spec = parse_job_spec(
        job(
            scaling={"workers": 2, "parallel": "fsdp"},
            optimizer={"name": "sgd", "lr": 0.004, "momentum": 0.0},
            kfac={
                "strategy": "mem-opt",
                "factor_update_steps": 5,
                "inv_update_steps": 20,
                "compute_method": "eigen",
                "scaling": "adam-eigenbasis",
            },
            stop={"max_steps": 60},
            max_failures=1,
            eval_every=60,
            checkpoint={"every_steps": 10, "keep": 10},  # keep them all: the resumed one is read
        )
    )
    box: dict[str, JobResult] = {}

    thread = threading.Thread(
        target=lambda: box.setdefault(
            "result",
            run_job(spec, storage_path=tmp_path / "a", run_name="killed", progress=False),
        )
    )
    thread.start()
    # Minutes: under a loaded machine (the suite's other worker starting Ray heads) the first
    # worker group can take a minute or more to start.
    deadline = time.monotonic() + 300
    killed: dict[str, Any] | None = None
    while killed is None and time.monotonic() < deadline and thread.is_alive():
        if any(r["step"] >= 20 for r in records("killed", "checkpoint")):
            # Kill rank 1 of the first worker group, by its pid, mid-run.
            killed = next(r for r in records("killed", "worker") if r["rank"] == 1)
            os.kill(killed["pid"], signal.SIGKILL)
        time.sleep(0.05)
    ended = not thread.is_alive()
    thread.join(timeout=600)
    assert killed is not None, (
        "the job finished before a worker could be killed"
        if ended
        else "no checkpoint at step 20 or later within 300 s"
    )
    result = box["result"]
    assert result.succeeded, result.error
    assert result.metrics["step"] == 60

    starts = records("killed", "start")
    assert len(starts) == 2, starts  # the first attempt and the resumed one
    resumed = starts[1]
    # The newest checkpoint Ray Train held when the worker died: the newest checkpoint record
    # before the restart (Ray Train's controller sends one once it holds the checkpoint), at
    # step 20 or later (the worker was killed once one at 20 was recorded).
    held = [c for c in records("killed", "checkpoint") if c["seq"] < resumed["seq"]]
    assert resumed["from_step"] == held[-1]["step"] >= 20
    assert resumed["resumed_from"] == held[-1]["path"]
    assert resumed["from_step"] < 60
    assert len(records("killed", "worker")) == 4  # two workers, started twice
    assert all(r.get("damping") is None for r in records("killed", "step"))  # quadratic's only

    # An uninterrupted run from that same checkpoint ends with identical parameters.
    again = run_job(
        spec,
        storage_path=tmp_path / "b",
        resume_from=resumed["resumed_from"],
        progress=False,
    )
    assert again.succeeded, again.error
    assert again.metrics["step"] == 60
    ours, theirs = _final_model(result), _final_model(again)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name

    # Whole tensors, in one process's format: a LeNet and SGD of its own load them.
    assert result.checkpoint is not None
    final = load_checkpoint_file(result.checkpoint)
    model = LeNetCNN()
    model.load_state_dict(final["model"])
    torch.optim.SGD(model.parameters(), lr=0.004).load_state_dict(final["optimizer"])
    test_x, test_y = load_idx_dataset(None, "test", limit=LIMIT)
    assert evaluate(model, test_x, test_y) == pytest.approx(result.metrics["test_accuracy"])


def test_two_worker_quadratic_model_job_end_to_end(ray_head: RayHead, tmp_path: Path) -> None:
    """A 2-worker K-FAC job with ``kfac.update: quadratic-model``: the records (both workers,
    every 10th step, the evaluations, followed by the driver), a checkpoint that reproduces
    the reported accuracy and restores K-FAC; K-FAC takes each step itself (its α in the step
    records), the loss falls, and the step-20 checkpoint holds λ and δ₀. (A resume from it,
    bit for bit, through the worker's loop: ``test_train_loop.py``; a Ray Train job resumed,
    bit for bit, the killed worker's above.)"""
    kfac = {"factor_update_steps": 1, "inv_update_steps": 5, "update": "quadratic-model"}
    spec = parse_job_spec(job(kfac={**kfac, "factor_samples": 16}))
    result = run_job(spec, storage_path=tmp_path / "a", run_name="qm", progress=False)
    assert result.succeeded, result.error
    assert result.metrics["step"] == 40
    assert result.metrics["finished"] is True

    # The progress sink saw both workers, every 10th step, and the evaluations.
    assert sorted(r["rank"] for r in records("qm", "worker")) == [0, 1]
    steps = records("qm", "step")
    assert [r["step"] for r in steps] == [10, 20, 30, 40]
    assert all(r["samples_per_s"] > 0 and r["kfac_ms_per_step"] > 0 for r in steps)
    evals = records("qm", "eval")
    assert [r["step"] for r in evals] == [20, 40]
    assert [e.wire() for e in result.evals] == evals  # the driver followed the sink meanwhile
    assert evals[-1]["test_loss"] < evals[0]["test_loss"]

    # The checkpoint loads: the model reproduces the reported accuracy, K-FAC state restores.
    assert result.checkpoint is not None
    final = load_checkpoint_file(result.checkpoint)
    assert final["step"] == 40
    assert final["sampler"] == {"epoch": 2, "batch": 8, "seed": 3}  # 2048/2/64 = 16 per epoch
    assert len(final["rng"]) == 2
    model = LeNetCNN()
    model.load_state_dict(final["model"])
    test_x, test_y = load_idx_dataset(None, "test", limit=LIMIT)
    assert evaluate(model, test_x, test_y) == pytest.approx(result.metrics["test_accuracy"])
    preconditioner = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=5)
    preconditioner.load_state_dict(final["preconditioner"])
    assert preconditioner.steps == 40

    assert all(r["lr"] > 0 for r in steps), [r["lr"] for r in steps]  # the model's α
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"], [r["loss"] for r in steps]
    at_20 = next(r for r in records("qm", "checkpoint") if r["step"] == 20)
    state = load_checkpoint_file(at_20["path"])["quadratic_model"]
    assert state["steps"] == 20
    assert state["previous"] is not None
    assert state["damping"] != 0.1  # the Levenberg-Marquardt rule moved it (every 5 steps)
    # The step records carry λ and μ as they were after the record's last step.
    (record_20,) = [r for r in steps if r["step"] == 20]
    assert record_20["damping"] == state["damping"]
    assert all(isinstance(r["momentum"], float) for r in steps), steps


@pytest.mark.gpu
@pytest.mark.parametrize("workers", [1, 2], ids=["1-gpu", "2-gpus-nccl"])
def test_gpu_job_trains_on_cuda(ray_head: RayHead, tmp_path: Path, workers: int) -> None:
    if torch.cuda.device_count() < workers:
        pytest.skip(f"needs {workers} GPUs (NCCL will not put two ranks on one GPU)")
    spec = job(
        name="gpu",
        dataset={"name": "synthetic", "batch_size": 64, "limit": 2048},
        scaling={"workers": workers, "gpus_per_worker": 1},
        stop={"max_steps": 30},
        eval_every=10,
        checkpoint={"every_steps": 10, "keep": 2},
    )
    result = run_job(parse_job_spec(spec), storage_path=tmp_path, progress=False)
    assert result.succeeded, result.error
    assert result.metrics["step"] == 30
    devices = [r["device"] for r in records(result.run_name, "worker")]
    assert len(devices) == workers
    assert all(d.startswith("cuda") for d in devices)
    assert result.checkpoint is not None
    assert load_checkpoint_file(result.checkpoint)["step"] == 30


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpu_mixed_precision_job_with_kfac_auto(
    ray_head: RayHead, tmp_path: Path, precision: str
) -> None:
    spec = job(
        name=f"gpu-{precision}",
        dataset={"name": "fashion-mnist", "batch_size": 64, "limit": 2048},
        kfac={"strategy": "auto", "kfac_approx": "reduce"},
        precision=precision,
        memory_budget="4GiB",
        scaling={"workers": 1, "gpus_per_worker": 1},
        stop={"max_steps": 40},
        eval_every=20,
    )
    result = run_job(parse_job_spec(spec), storage_path=tmp_path, progress=False)
    assert result.succeeded, result.error
    (tuning,) = records(result.run_name, "tuner")
    assert tuning["base_memory_bytes"] > 0  # the CUDA allocator's peak
    steps = records(result.run_name, "step")
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"]
    assert result.checkpoint is not None
    state = load_checkpoint_file(result.checkpoint)
    assert ("scale" in state["scaler"]) == (precision == "fp16")  # fp16 trains with a scaler


def test_ray_job_submit_runs_the_train_command_which_stops_at_its_target(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """``kaisa-ray train`` as a Ray Job's entrypoint; the job stops as soon as its target
    accuracy is met (evaluations every 5 steps, far below its 5 epochs). Its optimizer is a
    peer's, SOAP (heavyball), on 2 workers: DDP averages the gradients, each worker runs
    SOAP's own step on them."""
    spec = job(
        name="submitted",
        optimizer={"name": "soap", "lr": 3e-3},
        kfac="off",
        stop={"max_epochs": 5, "target": {"metric": "test_accuracy", "value": 0.5}},
        eval_every=5,
    )
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(spec))
    repo = Path(__file__).resolve().parents[2]
    submission_id = f"kaisa-ray-test-{secrets.token_hex(4)}"
    run = f"submitted-{secrets.token_hex(4)}"
    submit = [
        RAY,
        "job",
        "submit",
        f"--address={ray_head.dashboard_url}",
        f"--submission-id={submission_id}",
        "--working-dir=.",
        "--",
        "kaisa-ray",
        "train",
        f"--config={config}",
        f"--storage-path={tmp_path / 'runs'}",
        f"--run-name={run}",
    ]
    done = subprocess.run(
        submit, cwd=repo, env=ray_head.client_env(), capture_output=True, text=True, timeout=240
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    client = JobSubmissionClient(ray_head.dashboard_url)
    assert client.get_job_status(submission_id) == JobStatus.SUCCEEDED
    # It stopped at the first evaluation that met the target, well before its 5 epochs.
    step = int(re.search(r"run \S+ finished at step (\d+), test accuracy", output)[1])  # type: ignore[index]
    assert step < 5 * 16
    assert step % 5 == 0
    accuracies = [r["test_accuracy"] for r in records(run, "eval")]
    assert [r["step"] for r in records(run, "eval")][-1] == step
    assert accuracies[-1] >= 0.5
    assert all(a < 0.5 for a in accuracies[:-1])
    # Ray Train's INFO lines stay in its log files (ray_logs.py).
    assert "Started training worker group" not in output
    assert "Reporting training result" not in output

    # Without the cluster's token the job server refuses the client.
    refused = subprocess.run(
        [RAY, "job", "list", f"--address={ray_head.dashboard_url}"],
        env=ray_head.client_env(with_token=False),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0
    assert "RAY_AUTH_TOKEN" in refused.stdout + refused.stderr


@pytest.mark.parametrize(
    ("change", "field", "fix"),
    [
        ({"model": {"name": "transformer"}}, "model.name", "choose one of"),
        (
            {"dataset": {"name": "mnist", "data_dir": "/nonexistent/mnist"}},
            "dataset",
            "set data_dir",
        ),
        (
            {"dataset": {"name": "fashion-mnist", "data_dir": "/nonexistent/fm"}},
            "dataset",
            "apt-get install dataset-fashion-mnist",
        ),
        ({"memory_budget": "lots"}, "memory_budget", "'2GiB'"),
        ({"scaling": {"workers": 0}}, "scaling.workers", "greater than 0"),
    ],
)
def test_bad_specs_fail_before_anything_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: dict[str, Any],
    field: str,
    fix: str,
) -> None:
    def no_ray() -> None:
        raise AssertionError("a bad spec reached Ray")

    monkeypatch.setattr("kaisa_train.job.ensure_ray", no_ray)
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(job(**change)))
    done = CliRunner().invoke(main, ["train", f"--config={config}"])
    assert done.exit_code == 1, done.output
    assert f"  - {field}" in done.output, done.output
    assert fix in done.output, done.output
