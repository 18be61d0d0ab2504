"""The train loop's parts that need no Ray workers: schedules, sampler positions, the sink store,
and a quadratic-model job's resume through the worker's loop in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.capturing_session import CapturingSession

from kaisa_ray.errors import ConfigurationError
from kaisa_train.job import run_job
from kaisa_train.optimizers import build_optimizer, lr_factor
from kaisa_train.progress import ProgressStore
from kaisa_train.records import StepRecord
from kaisa_train.session import LocalSession
from kaisa_train.shard import load_shard
from kaisa_train.spec import OptimizerSpec, ScheduleSpec, parse_job_spec
from kaisa_train.state import CHECKPOINT_FILE, load_checkpoint_file
from kaisa_train.trainer import unique_run_name
from kaisa_train.worker import Window, train
from kaisa_train.worker_config import TrainConfig


def spec(**overrides: Any) -> Any:
    data: dict[str, Any] = {
        "name": "unit",
        "model": {"name": "mlp"},
        "dataset": {"name": "synthetic", "batch_size": 16, "limit": 200},
        "stop": {"max_steps": 10},
    }
    data.update(overrides)
    return parse_job_spec(data)


def test_warmup_then_cosine_reaches_zero_at_the_last_step() -> None:
    f = lr_factor(ScheduleSpec(kind="cosine", warmup_steps=4), total_steps=14)
    assert [f(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.5)
    assert f(14) == pytest.approx(0.0, abs=1e-12)
    assert f(20) == pytest.approx(0.0, abs=1e-12)  # stays at the end, never rises again


def test_step_schedule_and_constant() -> None:
    f = lr_factor(ScheduleSpec(kind="step", step_every=3, gamma=0.5), total_steps=100)
    assert [f(s) for s in range(7)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]
    g = lr_factor(ScheduleSpec(), total_steps=100)
    assert {g(s) for s in range(50)} == {1.0}


@pytest.mark.parametrize(
    ("name", "kind"),
    [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)],
)
def test_optimizers(name: str, kind: type) -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    optimizer = build_optimizer(OptimizerSpec(name=name, lr=0.01, weight_decay=0.1), params)  # type: ignore[arg-type]
    assert isinstance(optimizer, kind)
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert optimizer.param_groups[0]["weight_decay"] == 0.1


def test_shards_are_disjoint_and_each_step_reads_a_fixed_batch() -> None:
    job = spec()
    shards = [load_shard(job.dataset, job.seed, rank, 2) for rank in range(2)]
    assert shards[0].steps_per_epoch == 100 // 16
    # Both ranks' batches of one step are disjoint; together they cover fresh rows.
    x0, _ = shards[0].batch(1)
    x1, _ = shards[1].batch(1)
    rows0 = {tuple(r.flatten()[:8].tolist()) for r in x0}
    rows1 = {tuple(r.flatten()[:8].tolist()) for r in x1}
    assert not rows0 & rows1
    # The batch of a step does not depend on what was read before (sampler position = step).
    late = load_shard(job.dataset, job.seed, 0, 2)
    assert torch.equal(late.batch(14)[0], shards[0].batch(14)[0])
    assert shards[0].position(14) == (2, 1)
    # A new epoch is a new permutation.
    assert not torch.equal(shards[0].batch(1)[0], shards[0].batch(7)[0])


def test_batch_larger_than_the_shard_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="lower batch_size"):
        load_shard(
            spec(dataset={"name": "synthetic", "batch_size": 64, "limit": 100}).dataset, 0, 0, 2
        )


def test_window_record() -> None:
    w = Window(steps=2, loss=3.0, correct=24, samples=32, step_s=0.5)
    w.add_kfac({"factors": 0.04, "decompositions": 0.0, "precondition": 0.05})
    w.add_kfac({"communication": 0.01})
    record = w.record(step=20, epoch=1, lr=0.1, world=2)
    assert record.loss == 1.5
    assert record.accuracy == 0.75
    assert record.samples_per_s == pytest.approx(128.0)
    assert record.ms_per_step == pytest.approx(250.0)
    assert record.kfac_ms_per_step == pytest.approx(50.0)
    assert record.kfac_factors_ms == pytest.approx(20.0)
    assert record.kfac_communication_ms == pytest.approx(5.0)
    assert record.kfac_decompositions_ms == 0.0
    # On the wire: every field, with its kind.
    assert record.wire()["kind"] == "step"
    assert record.wire()["kfac_precondition_ms"] == pytest.approx(25.0)


def test_progress_store_sequences_filters_and_bounds() -> None:
    store = ProgressStore(max_records=3, max_runs=2)
    assert store.push("a", [{"kind": "step", "step": s} for s in range(5)]) == 5
    page = store.read("a")
    assert [r["step"] for r in page["records"]] == [2, 3, 4]  # the newest three
    assert [r["seq"] for r in page["records"]] == [2, 3, 4]
    assert page["next"] == 5
    store.push("a", [{"kind": "eval", "step": 5}])
    assert [r["step"] for r in store.read("a", since=4)["records"]] == [4, 5]
    assert [r["kind"] for r in store.read("a", kinds=["eval"])["records"]] == ["eval"]
    store.push("b", [{"kind": "step"}])
    store.push("c", [{"kind": "step"}])
    assert store.runs() == ["b", "c"]  # the oldest run was dropped
    assert store.read("a") == {"run": "a", "records": [], "next": 0}
    assert store.forget("b")
    assert not store.forget("b")
    with pytest.raises(ValueError, match="at least 1"):
        ProgressStore(max_records=0)


def test_the_sigint_handler_before_a_fit_is_back_after_it() -> None:
    """Ray Train's ``fit()`` in the main thread installs a SIGINT handler that holds its run's
    controller; ``sigint_kept`` puts back the one before, also when the fit raises, and does
    nothing in another thread (where ``fit()`` installs none)."""
    import signal
    import threading

    from kaisa_train.trainer import sigint_kept

    def ours(signum: int, frame: object) -> None: ...

    def rays(signum: int, frame: object) -> None: ...

    before = signal.signal(signal.SIGINT, ours)
    try:
        with sigint_kept():
            signal.signal(signal.SIGINT, rays)
        assert signal.getsignal(signal.SIGINT) is ours

        def failing_fit() -> None:
            with sigint_kept():
                signal.signal(signal.SIGINT, rays)
                raise RuntimeError("the workers failed")

        with pytest.raises(RuntimeError, match="the workers failed"):
            failing_fit()
        assert signal.getsignal(signal.SIGINT) is ours
        entered: list[bool] = []

        def elsewhere() -> None:
            with sigint_kept():
                entered.append(True)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        assert entered == [True]
    finally:
        signal.signal(signal.SIGINT, before)


def test_run_names_are_unique() -> None:
    names = {unique_run_name("job") for _ in range(100)}
    assert len(names) == 100
    assert all(n.startswith("job-") for n in names)


def test_run_job_refuses_bad_arguments_before_starting_ray(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="not a kaisa-ray checkpoint"):
        run_job(spec(), storage_path=tmp_path, resume_from=tmp_path)
    with pytest.raises(ConfigurationError, match="run name"):
        run_job(spec(), storage_path=tmp_path, run_name="../escape")
    with pytest.raises(ConfigurationError, match="progress_every"):
        run_job(spec(), storage_path=tmp_path, progress_every=0)
    with pytest.raises(ConfigurationError, match=r"no state\.pt"):
        load_checkpoint_file(tmp_path)


class _Keeping(LocalSession):
    """This process, keeping the checkpoints it is given as a file would (torch.save)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(lambda _record: None)
        self.keeps_checkpoints = True
        self.folder = folder
        self.saved: list[Path] = []

    def report(self, metrics: dict[str, Any], state: dict[str, Any] | None) -> None:
        if state is not None:
            path = self.folder / f"{len(self.saved)}" / CHECKPOINT_FILE
            path.parent.mkdir()
            torch.save(state, path)
            self.saved.append(path.parent)


