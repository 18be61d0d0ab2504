"""The test plugin in ``tests/plugins``: a model ``slow-mlp`` whose constructor sleeps as
long as it is told, registered through a real entry point (its ``.dist-info``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kaisa_train import registry

PLUGINS = Path(__file__).parents[1] / "plugins"


def with_slow_plugin() -> str:
    """``PYTHONPATH`` for a process that should see the plugin: the current one with
    ``tests/plugins`` first."""
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (str(PLUGINS), rest) if p)


@pytest.fixture
def slow_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The plugin seen by this process (its model registry re-read) and by the processes it
    starts; both undone afterwards."""
    monkeypatch.setenv("PYTHONPATH", with_slow_plugin())
    monkeypatch.syspath_prepend(str(PLUGINS))
    registry._plugins.cache_clear()
    yield
    monkeypatch.undo()
    registry._plugins.cache_clear()
