"""The cost model against measurement, on the example job (real Fashion-MNIST, 2 ranks) and on
``wide-mlp``, whose strategies differ in memory by megabytes.

Memory: for every candidate, the predicted peak per worker (measured base + measured K-FAC
temporaries + the plan's exact state) against the peak counted while training with that
candidate. Budgets: as the budget shrinks the choice moves from COMM-OPT to MEM-OPT, and the
chosen strategy, measured, never holds more than the budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.harness import run_distributed
from torch.nn.parallel import DistributedDataParallel

from kaisa_train.optimizers import build_optimizer
from kaisa_train.registry import model_factory
from kaisa_train.shard import load_shard
from kaisa_train.spec import JobSpec, KFACSpec, load_job_spec
from tuner.choice import NoFeasibleCandidateError, choose
from tuner.memory import TensorMemory
from tuner.profile import measure_candidate, profile_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fashion_mnist.yaml"
INTERVALS = ((1, 2),)  # memory does not depend on the intervals; short ones keep this quick


def test_existing_tensors_count_until_freed_and_the_peak_restarts() -> None:
    held = torch.zeros(1000)  # 4000 bytes before the block
    with TensorMemory(existing=[held]) as memory:
        del held  # freed inside: no longer counted
        scratch = torch.zeros(500)
        memory.reset_peak()
        kept = torch.zeros(250)
        del scratch
    assert memory.peak_bytes == 2000 + 1000
    assert memory.live_bytes == 1000
    assert kept.numel() == 250


def _example() -> JobSpec:
    return load_job_spec(EXAMPLE)


def example_worker(
    rank: int, world: int, model_name: str | None = None, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    spec = _example()
    if model_name is not None:  # the same job on another registered model
        model = spec.model.model_copy(update={"name": model_name, "params": params or {}})
        spec = spec.model_copy(update={"model": model})
    kfac = spec.kfac
    assert isinstance(kfac, KFACSpec)
    shard = load_shard(spec.dataset, spec.seed, rank, world)
    torch.manual_seed(spec.seed)
    model = DistributedDataParallel(model_factory(spec.model.name)(**spec.model.params))
    optimizer = build_optimizer(spec.optimizer, model.parameters())
    device = torch.device("cpu")
    options = {"kfac_approx": kfac.kfac_approx, "damping": kfac.damping, "kl_clip": kfac.kl_clip}

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return shard.batch(i + 1)

    profile = profile_job(
        model, optimizer, batch, F.cross_entropy, device, kfac_options={"kfac_approx": "reduce"}
    ).profile

    def measured(fraction: float) -> int:
        return measure_candidate(
            model,
            optimizer,
            batch,
            F.cross_entropy,
            device,
            grad_worker_fraction=fraction,
            factor_update_steps=1,
            inv_update_steps=2,
            min_steps=1,
            kfac_options=options,
        ).memory_bytes

    table = choose(profile, None, intervals=INTERVALS).candidates
    result: dict[str, Any] = {
        "predicted": {c.grad_worker_fraction: c.memory_bytes for c in table},
        "measured": {c.grad_worker_fraction: measured(c.grad_worker_fraction) for c in table},
        "base": profile.base_memory_bytes,
    }
    comm, mem = result["predicted"][1.0], result["predicted"][0.5]
    chosen: dict[int | None, Any] = {}
    for budget in (None, comm, mem, mem - 1):
        try:
            pick = choose(profile, budget, intervals=INTERVALS).chosen.grad_worker_fraction
        except NoFeasibleCandidateError as error:
            chosen[budget] = str(error)
            continue
        chosen[budget] = (pick, measured(pick))
    result["chosen"] = chosen
    return result


@pytest.fixture(scope="module")
def measured_example() -> list[dict[str, Any]]:
    return run_distributed(example_worker, 2, timeout=300)


def test_predicted_memory_per_worker_matches_the_measured_peak(
    measured_example: list[dict[str, Any]],
) -> None:
    first = measured_example[0]
    assert set(first["predicted"]) == {0.5, 1.0}
    for fraction, predicted in first["predicted"].items():
        measured = first["measured"][fraction]  # the worst rank's (max-reduced)
        # To the byte: every buffer is freed where the code lets go of it (the communicator
        # waits for gloo's thread to drop a finished collective's), so a step's peak is the
        # same on every run, loaded machine or not.
        assert predicted == measured, (fraction, predicted, measured)
    # MEM-OPT holds less K-FAC state than COMM-OPT: the choice has something to trade.
    assert first["predicted"][0.5] < first["predicted"][1.0]


def test_shrinking_budget_moves_to_mem_opt_and_the_measured_peak_stays_within_it(
    measured_example: list[dict[str, Any]],
) -> None:
    chosen = measured_example[0]["chosen"]
    comm, mem = (measured_example[0]["predicted"][f] for f in (1.0, 0.5))
    fractions = []
    for budget in (None, comm, mem):
        fraction, measured = chosen[budget]
        if budget is not None:
            assert measured <= budget, (budget, fraction, measured)
        fractions.append(fraction)
    # Which of the two fits a large budget best is a question of time; below COMM-OPT's
    # memory only MEM-OPT is left, and the fraction never grows as the budget shrinks.
    assert fractions[-1] == 0.5
    assert fractions == sorted(fractions, reverse=True)
    assert "no strategy fits the memory budget" in chosen[mem - 1]


@pytest.fixture(scope="module")
def measured_wide() -> list[dict[str, Any]]:
    # Width 256 (not 512) keeps it quick; the strategies still differ by 1.8 MiB.
    return run_distributed(
        example_worker, 2, timeout=300, model_name="wide-mlp", params={"width": 256}
    )


def test_predicted_memory_is_the_measured_peak_under_every_fraction_on_wide_mlp(
    measured_wide: list[dict[str, Any]],
) -> None:
    """The temporaries over the state depend on the strategy (COMM-OPT broadcasts every
    decomposition to every rank, MEM-OPT broadcasts gradients): profiling measures them under
    each fraction. Taking COMM-OPT's for MEM-OPT over-predicted its peak by 8% here."""
    first = measured_wide[0]
    assert set(first["predicted"]) == {0.5, 1.0}
    for fraction, predicted in first["predicted"].items():
        measured = first["measured"][fraction]
        # To the byte. (Until 2026-11-26 the peak sometimes held one more collective buffer
        # that gloo's thread had not yet dropped: 5.5% here, under load only;
        # tests/tuner/test_tuner_memory.py has the mechanism's own test.)
        assert predicted == measured, (fraction, predicted, measured)
    # Megabytes apart: a budget between them decides.
    assert first["predicted"][1.0] - first["predicted"][0.5] > 2**20
    chosen = first["chosen"]
    mem = first["predicted"][0.5]
    fraction, peak = chosen[mem]
    assert fraction == 0.5
    assert peak <= mem
