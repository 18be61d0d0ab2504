"""K-FAC's own step (``kaisa_ray.quadratic``) against its definition, in float64.

- The step is ``δ = D c`` with ``D = [Δ, δ₀]`` (the preconditioned gradient's negative and the
  previous step) and ``c`` minimising ``gᵀDc + ½ cᵀDᵀ(F + λI)Dc``, ``F = Jᵀ H J`` the
  Gauss-Newton matrix built here from the full Jacobian of the logits and the cross-entropy's
  Hessian in them; for a linear model that is the loss's own Hessian.
- The Levenberg-Marquardt rule: ``ρ`` is the observed over the predicted loss change on the
  sample, and λ moves by ``ω = decay^adapt_every`` exactly as the rule says.
- Its state resumes bit for bit; on 2 gloo processes, each with half the batch, K-FAC with one
  damping and this step equals one process on the whole batch.
- The JobSpec's option and its errors (the end-to-end job on Ray: ``test_ray_train.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from support.harness import run_distributed
from torch import nn
from torch.func import functional_call

from kaisa_ray import KFACPreconditioner, QuadraticModelStep
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.quadratic import StepInfo
from kaisa_train.records import Record
from kaisa_train.session import LocalSession
from kaisa_train.spec import parse_job_spec
from kaisa_train.training import Training
from kaisa_train.transformer import CharTransformer
from kaisa_train.worker import TrainingDivergedError, train
from kaisa_train.worker_config import TrainConfig


@pytest.fixture
def float64() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4))


def batch(seed: int, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=generator), torch.randint(0, 4, (n,), generator=generator)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def unflatten(model: nn.Module, vector: torch.Tensor) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, p in model.named_parameters():
        out[name] = vector[at : at + p.numel()].reshape(p.shape)
        at += p.numel()
    return out


def ggn_direct(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``Jᵀ H J / n`` from the full Jacobian of the logits in the flat parameters."""
    theta = flat(model)

    def logits(vector: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(model, unflatten(model, vector), (x,))
        return out

    jac = torch.autograd.functional.jacobian(logits, theta)  # (n, C, P)
    p = torch.softmax(logits(theta), dim=1)
    total = torch.zeros(theta.numel(), theta.numel())
    for row in range(x.shape[0]):
        h = torch.diag(p[row]) - torch.outer(p[row], p[row])
        total += jac[row].T @ h @ jac[row]
    return total / x.shape[0]


def mean_loss_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]


def set_grads(model: nn.Module, vector: torch.Tensor) -> None:
    for name, value in unflatten(model, vector).items():
        dict(model.named_parameters())[name].grad = value.clone()


@pytest.mark.usefixtures("float64")
def test_the_step_minimises_the_damped_gauss_newton_model_over_its_two_directions() -> None:
    model = mlp()
    qm = QuadraticModelStep(model, damping=0.3, adapt_every=0)
    torch.manual_seed(1)
    theta = flat(model)
    previous = 0.01 * torch.randn_like(theta)  # δ₀, as if a step had been taken
    qm.previous = {n: t.clone() for n, t in unflatten(model, previous).items()}
    x, y = batch(2)
    g = mean_loss_grad(model, x, y)
    qm.capture()
    # The "preconditioned" gradient: any direction will do for the definition; a fixed SPD
    # matrix applied to g, as a preconditioner would.
    root = torch.randn(theta.numel(), theta.numel())
    preconditioned = (root @ root.T / theta.numel() + 0.1 * torch.eye(theta.numel())) @ g
    set_grads(model, preconditioned)
    f = ggn_direct(model, x)  # at θ, before the step

    info = qm.step(x, y)

    directions = torch.stack([-preconditioned, previous], dim=1)  # D, P × 2
    matrix = directions.T @ (f + 0.3 * torch.eye(theta.numel())) @ directions
    c = -torch.linalg.solve(matrix, directions.T @ g)
    torch.testing.assert_close(flat(model) - theta, directions @ c, rtol=1e-10, atol=1e-12)
    assert info.alpha == pytest.approx(float(c[0]), rel=1e-10)
    assert info.mu == pytest.approx(float(c[1]), rel=1e-10)
    undamped = float(g @ directions @ c + 0.5 * c @ directions.T @ f @ directions @ c)
    assert info.predicted == pytest.approx(undamped, rel=1e-10)
    assert info.predicted < 0
    # The next step's δ₀ is this step.
    torch.testing.assert_close(
        torch.cat([t.reshape(-1) for t in qm.previous.values()]), directions @ c
    )


