"""Load on the job service: many clients polling a job, and the event stream's delay.

Starts the real service (``kaisa-ray serve`` on a free loopback port, with its embedded Ray
head) and submits a real 2-worker K-FAC job (LeNet on a Fashion-MNIST subset), so that there
is a job to poll and a live event stream. Then, one phase after the other:

- idle: no requests, only the event stream (its delay without load);
- baseline: one client, requests back to back (the time of one request, nothing queued);
- polling: ``--clients`` clients (default 200), each waiting ``--interval`` (default 1 s)
  after each answer, as a dashboard or ``kaisa-ray jobs`` does;
- saturation: the same clients with no wait, as fast as they get answers (a stress
  measure of capacity: in a closed loop the mean latency is clients / throughput, so the
  latency goal applies to the polling phase).

Each client has its own keep-alive connection and asks, in turn, ``GET /v1/jobs/{id}`` and
``GET /v1/jobs`` (through a minimal HTTP/1.1 client on uvloop, ``RawClient``: httpx would cost
the shared cores more than the service does); latency is measured in the client, from
sending to the whole answer, for every request that started in the phase (the percentiles are
computed from all of them).
The server's own view, from its Prometheus histogram (``/metrics``, scraped before and after
each phase), is the time from the app receiving the request to the answer sent: it includes
waiting for a thread of the pool, not the wait in the socket or uvicorn's parsing.

Event delay: a separate process follows ``GET /v1/jobs/{id}/events``; for every ``progress``
event it takes the time it received it minus the event's ``time``, which the progress sink
actor set on receiving the worker's report (same machine, same clock). The delay is thus
sink -> the service's follower reading the sink (every ``poll_interval_s``, 0.25 s by
default) -> the store -> the event stream -> the client. Not in it: the worker -> sink hop, a
fire-and-forget Ray call (typically milliseconds).

Everything shares this machine's cores: the service, its Ray head, the 2 training workers
(Ray starts them at nice 15, so they yield to the service), the load generator (one asyncio
process) and the event listener; the CPU each used over the phase is reported, with the load
average, and so are other heavy processes (test runs, Ray heads) seen during the run. Goal
(the issue): p99 under 50 ms, event delay under 1 s.

Run ``python benchmarks/service_load.py`` (about 3 minutes; ``--quick`` for a smoke run:
20 clients, 5 s phases); ``--write`` stores ``benchmarks/results/service_load.json`` and
``benchmarks/results/service_load.md`` (a block to paste in a README); ``--from-json``
re-prints a stored run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from kaisa_train.head import free_port
from service.head import RayHead, venv_path
from service.settings import Settings

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
KAISA_RAY = str(Path(sys.executable).with_name("kaisa-ray"))
GOAL_P99_MS = 50.0
GOAL_DELAY_S = 1.0
ROUTES = {"job": "/v1/jobs/{job_id}", "list": "/v1/jobs"}


def job_spec(max_steps: int) -> dict[str, Any]:
    return {
        "name": "load-bench",
        "model": {"name": "lenet"},
        "dataset": {"name": "fashion-mnist", "batch_size": 64, "limit": 4096},
        "kfac": {"strategy": "comm-opt", "factor_update_steps": 5, "inv_update_steps": 10},
        "scaling": {"workers": 2},
        "stop": {"max_steps": max_steps},
        "eval_every": 50,
        "checkpoint": {"every_steps": 1000},
    }


# -- statistics ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``, linear between the closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: list[float]) -> dict[str, float | int]:
    return {
        "n": len(values),
        "mean": sum(values) / len(values) if values else float("nan"),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else float("nan"),
    }


# -- the service -----------------------------------------------------------------------------


@dataclass
class Service:
    process: subprocess.Popen[bytes]
    url: str
    token: str
    data_dir: Path
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def stop(self, timeout_s: float = 90) -> None:
        """SIGINT, as Ctrl-C (the service stops its Ray head); SIGKILL if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                print(f"the service did not stop in {timeout_s} s: killed", flush=True)
                self.process.kill()
                self.process.wait(timeout=30)
        head = RayHead.load(self.data_dir / "ray" / "head.json")
        if head is not None and head.alive():  # left behind by a killed service
            head.stop()


