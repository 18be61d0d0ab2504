"""The layers of ARCHITECTURE.md, enforced: dependencies point inward only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = sorted(p for p in (ROOT / "kaisa_ray").glob("*.py"))
# What each layer may import from outside the standard library.
ALLOWED = {
    "core": {"torch", "kaisa_ray"},
    "tuner": {"torch", "kaisa_ray", "tuner", "ray", "numpy"},
}
FORBIDDEN_IN_CORE_PACKAGES = ("kaisa_ray.train", "tuner", "service")


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def third_party(name: str) -> bool:
    import sys

    return name.split(".")[0] not in sys.stdlib_module_names


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_core_imports_torch_only(path: Path) -> None:
    for name in imported_roots(path):
        if not third_party(name):
            continue
        assert name.split(".")[0] in ALLOWED["core"], f"{path.name} imports {name}"
        assert not name.startswith(FORBIDDEN_IN_CORE_PACKAGES), f"{path.name} imports {name}"


def test_nothing_imports_service() -> None:
    for path in ROOT.glob("kaisa_ray/**/*.py"):
        assert not any(n.startswith("service") for n in imported_roots(path)), path
    for path in ROOT.glob("tuner/**/*.py"):
        assert not any(
            n.startswith(("service", "kaisa_ray.train")) for n in imported_roots(path)
        ), path


def core_imports(path: Path, modules: set[str]) -> set[str]:
    """The core modules ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "kaisa_ray" and len(parts) > 1:
                found.add(parts[1])
            elif node.module == "kaisa_ray":
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "kaisa_ray" and len(parts) > 1:
                    found.add(parts[1])
    return (found & modules) - {path.stem}


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules that reach themselves through their imports."""

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        stack = [start]
        while stack:
            for nxt in graph[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    return sorted(name for name in graph if name in reach(name))


def test_the_core_modules_import_one_another_without_a_circle() -> None:
    """No circle among ``kaisa_ray/*.py``, deferred imports inside functions included (the
    plan and the registration of layers were one until ``PlannedLayer`` moved beside
    ``LayerShape``)."""
    modules = {path.stem for path in CORE} - {"__init__"}
    graph = {path.stem: core_imports(path, modules) for path in CORE if path.stem in modules}
    assert import_cycles(graph) == []
    # the check finds a circle where there is one
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import ray\nfrom fastapi import FastAPI\nimport os\n")
    assert {n for n in imported_roots(bad) if third_party(n)} == {"ray", "fastapi"}
