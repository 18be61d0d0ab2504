"""K-FAC on a model sharded by FSDP2 (``fully_shard``; docs/fsdp.md), gloo on the CPU: the
same parameters as under DDP and as one process on the whole batch, under every strategy,
both methods and the JobSpec's curvature options; the bytes each rank sends equal the plan's
FSDP schedule (the gradient rows' all-gather beside DDP's calls) on every step; and a sharding
K-FAC cannot take is refused naming the layers and the fix."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from support.fsdp_workers import (
    accumulated,
    bf16_parameters,
    by_units,
    checkpoint_round_trip,
    hybrid_sharded,
    job_in_bf16,
    partly_sharded,
    profiled,
    sharded_after_build,
    sharded_embeddings,
)
from support.harness import run_distributed
from support.kfac_workers import equivalence_worker, reference_params

from kaisa_ray.assignment import LayerShape
from kaisa_ray.plan import StepType, plan
from tuner.choice import choose

pytestmark = pytest.mark.slow  # processes of gloo, spawned per test

STRATEGIES = {2: ["comm-opt", "mem-opt"], 4: ["comm-opt", "hybrid-opt", "mem-opt"]}


def combos_for(world_size: int) -> list[dict[str, Any]]:
    """An MLP and a small LeNet-like CNN (its layers of 4, 6, 12 and 4 rows: at 4 ranks some
    split unevenly and one rank holds no row of a layer), eigen with the reference's curvature
    and inverse with the JobSpec's (Fisher scale, debiased averages, π-damping)."""
    return [
        {"model": model, "method": method, "strategy": strategy, "curvature": curvature}
        for model in ("mlp", "cnn")
        for method, curvature in (("eigen", "reference"), ("inverse", "natural"))
        for strategy in STRATEGIES[world_size]
    ]


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_equals_ddp_and_one_process_and_sends_what_the_plan_says(world_size: int) -> None:
    combos = combos_for(world_size)
    runs = [combo | {"fsdp": fsdp} for combo in combos for fsdp in (False, True)]
    per_rank = run_distributed(equivalence_worker, world_size, combos=runs, timeout=400)
    for index in range(0, len(runs), 2):
        combo = runs[index]
        label = f"{combo} at world size {world_size}"
        ddp, fsdp = per_rank[0][index], per_rank[0][index + 1]
        for rank in range(world_size):
            sharded = per_rank[rank][index + 1]
            assert sharded["mismatches"] == [], f"{label}, rank {rank}: {sharded['mismatches']}"
            assert sharded["memory"] == sharded["planned_memory"], f"{label}, rank {rank}"
            for a, b in zip(sharded["params"], fsdp["params"], strict=True):
                assert torch.equal(a, b), f"{label}: rank {rank} differs from rank 0"
        if combo["strategy"] == "comm-opt":  # beside DDP's calls: the all-gather of the rows
            for kind, sent in fsdp["sent_bytes"].items():
                assert sent > ddp["sent_bytes"][kind], (label, kind)
        expected = reference_params(combo | {"strategy": "comm-opt", "fsdp": False})
        for name, other in (("DDP", ddp["params"]), ("one process", expected)):
            for a, e in zip(fsdp["params"], other, strict=True):
                scale = e.abs().max().item()
                assert (a - e).abs().max().item() <= 1e-6 * scale, f"{label}: FSDP vs {name}"


