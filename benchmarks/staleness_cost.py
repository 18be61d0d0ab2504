"""What measuring staleness costs per step: K-FAC with ``measure_staleness`` on and off, LeNet
on Fashion-MNIST, one process, one thread.

The example job's model and K-FAC (``examples/fashion_mnist.yaml``: K-FAC-reduce, the JobSpec's
curvature defaults) at batch 128, intervals 1/10 and 5/50. Each configuration is timed by
``tuner.profile.measure_candidate`` (whole inverse-update periods of at least ``--min-steps``
steps, from the same weights, memory counted over the first period), the four of them
interleaved over ``--rounds`` rounds; medians. With staleness measured, every factor update
multiplies each factor by its probes (``F·Ω``) and every decomposition step preconditions the
gradient a second time with the previous decomposition (``kaisa_ray.staleness``); across ranks
it adds one small all-reduce per decomposition step, which one process does not pay.

Run ``python benchmarks/staleness_cost.py --write`` (about 3 minutes; ``--quick``).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from report import git_commit, machine, table, write_block

from kaisa_ray.preconditioner import KFACPreconditioner
from kaisa_train.registry import model_factory
from kaisa_train.shard import load_shard
from kaisa_train.spec import KFACSpec, load_job_spec
from tuner.profile import measure_candidate

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fashion_mnist.yaml"
MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-steps", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="1 round of 20 steps")
    parser.add_argument("--write", action="store_true", help="store the table")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.min_steps = 1, 20
    torch.set_num_threads(1)
    spec = load_job_spec(EXAMPLE)
    spec = spec.model_copy(update={"dataset": spec.dataset.model_copy(update={"batch_size": 128})})
    kfac = spec.kfac
    assert isinstance(kfac, KFACSpec)
    shard = load_shard(spec.dataset, spec.seed, 0, 1)
    torch.manual_seed(spec.seed)
    model = model_factory(spec.model.name)(**spec.model.params)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options: dict[str, object] = {
        "kfac_approx": kfac.kfac_approx,
        "damping": kfac.damping,
        "kl_clip": kfac.kl_clip,
        "running_average": kfac.running_average,
        "factor_scale": kfac.factor_scale,
        "pi_damping": kfac.pi_damping,
    }
    configs = [(i, m) for i in ((1, 10), (5, 50)) for m in (False, True)]
    times: dict[tuple[tuple[int, int], bool], list[float]] = {c: [] for c in configs}
    memory: dict[tuple[tuple[int, int], bool], int] = {}
    started = datetime.datetime.now(datetime.UTC)
    for round_ in range(args.rounds):
        for (fus, ius), measure in configs:
            m = measure_candidate(
                model,
                optimizer,
                lambda i: shard.batch(i + 1),
                F.cross_entropy,
                torch.device("cpu"),
                grad_worker_fraction=1.0,
                factor_update_steps=fus,
                inv_update_steps=ius,
                min_steps=args.min_steps,
                count_memory=round_ == 0,
                kfac_options={**options, "measure_staleness": measure},
            )
            times[(fus, ius), measure].append(1000 * m.step_s)
            if round_ == 0:
                memory[(fus, ius), measure] = m.memory_bytes
        print(f"round {round_}: " + ", ".join(f"{t[-1]:.1f}" for t in times.values()), flush=True)
    # The staleness phase on its own (the preconditioner's phase timer): what it adds to a step
    # whatever the load does to the rest of the step.
    phase_ms: dict[tuple[int, int], tuple[float, float]] = {}
    for fus, ius in {i for i, _ in configs}:
        preconditioner = KFACPreconditioner(
            model,
            factor_update_steps=fus,
            inv_update_steps=ius,
            measure_staleness=True,
            **options,  # type: ignore[arg-type]
        )
        steps = ius * max(1, -(-args.min_steps // ius))
        began = time.perf_counter()
        for i in range(steps):
            x, y = shard.batch(i + 1)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            preconditioner.step()
            optimizer.step()
        total = time.perf_counter() - began
        seconds = preconditioner.times.reset()
        preconditioner.remove_hooks()
        phase_ms[(fus, ius)] = (1000 * seconds["staleness"] / steps, 1000 * total / steps)
    rows = []
    for (fus, ius), measure in configs:
        ms = statistics.median(times[(fus, ius), measure])
        off = statistics.median(times[(fus, ius), False])
        per_round = [
            on / base
            for on, base in zip(times[(fus, ius), measure], times[(fus, ius), False], strict=True)
        ]
        rows.append(
            [
                f"{fus}/{ius}",
                "on" if measure else "off",
                f"{ms:.1f}",
                f"{ms / off:.3f}",
                f"{statistics.median(per_round):.3f}",
                f"{memory[(fus, ius), measure] / MIB:.2f}",
                (
                    f"{phase_ms[(fus, ius)][0]:.2f} of {phase_ms[(fus, ius)][1]:.1f} "
                    f"({phase_ms[(fus, ius)][0] / phase_ms[(fus, ius)][1]:.1%})"
                    if measure
                    else "-"
                ),
            ]
        )
    text = table(
        f"Measured {started:%Y-%m-%d} at commit {git_commit()} on {machine()}; LeNet, batch 128, "
        f"one process; {args.rounds} interleaved rounds of at least {args.min_steps} steps per "
        "configuration, medians.",
        [
            "intervals",
            "staleness measured",
            "ms/step (median)",
            "÷ off (medians)",
            "÷ off (median of per-round ratios)",
            "peak MiB",
            "staleness phase ms/step of the whole step (its share)",
        ],
        rows,
    )
    print(text)
    if args.write:
        write_block("staleness-cost", text)


if __name__ == "__main__":
    main()
