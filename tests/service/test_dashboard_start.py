"""The dashboard before its event stream connects, and its numbers: the job list shows the
jobs while ``/v1/events`` is held back (as a slow proxy would), in a real browser (Debian's
Chromium through Selenium; ``FakeRunner`` for Ray); and ``fmt`` writes numbers for people
(the page's own module, run by Node)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Request, Response
from support.browser import (
    CHROMEDRIVER,
    CHROMIUM,
    text_of,
    wait,
)
from support.fake_runner import FakeRunner
from support.served import serve

from service.app import create_app
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
NODE = shutil.which("node")


@pytest.fixture
def held_site(tmp_path: Path) -> Iterator[tuple[str, threading.Event]]:
    """The service (no token, loopback) whose ``/v1/events`` answers only once the returned
    event is set."""
    app = create_app(Settings(data_dir=tmp_path / "service"), runner=FakeRunner())
    release = threading.Event()

    @app.middleware("http")
    async def hold_events(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if request.url.path == "/v1/events":
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


@pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (make setup installs them)",
)
def test_the_job_list_shows_before_the_event_stream_connects(
    browser: Any,
    held_site: tuple[str, threading.Event],
) -> None:
    url, release = held_site
    job = {
        "name": "listed",
        "model": {"name": "lenet"},
        "dataset": {"name": "synthetic"},
        "stop": {"max_steps": 10},
    }
    created = httpx.post(f"{url}/v1/jobs", json=job, timeout=30)
    assert created.status_code == 201, created.text
    browser.get(f"{url}/#/")
    wait(lambda: text_of(browser, "#jobs") != "", "the job list, with the stream held back")
    assert "listed" in text_of(browser, "#jobs")
    assert text_of(browser, "#live") == "connecting…"  # the stream is still held
    release.set()
    wait(lambda: text_of(browser, "#live") == "live", "the stream to connect")
    assert "listed" in text_of(browser, "#jobs")


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