@pytest.mark.usefixtures("float64")
def test_for_a_linear_model_the_gauss_newton_matrix_is_the_loss_hessian() -> None:
    torch.manual_seed(3)
    model = nn.Linear(5, 4)
    x, y = batch(4)
    theta = flat(model)

    def loss(vector: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, unflatten(model, vector), (x,))
        return nn.functional.cross_entropy(out, y)

    hessian = torch.autograd.functional.hessian(loss, theta)
    torch.testing.assert_close(ggn_direct(model, x), hessian, rtol=1e-10, atol=1e-12)
    # And the step's α on the gradient alone (first step: no δ₀) is gᵀg / gᵀ(H + λI)g.
    qm = QuadraticModelStep(model, damping=0.05, adapt_every=0)
    g = mean_loss_grad(model, x, y)
    qm.capture()
    info = qm.step(x, y)
    expected = float(g @ g) / float(g @ (hessian + 0.05 * torch.eye(theta.numel())) @ g)
    assert info.alpha == pytest.approx(expected, rel=1e-10)
    assert info.mu == 0.0
    torch.testing.assert_close(flat(model) - theta, -expected * g, rtol=1e-10, atol=1e-12)


@pytest.mark.usefixtures("float64")
def test_levenberg_marquardt_follows_the_observed_reduction() -> None:
    model = mlp(4)
    qm = QuadraticModelStep(model, damping=1.0, adapt_every=1, decay=0.9)
    x, y = batch(5, 32)
    moved = set()
    for _ in range(12):
        before_damping = qm.damping
        with torch.no_grad():
            before = float(nn.functional.cross_entropy(model(x), y))
        mean_loss_grad(model, x, y)
        qm.capture()
        info = qm.step(x, y)
        with torch.no_grad():
            after = float(nn.functional.cross_entropy(model(x), y))
        assert info.rho == pytest.approx((after - before) / info.predicted, rel=1e-8)
        if info.rho > 0.75:
            expected = before_damping * 0.9
        elif info.rho < 0.25:
            expected = before_damping / 0.9
        else:
            expected = before_damping
        assert qm.damping == pytest.approx(expected, rel=1e-12)
        moved.add(qm.damping < before_damping)
    assert True in moved, "the damping never fell on this easy problem"


def test_the_damping_never_falls_below_its_floor() -> None:
    """An easy problem lowers λ on every step (ρ > 3/4); the floor stops it, exactly."""
    model = mlp(4)
    qm = QuadraticModelStep(model, damping=1.0, min_damping=0.3, adapt_every=1, decay=0.5)
    x, y = batch(5, 32)
    seen = []
    for _ in range(6):
        mean_loss_grad(model, x, y)
        qm.capture()
        qm.step(x, y)
        seen.append(qm.damping)
    assert min(seen) == 0.3, seen
    assert all(d >= 0.3 for d in seen), seen
    # Left out, the floor is 1e-8, or the starting damping where that is lower.
    assert QuadraticModelStep(mlp(), damping=0.1).min_damping == 1e-8
    assert QuadraticModelStep(mlp(), damping=1e-9).min_damping == 1e-9


