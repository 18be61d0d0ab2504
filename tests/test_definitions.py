"""One definition for every record kind and every closed set (the grep of issue 21, as a test).

- Each member of a closed set (job and trial states, strategies, compute methods, Conv2d
  approximations, precisions, directions) is written as a string in one Python module only:
  the one that defines its enum. Everyone else uses the enum.
- A record kind is written only in ``kaisa_train/records/``: no other module builds a
  record as ``{"kind": "..."}`` or compares a kind with a string.
- The dashboard's scripts hold no copy of those sets (they read ``GET /v1/registry``).
- ``RecordKind``, the record classes and the ``Record`` union agree.
"""

from __future__ import annotations

import ast
import enum
import re
import typing
from pathlib import Path

import pytest

from kaisa_ray.enums import (
    ComputeMethod,
    DistributedStrategy,
    EvalMetric,
    KFACApprox,
    OptimizerName,
    Precision,
    UpdateMode,
)
from kaisa_ray.timing import PHASES
from kaisa_train import records
from kaisa_train.records import (
    EVAL_LATEST,
    PHASE_FIELDS,
    STEP_LATEST,
    Direction,
    EvalRecord,
    LatestMetrics,
    RecordKind,
    StepRecord,
    TrialRecord,
    TrialState,
    Unit,
)
from kaisa_train.stream_sources import ImageMode, StreamSource
from service.model.lifecycle import JobState

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    path
    for package in ("kaisa_ray", "kaisa_train", "tuner", "service")
    for path in (ROOT / package).rglob("*.py")
    if "migrations" not in path.parts
)
CLOSED_SETS: list[type[enum.Enum]] = [
    JobState,
    TrialState,
    DistributedStrategy,
    ComputeMethod,
    KFACApprox,
    Precision,
    Direction,
    OptimizerName,
    UpdateMode,
    EvalMetric,
    Unit,
    StreamSource,
    ImageMode,
]
RECORDS = ROOT / "kaisa_train" / "records"


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            found.add(id(body[0].value))
    return found


