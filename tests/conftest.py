"""Shared pytest configuration: ``gpu`` tests skip where CUDA is absent."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
