"""``kaisa-ray plan`` and ``kaisa-ray measure-node`` through the real command line (click's
runner on the ``kaisa-ray`` entry point): the JSON and the table, the figures against
``plan()`` and ``choose()``, job files, budget sweeps, bad input. No Ray, no GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from kaisa_ray.plan import plan
from kaisa_train.planning import HARDWARE_DIR, hardware_names, load_hardware
from kaisa_train.shapes import workload
from service.cli import main
from tuner.choice import NoFeasibleCandidateError, choose
from tuner.forecast import forecast_profile
from tuner.hardware import OVERHEAD_OPERATIONS

GB = 10**9


def kaisa_ray(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def plan_json(*args: str) -> dict[str, Any]:
    result = kaisa_ray("plan", *args, "--json")
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.output)
    return report


@pytest.fixture(scope="module")
def resnet64() -> dict[str, Any]:
    return plan_json(
        "--model", "resnet50", "--workers", "64", "--batch", "32", "--budget", "40GB",
        "--budget", "4.4GiB", "--intervals", "1/10,10/100",
    )  # fmt: skip


def test_every_strategy_of_the_world_size_is_priced(resnet64: dict[str, Any]) -> None:
    fractions = [s["grad_worker_fraction"] for s in resnet64["strategies"]]
    assert fractions == [d / 64 for d in (1, 2, 4, 8, 16, 32, 64)]
    assert resnet64["strategies"][0]["strategy"] == "MEM-OPT"
    assert resnet64["strategies"][-1]["strategy"] == "COMM-OPT"
    assert resnet64["strategies"][3]["strategy"] == "HYBRID-OPT 1/8"
    inputs = resnet64["inputs"]
    assert (inputs["nodes"], inputs["gpus_per_node"], inputs["hardware"]) == (8, 8, "a100-80gb-hdr")
    for strategy in resnet64["strategies"]:
        pairs = [(c["factor_update_steps"], c["inv_update_steps"]) for c in strategy["candidates"]]
        assert pairs == [(1, 10), (10, 100)]


def test_memory_and_collectives_are_the_plans(resnet64: dict[str, Any]) -> None:
    layers = list(workload("resnet50", batch_size=32).layers)
    factors = sum(4 * (x.a_dim**2 + x.g_dim**2) for x in layers)
    gradients = sum(4 * x.a_dim * x.g_dim for x in layers)
    for strategy in resnet64["strategies"]:
        ranks = plan(layers, 64, strategy["grad_worker_fraction"]).ranks
        assert strategy["memory"] == max((r.memory for r in ranks), key=lambda m: m["total"])
        collectives = strategy["collectives"]
        assert collectives["factors"]["bytes"] == factors  # every factor, all-reduced whole
        assert collectives["factors"]["nodes_spanned"] == 8
    by_name = {s["strategy"]: s["collectives"] for s in resnet64["strategies"]}
    assert by_name["COMM-OPT"]["gradients"]["bytes"] == 0  # nothing to broadcast per step
    assert by_name["MEM-OPT"]["gradients"]["bytes"] == gradients  # every layer's, to everyone
    assert by_name["MEM-OPT"]["decompositions"]["bytes"] == 0
    # HYBRID 1/8: receiver rows of 8 consecutive ranks (one node), columns across 8 nodes.
    assert by_name["HYBRID-OPT 1/8"]["gradients"]["nodes_spanned"] == 1
    assert by_name["HYBRID-OPT 1/8"]["decompositions"]["nodes_spanned"] == 8


def test_the_choice_is_choose_on_the_forecast(resnet64: dict[str, Any]) -> None:
    hardware = load_hardware("a100-80gb-hdr")
    profile, _ = forecast_profile(workload("resnet50", batch_size=32), hardware, 64)
    for choice in resnet64["choices"]:
        if choice["chosen"] is None:
            with pytest.raises(NoFeasibleCandidateError, match="no strategy fits"):
                choose(profile, choice["budget_bytes"], intervals=((1, 10), (10, 100)))
            continue
        decision = choose(profile, choice["budget_bytes"], intervals=((1, 10), (10, 100)))
        assert choice["chosen"]["grad_worker_fraction"] == decision.chosen.grad_worker_fraction
        assert choice["chosen"]["inv_update_steps"] == decision.chosen.inv_update_steps
        assert choice["chosen"]["step_s"] == pytest.approx(decision.chosen.step_s, rel=1e-12)
        parts = choice["chosen"]["parts_s"]
        assert choice["chosen"]["step_s"] == pytest.approx(profile.step_s + sum(parts.values()))


def test_the_budgets_where_the_choice_changes(resnet64: dict[str, Any]) -> None:
    hardware = load_hardware("a100-80gb-hdr")
    profile, _ = forecast_profile(workload("resnet50", batch_size=32), hardware, 64)
    changes = resnet64["changes"]
    assert changes
    budgets = [c["from_budget_bytes"] for c in changes]
    assert budgets == sorted(budgets)
    for change in changes:
        at = choose(profile, change["from_budget_bytes"], intervals=((1, 10), (10, 100))).chosen
        assert at.grad_worker_fraction == change["grad_worker_fraction"]
        below = change["from_budget_bytes"] - 1
        fits = [
            c for s in resnet64["strategies"] for c in s["candidates"] if c["memory_bytes"] <= below
        ]
        if change is changes[0]:
            assert not fits  # below the first change nothing fits at all
    # 4.4 GiB is below every candidate's need: the plan says what would fit.
    tight = next(c for c in resnet64["choices"] if c["budget_bytes"] == int(4.4 * 2**30))
    assert tight["chosen"] is None
    assert "no strategy fits the memory budget 4.400 GiB" in tight["reason"]  # choose()'s
    assert "skip_layers the largest: layer4.2.conv2" in tight["reason"]


def test_the_table_names_every_part() -> None:
    result = kaisa_ray(
        "plan", "--model", "resnet50", "--workers", "16", "--batch", "32", "--budget", "40GB"
    )
    assert result.exit_code == 0, result.output
    text = result.output
    assert "16 x NVIDIA A100-SXM4-80GB (a100-80gb-hdr): 2 node(s) of 8" in text
    assert "plain step 34.1 ms (938 samples/s (benchmark: NVIDIA DeepLearningExamples" in text
    for heading in (
        "K-FAC memory per GPU (worst rank, MiB) and collectives (busiest rank)",
        "Predicted time per step (slowest rank), ms",
        "The tuner's choice (tuner.choice.choose on this forecast)",
        "Where the choice changes as the budget grows:",
    ):
        assert heading in text
    assert "COMM-OPT" in text
    assert "MEM-OPT" in text
    assert "budget 37.25 GiB:" in text  # 40 GB
    lines = text.splitlines()
    timing = lines.index("Predicted time per step (slowest rank), ms")
    assert lines[timing + 1].split() == [
        "strategy", "intervals", "step", "plain", "factors", "decomp.", "precond.", "comm.",
        "K-FAC", "GiB/GPU",
    ]  # fmt: skip
    assert len(lines) > timing + 1 + 5 * 3  # 5 fractions of 16 x 3 interval pairs


def test_bert_large_phase_one_as_kaisa_ran_it() -> None:
    report = plan_json(
        "--model", "bert-large", "--seq-len", "128", "--workers", "8", "--batch", "96",
        "--accumulation", "86", "--precision", "fp16", "--optimizer", "lamb",
        "--intervals", "1/10", "--budget", "40GB",
    )  # fmt: skip
    inputs = report["inputs"]
    assert inputs["skip_layers"] == [r"cls\.predictions"]
    assert "BERT-PyTorch" in inputs["skip_layers_source"]
    assert (inputs["seq_len"], inputs["accumulation_steps"]) == (128, 86)
    assert report["model"]["kfac_layers"] == 146
    assert report["model"]["fp32_factor_bytes"] == pytest.approx(3.95 * 2**30, rel=1e-3)
    # 86 micro-batches of 96 at the cited 580 sequences per second
    assert report["basis"]["plain_step_s"] == pytest.approx(86 * 96 / 580)


def test_bert_large_with_its_tokens_reduced_prices_one_row_a_sequence() -> None:
    """``--sequence-approx reduce``: the plan says so and its factor time is the products over
    the sequences, less than over every token; memory for the factors is the same."""
    args = ("--model", "bert-large", "--seq-len", "128", "--workers", "8", "--batch", "32")
    expand = plan_json(*args)
    reduce = plan_json(*args, "--sequence-approx", "reduce")
    assert (expand["inputs"]["sequence_approx"], reduce["inputs"]["sequence_approx"]) == (
        "expand",
        "reduce",
    )
    assert reduce["basis"]["factor_s"] < expand["basis"]["factor_s"]
    assert reduce["model"]["fp32_factor_bytes"] == expand["model"]["fp32_factor_bytes"]
    text = kaisa_ray("plan", *args, "--sequence-approx", "reduce")
    assert "reduce tokens" in text.output


def test_a_job_file_is_planned_with_its_own_settings(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "imagenet-kfac",
                "model": {"name": "resnet50"},
                "dataset": {"name": "synthetic", "batch_size": 32},
                "kfac": {"strategy": "auto", "intervals": [[10, 100]], "kfac_approx": "expand"},
                "memory_budget": "20GiB",
                "scaling": {"workers": 16},
                "stop": {"max_steps": 100},
            }
        )
    )
    report = plan_json("--config", str(job), "--hardware", "h100-80gb-ndr")
    assert report["inputs"]["workers"] == 16
    assert report["inputs"]["intervals"] == [[10, 100]]
    assert [c["budget_bytes"] for c in report["choices"]] == [20 * 2**30]
    assert report["inputs"]["gpu"] == "NVIDIA H100-SXM5-80GB"
    # --workers overrides the job's: the same job on 128 GPUs
    bigger = plan_json("--config", str(job), "--workers", "128")
    assert bigger["inputs"]["workers"] == 128
    assert len(bigger["strategies"]) == 8


def test_a_sharded_job_is_planned_with_its_gather_and_its_shards(tmp_path: Path) -> None:
    """``--parallel fsdp`` (or a JobSpec's ``scaling.parallel: fsdp``): every strategy moves
    every rank's gradient rows every step (COMM-OPT all-gathers them, the others gather them
    to the layers' workers and add up the KL clip's sums; priced, and said in the text),
    a GPU holds 1/W of the parameters, gradients and optimizer state, and the step's
    temporaries grow by the gathered and the whole gradients (``tuner.forecast.memory_basis``),
    under MEM-OPT and HYBRID-OPT only those of the busiest worker's layers."""
    args = ["--model", "resnet50", "--workers", "8", "--batch", "32", "--intervals", "10/100"]
    ddp, fsdp = plan_json(*args), plan_json(*args, "--parallel", "fsdp")
    assert "parallel" not in ddp["inputs"]  # as before FSDP2 (the pinned figures' reports)
    assert fsdp["inputs"]["parallel"] == "fsdp"
    layers = list(workload("resnet50", batch_size=32).layers)
    rows = sum(-(-layer.groups * layer.g_dim // 8) * layer.a_dim for layer in layers)
    for plain, sharded in zip(ddp["strategies"], fsdp["strategies"], strict=True):
        assert "gradient_rows" not in plain["collectives"]
        gather = sharded["collectives"]["gradient_rows"]
        if sharded["grad_workers"] == 8:  # COMM-OPT: one all-gather of every layer's rows
            assert (gather["bytes"], gather["calls"]) == (4 * rows, 1)
        else:  # each rank's rows of every layer to its worker, the sums, whether finite
            assert gather["bytes"] >= 4 * rows + 8 * (len(layers) + 1)
            assert sharded["collectives"]["gradients"]["bytes"] == 4 * rows  # rows scattered
        (a,), (b,) = plain["candidates"], sharded["candidates"]
        if sharded["grad_workers"] == 8:  # COMM-OPT: the all-gather beside DDP's calls
            assert b["parts_s"]["communication"] > a["parts_s"]["communication"]
        else:  # priced, whether more than DDP's broadcasts of whole gradients or less
            assert b["parts_s"]["communication"] > 0
        assert sharded["memory"] == plain["memory"]  # K-FAC's own state is DDP's
    base, sharded_base = ddp["basis"], fsdp["basis"]
    assert sharded_base["base_memory_bytes"] < base["base_memory_bytes"]
    assert sharded_base["kfac_transient_bytes"] > base["kfac_transient_bytes"]
    for sharded in fsdp["strategies"]:  # only a layer's workers gather it, but in COMM-OPT
        (c,) = sharded["candidates"]
        step = c["memory_bytes"] - c["kfac_state_bytes"] - sharded_base["base_memory_bytes"]
        if sharded["grad_workers"] == 8:
            assert step == sharded_base["kfac_transient_bytes"]
        else:
            assert base["kfac_transient_bytes"] < step < sharded_base["kfac_transient_bytes"]
    text = kaisa_ray("plan", *args, "--parallel", "fsdp").output
    assert "sharded by FSDP2: each rank's gradient rows gathered to the layers' workers" in text
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "sharded",
                "model": {"name": "resnet50"},
                "dataset": {"name": "synthetic", "batch_size": 32},
                "kfac": {"strategy": "mem-opt", "factor_update_steps": 10},
                "scaling": {"workers": 8, "parallel": "fsdp"},
                "stop": {"max_steps": 100},
            }
        )
    )
    from_job = plan_json("--config", str(job))
    assert from_job["inputs"]["parallel"] == "fsdp"
    assert [s["collectives"]["gradient_rows"] for s in from_job["strategies"]] == [
        s["collectives"]["gradient_rows"] for s in fsdp["strategies"]
    ]
    assert from_job["basis"]["base_memory_bytes"] == sharded_base["base_memory_bytes"]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--model", "resnet50"], 2, "give a job (--config FILE or --spec JSON), or --model"),
        (
            ["--model", "resnet50", "--workers", "8", "--batch", "32", "--hardware", "tpu"],
            1,
            "unknown hardware 'tpu': give a preset (a100-80gb-hdr, h100-80gb-ndr)",
        ),
        (
            ["--model", "resnet50", "--workers", "8", "--batch", "32", "--budget", "forty"],
            2,
            "'forty' is not a size; write e.g. 40GiB",
        ),
        (
            ["--model", "resnet50", "--workers", "8", "--batch", "32", "--intervals", "3/10"],
            1,
            "intervals 3/10: both positive, the inverse interval a multiple",
        ),
        (
            ["--model", "resnet50", "--workers", "8", "--batch", "32", "--param", "depth=101"],
            1,
            "model 'resnet50' does not take these params",
        ),
        (
            ["--model", "resnet50", "--workers", "8", "--batch", "32", "--optimizer", "soap"],
            1,
            "optimizer soap preconditions the gradient itself and runs with kfac: off, so there "
            "is no K-FAC to plan; name one of sgd, adam, adamw, lamb",
        ),
    ],
)
def test_bad_input_is_named(args: list[str], code: int, message: str) -> None:
    result = kaisa_ray("plan", *args)
    assert result.exit_code == code
    assert message in " ".join(result.output.split())


