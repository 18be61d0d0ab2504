"""The plan's K-FAC terms against measurements: each term against a timing of its own
operation, and each phase of a real training step, on this CPU and on the GPU measurements
stored in ``results/gpu/``.

Predictions come from the forecast ``kaisa-ray plan`` uses (``tuner.forecast``: shapes on the
meta device, a hardware profile, one rank). Two kinds of measurement sit beside them:

- **terms**: K-FAC's operations of one model timed one by one, synchronised, in isolation
  (``tuner.kernels.measure_kernels``): every layer's factor work (the patch extraction or
  position sums, then the covariance products: the forecast's extraction and products terms),
  every shape group's preconditioning products, every size's decompositions as
  ``batching.decompose`` runs them;
- **phases**: whole training steps (``phases.py``: preconditioning per step, factors and
  decompositions per update, by differences of medians) and the mean step at the
  configuration's intervals.

Sources:

- ``--cpu``: this machine, one thread. ``tuner.node.measure`` (``kaisa-ray measure-node
  --device cpu --model lenet:64 --model resnet20:128``) writes the profile; then LeNet (AdamW +
  K-FAC 5/50, 64 a worker) and ResNet-20 (SGD + K-FAC 10/100, batch 128), with the JobSpec's
  curvature, are measured both ways.
- ``--gpu-run2``: one NVIDIA H200, 2026-11-26, commit 2c514aa (runs without a GPU). The profile
  is ``results/gpu/h200-measured.yaml`` (``../shared/gpu/h200-measured.yaml``, written by
  ``measure-node`` at a85ad65) plus the ``decompose_s`` table today's ``measure-node`` adds,
  taken from the same session's timings of K-FAC's solvers at ResNet-50's sizes
  (``results/gpu/run2_gpu_kernels.json``, which also holds the terms' timings); the phases are
  ``results/gpu/run2_gpu_step_b32.json``. That profile has no ``tf32`` rates and no
  ``kfac_overhead_s``: the tables say what that costs.

    python benchmarks/plan_check.py --cpu --gpu-run2 --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from phases import JOBSPEC_CURVATURE, WORKLOADS, Config, run_rounds, summarize
from phases import phases as phase_split
from report import git_commit, machine, table, write_block

from kaisa_ray.plan import plan
from kaisa_train.shapes import workload
from tuner.cost import price
from tuner.forecast import Workload, factor_work_seconds, forecast_profile, group_products
from tuner.hardware import Hardware
from tuner.hardware_file import hardware_from_dict
from tuner.kernels import measure_kernels

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SHARED = RESULTS / "gpu" / "h200-measured.yaml"  # ../shared/gpu/h200-measured.yaml
PHASES = ("precondition", "factors", "decompositions")
SOLVERS = RESULTS / "gpu" / "h200-measured-solvers.yaml"
TERM_COLUMNS = ["configuration", "term", "timed alone", "predicted", "predicted ÷ timed"]


@dataclass(frozen=True)
class Case:
    label: str
    model: str
    batch: int
    kfac: dict[str, Any]
    optimizer: str = "sgd"


def predict(case: Case, hardware: Hardware) -> dict[str, float]:
    """Milliseconds: the plan's plain step, its K-FAC phases and its mean step."""
    options = case.kfac
    job = _job(case)
    profile, basis = forecast_profile(job, hardware, 1)
    strategy = plan(list(profile.layers), 1, 1.0, compute_method=profile.compute_method)
    fus, ius = options["factor_update_steps"], options["inv_update_steps"]
    candidate = price(profile, strategy, fus, ius)
    parts = candidate.breakdown
    return {  # the phases as they add to a whole step (``tuner.cost.overlapped``)
        "plain": basis.step_s * 1e3,
        "precondition": parts["precondition"] * 1e3,
        "factors": parts["factors"] * fus * 1e3,
        "decompositions": parts["decompositions"] * ius * 1e3,
        "mean": candidate.step_s * 1e3,
        "terms": list(basis.terms),  # type: ignore[dict-item]
    }


def _job(case: Case) -> Workload:
    options = case.kfac
    job = workload(
        case.model,
        batch_size=case.batch,
        kfac_approx=options.get("kfac_approx", "expand"),
        compute_method=options.get("compute_method", "eigen"),
        optimizer=case.optimizer,
    )
    return Workload(**{**job.__dict__, "matmul_precision": options.get("matmul_precision", "high")})


