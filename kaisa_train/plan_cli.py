"""``kaisa-ray plan`` and ``kaisa-ray measure-node``: price a K-FAC job before renting the GPUs,
and measure one GPU node into a hardware profile."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import click
from pydantic import ByteSize, TypeAdapter, ValidationError

from kaisa_ray.enums import (
    ComputeMethod,
    FactorReduction,
    KFACApprox,
    OptimizerName,
    Parallel,
    Precision,
)
from kaisa_ray.errors import ConfigurationError
from kaisa_train.planning import (
    PlanRequest,
    hardware_names,
    plan_job,
    request_from_spec,
)

__all__ = ["measure_node", "plan", "render_plan"]

_BYTES = TypeAdapter(ByteSize)


def parse_size(text: str) -> int:
    """``40GiB``, ``40GB`` (10⁹), ``512MiB`` or a number of bytes."""
    try:
        return int(_BYTES.validate_python(text))
    except ValidationError as err:
        raise click.BadParameter(
            f"{text!r} is not a size; write e.g. 40GiB, 40GB or 512MiB"
        ) from err


def parse_intervals(text: str) -> tuple[tuple[int, int], ...]:
    """``1/10,10/100``: factor/inverse interval pairs."""
    pairs = []
    for item in text.split(","):
        try:
            fus, ius = (int(part) for part in item.strip().split("/"))
        except ValueError as err:
            raise click.BadParameter(
                f"{item!r} is not a pair; write factor/inverse intervals like 1/10,10/100"
            ) from err
        pairs.append((fus, ius))
    return tuple(pairs)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _mb(n: float) -> str:
    return "-" if n == 0 else f"{n / 1e6:,.1f} MB"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()
        for row in rows
    ]


def _choice_text(chosen: dict[str, Any]) -> str:
    return (
        f"{chosen['strategy']} (f={chosen['grad_worker_fraction']:g}) at "
        f"{chosen['factor_update_steps']}/{chosen['inv_update_steps']}: "
        f"{chosen['step_s'] * 1e3:,.1f} ms per step, K-FAC +{chosen['overhead']:.0%} over the "
        f"plain step, {_gib(chosen['memory_bytes'])} per GPU"
    )


def render_plan(report: dict[str, Any]) -> str:
    """The plan as text: inputs, memory and collectives per strategy, time per candidate, the
    tuner's choice under each budget and where it changes."""
    inputs, model, basis = report["inputs"], report["model"], report["basis"]
    seq = f", sequence {inputs['seq_len']}" if inputs.get("seq_len") else ""
    accumulation = (
        f" x {inputs['accumulation_steps']} accumulated" if inputs["accumulation_steps"] > 1 else ""
    )
    lines = [
        f"{inputs['model']}: {model['kfac_layers']} K-FAC layers (largest factor "
        f"{model['largest_factor']}), {model['parameters'] / 1e6:.1f} M parameters, fp32 factors "
        f"{_gib(model['fp32_factor_bytes'])} per rank",
        f"{inputs['workers']} x {inputs['gpu']} ({inputs['hardware']}): {inputs['nodes']} node(s) "
        f"of {inputs['gpus_per_node']}; batch {inputs['batch_size']} per GPU{accumulation}{seq}; "
        f"{inputs['precision']}, {inputs['kfac_approx']} conv factors, "
        f"{inputs['sequence_approx']} tokens, {inputs['compute_method']}",
        f"plain step {basis['plain_step_s'] * 1e3:,.1f} ms ({basis['plain_step_source']})",
        f"base memory {_gib(basis['base_memory_bytes'])} per GPU (weights, gradients, optimizer "
        f"state, activations) + K-FAC temporaries {_gib(basis['kfac_transient_bytes'])}",
    ]
    if inputs["skip_layers"]:
        lines.append(f"skip_layers {inputs['skip_layers']}: {inputs['skip_layers_source']}")
    numbers = ", ".join(f"{n} {k}" for k, n in sorted(basis["hardware_numbers_by_kind"].items()))
    lines.append(f"hardware profile numbers: {numbers}")
    lines += [f"  {term}" for term in basis.get("terms", [])]
    lines += ["", "K-FAC memory per GPU (worst rank, MiB) and collectives (busiest rank)"]
    rows = [
        [
            "strategy",
            "f",
            "factors",
            "decomp.",
            "buffers",
            "K-FAC",
            "factor all-reduce/update",
            "decomp. broadcast/inverse",
            "gradient broadcast/step",
        ]
    ]

    def calls(c: dict[str, Any]) -> str:
        if not c["bytes"]:
            return "-"
        where = "1 node" if c["nodes_spanned"] <= 1 else f"{c['nodes_spanned']} nodes"
        return f"{_mb(c['bytes'])} in {c['calls']} calls, {where}"

    for s in report["strategies"]:
        m, c = s["memory"], s["collectives"]
        rows.append(
            [
                s["strategy"],
                f"{s['grad_worker_fraction']:g}",
                _mib(m["factors"]),
                _mib(m["decompositions"]),
                _mib(m["buffers"]),
                _mib(m["total"]),
                calls(c["factors"]),
                calls(c["decompositions"]),
                calls(c["gradients"]),
            ]
        )
    lines += _table(rows, right={2, 3, 4, 5})
    if inputs.get("factor_reduction") == FactorReduction.DEFERRED:
        lines.append(
            "factor_reduction: deferred: the factor all-reduces run on inverse updates only (the "
            "running averages), and each factor update all-reduces one 8-byte number"
        )
    if inputs.get("parallel") == Parallel.FSDP:
        gathers = {calls(s["collectives"]["gradient_rows"]) for s in report["strategies"]}
        lines.append(
            "sharded by FSDP2: each rank's gradient rows gathered to the layers' workers every "
            "step (all-gathered under COMM-OPT; MEM-OPT and HYBRID-OPT scatter the rows "
            f"back in the gradients' calls), "
            f"{', '.join(sorted(gathers))} (beside the calls above; docs/fsdp.md)"
        )
    lines += ["", "Predicted time per step (slowest rank), ms"]
    rows = [
        [
            "strategy",
            "intervals",
            "step",
            "plain",
            "factors",
            "decomp.",
            "precond.",
            "comm.",
            "K-FAC",
            "GiB/GPU",
        ]
    ]
    for s in report["strategies"]:
        for c in s["candidates"]:
            parts = c["parts_s"]
            rows.append(
                [
                    s["strategy"],
                    f"{c['factor_update_steps']}/{c['inv_update_steps']}",
                    f"{c['step_s'] * 1e3:,.1f}",
                    f"{c['plain_step_s'] * 1e3:,.1f}",
                    f"{parts['factors'] * 1e3:,.2f}",
                    f"{parts['decompositions'] * 1e3:,.2f}",
                    f"{parts['precondition'] * 1e3:,.2f}",
                    f"{parts['communication'] * 1e3:,.2f}",
                    f"+{c['overhead']:.0%}",
                    f"{c['memory_bytes'] / 2**30:.2f}",
                ]
            )
    lines += _table(rows, right=set(range(2, 10)))
    lines += ["", "The tuner's choice (tuner.choice.choose on this forecast)"]
    for choice in report["choices"]:
        budget = _gib(choice["budget_bytes"])
        if choice["chosen"] is None:
            lines.append(f"  budget {budget}: nothing fits: {choice['reason']}")
        else:
            lines.append(f"  budget {budget}: {_choice_text(choice['chosen'])}")
    lines.append("Where the choice changes as the budget grows:")
    for change in report["changes"]:
        need = change["from_budget_bytes"]
        lines.append(f"  from {need / 2**20:,.1f} MiB: {_choice_text(change)}")
    return "\n".join(lines)


