"""A probe, not a product feature: would K-FAC's own step-size rule (Martens & Grosse 2015,
section 7) cut the steps of the large-batch job further than handing K-FAC's direction to AdamW?

One process, LeNet on Fashion-MNIST at batch 2048 (the batch-size study's largest), to 88% on
the full test set, evaluated every 10 steps, seeds interleaved (the committed table: 0-4). All
modes share the curvature of ``examples/fashion_mnist_large_batch.yaml`` (Fisher-scale factors,
debiased averages, π-damping 0.1, the inverse method, factors every step from 512 examples, the
global count the example's 2 workers use, inverses every 10 steps, no KL clip), built by
``Training.build`` from that job with one worker:

- ``adamw``: the example as committed: the preconditioned gradient into AdamW (lr 0.032 after a
  20-step warm-up);
- ``qm``: no learning rate and no momentum to tune: each step takes ``δ = α Δ + μ δ₀``, with
  ``Δ`` the preconditioned gradient's negative and ``δ₀`` the previous step, ``α`` and ``μ``
  minimising the quadratic model ``gᵀδ + ½ δᵀ (F + λ I) δ``, where ``F`` is the exact
  Gauss-Newton matrix of the cross-entropy (its products from two Jacobian-vector products on
  the factors' 512 examples) and ``λ = 0.1``;
- ``qm+lm``: the same with ``λ`` adapted every 5 steps by the Levenberg-Marquardt rule on the
  reduction ratio ``ρ`` (the loss change on those examples over the undamped model's
  prediction): ``λ × (19/20)^5`` when ``ρ > 3/4``, ``÷`` when ``ρ < 1/4``;
- ``qm+lm, one damping``: the same, with the preconditioner's damping γ following λ (one damping, as
  kfac-jax has it; a new γ takes effect at the next inverse update).

Steps, not seconds, are the point (the quadratic model costs two forward-mode passes over 512
examples a step, unoptimised here). Run ``python benchmarks/quadratic_model_probe.py --seeds 0
1 2 3 4`` (about 18 minutes; ``--write`` stores the table in benchmarks/README.md; raw runs in
``results/quadratic_model_probe.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from report import git_commit, machine, table, write_block
from targets import median_or_none
from torch import nn
from torch.func import functional_call, jvp

from kaisa_train.shard import evaluate
from kaisa_train.spec import parse_job_spec
from kaisa_train.training import Training

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "fashion_mnist_large_batch.yaml"
RESULTS = HERE / "results"
TARGET = 0.88
EVAL_EVERY = 10
SAMPLES = 512  # the example's factor examples over its 2 workers
MODES = ("adamw", "qm", "qm+lm", "qm+lm, one damping")
LAMBDA = 0.1
LM_EVERY = 5
OMEGA = (19 / 20) ** LM_EVERY


def job(seed: int, max_steps: int) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    data["dataset"]["batch_size"] = 2048  # one process holds the global batch
    data["kfac"]["factor_samples"] = SAMPLES
    data["scaling"] = {"workers": 1, "cpus_per_worker": 1}
    data["stop"]["max_steps"] = max_steps
    data["seed"] = seed
    return data


def ggn_quadratic(logits: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``uᵀ H w`` averaged over the examples, ``H`` the softmax cross-entropy's Hessian in the
    logits (``diag(p) − p pᵀ``), ``u`` and ``w`` the logits' directional derivatives."""
    p = torch.softmax(logits, dim=1)
    return ((p * u * w).sum(1) - (p * u).sum(1) * (p * w).sum(1)).mean()


class QuadraticModelStep:
    """``δ = α Δ + μ δ₀`` from the 2x2 quadratic model (Martens & Grosse 2015, section 7)."""

    def __init__(self, model: nn.Module, adapt: bool) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.previous: dict[str, torch.Tensor] | None = None
        self.damping = LAMBDA
        self.adapt = adapt
        self.alphas: list[float] = []

    def __call__(self, x: torch.Tensor, y: torch.Tensor, raw: dict[str, torch.Tensor]) -> None:
        names = list(self.params)
        delta = {n: -self.params[n].grad.detach() for n in names}  # type: ignore[union-attr]
        values = {n: p.detach() for n, p in self.params.items()}

        def logits_of(params: dict[str, torch.Tensor]) -> torch.Tensor:
            # In eval mode (LeNet has no dropout or batch norm, so the same function): K-FAC's
            # hooks save a layer's inputs only in training mode, and these passes are not
            # the step's.
            self.model.eval()
            try:
                out: torch.Tensor = functional_call(self.model, params, (x,))
            finally:
                self.model.train()
            return out

        primal = jvp(logits_of, (values,), (delta,))
        logits, j_delta = primal[0], primal[1]
        directions = [delta]
        jacobians = [j_delta]
        if self.previous is not None:
            j_prev = jvp(logits_of, (values,), (self.previous,))[1]
            directions.append(self.previous)
            jacobians.append(j_prev)
        k = len(directions)
        curvature = torch.zeros(k, k, dtype=torch.float64)
        identity = torch.zeros(k, k, dtype=torch.float64)
        grad = torch.zeros(k, dtype=torch.float64)
        for i in range(k):
            grad[i] = sum(float((raw[n] * directions[i][n]).sum()) for n in names)
            for j in range(k):
                curvature[i, j] = float(ggn_quadratic(logits.detach(), jacobians[i], jacobians[j]))
                identity[i, j] = sum(
                    float((directions[i][n] * directions[j][n]).sum()) for n in names
                )
        damped = curvature + self.damping * identity
        coefficients = -torch.linalg.solve(damped, grad)
        self.alphas.append(float(coefficients[0]))
        step: dict[str, torch.Tensor] = {}
        for n in names:
            step[n] = float(coefficients[0]) * directions[0][n]
            for i in range(1, k):
                step[n] = step[n] + float(coefficients[i]) * directions[i][n]
        with torch.no_grad():
            for n in names:
                self.params[n].add_(step[n])
        self.previous = step
        if self.adapt and len(self.alphas) % LM_EVERY == 0:
            predicted = float(grad @ coefficients + 0.5 * coefficients @ curvature @ coefficients)
            before = float(nn.functional.cross_entropy(logits.detach(), y))
            with torch.no_grad():
                after = float(nn.functional.cross_entropy(logits_of(values), y))
            rho = (after - before) / predicted if predicted < 0 else 0.0
            if rho > 0.75:
                self.damping *= OMEGA
            elif rho < 0.25:
                self.damping /= OMEGA


