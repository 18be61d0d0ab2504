"""The CUDA path: the core's state on the device, autocast with a GradScaler, NCCL for every
KAISA strategy, and the tuner's memory profile from the CUDA allocator. Skipped without CUDA
(``conftest.py``); run wherever a GPU is available."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.graphs import CONFIGS, graphed_kwargs
from support.harness import run_distributed
from support.kfac_workers import equivalence_worker, reference_params
from support.models import repeated_shapes
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.amp import MixedPrecision
from kaisa_ray.plan import plan
from kaisa_train.models import LeNetCNN
from tuner.choice import choose
from tuner.memory import TensorMemory, tensor_bytes
from tuner.profile import profile_job

pytestmark = pytest.mark.gpu


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 14 * 14, 10),
    ).cuda()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_amp_training_on_cuda_stays_finite_with_state_on_device(dtype: torch.dtype) -> None:
    model = cnn()
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    preconditioner = KFACPreconditioner(model, grad_scaler=scaler, inv_update_steps=5, damping=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(12):
        x = torch.randn(32, 1, 28, 28, device="cuda")
        y = torch.randint(0, 10, (32,), device="cuda")
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        preconditioner.step()
        scaler.step(optimizer)
        scaler.update()
    for layer in preconditioner.layers:
        assert layer.a_factor is not None
        assert layer.a_factor.device.type == "cuda"
        assert layer.a_factor.dtype == torch.float32
        assert all(t.device.type == "cuda" for t in layer.decomposition.tensors().values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cuda_matches_cpu_in_float64() -> None:
    torch.manual_seed(1)
    x = torch.randn(16, 1, 28, 28, dtype=torch.float64)
    y = torch.randint(0, 10, (16,))
    grads = []
    for device in ("cpu", "cuda"):
        model = cnn().to(device=device, dtype=torch.float64)
        preconditioner = KFACPreconditioner(model, damping=0.01, kl_clip=None)
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        preconditioner.step()
        grads.append([p.grad.cpu() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


# -- NCCL: every KAISA strategy on real GPUs, one rank per GPU ----------------------------


def check_strategy_equals_single_process_kfac(strategy: str, world_size: int, backend: str) -> None:
    combos = [
        {"model": model, "method": method, "strategy": strategy, "device": "cuda"}
        for model in ("mlp", "cnn")
        for method in ("eigen", "inverse")
    ]
    per_rank = run_distributed(
        equivalence_worker, world_size, combos=combos, backend=backend, timeout=400
    )
    for index, combo in enumerate(combos):
        results = [per_rank[rank][index] for rank in range(world_size)]
        for rank, result in enumerate(results):
            # Every collective is the one the plan predicted, state is the plan's to the byte.
            assert result["mismatches"] == [], f"{combo}, rank {rank}: {result['mismatches']}"
            assert result["memory"] == result["planned_memory"], f"{combo}, rank {rank}"
            for a, b in zip(result["params"], results[0]["params"], strict=True):
                assert torch.equal(a, b), f"{combo}: rank {rank} differs from rank 0"
        # One process has no other ranks to place work on: its reference is COMM-OPT's.
        expected = reference_params({**combo, "strategy": "comm-opt", "device": "cpu"})
        for a, e in zip(results[0]["params"], expected, strict=True):
            assert (a - e).abs().max().item() <= 1e-5 * e.abs().max().item(), combo


@pytest.mark.parametrize("strategy", ["comm-opt", "hybrid-opt", "mem-opt"])
def test_nccl_strategies_equal_single_process_kfac(strategy: str) -> None:
    world_size = min(torch.cuda.device_count(), 4)
    if world_size < 2:
        pytest.skip("needs 2 GPUs: NCCL will not put two ranks on one GPU")
    check_strategy_equals_single_process_kfac(strategy, world_size, "nccl")


@pytest.mark.parametrize("strategy", ["comm-opt", "hybrid-opt", "mem-opt"])
def test_strategies_on_cuda_tensors_over_gloo_equal_single_process_kfac(strategy: str) -> None:
    """With one GPU: two ranks share it over gloo (NCCL would refuse), so every strategy's
    factors, decompositions and collectives run on CUDA tensors."""
    check_strategy_equals_single_process_kfac(strategy, 2, "gloo")


# -- the tuner's memory profile reads the CUDA allocator ----------------------------------


def test_cuda_memory_counts_known_allocations_from_the_allocator() -> None:
    torch.cuda.synchronize()
    with TensorMemory("cuda") as memory:
        big = torch.empty(2**20, dtype=torch.uint8, device="cuda")
        kept = torch.zeros(1024, device="cuda")  # 4 KiB: a multiple of the allocator's 512 B
        del big
    assert memory.peak_bytes == 2**20 + 4096
    assert memory.live_bytes == 4096
    assert kept.device.type == "cuda"


def test_cuda_profile_of_the_example_model_prices_exactly_the_plans_state() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = LeNetCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(i)
        x = torch.randn(64, 1, 28, 28, generator=generator)
        return x, torch.randint(0, 10, (64,), generator=generator)

    for precision in ("fp32", "bf16"):
        result = profile_job(
            model,
            optimizer,
            batch,
            F.cross_entropy,
            device,
            steps=2,
            precision=MixedPrecision(mode=precision, device_type="cuda"),
        )
        profile = result.profile
        # Parameters, gradients and momentum at least, read from the CUDA allocator's peak.
        assert profile.base_memory_bytes > 3 * tensor_bytes(model.parameters())
        assert profile.kfac_transient_bytes >= 0
        assert profile.step_s > 0
        decision = choose(profile, budget_bytes=None)
        for candidate in decision.candidates:
            state = plan(model, 1, grad_worker_fraction=candidate.grad_worker_fraction)
            assert candidate.kfac_state_bytes == state.ranks[0].memory["total"]


def repeated_cnn() -> nn.Module:
    return repeated_shapes("cuda")


def _train_cuda(model: nn.Module, preconditioner: KFACPreconditioner, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 2, 6, 6, generator=g).cuda()
        y = torch.randint(0, 5, (16,), generator=g).cuda()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
        optimizer.step()


@contextlib.contextmanager
def synchronising_raises() -> Iterator[None]:
    """CUDA's sync debug mode set to error inside: any host-device synchronisation raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("method", ["eigen", "inverse", "adam-eigenbasis", "ekfac"])
