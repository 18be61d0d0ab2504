"""Behaviour of the preconditioner over steps: schedules, averages, clipping, checkpoints."""

from __future__ import annotations

import io
import logging
import math
import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from support.kfac_training import batches, small_cnn, train
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.kfac_layer import KFACLayer
from kaisa_ray.plan import STEP_SCALAR_BYTES


def snapshot(preconditioner: KFACPreconditioner) -> list[torch.Tensor]:
    out = []
    for layer in preconditioner.layers:
        assert layer.a_factor is not None
        assert layer.g_factor is not None
        out += [layer.a_factor.clone(), layer.g_factor.clone()]
    return out


def test_running_average_starts_from_identity() -> None:
    model = small_cnn(dtype=torch.float64)
    (x, y), (x2, y2) = batches(2, dtype=torch.float64)
    decay = 0.9
    # Batch factors from a decay-0 preconditioner on an identical model.
    probe_model = small_cnn(dtype=torch.float64)
    probe = KFACPreconditioner(probe_model, factor_decay=0.0)
    preconditioner = KFACPreconditioner(model, factor_decay=decay)
    for m, p in ((probe_model, probe), (model, preconditioner)):
        F.cross_entropy(m(x), y).backward()
        p.step()
    first_batch = snapshot(probe)
    after_one = snapshot(preconditioner)
    for batch_factor, running in zip(first_batch, after_one, strict=True):
        eye = torch.eye(batch_factor.shape[-1], dtype=torch.float64).expand_as(batch_factor)
        torch.testing.assert_close(running, decay * eye + (1 - decay) * batch_factor)
    # Second step: the decay applies to the previous running value (no optimizer step taken).
    for m, p in ((probe_model, probe), (model, preconditioner)):
        m.zero_grad()
        F.cross_entropy(m(x2), y2).backward()
        p.step()
    for before, batch_factor, running in zip(
        after_one, snapshot(probe), snapshot(preconditioner), strict=True
    ):
        torch.testing.assert_close(running, decay * before + (1 - decay) * batch_factor)


def test_kl_clip_scales_by_the_formula() -> None:
    ((x, y),) = batches(1)
    grads = {}
    lr, kl_clip = 0.5, 1e-6
    for clip in (None, kl_clip):
        model = small_cnn()
        preconditioner = KFACPreconditioner(model, kl_clip=clip, lr=lr, damping=0.01)
        F.cross_entropy(model(x), y).backward()
        raw = [p.grad.clone() for p in model.parameters()]
        preconditioner.step()
        grads[clip] = (raw, [p.grad.clone() for p in model.parameters()])
    raw, preconditioned = grads[None]
    vg = sum(float((p * g).sum()) for p, g in zip(preconditioned, raw, strict=True))
    scale = min(1.0, math.sqrt(kl_clip / abs(lr**2 * vg)))
    assert scale < 0.5, "the test must use a clip that binds"
    for unclipped, clipped in zip(preconditioned, grads[kl_clip][1], strict=True):
        torch.testing.assert_close(clipped, unclipped * scale)


def test_kl_clip_that_does_not_bind_leaves_gradients() -> None:
    ((x, y),) = batches(1)
    results = []
    for clip in (None, 1e9):
        model = small_cnn()
        preconditioner = KFACPreconditioner(model, kl_clip=clip)
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
        results.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_hyperparameter_callables_get_the_step() -> None:
    seen: dict[str, list[int]] = {
        "damping": [],
        "lr": [],
        "factor_decay": [],
        "kl_clip": [],
        "factor_update_steps": [],
        "inv_update_steps": [],
    }

    def recorder(name: str, value: float) -> Callable[[int], float]:
        def fn(step: int) -> float:
            seen[name].append(step)
            return value

        return fn

    def interval(name: str, value: int) -> Callable[[int], int]:
        def fn(step: int) -> int:
            seen[name].append(step)
            return value

        return fn

    model = small_cnn()
    preconditioner = KFACPreconditioner(
        model,
        damping=recorder("damping", 0.01),
        lr=recorder("lr", 0.1),
        factor_decay=recorder("factor_decay", 0.95),
        kl_clip=recorder("kl_clip", 0.001),
        factor_update_steps=interval("factor_update_steps", 1),
        inv_update_steps=interval("inv_update_steps", 2),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, preconditioner, optimizer, batches(5))
    for name, steps in seen.items():
        assert sorted(set(steps)) == list(range(5 + (name == "factor_update_steps"))), name
    assert preconditioner.steps == 5


