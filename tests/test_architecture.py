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
FORBIDDEN_IN_CORE_PACKAGES = ("kaisa_train", "tuner", "service")


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


# -- the layers and their directions ---------------------------------------------------------

# Each layer is one top-level package, so the folders show the layers: the core
# (``kaisa_ray``: the preconditioner, torch only), the tuner, the training jobs
# (``kaisa_train``: Ray Train, the JobSpec, the commands; not ``train``, which a user's own
# ``train.py`` in a job's working directory would shadow) and the service.
LAYER_OF_PACKAGE = {
    "kaisa_ray": "core",
    "tuner": "tuner",
    "kaisa_train": "train",
    "service": "service",
}
PACKAGES = tuple(LAYER_OF_PACKAGE)
# Inner to outer: a module may import its own layer and the layers before it, never after.
LAYERS = ("core", "tuner", "train", "service")


def layer_of(module: str) -> str:
    """The layer of ``module``: its top-level package's."""
    return LAYER_OF_PACKAGE[module.split(".")[0]]


def project_graph(root: Path) -> dict[str, set[str]]:
    """Every project module under ``root`` and the project modules it imports, at the top, in
    a function or under ``TYPE_CHECKING`` alike (relative imports resolved; ``from pkg import
    name`` counts the submodule ``pkg.name`` where there is one, else ``pkg``)."""
    paths: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (root / package).glob("**/*.py"):
            if "migrations" in path.parts:  # Alembic's scripts, loaded by Alembic
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    above = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*above, base] if base else above)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in paths else known(base))
            elif isinstance(node, ast.Import):
                found.update(known(alias.name) for alias in node.names)
        graph[module] = {name for name in found if name is not None} - {module}
    return graph


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import from an inner layer to an outer one, as ``a (layer) -> b (layer)``."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    return sorted(
        f"{module} ({layer_of(module)}) -> {target} ({layer_of(target)})"
        for module, targets in graph.items()
        for target in targets
        if rank[layer_of(target)] > rank[layer_of(module)]
    )


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules that reach themselves through their imports."""

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        stack = [start]
        while stack:
            for nxt in graph.get(stack.pop(), set()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    return sorted(name for name in graph if name in reach(name))


def test_every_import_points_inward_core_tuner_train_service() -> None:
    """core <- tuner <- train <- service, for every module of the project, deferred imports
    and type-only imports included."""
    graph = project_graph(ROOT)
    assert {layer_of(module) for module in graph} == set(LAYERS)
    assert layer_violations(graph) == []


def test_each_package_of_the_project_is_one_layer() -> None:
    """The folders show the layers: every package at the project's top is a layer of its own
    (a new one must be given its place), and no layer sits inside another's package."""
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert packages == set(PACKAGES)
    assert sorted(LAYER_OF_PACKAGE.values()) == sorted(LAYERS)
    nested = [  # the inner layers, core and tuner: modules, no subpackages
        str(path.parent.relative_to(ROOT))
        for package in ("kaisa_ray", "tuner")
        for path in (ROOT / package).glob("*/__init__.py")
    ]
    assert nested == [], f"a package inside an inner layer: {nested}"


# The service's rooms, inner to outer; its other modules (the app, settings, the Ray adapter,
# the CLI...) are its infrastructure, free to use them.
SERVICE_ROOMS = ("model", "store", "domain", "routes")


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import from one of the service's rooms into a room after it."""

    def room(module: str) -> int | None:
        parts = module.split(".")
        if parts[0] != "service" or len(parts) < 2 or parts[1] not in SERVICE_ROOMS:
            return None
        return SERVICE_ROOMS.index(parts[1])

    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if room(module) is not None and room(target) is not None and room(target) > room(module)  # type: ignore[operator]
    )


def test_the_service_s_rooms_import_only_the_rooms_before_them() -> None:
    """model <- store <- domain <- routes."""
    graph = project_graph(ROOT)
    assert {
        m.split(".")[1] for m in graph if m.count(".") >= 2 and m.startswith("service.")
    } >= set(SERVICE_ROOMS)
    assert room_violations(graph) == []
    planted = {"service.store.repository": {"service.domain.jobs", "service.model.lifecycle"}}
    assert room_violations(planted) == ["service.store.repository -> service.domain.jobs"]