def run(mode: str, seed: int, max_steps: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    training = Training.build(
        parse_job_spec(job(seed, max_steps)), rank=0, world=1, device=torch.device("cpu")
    )
    model, precond = training.model, training.preconditioner
    assert precond is not None
    qm = QuadraticModelStep(model, adapt="lm" in mode) if mode != "adamw" else None
    if qm is not None and "one damping" in mode:
        # The preconditioner's damping follows λ (kfac-jax's single damping): the constructor's
        # damping may be a function of the step, and Training.build passed the spec's float.
        precond._damping = lambda _: qm.damping
    criterion = nn.CrossEntropyLoss()
    curve: list[tuple[int, float]] = []
    reached: int | None = None
    seconds = 0.0
    taken = 0
    for step in range(1, max_steps + 1):
        taken = step
        x, y = training.shard.batch(step)
        tick = time.perf_counter()
        training.optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        if qm is None:
            precond.step()
            training.optimizer.step()
            training.scheduler.step()
        else:
            # The raw gradient, before K-FAC preconditions it in place: the model's g.
            raw = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
            precond.step()
            qm(x[:SAMPLES], y[:SAMPLES], raw)
        seconds += time.perf_counter() - tick
        if step % EVAL_EVERY == 0:
            accuracy = evaluate(model, training.shard.test_x, training.shard.test_y)
            curve.append((step, accuracy))
            if accuracy >= TARGET:
                reached = step
                break
    return {
        "mode": mode,
        "seed": seed,
        "steps": reached,
        "train_s": seconds,
        "ms_per_step": seconds / max(taken, 1) * 1000,
        "curve": curve,
        "alphas": qm.alphas[::EVAL_EVERY] if qm else [],
        "final_damping": qm.damping if qm else None,
    }


def summarize(runs: list[dict[str, Any]], header: str) -> str:
    rows = []
    adamw = median_or_none([r["steps"] for r in runs if r["mode"] == "adamw"])
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        steps = [r["steps"] for r in mine]
        med = median_or_none(steps)
        rows.append(
            [
                mode,
                f"{sum(s is not None for s in steps)}/{len(steps)}",
                " / ".join("-" if s is None else str(s) for s in steps),
                "-" if med is None else f"{med:.0f}",
                "-" if med is None or adamw is None else f"{med / adamw:.2f}",
                f"{statistics.mean(r['ms_per_step'] for r in mine):.0f}",
                ", ".join(f"{r['final_damping']:.3g}" for r in mine if r["final_damping"]) or "-",
            ]
        )
    return table(
        header,
        [
            "mode",
            "seeds at 88%",
            "steps per seed",
            "steps (median)",
            "steps ÷ adamw's",
            "ms/step (mean, unoptimised)",
            "λ at the end per seed",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--json", type=Path, default=RESULTS / "quadratic_model_probe.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = datetime.datetime.now(datetime.UTC)
    header = (
        f"Measured {started:%Y-%m-%d} at commit {git_commit()} on {machine()}; one process, "
        f"LeNet, batch 2048, the large-batch example's curvature; seeds "
        f"{', '.join(map(str, args.seeds))} interleaved; steps to {TARGET:.0%} test accuracy "
        f"(evaluated every {EVAL_EVERY}), at most {args.max_steps}."
    )
    runs = []
    for seed in args.seeds:
        for mode in args.modes:
            result = run(mode, seed, args.max_steps)
            runs.append(result)
            print(
                f"{mode} seed {seed}: steps {result['steps']}, {result['train_s']:.1f} s, "
                f"last accuracy {result['curve'][-1][1] if result['curve'] else None}, "
                f"λ {result['final_damping']}",
                flush=True,
            )
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"header": header, "runs": runs}, indent=1))
    text = summarize(runs, header)
    print(text)
    if args.write:
        write_block("quadratic-model-probe", text)


if __name__ == "__main__":
    main()
