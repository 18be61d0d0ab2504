"""The tuner's hardware measurements: they run, fit the cost model, and agree across ranks.

Only structure is asserted here (finite, non-negative fits that every rank shares); how good
the fits are is a benchmark's question, not a pass/fail test's.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.harness import run_distributed

from tuner.cost import CubicFit, LinkFit
from tuner.measure import (
    compute_contention,
    fit_decomposition,
    precondition_rate,
    time_collectives,
)

CPU = torch.device("cpu")


def test_decomposition_fits_are_finite_and_non_negative() -> None:
    for method in ("eigen", "inverse"):
        fit = fit_decomposition(CPU, method, dims=(16, 32, 64), repeats=1)
        assert isinstance(fit, CubicFit)
        assert math.isfinite(fit.c0)
        assert fit.c0 >= 0
        assert math.isfinite(fit.c3)
        assert fit.c3 >= 0


def test_a_power_qr_jobs_decomposition_fit_times_the_refresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``basis_update='power-qr'`` the eigen method's fit times ``power_qr`` of a factor
    from its basis (what each decomposition after the first runs), not ``eigh``."""
    import tuner.measure

    shapes: list[tuple[int, ...]] = []

    def counted(factor: torch.Tensor, basis: torch.Tensor) -> object:
        shapes.append(tuple(factor.shape))
        return real(factor, basis)

    real = tuner.measure.power_qr
    monkeypatch.setattr(tuner.measure, "power_qr", counted)
    fit = fit_decomposition(CPU, "eigen", dims=(16, 32), repeats=1, basis_update="power-qr")
    assert {(16, 16), (32, 32)} <= set(shapes)
    assert math.isfinite(fit.c3)
    assert fit.c3 >= 0
    shapes.clear()
    fit_decomposition(CPU, "eigen", dims=(16, 32), repeats=1)
    assert shapes == []


def test_precondition_rate_is_positive() -> None:
    rate = precondition_rate(CPU, a_dim=65, g_dim=32, repeats=1)
    assert 0 < rate < 1


def test_one_rank_has_nothing_to_send() -> None:
    allreduce, broadcast = time_collectives(CPU)
    assert allreduce.seconds(2**30) == 0.0
    assert broadcast == allreduce


def collectives_worker(rank: int, world_size: int) -> tuple[LinkFit, LinkFit]:
    return time_collectives(CPU, sizes=(1024, 64 * 1024, 1024 * 1024), repeats=2)


def test_collective_fits_on_two_ranks_agree() -> None:
    per_rank = run_distributed(collectives_worker, 2, timeout=120)
    assert per_rank[0] == per_rank[1]  # fitted to the slowest rank's times, on every rank
    for fit in per_rank[0]:
        assert fit.latency_s >= 0
        assert 0 < fit.bytes_per_s < math.inf


def contention_worker(rank: int, world_size: int) -> float:
    return compute_contention(torch.device("cpu"))


def test_contention_is_one_alone_and_shared_by_every_rank() -> None:
    assert compute_contention(torch.device("cpu")) == 1.0
    figures = run_distributed(contention_worker, 3, timeout=120)
    assert len(set(figures)) == 1  # every rank prices the same
    assert figures[0] >= 1.0