def _params(pairs: tuple[str, ...]) -> dict[str, Any]:
    import yaml

    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r}: write --param name=value, e.g. seq_len=128")
        params[key] = yaml.safe_load(value)
    return params


@click.command()
@click.option(
    "--config",
    "config",
    type=click.Path(path_type=Path),
    default=None,
    help="A job file (YAML or JSON) to plan.",
)
@click.option("--spec", "spec_json", default=None, help="A job as one JSON object to plan.")
@click.option("--model", default=None, help="A registered model (resnet50, bert-large, ...).")
@click.option("--workers", type=click.IntRange(1, 65536), default=None, help="GPUs.")
@click.option("--batch", type=click.IntRange(min=1), default=None, help="Batch per GPU.")
@click.option(
    "--hardware",
    default="a100-80gb-hdr",
    show_default=True,
    help=f"A preset ({', '.join(hardware_names())}), a profile of yours by name (in "
    "~/.config/kaisa-ray/hardware, where measure-node writes them) or a profile file.",
)
@click.option(
    "--budget",
    "budgets",
    multiple=True,
    help="Memory budget per GPU (40GiB, 40GB); repeat to sweep [default: the job's "
    "memory_budget, else the GPU's memory].",
)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=None)
@click.option("--intervals", default=None, help="factor/inverse pairs, e.g. 1/10,10/100.")
@click.option("--precision", type=click.Choice([m.value for m in Precision]), default=None)
@click.option("--kfac-approx", type=click.Choice([m.value for m in KFACApprox]), default=None)
@click.option(
    "--sequence-approx",
    type=click.Choice([m.value for m in KFACApprox]),
    default=None,
    help="Linear layers' tokens: every token a row (expand) or one per sequence (reduce).",
)
@click.option("--compute-method", type=click.Choice([m.value for m in ComputeMethod]), default=None)
@click.option(
    "--optimizer", type=click.Choice([name.value for name in OptimizerName]), default=None
)
@click.option("--accumulation", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Language models.")
@click.option("--param", "params", multiple=True, help="Model parameter name=value.")
@click.option(
    "--skip-layers",
    multiple=True,
    help="K-FAC skip_layers regex (repeat) [default: the model's, KAISA's authors' choice].",
)
@click.option(
    "--embeddings",
    is_flag=True,
    default=False,
    help="Precondition the model's nn.Embedding layers too (kfac.embeddings) [default: the "
    "job's, else off].",
)
@click.option(
    "--parallel",
    type=click.Choice([m.value for m in Parallel]),
    default=None,
    help="ddp, or fsdp (sharded by FSDP2) [default: the job's, else ddp].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(
    config: Path | None,
    spec_json: str | None,
    model: str | None,
    workers: int | None,
    batch: int | None,
    hardware: str,
    budgets: tuple[str, ...],
    gpus_per_node: int | None,
    intervals: str | None,
    precision: str | None,
    kfac_approx: str | None,
    sequence_approx: str | None,
    compute_method: str | None,
    optimizer: str | None,
    accumulation: int,
    seq_len: int | None,
    params: tuple[str, ...],
    skip_layers: tuple[str, ...],
    embeddings: bool,
    parallel: str | None,
    as_json: bool,
) -> None:
    """What K-FAC would cost for a job (--config/--spec) or a model (--model, --workers,
    --batch) on GPUs of a hardware profile: memory and collectives per strategy, time per step
    and its parts per candidate, and the tuner's choice under each --budget.

    Example: kaisa-ray plan --model resnet50 --workers 64 --batch 32 --budget 40GB
    """
    sizes = tuple(parse_size(b) for b in budgets)
    try:
        if config is not None or spec_json is not None:
            if model is not None:
                raise click.UsageError("give the job (--config/--spec) or --model, not both")
            from kaisa_train.cli import _job  # the JobSpec's models import torch

            request = request_from_spec(_job(config, spec_json), hardware, sizes, gpus_per_node)
        else:
            if model is None or workers is None or batch is None:
                raise click.UsageError(
                    "give a job (--config FILE or --spec JSON), or --model, --workers and --batch"
                )
            request = PlanRequest(
                model=model,
                batch_size=batch,
                workers=workers,
                hardware=hardware,
                budgets=sizes,
                gpus_per_node=gpus_per_node,
            )
        extra = _params(params)
        if seq_len is not None:
            extra["seq_len"] = seq_len
        overrides: dict[str, Any] = {
            "params": {**request.params, **extra},
            "accumulation_steps": accumulation,
        }
        for name, value in (
            ("workers", workers),
            ("batch_size", batch),
            ("precision", precision),
            ("kfac_approx", kfac_approx),
            ("sequence_approx", sequence_approx),
            ("compute_method", compute_method),
            ("optimizer", optimizer),
            ("parallel", parallel),
        ):
            if value is not None:
                overrides[name] = value
        if intervals is not None:
            overrides["intervals"] = parse_intervals(intervals)
        if skip_layers:
            overrides["skip_layers"] = skip_layers
        if embeddings:
            overrides["embeddings"] = True
        request = dataclasses.replace(request, **overrides)
        report = plan_job(request).to_json()
    except ConfigurationError as err:
        raise click.ClickException(str(err)) from err
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_plan(report))