def test_the_plan_counts_each_rank_s_rows_of_every_gradient() -> None:
    """A 7-row and a 3-row layer on 4 ranks: every collective of the gradients moves ⌈7/4⌉ =
    2 and ⌈3/4⌉ = 1 rows a rank (the last ranks pad what they lack), 6 and 8 wide, float32.
    COMM-OPT all-gathers them to every rank beside DDP's calls; MEM-OPT gathers each layer's
    rows to its one worker and scatters each rank its rows of the result, in place of DDP's
    broadcasts of the whole preconditioned gradient, then adds up the KL clip's sums (one a
    layer, float64) over ranks, and on factor steps whether every rank's rows are finite."""
    layers = [LayerShape(name="a", a_dim=6, g_dim=7), LayerShape(name="b", a_dim=8, g_dim=3)]
    sharded = plan(layers, 4, "comm-opt", parallel="fsdp")
    ddp = plan(layers, 4, "comm-opt")
    for kind in ("plain", "factor_update", "inverse_update"):
        extra = sharded.ranks[3].bytes(kind) - ddp.ranks[3].bytes(kind)
        assert extra == (2 * 6 + 1 * 8) * 4, kind
    (gather,) = sharded.gather_calls
    assert (gather.op, gather.group, gather.src) == ("all_gather", (0, 1, 2, 3), None)
    assert ddp.gather_calls == ()

    mem = plan(layers, 4, "mem-opt", parallel="fsdp")
    workers = {name: mem.assignment.placements[name].workers for name in ("a", "b")}
    assert mem.gather_calls == ()
    everyone = (0, 1, 2, 3)
    rows = [(workers["a"][0], 2 * 6 * 4), (workers["b"][0], 1 * 8 * 4)]
    exchange = [("gather", everyone, src, n) for src, n in rows]
    back = [("scatter", everyone, src, n) for src, n in rows]
    clip = [("all_reduce", everyone, None, 2 * 8)]
    for rank in range(4):
        calls = mem.ranks[rank].calls
        seen = {kind: [(c.op, c.group, c.src, c.nbytes) for c in calls[kind]] for kind in calls}
        assert seen["plain"] == exchange + back + clip, rank
        finite = [("all_reduce", everyone, None, 8)]
        assert seen["factor_update"][1:] == exchange + finite + back + clip, rank


def test_a_model_sharded_after_the_preconditioner_was_built_trains_as_one_sharded_before() -> None:
    said = run_distributed(sharded_after_build, 2)
    for parallel, difference in said:
        assert parallel == "fsdp"  # the plan follows: it prices the gather now
        assert difference == 0.0


def test_a_layer_left_unsharded_beside_sharded_ones_is_refused_with_the_fix() -> None:
    said = run_distributed(partly_sharded, 2)
    for message in said:
        assert "layers 2 are not sharded while layers 0 are" in message, message
        assert "fully_shard" in message
        assert "DistributedDataParallel" in message


def test_embeddings_under_fsdp2_are_refused_with_the_fix() -> None:
    for message in run_distributed(sharded_embeddings, 2):
        assert "embeddings=True with FSDP2" in message, message
        assert "embeddings 0 are sharded" in message
        assert "leave embeddings off" in message


def test_a_sharded_checkpoint_is_whole_and_resumes_a_sharded_model_exactly() -> None:
    """A job's checkpoint of a sharded model and Adam (``kaisa_train.state``): saved as
    whole tensors that a plain model and Adam load; loaded back into a sharded model, the
    next steps equal those of the model that never stopped."""
    for said in run_distributed(checkpoint_round_trip, 2):
        assert said["equal"] is True
        assert said["plain_types"] == ["Tensor"]
        assert said["moments"] == [(7, 5), (7,), (3, 7), (3,)]


@pytest.mark.parametrize("strategy", ["comm-opt", "mem-opt"])
def test_accumulated_micro_batches_equal_ddp_s(strategy: str) -> None:
    """Two micro-batches a step (FSDP2 syncs on the last, as ``no_sync`` does for DDP) with
    ``accumulation_steps=2``: the same parameters as DDP's after 4 steps (under MEM-OPT
    within float32's rounding: each rank clips its own rows, the sums added over ranks)."""
    for difference in run_distributed(accumulated, 2, strategy=strategy):
        assert difference <= (0.0 if strategy == "comm-opt" else 1e-6)


