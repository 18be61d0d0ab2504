"""An embedding's A decomposed from its diagonal against a dense solver, as the vocabulary
grows: the transformer benchmark's best K-FAC job, one worker's share, one process, one thread.

``kfac.embeddings`` preconditions an ``nn.Embedding`` as the Linear layer of one-hot inputs
it is; its A factor is diagonal (the ids' frequencies). Since commit 4dadb3b it is decomposed
from its diagonal (eigenvalues the diagonal, basis the identity) and its preconditioning skips
the products on A's side, and since this table's commit the factor, its batch buffer and its
inverse are held as their diagonals and the basis not at all; before, the factor was held
whole, ``eigh`` decomposed it (cubic in the vocabulary) and the identity-like basis it
returned multiplied every step's gradient. Both run here in the same process: "dense" is this
code with embeddings registered as a subclass whose ``diagonal_a`` is False
(``DenseEmbeddingHelper``), which takes the dense path exactly as before. The memory column
is the preconditioner's own count of the K-FAC state it holds (``memory_usage()``: factors,
decompositions and buffers, every layer).

The job: ``benchmarks/transformer_fortunes.py``'s "K-FAC (Adam eigenbasis, 1/3, 8 sequences,
embeddings)" (Adam in K-FAC's eigenbasis, factors every step from 8 of the worker's 32
sequences, bases every 3 steps) with the character transformer's vocabulary set to each
size (the fortunes corpus's ids stay bytes: the step's cost does not depend on which ids
occur). Each variant's steps are timed in interleaved rounds; the preconditioner's own phase
timers split K-FAC's part.

Run ``python benchmarks/embedding_vocab.py --write`` (about 5 minutes; ``--quick``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import transformer_fortunes as fortunes
from report import git_commit, machine, table, write_block
from torch import nn

from kaisa_ray import registration
from kaisa_ray.layers import EmbeddingHelper
from kaisa_train.spec import parse_job_spec
from kaisa_train.training import Training

ROW = fortunes.ADAM_EIGENBASIS_8_EMB_3
OUT = Path(__file__).resolve().parent / "results" / "embedding_vocab.json"


class DenseEmbeddingHelper(EmbeddingHelper):
    """An embedding whose A is not known to be diagonal: held whole, decomposed densely."""

    @property
    def diagonal_a(self) -> bool:
        return False


def dense_a() -> AbstractContextManager[object]:
    """The dense path (as before 4dadb3b): embeddings registered meanwhile get helpers whose A
    is not known to be diagonal, for as long as they live."""
    return mock.patch.object(registration, "EmbeddingHelper", DenseEmbeddingHelper)


def build(vocabulary: int, dense: bool) -> Training:
    job = fortunes.spec(ROW, 0.016, 0, 10**6)
    job["model"] = {"name": "char-transformer", "params": {"vocabulary": vocabulary}}
    with dense_a() if dense else contextlib.nullcontext():
        training = Training.build(parse_job_spec(job), rank=0, world=1, device=torch.device("cpu"))
    return training


def state_mib(training: Training) -> float:
    """The K-FAC state the preconditioner holds (every layer), MiB."""
    assert training.preconditioner is not None
    return training.preconditioner.memory_usage()["total"] / 2**20


def run_steps(training: Training, steps: int) -> tuple[list[float], dict[str, float]]:
    """``steps`` training steps: each one's seconds, and K-FAC's phase seconds in all."""
    criterion = nn.CrossEntropyLoss()
    preconditioner = training.preconditioner
    assert preconditioner is not None
    preconditioner.times.reset()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step = training.step + 1
        x, y = training.shard.batch(step)
        training.optimizer.zero_grad(set_to_none=True)
        loss = criterion(training.net(x), y)
        training.update(loss, x, y)
        training.step = step
        seconds.append(time.perf_counter() - start)
    return seconds, dict(preconditioner.times.reset())


def measure(vocabularies: list[int], rounds: int, steps: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    found = []
    for vocabulary in vocabularies:
        variants = {"dense": build(vocabulary, True), "diagonal": build(vocabulary, False)}
        for training in variants.values():
            run_steps(training, 6)  # warm: the first decompositions and allocations
        times: dict[str, list[float]] = {name: [] for name in variants}
        phases: dict[str, dict[str, float]] = {name: {} for name in variants}
        for _ in range(rounds):
            for name, training in variants.items():
                seconds, parts = run_steps(training, steps)
                times[name] += seconds
                for part, value in parts.items():
                    phases[name][part] = phases[name].get(part, 0.0) + value
        total = rounds * steps
        for name in variants:
            found.append(
                {
                    "vocabulary": vocabulary,
                    "variant": name,
                    "steps": total,
                    "mean_step_ms": 1e3 * statistics.mean(times[name]),
                    "median_step_ms": 1e3 * statistics.median(times[name]),
                    "phases_ms_per_step": {k: 1e3 * v / total for k, v in phases[name].items()},
                    "kfac_state_mib": state_mib(variants[name]),
                }
            )
            print(json.dumps(found[-1]), flush=True)
    return found


def render(results: list[dict[str, Any]], header: str) -> str:
    rows = []
    by = {(r["vocabulary"], r["variant"]): r for r in results}
    for vocabulary in sorted({r["vocabulary"] for r in results}):
        dense, diagonal = by[(vocabulary, "dense")], by[(vocabulary, "diagonal")]
        for name, r in (("dense (eigh)", dense), ("from its diagonal", diagonal)):
            p = r["phases_ms_per_step"]
            rows.append(
                [
                    str(vocabulary),
                    name,
                    f"{r['mean_step_ms']:.1f}",
                    f"{p.get('decompositions', 0.0):.2f}",
                    f"{p.get('precondition', 0.0):.2f}",
                    f"{p.get('factors', 0.0):.2f}",
                    f"{r['mean_step_ms'] / dense['mean_step_ms']:.2f}x",
                    f"{r['kfac_state_mib']:.1f}" if "kfac_state_mib" in r else "-",
                ]
            )
    return table(
        header,
        [
            "vocabulary",
            "embedding's A",
            "mean step (ms)",
            "decompositions / step",
            "preconditioning / step",
            "factors / step",
            "step ÷ dense",
            "K-FAC state (MiB)",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabularies", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15, help="a multiple of 3 (the bases')")
    parser.add_argument("--quick", action="store_true", help="256 and 512, 1 round of 6")
    parser.add_argument("--report", action="store_true", help="print the stored table")
    parser.add_argument("--write", action="store_true", help="store the table")
    args = parser.parse_args()
    if args.report:
        stored = json.loads(OUT.read_text())
        results, header = stored["results"], stored["header"]
    else:
        if args.quick:
            args.vocabularies, args.rounds, args.steps = [256, 512], 1, 6
        header = (
            f"Measured {datetime.date.today()} at commit {git_commit()} on {machine()}; "
            f"one process, one thread; {args.rounds} interleaved rounds of {args.steps} steps "
            "per variant; K-FAC's phases by its own timers, ms per step."
        )
        results = measure(args.vocabularies, args.rounds, args.steps)
        if args.write:
            OUT.write_text(json.dumps({"header": header, "results": results}, indent=1) + "\n")
    rendered = render(results, header)
    print(rendered)
    if args.write:
        write_block("embedding-vocab", rendered)


if __name__ == "__main__":
    main()