def _model_to_time(text: str) -> Any:
    """``NAME:BATCH`` as ``tuner.node_training.ModelToTime`` (a registered model, on the CPU)."""
    import functools

    from kaisa_train.registry import model_factory, model_names
    from kaisa_train.shapes import build_on_meta, example_batch
    from tuner.node_training import ModelToTime

    name, _, batch = text.partition(":")
    if name not in model_names() or not batch.isdigit() or int(batch) < 1:
        raise click.BadParameter(
            f"{text!r}: write NAME:BATCH with a registered model ({', '.join(model_names())}) "
            "and a whole batch size, e.g. resnet20:128",
            param_hint="--model",
        )
    meta = build_on_meta(name)
    return ModelToTime(
        name=name,
        build=model_factory(name),
        example=functools.partial(example_batch, name, meta),
        batch=int(batch),
    )


@click.command(name="measure-node")
@click.option(
    "--base",
    default="a100-80gb-hdr",
    show_default=True,
    help=f"The profile whose inter-node links are kept ({', '.join(hardware_names())}).",
)
@click.option("--name", required=True, help="The new profile's name, e.g. my-a100-node.")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write it [default: <name>.yaml in ~/.config/kaisa-ray/hardware, where "
    "--hardware NAME finds it].",
)
@click.option("--device", default="cuda", show_default=True, help="cuda, or cpu to try it out.")
@click.option("--quick", is_flag=True, help="Small sizes and few repeats (a trial run).")
@click.option(
    "--ranks",
    type=click.IntRange(min=1),
    default=None,
    help="Processes for the intra-node collectives [default: the GPUs visible; 1 on CPU].",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="NAME:BATCH",
    help="Also time this registered model's plain training step at this batch per GPU, "
    "e.g. resnet20:128, so that plans of it use a measured step (repeat for several).",
)
def measure_node(
    base: str,
    name: str,
    output: Path | None,
    device: str,
    quick: bool,
    ranks: int | None,
    models: tuple[str, ...],
) -> None:
    """Measure this machine's GPU (matmul rates by size, eigh times, launch latency, the
    intra-node collectives when several GPUs are visible, ResNet-50 training throughput) into a
    hardware profile; every measured number says when, where and with what it was measured."""
    import yaml

    from kaisa_train.models_large import ResNet50
    from kaisa_train.planning import hardware_file, user_hardware_dir
    from tuner.node import measure

    timed = tuple(_model_to_time(text) for text in models)

    if output is None and (name in hardware_names() or "/" in name or name.startswith(".")):
        raise click.BadParameter(
            f"{name!r} is a preset's name or not a file name; choose another (or give --output)",
            param_hint="--name",
        )
    try:
        profile = measure(
            yaml.safe_load(hardware_file(base).read_text()),
            name=name,
            device=device,
            quick=quick,
            ranks=ranks,
            resnet50=ResNet50,
            models=timed,
        )
    except ConfigurationError as err:
        raise click.ClickException(str(err)) from err
    target = output or user_hardware_dir() / f"{name}.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(
        "# Measured by kaisa-ray measure-node; see kaisa_train/hardware/a100-80gb-hdr.yaml\n"
        + yaml.safe_dump(profile, sort_keys=False, width=100)
    )
    use = name if output is None else str(target)
    click.echo(f"wrote {target}; plan with it: kaisa-ray plan --hardware {use} ...")