@pytest.mark.parametrize("strategy", ["comm-opt", "mem-opt"])
def test_bf16_parameters_with_fp32_reduction_train_as_fp32_does(strategy: str) -> None:
    """FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the hooks
    see bf16 activations, the factors stay float32, K-FAC preconditions the float32 gradient
    shards it is given (gathered whole to every rank, or to each layer's worker), and the
    losses of 6 steps follow the fp32 run's within bf16's precision."""
    for said in run_distributed(bf16_parameters, 2, strategy=strategy):
        assert said["bf16_grad_dtype"] == said["bf16_factor_dtype"] == "torch.float32"
        assert said["bf16_losses"] == pytest.approx(said["fp32_losses"], rel=1e-2)
        assert said["bf16_losses"] != said["fp32_losses"]  # it did run in bf16


def test_a_model_sharded_over_a_2d_mesh_is_refused_with_the_fix() -> None:
    """HSDP (a 2-D mesh: replicated over one dimension, sharded over the other) is not what
    K-FAC gathers (rows over all ranks): refused before the first step, naming the layers,
    their placements and the fix."""
    for message in run_distributed(hybrid_sharded, 4):
        assert "layers 0 (" in message, message
        assert ", 2 (" in message, message
        assert "sharded in a way K-FAC does not precondition" in message
        assert "a 1-D mesh of all 4 ranks" in message
        assert "DistributedDataParallel" in message


def test_kfac_auto_profiles_a_sharded_model_and_prices_its_gradient_rows() -> None:
    """``kfac: auto`` on a job sharded by FSDP2: the profile (taken on the sharded model,
    whose parameters it restores) says so, and every candidate the tuner prices is planned
    with the gradient rows' collectives (MEM-OPT's gathers and scatters, COMM-OPT's
    all-gather)."""
    said = run_distributed(profiled, 2)
    for profile, restored in said:
        assert restored
        assert profile.parallel == "fsdp"
    profile = said[0][0]
    outcome = choose(profile, budget_bytes=None)
    assert {c.grad_worker_fraction for c in outcome.candidates} == {0.5, 1.0}
    unsharded = choose(dataclasses.replace(profile, parallel="ddp"), budget_bytes=None)
    priced = {c.key: c.step_s for c in unsharded.candidates}
    for candidate in outcome.candidates:  # the rows' collectives in every candidate's price
        assert candidate.step_s != priced[candidate.key], candidate.key
    for fraction, ops in ((0.5, {"gather", "scatter"}), (1.0, {"all_gather"})):
        strategy = plan(list(profile.layers), 2, fraction, parallel=profile.parallel)
        assert ops <= {c.op for c in strategy.ranks[0].calls[StepType.PLAIN]}


def test_every_sharding_unit_trains_as_ddp_does() -> None:
    """``scaling.shard_units`` (``sharding.shard_layers``): each Linear (``layers``: two units
    and the model), each child block (``blocks``: two and the model) or the model alone
    (``model``): FSDP2 gathers differently, K-FAC sees the same whole layers, and the
    parameters after 4 steps equal DDP's."""
    for said in run_distributed(by_units, 2):
        assert (said["layers_units"], said["blocks_units"], said["model_units"]) == (3, 3, 1)
        for units in ("layers", "blocks", "model"):
            assert said[f"{units}_difference"] <= 1e-6, (units, said)


def test_a_sharded_job_in_bf16_runs_fsdp2_s_mixed_precision() -> None:
    """``precision: bf16`` in a sharded job: FSDP2's ``MixedPrecisionPolicy`` as its users run
    it (the layers compute with bfloat16 parameters, the shards and their gradients stay
    float32), K-FAC's factors float32, MEM-OPT's rows exchanged, and the loss finite."""
    for said in run_distributed(job_in_bf16, 2):
        assert said["computed"] == ["torch.bfloat16"], said
        assert said["shard"] == said["grad"] == said["factor"] == "torch.float32", said
        assert said["rows_mode"] == "RowExchange"
        assert all(math.isfinite(loss) for loss in said["losses"])  # type: ignore[attr-defined]
