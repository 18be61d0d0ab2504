"""The stored shapes (``kaisa_train/shape_table.json``) against the meta pass they stand in
for: the same workload at batch sizes they were not stored at, the file as the code writes it
today, the same plan from either, and ``kaisa-ray plan`` answering without importing torch."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kaisa_train import planning, shape_table
from kaisa_train.planning import PlanRequest, plan_job
from kaisa_train.shape_table import stored_workload
from kaisa_train.shapes import table, workload
from tuner.forecast import Workload

ROOT = Path(__file__).resolve().parents[2]
STORED = sorted(json.loads(shape_table.TABLE.read_text()))


def comparable(job: Workload) -> dict[str, object]:
    """Everything a workload says, its layers as (name, a, g, groups, dtypes by name)."""
    out = dataclasses.asdict(job)
    out["layers"] = [
        (x.name, x.a_dim, x.g_dim, x.groups, *(str(d).removeprefix("torch.") for d in dtypes))
        for x in job.layers
        for dtypes in [(x.factor_dtype, x.inv_dtype, x.grad_dtype)]
    ]
    return out


def test_the_table_lists_the_built_in_models_that_can_be_planned() -> None:
    assert STORED == ["bert-large", "char-transformer", "lenet", "mlp", "resnet20", "resnet50"]


@pytest.mark.parametrize("name", STORED)
@pytest.mark.parametrize(
    ("batch", "approx", "precision"),
    [(3, "expand", "fp32"), (24, "reduce", "bf16")],
)
def test_the_stored_workload_is_the_meta_pass_at_batches_it_was_not_stored_at(
    name: str, batch: int, approx: str, precision: str
) -> None:
    options = {"kfac_approx": approx, "precision": precision, "compute_method": "inverse"}
    stored = stored_workload(name, batch_size=batch, **options)
    assert stored is not None
    assert comparable(stored) == comparable(workload(name, batch_size=batch, **options))


def test_the_stored_file_is_what_the_code_writes_today() -> None:
    """A model's code that changed its layers, rows or activations without the table being
    rewritten fails here, with the command that rewrites it."""
    assert json.loads(shape_table.TABLE.read_text()) == table(), (
        "kaisa_train/shape_table.json is stale: run "
        "`.venv/bin/python -m kaisa_train.shapes --write`"
    )


def test_what_the_table_does_not_hold_goes_to_the_meta_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert stored_workload("bert-large", batch_size=8, params={"seq_len": 128}) is None
    assert stored_workload("resnet50", batch_size=8, skip_layers=["fc"]) is None
    assert stored_workload("char-transformer", batch_size=8, embeddings=True) is None
    monkeypatch.setattr(shape_table, "TABLE", Path("/nonexistent/shape_table.json"))
    shape_table._table.cache_clear()
    try:
        assert stored_workload("resnet50", batch_size=8) is None
        job = planning.workload("resnet50", batch_size=8, kfac_approx="reduce")
        assert len(job.layers) == 54
    finally:
        monkeypatch.undo()
        shape_table._table.cache_clear()
    short = planning.workload("bert-large", batch_size=2, params={"seq_len": 16})
    assert short.seq_len == 16


@pytest.mark.parametrize(
    ("model", "workers", "batch"), [("resnet50", 64, 32), ("bert-large", 1024, 8)]
)
def test_a_plan_from_the_table_equals_the_plan_from_the_meta_pass(
    monkeypatch: pytest.MonkeyPatch, model: str, workers: int, batch: int
) -> None:
    request = PlanRequest(
        model=model,
        batch_size=batch,
        workers=workers,
        hardware="a100-80gb-hdr",
        budgets=(40 * 2**30,),
        intervals=((1, 10), (10, 100)),
    )
    stored = plan_job(request).to_json()
    monkeypatch.setattr(planning, "stored_workload", lambda *args, **kwargs: None)
    assert plan_job(request).to_json() == stored


def test_kaisa_ray_plan_answers_without_importing_torch() -> None:
    """The command in a fresh process where any import of torch fails."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('planning imported ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from service.cli import main\n"
        "sys.argv = ['kaisa-ray', *sys.argv[1:]]\n"
        "main()\n"
    )
    command = ["plan", "--model", "bert-large", "--workers", "4096", "--batch", "8", "--json"]
    done = subprocess.run(
        [sys.executable, "-c", blocker, *command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["model"]["kfac_layers"] == 146
    assert report["choices"][0]["chosen"] is not None