def test_measure_node_needs_a_gpu_or_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the command would measure it")
    result = kaisa_ray("measure-node", "--name", "here")
    assert result.exit_code == 1
    assert "no CUDA device here: measure-node measures a GPU node" in result.output


def measure_node_trial(tmp_path: Path, *, output: bool = True) -> Path:
    """``kaisa-ray measure-node --quick`` on the CPU with two gloo ranks, as profile "trial";
    the file it wrote (the command must succeed): ``--output`` in ``tmp_path``, or (``output``
    false) where it goes by default."""
    out = ["--output", str(tmp_path / "node.yaml")] if output else []
    result = kaisa_ray(
        "measure-node", "--device", "cpu", "--quick", "--ranks", "2", "--name", "trial",
        "--model", "lenet:8", *out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    written = Path(result.output.split("wrote ", 1)[1].split(";", 1)[0])
    assert written.is_file()
    return written


def test_measure_node_writes_a_profile_that_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command end to end on the CPU (``--quick``, two gloo processes for the
    collectives), with no ``--output``: it writes to the user's folder (never into the
    installed package), ``--hardware trial`` finds it there by name, what it wrote loads, its
    numbers are measured here with the date, and only the links between nodes come from the
    base profile."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    shipped = sorted(HARDWARE_DIR.iterdir())
    out = measure_node_trial(tmp_path, output=False)
    assert out == tmp_path / "config" / "kaisa-ray" / "hardware" / "trial.yaml"
    assert sorted(HARDWARE_DIR.iterdir()) == shipped
    assert hardware_names() == ["a100-80gb-hdr", "h100-80gb-ndr"]  # what the service offers
    hardware = load_hardware(out)
    assert hardware.name == "trial"
    measured = {path for path, n in hardware.sources.items() if n.kind == "measured"}
    assert {
        "gpu.memory_bytes", "gpu.kernel_latency_s", "node.gpus", "links.intra_node.latency_s",
        "links.intra_node.allreduce_busbw", "links.intra_node.broadcast_busbw",
    } <= measured  # fmt: skip
    assert any(p.startswith("gpu.eigh_s") for p in measured)
    # K-FAC's own solvers, alone and batched, and its fixed costs on tiny layers
    for method in ("eigen", "inverse"):
        assert {
            f"gpu.decompose_s.{method}({kind})[n=32]" for kind in ("alone", "batched")
        } <= measured
    assert {f"gpu.kfac_overhead_s.{name}" for name in OVERHEAD_OPERATIONS} <= measured
    assert "gpu.extract_elements_per_s" in measured
    assert any(p.startswith("training") and "(lenet, fp32)" in p for p in measured)
    for approx in ("reduce", "expand"):  # lenet's own factor work at the batch it was timed at
        assert any(p.endswith(f".factor_work_s(lenet, 8, {approx})") for p in measured)
    assert all(
        path.startswith(("links.inter_node", "training"))
        for path, n in hardware.sources.items()
        if n.kind != "measured"
    )  # --model lenet:8 measured lenet's step
    assert hardware.node_size == 2
    # every number positive, but a fixed cost may measure 0 (below what it resolves)
    assert all(
        math.isfinite(n.value) and (n.value > 0 or (n.value == 0 and "kfac_overhead" in path))
        for path, n in hardware.sources.items()
    )
    assert "measured by kaisa-ray measure-node on CPU" in hardware.eigh.points[0][1].source
    planned = plan_json(
        "--model", "lenet", "--workers", "2", "--batch", "64", "--hardware", "trial"
    )  # fmt: skip
    assert planned["inputs"]["hardware"] == "trial"
    assert "measured" in planned["basis"]["plain_step_source"]  # lenet's own step
    terms = " ".join(planned["basis"]["terms"])
    assert "the profile's decompose_s table (measured)" in terms
    assert "the profile's kfac_overhead_s" in terms
    assert "lenet's own factor work" not in terms  # measured at batch 8, planned at 64
    at_8 = plan_json(
        "--model", "lenet", "--workers", "2", "--batch", "8", "--hardware", "trial"
    )  # fmt: skip
    assert "lenet's own factor work at batch 8, expand (measured" in " ".join(
        at_8["basis"]["terms"]
    )
    unknown = kaisa_ray("plan", "--model", "lenet", "--workers", "2", "--batch", "64",
                        "--hardware", "tpu")  # fmt: skip
    assert unknown.exit_code == 1
    assert f"a profile of yours in {out.parent} (trial;" in " ".join(unknown.output.split())


