"""Admission control: which queued jobs go to Ray now (pure functions of the jobs and the
cluster, tested on their own; the follower applies them every pass).

A job holds CPUs and memory in Ray while it runs: its workers' (a sweep's trials at once,
each with its own workers) and its driver's. What a job needs is worked out once, when it is
submitted (``service.domain.limits``: from every trial's spec and the model's predicted memory per
worker) and stored with it; a job stored before that (or by a test) is counted from its spec,
CPUs only. First come, first served: a job that does not fit holds the ones behind it, so a
large job is never starved by small ones; a job larger than the cluster is admitted alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.model.job_data import Job

__all__ = ["Capacity", "Need", "admit", "job_cpus", "need_of"]

PROCESS_BYTES = 300 * 2**20
"""What one Ray process of a job holds besides its tensors (Python, torch, Ray's client):
eight train workers on one head were 2.4 GB resident (issue 30), 300 MB each. Counted for
every worker and for the driver."""


@dataclass(frozen=True, kw_only=True)
class Need:
    """What a job holds in Ray while it runs: CPUs, and memory in bytes (0: not known)."""

    cpus: float
    memory_bytes: float = 0

    def as_json(self) -> dict[str, float]:
        return {"cpus": self.cpus, "memory_bytes": self.memory_bytes}


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """What admission control allows: at most ``max_running`` jobs in Ray at once (None: as
    many as ``cpus`` hold, at least one CPU a job), and the CPUs and memory of the admitted
    jobs within the cluster's ``cpus`` and ``memory_bytes`` (None: unknown, not counted)."""

    cpus: float | None
    memory_bytes: float | None = None
    max_running: int | None = None
    driver_cpus: float = 0.25

    @property
    def limit(self) -> int:
        if self.max_running is not None:
            return self.max_running
        if self.cpus is None:
            return 1_000_000
        return max(1, math.floor(self.cpus / (1 + self.driver_cpus)))


def job_cpus(spec: Mapping[str, Any], driver_cpus: float) -> float:
    """The CPUs a job holds in Ray read from its spec alone: its workers' (a sweep's trials at
    once, each with the job's workers) and its driver's."""
    scaling = spec.get("scaling") or {}
    workers = float(scaling.get("workers", 1)) * float(scaling.get("cpus_per_worker", 1))
    sweep = spec.get("sweep") or {}
    trials = float(sweep.get("concurrent", 1)) if sweep else 1.0
    return workers * trials + driver_cpus


def need_of(job: Job, driver_cpus: float) -> Need:
    """What ``job`` holds in Ray: as worked out at its submission (its workers' CPUs and
    memory, every trial counted), with its driver's share; else from its spec, CPUs only."""
    found = job.resources or {}
    cpus, memory = found.get("cpus"), found.get("memory_bytes")
    if not isinstance(cpus, int | float) or isinstance(cpus, bool):
        return Need(cpus=job_cpus(job.spec, driver_cpus))
    memory = float(memory) if isinstance(memory, int | float) else 0.0
    return Need(cpus=float(cpus) + driver_cpus, memory_bytes=memory + PROCESS_BYTES)


def admit(queue: list[Job], running: list[Job], capacity: Capacity) -> list[Job]:
    """The jobs of ``queue`` (first in line first) to send to Ray now, given the jobs
    ``running`` there (pure)."""
    needs = [need_of(job, capacity.driver_cpus) for job in running]
    cpus = sum(n.cpus for n in needs)
    memory = sum(n.memory_bytes for n in needs)
    count = len(running)
    admitted: list[Job] = []
    for job in queue:
        if count >= capacity.limit:
            break
        need = need_of(job, capacity.driver_cpus)
        if count and (
            (capacity.cpus is not None and cpus + need.cpus > capacity.cpus + 1e-9)
            or (
                capacity.memory_bytes is not None
                and memory + need.memory_bytes > capacity.memory_bytes
            )
        ):
            break
        admitted.append(job)
        cpus += need.cpus
        memory += need.memory_bytes
        count += 1
    return admitted
