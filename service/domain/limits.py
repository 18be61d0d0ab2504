"""The service's caps on what one job may ask of the cluster, checked on every path into Ray.

A job's spec is checked as it will run: for a sweep, as each of its trials will (the search
space applied: ``scaling.workers: {choice: [4]}`` on a service with ``--max-workers 2`` is
refused when it is submitted, not found out when 4 workers start). The trials checked are
the job as written, each swept field of ``RESOURCE_FIELDS`` at each of its extremes, and all
of them at their largest at once. Each is held to:

- ``--max-workers`` and ``--max-gpus-per-worker``;
- ``--min-cpus-per-worker``: below it Ray packs any number of workers on a node (0.0001 CPU
  each put 8 train workers, 2.4 GB, on a 3-CPU head while admission counted a quarter CPU);
- ``--max-model-bytes``: the model's float32 parameters and its activations at the trial's
  batch, computed on the meta device (``kaisa_train.footprint``), so that a model of 34 GB
  is refused by name, not found out by the kernel's OOM killer;
- the cluster's memory: the job's workers' predicted memory (all of its concurrent trials'),
  within Ray's ``memory`` resource.

What passes is what admission counts (``service.domain.admission.Need``): CPUs and memory, of the
largest trial. Pricing a built-in model whose every constructor argument is bounded takes
milliseconds and runs in this process; any other (a plugin's, BERT's unbounded ``layers``)
runs in a worker process with a time limit (``service.worker_pool``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ByteSize
from starlette.concurrency import run_in_threadpool

from kaisa_train.footprint import Footprint, footprint
from kaisa_train.spec import JobSpec, JobSpecError, KFACSpec, trial_spec
from service.domain.admission import PROCESS_BYTES, Need
from service.settings import Settings
from service.worker_pool import PoolTimeoutError, WorkerPool, WorkRefusedError

__all__ = ["RESOURCE_FIELDS", "Pricer", "Trial", "check", "trials"]

RESOURCE_FIELDS = (
    "scaling.workers",
    "scaling.gpus_per_worker",
    "scaling.cpus_per_worker",
    "dataset.batch_size",
)
"""The swept fields that change what a trial holds in Ray."""

PRICED_IN_PROCESS = frozenset({"lenet", "mlp", "resnet20"})
"""Built-in models whose every constructor argument is bounded, so that building and running
them on the meta device is cheap at any size: priced in the service's own process."""


def _human(size: float) -> str:
    return ByteSize(int(size)).human_readable()


@dataclass(frozen=True)
class Trial:
    """A spec the job runs: the job itself (``values`` empty), or a trial of its sweep with
    the swept ``values`` set."""

    values: dict[str, Any]
    spec: JobSpec

    def where(self, field: str) -> tuple[str, ...]:
        """Where a problem with ``field`` is, in the body."""
        return ("sweep", "space", field) if field in self.values else tuple(field.split("."))

    def says(self, field: str) -> str:
        """How a problem with ``field`` starts: which trial it is of."""
        if field not in self.values:
            return ""
        drawn = ", ".join(f"{k} = {v:g}" for k, v in self.values.items())
        return f"a trial with {drawn} (sweep.space): "


def trials(spec: JobSpec) -> list[Trial]:
    """The specs to hold to the caps (see the module docstring)."""
    found = [Trial({}, spec.without_sweep())]
    if spec.sweep is None:
        return found
    base = spec.without_sweep().model_dump(mode="json")
    swept = {p: d.extremes() for p, d in spec.sweep.space.items() if p in RESOURCE_FIELDS}
    drawn = [{p: v} for p, values in swept.items() for v in sorted(set(values))]
    if len(swept) > 1:
        drawn.append({p: max(values) for p, values in swept.items()})
    for values in drawn:
        try:
            found.append(Trial(values, trial_spec(base, values)))
        except JobSpecError:  # a combination the JobSpec itself refuses is never drawn
            continue
    return found


def _key(spec: JobSpec) -> tuple[str, dict[str, Any]]:
    kfac = spec.kfac
    options: dict[str, Any] = {
        "batch_size": spec.dataset.batch_size,
        "precision": str(spec.precision),
        "optimizer": spec.optimizer.name,
        "kfac": isinstance(kfac, KFACSpec),
    }
    if isinstance(kfac, KFACSpec):
        options["kfac_approx"] = str(kfac.kfac_approx)
        options["sequence_approx"] = str(kfac.sequence_approx)
        options["compute_method"] = str(kfac.compute_method)
        if kfac.embeddings:
            options["embeddings"] = True
    task = {"model": spec.model.name, "params": dict(spec.model.params), "options": options}
    return json.dumps(task, sort_keys=True), task


