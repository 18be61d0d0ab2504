"""Where a training step's time goes, by kind of K-FAC step, on a CPU or a CUDA GPU.

Shared by ``step_phases.py`` (this machine's CPU, before and after a change), ``gpu_step.py``
and ``plan_vs_gpu.py`` (a GPU). A ``Trainee`` is one workload (model, batch, loss,
optimizer) with or without a ``KFACPreconditioner``; its steps are timed one by one (CUDA
events on a GPU, so a step is the device's time from the end of the last step to the end of
this one) and sorted by what K-FAC did in them:

- ``quiet``: only preconditioning with the current decompositions;
- ``factors``: also a factor update (the hooks' covariances, the running averages);
- ``decomposition``: also every layer's decomposition.

The phases are differences of medians of whole steps: preconditioning = quiet - plain (the
first-order step on the same model), factors = factors - quiet (per update), decompositions
= decomposition - factors (per update). ``products`` is the time of the bare
preconditioning products over the same layers (batched where the code batches them), so
that preconditioning - products is the rest of a quiet step: gathering and writing back the
gradients, the KL clip and Python.

``python benchmarks/phases.py --serve`` answers rounds over stdin/stdout (JSON lines), so
that another checkout's code (``PYTHONPATH`` set to it) can be timed interleaved with this
one's: ``step_phases.py --before PATH``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """A model, its batch and loss, and its optimizer (by name and lr)."""

    model: Callable[[], nn.Module]
    batch: Callable[[int, torch.device], Batch]
    optimizer: str
    lr: float


def _images(shape: tuple[int, ...], classes: int) -> Callable[[int, torch.device], Batch]:
    def batch(size: int, device: torch.device) -> Batch:
        g = torch.Generator().manual_seed(size)
        x = torch.randn(size, *shape, generator=g)
        y = torch.randint(0, classes, (size,), generator=g)
        return x.to(device), y.to(device)

    return batch


def _tokens(context: int) -> Callable[[int, torch.device], Batch]:
    def batch(size: int, device: torch.device) -> Batch:
        g = torch.Generator().manual_seed(size)
        x = torch.randint(0, 256, (size, context + 1), generator=g)
        return x[:, :-1].to(device), x[:, 1:].to(device)

    return batch


def _lenet() -> nn.Module:
    from kaisa_train.models import LeNetCNN

    return LeNetCNN()


def _resnet20() -> nn.Module:
    from kaisa_train.models import ResNet20

    return ResNet20()


def _resnet50() -> nn.Module:
    from kaisa_train.models_large import ResNet50

    return ResNet50()


def _char_transformer(**params: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from kaisa_train.transformer import CharTransformer

        return CharTransformer(**params)

    return build


WORKLOADS: dict[str, Workload] = {
    "lenet": Workload(_lenet, _images((1, 28, 28), 10), "adamw", 0.008),
    "resnet20": Workload(_resnet20, _images((3, 32, 32), 10), "sgd", 0.05),
    "resnet50": Workload(_resnet50, _images((3, 224, 224), 1000), "sgd", 0.05),
    "char-transformer": Workload(_char_transformer(), _tokens(64), "adamw", 0.002),
    # the 10.7M-parameter byte-level transformer measured on an H200 (shared/gpu/README.md)
    "char-transformer-10m": Workload(
        _char_transformer(context=256, width=384, depth=6, heads=6),
        _tokens(256),
        "adamw",
        0.001,
    ),
}

# The JobSpec's curvature (kaisa_train.spec.KFACSpec's defaults), no KL clip.
JOBSPEC_CURVATURE: dict[str, Any] = {
    "compute_method": "inverse",
    "kfac_approx": "reduce",
    "running_average": "debiased",
    "factor_scale": "fisher",
    "pi_damping": True,
    "damping": 0.1,
    "kl_clip": None,
}


class Trainee:
    """One workload stepping on one fixed batch, with K-FAC (``kfac``: its keyword
    arguments) or without (None); ``precision`` 'bf16' runs the forward under autocast."""

    def __init__(
        self,
        workload: str,
        batch: int,
        kfac: dict[str, Any] | None,
        device: torch.device,
        precision: str = "fp32",
    ) -> None:
        from kaisa_ray import KFACPreconditioner

        spec = WORKLOADS[workload]
        torch.manual_seed(0)
        self.workload = spec
        self.device = device
        self.model = spec.model().to(device)
        self.x, self.y = spec.batch(batch, device)
        params = self.model.parameters()
        self.optimizer: torch.optim.Optimizer = (
            torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
            if spec.optimizer == "adamw"
            else torch.optim.SGD(params, lr=spec.lr, momentum=0.9)
        )
        self.precision = precision
        self.preconditioner = None if kfac is None else KFACPreconditioner(self.model, **kfac)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            # logits (batch, classes) or, for a language model, (batch, vocabulary, time)
            loss = F.cross_entropy(self.model(self.x).float(), self.y)
        loss.backward()  # type: ignore[no-untyped-call]

    def step(self) -> str:
        """One training step; what K-FAC did in it."""
        self.forward_backward()
        kind = "plain"
        if self.preconditioner is not None:
            self.preconditioner.step()
            factors, decompositions = self.preconditioner.last_updates
            kind = "decomposition" if decompositions else "factors" if factors else "quiet"
        self.optimizer.step()
        return kind

    def products_ms(self, repeats: int) -> float:
        """Milliseconds of the bare preconditioning products over this rank's layers, as the
        code runs them (shape groups where it has them, else layer by layer)."""
        p = self.preconditioner
        if p is None:
            return 0.0
        self.forward_backward()
        damping = p.damping
        groups = getattr(p, "_groups", None)
        precision = getattr(p, "_products", contextlib.nullcontext)

        from kaisa_ray import batching

        together = getattr(batching, "precondition", None)  # not in older checkouts

        def run() -> None:
            with torch.no_grad(), precision():
                if groups is not None and together is not None:
                    together(groups, batching.gather(groups), damping)
                elif groups is not None:
                    for group in groups:
                        group.precondition(group.gather(), damping)
                else:
                    for layer in p.layers:
                        layer.decomposition.precondition(layer.helper.grad(), damping)

        run()
        times = []
        for _ in range(repeats):
            with timer(self.device) as elapsed:
                run()
            times.append(elapsed())
        return statistics.median(times)


@contextlib.contextmanager
def timer(device: torch.device) -> Iterator[Callable[[], float]]:
    """Milliseconds of the block (CUDA events on a GPU); read after the block."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # type: ignore[no-untyped-call]
        result: list[float] = []
        yield lambda: result[0]
        end.record()  # type: ignore[no-untyped-call]
        end.synchronize()  # type: ignore[no-untyped-call]
        result.append(start.elapsed_time(end))  # type: ignore[no-untyped-call]
        return
    tick = time.perf_counter()
    wall: list[float] = []
    yield lambda: wall[0]
    wall.append((time.perf_counter() - tick) * 1000)


