"""``kaisa-ray plan``: what a K-FAC job would cost on GPUs it has not run on, and what the
tuner would choose there.

``plan_job(PlanRequest(...))`` prices every KAISA strategy the world size admits, at every
interval pair of the ladder, from the model's shapes (``kaisa_train.shapes``) and a
hardware profile (``tuner.hardware``; presets in ``kaisa_train/hardware/``):

- per strategy, the exact per-rank K-FAC memory of ``kaisa_ray.plan`` (factors,
  decompositions, buffers; the worst rank) and the bytes each collective moves per step (the
  factor all-reduce on factor-update steps, the decomposition broadcast on inverse-update
  steps, the preconditioned-gradient broadcast every step), with the nodes they span;
- per candidate, the predicted time per step and its parts (``tuner.cost`` on the profile
  ``tuner.forecast`` predicts, collectives priced by ``tuner.topology``);
- the tuner's choice (``tuner.choice.choose``) under each budget asked for, and the budgets at
  which the choice changes (the candidates' own memory needs are the only places it can).

The result is plain JSON (``PlanReport.to_json``): the CLI prints it or a table, the service
returns it from ``POST /v1/plan``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kaisa_ray.enums import (
    ComputeMethod,
    FactorReduction,
    KFACApprox,
    OptimizerName,
    Parallel,
    Precision,
    Scaling,
)
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.plan import Plan, plan
from kaisa_ray.strategy import placeable_fractions
from kaisa_train.shape_table import PLANNING, stored_workload
from tuner.choice import DEFAULT_INTERVALS, NoFeasibleCandidateError, choose
from tuner.cost import Candidate, Profile, prices
from tuner.forecast import Basis, Workload, forecast_profile, sharded_transient
from tuner.hardware import Hardware
from tuner.hardware_file import hardware_from_dict
from tuner.topology import Topology

HARDWARE_DIR = Path(__file__).with_name("hardware")


def user_hardware_dir() -> Path:
    """Where ``kaisa-ray measure-node`` writes profiles and ``--hardware NAME`` finds them
    after the presets: ``$XDG_CONFIG_HOME/kaisa-ray/hardware`` (``~/.config/...``), never the
    installed package."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kaisa-ray" / "hardware"