class Sequence(nn.Module):
    """Per-position logits as a sequence model returns them: (batch, classes, positions)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.inner = mlp(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, positions, 5)
        out: torch.Tensor = self.inner(x).transpose(1, 2)
        return out


@pytest.mark.usefixtures("float64")
def test_sequence_logits_take_the_step_of_their_positions_as_rows() -> None:
    """Logits (batch, classes, positions) with targets (batch, positions), as
    nn.CrossEntropyLoss reads them, step exactly as the same positions given as rows."""
    x, y = batch(11, 24)
    flat_model, seq_model = mlp(12), Sequence(12)
    steps = []
    for model, inputs, targets in (
        (flat_model, x, y),
        (seq_model, x.reshape(4, 6, 5), y.reshape(4, 6)),
    ):
        qm = QuadraticModelStep(model, damping=0.2, adapt_every=1)
        for _ in range(3):
            model.zero_grad()
            nn.functional.cross_entropy(model(inputs), targets).backward()
            qm.capture()
            steps.append(qm.step(inputs, targets))
    for a, b in zip(steps[:3], steps[3:], strict=True):
        assert (a.alpha, a.mu, a.rho) == pytest.approx((b.alpha, b.mu, b.rho), rel=1e-10)
    for a, b in zip(flat_model.parameters(), seq_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_attention_models_take_the_step() -> None:
    """The char-transformer (scaled dot-product attention, whose fused CPU kernel has no
    forward-mode derivative) takes quadratic-model steps, and they lower its loss."""
    torch.manual_seed(0)
    model = CharTransformer(vocabulary=16, context=8, width=8, depth=1, heads=2)
    x, y = torch.randint(0, 16, (8, 8)), torch.randint(0, 16, (8, 8))
    qm = QuadraticModelStep(model, damping=1.0)
    losses = []
    for _ in range(5):
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(float(loss))
        loss.backward()
        qm.capture()
        assert qm.step(x, y).predicted < 0
    assert losses[-1] < losses[0], losses


def test_a_resumed_step_continues_bit_for_bit() -> None:
    def run(steps: int, model: nn.Module, qm: QuadraticModelStep, start: int = 0) -> None:
        for step in range(start, start + steps):
            x, y = batch(10 + step, 16)
            mean_loss_grad(model, x, y)
            qm.capture()
            qm.step(x, y)

    straight = mlp(6)
    qm = QuadraticModelStep(straight, damping=0.2, adapt_every=2)
    run(7, straight, qm)

    first = mlp(6)
    early = QuadraticModelStep(first, damping=0.2, adapt_every=2)
    run(4, first, early)
    state = early.state_dict()
    resumed_model = mlp(99)
    resumed_model.load_state_dict(first.state_dict())
    resumed = QuadraticModelStep(resumed_model, damping=0.2, adapt_every=2)
    resumed.load_state_dict(state)
    run(3, resumed_model, resumed, start=4)
    assert resumed.damping == qm.damping
    for a, b in zip(straight.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_arguments_are_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="starting damping"):
        QuadraticModelStep(mlp(), damping=0.0)
    with pytest.raises(ConfigurationError, match="adapt_every"):
        QuadraticModelStep(mlp(), adapt_every=-1)
    with pytest.raises(ConfigurationError, match="decay"):
        QuadraticModelStep(mlp(), decay=1.5)
    with pytest.raises(ConfigurationError, match=r"min_damping=0\.5: the damping's floor"):
        QuadraticModelStep(mlp(), damping=0.1, min_damping=0.5)
    with pytest.raises(ConfigurationError, match="min_damping=0"):
        QuadraticModelStep(mlp(), min_damping=0)
    qm = QuadraticModelStep(mlp())
    with pytest.raises(RuntimeError, match="capture"):
        qm.step(*batch(0))


STEPS = 8


def kfac_qm_worker(rank: int, world: int, full: bool = False) -> list[torch.Tensor]:
    """K-FAC with one damping and the quadratic-model step; gradients averaged over ranks by
    hand, each rank's half of a fixed global batch (or, ``full``, one process on all of it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _kfac_qm_steps(rank, world, full)
    finally:  # it also runs in the test's own process
        torch.set_default_dtype(previous)


def _kfac_qm_steps(rank: int, world: int, full: bool) -> list[torch.Tensor]:
    model = mlp(8)
    qm = QuadraticModelStep(model, damping=0.1, adapt_every=2)
    preconditioner = KFACPreconditioner(
        model,
        factor_update_steps=1,
        inv_update_steps=3,
        damping=qm.current_damping,
        kl_clip=None,
        lr=1.0,
        running_average="debiased",
        factor_scale="fisher",
        pi_damping=True,
        compute_method="inverse",
        grad_worker_fraction="comm-opt",
        loglevel=0,
    )
    for step in range(STEPS):
        x, y = batch(40 + step, 24)
        if not full:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)  # type: ignore[arg-type]
                p.grad /= world  # type: ignore[operator]
        qm.capture()
        preconditioner.step()
        qm.step(x, y)
    return [p.detach().clone() for p in model.parameters()] + [torch.tensor(qm.damping)]