def time_steps(trainee: Trainee, steps: int) -> list[tuple[str, float]]:
    """Each step's kind and milliseconds (on a GPU: CUDA events between consecutive steps,
    read once at the end, so that timing does not make the host wait)."""
    if trainee.device.type != "cuda":
        out = []
        for _ in range(steps):
            tick = time.perf_counter()
            kind = trainee.step()
            out.append((kind, (time.perf_counter() - tick) * 1000))
        return out
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    kinds = []
    events[0].record()  # type: ignore[no-untyped-call]
    for i in range(steps):
        kinds.append(trainee.step())
        events[i + 1].record()  # type: ignore[no-untyped-call]
    events[-1].synchronize()  # type: ignore[no-untyped-call]
    return [
        (kind, events[i].elapsed_time(events[i + 1]))  # type: ignore[no-untyped-call]
        for i, kind in enumerate(kinds)
    ]


def summarize(timed: list[tuple[str, float]]) -> dict[str, float]:
    """Median milliseconds per kind of step, and the mean over all (``mean``)."""
    out: dict[str, float] = {"mean": statistics.mean(ms for _, ms in timed)}
    for kind in ("plain", "quiet", "factors", "decomposition"):
        values = [ms for k, ms in timed if k == kind]
        if values:
            out[kind] = statistics.median(values)
    return out