def predicted_terms(case: Case, hardware: Hardware) -> dict[str, float]:
    """Milliseconds of the forecast's arithmetic terms alone (no fixed costs): every layer's
    covariance products, every shape group's preconditioning products, every decomposition."""
    job = _job(case)
    factors = factor_work_seconds(job, hardware)
    precondition = sum(seconds for seconds, _ in group_products(job, hardware).values())
    solve = forecast_profile(job, hardware, 1)[0].decomposition.seconds
    decompositions = sum(
        layer.groups * (solve(layer.a_dim) + solve(layer.g_dim)) for layer in job.layers
    )
    return {
        "factor work": factors * 1e3,
        "preconditioning products": precondition * 1e3,
        "decompositions": decompositions * 1e3,
    }


def measured_terms(kernels: dict[str, Any]) -> dict[str, float]:
    """The same terms from a ``tuner.kernels`` profile (its ``to_dict()``), in ms."""
    return {
        "factor work": 1e3
        * sum(layer["a_factor_s"] + layer["g_factor_s"] for layer in kernels["layers"]),
        "preconditioning products": 1e3 * sum(g["precondition_s"] for g in kernels["groups"]),
        "decompositions": 1e3 * sum(d["seconds"] for d in kernels["decompositions"]),
    }


def term_rows(
    label: str, predicted: dict[str, float], measured: dict[str, float]
) -> list[list[str]]:
    return [
        [
            label,
            name,
            f"{measured[name]:.2f}",
            f"{predicted[name]:.2f}",
            _ratio(predicted[name], measured[name]),
        ]
        for name in predicted
    ]