def test_two_ranks_equal_one_process_on_the_whole_batch() -> None:
    one = kfac_qm_worker(0, 1, full=True)
    ranks = run_distributed(kfac_qm_worker, 2, timeout=120)
    assert float(one[-1]) != 0.1, "the damping never adapted: the test would not see LM"
    for a, b in zip(ranks[0], ranks[1], strict=True):
        assert torch.equal(a, b), "the ranks took different steps"
    for a, e in zip(ranks[0], one, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


BASE = {
    "name": "qm",
    "model": {"name": "lenet"},
    "dataset": {"name": "synthetic", "batch_size": 32, "limit": 256},
    "stop": {"max_steps": 10},
}


def test_the_job_spec_option_and_its_errors() -> None:
    spec = parse_job_spec({**BASE, "kfac": {"update": "quadratic-model"}})
    assert spec.kfac != "off"
    assert spec.kfac.quadratic_model
    assert spec.kfac.kl_clip is None
    assert parse_job_spec(BASE).kfac != "off"
    with pytest.raises(ValueError, match="set kl_clip: null"):
        parse_job_spec({**BASE, "kfac": {"update": "quadratic-model", "kl_clip": 0.001}})
    with pytest.raises(ValueError, match="set precision: fp32"):
        parse_job_spec({**BASE, "kfac": {"update": "quadratic-model"}, "precision": "bf16"})
    with pytest.raises(ValueError, match="weight_decay: 0"):
        parse_job_spec(
            {
                **BASE,
                "kfac": {"update": "quadratic-model"},
                "optimizer": {"name": "adamw", "weight_decay": 0.01},
            }
        )
    with pytest.raises(ValueError, match="quadratic-model"):
        parse_job_spec({**BASE, "kfac": {"update": "newton"}})
    # The JobSpec floors the adapted damping at 1e-3 by default (the library at 1e-8), and
    # the worker's step gets the floor; a starting damping below it becomes the floor.
    assert spec.kfac.min_damping == 1e-3
    training = Training.build(spec, rank=0, world=1, device=torch.device("cpu"))
    assert training.quadratic is not None
    assert training.quadratic.min_damping == 1e-3
    unfloored = {"update": "quadratic-model", "min_damping": 1e-8}
    training = Training.build(
        parse_job_spec({**BASE, "kfac": unfloored}), rank=0, world=1, device=torch.device("cpu")
    )
    assert training.quadratic is not None
    assert training.quadratic.min_damping == 1e-8
    low = parse_job_spec({**BASE, "kfac": {"update": "quadratic-model", "damping": 1e-4}})
    training = Training.build(low, rank=0, world=1, device=torch.device("cpu"))
    assert training.quadratic is not None
    assert training.quadratic.min_damping == 1e-4
    # A stored spec's dump (every field, the default floor too) parses back as it was.
    ordinary = parse_job_spec(BASE)
    assert parse_job_spec(ordinary.model_dump(mode="json")) == ordinary
    with pytest.raises(ValueError, match="applies to update: quadratic-model only"):
        parse_job_spec({**BASE, "kfac": {"min_damping": 1e-8}})
    with pytest.raises(ValueError, match=r"is above the starting damping 0\.1"):
        parse_job_spec({**BASE, "kfac": {"update": "quadratic-model", "min_damping": 0.5}})


def test_a_diverged_quadratic_model_job_names_its_damping_floor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A quadratic-model job whose loss turns NaN fails saying which settings to raise, the
    floor first with its value (the step is poisoned at a seam: no small job diverges on
    demand)."""
    spec = parse_job_spec({**BASE, "kfac": {"update": "quadratic-model", "min_damping": 0.01}})
    take_step = QuadraticModelStep.step

    def poisoned(self: QuadraticModelStep, x: torch.Tensor, y: torch.Tensor) -> StepInfo:
        info = take_step(self, x, y)
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.fill_(float("nan"))
        return info

    monkeypatch.setattr(QuadraticModelStep, "step", poisoned)
    records: list[Record] = []
    with pytest.raises(
        TrainingDivergedError,
        match=r"the training loss is nan at step 2 on rank 0: the run diverged\. "
        r"Raise kfac\.min_damping \(the floor of the quadratic model's adapted damping, now "
        r"0\.01\) or kfac\.damping",
    ):
        train(TrainConfig(spec=spec, run="qm-nan"), LocalSession(records.append))
