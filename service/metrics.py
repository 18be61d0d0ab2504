"""Prometheus metrics of one service (its own registry): jobs by state, submissions, request
latency, and each running job's training throughput and progress."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from service.model.lifecycle import JobState
from service.store.repository import JobStore
from service.worker_pool import WorkerPool

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class _JobsCollector(Collector):
    def __init__(self, store: JobStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_state = GaugeMetricFamily(
            "kaisa_ray_jobs", "Jobs in the store by state", labels=["state"]
        )
        for state, n in self.store.counts().items():
            by_state.add_metric([state.value], n)
        yield by_state
        throughput = GaugeMetricFamily(
            "kaisa_ray_job_samples_per_second",
            "Training throughput of each running job (all workers), from its last report",
            labels=["job_id", "name"],
        )
        progress = GaugeMetricFamily(
            "kaisa_ray_job_progress_ratio",
            "Steps done over steps in all, for each running job",
            labels=["job_id", "name"],
        )
        for job in self.store.active():
            if job.state is not JobState.RUNNING:
                continue
            rate = job.latest.samples_per_s
            if rate is not None:
                throughput.add_metric([job.id, job.name], float(rate))
            if job.total_steps:
                progress.add_metric([job.id, job.name], job.step / job.total_steps)
        yield throughput
        yield progress


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.submissions = Counter(
            "kaisa_ray_job_submissions", "Jobs created by POST /v1/jobs", registry=self.registry
        )
        self.latency = Histogram(
            "kaisa_ray_http_request_duration_seconds",
            "Time to answer an HTTP request (to the end of streams)",
            labelnames=["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.latency.labels(method, route, str(status)).observe(seconds)

    def bind(self, store: JobStore, plans: WorkerPool | None = None) -> None:
        """Report the jobs of ``store`` and the plans of ``plans`` (once the lifespan has
        opened them)."""
        self.registry.register(_JobsCollector(store))
        if plans is not None:
            self.registry.register(_PlansCollector(plans))


class _PlansCollector(Collector):
    def __init__(self, plans: WorkerPool) -> None:
        self.plans = plans

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        running = GaugeMetricFamily(
            "kaisa_ray_plans_running", "Plans (POST /v1/plan) computing now, each in a process"
        )
        running.add_metric([], self.plans.running)
        yield running
        outcomes = CounterMetricFamily(
            "kaisa_ray_plans",
            "Plans asked for, by outcome: ok, refused (422), busy (429), timeout (504), "
            "cancelled (the client went), stopped, error",
            labels=["outcome"],
        )
        for outcome, count in sorted(self.plans.outcomes.items()):
            outcomes.add_metric([outcome], count)
        yield outcomes
