"""Shared pytest configuration: ``gpu`` tests skip where CUDA is absent; a real Ray head."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from ray_head import RayHead


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    # Ray reads its auth settings when it is first imported, so they are set before any test
    # module imports it: token auth, as on a real cluster, with a token made for this run.
    from ray_head import TEST_ENV

    os.environ.update(TEST_ENV)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    """One real Ray head (job server, token auth) for the run; this process is connected."""
    import ray
    from ray_head import start_head

    head = start_head(tmp_path_factory.mktemp("ray"), token=os.environ["RAY_AUTH_TOKEN"])
    try:
        ray.init(address=head.gcs_address, include_dashboard=False, log_to_driver=False)
        yield head
    finally:
        ray.shutdown()
        head.stop()