def test_no_module_of_the_project_reaches_itself_through_its_imports() -> None:
    """No circle anywhere (the core's plan and registration were one until ``PlannedLayer``
    moved beside ``LayerShape``; six train modules until the workers' half of ``kfac: auto``
    left ``tuning.py`` for ``auto_choice.py``)."""
    assert import_cycles(project_graph(ROOT)) == []


def _planted(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    return tmp_path


def test_the_checks_find_a_planted_circle_and_a_planted_outward_import(tmp_path: Path) -> None:
    root = _planted(
        tmp_path,
        {
            "kaisa_ray/__init__.py": "",
            "kaisa_ray/plan.py": "def f():\n    from kaisa_ray import registration\n",
            "kaisa_ray/registration.py": "from kaisa_ray.plan import f\n",
            "kaisa_train/__init__.py": "",
            "kaisa_train/job.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from service.app import App\n",
            "kaisa_train/spec.py": "from . import job\n",
            "tuner/__init__.py": "",
            "tuner/cost.py": "import kaisa_train.spec\n",
            "service/__init__.py": "",
            "service/app.py": "from kaisa_ray import plan\n",
        },
    )
    graph = project_graph(root)
    assert graph["kaisa_train.spec"] == {"kaisa_train.job"}  # relative, resolved
    assert import_cycles(graph) == ["kaisa_ray.plan", "kaisa_ray.registration"]
    assert layer_violations(graph) == [
        "kaisa_train.job (train) -> service.app (service)",
        "tuner.cost (tuner) -> kaisa_train.spec (train)",
    ]


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import ray\nfrom fastapi import FastAPI\nimport os\n")
    assert {n for n in imported_roots(bad) if third_party(n)} == {"ray", "fastapi"}


# -- processes that must not pay for torch ---------------------------------------------------

# Modules that Ray actors and tasks import in processes of their own (the progress sink and the
# tuner, one per cluster, created by each driver; a streamed dataset's functions, which Ray
# Data's readers, split coordinator and skipped-records ledger run): importing torch there
# costs seconds of CPU and hundreds of MB a process.
TORCH_FREE = [
    "kaisa_train.progress",
    "tuner.singleton",
    "tuner.actor",
    "kaisa_train.streaming",
    "kaisa_train.stream_files",
    "kaisa_train.stream_images",
    "kaisa_train.stream_parquet",
    "kaisa_train.stream_text",
    "kaisa_train.stream_read",
]


def fresh_python(code: str) -> str:
    """What ``code`` prints in a fresh interpreter of this venv, run from the checkout."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("module", TORCH_FREE)
def test_an_actor_module_imports_no_torch(module: str) -> None:
    code = f"import sys, {module}\nprint('torch' in sys.modules)\n"
    assert fresh_python(code) == "False", f"{module} imports torch"


# The contract: a job file is read and checked, every example's model parameters included,
# without torch (the ``kaisa-ray`` commands that only read specs, ``validate`` among them;
# what imports torch is what builds or prices a model).
def test_a_job_spec_is_parsed_and_checked_without_torch() -> None:
    code = (
        "import sys, yaml, pathlib\n"
        "from kaisa_train.spec import JobSpecError, parse_job_spec\n"
        "from kaisa_train.spec.model_params import constructor_params\n"
        "from kaisa_train.registry import model_names\n"
        "for path in sorted(pathlib.Path('examples').glob('*.yaml')):\n"
        "    try:\n"
        "        parse_job_spec(yaml.safe_load(path.read_text()))\n"
        "    except JobSpecError as err:  # files a streamed example names, not here\n"
        "        assert '- model' not in str(err), err\n"
        "for name in model_names():\n"
        "    constructor_params(name)\n"
        "print('torch' in sys.modules)\n"
    )
    assert fresh_python(code) == "False", "reading a job spec imports torch"


def test_no_command_s_help_imports_torch() -> None:
    """``kaisa-ray COMMAND --help`` for every command, in one fresh process: none loads torch
    (a command imports what it runs when it runs)."""
    code = (
        "import sys, click\n"
        "from click.testing import CliRunner\n"
        "from service.cli import main\n"
        "for name in main.list_commands(click.Context(main)):\n"
        "    done = CliRunner().invoke(main, [name, '--help'])\n"
        "    assert done.exit_code == 0, (name, done.output)\n"
        "    if 'torch' in sys.modules:\n"
        "        print(name)\n"
        "        break\n"
        "else:\n"
        "    print('none')\n"
    )
    first = fresh_python(code)
    assert first == "none", f"kaisa-ray {first} --help imports torch"