def phases(kfac: dict[str, float], plain: float) -> dict[str, float]:
    """Preconditioning per step, factors and decompositions per update (ms), from medians."""
    out: dict[str, float] = {}
    if "quiet" in kfac:
        out["precondition"] = kfac["quiet"] - plain
        if "factors" in kfac:
            out["factors"] = kfac["factors"] - kfac["quiet"]
            if "decomposition" in kfac:
                out["decompositions"] = kfac["decomposition"] - kfac["factors"]
    return out


@dataclass(frozen=True)
class Config:
    label: str
    workload: str
    batch: int
    kfac: dict[str, Any] | None
    # the code versions it runs in: "after" (this checkout), "before" (--before)
    versions: tuple[str, ...] = ("before", "after")
    steps: int = 50
    precision: str = "fp32"  # 'bf16': the forward under autocast


class Worker:
    """A ``phases.py --serve`` process running one checkout's code."""

    def __init__(self, tree: Path) -> None:
        # the checkout first; what the caller's path held (installed packages) after it
        path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tree,
        )
        ready = json.loads(self._line())
        self.package = ready["ready"]
        if not self.package.startswith(str(tree)):
            raise SystemExit(f"{tree}: the worker imported kaisa_ray from {self.package}")

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the worker exited with {self.process.wait()}")
        return line

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer: dict[str, Any] = json.loads(self._line())
        return answer

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        if self.process.wait(timeout=60) != 0:
            raise SystemExit(f"a worker exited with {self.process.returncode}")


@dataclass
class Measured:
    """Every configuration's timed steps (kind, ms), products (ms) and peak memory (MiB, on
    a GPU), by (label, version)."""

    timed: dict[tuple[str, str], list[tuple[str, float]]] = field(default_factory=dict)
    products: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    peak_mib: dict[tuple[str, str], float] = field(default_factory=dict)
    failed: dict[tuple[str, str], str] = field(default_factory=dict)  # the error, by key


def run_rounds(
    configs: Sequence[Config], trees: dict[str, Path], rounds: int, device: torch.device
) -> Measured:
    """``rounds`` interleaved rounds (after one warm-up round) of every configuration in
    every version it runs in, one ``--serve`` process per version (``trees``: its checkout)."""
    workers = {version: Worker(tree) for version, tree in trees.items()}
    measured = Measured()
    for round_ in range(rounds + 1):  # the first round warms up: past step 0's work
        for config in configs:
            for version, worker in workers.items():
                if version not in config.versions or (config.label, version) in measured.failed:
                    continue
                answer = worker.ask(
                    {
                        "key": config.label,
                        "workload": config.workload,
                        "batch": config.batch,
                        "kfac": config.kfac,
                        "precision": config.precision,
                        "device": str(device),
                        "steps": config.steps,
                        "products": 20 if config.kfac is not None and round_ > 0 else 0,
                    }
                )
                key = (config.label, version)
                if "error" in answer:
                    print(f"{config.label} ({version}) failed: {answer['error']}", file=sys.stderr)
                    measured.failed[key] = answer["error"]
                    measured.timed.pop(key, None)
                    continue
                if round_ == 0:
                    measured.peak_mib[key] = answer["peak_mib"]
                    continue
                measured.timed.setdefault(key, []).extend(
                    (kind, ms) for kind, ms in answer["timed"]
                )
                measured.products.setdefault(key, []).append(answer["products_ms"])
    for worker in workers.values():
        worker.close()
    return measured


