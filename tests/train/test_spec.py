"""JobSpec: valid jobs load from YAML and JSON; bad ones name every bad field and the fix."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from kaisa_train.registry import (
    BUILTIN_MODELS,
    builtin_model_reference,
    dataset_entry,
    model_factory,
)
from kaisa_train.spec import JobSpec, JobSpecError, KFACSpec, load_job_spec, parse_job_spec
from kaisa_train.spec.model_params import checker_of, constructor_params, source_constructor

GOOD: dict[str, Any] = {
    "name": "fashion-kfac",
    "model": {"name": "lenet"},
    "dataset": {"name": "synthetic", "batch_size": 64},
    "optimizer": {"name": "sgd", "lr": 0.05},
    "kfac": {"strategy": "hybrid-opt", "factor_update_steps": 5, "inv_update_steps": 50},
    "memory_budget": "2GiB",
    "scaling": {"workers": 2},
    "stop": {"max_steps": 100, "target": {"metric": "test_accuracy", "value": 0.88}},
}


def with_(**changes: Any) -> dict[str, Any]:
    spec = json.loads(json.dumps(GOOD))
    spec.update(changes)
    return spec


def test_a_good_spec_loads_from_yaml_and_json(tmp_path: Path) -> None:
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text(
        "name: fashion-kfac\nmodel: {name: lenet}\ndataset: {name: synthetic, batch_size: 64}\n"
        "optimizer: {name: sgd, lr: 0.05}\n"
        "kfac: {strategy: hybrid-opt, factor_update_steps: 5, inv_update_steps: 50}\n"
        "memory_budget: 2GiB\nscaling: {workers: 2}\n"
        "stop: {max_steps: 100, target: {metric: test_accuracy, value: 0.88}}\n"
    )
    json_file = tmp_path / "job.json"
    json_file.write_text(json.dumps(GOOD))
    from_yaml, from_json = load_job_spec(yaml_file), load_job_spec(json_file)
    assert from_yaml == from_json
    assert from_yaml.memory_budget == 2 * 2**30
    assert isinstance(from_yaml.kfac, KFACSpec)
    assert from_yaml.kfac.strategy == "hybrid-opt"


def test_every_bad_field_is_named_at_once() -> None:
    bad = with_(
        model={"name": "resnet-9000"},
        memory_budget="lots",
        scaling={"workers": 0},
        optimizer={"name": "sgd", "lr": -1, "momentum": 0.9},
        colour="blue",
    )
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(bad)
    problems = "\n".join(caught.value.problems)
    assert len(caught.value.problems) == 5
    assert (
        "model.name: unknown model 'resnet-9000'; choose one of bert-large, char-transformer, "
        "lenet, mlp, resnet20, resnet50, wide-mlp" in problems
    )
    assert "memory_budget:" in problems
    assert "write a size such as '2GiB'" in problems
    assert "scaling.workers: Input should be greater than 0" in problems
    assert "optimizer.lr: Input should be greater than 0" in problems
    assert "colour: unknown field" in problems


def test_missing_data_directory_says_how_to_install(tmp_path: Path) -> None:
    bad = with_(dataset={"name": "fashion-mnist", "data_dir": str(tmp_path / "nowhere")})
    with pytest.raises(
        JobSpecError,
        match=r"dataset: .*does not exist: apt-get install "
        r"dataset-fashion-mnist",
    ):
        parse_job_spec(bad)
    with pytest.raises(JobSpecError, match=r"dataset 'mnist' needs data_dir"):
        parse_job_spec(with_(dataset={"name": "mnist"}))


def test_strategy_must_fit_the_workers_and_auto_is_a_strategy() -> None:
    with pytest.raises(
        JobSpecError,
        match=r"kfac.strategy does not fit scaling.workers: .*"
        r"valid values for world size 3",
    ):
        parse_job_spec(with_(scaling={"workers": 3}))
    auto = parse_job_spec(with_(kfac="auto", scaling={"workers": 3}))
    assert isinstance(auto.kfac, KFACSpec)
    assert auto.kfac.strategy == "auto"  # any worker count: the tuner picks a valid f
    capped = parse_job_spec(with_(kfac={"strategy": "auto", "max_overhead": 0.5}))
    assert isinstance(capped.kfac, KFACSpec)
    assert capped.kfac.max_overhead == 0.5
    assert parse_job_spec(with_(kfac="off")).kfac == "off"


@pytest.mark.parametrize(
    ("change", "what", "fix"),
    [
        (
            {"kfac": {"update": "quadratic-model", "factor_update_steps": 1}},
            "kfac.update: quadratic-model",
            "kfac.update: optimizer",
        ),
        ({"precision": "fp16"}, "precision: fp16", "precision: bf16 or fp32"),
    ],
)
def test_what_a_sharded_job_does_not_run_yet_is_refused_with_the_fix(
    change: dict[str, Any], what: str, fix: str
) -> None:
    sharded = {"workers": 2, "parallel": "fsdp"}
    assert parse_job_spec(with_(scaling=sharded)).scaling.parallel == "fsdp"
    auto = parse_job_spec(with_(scaling=sharded, kfac="auto")).kfac  # profiled sharded
    assert parse_job_spec(with_(scaling=sharded)).scaling.shard_units == "layers"
    blocks = parse_job_spec(with_(scaling=sharded | {"shard_units": "blocks"})).scaling
    assert blocks.shard_units == "blocks"
    with pytest.raises(JobSpecError, match="shard_units: model says how FSDP2 shards"):
        parse_job_spec(with_(scaling={"workers": 2, "shard_units": "model"}))
    assert isinstance(auto, KFACSpec)
    assert auto.auto
    assert parse_job_spec(GOOD).scaling.parallel == "ddp"
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(with_(scaling=sharded, **change))
    message = str(caught.value)
    assert f"scaling.parallel: fsdp does not run with {what}" in message
    assert f"set {fix}, or scaling.parallel: ddp" in message
    with pytest.raises(JobSpecError, match=r"scaling.parallel.*'ddp' or 'fsdp'"):
        parse_job_spec(with_(scaling={"workers": 2, "parallel": "zero3"}))


def test_cuda_graphs_need_gpu_workers_and_reach_the_preconditioner() -> None:
    graphs = {**GOOD["kfac"], "cuda_graphs": True}
    with pytest.raises(JobSpecError, match=r"scaling.gpus_per_worker is 0: give each worker a GPU"):
        parse_job_spec(with_(kfac=graphs))
    spec = parse_job_spec(with_(kfac=graphs, scaling={"workers": 2, "gpus_per_worker": 1}))
    assert isinstance(spec.kfac, KFACSpec)
    assert spec.kfac.preconditioner_options()["cuda_graphs"] is True
    plain = parse_job_spec(GOOD).kfac
    assert isinstance(plain, KFACSpec)
    assert plain.preconditioner_options()["cuda_graphs"] is False


def test_tuner_options_need_auto_and_intervals_must_nest() -> None:
    tuned = parse_job_spec(
        with_(kfac={"strategy": "auto", "intervals": [[1, 10], [5, 50]], "verify": 2})
    )
    assert isinstance(tuned.kfac, KFACSpec)
    assert tuned.kfac.ladder() == [(1, 10), (5, 50)]
    assert tuned.kfac.verify == 2
    assert KFACSpec(strategy="auto").ladder() is None  # the tuner's own ladder
    # Workers read the spec back from its JSON dump, where every field is set.
    for spec in (parse_job_spec(GOOD), tuned):
        assert parse_job_spec(spec.model_dump(mode="json")) == spec
    with pytest.raises(JobSpecError, match=r"kfac.*verify only for strategy: auto.*remove it"):
        parse_job_spec(with_(kfac={"strategy": "comm-opt", "verify": 2}))
    with pytest.raises(JobSpecError, match=r"kfac.intervals.*\[3, 10\].*use e.g. \[3, 9\]"):
        parse_job_spec(with_(kfac={"strategy": "auto", "intervals": [[3, 10]]}))
    with pytest.raises(JobSpecError, match=r"kfac.intervals"):
        parse_job_spec(with_(kfac={"strategy": "auto", "intervals": []}))
    with pytest.raises(JobSpecError, match=r"kfac.verify"):
        parse_job_spec(with_(kfac={"strategy": "auto", "verify": -1}))


def test_auto_adapts_its_intervals_only_when_asked() -> None:
    fixed = parse_job_spec(with_(kfac="auto"))  # opt-in: adapted intervals measured slower
    assert isinstance(fixed.kfac, KFACSpec)
    assert not fixed.kfac.adaptive
    adaptive = parse_job_spec(with_(kfac={"strategy": "auto", "adapt": True}))
    assert isinstance(adaptive.kfac, KFACSpec)
    assert adaptive.kfac.adaptive
    assert adaptive.kfac.staleness_target == 15.0
    for kfac in ({"strategy": "auto", "adapt": False}, {"strategy": "auto", "verify": 2}):
        chosen = parse_job_spec(with_(kfac=kfac))
        assert isinstance(chosen.kfac, KFACSpec)
        assert not chosen.kfac.adaptive
    assert not KFACSpec().adaptive  # a fixed strategy
    tuned = parse_job_spec(with_(kfac={"strategy": "auto", "adapt": True, "staleness_target": 5}))
    assert parse_job_spec(tuned.model_dump(mode="json")) == tuned
    with pytest.raises(JobSpecError, match=r"kfac.*adapt, staleness_target only for strategy"):
        parse_job_spec(with_(kfac={"strategy": "comm-opt", "adapt": True, "staleness_target": 5}))
    with pytest.raises(JobSpecError, match=r"kfac.*verify measures candidates with fixed"):
        parse_job_spec(with_(kfac={"strategy": "auto", "adapt": True, "verify": 2}))
    not_nested = {"strategy": "auto", "intervals": [[2, 10], [3, 30]]}
    with pytest.raises(
        JobSpecError, match=r"kfac.*\(2, 10\) and \(3, 30\) do not nest.*adapt: false"
    ):
        parse_job_spec(with_(kfac={**not_nested, "adapt": True}))
    assert isinstance(parse_job_spec(with_(kfac=not_nested)).kfac, KFACSpec)  # one pair: fine
    with pytest.raises(JobSpecError, match=r"kfac.staleness_target"):
        parse_job_spec(with_(kfac={"strategy": "auto", "staleness_target": 90}))
    measured = parse_job_spec(with_(kfac={"strategy": "comm-opt", "measure_staleness": True}))
    assert isinstance(measured.kfac, KFACSpec)
    assert measured.kfac.measure_staleness


def test_stop_needs_exactly_one_limit() -> None:
    with pytest.raises(JobSpecError, match=r"stop: give exactly one of max_steps and max_epochs"):
        parse_job_spec(with_(stop={"max_steps": 10, "max_epochs": 1}))


def test_an_optimizer_only_a_plan_prices_is_refused_naming_those_a_job_trains_with() -> None:
    with pytest.raises(JobSpecError) as refused:
        parse_job_spec(with_(optimizer={"name": "lamb"}))
    assert (
        "optimizer.name: optimizer lamb is priced by kaisa-ray plan but no job here trains with "
        "it: name one of sgd, adam, adamw, soap, muon, psgd-kron (adamw is the closest)"
    ) in str(refused.value)


def test_files_that_are_not_specs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match=r"does not exist"):
        load_job_spec(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(JobSpecError, match=r"not valid YAML"):
        load_job_spec(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(JobSpecError, match=r"expected a mapping of fields, got list"):
        load_job_spec(listing)


def test_registries_build_what_a_spec_names() -> None:
    spec = JobSpec.model_validate(GOOD)
    model = model_factory(spec.model.name)(**spec.model.params)
    entry = dataset_entry(spec.dataset.name)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert not entry.needs_files


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_a_built_in_models_parameters_read_from_its_source_are_its_constructors(name: str) -> None:
    """What the spec checks a built-in model's ``params`` against without importing torch
    (its constructor read from the source) is what the imported class's constructor takes:
    every name, annotation with its bounds, and default."""
    reference = builtin_model_reference(name)
    assert reference is not None
    from_source = source_constructor(reference)
    assert from_source is not None, f"{reference}'s constructor could not be read torch-free"
    imported = model_factory(name).__init__  # type: ignore[misc]
    assert inspect.signature(from_source) == inspect.signature(imported)
    # The checks built from each: the same fields, types, bounds and defaults.
    schema = checker_of(name, from_source).model_json_schema()
    assert schema == checker_of(name, imported).model_json_schema()
    assert schema == constructor_params(name).model_json_schema()


def test_a_constructor_the_source_cannot_give_is_read_from_the_imported_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``__init__`` of its own, or an annotation that needs the module itself: no stub
    (the spec imports the class instead, as for a plugin)."""
    (tmp_path / "own_models.py").write_text(
        "from __future__ import annotations\n"
        "import torch\n"
        "from torch import nn\n"
        "class Bare(nn.Linear):\n"
        "    pass\n"
        "class Typed(nn.Module):\n"
        "    def __init__(self, like: torch.dtype = torch.float32, width: int = 4) -> None:\n"
        "        super().__init__()\n"
        "class Plain(nn.Module):\n"
        "    def __init__(self, width: int = 4) -> None:\n"
        "        super().__init__()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert source_constructor("own_models:Bare") is None
    assert source_constructor("own_models:Typed") is None
    plain = source_constructor("own_models:Plain")
    assert plain is not None
    assert list(inspect.signature(plain).parameters) == ["self", "width"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"dataset": {"name": "synthetic", "batch_size": True}}, "dataset.batch_size"),
        ({"kfac": {"strategy": True}}, "kfac.strategy"),  # was read as the fraction 1.0
        ({"memory_budget": False}, "memory_budget"),
        ({"model": {"name": "mlp", "params": {"hidden": [True]}}}, "model.params.hidden"),
        (
            {"kfac": "auto", "sweep": {"space": {"optimizer.lr": {"choice": [0.1, True]}}}},
            "sweep.space.optimizer.lr.choice",
        ),
    ],
)
def test_a_boolean_is_not_a_number(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(with_(**changes))
    assert len(caught.value.problems) == 1, caught.value.problems
    assert caught.value.problems[0].startswith(f"{field}: ")
    assert "boolean where a number belongs" in caught.value.problems[0]
    assert "(1, not true)" in caught.value.problems[0]
    # Where a boolean belongs, it is one.
    spec = parse_job_spec(with_(kfac={"strategy": "comm-opt", "pi_damping": False}))
    assert isinstance(spec.kfac, KFACSpec)
    assert spec.kfac.pi_damping is False


def test_a_reversed_sweep_range_is_refused_with_the_order_to_write() -> None:
    sweep = {"space": {"optimizer.lr": {"uniform": [1, 0.001]}}}
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(with_(kfac="auto", sweep=sweep))
    [problem] = caught.value.problems
    assert problem.startswith("sweep.space.optimizer.lr: ")
    assert "[1, 0.001] of uniform is reversed" in problem
    assert "[0.001, 1]" in problem
    sweep["space"]["optimizer.lr"] = {"loguniform": [0.001, 1]}
    assert parse_job_spec(with_(kfac="auto", sweep=sweep)).sweep is not None


def test_kfac_off_as_typed_in_yaml_is_off(tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML) reads ``kfac: off`` and ``kfac: no`` as false: that is K-FAC off, as
    the user wrote; ``kfac: on`` (true) is no setting and says what to write."""
    for word in ("off", "no", "false", '"off"'):
        path = tmp_path / f"{word.strip(chr(34))}.yaml"
        path.write_text(json.dumps(with_(kfac=None)).replace("null", word))
        assert load_job_spec(path).kfac == "off"
    path = tmp_path / "on.yaml"
    path.write_text(json.dumps(with_(kfac=None)).replace("null", "on"))
    with pytest.raises(JobSpecError) as caught:
        load_job_spec(path)
    [problem] = caught.value.problems
    assert "kfac: true (YAML reads on and yes as true) is not a setting" in problem
    assert "kfac: off" in problem