def string_constants(path: Path) -> set[str]:
    """The strings a module writes in its code (not its docstrings)."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
    }


def enum_members(path: Path) -> set[str]:
    """The values of the members of the enums a module defines."""
    tree = ast.parse(path.read_text())
    values = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            isinstance(base, ast.Attribute | ast.Name)
            and (getattr(base, "attr", None) or getattr(base, "id", "")).endswith("Enum")
            for base in node.bases
        ):
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant):
                    values.add(str(item.value.value))
    return values


# Members that are also another vocabulary's word, written as that word elsewhere.
ALSO_ANOTHER_WORD = {
    UpdateMode.OPTIMIZER: "the JobSpec's optimizer section, a key of specs and checkpoints",
    Unit.VALUE: "a record's or a setting's value, a key of many mappings",
    Unit.SECONDS: "a sweep's duration, a key of the sweep's view",
}


@pytest.mark.parametrize("closed", CLOSED_SETS, ids=lambda e: e.__name__)
def test_each_member_of_a_closed_set_is_written_in_its_enum_s_module_only(
    closed: type[enum.Enum],
) -> None:
    constants = {path: string_constants(path) for path in SOURCES}
    defines = {path: enum_members(path) for path in SOURCES}
    for member in closed:
        if member in ALSO_ANOTHER_WORD:
            continue
        value = str(member.value)
        written = {path for path, found in constants.items() if value in found}
        defining = {path for path in written if value in defines[path]}
        assert defining, f"{value!r} of {closed.__name__} is written nowhere as a member"
        assert written == defining, (
            f"{value!r} of {closed.__name__} is written in "
            f"{sorted(str(p.relative_to(ROOT)) for p in written - defining)}: use the enum"
        )


def _mentions_kind(node: ast.AST) -> bool:
    return "kind" in ast.unparse(node).lower()


def _strings_in(node: ast.AST) -> list[str]:
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def kind_literals(path: Path) -> list[str]:
    """Where a module writes a record kind as a string: a ``{"kind": "..."}`` literal, a
    comparison of something named kind with a string, or ``kinds=[...]`` of strings."""
    tree = ast.parse(path.read_text())
    found = []
    kinds = {k.value for k in RecordKind}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "kind"
                    and isinstance(value, ast.Constant)
                    and value.value in kinds
                ):
                    found.append(f"line {node.lineno}: {{'kind': {value.value!r}}}")
        elif isinstance(node, ast.Compare) and any(
            _mentions_kind(side) for side in [node.left, *node.comparators]
        ):
            written = [s for s in _strings_in(node) if s in kinds]
            if written:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.keyword) and node.arg == "kinds":
            written = [s for s in _strings_in(node.value) if s in kinds]
            if written:
                found.append(f"line {node.value.lineno}: kinds={written}")
    return found


# Other vocabularies that happen to share a word with a record kind, and say "kind" too.
NOT_RECORDS = {
    "kaisa_train/optimizers.py": "schedule.kind == 'step'",  # ScheduleSpec.kind
    "tuner/node_training.py": "{'kind': 'measured'}",  # a hardware number's kind (hardware.KINDS)
}


def test_record_kinds_are_written_in_the_records_module_only() -> None:
    offenders = {}
    for path in SOURCES:
        where = str(path.relative_to(ROOT))
        lines = [
            line
            for line in kind_literals(path)
            if RECORDS not in path.parents
            and not (where in NOT_RECORDS and NOT_RECORDS[where] in line)
        ]
        if lines:
            offenders[where] = lines
    assert offenders == {}


def test_the_check_sees_a_record_built_by_hand(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "record = {'kind': 'step', 'step': 3}\n"
        "if record['kind'] == 'eval':\n    pass\n"
        "read(run, kinds=['tuner'])\n"
        "if record['step'] == 'eval':\n    pass\n"  # not a kind: not counted
    )
    assert [line.split(":")[0] for line in kind_literals(bad)] == ["line 1", "line 2", "line 4"]
    assert "QUEUED" in string_constants(ROOT / "service" / "model" / "lifecycle.py")
    assert "QUEUED" in enum_members(ROOT / "service" / "model" / "lifecycle.py")


def test_every_kind_has_one_record_class_in_the_union() -> None:
    union = typing.get_args(typing.get_args(records.Record)[0])
    kinds = [typing.get_args(cls.model_fields["kind"].annotation)[0] for cls in union]
    assert sorted(kinds) == sorted(RecordKind)  # one class per kind, every kind a class
    for cls in union:
        name = cls.__name__
        assert name.endswith("Record"), name
        assert name in records.__all__, name


def test_a_job_s_latest_metrics_are_fields_of_its_records_with_their_types() -> None:
    own = {"step", "checkpoint_step"}
    assert set(LatestMetrics.model_fields) == STEP_LATEST | EVAL_LATEST | own
    for fields, cls in ((STEP_LATEST, StepRecord), (EVAL_LATEST, EvalRecord)):
        for name in fields:
            kept = LatestMetrics.model_fields[name].annotation
            assert kept == cls.model_fields[name].annotation, (name, cls.__name__)


def test_a_step_record_has_a_field_for_every_k_fac_phase() -> None:
    assert tuple(f"kfac_{phase}_ms" for phase in PHASES) == PHASE_FIELDS
    assert set(PHASE_FIELDS) <= set(StepRecord.model_fields)


# -- the dashboard ----------------------------------------------------------------------------

SCRIPTS = sorted((ROOT / "service" / "static").rglob("*.js"))
JS_STRING = re.compile(r"""(["'`])((?:\\.|(?!\1).)*)\1""")


@pytest.mark.parametrize(
    "closed",
    [JobState, TrialState, DistributedStrategy, ComputeMethod, KFACApprox, Precision, Unit],
    ids=lambda e: e.__name__,
)
def test_the_dashboard_keeps_no_copy_of_a_closed_set(closed: type[enum.Enum]) -> None:
    assert SCRIPTS, "no dashboard scripts found"
    for script in SCRIPTS:
        strings = {match.group(2) for match in JS_STRING.finditer(script.read_text())}
        copied = sorted(strings & {str(m.value) for m in closed if m not in ALSO_ANOTHER_WORD})
        assert not copied, f"{script.name} writes {copied} of {closed.__name__}: read /v1/registry"


FORM = ROOT / "service" / "static" / "js" / "form.js"
# A form input and the value it starts with: number("name", value, ...), text(...), or
# select("name", options, value).
VALUE = r"""(initial\("[^"]*"\)|[^,)]+)"""
FORM_INPUT = re.compile(
    rf"""\b(number|text)\("([\w.]+)",\s*{VALUE}|\bselect\("([\w.]+)",\s*[^,]+,\s*{VALUE}"""
)


def form_initial_values(script: str) -> dict[str, str]:
    """Each input of the form by its field, and the expression it starts from."""
    found = {}
    for match in FORM_INPUT.finditer(script):
        if match[1]:
            found[match[2]] = match[3].strip()
        else:
            found[match[4]] = match[5].strip()
    return found


# The model and the dataset have no default (a job must name them): the form prefers these
# from the registry's lists.
PREFERRED = {"model.name", "dataset.name"}


def test_every_field_of_the_form_starts_from_what_the_service_says() -> None:
    """Defaults from ``GET /v1/registry`` (the JobSpec's own, and the service's example where
    a job must give a value), none written in the dashboard's scripts."""
    initial = form_initial_values(FORM.read_text())
    assert {"optimizer.lr", "kfac.damping", "dataset.batch_size", "name"} <= set(initial)
    for field, expression in initial.items():
        if field in PREFERRED:
            continue
        assert expression == f'initial("{field}")', f"{field} starts from {expression}"


def test_the_check_sees_a_default_written_in_the_form() -> None:
    """The form as it was: its defaults written by hand."""
    old = (
        'number("optimizer.lr", 0.05)\n'
        'number("kfac.inv_update_steps", 50, { step: 1 })\n'
        'text("memory_budget", "2GiB"),\n'
        'select("kfac.strategy", strategies, sets.strategies[0])\n'
    )
    assert form_initial_values(old) == {
        "optimizer.lr": "0.05",
        "kfac.inv_update_steps": "50",
        "memory_budget": '"2GiB"',
        "kfac.strategy": "sets.strategies[0]",
    }


def test_the_registry_states_the_job_spec_s_defaults() -> None:
    from kaisa_train.reference import STARTER, field_defaults
    from kaisa_train.spec import KFACSpec, OptimizerSpec, parse_job_spec

    defaults = field_defaults()
    assert defaults["optimizer.lr"] == OptimizerSpec().lr
    assert defaults["kfac.damping"] == KFACSpec().damping
    assert defaults["kfac.strategy"] == KFACSpec().strategy
    assert "stop.max_steps" not in defaults  # no default: the starter's example
    # The starter's values with the defaults make a valid job (the form submits as it is).
    spec: dict[str, typing.Any] = {"model": {"name": "lenet"}, "dataset": {"name": "synthetic"}}
    for field, value in {**defaults, **STARTER}.items():
        if field.startswith(("sweep.", "stop.target.")):  # optional sections, off
            continue
        node = spec
        *sections, leaf = field.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    assert parse_job_spec(spec).optimizer.lr == OptimizerSpec().lr


# Fields of the records the page shows; the page names none of them, it reads them from the
# registry's metrics, charts and columns. Words the page uses for its own things are left out.
SHOWN_RECORDS = (StepRecord, EvalRecord, TrialRecord)
OWN_WORDS = {"kind", "seq", "time", "step", "epoch", "trial", "state", "params", "error"}
# The tuner's table and the intervals' chart show records of their own kinds, field by field.
RECORD_VIEWS = {"tuner.js", "intervals.js"}
JS_PROPERTY = re.compile(r"\.([A-Za-z_]\w*)\b")


def record_fields_written(script: str, fields: set[str]) -> set[str]:
    """The fields in ``fields`` a script writes, as a string or as a property it reads."""
    strings = {match.group(2) for match in JS_STRING.finditer(script)}
    code = JS_STRING.sub('""', script)  # "kfac.damping" is a string, not a property read
    properties = {match.group(1) for match in JS_PROPERTY.finditer(code)}
    return (strings | properties) & fields


def test_the_dashboard_names_no_field_of_the_records_it_charts() -> None:
    fields = set().union(*(cls.model_fields for cls in SHOWN_RECORDS)) - OWN_WORDS
    for script in SCRIPTS:
        if script.name in RECORD_VIEWS:
            continue
        written = record_fields_written(script.read_text(), fields)
        assert not written, f"{script.name} names {sorted(written)}: read the registry's metrics"


def test_the_check_sees_a_field_written_in_a_script() -> None:
    """The job list as it was: its accuracy column named two fields."""
    old = 'const accuracy = m.test_accuracy ?? m.accuracy;\nfor (const key of ["loss"]) {}\n'
    assert record_fields_written(old, {"test_accuracy", "accuracy", "loss", "lr"}) == {
        "test_accuracy",
        "accuracy",
        "loss",
    }


def test_every_metric_the_page_shows_is_a_field_of_its_record() -> None:
    from service.domain.metric_views import CHARTS, COLUMNS, METRICS, RECORD_CLASSES

    charts, columns = {c.id for c in CHARTS}, {c.id for c in COLUMNS}
    for metric in METRICS:
        assert metric.field in RECORD_CLASSES[metric.kind].model_fields, metric
        assert metric.chart is None or metric.chart in charts, metric
        assert metric.column is None or metric.column in columns, metric
    assert {m.chart for m in METRICS if m.chart} == charts  # every chart draws something