def _ratio(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None or measured <= 0:
        return "-"
    return f"{predicted / measured:.2f}"


def rows_of(label: str, predicted: dict[str, Any], measured: dict[str, float]) -> list[list[str]]:
    rows = []
    for phase in ("mean", "plain", *PHASES):
        p, m = predicted.get(phase), measured.get(phase)
        rows.append(
            [
                label,
                {"mean": "mean step", "plain": "plain step"}.get(phase, phase),
                "-" if m is None else f"{m:.2f}",
                "-" if p is None else f"{p:.2f}",
                _ratio(p, m),
            ]
        )
    return rows


# -- the CPU ------------------------------------------------------------------------------

CPU_CASES = [
    Case(
        "LeNet, 64, AdamW + K-FAC 5/50",
        "lenet",
        64,
        {**JOBSPEC_CURVATURE, "factor_update_steps": 5, "inv_update_steps": 50},
        "adamw",
    ),
    Case(
        "ResNet-20, 128, SGD + K-FAC 10/100",
        "resnet20",
        128,
        {**JOBSPEC_CURVATURE, "factor_update_steps": 10, "inv_update_steps": 100},
    ),
]
FIRST_ORDER = {"lenet": ("lenet", 64), "resnet20": ("resnet20", 128)}


def live(
    device: torch.device,
    name: str,
    cases: list[Case],
    models: tuple[str, ...],
    rounds: int,
    largest: int,
) -> dict[str, Any]:
    """Measure this machine's profile (``measure-node`` with ``models``), then each case's
    terms (operations timed alone) and phases (whole steps), against the forecast from it."""
    from kaisa_train.plan_cli import _model_to_time
    from kaisa_train.planning import hardware_file
    from tuner.node import measure

    base = yaml.safe_load(hardware_file("a100-80gb-hdr").read_text())
    profile = measure(
        base,
        name=name,
        device=device.type,
        largest=largest,
        models=tuple(_model_to_time(model) for model in models),
    )
    hardware = hardware_from_dict(profile)
    configs, seen = [], set()
    for case in cases:
        first = _first_order(case)
        if first not in seen:
            seen.add(first)
            configs.append(Config(first, case.model, case.batch, None, ("after",)))
        steps = case.kfac["inv_update_steps"]
        configs.append(Config(case.label, case.model, case.batch, case.kfac, ("after",), steps))
    measured = run_rounds(configs, {"after": HERE.parent}, rounds, device)
    terms = []
    for case in cases:
        spec = WORKLOADS[case.model]
        torch.manual_seed(0)
        model = spec.model().to(device)
        x, y = spec.batch(case.batch, device)
        options = {
            k: v
            for k, v in case.kfac.items()
            if k not in ("factor_update_steps", "inv_update_steps")
        }
        kernels = measure_kernels(model, x, y, repeats=7, **options).to_dict()
        terms.append(
            {
                "case": case.label,
                "measured": measured_terms(kernels),
                "predicted": predicted_terms(case, hardware),
            }
        )
    # The same forecast with the stand-in's fixed costs (``kfac_overhead_s``) in place of the
    # model's own (``kfac_host_s``, measured on a GPU): what the model's own change, one run;
    # and with the host's times from one-sample steps back to back (``steady_host``).
    stand_in = (
        hardware_from_dict({k: v for k, v in profile.items() if k != "kfac_host_s"})
        if profile.get("kfac_host_s")
        else None
    )
    steady = (
        hardware_from_dict(steady_host(profile, device, models)) if device.type == "cuda" else None
    )
    out = []
    for case in cases:
        plain = summarize(measured.timed[(_first_order(case), "after")])["plain"]
        kfac = summarize(measured.timed[(case.label, "after")])
        found = {"mean": kfac["mean"], "plain": plain, **phase_split(kfac, plain)}
        row = {"case": case.label, "measured": found, "predicted": predict(case, hardware)}
        if stand_in is not None:
            row["predicted_stand_in"] = predict(case, stand_in)
        if steady is not None:
            row["predicted_steady"] = predict(case, steady)
        out.append(row)
    return {"profile": profile, "rows": out, "terms": terms}


def steady_host(profile: dict[str, Any], device: torch.device, models: tuple[str, ...]) -> Any:
    """``profile`` with each model's host times (the plain step's ``host_step_s`` and
    K-FAC's ``kfac_host_s``) taken again from one-sample steps back to back
    (``tuner.measure.steady_seconds``) instead of each waited for."""
    import copy

    from kaisa_train.plan_cli import _model_to_time
    from tuner.node_kfac import model_kfac_host
    from tuner.node_training import measured, training_rate

    where = "one-sample steps back to back (plan_check.steady_host)"
    out = copy.deepcopy(profile)
    for name in dict.fromkeys(model.split(":", 1)[0] for model in models):
        timed = _model_to_time(f"{name}:1")
        _, host = training_rate(timed.build, device, "fp32", 30, timed.example, 1, steady=True)
        for entry in out.get("training", []):
            if entry.get("model") == name and entry.get("precision") == "fp32" and host:
                entry["host_step_s"] = measured(host, f"{name}: the host's step", where)
        out["kfac_host_s"] = [
            *(e for e in out.get("kfac_host_s", []) if e.get("model") != name),
            *model_kfac_host(timed, device, 30, where, steady=True),
        ]
    return out


def _first_order(case: Case) -> str:
    return f"{case.model} b{case.batch}: first-order"


def cpu(rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    # LeNet's and ResNet-20's factors are at most 785 and 577
    models = ("lenet:64", "resnet20:128")
    return live(torch.device("cpu"), "this-cpu", CPU_CASES, models, rounds, 1024)


def gpu(rounds: int, batches: tuple[int, ...] = (32,)) -> dict[str, Any]:
    """This machine's GPU: ResNet-50 at batch 32, the cases of the stored run; at any other
    batch in ``batches``, the JobSpec's curvature with the inverse and the eigen method."""
    cases = [
        Case(label.split(": ", 1)[1], "resnet50", 32, options)
        for label, options in GPU_CASES.items()
        if 32 in batches
    ]
    for batch in (b for b in batches if b != 32):
        cases += [
            Case(f"b{batch} {label.split(': ', 1)[1]}", "resnet50", batch, options)
            for label, options in GPU_CASES.items()
            if label.endswith(JOBSPEC_CASES)
        ]
    if 32 in batches:  # the 1/10 rows: every step a factor step
        cases += [Case(label, "resnet50", 32, options) for label, options in GPU_CASES_1_10.items()]
    name = torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")
    models = tuple(f"resnet50:{batch}" for batch in batches)
    return live(torch.device("cuda"), f"{name}-measured", cases, models, rounds, 4096)


# -- the stored GPU run -------------------------------------------------------------------

GPU_CASES = {  # run 2's configurations (gpu_step.py labels) and the plan's options for them
    "ResNet-50 b32 fp32: K-FAC reference eigen expand 10/100": {
        "compute_method": "eigen",
        "kfac_approx": "expand",
        "factor_update_steps": 10,
        "inv_update_steps": 100,
    },
    "ResNet-50 b32 fp32: K-FAC eigen 10/100": {
        **JOBSPEC_CURVATURE,
        "compute_method": "eigen",
        "factor_update_steps": 10,
        "inv_update_steps": 100,
    },
    "ResNet-50 b32 fp32: K-FAC inverse 10/100": {
        **JOBSPEC_CURVATURE,
        "factor_update_steps": 10,
        "inv_update_steps": 100,
    },
    "ResNet-50 b32 fp32: K-FAC inverse 10/100, highest": {
        **JOBSPEC_CURVATURE,
        "factor_update_steps": 10,
        "inv_update_steps": 100,
        "matmul_precision": "highest",
    },
}

JOBSPEC_CASES = ("K-FAC eigen 10/100", "inverse 10/100")  # the JobSpec's curvature
GPU_CASES_1_10 = {  # the same at intervals 1/10, eigen and inverse
    label.split(": ", 1)[1].replace("10/100", "1/10"): {
        **options,
        "factor_update_steps": 1,
        "inv_update_steps": 10,
    }
    for label, options in GPU_CASES.items()
    if label.endswith(JOBSPEC_CASES)
}


def h200_profile() -> dict[str, Any]:
    """The shared H200 profile with the ``decompose_s`` table of K-FAC's solvers as run 2
    timed them (per factor: the seconds of a size's batch over its count)."""
    profile = yaml.safe_load(SHARED.read_text())
    kernels = json.loads((RESULTS / "gpu" / "run2_gpu_kernels.json").read_text())
    rows = {row["config"]: row for row in kernels["rows"]}
    where = (
        "K-FAC's {method} solver on ResNet-50's {count} factor(s) of {n}x{n} at once, per "
        "factor; measured by benchmarks/gpu_kernels.py on NVIDIA H200, 2026-11-26, commit 2c514aa"
    )
    profile["gpu"]["decompose_s"] = {
        method: [
            {
                "n": entry["dim"],
                "count": entry["count"],
                "value": entry["seconds"] / entry["count"],
                "kind": "measured",
                "source": where.format(method=method, count=entry["count"], n=entry["dim"]),
            }
            for entry in rows[config]["decompositions"]
        ]
        for method, config in (
            ("eigen", "eigen-expand-highest"),
            ("inverse", "inverse-expand-highest"),
        )
    }
    return profile


def gpu_run2() -> dict[str, Any]:
    profile = h200_profile()
    hardware = hardware_from_dict(profile)
    stored = json.loads((RESULTS / "gpu" / "run2_gpu_step_b32.json").read_text())
    by_label = {row["config"]: row for row in stored["rows"]}
    plain = by_label["ResNet-50 b32 fp32: SGD"]["summary"]["plain"]
    out = []
    for label, options in GPU_CASES.items():
        row = by_label[label]
        found = {"mean": row["summary"]["mean"], "plain": plain, **row["phases"]}
        case = Case(label.split(": ", 1)[1], "resnet50", 32, options)
        out.append({"case": case.label, "measured": found, "predicted": predict(case, hardware)})
    kernels = json.loads((RESULTS / "gpu" / "run2_gpu_kernels.json").read_text())
    terms = []
    for row in kernels["rows"]:
        options = {**row["options"], "factor_update_steps": 10, "inv_update_steps": 100}
        case = Case(f"{row['config']}", "resnet50", row["batch"], options)
        terms.append(
            {
                "case": case.label,
                "measured": measured_terms(row),
                "predicted": predicted_terms(case, hardware),
            }
        )
    return {"rows": out, "terms": terms, "measured_at": stored["commit"]}


def render(result: dict[str, Any]) -> str:
    parts = [
        f"Computed {result['date']} at commit {result['commit']} on {result['machine']}. "
        "Milliseconds; phases by whole-step differences (phases.py): preconditioning per step, "
        "factors and decompositions per update; predicted: the forecast `kaisa-ray plan` uses, "
        "one rank.",
        "",
    ]
    columns = ["configuration", "phase", "measured", "predicted", "predicted ÷ measured"]
    titles = {
        "cpu": "This CPU, one thread",
        "gpu": "One H200 (run 2, stored)",
        "gpu-live": "One {device}, measured on it at commit {commit}, {date}".format(
            device=result.get("gpu-live", {}).get("device", "GPU"),
            commit=result.get("gpu-live", {}).get("commit", result["commit"]),
            date=result.get("gpu-live", {}).get("date", result["date"]),
        ),
    }
    for key, title in titles.items():
        if key not in result:
            continue
        rows = [
            r
            for item in result[key]["rows"]
            for r in rows_of(item["case"], item["predicted"], item["measured"])
        ]
        terms = result[key]["rows"][0]["predicted"]["terms"]
        timed = [
            r
            for item in result[key].get("terms", [])
            for r in term_rows(item["case"], item["predicted"], item["measured"])
        ]
        parts += [
            table(
                f"**{title}: each term against its operation, timed alone**", TERM_COLUMNS, timed
            ),
            "",
            table(f"**{title}: the phases of real training steps**", columns, rows),
            "",
            "What the terms rest on:",
            "",
        ]
        parts += [f"- {term}" for term in terms] + [""]
        parts += _compared(
            result[key]["rows"],
            "predicted_steady",
            f"**{title}: the mean step with the host's times from one-sample steps each waited "
            "for (the profile's) and back to back**",
            ("waited for", "back to back"),
        )
        parts += _compared(
            result[key]["rows"],
            "predicted_stand_in",
            f"**{title}: the mean step with the model's own fixed costs (kfac_host_s) and with "
            "the stand-in's (kfac_overhead_s)**",
            ("own", "stand-in"),
        )
    return "\n".join(parts).rstrip()


def _compared(
    items: list[dict[str, Any]], other: str, header: str, names: tuple[str, str]
) -> list[str]:
    """A table of each case's measured mean step beside the profile's prediction and the
    prediction stored under ``other`` (none where no case has it)."""
    rows = [
        [
            item["case"],
            f"{item['measured']['mean']:.2f}",
            *(
                value
                for key in ("predicted", other)
                for value in (
                    f"{item[key]['mean']:.2f}",
                    f"{item[key]['mean'] / item['measured']['mean']:.2f}",
                )
            ),
        ]
        for item in items
        if other in item
    ]
    if not rows:
        return []
    columns = ["configuration", "measured"]
    for name in names:
        columns += [name, f"{name} ÷ measured"]
    return [table(header, columns, rows), ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="measure this CPU and its phases")
    parser.add_argument("--gpu-run2", action="store_true", help="the stored H200 run 2")
    parser.add_argument("--gpu", action="store_true", help="measure this machine's GPU")
    parser.add_argument("--json", type=Path, default=None, help="also save the results here")
    parser.add_argument(
        "--add-gpu", type=Path, default=None, help="a saved --gpu run (--json) to add to the stored"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[32], help="--gpu: ResNet-50's batches"
    )
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--report", action="store_true", help="print the stored results")
    args = parser.parse_args()
    path = RESULTS / "plan_check.json"
    if args.report:
        print(render(json.loads(path.read_text())))
        return 0
    if args.add_gpu is not None:  # a run on a lent GPU beside the stored CPU and run-2 checks
        stored = json.loads(path.read_text())
        added = json.loads(args.add_gpu.read_text())
        stored["gpu-live"] = {**added["gpu-live"], "commit": added["commit"], "date": added["date"]}
        path.write_text(json.dumps(stored, indent=1))
        text = render(stored)
        print(text)
        write_block("plan-check", text)
        return 0
    if not (args.cpu or args.gpu_run2 or args.gpu):
        parser.error("say what to check: --cpu, --gpu, --gpu-run2 or several")
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "machine": machine(),
    }
    if args.gpu_run2:
        result["gpu"] = gpu_run2()
    if args.cpu:
        result["cpu"] = cpu(args.rounds)
    if args.gpu:
        result["gpu-live"] = gpu(args.rounds, tuple(args.batches))
        result["gpu-live"]["device"] = torch.cuda.get_device_name()
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    text = render(result)
    print(text)
    if args.write:
        path.write_text(json.dumps(result, indent=1))
        if args.gpu_run2:  # for `kaisa-ray plan --hardware <it>`
            SOLVERS.write_text(
                "# results/gpu/h200-measured.yaml plus decompose_s from run 2 "
                "(benchmarks/plan_check.py)\n"
                + yaml.safe_dump(h200_profile(), sort_keys=False, width=100)
            )
        write_block("plan-check", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