COLUMNS = [
    "configuration",
    "code",
    "mean step",
    "÷ first-order step",
    "preconditioning / step",
    "of which products",
    "factors / update",
    "decompositions / update",
]


def row_of(result: dict[str, Any], memory: bool = False) -> list[str]:
    """A table row (``COLUMNS``, then peak MiB with ``memory``) from a JSON row of
    ``tabulate``: the stored results print as they were measured."""
    found = result["phases"]
    row = [
        result["config"],
        result["version"],
        f"{result['summary']['mean']:.2f}",
        f"{result['ratio']:.2f}x",
        *(
            f"{found[k]:.2f}" if k in found else "-"
            for k in ("precondition", "products", "factors", "decompositions")
        ),
    ]
    if memory:
        row.append(f"{result['peak_mib'] or 0.0:.0f}")
    return row


def tabulate(
    configs: Sequence[Config], measured: Measured, versions: Sequence[str], memory: bool = False
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """Table rows (``COLUMNS``, then peak MiB with ``memory``) and JSON rows: each K-FAC
    configuration against the first-order configuration of its workload, batch, precision
    and version (the first-order rows first)."""
    rows, results = [], []
    plain: dict[tuple[str, int, str, str], float] = {}
    # the first-order configurations first: the K-FAC ones are divided by theirs
    for config in sorted(configs, key=lambda c: c.kfac is not None):
        for version in versions:
            key = (config.label, version)
            if key not in measured.timed:
                continue
            summary = summarize(measured.timed[key])
            base_key = (config.workload, config.batch, config.precision, version)
            found: dict[str, float] = {}
            if config.kfac is None:
                plain[base_key] = summary["plain"]
            else:
                found = phases(summary, plain[base_key])
                found["products"] = statistics.median(measured.products[key])
            ratio = summary["mean"] / plain[base_key]
            result = {
                "config": config.label,
                "version": version,
                "summary": summary,
                "phases": found,
                "ratio": ratio,
                "peak_mib": measured.peak_mib.get(key),
            }
            rows.append(row_of(result, memory))
            results.append(result)
    return rows, results


def serve() -> None:
    """Answer timing requests on stdin, one JSON line each: ``{"key", "workload", "batch",
    "kfac", "precision", "steps", "products"}`` -> ``{"key", "timed", "products_ms"}``. A
    trainee is built on its key's first request and kept, so rounds continue its run."""
    import kaisa_ray

    torch.set_num_threads(1)
    trainees: dict[str, Trainee] = {}
    print(json.dumps({"ready": kaisa_ray.__file__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = _answer(request, trainees)
        except Exception as error:  # the configuration fails; the others go on
            trainees.pop(request["key"], None)
            answer = {"key": request["key"], "error": f"{type(error).__name__}: {error}"}
            traceback.print_exc(file=sys.stderr)
        print(json.dumps(answer), flush=True)


def _answer(request: dict[str, Any], trainees: dict[str, Trainee]) -> dict[str, Any]:
    """One request's answer (``serve``)."""
    key = request["key"]
    device = torch.device(request.get("device", "cpu"))
    peak_mib = 0.0
    if key not in trainees:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        trainees[key] = Trainee(
            request["workload"],
            request["batch"],
            request["kfac"],
            device,
            request.get("precision", "fp32"),
        )
        timed = time_steps(trainees[key], request["steps"])
        if device.type == "cuda":  # the allocator's peak over this trainee's first steps
            peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        timed = time_steps(trainees[key], request["steps"])
    trainee = trainees[key]
    products = trainee.products_ms(request.get("products", 0)) if request.get("products") else 0.0
    return {"key": key, "timed": timed, "products_ms": products, "peak_mib": peak_mib}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="answer rounds on stdin")
    if parser.parse_args().serve:
        serve()
    else:
        parser.print_help()
