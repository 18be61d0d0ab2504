"""Shared pytest configuration: ``gpu`` tests skip where CUDA is absent; the tiers (``ray``:
a Ray cluster, Ray Train workers or a real service; ``slow``: real data or many processes;
``make test-fast`` runs neither); which pytest worker runs what (a test at a time to the
worker that is free, a module at a time where its tests share a fixture) and in what order;
and one real Ray head per worker, up only while the tests that use it run.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

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
# Where each test runs (xdist's ``loadgroup``): a test at a time to whichever worker is free,
# in this order: the tests on the worker's Ray head first (so that each worker starts its head
# once, and stops it after the last: ``pytest_runtest_teardown``), then the other Ray tests,
# modules longest first, then the rest in file order, two service-only modules last so that
# the workers end together. A module whose tests share a module fixture of its own (a service,
# a cluster run, the neighbours' Ray on the default ports) is one group, run on one worker, so
# that the fixture is made once, and not twice at once. Measured 2026-12-02
# (benchmarks/README.md): a test at a time took half the wall and CPU of a module at a time.
LATE = ["test_service_plan_burst.py", "test_dashboard_start.py"]
LONGEST_FIRST = [  # the Ray modules by their seconds alone (2026-12-01), longest first
    "test_shared_machine.py",
    "test_streaming.py",
    "test_service_e2e.py",
    "test_ray_train.py",
    "test_kfac_auto.py",
    "test_service_ops.py",
    "test_multinode.py",
    "test_dashboard_e2e.py",
    "test_service_quickstart.py",
    "test_sweep.py",
]
ON_HEAD = pytest.StashKey[set[object]]()  # the modules (paths) with a test on the head


# The modules whose tests share a module fixture of their own (``shares_a_module_fixture``):
# one worker each. Listed here because xdist's controller, which schedules, collects nothing.
ONE_WORKER = {
    "tests/core/test_precision.py",
    "tests/service/test_plan_dashboard.py",
    "tests/service/test_service_cli.py",
    "tests/service/test_service_e2e.py",
    "tests/service/test_service_fuzz.py",
    "tests/service/test_service_ops.py",
    "tests/service/test_service_plan_burst.py",
    "tests/train/test_multinode.py",
    "tests/train/test_plan_api.py",
    "tests/train/test_plan_cli.py",
    "tests/train/test_shared_machine.py",
    "tests/tuner/test_plan_figures.py",
    "tests/tuner/test_tuner_measured.py",
}


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (the Makefile's): a test at a time, except the ``ONE_WORKER``
    modules, a module at a time. (xdist 3.8's own groups do nothing under pytest 9.2, whose
    node ids no longer come from the ``_nodeid`` that xdist suffixes with the group.)"""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in ONE_WORKER else nodeid

    return Scheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if uses_head(item):
            item.add_marker(pytest.mark.ray)
        if item.path.name in MANY_PROCESSES:
            item.add_marker(pytest.mark.slow)
    unlisted = sorted(
        {item.nodeid.split("::", 1)[0] for item in items if shares_a_module_fixture(item)}
        - ONE_WORKER
    )
    if unlisted:
        raise pytest.UsageError(
            f"{', '.join(unlisted)}: its tests share a module fixture of its own; add it to "
            "ONE_WORKER in tests/conftest.py, so that one pytest worker runs all of them"
        )
    on_head = config.stash[ON_HEAD] = {item.path for item in items if uses_head(item)}
    ray = {item.path for item in items if "ray" in item.keywords}
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> tuple[int, int, int]:
        if item.path.name in LATE:
            return (2, 0, 0)
        if item.path in ray:
            return (0, item.path not in on_head, rank.get(item.path.name, len(rank)))
        return (1, 0, 0)

    items.sort(key=order)  # stable: file order kept within each place
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module- or session-scoped fixture its own module defines (the
    worker's Ray head, defined here, is one a worker, and cheap to share across modules)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    module = item.nodeid.split("::", 1)[0]
    return any(
        defs[-1].scope in ("module", "session") and defs[-1].baseid == module
        for defs in info.name2fixturedefs.values()
    )


def uses_head(item: pytest.Item) -> bool:
    """Whether ``item`` uses the worker's Ray head (``ray_head``, itself or by a fixture)."""
    return "ray_head" in getattr(item, "fixturenames", ())


def pytest_configure(config: pytest.Config) -> None:
    # Ray reads its auth settings when it is first imported, so they are set before any test
    # module imports it: token auth, as on a real cluster, with a token made for this run.
    from support.ray_head import TEST_ENV

    os.environ.update(TEST_ENV)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture(scope="module")
def ray_head(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> RayHead:
    """The worker's real Ray head (job server, token auth), started by the first module that
    asks and kept for the next ones; this process is connected to it."""
    head = request.config.stash.get(HEAD, None)
    if head is not None:
        return head
    import ray
    from support.ray_head import start_head

    head = start_head(tmp_path_factory.mktemp("ray"), token=os.environ["RAY_AUTH_TOKEN"])
    request.config.stash[HEAD] = head
    ray.init(address=head.gcs_address, include_dashboard=False, log_to_driver=False)
    return head


def _stop_head(config: pytest.Config) -> None:
    head = config.stash.get(HEAD, None)
    if head is None:
        return
    import ray

    del config.stash[HEAD]
    try:
        ray.shutdown()
    finally:
        head.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Once the worker's next module has no test on the head (xdist's worker knows its next
    test before it runs this one), the head stops, after this module's fixtures have ended;
    a later module that asks for it starts it again."""
    try:
        yield
    finally:
        if nextitem is None or nextitem.path not in item.config.stash.get(ON_HEAD, set()):
            _stop_head(item.config)


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
