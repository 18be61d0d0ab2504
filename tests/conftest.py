"""Shared pytest configuration: ``gpu`` tests skip where CUDA is absent; the tiers (``ray``:
a Ray cluster, Ray Train workers or a real service; ``slow``: real data or many processes;
``make test-fast`` runs neither); the longest modules first, so that ``make test``'s two
workers (pytest-xdist, a module to a worker) end together; and one real Ray head per worker.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from support.ray_head import RayHead

HEAD = pytest.StashKey["RayHead"]()


# Modules of many processes (gloo process groups spawned per test): ``slow``, not ``ray``.
MANY_PROCESSES = {
    "test_distributed.py",
    "test_tuner_measure.py",
    "test_tuner_measured.py",
    "test_tuner_profile.py",
}
# The longest modules (minutes of Ray and services), run first: with a module to a worker,
# the last module to start decides when the run ends. (Tried 2026-11-29: test_streaming.py and
# test_fsdp.py moved up among these, by their seconds, made the run 3182 s, its tests 6273 s of
# worker time, against 2679 s and 4949 s in a run of 2026-11-28 with them where file order
# puts them: two Ray-heavy modules at once cost more than their sum. One run each.)
LONGEST_FIRST = [  # by their seconds in a full run (2026-11-27), longest first
    "test_shared_machine.py",
    "test_ray_train.py",
    "test_service_e2e.py",
    "test_kfac_auto.py",
    "test_service_ops.py",
    "test_multinode.py",
    "test_service_quickstart.py",
    "test_distributed.py",
    "test_dashboard_e2e.py",
    "test_sweep.py",
    "test_service_plan_burst.py",
    "test_peers.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "ray_head" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
        if item.path.name in MANY_PROCESSES:
            item.add_marker(pytest.mark.slow)
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    # Ray reads its auth settings when it is first imported, so they are set before any test
    # module imports it: token auth, as on a real cluster, with a token made for this run.
    from support.ray_head import TEST_ENV

    os.environ.update(TEST_ENV)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture(scope="session")
def ray_head(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RayHead]:
    """One real Ray head (job server, token auth) for the run; this process is connected."""
    import ray
    from support.ray_head import start_head

    head = start_head(tmp_path_factory.mktemp("ray"), token=os.environ["RAY_AUTH_TOKEN"])
    request.config.stash[HEAD] = head
    try:
        ray.init(address=head.gcs_address, include_dashboard=False, log_to_driver=False)
        yield head
    finally:
        ray.shutdown()
        head.stop()
        del request.config.stash[HEAD]


@pytest.fixture(autouse=True, scope="module")
def _no_ray_job_outlives_its_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """The Ray Jobs a module leaves unfinished on the shared head (a failed test's job of
    100,000 steps) are stopped when it ends, so that they do not train on, and slow down,
    the modules after it."""
    yield
    head = request.config.stash.get(HEAD, None)
    if head is not None and head.alive():
        from support.ray_head import stop_unfinished_jobs

        stop_unfinished_jobs(head)