def test_measure_node_refuses_a_preset_name() -> None:
    result = kaisa_ray("measure-node", "--device", "cpu", "--name", "a100-80gb-hdr")
    assert result.exit_code == 2
    assert "is a preset's name" in result.output


def test_a_latency_the_fit_cannot_resolve_is_bounded_by_the_smallest_all_reduce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load the a-b fit's intercept can come out at zero (clamped), which a profile
    refuses (latency must be positive): the 4-byte all-reduce's measured time stands in, and
    the source says so. (The collectives are replaced at their seam; the rest is measured.)"""
    import tuner.node

    def collectives(device_type: str, ranks: int) -> tuple[float, float, float, float, float]:
        return 0.0, 2e9, 0.0, 1e9, 3e-5

    monkeypatch.setattr(tuner.node, "_collectives", collectives)
    out = measure_node_trial(tmp_path)
    hardware = load_hardware(out)
    latency = hardware.sources["links.intra_node.latency_s"]
    assert latency.kind == "measured"
    assert "4-byte all-reduce" in latency.source
    assert "not positive" in latency.source
    stored = yaml.safe_load(out.read_text())
    assert stored["links"]["intra_node"]["latency_s"]["value"] == 3e-5


def test_embeddings_are_planned_when_asked_as_the_library_plans_them() -> None:
    """``--embeddings`` registers the model's ``nn.Embedding`` layers, as
    ``kfac.embeddings`` and ``plan(..., embeddings=True)`` do: memory and factor bytes are
    ``plan()``'s for those layers; without it, the model's plan leaves them out."""
    args = ("--model", "char-transformer", "--workers", "2", "--batch", "32")
    with_them, without = plan_json(*args, "--embeddings"), plan_json(*args)
    assert with_them["inputs"]["embeddings"] is True
    assert "embeddings" not in without["inputs"]
    for report, embeddings in ((with_them, True), (without, False)):
        layers = list(workload("char-transformer", batch_size=32, embeddings=embeddings).layers)
        assert any(x.name == "tokens" for x in layers) is embeddings
        # an embedding's A travels as its diagonal
        factors = sum(4 * ((x.a_dim if x.diagonal_a else x.a_dim**2) + x.g_dim**2) for x in layers)
        for strategy in report["strategies"]:
            ranks = plan(layers, 2, strategy["grad_worker_fraction"]).ranks
            assert strategy["memory"] == max((r.memory for r in ranks), key=lambda m: m["total"])
            assert strategy["collectives"]["factors"]["bytes"] == factors
