"""Preconditioning by shape group (``kaisa_ray.batching``): the batched products equal the
layer-by-layer ones, decompositions batch and fall back per layer, a step that updates
nothing waits for no value, and the model can be ``torch.compile``d with K-FAC attached."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from support.models import grouped_and_odd, repeated_shapes
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from kaisa_ray import KFACPreconditioner, batching, solvers
from kaisa_ray.errors import ConfigurationError


def batches(count: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for step in range(start, start + count):
        g = torch.Generator().manual_seed(step)
        yield torch.randn(16, 2, 6, 6, generator=g), torch.randint(0, 5, (16,), generator=g)


def train(model: nn.Module, preconditioner: KFACPreconditioner, steps: int, start: int = 0) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(steps, start):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
        optimizer.step()


CONFIGS: list[dict[str, Any]] = [
    {"compute_method": "inverse"},
    {"compute_method": "inverse", "pi_damping": True, "factor_scale": "fisher"},
    {"compute_method": "eigen"},
    {"compute_method": "eigen", "compute_eigenvalue_outer_product": False, "pi_damping": True},
    {"compute_method": "eigen", "kl_clip": None, "running_average": "debiased"},
    {"compute_method": "eigen", "kl_clip": None, "scaling": "adam-eigenbasis"},
    {"compute_method": "eigen", "scaling": "ekfac"},
]


def test_layers_of_one_shape_share_a_group() -> None:
    preconditioner = KFACPreconditioner(repeated_shapes())
    sizes = sorted(len(group.layers) for group in preconditioner._preconditioning.groups)
    assert sizes == [1, 1, 1, 2, 3]


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: "-".join(map(str, o.values())))
def test_batched_steps_equal_the_layer_by_layer_path(options: dict[str, Any]) -> None:
    """The same training with the groups (batched products, stacked storage) and without
    (every layer alone, as before batching) ends on the same parameters in float32."""
    kwargs = {"factor_update_steps": 1, "inv_update_steps": 3, "damping": 0.01, **options}
    batched_model = repeated_shapes()
    alone_model = copy.deepcopy(batched_model)
    batched = KFACPreconditioner(batched_model, **kwargs)
    alone = KFACPreconditioner(alone_model, **kwargs)
    alone._preconditioning.groups = []  # every layer preconditioned on its own
    train(batched_model, batched, 7)
    train(alone_model, alone, 7)
    for a, b in zip(batched_model.parameters(), alone_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert batched.memory_usage() == alone.memory_usage()


@pytest.mark.parametrize("kl_clip", [None, 0.001])
def test_grouped_convolutions_and_biases_in_flat_buffers_equal_the_layer_by_layer_path(
    kl_clip: float | None,
) -> None:
    kwargs = {"factor_update_steps": 1, "inv_update_steps": 3, "damping": 0.01}
    batched_model = grouped_and_odd()
    alone_model = copy.deepcopy(batched_model)
    batched = KFACPreconditioner(batched_model, kl_clip=kl_clip, **kwargs)
    alone = KFACPreconditioner(alone_model, kl_clip=kl_clip, **kwargs)
    alone._preconditioning.groups = []
    train(batched_model, batched, 7)
    train(alone_model, alone, 7)
    for a, b in zip(batched_model.parameters(), alone_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert batched._preconditioning.layouts  # the flat buffers were used


@pytest.mark.parametrize("kl_clip", [None, 0.001])
def test_a_quiet_step_launches_a_fixed_number_of_operations_per_group(
    kl_clip: float | None,
) -> None:
    """Preconditioning costs the products of each shape group (``bmm``, not ``matmul``'s
    broadcasting views first) and a fixed number of other operations, however many layers and
    groups: no per-layer or per-group copies, sums or selections (each is a launch on a GPU);
    on one rank the KL clip's Σ p·g is one product per group. Views are not counted: they
    launch nothing."""
    views = {"aten::as_strided", "aten::view", "aten::reshape", "aten::narrow"}

    def dispatched(model: nn.Sequential) -> tuple[int, int, int]:
        preconditioner = KFACPreconditioner(
            model,
            compute_method="inverse",
            kl_clip=kl_clip,
            factor_update_steps=3,
            inv_update_steps=6,
        )
        train(model, preconditioner, 7)
        x, y = next(batches(1, 100))
        F.cross_entropy(model(x), y).backward()
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=cpu) as prof, torch.profiler.record_function("q"):
            preconditioner.step()
        assert preconditioner.last_updates == (frozenset(), frozenset())
        events = prof.events()
        (step,) = [e for e in events if e.name == "q"]
        outermost = [e for e in step.cpu_children if e.name not in views]
        products = sum(e.name == "aten::bmm" for e in outermost)
        dots = sum(e.name == "aten::linalg_vecdot" for e in outermost)
        assert not any(e.name == "aten::matmul" for e in outermost)
        return products, dots, len(outermost) - products - dots

    fixed = set()
    for model in (repeated_shapes(), grouped_and_odd()):
        groups = len(KFACPreconditioner(copy.deepcopy(model))._preconditioning.groups)
        products, dots, others = dispatched(model)
        assert products == 2 * groups  # the inverse method: (G+γI)⁻¹ ∇W (A+γI)⁻¹
        assert dots == (0 if kl_clip is None else groups)
        fixed.add(others)
    # 5 groups of 9 layers and 6 groups of 7 alike (up to one more multi-tensor copy each
    # way where some gradients' layouts match their views and some do not)
    assert max(fixed) - min(fixed) <= 2, fixed
    assert max(fixed) <= (20 if kl_clip is None else 30), fixed


def test_batched_decompositions_equal_each_layer_alone() -> None:
    torch.manual_seed(0)
    for method in ("eigen", "inverse"):
        preconditioner = KFACPreconditioner(repeated_shapes(), compute_method=method)
        layers = [layer for layer in preconditioner.layers if layer.helper.a_dim == 13]
        assert len(layers) == 4  # three Linear(12, 12) and Linear(12, 5)
        factors = []
        for _ in layers:
            x = torch.randn(40, 13, dtype=torch.float32)
            factors.append((x.T @ x / 40).unsqueeze(0))
        batching.decompose(
            [(layer, "A", f, 0.01) for layer, f in zip(layers, factors, strict=True)]
        )
        batched = [
            {k: v.clone() for k, v in layer.decomposition.tensors().items()} for layer in layers
        ]
        for layer, factor, got in zip(layers, factors, batched, strict=True):
            layer.decomposition.compute_a(factor, 0.01)
            for part, value in layer.decomposition.tensors().items():
                if part.startswith("q"):  # eigenvectors: up to sign
                    torch.testing.assert_close(got[part].abs(), value.abs(), rtol=1e-5, atol=1e-5)
                else:
                    torch.testing.assert_close(got[part], value, rtol=1e-5, atol=1e-6)


def test_a_member_the_batched_call_fails_on_is_retried_alone_in_float64(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    preconditioner = KFACPreconditioner(repeated_shapes(), compute_method="eigen")
    layers = [layer for layer in preconditioner.layers if layer.helper.a_dim == 13]
    real_eigh = torch.linalg.eigh
    calls: list[tuple[int, torch.dtype]] = []

    def batched_float32_fails(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((matrix.shape[0], matrix.dtype))
        if matrix.dtype != torch.float64:
            raise torch.linalg.LinAlgError("simulated: failed to converge")
        return real_eigh(matrix)

    monkeypatch.setattr(torch.linalg, "eigh", batched_float32_fails)
    wide = next(layer for layer in preconditioner.layers if layer.helper.a_dim == 145)
    eye = torch.eye(13).unsqueeze(0)
    work = [(layer, "A", eye * (i + 1), 0.01) for i, layer in enumerate(layers)]
    batching.decompose([*work, (wide, "A", torch.eye(145).unsqueeze(0), 0.01)])
    # the four 13-wide factors in one batched float32 attempt (the 145-wide one bounds the
    # chunk), then each member once in float64, not in float32 again; then the wide one
    assert calls == [(4, torch.float32)] + [(1, torch.float64)] * 4 + [
        (1, torch.float32),
        (1, torch.float64),
    ]
    for i, layer in enumerate(layers):
        da = layer.decomposition.tensors()["da"]
        torch.testing.assert_close(da, torch.full_like(da, float(i + 1)))


def test_a_singular_member_of_a_batched_inverse_keeps_its_previous_and_spares_the_rest() -> None:
    # A factor Cholesky cannot factor even in float64 (zero, undamped) beside good ones: the
    # batched call must not raise (cholesky_inverse refuses a partial factor on CPU); the
    # failed member keeps the damped identity's inverse, the others get theirs.
    preconditioner = KFACPreconditioner(repeated_shapes(), compute_method="inverse")
    layers = [layer for layer in preconditioner.layers if layer.helper.a_dim == 13]
    eye = torch.eye(13).unsqueeze(0)
    factors = [eye * (i + 1) for i in range(len(layers))]
    factors[1] = torch.zeros_like(eye)
    with pytest.warns(RuntimeWarning, match="could not decompose the A factor"):
        batching.decompose([(layer, "A", f, 0.0) for layer, f in zip(layers, factors, strict=True)])
    for i, layer in enumerate(layers):
        got = layer.decomposition.tensors()["a_inv"]
        torch.testing.assert_close(got, eye / (1 if i == 1 else i + 1))


def test_the_inverse_by_triangular_solve_equals_cholesky_inverse() -> None:
    """CUDA's inverse route (one triangular solve, one product), checked here on the CPU in
    float64 against LAPACK's inverse, for a batch of factors of one size."""
    torch.manual_seed(0)
    x = torch.randn(5, 40, 60, dtype=torch.float64)
    factors = x @ x.mT / 60 + 0.01 * torch.eye(40, dtype=torch.float64)
    chol = torch.linalg.cholesky(factors)
    expected = torch.cholesky_inverse(chol)
    holder = [chol.clone()]
    got = solvers.inverse_by_solve(holder)
    assert holder == []  # taken: the caller's factors are let go of as soon as used
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    eye = torch.eye(40, dtype=torch.float64).expand(5, 40, 40)
    torch.testing.assert_close(got @ factors, eye, rtol=0, atol=1e-8)


