"""Waiting in tests for something another thread or process does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], what: str, timeout_s: float = 10) -> T:
    """Poll ``check`` until it returns something true (not None, False, [] or 0)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def wait_for_job(
    job: Callable[[str], dict[str, Any]],
    job_id: str,
    what: str,
    check: Callable[[dict[str, Any]], bool],
) -> dict[str, Any]:
    """Poll the job's view (``job(job_id)``) until ``check`` holds for it; return that view."""

    def found() -> dict[str, Any] | None:
        view = job(job_id)
        return view if check(view) else None

    return wait_for(found, f"job {job_id}: {what}")