class Pricer:
    """Footprints of the models jobs ask for: remembered (the same spec is priced once),
    computed in this process for ``PRICED_IN_PROCESS`` and in ``pool`` for the rest."""

    def __init__(self, pool: WorkerPool, *, remember: int = 256) -> None:
        self.pool, self.remember = pool, remember
        self._known: OrderedDict[str, Footprint | str] = OrderedDict()  # a refusal: its reason

    async def footprint(self, spec: JobSpec) -> Footprint:
        """Raises ``WorkRefusedError`` for a model that cannot be built as asked."""
        key, task = _key(spec)
        found = self._known.get(key)
        if found is None:
            found = await self._price(task)
            self._known[key] = found
            while len(self._known) > self.remember:
                self._known.popitem(last=False)
        self._known.move_to_end(key)
        if isinstance(found, str):
            raise WorkRefusedError(found)
        return found

    async def _price(self, task: dict[str, Any]) -> Footprint | str:
        from kaisa_ray.errors import ConfigurationError

        if task["model"] in PRICED_IN_PROCESS:
            try:
                return await run_in_threadpool(
                    footprint, task["model"], task["params"], **task["options"]
                )
            except ConfigurationError as err:
                return str(err)
        try:
            return Footprint.from_json(await self.pool.run({"kind": "footprint", **task}))
        except WorkRefusedError as err:
            return str(err)


async def check(spec: JobSpec, settings: Settings, pricer: Pricer, memory: float | None) -> Need:
    """What the job needs in Ray, once every trial is within the caps; else
    ``RequestValidationError`` naming every problem, its cap and the fix. ``memory``: the
    cluster's (None: unknown, not checked)."""
    problems: list[tuple[tuple[str, ...], str]] = []
    cpus = memory_need = 0.0
    for trial in trials(spec):
        problems += _caps(trial, settings)
        scaling = trial.spec.scaling
        concurrent = spec.sweep.concurrent if spec.sweep is not None else 1
        try:
            found = await pricer.footprint(trial.spec)
        except WorkRefusedError as err:
            problems.append((("model", "params"), str(err)))
            continue
        except PoolTimeoutError as err:
            problems.append(
                (("model",), f"model {trial.spec.model.name!r} could not be priced: {err}")
            )
            continue
        if found.model_bytes > settings.max_model_bytes:
            problems.append(
                (
                    ("model", "params"),
                    f"{trial.says('dataset.batch_size')}{found}: "
                    f"{_human(found.model_bytes)} per worker, over this service's maximum of "
                    f"{_human(settings.max_model_bytes)} (kaisa-ray serve --max-model-bytes); "
                    "use a smaller model or batch",
                )
            )
        per_worker = (0 if scaling.gpus_per_worker else found.worker_bytes) + PROCESS_BYTES
        cpus = max(cpus, concurrent * scaling.workers * scaling.cpus_per_worker)
        need = concurrent * scaling.workers * per_worker
        memory_need = max(memory_need, need)
        if memory is not None and need > memory:
            problems.append(
                (
                    trial.where("scaling.workers"),
                    f"{trial.says('scaling.workers')}{concurrent * scaling.workers} worker(s) "
                    f"need about {_human(need)} of memory ({_human(per_worker)} each, "
                    f"predicted from the model: {found}), more than the cluster's "
                    f"{_human(memory)} (Ray's memory resource); lower dataset.batch_size or "
                    "scaling.workers, or run it where there is more memory",
                )
            )
    if problems:
        unique = list(dict.fromkeys(problems))
        raise RequestValidationError(
            [{"loc": ("body", *loc), "msg": msg, "type": "service_cap"} for loc, msg in unique]
        )
    return Need(cpus=cpus, memory_bytes=memory_need)


def _caps(trial: Trial, settings: Settings) -> Iterator[tuple[tuple[str, ...], str]]:
    scaling = trial.spec.scaling
    if scaling.workers > settings.max_workers:
        field = "scaling.workers"
        yield (
            trial.where(field),
            f"{trial.says(field)}{scaling.workers} workers is over this service's maximum of "
            f"{settings.max_workers} (kaisa-ray serve --max-workers, $KAISA_RAY_MAX_WORKERS); "
            "ask for fewer",
        )
    if scaling.gpus_per_worker > settings.max_gpus_per_worker:
        field = "scaling.gpus_per_worker"
        yield (
            trial.where(field),
            f"{trial.says(field)}{scaling.gpus_per_worker:g} GPUs per worker is over this "
            f"service's maximum of {settings.max_gpus_per_worker:g} (--max-gpus-per-worker); "
            "ask for fewer",
        )
    if scaling.cpus_per_worker < settings.min_cpus_per_worker:
        field = "scaling.cpus_per_worker"
        yield (
            trial.where(field),
            f"{trial.says(field)}{scaling.cpus_per_worker:g} CPUs per worker is under this "
            f"service's minimum of {settings.min_cpus_per_worker:g} (--min-cpus-per-worker): "
            "Ray would pack any number of such workers on a node, each a whole training "
            f"process; ask for at least {settings.min_cpus_per_worker:g}",
        )