def test_decomposition_chunks_are_no_larger_than_the_largest_factor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    preconditioner = KFACPreconditioner(repeated_shapes(), compute_method="inverse")
    sizes: list[int] = []
    real = torch.linalg.cholesky_ex

    def counting(matrix: torch.Tensor) -> Any:
        sizes.append(matrix.numel())
        return real(matrix)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", counting)
    work = []
    for layer in preconditioner.layers:
        a = torch.eye(layer.helper.a_dim).expand(layer.helper.groups, -1, -1).clone()
        work.append((layer, "A", a, 0.1))
    batching.decompose(work)
    largest = max(layer.helper.a_dim**2 for layer in preconditioner.layers)
    assert max(sizes) <= largest
    assert len(sizes) < len(work)  # something was batched


class Waits(TorchDispatchMode):
    """Records every operation that hands a tensor's value to Python (a device wait on CUDA:
    ``.item()``, ``float()``, ``bool()``, ``if tensor``) and the shape-from-data ones."""

    WAITING: ClassVar[set[Any]] = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
    }

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self.WAITING:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _watch_tolist(monkeypatch: pytest.MonkeyPatch, seen: list[str]) -> None:
    real = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:  # reads memory directly: not a dispatched op
        seen.append("tolist")
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: "-".join(map(str, o.values())))
def test_a_step_that_updates_nothing_reads_no_value_back(
    options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = repeated_shapes()
    preconditioner = KFACPreconditioner(
        model, factor_update_steps=3, inv_update_steps=6, damping=0.01, **options
    )
    train(model, preconditioner, 7)  # past the first decomposition; step 7 updates nothing
    assert preconditioner.steps == 7
    x, y = next(batches(1, 100))
    F.cross_entropy(model(x), y).backward()
    watch = Waits()
    _watch_tolist(monkeypatch, watch.seen)
    with watch:
        preconditioner.step()
    assert watch.seen == []
    assert preconditioner.last_updates == (frozenset(), frozenset())
    # the check itself can fail: a factor step reads its flags back
    F.cross_entropy(model(x), y).backward()
    preconditioner.step()
    F.cross_entropy(model(x), y).backward()
    with watch:
        preconditioner.step()  # step 9: a factor update
    assert watch.seen


def test_a_non_finite_gradient_on_a_quiet_step_keeps_the_raw_gradients() -> None:
    model = repeated_shapes()
    preconditioner = KFACPreconditioner(model, factor_update_steps=3, inv_update_steps=6)
    train(model, preconditioner, 7)
    x, y = next(batches(1, 100))
    F.cross_entropy(model(x), y).backward()
    last = model[-1]
    assert isinstance(last, nn.Linear)
    assert last.weight.grad is not None
    last.weight.grad[0, 0] = float("nan")
    raw = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    preconditioner.step()
    for name, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(p.grad, raw[name], equal_nan=True)
    assert preconditioner.skipped_steps == 1
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    preconditioner.step()  # step 8 does not wait: no warning yet
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"not finite on 1 step\(s\)"):
        preconditioner.step()  # step 9 updates the factors: it waits, and warns


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_reduced_matmul_precision_stays_within_its_bound_of_float64(method: str) -> None:
    """K-FAC's products at 'medium' (bfloat16 products where the CPU has them) and 'highest'
    against the same preconditioner run in float64: the preconditioned gradient's error
    relative to its norm."""

    def preconditioned(precision: str, dtype: torch.dtype) -> torch.Tensor:
        model = repeated_shapes().to(dtype)
        pre = KFACPreconditioner(
            model, compute_method=method, damping=0.01, kl_clip=None, matmul_precision=precision
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for x, y in batches(4):
            optimizer.zero_grad()
            F.cross_entropy(model(x.to(dtype)), y).backward()
            pre.step()
            optimizer.step() if pre.steps < 4 else None
        return torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]

    exact = preconditioned("highest", torch.float64)
    for precision, bound in (("highest", 1e-4), ("medium", 3e-2)):
        got = preconditioned(precision, torch.float32)
        error = float((got - exact).norm() / exact.norm())
        assert error < bound, f"{precision}: {error:.2e}"


