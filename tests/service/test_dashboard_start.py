"""The dashboard before its event stream connects, and its numbers: the job list shows the
jobs while ``/v1/events`` is held back (as a slow proxy would); a job's curves draw each point
once when a record is both streamed and in the history read late; in a real browser (Debian's
Chromium through Selenium; ``FakeRunner`` for Ray); and ``fmt`` writes numbers for people
(the page's own module, run by Node)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Request, Response
from support.browser import NEEDS_BROWSER, points, text_of, wait
from support.fake_runner import FakeRunner
from support.served import serve

from service.app import create_app
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
NODE = shutil.which("node")


@contextmanager
def holding(
    runner: FakeRunner, data_dir: Path, held: Callable[[Request], bool]
) -> Iterator[tuple[str, threading.Event]]:
    """The service (no token, loopback) on ``runner``, whose answers to the requests ``held``
    picks wait until the returned event is set."""
    app = create_app(Settings(data_dir=data_dir), runner=runner)
    release = threading.Event()

    @app.middleware("http")
    async def hold(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if held(request):
            while not release.is_set():
                await asyncio.sleep(0.05)
        return await call_next(request)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        server, thread, url = serve(app, sock)
        try:
            yield url, release
        finally:
            release.set()
            server.should_exit = True
            thread.join(timeout=15)
    assert not thread.is_alive(), "uvicorn did not shut down"


@pytest.fixture
def held_site(tmp_path: Path) -> Iterator[tuple[str, threading.Event]]:
    """The service whose ``/v1/events`` answers only once the returned event is set."""
    with holding(FakeRunner(), tmp_path / "service", lambda r: r.url.path == "/v1/events") as found:
        yield found


def submit(url: str, name: str, *, max_steps: int) -> str:
    """A LeNet job on synthetic data, submitted over REST; returns its id."""
    job = {
        "name": name,
        "model": {"name": "lenet"},
        "dataset": {"name": "synthetic"},
        "stop": {"max_steps": max_steps},
    }
    created = httpx.post(f"{url}/v1/jobs", json=job, timeout=30)
    assert created.status_code == 201, created.text
    job_id: str = created.json()["id"]
    return job_id


@NEEDS_BROWSER
def test_the_job_list_shows_before_the_event_stream_connects(
    browser: Any,
    held_site: tuple[str, threading.Event],
) -> None:
    url, release = held_site
    submit(url, "listed", max_steps=10)
    browser.get(f"{url}/#/")
    wait(lambda: text_of(browser, "#jobs") != "", "the job list, with the stream held back")
    assert "listed" in text_of(browser, "#jobs")
    assert text_of(browser, "#live") == "connecting…"  # the stream is still held
    release.set()
    wait(lambda: text_of(browser, "#live") == "live", "the stream to connect")
    assert "listed" in text_of(browser, "#jobs")


@pytest.fixture
def held_history(tmp_path: Path) -> Iterator[tuple[str, FakeRunner, threading.Event]]:
    """The service whose metric history answers the browser only once the returned event is
    set (the test's own requests are answered at once)."""

    def browsers_history(request: Request) -> bool:
        agent = request.headers.get("user-agent", "")
        return request.url.path.endswith("/metrics") and "Chrome" in agent

    runner = FakeRunner()
    with holding(runner, tmp_path / "service", browsers_history) as (url, release):
        yield url, runner, release


@NEEDS_BROWSER
def test_a_point_both_streamed_and_in_the_history_is_drawn_once(
    browser: Any, held_history: tuple[str, FakeRunner, threading.Event]
) -> None:
    """A step recorded while the page reads the history (a restarted service catching up does
    this) reaches the page twice: in the event stream and in the history. It is drawn once,
    with times to the microsecond as the workers send them (the history's ISO times keep
    milliseconds in the browser)."""
    url, runner, release = held_history
    job_id = submit(url, "curves", max_steps=100)

    def step(n: int) -> dict[str, Any]:
        return {"kind": "step", "step": n, "loss": 1.0 / n, "samples_per_s": 100.0 + n,
                "time": 1.8e9 + n + 0.0004567}  # fmt: skip

    def stored() -> int:
        page = httpx.get(f"{url}/v1/jobs/{job_id}/metrics?kind=step", timeout=30).json()
        return len(page["points"])

    runner.push(job_id, {"kind": "worker", "rank": 0}, {"kind": "start", "total_steps": 100})
    runner.push(job_id, step(10), step(20))
    wait(lambda: stored() == 2, "two steps stored")

    browser.get(f"{url}/#/jobs/{job_id}")
    wait(lambda: text_of(browser, "#live") == "live", "the job's stream")  # history held
    runner.push(job_id, step(30))  # streamed to the page now, and stored before it reads
    wait(lambda: stored() == 3, "the third step stored")
    release.set()
    wait(lambda: points(browser, "chart-throughput") >= 3, "the curves")
    runner.push(job_id, step(40))  # streamed after the third: a doubled third would show
    wait(lambda: stored() == 4, "the fourth step stored")
    wait(lambda: points(browser, "chart-throughput") >= 4, "the fourth point")
    time.sleep(1)  # the chart redraws at most twice a second
    assert points(browser, "chart-throughput") == 4


@pytest.mark.skipif(NODE is None, reason="needs node (Debian's nodejs)")
def test_numbers_are_written_for_people() -> None:
    """Samples per second as 5,660, not 5.66e+3; small values keep three significant digits."""
    module = ROOT / "service" / "static" / "js" / "dom.js"
    values = [5660.3, 999.94, 99.96, 12.345, 0.012345, -2500.2, 3, None, 1.5e-7]
    script = (
        f"import {{ fmt }} from {json.dumps(str(module))};"
        f"console.log(JSON.stringify({json.dumps(values)}.map((v) => fmt(v))));"
    )
    done = subprocess.run(
        [str(NODE), "--input-type=module", "-e", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [
        "5,660", "1,000", "100", "12.3", "0.0123", "-2,500", "3", "\u2013", "1.50e-7",
    ]  # fmt: skip
