"""Profiling on the job's own model and ranks: complete, shared by every rank, and harmless."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from support.harness import run_distributed
from torch.nn.parallel import DistributedDataParallel

from kaisa_train.models import LeNetCNN
from tuner.choice import choose
from tuner.cost import Profile
from tuner.memory import tensor_bytes
from tuner.profile import profile_job


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + i)
    return torch.randn(32, 1, 28, 28, generator=generator), torch.randint(
        0, 10, (32,), generator=generator
    )


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x, y = batch(i)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = LeNetCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(model, optimizer, 2)  # momentum state exists, as in a resumed job
    return model, optimizer


def test_profile_describes_the_job_and_changes_nothing() -> None:
    model, optimizer = setup()
    result = profile_job(model, optimizer, batch, F.cross_entropy, torch.device("cpu"), steps=2)
    profile = result.profile
    assert [(layer.name, layer.a_dim, layer.g_dim) for layer in profile.layers] == [
        ("conv1", 26, 8),
        ("conv2", 201, 16),
        ("fc1", 785, 128),
        ("fc2", 129, 10),
    ]
    assert profile.world_size == 1
    assert profile.base_memory_bytes > tensor_bytes(model.parameters()) * 3  # + grads, momentum
    assert profile.step_s > 0
    assert profile.factor_s > 0
    assert profile.precondition_s_per_flop > 0
    assert result.seconds > 0
    assert choose(profile, None).chosen.grad_worker_fraction == 1.0  # the only f at one rank

    # Training after profiling is bit-for-bit training without it.
    reference, reference_optimizer = setup()
    train(model, optimizer, 3)
    train(reference, reference_optimizer, 3)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def profile_worker(rank: int, world_size: int) -> Profile:
    torch.manual_seed(0)
    model = DistributedDataParallel(LeNetCNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return profile_job(
        model,
        optimizer,
        lambda i: batch(10 * i + rank),
        F.cross_entropy,
        torch.device("cpu"),
        steps=2,
    ).profile


def test_every_rank_gets_the_same_profile() -> None:
    first, second = run_distributed(profile_worker, 2, timeout=180)
    assert first == second
    assert first.world_size == 2
    assert first.allreduce.bytes_per_s > 0
    assert len(choose(first, None).candidates) == 2 * 3  # f in {1/2, 1} x three interval pairs


def test_a_profile_with_embeddings_counts_the_embeddings_layers() -> None:
    """``kfac.embeddings``: the profile's layers (and so the tuner's memory model) hold the
    embedding the preconditioner registers, with its state exactly as the preconditioner's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 6), torch.nn.Flatten(), torch.nn.Linear(6 * 4, 3)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def ids(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(i)
        return torch.randint(0, 11, (8, 4), generator=generator), torch.randint(
            0, 3, (8,), generator=generator
        )

    result = profile_job(
        model,
        optimizer,
        ids,
        F.cross_entropy,
        torch.device("cpu"),
        steps=2,
        kfac_options={"embeddings": True},
    )
    assert [(layer.name, layer.a_dim, layer.g_dim) for layer in result.profile.layers] == [
        ("0", 11, 6),
        ("2", 25, 3),
    ]
