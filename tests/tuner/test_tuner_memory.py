"""Measured tensor memory (CPU: counted through a dispatch mode) against known allocations
and against the plan's exact K-FAC state."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.harness import run_distributed

from kaisa_ray import KFACPreconditioner
from kaisa_ray.plan import plan
from kaisa_train.models import LeNetCNN
from tuner.memory import TensorMemory, tensor_bytes


def test_counts_allocations_once_and_frees() -> None:
    with TensorMemory() as memory:
        big = torch.empty(2**20, dtype=torch.uint8)
        kept = torch.zeros(1000)
        view = kept.view(10, 100)  # same storage: not counted again
        del big
    assert memory.peak_bytes == 2**20 + 4000
    assert memory.live_bytes == 4000
    assert view.shape == (10, 100)


def test_tensor_bytes_counts_shared_storage_once() -> None:
    x = torch.zeros(256)
    assert tensor_bytes([x, x.view(16, 16), x[:10]]) == 1024


def images() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (32, 4)), torch.randint(0, 10, (32,))


VOCAB = 3000


def train(
    model: torch.nn.Module,
    steps: int,
    kfac: bool,
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]] = images,
    **options: Any,
) -> int:
    """Live bytes a short run leaves behind (grads, optimizer and K-FAC state)."""
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with TensorMemory() as memory:
        preconditioner = (
            KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, **options)
            if kfac
            else None
        )
        for _ in range(steps):
            x, y = batch()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            if preconditioner is not None:
                preconditioner.step()
            optimizer.step()
            del x, y
        memory.update()
        live = memory.live_bytes
    return live


def test_measured_kfac_state_is_exactly_the_plans() -> None:
    torch.manual_seed(0)
    plain = train(LeNetCNN(), 3, kfac=False)
    torch.manual_seed(0)
    model = LeNetCNN()
    with_kfac = train(model, 3, kfac=True)
    predicted = plan(model, 1).ranks[0].memory["total"]
    # Counted independently (every storage the run left alive), it matches to the byte.
    assert with_kfac - plain == predicted


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_an_embeddings_measured_kfac_state_is_the_plans_and_linear_in_its_vocabulary(
    method: str,
) -> None:
    """``embeddings=True``: the embedding's A held as its diagonal, counted independently to
    the byte as ``plan()`` prices it, and far under one ``V × V`` matrix."""

    def built() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Embedding(VOCAB, 8), torch.nn.Flatten(), torch.nn.Linear(32, 10)
        )

    plain = train(built(), 3, kfac=False, batch=tokens)
    model = built()
    with_kfac = train(model, 3, kfac=True, batch=tokens, embeddings=True, compute_method=method)
    predicted = plan(model, 1, embeddings=True, compute_method=method).ranks[0].memory["total"]
    assert with_kfac - plain == predicted
    assert predicted < 4 * VOCAB**2  # one float32 V x V matrix: the factor alone, held whole


def _release_worker(rank: int, world: int, rounds: int) -> dict[str, int]:
    import torch.distributed as dist

    from kaisa_ray.comm import completed
    from kaisa_ray.plan import Bucket, Purpose

    bucket = Bucket(
        purpose=Purpose.FACTORS,
        op="all_reduce",
        group=(0, 1),
        src=None,
        dtype=torch.float32,
        pieces=(),
    )
    held_after = []
    for _ in range(rounds):
        flat = torch.ones(2**18)
        in_flight = [(bucket, flat, dist.all_reduce(flat, async_op=True))]
        for _, buffer in completed(in_flight):
            held_after.append(buffer._use_count())  # type: ignore[attr-defined]
        del flat
    return {"rounds": len(held_after), "held_elsewhere": sum(h > 1 for h in held_after)}


def test_a_finished_collectives_buffer_is_held_by_nothing_but_the_caller() -> None:
    """gloo's thread drops its reference to a finished work a moment after ``wait()``
    returns (in about 1 of 8 calls it has not yet, on an idle machine): until then a buffer
    the caller lets go of stays allocated, and whether a step's peak holds it depended on
    thread timing. ``completed`` hands the buffer on only once gloo has let go of it."""
    results = run_distributed(_release_worker, 2, timeout=120, rounds=300)
    for result in results:
        assert result == {"rounds": 300, "held_elsewhere": 0}


def test_the_inverse_method_holds_at_most_two_factor_sized_temporaries() -> None:
    """The damped inverse of an n×n factor peaks at two n×n tensors (the result and one
    temporary), as the eigen method's outputs do; it held six before 2026-11-26 (the identity,
    the damped copy, its Cholesky factor, the inverse, its symmetrised sum, the halved
    result), which made the inverse method's peak the larger one under a memory budget."""
    from kaisa_ray.solvers import robust_damped_inverse

    torch.manual_seed(0)
    x = torch.randn(1000, 300)
    factor = (x.T @ x / 1000).unsqueeze(0)
    square = factor.numel() * factor.element_size()
    for damping in (0.003, torch.full((1, 1, 1), 0.003)):
        with TensorMemory() as memory:
            inverse = robust_damped_inverse(factor, damping)
        assert inverse is not None
        assert square <= memory.live_bytes < square + 1024  # the result (and a cached scalar)
        assert memory.peak_bytes <= 2 * square + 4096, memory.peak_bytes / square
        expected = torch.linalg.inv(factor.double() + 0.003 * torch.eye(300, dtype=torch.float64))
        torch.testing.assert_close(inverse.double(), expected, rtol=1e-3, atol=1e-3)


def test_a_buffer_held_elsewhere_is_waited_for_only_until_the_timeout() -> None:
    from kaisa_ray.comm import released

    buffer = torch.zeros(100)
    assert released(buffer)  # only this tensor holds it
    view = buffer[:10]  # another holder, which never goes: give up, do not hang
    began = time.monotonic()
    assert not released(buffer, timeout=0.05)
    assert time.monotonic() - began < 2.0
    del view
    assert released(buffer)
