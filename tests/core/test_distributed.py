"""KAISA strategies on real gloo process groups (CPU) against single-process K-FAC.

One conformance suite over compute method × strategy × world size (1, 2, 4) × model: after
26 steps crossing several factor (every 2) and inverse (every 6) updates, the parameters equal
single-process K-FAC on the whole batch to 1e-5 relative, all ranks hold identical
parameters, every collective each rank sends is exactly the one ``plan()`` predicted, and
``memory_usage()`` equals the plan's figure. Measuring staleness changes none of that; with
adaptive per-layer intervals every rank reaches the same schedule, each step updates what the
layers' intervals say, the bytes sent on every step equal ``plan.calls_at`` for the layers it
updates, and a resume continues the schedule bit for bit.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from support.harness import run_distributed
from support.kfac_workers import (
    STEPS,
    checkpoint_worker,
    deferred_skip_worker,
    equivalence_worker,
    reference_params,
    resume_worker,
)

METHODS = ("eigen", "inverse")
ADAM = "adam-eigenbasis"
EKFAC = "ekfac"
POWER_QR = "power-qr"
DEFERRED = "deferred"
MODELS = ("mlp", "cnn")
STRATEGIES = {
    1: ("comm-opt", "mem-opt"),
    2: ("comm-opt", "hybrid-opt", "mem-opt"),
    4: ("comm-opt", "hybrid-opt", "mem-opt"),
}
EXTRAS: dict[int, list[dict[str, Any]]] = {
    # Gradients averaged by the user instead of DDP.
    2: [
        {"model": "cnn", "method": "eigen", "strategy": "mem-opt", "ddp": False},
        # An nn.Embedding preconditioned (embeddings=True): its layer on one rank, ...
        {"model": "embedded", "method": "inverse", "strategy": "mem-opt", "curvature": "natural"},
        # ... its A (held as its diagonal) packed beside upper triangles, its eigenvalues sent
        # without a basis from a rank apart from G's, its running factors averaged deferred.
        {
            "model": "embedded",
            "method": "eigen",
            "strategy": "mem-opt",
            "symmetry_aware": True,
            "colocate": False,
            "deferral": DEFERRED,
        },
        # Fisher-scale factors, debiased averages and pi-damping: still one process's result.
        {"model": "cnn", "method": "eigen", "strategy": "hybrid-opt", "curvature": "natural"},
        {"model": "cnn", "method": "inverse", "strategy": "mem-opt", "curvature": "natural"},
        # Factors computed and all-reduced in step() instead of the backward hooks.
        {"model": "cnn", "method": "inverse", "strategy": "comm-opt", "in_hook": False},
        # Staleness measured (its all-reduce, its sketches): still one process's result.
        {"model": "cnn", "method": "eigen", "strategy": "mem-opt", "schedule": "measured"},
        # Per-layer intervals adapted to it: a schedule that changes during the run.
        {"model": "mlp", "method": "eigen", "strategy": "hybrid-opt", "schedule": "adaptive"},
        {"model": "cnn", "method": "inverse", "strategy": "comm-opt", "schedule": "adaptive"},
        # Adam's moments in the eigenbasis, held where the layer is preconditioned (a model
        # whose eigenbases the factors determine: see kfac_workers.build_model).
        {"model": "pooled", "method": "eigen", "strategy": "mem-opt", "scaling": ADAM},
        {"model": "pooled", "method": "eigen", "strategy": "comm-opt", "scaling": ADAM},
        # EKFAC's diagonal, fitted on every rank from its examples and reduced with the factors.
        {"model": "pooled", "method": "eigen", "strategy": "comm-opt", "scaling": EKFAC},
        # Each rank's running factors, averaged over the ranks only before decompositions.
        {"model": "cnn", "method": "eigen", "strategy": "comm-opt", "deferral": DEFERRED},
        {
            "model": "cnn",
            "method": "inverse",
            "strategy": "mem-opt",
            "curvature": "natural",
            "deferral": DEFERRED,
        },
        # The bases refreshed by a power iteration from those the computing rank holds.
        {
            "model": "pooled",
            "method": "eigen",
            "strategy": "mem-opt",
            "scaling": ADAM,
            "basis_update": POWER_QR,
        },
    ],
    4: [
        # ... and Adam's moments in its eigenbasis on every rank.
        {"model": "embedded", "method": "eigen", "strategy": "comm-opt", "scaling": ADAM},
        {"model": "mlp", "method": "eigen", "strategy": "comm-opt", "curvature": "natural"},
        # Upper triangles only, factors of a layer on different ranks, tiny buckets so that
        # the two different worker groups of the same size ({0, 2}, {1, 3}) both have many.
        {
            "model": "cnn",
            "method": "eigen",
            "strategy": 0.5,
            "symmetry_aware": True,
            "colocate": False,
            "bucket_mb": 0.002,
        },
        {
            "model": "mlp",
            "method": "inverse",
            "strategy": "hybrid-opt",
            "ddp": False,
            "bucket_mb": 0.001,
        },
        {
            "model": "mlp",
            "method": "inverse",
            "strategy": "comm-opt",
            "schedule": "measured",
            "curvature": "natural",
        },
        # Tiny buckets: a step's subset of layers is bucketed afresh (Schedule.restricted).
        {
            "model": "cnn",
            "method": "eigen",
            "strategy": 0.5,
            "schedule": "adaptive",
            "bucket_mb": 0.0005,
            "curvature": "natural",
        },
        {"model": "pooled", "method": "eigen", "strategy": "hybrid-opt", "scaling": ADAM},
        {
            "model": "mlp",
            "method": "eigen",
            "strategy": "hybrid-opt",
            "deferral": DEFERRED,
            "symmetry_aware": True,
            "bucket_mb": 0.001,
        },
        # ... each factor refreshed on its own rank of the layer's column.
        {
            "model": "pooled",
            "method": "eigen",
            "strategy": 0.5,
            "scaling": ADAM,
            "basis_update": POWER_QR,
            "colocate": False,
        },
        {
            "model": "pooled",
            "method": "eigen",
            "strategy": "comm-opt",
            "scaling": EKFAC,
            "basis_update": POWER_QR,
        },
        # ... from the inputs kept for step(), upper triangles of the factors beside the
        # (unsymmetric) diagonal, in tiny buckets.
        {
            "model": "pooled",
            "method": "eigen",
            "strategy": "comm-opt",
            "scaling": EKFAC,
            "in_hook": False,
            "symmetry_aware": True,
            "bucket_mb": 0.0002,
        },
    ],
}


def combos_for(world_size: int) -> list[dict[str, Any]]:
    base = [
        {"model": m, "method": c, "strategy": s}
        for m in MODELS
        for c in METHODS
        for s in STRATEGIES[world_size]
    ]
    return base + EXTRAS.get(world_size, [])


@functools.cache
def reference(
    model: str,
    method: str,
    curvature: str = "reference",
    scaling: str | None = None,
    basis_update: str | None = None,
) -> list[torch.Tensor]:
    combo = {"model": model, "method": method, "strategy": "comm-opt", "curvature": curvature}
    if scaling is not None:
        combo["scaling"] = scaling
    if basis_update is not None:
        combo["basis_update"] = basis_update
    return reference_params(combo)


def assert_relative_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        scale = e.abs().max().item()
        assert (a - e).abs().max().item() <= 1e-5 * scale, "parameters differ beyond 1e-5"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_strategies_equal_single_process_kfac(world_size: int) -> None:
    combos = combos_for(world_size)
    per_rank = run_distributed(equivalence_worker, world_size, combos=combos, timeout=400)
    for index, combo in enumerate(combos):
        label = f"{combo} at world size {world_size}"
        results = [per_rank[rank][index] for rank in range(world_size)]
        for rank, result in enumerate(results):
            assert result["mismatches"] == [], f"{label}, rank {rank}: {result['mismatches']}"
            assert result["memory"] == result["planned_memory"], f"{label}, rank {rank}"
            for a, b in zip(result["params"], results[0]["params"], strict=True):
                assert torch.equal(a, b), f"{label}: rank {rank} differs from rank 0"
            # The same schedule everywhere: steps, layers, rungs and what was measured.
            assert result["trace"] == results[0]["trace"], f"{label}: rank {rank}'s schedule"
            assert result["schedule"] == results[0]["schedule"], label
            assert result["staleness"] == results[0]["staleness"], label
        if combo.get("schedule") == "adaptive":
            assert_schedule_changed(results[0], label)
            continue  # its decisions depend on measurements a single process rounds otherwise
        expected = reference(
            combo["model"],
            combo["method"],
            combo.get("curvature", "reference"),
            combo.get("scaling"),
            combo.get("basis_update"),
        )
        assert_relative_close(results[0]["params"], expected)


def assert_schedule_changed(result: dict[str, Any], label: str) -> None:
    """The layers did not all stay on their starting rung, and some step updated only some of
    them (so the plan priced a proper subset of the layers)."""
    layers = {name for _, factors, _ in result["trace"] for name in factors}
    rungs = {tuple(entry["rung"]) for entry in result["schedule"].values()}
    assert rungs != {(2, 4)}, f"{label}: every layer stayed on its starting rung"
    partial = [
        step
        for step, factors, decompositions in result["trace"]
        if 0 < len(factors) < len(layers) or 0 < len(decompositions) < len(layers)
    ]
    assert partial, f"{label}: no step updated only some layers"
    assert any(0 <= reading.angle < 90 for reading in result["staleness"]), label


def test_strategies_trade_memory_for_communication() -> None:
    """What KAISA is about, seen on real runs: MEM-OPT holds less, COMM-OPT sends less."""
    combos = [
        {"model": "cnn", "method": "eigen", "strategy": s}
        for s in ("comm-opt", "hybrid-opt", "mem-opt")
    ]
    per_rank = run_distributed(equivalence_worker, 4, combos=combos, timeout=300)
    # Summed over ranks: one layer (fc 97x12) dominates this model, so the largest rank's
    # share cannot shrink below it, but the cluster's total halves with each step of f.
    memory = [sum(per_rank[r][i]["memory"]["decompositions"] for r in range(4)) for i in range(3)]
    plain_bytes = [per_rank[0][i]["sent_bytes"]["plain"] for i in range(3)]
    inverse_bytes = [per_rank[0][i]["sent_bytes"]["inverse_update"] for i in range(3)]
    assert memory[0] == 2 * memory[1] == 4 * memory[2]
    # Plain steps: COMM-OPT sends nothing; HYBRID and MEM-OPT pass every layer's gradient
    # once per rank (to receiver groups of 2 and of 4 ranks).
    assert plain_bytes[0] == 0 < plain_bytes[1] == plain_bytes[2]
    # Inverse steps: decompositions travel to fewer ranks as f shrinks (none at MEM-OPT).
    assert inverse_bytes[0] - plain_bytes[0] > inverse_bytes[1] - plain_bytes[1]
    assert inverse_bytes[1] - plain_bytes[1] > inverse_bytes[2] - plain_bytes[2]


def test_checkpoint_moves_between_world_sizes_and_strategies(tmp_path: Path) -> None:
    path = str(tmp_path / "kfac.pt")
    split = 13  # not an inverse-update step: the decompositions must come from the file
    combo = {"model": "cnn", "method": "eigen", "strategy": 0.5}
    saved = run_distributed(checkpoint_worker, 4, combo=combo, path=path, phase="save", split=split)
    uninterrupted = saved[0]
    for world_size, strategy in ((2, 1.0), (1, "comm-opt"), (2, "mem-opt")):
        resumed = run_distributed(
            checkpoint_worker,
            world_size,
            combo=dict(combo, strategy=strategy),
            path=path,
            phase="resume",
            split=split,
        )
        for rank_params in resumed:
            assert_relative_close(rank_params, uninterrupted)
    assert_relative_close(uninterrupted, reference("cnn", "eigen"))
    assert split < STEPS


def test_an_adaptive_schedule_resumes_bit_for_bit(tmp_path: Path) -> None:
    combo = {"model": "mlp", "method": "eigen", "strategy": "hybrid-opt", "schedule": "adaptive"}
    split = 11  # mid-interval for every rung: the schedule must come from the checkpoint
    per_rank = run_distributed(
        resume_worker, 2, combo=combo, path=str(tmp_path / "kfac.pt"), split=split, timeout=300
    )
    for uninterrupted, resumed in per_rank:
        for a, b in zip(uninterrupted["params"], resumed["params"], strict=True):
            assert torch.equal(a, b)
        assert resumed["schedule"] == uninterrupted["schedule"]
        assert resumed["staleness"] == uninterrupted["staleness"]
    assert per_rank[0][0]["schedule"] == per_rank[1][0]["schedule"]


@pytest.mark.parametrize(
    ("scaling", "strategy", "basis_update"),
    [(ADAM, "mem-opt", "eigh"), (EKFAC, "comm-opt", "eigh"), (ADAM, "comm-opt", POWER_QR)],
)
def test_state_in_the_eigenbasis_resumes_bit_for_bit(
    tmp_path: Path, scaling: str, strategy: str, basis_update: str
) -> None:
    """Adam's moments under MEM-OPT live on each layer's one gradient worker, EKFAC's
    diagonal under COMM-OPT on every rank; a checkpoint between two basis refreshes (whose
    state was rotated into the new bases) gathers them, and the resumed run goes on exactly
    as the uninterrupted one; so do bases refreshed by a power iteration from the ones the
    checkpoint held."""
    combo = {
        "model": "cnn",
        "method": "eigen",
        "strategy": strategy,
        "scaling": scaling,
        "basis_update": basis_update,
    }
    per_rank = run_distributed(
        resume_worker, 2, combo=combo, path=str(tmp_path / "kfac.pt"), split=13, timeout=300
    )
    for uninterrupted, resumed in per_rank:
        for a, b in zip(uninterrupted["params"], resumed["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("strategy", ["comm-opt", "mem-opt"])
def test_deferred_factor_reduction_resumes_bit_for_bit(tmp_path: Path, strategy: str) -> None:
    """A checkpoint between two decompositions averages every rank's running factors in place
    (collective), so the resumed run and the uninterrupted one, which saved it, go on alike."""
    combo = {"model": "cnn", "method": "eigen", "strategy": strategy, "deferral": DEFERRED}
    per_rank = run_distributed(
        resume_worker, 2, combo=combo, path=str(tmp_path / "kfac.pt"), split=9, timeout=300
    )
    for uninterrupted, resumed in per_rank:
        for a, b in zip(uninterrupted["params"], resumed["params"], strict=True):
            assert torch.equal(a, b)


def test_deferred_reduction_skips_a_step_on_every_rank_when_one_ranks_factors_are_not_finite() -> (
    None
):
    """Each rank folds its own batch factors, so a batch factor that is not finite on one rank
    alone must make every rank skip that step (one all-reduce of the verdict): the ranks'
    averages then still average to the single process's, and their parameters agree."""
    combo = {"model": "cnn", "method": "inverse", "strategy": "comm-opt", "deferral": DEFERRED}
    per_rank = run_distributed(deferred_skip_worker, 2, combo=combo, timeout=300)
    assert [result["skipped"] for result in per_rank] == [1, 1]
    assert per_rank[0]["weights"] == per_rank[1]["weights"]
    for a, b in zip(per_rank[0]["params"], per_rank[1]["params"], strict=True):
        assert torch.equal(a, b)
        assert bool(torch.isfinite(a).all())
    for factor in per_rank[0]["factors"] + per_rank[1]["factors"]:
        assert bool(torch.isfinite(factor).all())


def test_a_child_failure_is_reported_not_swallowed() -> None:
    with pytest.raises(AssertionError, match=r"rank 1 raised:(.|\n)*ZeroDivisionError"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)


def test_a_hang_fails_within_the_time_limit() -> None:
    with pytest.raises(AssertionError, match=r"still running after 3 s \(a hang\)"):
        run_distributed(_hang_on_rank_one, 2, timeout=3)


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ZeroDivisionError("boom")


def _hang_on_rank_one(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        dist.recv(torch.zeros(1), src=0)  # rank 0 never sends: a real deadlock