def test_a_callable_returning_a_bad_value_names_it() -> None:
    model = small_cnn()
    preconditioner = KFACPreconditioner(model, damping=lambda step: -1.0 if step == 1 else 0.1)
    (x, y), (x2, y2) = batches(2)
    F.cross_entropy(model(x), y).backward()
    preconditioner.step()
    F.cross_entropy(model(x2), y2).backward()
    with pytest.raises(ValueError, match=r"damping=-1.0 \(returned by the callable at step 1\)"):
        preconditioner.step()


def test_factor_and_inverse_updates_happen_on_their_intervals() -> None:
    model = small_cnn()
    preconditioner = KFACPreconditioner(model, factor_update_steps=3, inv_update_steps=6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    factor_steps, inverse_steps = [], []
    state: dict[str, object] = {"factors": None, "decomp": None}

    def record(step: int) -> None:
        factors = snapshot(preconditioner)
        decomp = [
            t.clone()
            for layer in preconditioner.layers
            for t in layer.decomposition.tensors().values()
        ]
        previous_f, previous_d = state["factors"], state["decomp"]
        if previous_f is None or any(
            not torch.equal(a, b)
            for a, b in zip(factors, previous_f, strict=True)  # type: ignore[call-overload]
        ):
            factor_steps.append(step)
        if previous_d is None or any(
            not torch.equal(a, b)
            for a, b in zip(decomp, previous_d, strict=True)  # type: ignore[call-overload]
        ):
            inverse_steps.append(step)
        state["factors"], state["decomp"] = factors, decomp

    train(model, preconditioner, optimizer, batches(14), on_step=record)
    assert factor_steps == [0, 3, 6, 9, 12]
    assert inverse_steps == [0, 6, 12]


def test_phase_times_follow_the_step_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    # Covariance work made slow enough (50 ms a layer) that the timer cannot miss it, so that
    # which steps spent it does not depend on how busy the machine is.
    add_input = KFACLayer.add_input

    def slow_add_input(self: KFACLayer, inputs: torch.Tensor) -> None:
        time.sleep(0.05)
        add_input(self, inputs)

    monkeypatch.setattr(KFACLayer, "add_input", slow_add_input)
    model = small_cnn()
    preconditioner = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: list[dict[str, float]] = []
    train(
        model,
        preconditioner,
        optimizer,
        batches(5),
        on_step=lambda _step: seen.append(preconditioner.times.reset()),
    )
    assert set(seen[0]) == {
        "factors",
        "decompositions",
        "precondition",
        "communication",
        "staleness",
    }
    assert all(s["staleness"] == 0 for s in seen)  # not measured unless asked for
    assert [s["decompositions"] > 0 for s in seen] == [True, False, False, False, True]
    assert all(s["precondition"] > 0 for s in seen)
    # Factor steps (0, 2, 4) compute covariances in the hooks (50 ms a layer, above); the
    # others only fold nothing.
    covariances = min(seen[i]["factors"] for i in (0, 2, 4))
    assert covariances >= 0.05 * len(preconditioner.layers)
    assert covariances > max(seen[i]["factors"] for i in (1, 3))
    assert preconditioner.times.reset() == dict.fromkeys(seen[0], 0.0)


@pytest.mark.parametrize("update_in_hook", [True, False])
def test_accumulation_equals_one_combined_batch(update_in_hook: bool) -> None:
    ((x, y),) = batches(1, size=24, dtype=torch.float64)
    results = []
    for micro in (1, 4):
        model = small_cnn(dtype=torch.float64)
        preconditioner = KFACPreconditioner(
            model, accumulation_steps=micro, factor_decay=0.5, update_factors_in_hook=update_in_hook
        )
        for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
            (F.cross_entropy(model(xs), ys) / micro).backward()
        preconditioner.step()
        results.append((snapshot(preconditioner), [p.grad.clone() for p in model.parameters()]))
    (factors_1, grads_1), (factors_4, grads_4) = results
    for a, b in zip(factors_1 + grads_1, factors_4 + grads_4, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_update_factors_in_hook_off_gives_the_same_result() -> None:
    results = []
    for in_hook in (True, False):
        model = small_cnn(dtype=torch.float64)
        preconditioner = KFACPreconditioner(
            model, update_factors_in_hook=in_hook, inv_update_steps=2
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, preconditioner, optimizer, batches(4, dtype=torch.float64))
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("outer_product", [True, False])
def test_checkpoint_resume_is_bitwise_identical(method: str, outer_product: bool) -> None:
    data = batches(13)
    options = {
        "factor_update_steps": 2,
        "inv_update_steps": 4,
        "damping": 0.01,
        "compute_method": method,
        "compute_eigenvalue_outer_product": outer_product,
    }

    def fresh() -> tuple[nn.Module, KFACPreconditioner, torch.optim.Optimizer]:
        model = small_cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        return model, KFACPreconditioner(model, **options), optimizer  # type: ignore[arg-type]

    model, preconditioner, optimizer = fresh()
    train(model, preconditioner, optimizer, data)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, preconditioner, optimizer = fresh()
    train(model, preconditioner, optimizer, data[:7])  # step 7: not an inverse-update step
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "kfac": preconditioner.state_dict(),
        },
        buffer,
    )
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    model, preconditioner, optimizer = fresh()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    preconditioner.load_state_dict(checkpoint["kfac"])
    assert preconditioner.steps == 7
    train(model, preconditioner, optimizer, data[7:])
    for a, b in zip(uninterrupted, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_from_another_model_is_refused() -> None:
    preconditioner = KFACPreconditioner(small_cnn())
    other = KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)))
    with pytest.raises(ValueError, match=r"missing \['3', '6', '8'\], unexpected \[\]"):
        preconditioner.load_state_dict(other.state_dict())
    wider = small_cnn()
    wider[8] = nn.Linear(12, 5)
    other = KFACPreconditioner(wider)
    ((x, y),) = batches(1)
    F.cross_entropy(wider(x), y).backward()
    other.step()
    model = small_cnn()
    preconditioner = KFACPreconditioner(model)
    F.cross_entropy(model(x), y).backward()
    preconditioner.step()
    before = snapshot(preconditioner)
    with pytest.raises(ValueError, match=r"layer '8': checkpoint g_factor has shape \(1, 5, 5\)"):
        preconditioner.load_state_dict(other.state_dict())
    # nothing was changed by the refused load, not even the layers before the bad one
    for a, b in zip(before, snapshot(preconditioner), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not a KFACPreconditioner state dict"):
        preconditioner.load_state_dict({"model": 1})


def test_bf16_autocast_run_stays_finite() -> None:
    model = small_cnn()
    preconditioner = KFACPreconditioner(model, inv_update_steps=3, damping=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(12):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        preconditioner.step()
        optimizer.step()
        assert torch.isfinite(loss)
    for layer in preconditioner.layers:
        assert layer.a_factor is not None
        assert layer.a_factor.dtype == torch.float32
        assert torch.isfinite(layer.a_factor).all()
        assert torch.isfinite(layer.g_factor).all()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert preconditioner.skipped_factor_updates == 0


def test_grad_scaler_overflow_leaves_factors_unchanged() -> None:
    model = small_cnn()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    preconditioner = KFACPreconditioner(model, grad_scaler=scaler, damping=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def scaled_step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.unscale_(optimizer)
        preconditioner.step()
        scaler.step(optimizer)
        scaler.update()

    data = batches(3)
    scaled_step(*data[0])
    factors = snapshot(preconditioner)
    params = [p.detach().clone() for p in model.parameters()]
    x, y = data[1]
    x = x.clone()
    x[0, 0, 0, 0] = float("inf")  # overflowing activations and gradients
    scaled_step(x, y)
    assert preconditioner.skipped_factor_updates == 1
    assert preconditioner.skipped_steps == 1
    assert scaler.get_scale() < 2.0**10  # the scaler saw the overflow and backed off
    for before, after in zip(factors, snapshot(preconditioner), strict=True):
        assert torch.equal(before, after)
    for before, after in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, after)
    scaled_step(*data[2])  # training goes on normally afterwards
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert preconditioner.skipped_factor_updates == 1


def test_grad_scaler_scale_is_removed_from_g() -> None:
    ((x, y),) = batches(1, dtype=torch.float64)
    factors = []
    for scale in (None, 2.0**12):
        model = small_cnn(dtype=torch.float64)
        preconditioner = KFACPreconditioner(
            model, grad_scaler=(lambda s=scale: s) if scale else None, factor_decay=0.0
        )
        (F.cross_entropy(model(x), y) * (scale or 1.0)).backward()
        preconditioner.step()
        factors.append(snapshot(preconditioner))
    for a, b in zip(*factors, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def test_memory_usage_is_exact() -> None:
    model = small_cnn()
    preconditioner = KFACPreconditioner(model, compute_eigenvalue_outer_product=True)
    ((x, y),) = batches(1)
    F.cross_entropy(model(x), y).backward()
    preconditioner.step()
    # (a_dim, g_dim) per layer, float32: conv1 1*9+1, conv2 4*9+1, fc1 96+1, fc2 12+1.
    dims = [(10, 4), (37, 6), (97, 12), (13, 3)]
    factors = sum(4 * (a * a + g * g) for a, g in dims)
    # Q_A, Q_G, λ_A, λ_G and the table 1/(λ_G λ_Aᵀ + γ)
    decompositions = sum(4 * (a * a + g * g + a + g + g * a) for a, g in dims)
    assert preconditioner.memory_usage() == {
        "factors": factors,
        "decompositions": decompositions,
        # one reusable batch-factor buffer per factor; the step's two device scalars
        "buffers": factors + STEP_SCALAR_BYTES,
        "total": 2 * factors + decompositions + STEP_SCALAR_BYTES,
    }
    inverse = KFACPreconditioner(small_cnn(), compute_method="inverse")
    assert inverse.memory_usage()["total"] == 0  # nothing allocated before the first step


def test_construction_logs_one_line_naming_layers(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2))
    model[3].weight.requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="kaisa_ray"):
        KFACPreconditioner(model, skip_layers=["Nothing"], loglevel=logging.INFO)
    (record,) = [r for r in caplog.records if r.name.startswith("kaisa_ray")]
    message = record.getMessage()
    assert "preconditions 1 layers: 0 Conv2d [A 10, G 2]" in message
    assert "1 (BatchNorm2d)" in message
    assert "3 (Linear: frozen)" in message


def test_skip_layers_matches_names_and_classes() -> None:
    model = small_cnn()
    assert len(KFACPreconditioner(model, skip_layers=["Conv2d"]).layers) == 2
    assert [lay.name for lay in KFACPreconditioner(small_cnn(), skip_layers="6").layers] == [
        "0",
        "3",
        "8",
    ]


def test_layer_without_gradient_is_left_alone() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 2)
            self.unused = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = TwoHeads()
    preconditioner = KFACPreconditioner(model)
    model(torch.randn(5, 4)).sum().backward()
    preconditioner.step()
    assert model.unused.weight.grad is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"damping": -0.1}, r"damping=-0.1 is outside \(0, inf\)\. Use a positive damping"),
        ({"damping": 0.0}, r"damping=0.0 is outside"),
        ({"factor_decay": 1.0}, r"factor_decay=1.0 is outside \[0, 1\)\. Use a running-average"),
        ({"factor_decay": -0.5}, r"factor_decay=-0.5 is outside \[0, 1\)"),
        (
            {"compute_method": "cholesky"},
            r"compute_method='cholesky' is not valid; choose one of "
            r"'eigen', 'inverse'",
        ),
        ({"kfac_approx": "mean"}, r"kfac_approx='mean' is not valid"),
        ({"kl_clip": 0.0}, r"kl_clip=0.0 is outside .* or None to disable"),
        ({"factor_update_steps": 0}, r"factor_update_steps=0 must be a positive integer"),
        ({"accumulation_steps": 0}, r"accumulation_steps=0 must be a positive integer"),
        (
            {"grad_worker_fraction": 0.5},
            r"grad_worker_fraction=0.5 gives 0.5 gradient workers.*"
            r"valid values for world size 1: \[1.0\]",
        ),
        ({"grad_worker_fraction": "fastest"}, r"grad_worker_fraction='fastest' is not valid"),
        ({"skip_layers": ["("]}, r"skip_layers contains an invalid regular expression"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KFACPreconditioner(small_cnn(), **kwargs)  # type: ignore[arg-type]


def test_model_with_nothing_to_precondition_is_refused() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3), nn.ReLU())
    with pytest.raises(
        ValueError,
        match=r"model has nothing to precondition.*BatchNorm1d.*base "
        r"optimizer alone",
    ):
        KFACPreconditioner(model)
    with pytest.raises(ValueError, match="Loosen skip_layers"):
        KFACPreconditioner(nn.Linear(2, 2), skip_layers=[".*"])