def test_a_quiet_step_on_cuda_never_synchronises(method: str) -> None:
    """A step that updates neither factors nor decompositions runs under CUDA's sync debug
    mode set to error: any host-device synchronisation in it raises."""
    model = repeated_cnn()
    options: dict[str, Any] = (
        {"compute_method": "eigen", "scaling": method, "kl_clip": None}
        if method == "adam-eigenbasis"
        else {"compute_method": "eigen", "scaling": method}
        if method == "ekfac"
        else {"compute_method": method}
    )
    preconditioner = KFACPreconditioner(model, factor_update_steps=3, inv_update_steps=6, **options)
    _train_cuda(model, preconditioner, 7)
    x = torch.randn(16, 2, 6, 6, device="cuda")
    y = torch.randint(0, 5, (16,), device="cuda")
    F.cross_entropy(model(x), y).backward()
    torch.cuda.synchronize()
    with synchronising_raises():
        preconditioner.step()
    assert preconditioner.last_updates == (frozenset(), frozenset())
    # the mode does catch a synchronisation: a factor step reads its flags back
    F.cross_entropy(model(x), y).backward()
    preconditioner.step()  # step 8
    F.cross_entropy(model(x), y).backward()
    with synchronising_raises(), pytest.raises(RuntimeError, match="synchroniz"):
        preconditioner.step()  # step 9 updates the factors


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_batched_steps_on_cuda_equal_the_layer_by_layer_path(method: str) -> None:
    kwargs = {"factor_update_steps": 1, "inv_update_steps": 3, "damping": 0.01}
    batched_model = repeated_cnn()
    alone_model = repeated_cnn()
    batched = KFACPreconditioner(
        batched_model, compute_method=method, matmul_precision="highest", **kwargs
    )
    alone = KFACPreconditioner(
        alone_model, compute_method=method, matmul_precision="highest", **kwargs
    )
    alone._preconditioning.groups = []
    _train_cuda(batched_model, batched, 7)
    _train_cuda(alone_model, alone, 7)
    for a, b in zip(batched_model.parameters(), alone_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tf32_products_stay_within_their_bound_of_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """'high' (TF32 products) against the same run in float64: the preconditioned gradient's
    error relative to its norm (the model's own convolutions in IEEE float32, so that only
    K-FAC's products differ)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)

    def preconditioned(precision: str, dtype: torch.dtype) -> torch.Tensor:
        model = repeated_cnn().to(dtype)
        pre = KFACPreconditioner(
            model, damping=0.01, kl_clip=None, compute_method="inverse", matmul_precision=precision
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(16, 2, 6, 6, generator=g).cuda().to(dtype)
            y = torch.randint(0, 5, (16,), generator=g).cuda()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            if step < 3:
                optimizer.step()
        return torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]

    exact = preconditioned("highest", torch.float64)
    for precision, bound in (("highest", 1e-4), ("high", 3e-2)):
        error = float((preconditioned(precision, torch.float32) - exact).norm() / exact.norm())
        print(f"matmul_precision {precision}: relative error {error:.2e}")
        assert error < bound, f"{precision}: {error:.2e}"


@pytest.mark.parametrize("method", list(CONFIGS))
def test_graphed_preconditioning_equals_the_eager_steps(method: str) -> None:
    """``cuda_graphs=True`` against the same run without: factor and decomposition updates,
    a damping and a learning rate that change every step (read from the device scalars the
    graph refills) and the KL clip; one capture for the whole run."""
    kwargs = {**graphed_kwargs(method), "matmul_precision": "highest"}
    graphed_model, eager_model = repeated_cnn(), repeated_cnn()
    graphed = KFACPreconditioner(graphed_model, cuda_graphs=True, **kwargs)
    eager = KFACPreconditioner(eager_model, **kwargs)
    _train_cuda(graphed_model, graphed, 13)
    _train_cuda(eager_model, eager, 13)
    for a, b in zip(graphed_model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if kwargs["kl_clip"] is not None:
        assert eager.last_grad_scale < 1.0
    assert graphed.last_grad_scale == pytest.approx(eager.last_grad_scale, rel=1e-5)
    captures = [g.captures for g in graphed._preconditioning.graphs.values()]
    assert captures == [1], captures


def test_a_graphed_quiet_step_never_synchronises_and_keeps_raw_gradients_that_are_not_finite() -> (
    None
):
    model = repeated_cnn()
    preconditioner = KFACPreconditioner(
        model, factor_update_steps=3, inv_update_steps=6, compute_method="inverse", cuda_graphs=True
    )
    _train_cuda(model, preconditioner, 8)  # captured on step 0, replayed since
    x = torch.randn(16, 2, 6, 6, device="cuda")
    y = torch.randint(0, 5, (16,), device="cuda")
    F.cross_entropy(model(x), y).backward()
    torch.cuda.synchronize()
    with synchronising_raises():
        preconditioner.step()  # step 8: neither factors nor decompositions
    assert preconditioner.last_updates == (frozenset(), frozenset())
    _train_cuda(model, preconditioner, 1)  # step 9 updates the factors
    for param in model.parameters():
        param.grad = None
    F.cross_entropy(model(x), y).backward()
    first = next(model.parameters())
    assert first.grad is not None
    first.grad[0].fill_(float("nan"))
    raw = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    preconditioner.step()  # step 10: quiet, replayed, one gradient not finite
    assert preconditioner.last_updates == (frozenset(), frozenset())
    assert preconditioner.skipped_steps == 1
    for before, param in zip(raw, model.parameters(), strict=True):
        torch.testing.assert_close(param.grad, before, equal_nan=True)
    assert [g.captures for g in preconditioner._preconditioning.graphs.values()] == [1]


def test_measure_node_times_a_models_own_kfac_host_costs_on_cuda() -> None:
    """``measure-node --quick --model lenet:32`` on the GPU: the profile has LeNet's K-FAC
    host costs (``kfac_host_s``: each method's preconditioning, each approximation's factor
    update), measured once however many batches of it are timed, and the plan of LeNet takes
    them in place of the stand-in's."""
    import yaml

    from kaisa_train.plan_cli import _model_to_time
    from kaisa_train.planning import hardware_file
    from kaisa_train.shapes import workload
    from tuner.forecast import forecast_profile
    from tuner.hardware_file import hardware_from_dict
    from tuner.node import measure

    base = yaml.safe_load(hardware_file("a100-80gb-hdr").read_text())
    models = (_model_to_time("lenet:32"), _model_to_time("lenet:64"))
    profile = measure(base, name="here", device="cuda", quick=True, models=models)
    found = {
        (e["model"], e["phase"], e.get("compute_method") or e.get("kfac_approx"))
        for e in profile["kfac_host_s"]
    }
    assert len(profile["kfac_host_s"]) == len(found) == 4
    hardware = hardware_from_dict(profile)
    job = workload("lenet", batch_size=32, compute_method="inverse", kfac_approx="reduce")
    basis = forecast_profile(job, hardware, 1)[1]
    assert "lenet's own, timed on one-sample steps" in " ".join(basis.terms)
