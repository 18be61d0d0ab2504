"""Eigenvalue ranges of each layer's K-FAC factors on the benchmark CNN, after N updates.

Shows how a damping value compares with the curvature K-FAC actually sees under the
reference implementation's scaling conventions (G from gradients of a mean loss, conv
factors divided by the number of positions), and how much of each factor is still the
identity the running average started from (``factor_decay ** updates``).

Run ``python benchmarks/factor_spectra.py [--updates 100] [--factor-decay 0.95]``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from kaisa_ray import KFACPreconditioner
from kaisa_train.datasets import load_idx_dataset
from kaisa_train.models import LeNetCNN


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--factor-decay", type=float, default=0.95)
    parser.add_argument("--kfac-approx", default="expand", choices=["expand", "reduce"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x, y = load_idx_dataset(split="train", limit=128 * args.updates)
    torch.manual_seed(0)
    model = LeNetCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    preconditioner = KFACPreconditioner(
        model,
        factor_decay=args.factor_decay,
        kfac_approx=args.kfac_approx,
        inv_update_steps=10**9,
        damping=1.0,
        kl_clip=None,
        lr=0.0,
        loglevel=0,
    )
    for i in range(args.updates):
        optimizer.zero_grad()
        batch = slice(i * 128, (i + 1) * 128)
        F.cross_entropy(model(x[batch]), y[batch]).backward()
        raw = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        preconditioner.step()  # folds this batch into the factors
        for p, g in zip((p for p in model.parameters() if p.grad is not None), raw, strict=True):
            p.grad.copy_(g)  # ... but the trajectory is plain SGD's, the baseline's
        optimizer.step()
    identity = args.factor_decay**args.updates
    print(
        f"after {args.updates} updates with factor_decay {args.factor_decay}: the identity "
        f"start still contributes {identity:.2e} to every eigenvalue"
    )
    print("| layer | A max | A median | G max | G median | max of G⊗A |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layer in preconditioner.layers:
        assert layer.a_factor is not None
        assert layer.g_factor is not None
        ea = torch.linalg.eigvalsh(layer.a_factor.double()).flatten()
        eg = torch.linalg.eigvalsh(layer.g_factor.double()).flatten()
        print(
            f"| {layer.name} | {ea.max():.2e} | {ea.median():.2e} | {eg.max():.2e} | "
            f"{eg.median():.2e} | {ea.max() * eg.max():.2e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