def hardware_names() -> list[str]:
    """The hardware presets shipped with kaisa-ray (the service offers these only)."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def user_hardware_names() -> list[str]:
    """The profiles in ``user_hardware_dir()`` (a preset's name there is shadowed)."""
    presets = hardware_names()
    return sorted(p.stem for p in user_hardware_dir().glob("*.yaml") if p.stem not in presets)


def hardware_file(name_or_path: str | Path) -> Path:
    """The file of a preset or of a profile in ``user_hardware_dir()`` (by name, presets
    first), or a profile file's path.

    Raises:
        ConfigurationError: none of these (the presets and the user's profiles are listed).
    """
    text = str(name_or_path)
    if "/" not in text:
        for folder in (HARDWARE_DIR, user_hardware_dir()):
            path = folder / f"{text}.yaml"
            if path.is_file():
                return path
    path = Path(text).expanduser()
    if not path.is_file():
        mine = ", ".join(user_hardware_names()) or "none yet"
        raise ConfigurationError(
            f"unknown hardware {text!r}: give a preset ({', '.join(hardware_names())}), a "
            f"profile of yours in {user_hardware_dir()} ({mine}; `kaisa-ray measure-node` "
            "writes them there), or a profile file (see kaisa_train/hardware/*.yaml for the "
            "format)"
        )
    return path


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A preset by name (``a100-80gb-hdr``) or a profile file (YAML or JSON).

    Raises:
        ConfigurationError: an unknown name (the presets are listed) or an invalid file
            (``HardwareProfileError``, every bad field named).
    """
    path = hardware_file(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigurationError(f"hardware profile {path} is not valid YAML: {err}") from err
    return hardware_from_dict(data, origin=f"hardware profile {path}")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan: a model at a batch size on ``workers`` GPUs of ``hardware``."""

    model: str
    params: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int
    workers: int
    hardware: str
    budgets: tuple[int, ...] = ()  # bytes per GPU; empty: the GPU's memory
    intervals: tuple[tuple[int, int], ...] = DEFAULT_INTERVALS
    precision: str = Precision.FP32
    kfac_approx: str = KFACApprox.EXPAND
    sequence_approx: str = KFACApprox.EXPAND
    compute_method: str = ComputeMethod.EIGEN
    scaling: str = Scaling.KRONECKER
    skip_layers: tuple[str, ...] | None = None  # None: the model's default (KAISA's)
    optimizer: str = OptimizerName.SGD.value
    accumulation_steps: int = 1
    gpus_per_node: int | None = None  # None: the hardware's
    spec_strategy: float | str | None = None  # a JobSpec's own choice, marked in the report
    parallel: str = Parallel.DDP  # fsdp: sharded by FSDP2 (docs/fsdp.md)
    # deferred: the factors all-reduced on decomposition steps only (kaisa_ray.enums)
    factor_reduction: str = FactorReduction.EVERY_UPDATE
    embeddings: bool = False  # nn.Embedding layers preconditioned too (kfac.embeddings)

    def __post_init__(self) -> None:
        problems = []
        if self.batch_size < 1:
            problems.append(f"batch_size={self.batch_size} must be at least 1")
        if not 1 <= self.workers <= 65536:
            problems.append(f"workers={self.workers} must be between 1 and 65536")
        if self.accumulation_steps < 1:
            problems.append(f"accumulation_steps={self.accumulation_steps} must be at least 1")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            problems.append(f"gpus_per_node={self.gpus_per_node} must be at least 1")
        if OptimizerName(self.optimizer).peer:
            planned = ", ".join(n for n in OptimizerName if not n.peer)
            problems.append(
                f"optimizer {self.optimizer} preconditions the gradient itself and runs with "
                f"kfac: off, so there is no K-FAC to plan; name one of {planned}"
            )
        for budget in self.budgets:
            if budget <= 0:
                problems.append(f"budget {budget} must be a positive number of bytes")
        for fus, ius in self.intervals:
            if fus < 1 or ius < 1 or ius % fus:
                problems.append(
                    f"intervals {fus}/{ius}: both positive, the inverse interval a multiple of "
                    f"the factor interval (e.g. {fus}/{10 * max(fus, 1)})"
                )
        if problems:
            raise ConfigurationError("cannot plan this job: " + "; ".join(problems))


def request_from_spec(
    spec: Any, hardware: str, budgets: Sequence[int] = (), gpus_per_node: int | None = None
) -> PlanRequest:
    """The plan of a ``JobSpec``: its model, batch, workers, precision and K-FAC settings."""
    from kaisa_train.spec import KFACSpec

    kfac = spec.kfac if isinstance(spec.kfac, KFACSpec) else None
    if kfac is None:
        raise ConfigurationError(
            f"job {spec.name!r} trains with kfac: off; there is no K-FAC to plan (set kfac)"
        )
    if not budgets and spec.memory_budget is not None:
        budgets = (int(spec.memory_budget),)
    return PlanRequest(
        model=spec.model.name,
        params=dict(spec.model.params),
        batch_size=spec.dataset.batch_size,
        workers=spec.scaling.workers,
        hardware=hardware,
        budgets=tuple(budgets),
        intervals=tuple(kfac.ladder() or DEFAULT_INTERVALS),
        precision=spec.precision,
        kfac_approx=kfac.kfac_approx,
        sequence_approx=kfac.sequence_approx,
        compute_method=kfac.compute_method,
        scaling=kfac.scaling,
        optimizer=spec.optimizer.name,
        gpus_per_node=gpus_per_node,
        spec_strategy=None if kfac.auto else kfac.strategy,
        parallel=spec.scaling.parallel,
        factor_reduction=kfac.factor_reduction,
        embeddings=kfac.embeddings,
    )


def strategy_name(fraction: float, world: int) -> str:
    if fraction == 1.0:
        return "COMM-OPT"
    if round(fraction * world) == 1:
        return "MEM-OPT"
    return f"HYBRID-OPT 1/{round(1 / fraction)}"


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """Everything ``plan_job`` found, as JSON-ready values (see the module docstring)."""

    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return self.data


def _collectives(strategy: Plan, topology: Topology) -> dict[str, Any]:
    """Per purpose, the busiest rank's calls and bytes on the step type that makes them, and
    whether they cross nodes. Each purpose's calls are one part of a rank's plan
    (``kaisa_ray.plan.Plan``): the factor all-reduces are every rank's, the decomposition
    broadcasts its column's, the gradient broadcasts its row's (the same bytes in every row);
    the busiest rank is the lowest with the most bytes, as a pass over every rank finds it."""
    parts = {
        "factors": [strategy.factor_calls],
        "decompositions": [strategy.column_calls(column) for column in strategy.representatives],
        "gradients": [strategy.row_calls(0)],
    }
    if strategy.options.parallel is Parallel.FSDP:  # FSDP2's gradient rows, every step
        parts["gradient_rows"] = [
            strategy.gather_calls
            + strategy.row_gather_calls(0)
            + strategy.column_gather_calls(column)
            + strategy.finite_calls
            + strategy.clip_calls
            for column in strategy.representatives
        ]
    out: dict[str, Any] = {}
    for purpose, candidates in parts.items():
        best: tuple[int, int, int] = (0, 0, 0)  # bytes, calls, nodes spanned
        for calls in candidates:  # in rank order
            nbytes = sum(c.nbytes for c in calls)
            if nbytes > best[0]:
                groups = {id(c.group): c.group for c in calls}.values()  # one tuple per group
                spans = max((topology.span(group)[0] for group in groups), default=0)
                best = (nbytes, len(calls), spans)
        out[purpose] = {"bytes": best[0], "calls": best[1], "nodes_spanned": best[2]}
    return out


def _candidate_json(candidate: Candidate, profile: Profile) -> dict[str, Any]:
    return {
        "factor_update_steps": candidate.factor_update_steps,
        "inv_update_steps": candidate.inv_update_steps,
        "step_s": candidate.step_s,
        "plain_step_s": profile.step_s,
        "kfac_s": candidate.step_s - profile.step_s,
        "overhead": candidate.overhead,
        "parts_s": dict(candidate.breakdown),
        "memory_bytes": candidate.memory_bytes,
        "kfac_state_bytes": candidate.kfac_state_bytes,
    }


def _pick(table: Sequence[Candidate], budget: int | None) -> Candidate | None:
    """``choose``'s rule on a priced table: the fastest candidate within the budget, ties to
    the larger fraction (``tests/train/test_plan_cli.py`` checks it against ``choose``)."""
    feasible = [c for c in table if budget is None or c.memory_bytes <= budget]
    if not feasible:
        return None
    return min(feasible, key=lambda c: (c.step_s, -c.grad_worker_fraction))


def workload(name: str, *, batch_size: int, **options: Any) -> Workload:
    """Model ``name``'s shapes from the stored table where it holds them (no torch), else
    from the meta pass (``kaisa_train.shapes``, which imports torch)."""
    found = stored_workload(name, batch_size=batch_size, **options)
    if found is not None:
        return found
    from kaisa_train.shapes import workload as measured

    return measured(name, batch_size=batch_size, **options)


def plan_job(request: PlanRequest, hardware: Hardware | None = None) -> PlanReport:
    """Price every strategy and interval pair for ``request``; the tuner's choices.

    Args:
        hardware: a profile to use instead of loading ``request.hardware`` (a variant built
            in code, e.g. to ask what a faster matmul would change).
    """
    hardware = hardware or load_hardware(request.hardware)
    params = dict(request.params)
    job = workload(
        request.model,
        batch_size=request.batch_size,
        params=params,
        precision=request.precision,
        kfac_approx=request.kfac_approx,
        sequence_approx=request.sequence_approx,
        skip_layers=request.skip_layers,
        optimizer=request.optimizer,
        compute_method=request.compute_method,
        scaling=request.scaling,
        embeddings=request.embeddings,
    )
    world = request.workers
    sharded = Parallel(request.parallel) is Parallel.FSDP
    job = dataclasses.replace(
        job,
        accumulation_steps=request.accumulation_steps,
        sharded_over=world if sharded else 1,
        factor_reduction=request.factor_reduction,
    )
    profile, basis = forecast_profile(job, hardware, world, gpus_per_node=request.gpus_per_node)
    topology = profile.topology
    assert isinstance(topology, Topology)
    budgets = request.budgets or (int(hardware.memory_bytes.value),)
    table: list[Candidate] = []
    strategies = []
    built = [
        plan(
            list(job.layers),
            world,
            fraction,
            compute_method=job.compute_method,
            scaling=job.scaling,
            parallel=request.parallel,
            factor_reduction=request.factor_reduction,
        )
        for fraction in placeable_fractions(world, job.scaling)
    ]
    if sharded:  # what a step gathers depends on the strategy (docs/fsdp.md)
        by_fraction = tuple((s.grad_worker_fraction, sharded_transient(job, s)) for s in built)
        profile = dataclasses.replace(profile, kfac_transient_by_fraction=by_fraction)
    for strategy in built:
        fraction = strategy.grad_worker_fraction
        worst = strategy.most_memory()
        candidates = []
        for candidate in prices(profile, strategy, request.intervals):  # as choose() prices
            table.append(candidate)
            candidates.append(_candidate_json(candidate, profile))
        strategies.append(
            {
                "strategy": strategy_name(fraction, world),
                "grad_worker_fraction": fraction,
                "grad_workers": round(fraction * world),
                "memory": worst,
                "collectives": _collectives(strategy, topology),
                "candidates": candidates,
            }
        )
    choices = []
    for budget in budgets:
        picked = _pick(table, budget)
        choices.append(
            {
                "budget_bytes": budget,
                "chosen": None if picked is None else _chosen(picked, profile, world),
                "reason": None
                if picked is not None
                else _nothing_fits(profile, budget, request.intervals),
            }
        )
    return PlanReport(
        data={
            "inputs": _inputs(request, hardware, job, topology),
            "model": _model(job),
            "basis": _basis(basis, hardware, profile),
            "strategies": strategies,
            "choices": choices,
            "changes": _changes(table, profile, world),
        }
    )


def _chosen(candidate: Candidate, profile: Profile, world: int) -> dict[str, Any]:
    return {
        "strategy": strategy_name(candidate.grad_worker_fraction, world),
        "grad_worker_fraction": candidate.grad_worker_fraction,
        **_candidate_json(candidate, profile),
    }


def _nothing_fits(profile: Profile, budget: int, intervals: Sequence[tuple[int, int]]) -> str:
    """The tuner's own account of why nothing fits and what would."""
    try:
        choose(profile, budget, intervals=intervals)
    except NoFeasibleCandidateError as err:
        return str(err)
    raise AssertionError("choose() found a candidate that the plan's table did not")


def _changes(table: Sequence[Candidate], profile: Profile, world: int) -> list[dict[str, Any]]:
    """The budgets at which the tuner's choice changes: from the smallest budget anything fits
    at up, each candidate's memory need is a place the feasible set grows."""
    out: list[dict[str, Any]] = []
    previous: Candidate | None = None
    for need in sorted({c.memory_bytes for c in table}):
        picked = _pick(table, need)
        if picked is not None and (previous is None or picked != previous):
            out.append({"from_budget_bytes": need, **_chosen(picked, profile, world)})
            previous = picked
    return out


def _inputs(request: PlanRequest, hardware: Hardware, job: Workload, topology: Topology) -> Any:
    planning = PLANNING.get(request.model)
    found: dict[str, Any] = {
        "model": request.model,
        "params": dict(request.params),
        "batch_size": request.batch_size,
        "accumulation_steps": request.accumulation_steps,
        "seq_len": job.seq_len,
        "workers": request.workers,
        "gpus_per_node": topology.gpus_per_node,
        "nodes": -(-request.workers // topology.gpus_per_node),
        "hardware": hardware.name,
        "gpu": hardware.gpu_name,
        "gpu_memory_bytes": int(hardware.memory_bytes.value),
        "precision": request.precision,
        "kfac_approx": request.kfac_approx,
        "sequence_approx": request.sequence_approx,
        "compute_method": request.compute_method,
        "optimizer": request.optimizer,
        "skip_layers": list(
            request.skip_layers
            if request.skip_layers is not None
            else (planning.skip_layers if planning else ())
        ),
        "skip_layers_source": planning.skip_source if planning else "",
        "intervals": [list(pair) for pair in request.intervals],
        "spec_strategy": request.spec_strategy,
    }
    if Parallel(request.parallel) is Parallel.FSDP:
        found["parallel"] = str(Parallel.FSDP)
    if FactorReduction(request.factor_reduction) is FactorReduction.DEFERRED:
        found["factor_reduction"] = str(FactorReduction.DEFERRED)
    if request.embeddings:
        found["embeddings"] = True
    return found


def _model(job: Workload) -> dict[str, Any]:
    return {
        "kfac_layers": len(job.layers),
        "largest_factor": max((max(x.a_dim, x.g_dim) for x in job.layers), default=0),
        "parameters": job.parameters,
        "activation_bytes": job.activation_bytes,
        "forward_flops": job.forward_flops,
        "fp32_factor_bytes": sum(4 * x.factor_elements for x in job.layers),
    }


def _basis(basis: Basis, hardware: Hardware, profile: Profile) -> dict[str, Any]:
    kinds: dict[str, int] = {}
    for number in hardware.sources.values():
        kinds[number.kind] = kinds.get(number.kind, 0) + 1
    return {
        "plain_step_s": basis.step_s,
        "plain_step_source": basis.step_source,
        "base_memory_bytes": basis.base_memory_bytes,
        "kfac_transient_bytes": basis.kfac_transient_bytes,
        "factor_s": profile.factor_s,
        "hardware_numbers_by_kind": kinds,
        "terms": list(basis.terms),
    }