@contextlib.contextmanager
def running_service(
    data_dir: Path, timeout_s: float = 180, extra: list[str] | None = None
) -> Iterator[Service]:
    """``kaisa-ray serve`` (with ``extra`` flags) on a free port, its token in the
    environment; yields once it is ready, stops it after."""
    port = free_port()
    token = secrets.token_hex(16)
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "service.log"
    command = [KAISA_RAY, "serve", "--port", str(port), "--data-dir", str(data_dir)]
    command += extra or []
    env = {**os.environ, "PATH": venv_path(), "RAY_USAGE_STATS_ENABLED": "0"}
    env["KAISA_RAY_TOKEN"] = token
    env.pop("RAY_ADDRESS", None)
    with log.open("ab") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    service = Service(process, f"http://127.0.0.1:{port}", token, data_dir, log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"kaisa-ray serve exited with {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{service.url}/readyz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service was not ready in {timeout_s} s")
            time.sleep(0.5)
        yield service
    except BaseException:
        print(f"--- the service's log ({log}), last lines:", file=sys.stderr)
        print("\n".join(log.read_text().splitlines()[-40:]), file=sys.stderr)
        raise
    finally:
        service.stop()


def wait_for_state(service: Service, job_id: str, states: set[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        state = str(
            httpx.get(
                f"{service.url}/v1/jobs/{job_id}", headers=service.headers, timeout=10
            ).json()["state"]
        )
        if state in states:
            return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} is {state} after {timeout_s} s, not {states}")
        time.sleep(0.5)


# -- the event stream (a process of its own) -------------------------------------------------


def listen(url: str, token: str, job_id: str, out: str) -> None:
    """Append ``{received, time, step, ms_per_step}`` for each progress event to ``out``."""
    headers = {"Authorization": f"Bearer {token}"}
    with (
        open(out, "a") as sink,
        httpx.Client(base_url=url, headers=headers) as client,
        client.stream(
            "GET", f"/v1/jobs/{job_id}/events", timeout=httpx.Timeout(10, read=None)
        ) as response,
    ):
        event = "message"
        for line in response.iter_lines():
            received = time.time()
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "progress":
                data = json.loads(line[5:])
                row = {
                    "received": received,
                    "time": data["time"],
                    "step": data.get("step"),
                    "ms_per_step": data.get("ms_per_step"),
                }
                sink.write(json.dumps(row) + "\n")
                sink.flush()
            elif not line:
                event = "message"


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- CPU accounting --------------------------------------------------------------------------


def _ticks_all() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _ticks_of(pid: int) -> int:
    """utime + stime of a process, in jiffies."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    parts = stat[stat.rindex(")") + 2 :].split()
    return int(parts[11]) + int(parts[12])


@dataclass
class CpuMeter:
    """Share of all CPUs busy, and of one CPU used by the service and this process."""

    server_pid: int
    began: float = 0.0
    start: tuple[int, int, int, float] = (0, 0, 0, 0.0)
    result: dict[str, Any] = field(default_factory=dict)

    def __enter__(self) -> CpuMeter:
        busy, total = _ticks_all()
        self.began = time.monotonic()
        self.start = (busy, total, _ticks_of(self.server_pid), time.process_time())
        return self

    def __exit__(self, *_: object) -> None:
        busy, total = _ticks_all()
        wall = time.monotonic() - self.began
        hz = os.sysconf("SC_CLK_TCK")
        self.result = {
            "all_cpus_busy": (busy - self.start[0]) / max(total - self.start[1], 1),
            "service_cpus": (_ticks_of(self.server_pid) - self.start[2]) / hz / wall,
            "load_generator_cpus": (time.process_time() - self.start[3]) / wall,
            "load_average": os.getloadavg(),
        }


# -- the server's histogram ------------------------------------------------------------------


def buckets_of(text: str) -> dict[str, float]:
    """From ``/metrics``: GET 200 of the two routes, cumulative count per bucket bound
    (``le`` in seconds, as a string; ``+Inf`` is every request) and ``sum`` of seconds."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kaisa_ray_http_request_duration_seconds":
            continue
        for sample in family.samples:
            labels = sample.labels
            if labels.get("method") != "GET" or labels.get("status") != "200":
                continue
            if labels.get("route") not in ROUTES.values():
                continue
            if sample.name.endswith("_bucket"):
                key = labels["le"]
            elif sample.name.endswith("_sum"):
                key = "sum"
            else:
                continue
            found[key] = found.get(key, 0.0) + sample.value
    return found


def server_view(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The requests answered between two scrapes: mean, and p50 and p99 as bucket bounds."""
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
    total = delta.pop("+Inf", 0.0)
    seconds = delta.pop("sum", 0.0)
    bounds = sorted((float(le), count) for le, count in delta.items())

    def bound(q: float) -> float | None:
        for le, count in bounds:
            if total and count >= q / 100 * total:
                return le * 1000
        return None

    return {
        "n": total,
        "mean_ms": 1000 * seconds / total if total else None,
        "p50_le_ms": bound(50),
        "p99_le_ms": bound(99),
    }


# -- the load --------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    clients: int
    interval_s: float
    duration_s: float
    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in ROUTES})
    errors: dict[str, int] = field(default_factory=dict)
    window: tuple[float, float] = (0.0, 0.0)  # wall clock (time.time())
    metrics: tuple[str, str] = ("", "")  # /metrics before and after the measured requests
    cpu: dict[str, Any] = field(default_factory=dict)  # CpuMeter's, over the window


class RawClient:
    """A minimal HTTP/1.1 client on one keep-alive connection, for the load's GETs.

    httpx takes about 2 ms of CPU per request here, more than the service does to answer
    it, and the load generator shares the machine's 2 cores with the service: it would be
    measuring itself. This client writes a prepared request and reads the status line, the
    headers and a ``Content-Length`` body, as a load tool such as wrk does."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        address = url.removeprefix("http://").rstrip("/")
        host, _, port = address.partition(":")
        self.host, self.port = host, int(port or 80)
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.requests: dict[str, bytes] = {}
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> int:
        """GET ``path``; the status code, once the whole body has arrived."""
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        request = self.requests.get(path)
        if request is None:
            request = (
                f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.extra}\r\n"
            ).encode()
            self.requests[path] = request
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            raise ValueError(f"an answer without Content-Length to GET {path}: {head!r}")
        await self.reader.readexactly(length)
        return status

    async def aclose(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()


async def load(service: Service, job_id: str, phase: Phase) -> None:
    """The phase's clients: each connects, then polls until the phase ends; requests sent
    once every client has connected, for ``duration_s``, are measured. (A client never sits
    idle longer than its wait, so no keep-alive connection times out under it.)"""
    paths = {"job": f"/v1/jobs/{job_id}", "list": "/v1/jobs"}
    clients = [RawClient(service.url, service.headers) for _ in range(phase.clients)]
    scraper = httpx.AsyncClient(base_url=service.url, headers=service.headers, timeout=30)
    connected = 0
    all_connected = asyncio.Event()
    begin = end = float("inf")

    async def one(index: int, client: RawClient) -> None:
        nonlocal connected
        await client.get(paths["list"])  # connects; not measured
        connected += 1
        if connected == len(clients):
            all_connected.set()
        kinds = ["job", "list"] if index % 2 == 0 else ["list", "job"]
        turn = 0
        # Pollers start spread over one interval, as independent dashboards would.
        await asyncio.sleep(random.uniform(0, phase.interval_s))
        while (sent := time.perf_counter()) < end:
            kind = kinds[turn % 2]
            turn += 1
            try:
                code = await asyncio.wait_for(client.get(paths[kind]), timeout=30)
                error = None if code == 200 else str(code)
            except (OSError, ValueError, asyncio.IncompleteReadError, TimeoutError) as err:
                error = type(err).__name__
                await client.aclose()
                client.reader = client.writer = None  # the next request reconnects
            took = (time.perf_counter() - sent) * 1000
            if sent >= begin:
                if error is None:
                    phase.latencies_ms[kind].append(took)
                else:
                    phase.errors[error] = phase.errors.get(error, 0) + 1
            if phase.interval_s:
                await asyncio.sleep(phase.interval_s)

    async def clock() -> None:
        nonlocal begin, end
        await all_connected.wait()
        before = (await scraper.get("/metrics")).text
        begin = time.perf_counter() + 0.5  # the ramp: every client in its loop
        end = begin + phase.duration_s
        wall_begin = time.time() + 0.5
        phase.window = (wall_begin, wall_begin + phase.duration_s)
        await asyncio.sleep(begin - time.perf_counter())
        with CpuMeter(service.process.pid) as cpu:
            await asyncio.sleep(end - time.perf_counter())
        phase.cpu = cpu.result
        # In-flight requests end after ``end``; the scrape counts those answered by now.
        phase.metrics = (before, (await scraper.get("/metrics")).text)

    try:
        await asyncio.gather(clock(), *(one(i, c) for i, c in enumerate(clients)))
    finally:
        await asyncio.gather(scraper.aclose(), *(c.aclose() for c in clients))


def run_phase(service: Service, job_id: str, phase: Phase) -> dict[str, Any]:
    print(
        f"phase {phase.name}: {phase.clients} client(s), wait {phase.interval_s:g} s, "
        f"{phase.duration_s:g} s",
        flush=True,
    )
    if phase.clients:
        uvloop.run(load(service, job_id, phase))
    else:
        began = time.time()
        with CpuMeter(service.process.pid) as cpu:
            time.sleep(phase.duration_s)
        phase.window = (began, began + phase.duration_s)
        phase.cpu = cpu.result
    every = phase.latencies_ms["job"] + phase.latencies_ms["list"]
    result: dict[str, Any] = {
        "phase": phase.name,
        "clients": phase.clients,
        "interval_s": phase.interval_s,
        "duration_s": phase.duration_s,
        "window": phase.window,
        "requests": len(every),
        "requests_per_s": len(every) / phase.duration_s,
        "errors": phase.errors,
        "latency_ms": summary(every),
        "latency_ms_by_route": {k: summary(v) for k, v in phase.latencies_ms.items()},
        "server": server_view(*map(buckets_of, phase.metrics)),
        "cpu": phase.cpu,
    }
    if phase.clients:
        lat = result["latency_ms"]
        print(
            f"  {result['requests_per_s']:.0f} requests/s, p50 {lat['p50']:.1f} ms, "
            f"p99 {lat['p99']:.1f} ms, errors {sum(phase.errors.values())}",
            flush=True,
        )
    return result


# -- the report ------------------------------------------------------------------------------


def add_events(results: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
    for result in results:
        start, stop = result["window"]
        inside = [e for e in events if start <= e["received"] < stop]
        result["event_delay_s"] = summary([e["received"] - e["time"] for e in inside])
        steps = [e["ms_per_step"] for e in inside if e["ms_per_step"] is not None]
        result["training_ms_per_step"] = percentile(steps, 50) if steps else None


def le(bound_ms: float | None) -> str:
    return "> 10000" if bound_ms is None else f"≤ {bound_ms:g}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def render(saved: dict[str, Any]) -> str:
    from report import (  # here: it imports torch, which the event listener need not
        table,
    )

    results = saved["results"]
    ms = "{:.1f}".format
    rows = []
    for r in results:
        if not r["clients"]:
            continue
        lat, srv, cpu = r["latency_ms"], r["server"], r["cpu"]
        server = "-"
        if srv["mean_ms"] is not None:
            server = f"{srv['mean_ms']:.1f} / {le(srv['p50_le_ms'])} / {le(srv['p99_le_ms'])}"
        rows.append(
            [
                r["phase"],
                str(r["clients"]),
                f"{r['interval_s']:g} s",
                f"{r['requests_per_s']:.0f}",
                ms(lat["p50"]),
                ms(lat["p90"]),
                ms(lat["p99"]),
                ms(lat["max"]),
                str(sum(r["errors"].values())),
                server,
                f"{cpu['service_cpus']:.2f} / {cpu['load_generator_cpus']:.2f} / "
                f"{100 * cpu['all_cpus_busy']:.0f}%",
                f"{cpu['load_average'][0]:.2f}",
                (
                    f"{verdict(lat['p99'] < GOAL_P99_MS)} (p99 < {GOAL_P99_MS:g} ms)"
                    if r["interval_s"] or r["clients"] == 1
                    # No wait: each client sends again on its answer, so the mean latency is
                    # clients / throughput (Little's law); a measure of capacity, not a goal.
                    else f"none (stress: {r['clients']} / {r['requests_per_s']:.0f} per s "
                    f"= {1000 * r['clients'] / max(r['requests_per_s'], 1e-9):.0f} ms mean)"
                ),
            ]
        )
    requests = table(
        f"Requests: each client alternates `GET /v1/jobs/{{id}}` and `GET /v1/jobs`; latency "
        f"in the client, in ms, over every request of the phase; the server's view (mean, and "
        f"p50 / p99 as bucket bounds of its Prometheus histogram) is the time inside the app; CPU: "
        f"the service process and the load generator in CPUs, and all {saved['cpus']} CPUs' "
        f"busy share (the rest: Ray, the 2 training workers, the event listener).",
        [
            "phase",
            "clients",
            "wait",
            "requests/s",
            "p50",
            "p90",
            "p99",
            "max",
            "errors",
            "server mean / p50 / p99",
            "CPU: service / load gen. / all",
            "load avg (1 min)",
            "goal",
        ],
        rows,
    )
    rows = []
    for r in results:
        d = r["event_delay_s"]
        step = r["training_ms_per_step"]
        rows.append(
            [
                r["phase"],
                str(d["n"]),
                f"{d['p50']:.2f}",
                f"{d['p99']:.2f}",
                f"{d['max']:.2f}",
                "-" if step is None else f"{step:.0f}",
                f"{verdict(d['n'] > 0 and d['p99'] < GOAL_DELAY_S)} (p99 < {GOAL_DELAY_S:g} s)",
            ]
        )
    delays = table(
        "Event delay, in s: the client's receipt of each `progress` event minus its `time` "
        "(set by the progress sink when the worker's report reached it); it spans sink -> "
        f"the service's follower (reads every {saved['poll_interval_s']:g} s) -> store -> "
        "event stream -> client, not the worker -> sink hop (a fire-and-forget Ray call). "
        "Training ms/step: the median the workers reported in the phase.",
        ["phase", "events", "p50", "p99", "max", "training ms/step", "goal"],
        rows,
    )
    return f"{saved['header']}\n\n{requests}\n\n{delays}"


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return f"{platform.platform()}, {cpu}, {os.cpu_count()} CPUs, load average {load}"


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return False


def training_nice() -> list[int]:
    """The nice values of this run's Ray Train workers (Ray starts its workers niced)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or not _descends_from(int(proc.name), os.getpid()):
            continue
        with contextlib.suppress(OSError):
            if (proc / "cmdline").read_bytes().startswith(b"ray::RayTrainWorker"):
                stat = (proc / "stat").read_text()
                found.append(int(stat[stat.rindex(")") + 2 :].split()[16]))
    return found


def busy_elsewhere() -> list[str]:
    """Other heavy processes (a test run, another Ray head or service), not this run's own,
    that would skew the figures."""
    found = subprocess.run(
        ["pgrep", "-af", "pytest|ray start|kaisa-ray serve"], capture_output=True, text=True
    ).stdout
    return [
        line[:100]
        for line in found.splitlines()
        if not _descends_from(int(line.split()[0]), os.getpid())
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--duration", type=float, default=30, help="seconds per load phase")
    parser.add_argument("--interval", type=float, default=1.0, help="polling: wait (s)")
    parser.add_argument("--idle", type=float, default=10, help="seconds with no load")
    parser.add_argument("--baseline", type=float, default=10, help="seconds of one client")
    parser.add_argument("--quick", action="store_true", help="20 clients, 5 s phases")
    parser.add_argument("--write", action="store_true", help="store the JSON and Markdown")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="print an earlier run's tables"
    )
    args = parser.parse_args()
    if args.from_json is not None:
        print(render(json.loads(args.from_json.read_text())))
        return
    if args.quick:
        args.clients, args.duration, args.idle, args.baseline = 20, 5.0, 3.0, 3.0
    others = busy_elsewhere()
    if others:
        print("note: other heavy processes run on this machine:\n  " + "\n  ".join(others))
    seen = set(others)
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC)
    from report import git_commit  # here: report imports torch

    commit = git_commit()
    total = args.idle + args.baseline + 2 * args.duration
    nice: list[int] = []
    steps = 100_000  # more than it can do here; the job is cancelled at the end
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="kaisa-load-") as tmp,
        running_service(Path(tmp) / "service") as service,
    ):
        print(f"service up at {service.url}", flush=True)
        job = (
            httpx.post(
                f"{service.url}/v1/jobs", json=job_spec(steps), headers=service.headers, timeout=30
            )
            .raise_for_status()
            .json()
        )
        wait_for_state(service, job["id"], {"RUNNING"}, timeout_s=300)
        events_file = Path(tmp) / "events.jsonl"
        listener = multiprocessing.get_context("spawn").Process(
            target=listen, args=(service.url, service.token, job["id"], str(events_file))
        )
        listener.start()
        try:
            deadline = time.monotonic() + 120
            while not read_events(events_file):  # the job reports, the stream works
                if time.monotonic() > deadline or not listener.is_alive():
                    raise RuntimeError("no progress event reached the event stream")
                time.sleep(0.2)
            print(f"job {job['id']} running; measuring about {total:.0f} s", flush=True)
            nice = training_nice()
            for phase in (
                Phase("idle", 0, 0.0, args.idle),
                Phase("baseline", 1, 0.0, args.baseline),
                Phase("polling", args.clients, args.interval, args.duration),
                Phase("saturation", args.clients, 0.0, args.duration),
            ):
                results.append(run_phase(service, job["id"], phase))
                results[-1]["others"] = busy_elsewhere()  # at the phase's end
                seen.update(results[-1]["others"])
            time.sleep(1)  # the last events of the last phase
        finally:
            listener.terminate()
            listener.join(10)
        add_events(results, read_events(events_file))
        httpx.post(f"{service.url}/v1/jobs/{job['id']}/cancel", headers=service.headers, timeout=30)
        state = wait_for_state(
            service, job["id"], {"CANCELLED", "SUCCEEDED", "FAILED"}, timeout_s=120
        )
        if state != "CANCELLED":
            print(f"note: the job ended {state}, not CANCELLED", flush=True)
    header = (
        f"Measured {started:%Y-%m-%d %H:%M} UTC at commit {commit} on {machine()} (before the "
        f"run: {', '.join(f'{v:.2f}' for v in load_before)}). The service (`kaisa-ray serve`, "
        "one uvicorn process, embedded Ray head) on loopback, a 2-worker K-FAC job (LeNet, "
        "Fashion-MNIST, 4096 samples) training throughout (its Ray Train workers at nice "
        f"{'/'.join(map(str, sorted(set(nice)))) or '?'}, as Ray starts them), and the load "
        "generator (one asyncio process on uvloop, a minimal HTTP/1.1 client, a keep-alive "
        "connection per client) on the same machine."
        + (
            " Other heavy processes seen during the run (they skew the figures): "
            + "; ".join(sorted(seen))
            + "."
            if seen
            else " No other heavy process (test run, Ray head) was seen during the run."
        )
    )
    saved = {
        "header": header,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "poll_interval_s": Settings().poll_interval_s,  # the service reads the same env
        "job_spec": job_spec(steps),
        "training_nice": nice,
        "args": vars(args) | {"from_json": None},
        "results": results,
    }
    text = render(saved)
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "service_load.json").write_text(json.dumps(saved, indent=1) + "\n")
        (RESULTS / "service_load.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