def test_a_checkpoint_loads_with_torch_s_weights_only_loader(tmp_path: Path) -> None:
    """Everything a checkpoint holds is what ``torch.load(weights_only=True)`` reads: no
    class of the project (an enum as a key of the best metrics once made every resume fail)."""
    spec = parse_job_spec(
        {
            "name": "kept",
            "model": {"name": "mlp"},
            "dataset": {"name": "synthetic", "batch_size": 16, "limit": 64},
            "kfac": {"strategy": "comm-opt", "factor_update_steps": 1, "inv_update_steps": 2},
            "stop": {"max_steps": 4, "target": {"metric": "test_accuracy", "value": 0.99}},
            "eval_every": 2,
            "checkpoint": {"every_steps": 2},
        }
    )
    session = _Keeping(tmp_path)
    train(TrainConfig(spec=spec, run="kept"), session)
    assert session.saved
    state = load_checkpoint_file(session.saved[-1])
    assert set(state["best"]) == {"test_accuracy"}
    assert type(next(iter(state["best"]))) is str


def test_a_quadratic_model_job_resumed_from_its_checkpoint_ends_bit_for_bit() -> None:
    """``kfac.update: quadratic-model`` through the worker's loop in this process: the
    checkpoint at step 20 holds the step's state (λ moved by Levenberg-Marquardt, the last
    direction δ₀), the step records carry λ as it was then, and a job resumed from it ends
    with the parameters of the run that was not stopped. (On Ray Train's 2 workers, the
    records and the checkpoint: ``test_ray_train.py``.)"""
    job = spec(
        model={"name": "lenet"},
        dataset={"name": "synthetic", "batch_size": 32, "limit": 512},
        kfac={
            "factor_update_steps": 1,
            "inv_update_steps": 5,
            "update": "quadratic-model",
            "factor_samples": 16,
        },
        stop={"max_steps": 40},
        eval_every=20,
        checkpoint={"every_steps": 20},
    )
    whole = CapturingSession()
    train(TrainConfig(spec=job, run="qm", progress_every=10), whole)
    state = whole.saved[20]["quadratic_model"]
    assert state["steps"] == 20
    assert state["previous"] is not None
    assert state["damping"] != job.kfac.damping  # type: ignore[union-attr]
    steps = [r for r in whole.records if isinstance(r, StepRecord)]
    (record_20,) = [r for r in steps if r.step == 20]
    assert record_20.damping == state["damping"]
    assert all(r.lr > 0 for r in steps)  # the model's α

    resumed = CapturingSession(whole.saved[20])
    train(TrainConfig(spec=job, run="qm", progress_every=10), resumed)
    final = whole.saved[40]["model"]
    for name, tensor in resumed.saved[40]["model"].items():
        assert torch.equal(tensor, final[name]), name