def test_inverse_interval_not_a_multiple_warns() -> None:
    with pytest.warns(
        UserWarning,
        match=r"inv_update_steps=7 is not a multiple of "
        r"factor_update_steps=3.*inv_update_steps=6",
    ):
        KFACPreconditioner(small_cnn(), factor_update_steps=3, inv_update_steps=7)


def test_warnings_point_at_the_callers_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(UserWarning, match="not a multiple") as caught:
        KFACPreconditioner(small_cnn(), factor_update_steps=3, inv_update_steps=7)
    assert caught[0].filename == __file__
    model = small_cnn()
    preconditioner = KFACPreconditioner(model, inv_update_steps=1)
    ((x, y),) = batches(1)
    F.cross_entropy(model(x), y).backward()

    def fails(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise torch.linalg.LinAlgError("simulated")

    monkeypatch.setattr(torch.linalg, "eigh", fails)
    with pytest.warns(RuntimeWarning, match="could not decompose") as caught:
        preconditioner.step()  # under torch.no_grad: the warning must still name this line
    assert {w.filename for w in caught} == {__file__}


def test_kl_clip_none_and_reference_enums_are_accepted() -> None:
    import enum

    class ComputeMethod(enum.Enum):  # what kfac-pytorch users pass
        EIGEN = 1
        INVERSE = 2

    preconditioner = KFACPreconditioner(
        small_cnn(), kl_clip=None, compute_method=ComputeMethod.INVERSE
    )
    assert preconditioner.compute_method == "inverse"
    assert preconditioner.kl_clip is None


def test_eigh_failure_retries_in_float64_then_keeps_previous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = small_cnn()
    preconditioner = KFACPreconditioner(model, inv_update_steps=1, damping=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(3)
    train(model, preconditioner, optimizer, data[:1])
    real_eigh = torch.linalg.eigh
    calls: list[torch.dtype] = []

    def float32_fails(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(matrix.dtype)
        if matrix.dtype != torch.float64:
            raise torch.linalg.LinAlgError("simulated: failed to converge")
        return real_eigh(matrix)

    monkeypatch.setattr(torch.linalg, "eigh", float32_fails)
    train(model, preconditioner, optimizer, data[1:2])
    assert calls.count(torch.float32) == calls.count(torch.float64) == 8
    layer = preconditioner.layers[0]
    assert layer.a_factor is not None
    expected = real_eigh(layer.a_factor.double())[1].float()
    qa = layer.decomposition.tensors()["qa"]
    torch.testing.assert_close(qa.abs(), expected.abs(), rtol=1e-4, atol=1e-4)

    kept = {k: v.clone() for k, v in layer.decomposition.tensors().items()}

    def always_fails(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise torch.linalg.LinAlgError("simulated")

    monkeypatch.setattr(torch.linalg, "eigh", always_fails)
    with pytest.warns(RuntimeWarning, match="could not decompose") as caught:
        train(model, preconditioner, optimizer, data[2:])
    messages = sorted(str(w.message).split(" even")[0] for w in caught)
    assert messages == sorted(
        f"K-FAC could not decompose the {f} factor of layer '{n}'"
        for f in "AG"
        for n in ("0", "3", "6", "8")
    )
    for key, value in layer.decomposition.tensors().items():
        if key in ("qa", "qg"):
            assert torch.equal(value, kept[key])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_rank_deficient_factor_decomposes() -> None:
    """A 785-wide factor from 16 rows without the identity share: the fallback path's case."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    preconditioner = KFACPreconditioner(model, factor_decay=0.0, damping=0.003)
    x = torch.randn(16, 1, 28, 28)
    F.cross_entropy(model(x), torch.randint(0, 10, (16,))).backward()
    preconditioner.step()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
