"""How ``make test`` spreads the suite over its pytest workers (``tests/conftest.py``): a test
at a time, except the modules whose tests share a module fixture of their own, which one
worker runs whole."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

ROOT_CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.fixture
def conftest(pytestconfig: pytest.Config) -> ModuleType:
    """tests/conftest.py as pytest loaded it (``import conftest`` may find another folder's)."""
    for plugin in pytestconfig.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) == str(ROOT_CONFTEST):
            assert isinstance(plugin, ModuleType)
            return plugin
    raise AssertionError(f"{ROOT_CONFTEST} is not loaded")


def test_a_listed_module_is_one_unit_and_every_other_test_its_own(
    conftest: ModuleType, pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pytestconfig.option, "dist", "loadgroup")
    monkeypatch.setattr(pytestconfig.option, "tx", ["popen"] * 2, raising=False)
    monkeypatch.setattr(pytestconfig.option, "numprocesses", 2, raising=False)
    scheduling = conftest.pytest_xdist_make_scheduler(pytestconfig, None)
    listed = "tests/train/test_shared_machine.py"
    assert listed in conftest.ONE_WORKER
    units = {scheduling._split_scope(f"{listed}::test_{name}") for name in ("a", "b[1]", "b[2]")}
    assert units == {listed}
    other = "tests/train/test_spec.py"
    assert other not in conftest.ONE_WORKER
    ids = [f"{other}::test_a", f"{other}::test_b[1]"]
    assert [scheduling._split_scope(i) for i in ids] == ids


def test_another_dist_mode_gets_xdist_s_own_scheduler(
    conftest: ModuleType, pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pytestconfig.option, "dist", "loadfile", raising=False)
    assert conftest.pytest_xdist_make_scheduler(pytestconfig, None) is None