def test_matmul_precision_is_restored_and_named_when_bad() -> None:
    before = torch.get_float32_matmul_precision()
    model = repeated_shapes()
    preconditioner = KFACPreconditioner(model, matmul_precision="medium")
    train(model, preconditioner, 2)
    assert torch.get_float32_matmul_precision() == before
    with pytest.raises(ValueError, match="matmul_precision='low' is not valid"):
        KFACPreconditioner(repeated_shapes(), matmul_precision="low")


@pytest.mark.slow
def test_a_compiled_model_trains_with_kfac_as_the_eager_one() -> None:
    """``torch.compile(model)`` with K-FAC attached to the model's layers: the same parameters
    as eager after factor, decomposition and quiet steps (factor work runs eagerly, a graph
    break on factor steps only)."""
    eager_model = repeated_shapes()
    compiled_model = copy.deepcopy(eager_model)
    kwargs = {"factor_update_steps": 2, "inv_update_steps": 4, "damping": 0.01}
    eager = KFACPreconditioner(eager_model, **kwargs)
    compiled = KFACPreconditioner(compiled_model, **kwargs)
    train(eager_model, eager, 6)
    net = torch.compile(compiled_model)
    optimizer = torch.optim.SGD(compiled_model.parameters(), lr=0.05)
    for x, y in batches(6):
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        compiled.step()
        optimizer.step()
    for a, b in zip(eager_model.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The hooks found the factor methods disabled for dynamo (run eagerly), although the
    # preconditioner was built before torch.compile loaded dynamo.
    for method in (compiled._hooks.take_input, compiled._hooks.on_grad):
        assert getattr(method.__func__, "_torchdynamo_disable", False), method


def test_importing_kaisa_ray_does_not_load_dynamo() -> None:
    """A process that never compiles (a Ray Train worker, a job's driver, the CLI) does not
    pay for importing ``torch._dynamo``; its hooks run the plain methods."""
    code = (
        "import sys\n"
        "import torch\n"
        "from kaisa_ray import KFACPreconditioner\n"
        "import kaisa_train.cli\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 3))\n"
        "pre = KFACPreconditioner(model)\n"
        "model(torch.randn(8, 4)).sum().backward()\n"
        "pre.step()\n"
        "assert not hasattr(pre._hooks.take_input.__func__, '_torchdynamo_disable')\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_cuda_graphs_on_a_model_off_the_gpu_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"model\.cuda\(\)"):
        KFACPreconditioner(nn.Linear(4, 3), cuda_graphs=True)
    with pytest.raises(ConfigurationError, match="cuda_graphs='yes' must be True or False"):
        KFACPreconditioner(nn.Linear(4, 3), cuda_graphs="yes")  # type: ignore[arg-type]
