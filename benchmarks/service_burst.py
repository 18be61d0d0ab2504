"""A burst of submissions against the real service: admission control and health under it.

Starts the real service (``kaisa-ray serve`` on a free loopback port, with its embedded Ray
head, ``--max-running 2``), then sends ``--jobs`` (1000) submissions at once from ``--clients``
(50) concurrent clients, each honouring 429 and its ``Retry-After`` (the service's default
rate limit, 20 POSTs a second per client address with bursts of 40: every client here is
127.0.0.1). The jobs are real and cheap (an MLP on 512 synthetic samples, 20 steps, one
worker, no K-FAC): each admitted job is a real Ray Job whose driver runs ``kaisa-ray train``.

Measured throughout, each in a thread of its own:

- ``/healthz`` every 20 ms on a keep-alive connection (latency in the client);
- what runs in Ray, from Ray's own job server (``GET /api/jobs/`` of the head's dashboard,
  with the head's token) every 0.25 s: the service's Ray Jobs (submission ids
  ``kaisa-ray-*``; Ray lists every driver too, the service's own connection among them)
  PENDING or RUNNING, never to exceed the service's maximum.

The run goes on ``--observe`` seconds (60) after the last submission was stored, so that
jobs finish and the next ones are admitted. Then a burst of plans: ``--plans`` (40, the
default burst of POSTs) concurrent ``POST /v1/plan`` of BERT-Large on 4096 GPUs (minutes of
planning each; the service computes ``--max-plans`` at once and refuses the rest with 429),
while ``GET /v1/jobs`` is timed every 20 ms for ``--plan-observe`` seconds (20) beside the
``/healthz`` prober; then SIGTERM with the plans still computing, timed to the service's
exit. The jobs still queued stay stored (they would run on the next start).

Run ``python benchmarks/service_burst.py`` (about 3 minutes); ``--write`` stores
``benchmarks/results/service_burst.json`` and the table in ``benchmarks/README.md``;
``--from-json`` re-prints a stored run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import git_commit, write_block
from service_load import busy_elsewhere, machine, running_service, summary

from service.head import RayHead

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_P99_MS = 100.0


def cheap_job(n: int) -> dict[str, Any]:
    return {
        "name": f"burst-{n}",
        "model": {"name": "mlp", "params": {"hidden": [32]}},
        "dataset": {"name": "synthetic", "batch_size": 32, "limit": 512},
        "kfac": "off",
        "scaling": {"workers": 1},
        "stop": {"max_steps": 20},
        "eval_every": 10,
        "checkpoint": {"every_steps": 1000},
        "seed": n,
    }


class Sampler(threading.Thread):
    """Calls ``sample()`` every ``every_s`` until stopped; keeps ``(time, value)``."""

    def __init__(self, sample: Any, every_s: float) -> None:
        super().__init__(daemon=True)
        self.sample, self.every_s = sample, every_s
        self.values: list[tuple[float, Any]] = []
        self.errors = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.values.append((time.time(), self.sample()))
            except Exception:  # a sample that failed is counted, not fatal
                self.errors += 1
            self.done.wait(self.every_s)


async def burst(url: str, headers: dict[str, str], jobs: int, clients: int) -> dict[str, Any]:
    """``jobs`` POSTs from ``clients`` concurrent clients, each retrying after a 429."""
    todo = list(range(jobs))
    created: list[str] = []
    latencies: list[float] = []
    refused = Counter[int]()

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
            while todo:
                n = todo.pop()
                while True:
                    began = time.perf_counter()
                    response = await http.post("/v1/jobs", json=cheap_job(n))
                    latencies.append(time.perf_counter() - began)
                    if response.status_code == 201:
                        created.append(response.json()["id"])
                        break
                    refused[response.status_code] += 1
                    if response.status_code != 429:
                        raise RuntimeError(f"{response.status_code}: {response.text}")
                    await asyncio.sleep(float(response.headers.get("Retry-After", "1")))

    began = time.time()
    await asyncio.gather(*(client() for _ in range(clients)))
    return {
        "began": began,
        "ended": time.time(),
        "created": len(created),
        "distinct": len(set(created)),
        "refused": dict(refused),
        "post_ms": summary([s * 1000 for s in latencies]),
    }


BERT_4096 = {"model": "bert-large", "workers": 4096, "batch_size": 8}


async def plan_burst(url: str, headers: dict[str, str], plans: int) -> dict[str, Any]:
    """``plans`` concurrent plans of BERT-Large on 4096 GPUs, one a client; what each got
    and how fast, until the service stops (the ones still computing then)."""
    answers: list[tuple[int | str, float]] = []

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
            began = time.perf_counter()
            try:
                response = await http.post("/v1/plan", json=BERT_4096)
                answers.append((response.status_code, time.perf_counter() - began))
            except httpx.HTTPError as err:  # the service stopped under it
                answers.append((type(err).__name__, time.perf_counter() - began))

    await asyncio.gather(*(client() for _ in range(plans)))
    return {
        "statuses": dict(Counter(str(status) for status, _ in answers)),
        "answer_ms": {
            str(status): summary([1000 * s for code, s in answers if code == status])
            for status in {code for code, _ in answers}
        },
    }


def plans_phase(service: Any, args: argparse.Namespace, health: Sampler) -> dict[str, Any]:
    """The burst of plans with GET /v1/jobs timed, then SIGTERM timed (the service is
    stopped when this returns)."""
    lister = httpx.Client(base_url=service.url, headers=service.headers, timeout=30)

    def list_jobs() -> float:
        began = time.perf_counter()
        lister.get("/v1/jobs").raise_for_status()
        return (time.perf_counter() - began) * 1000

    listing = Sampler(list_jobs, 0.02)
    outcome: dict[str, Any] = {}
    burst_thread = threading.Thread(
        target=lambda: outcome.update(
            asyncio.run(plan_burst(service.url, service.headers, args.plans))
        )
    )
    began = time.time()
    listing.start()
    burst_thread.start()
    time.sleep(args.plan_observe)
    listing.done.set()
    listing.join()
    window = (began, time.time())
    stopped = time.monotonic()
    service.process.send_signal(signal.SIGTERM)
    service.process.wait(timeout=120)
    sigterm_s = time.monotonic() - stopped
    burst_thread.join(timeout=120)
    during = [v for t, v in health.values if window[0] <= t <= window[1]]
    return {
        "plans": args.plans,
        "observe_s": args.plan_observe,
        **outcome,
        "list_jobs_ms": summary([v for _, v in listing.values]),
        "list_jobs_errors": listing.errors,
        "healthz_ms": summary(during),
        "sigterm_s": round(sigterm_s, 2),
        "exit_status": service.process.returncode,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kaisa-burst-") as tmp:
        data_dir = Path(tmp) / "service"
        extra = ["--max-running", str(args.max_running)]
        with running_service(data_dir, extra=extra) as service:
            head = RayHead.load(data_dir / "ray" / "head.json")
            assert head is not None
            health = httpx.Client(base_url=service.url, timeout=10)
            ray_api = httpx.Client(
                base_url=head.dashboard_url,
                headers={"Authorization": f"Bearer {head.token}"},
                timeout=10,
            )

            def healthz() -> float:
                began = time.perf_counter()
                health.get("/healthz").raise_for_status()
                return (time.perf_counter() - began) * 1000

            def in_ray() -> int:
                # The service's Ray Jobs only: Ray lists its drivers too (the service's own
                # connection to the cluster is one, always RUNNING).
                listed = ray_api.get("/api/jobs/").json()
                return sum(
                    1
                    for job in listed
                    if str(job.get("submission_id") or "").startswith("kaisa-ray-")
                    and job["status"] in ("PENDING", "RUNNING")
                )

            samplers = {"healthz": Sampler(healthz, 0.02), "ray": Sampler(in_ray, 0.25)}
            for sampler in samplers.values():
                sampler.start()
            time.sleep(2)  # the idle baseline
            pushed = asyncio.run(burst(service.url, service.headers, args.jobs, args.clients))
            print(
                f"{pushed['created']} stored in {pushed['ended'] - pushed['began']:.1f} s "
                f"({pushed['refused']} refused, retried)",
                flush=True,
            )
            time.sleep(args.observe)
            for sampler in samplers.values():
                sampler.done.set()
                sampler.join()
            page = httpx.get(
                f"{service.url}/v1/jobs", headers=service.headers, params={"limit": 500}
            ).json()
            states = Counter[str]()
            offset: int | None = 0
            while offset is not None:
                page = httpx.get(
                    f"{service.url}/v1/jobs",
                    headers=service.headers,
                    params={"limit": 500, "offset": offset},
                ).json()
                states.update(job["state"] for job in page["jobs"])
                offset = page["next_offset"]
            total = page["total"]
            others = busy_elsewhere()
            health_plans = Sampler(healthz, 0.02)
            health_plans.start()
            plans = plans_phase(service, args, health_plans)
            health_plans.done.set()
            health_plans.join()
    window = (pushed["began"], pushed["ended"])
    during = [v for t, v in samplers["healthz"].values if window[0] <= t <= window[1]]
    after = [v for t, v in samplers["healthz"].values if t > window[1]]
    before = [v for t, v in samplers["healthz"].values if t < window[0]]
    running = [v for _, v in samplers["ray"].values]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "machine": machine(),
        "load_before": [round(v, 2) for v in load_before],
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "others": others,
        "jobs": args.jobs,
        "clients": args.clients,
        "max_running": args.max_running,
        "observe_s": args.observe,
        "burst": pushed,
        "stored": total,
        "states": dict(states),
        "healthz_ms": {
            "before": summary(before),
            "during": summary(during),
            "after": summary(after),
            "errors": samplers["healthz"].errors,
        },
        "ray_running": {
            "max": max(running) if running else None,
            "samples": len(running),
            "errors": samplers["ray"].errors,
            "histogram": dict(sorted(Counter(running).items())),
        },
        "plans": plans,
    }


def render(saved: dict[str, Any]) -> str:
    burst_s = saved["burst"]["ended"] - saved["burst"]["began"]
    h = saved["healthz_ms"]
    ok = (
        saved["stored"] == saved["jobs"]
        and saved["burst"]["distinct"] == saved["jobs"]
        and (saved["ray_running"]["max"] or 0) <= saved["max_running"]
        and h["during"]["p99"] < GOAL_P99_MS
    )
    rows = [
        f"| submissions | {saved['jobs']} from {saved['clients']} concurrent clients on "
        f"127.0.0.1, each retrying after 429 |",
        f"| stored | {saved['stored']} ({saved['burst']['distinct']} distinct ids), in "
        f"{burst_s:.1f} s; refused and retried: {saved['burst']['refused'] or 'none'} |",
        f"| POST latency ms | p50 {saved['burst']['post_ms']['p50']:.1f}, p99 "
        f"{saved['burst']['post_ms']['p99']:.1f} |",
        f"| Ray Jobs PENDING or RUNNING (Ray's job server, every 0.25 s) | max "
        f"{saved['ray_running']['max']} (the maximum: {saved['max_running']}); samples by "
        f"count {saved['ray_running']['histogram']} |",
        f"| /healthz ms before the burst | p50 {h['before']['p50']:.1f}, p99 "
        f"{h['before']['p99']:.1f} ({h['before']['n']} requests) |",
        f"| /healthz ms during the burst | p50 {h['during']['p50']:.1f}, p99 "
        f"{h['during']['p99']:.1f}, max {h['during']['max']:.1f} ({h['during']['n']} requests) |",
        f"| /healthz ms in the {saved['observe_s']} s after | p50 {h['after']['p50']:.1f}, p99 "
        f"{h['after']['p99']:.1f}, max {h['after']['max']:.1f} ({h['after']['n']} requests) |",
        f"| jobs by state at the end | {saved['states']} |",
        f"| verdict | {'PASS' if ok else 'FAIL'}: all stored, never more than the maximum in "
        f"Ray, /healthz p99 under {GOAL_P99_MS:.0f} ms during the burst |",
    ]
    rows += _plan_rows(saved)
    header = (
        "### A burst of 1000 submissions\n\n"
        f"Measured {saved['date']} at commit {saved['commit']} on {saved['machine']} (before "
        f"the run: {', '.join(map(str, saved['load_before']))}; after: "
        f"{', '.join(map(str, saved['load_after']))}). The real service (`kaisa-ray serve`, "
        "embedded Ray head, `--max-running "
        f"{saved['max_running']}`, the default rate limit); real, cheap jobs (an MLP on 512 "
        "synthetic samples, 20 steps, one worker, each a Ray Job whose driver runs "
        "`kaisa-ray train`); the clients, the /healthz prober and Ray's job list read on the "
        "same machine. "
        + (
            f"Other heavy processes seen: {'; '.join(saved['others'])}."
            if saved["others"]
            else "No other heavy process was seen."
        )
    )
    return header + "\n\n| what | measured |\n| --- | --- |\n" + "\n".join(rows)


def _plan_rows(saved: dict[str, Any]) -> list[str]:
    plans = saved.get("plans")
    if not plans:  # a run from before the plans phase
        return []
    listing, health = plans["list_jobs_ms"], plans["healthz_ms"]
    refused = plans["answer_ms"].get("429")
    ok = listing["p99"] < GOAL_P99_MS and plans["sigterm_s"] < 10 and "500" not in plans["statuses"]
    return [
        f"| plans | {plans['plans']} concurrent POST /v1/plan of BERT-Large on 4096 GPUs, one "
        f"a client; answers by status {plans['statuses']} (the one computing: answered when "
        "the service stopped) |",
        "| 429 answered in ms | "
        + (f"p50 {refused['p50']:.1f}, p99 {refused['p99']:.1f}" if refused else "none")
        + " |",
        f"| GET /v1/jobs ms during the plans ({plans['observe_s']:g} s) | p50 "
        f"{listing['p50']:.1f}, p99 {listing['p99']:.1f}, max {listing['max']:.1f} "
        f"({listing['n']} requests, {plans['list_jobs_errors']} errors) |",
        f"| /healthz ms during the plans | p50 {health['p50']:.1f}, p99 {health['p99']:.1f} "
        f"({health['n']} requests) |",
        f"| SIGTERM with a plan computing | the service exited in {plans['sigterm_s']:.1f} s, "
        f"status {plans['exit_status']} |",
        f"| verdict (plans) | {'PASS' if ok else 'FAIL'}: GET /v1/jobs p99 under "
        f"{GOAL_P99_MS:.0f} ms, no 500, SIGTERM under 10 s |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--max-running", type=int, default=2)
    parser.add_argument("--observe", type=float, default=60)
    parser.add_argument("--plans", type=int, default=40)
    parser.add_argument("--plan-observe", type=float, default=20)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--from-json", type=Path, default=None)
    args = parser.parse_args()
    saved = json.loads(args.from_json.read_text()) if args.from_json else run(args)
    text = render(saved)
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "service_burst.json").write_text(json.dumps(saved, indent=2) + "\n")
        write_block("service-burst", text)


if __name__ == "__main__":
    main()
