"""The forecast's K-FAC terms (``tuner.forecast``, ``tuner.hardware``): what each is priced
from, its fallback when a profile lacks the measurement (marked as an estimate), the profile
fields that hold the measurements, and the operation counts behind the estimate of K-FAC's
fixed costs. How close each term comes to a timing of its operation is a benchmark
(``benchmarks/plan_check.py``), not a test."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from kaisa_train.planning import hardware_file
from kaisa_train.shapes import workload
from tuner.forecast import forecast_profile, precondition_seconds
from tuner.hardware import OVERHEAD_OPERATIONS, HardwareProfileError
from tuner.hardware_file import hardware_from_dict
from tuner.node_kfac import OVERHEAD_LAYERS, _tiny_kfac, _tiny_stack, _train_step

MEASURED = {"kind": "measured", "source": "measured here, for a test"}


def preset() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(hardware_file("a100-80gb-hdr").read_text())
    return data


def with_measurements() -> dict[str, Any]:
    data = copy.deepcopy(preset())
    gpu = data["gpu"]
    gpu["matmul_flops_per_s"]["tf32"] = [
        {"n": 64, "value": 2e12, **MEASURED},
        {"n": 4096, "value": 1.5e14, **MEASURED},
    ]
    gpu["decompose_s"] = {
        method: [
            {"n": 64, "count": 1, "value": 1e-3, **MEASURED},
            {"n": 4096, "count": 1, "value": 1e-1, **MEASURED},
            {"n": 64, "count": 8, "value": 1e-4, **MEASURED},
            {"n": 4096, "count": 2, "value": 5e-2, **MEASURED},
        ]
        for method in ("eigen", "inverse")
    }
    gpu["extract_elements_per_s"] = {"value": 2e9, **MEASURED}
    gpu["kfac_overhead_s"] = {
        "factors_per_layer": {"value": 2e-4, **MEASURED},
        "precondition_per_layer": {"value": 1e-4, **MEASURED},
        "precondition_per_group": {"value": 0.0, **MEASURED},
    }
    return data


def test_a_product_is_priced_at_the_square_size_of_its_volume() -> None:
    """``m × k`` by ``k × n``, ``batch`` of them: latency + 2·volume flops at the rate of the
    square product whose volume it has (K-FAC's tall ``XᵀX`` is not a small square)."""
    hw = hardware_from_dict(preset())
    latency = hw.kernel_latency_s.value
    for m, k, n, batch in ((147, 401_408, 147, 1), (64, 64, 576, 12), (1024, 32, 1024, 1)):
        volume = float(batch * m * k * n)
        expected = latency + 2 * volume / hw.matmul_rate(volume ** (1 / 3))
        assert hw.product_seconds(m, k, n, batch=batch) == pytest.approx(expected, rel=1e-12)
    tall = hw.product_seconds(147, 401_408, 147)
    # the old pricing: the same flops at the rate of a 147 x 147 square product
    assert tall < 2 * 147 * 401_408 * 147 / hw.matmul_rate(147) / 4


def test_tf32_rates_price_high_precision_products_only_where_measured() -> None:
    plain, measured = hardware_from_dict(preset()), hardware_from_dict(with_measurements())
    assert plain.product_precision("high") == "fp32"  # no tf32 table: fp32's rates
    assert measured.product_precision("high") == "tf32"
    assert measured.product_precision("medium") == "tf32"
    assert measured.product_precision("highest") == "fp32"
    job = workload("resnet50", batch_size=32)
    terms = " ".join(forecast_profile(job, plain, 1)[1].terms)
    assert "no tf32 rates, so they are priced at fp32's" in terms
    assert "tf32 matmul rates (measured)" in " ".join(forecast_profile(job, measured, 1)[1].terms)


def test_decompositions_come_from_the_measured_table_alone_or_batched() -> None:
    hw = hardware_from_dict(with_measurements())
    for method in ("eigen", "inverse"):
        assert hw.decomposition_seconds(method, 64, batched=False) == (1e-3, "measured")
        assert hw.decomposition_seconds(method, 64, batched=True) == (1e-4, "measured")
    # without the table: eigh of one matrix, or the n³ estimate of the inverse
    plain = hardware_from_dict(preset())
    seconds, kind = plain.decomposition_seconds("eigen", 1024, batched=True)
    assert seconds == plain.eigh_seconds(1024)
    assert kind == plain.eigh.kind
    seconds, kind = plain.decomposition_seconds("inverse", 1024, batched=False)
    assert kind == "estimate"
    assert seconds == pytest.approx(plain.matmul_seconds(1024.0**3, 1024))


def test_a_forecast_batches_the_decompositions_of_the_sizes_a_model_repeats() -> None:
    hw = hardware_from_dict(with_measurements())
    job = workload("resnet50", batch_size=32)
    profile, basis = forecast_profile(job, hw, 1)
    # ResNet-50's fc G factor (1000) is its size's only one; 64 appears many times
    assert (
        profile.decomposition.seconds(1000)
        == hw.decomposition_seconds("eigen", 1000, batched=False)[0]
    )
    assert profile.decomposition.seconds(64) == 1e-4
    assert "eigen decompositions: the profile's decompose_s table (measured)" in basis.terms


def test_without_measured_fixed_costs_they_are_counted_operations_at_the_latency() -> None:
    plain, measured = hardware_from_dict(preset()), hardware_from_dict(with_measurements())
    for name, count in OVERHEAD_OPERATIONS.items():
        assert plain.overhead(name) == (count * plain.kernel_latency_s.value, "estimate")
    assert measured.overhead("factors_per_layer") == (2e-4, "measured")
    assert measured.overhead("precondition_per_group") == (0.0, "measured")
    job = workload("lenet", batch_size=64, kfac_approx="reduce", compute_method="inverse")
    assert any(
        "estimate, operations counted" in t for t in forecast_profile(job, plain, 1)[1].terms
    )
    assert any(
        "the profile's kfac_overhead_s" in t for t in forecast_profile(job, measured, 1)[1].terms
    )


def test_factors_and_preconditioning_are_the_sums_of_their_terms() -> None:
    """LeNet (4 layers, 4 shapes): each term written out."""
    hw = hardware_from_dict(with_measurements())
    job = workload("lenet", batch_size=64, kfac_approx="reduce", compute_method="inverse")
    profile, _ = forecast_profile(job, hw, 1)
    factors = sum(
        hw.product_seconds(dim, rows, dim, batch=layer.groups, precision="tf32")
        for layer, (a_rows, g_rows) in zip(job.layers, job.rows, strict=True)
        for dim, rows in ((layer.a_dim, a_rows), (layer.g_dim, g_rows))
    )
    moved = sum(a + g for a, g in job.moved)
    assert moved > 0
    assert not hw.host_is_device  # a GPU: fixed costs overlap the device's arithmetic
    assert profile.factor_s == pytest.approx(max(factors + moved / 2e9, 4 * 2e-4), rel=1e-12)
    per_layer = precondition_seconds(job, hw)
    for layer, seconds in zip(job.layers, per_layer, strict=True):
        a, g = layer.a_dim, layer.g_dim
        products = hw.product_seconds(g, g, a, precision="tf32") + hw.product_seconds(
            g, a, a, precision="tf32"
        )
        assert seconds == pytest.approx(max(1e-4, products), rel=1e-12)
    assert profile.layer_precondition_s == per_layer


def test_a_shape_group_shares_its_batched_products() -> None:
    """ResNet-50's 54 layers are 21 shape groups: a group's layers each carry an equal share
    of one batched call (fewer latencies than layer by layer)."""
    hw = hardware_from_dict(preset())
    job = workload("resnet50", batch_size=32, compute_method="eigen")
    shares = precondition_seconds(job, hw)
    same = [s for x, s in zip(job.layers, shares, strict=True) if (x.a_dim, x.g_dim) == (576, 64)]
    assert len(same) == 3
    assert len(set(same)) == 1
    alone = hw.product_seconds(64, 64, 576) + hw.product_seconds(64, 576, 576)
    per_layer, _ = hw.overhead("precondition_per_layer")
    per_group, _ = hw.overhead("precondition_per_group")
    assert same[0] < max(per_layer + per_group, 2 * alone)


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        (
            "decompose_s",
            {"eigen": [{"n": 64, "count": 0, "value": 1.0, **MEASURED}]},
            "gpu.decompose_s.eigen[0].count: 0 must be a positive whole number",
        ),
        (
            "decompose_s",
            {"cholesky": [{"n": 64, "count": 1, "value": 1.0, **MEASURED}]},
            "gpu.decompose_s.cholesky: unknown method (expected eigen, inverse)",
        ),
        (
            "kfac_overhead_s",
            {"per_step": {"value": 1.0, **MEASURED}},
            "gpu.kfac_overhead_s.per_step: unknown",
        ),
        (
            "kfac_overhead_s",
            {"factors_per_layer": {"value": -1.0, **MEASURED}},
            "gpu.kfac_overhead_s.factors_per_layer.value: -1.0 must not be negative",
        ),
    ],
)
def test_bad_measurement_fields_are_named(field: str, value: Any, problem: str) -> None:
    data = preset()
    data["gpu"][field] = value
    with pytest.raises(HardwareProfileError) as raised:
        hardware_from_dict(data)
    assert any(p.startswith(problem) for p in raised.value.problems), raised.value.problems


def _operations(distinct: bool, every: int) -> int:
    """Top-level torch operations of one training step of a tiny stack (K-FAC quiet, or
    updating factors, or ``every`` 0: without K-FAC)."""
    torch.manual_seed(0)
    model = _tiny_stack(distinct)
    x = torch.randn(4, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    pre = _tiny_kfac(model, every)
    for _ in range(3):
        _train_step(model, x, optimizer, pre)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _train_step(model, x, optimizer, pre)
    if pre is not None:
        pre.remove_hooks()
    return len([e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None])


def test_the_estimated_fixed_costs_count_the_operations_this_code_runs() -> None:
    """``OVERHEAD_OPERATIONS`` against a count of the operations of K-FAC's steps on the tiny
    stacks ``measure-node`` times (the same differences): a change to the code that adds or
    removes many per-layer operations fails here until the counts are updated."""
    quiet, every = 10**9, 1
    same_quiet, distinct_quiet = _operations(False, quiet), _operations(True, quiet)
    per_group = (distinct_quiet - same_quiet) / (OVERHEAD_LAYERS - 1)
    per_layer = (same_quiet - _operations(False, 0) - per_group) / OVERHEAD_LAYERS
    factors = (_operations(True, every) - distinct_quiet) / OVERHEAD_LAYERS
    counted = {
        "factors_per_layer": factors,
        "precondition_per_layer": per_layer,
        "precondition_per_group": per_group,
    }
    for name, count in counted.items():
        assert count == pytest.approx(OVERHEAD_OPERATIONS[name], rel=0.25), (name, counted)


def test_on_a_cpu_fixed_costs_add_to_the_arithmetic() -> None:
    data = with_measurements()
    data["gpu"]["name"] = "CPU x86_64 (2 cores)"  # as measure-node --device cpu names it
    hw = hardware_from_dict(data)
    assert hw.host_is_device
    job = workload("lenet", batch_size=64, kfac_approx="reduce", compute_method="inverse")
    gpu_like = forecast_profile(job, hardware_from_dict(with_measurements()), 1)[0]
    cpu_like = forecast_profile(job, hw, 1)[0]
    assert cpu_like.factor_s > gpu_like.factor_s
    for cpu_s, gpu_s in zip(
        cpu_like.layer_precondition_s, gpu_like.layer_precondition_s, strict=True
    ):
        assert cpu_s > gpu_s


def test_factor_extraction_counts_the_elements_the_code_moves() -> None:
    """A convolution's reduce factors: its input's elements once per kernel row (the position
    sums) and its output gradient's; expand: the patch matrix (rows x a without the bias)."""
    reduce = workload("resnet20", batch_size=8, kfac_approx="reduce")
    expand = workload("resnet20", batch_size=8, kfac_approx="expand")
    stem = 0  # ResNet-20's first layer: a 3x3 convolution of the 3 x 32 x 32 image to 16 channels
    assert reduce.moved[stem] == (8 * 3 * 32 * 32 * 3, 8 * 16 * 32 * 32)
    assert expand.moved[stem] == (8 * 32 * 32 * 27, 8 * 16 * 32 * 32)
    without = hardware_from_dict(preset())
    terms = " ".join(forecast_profile(reduce, without, 1)[1].terms)
    assert "factor extraction (patches, position sums): not priced" in terms
    with_rate = forecast_profile(reduce, hardware_from_dict(with_measurements()), 1)
    assert "the profile's extract rate (measured)" in " ".join(with_rate[1].terms)


def with_host_step(host_s: float, cpu: bool = False) -> dict[str, Any]:
    """The measured profile with the host's time to issue ResNet-50's fp32 step."""
    data = with_measurements()
    if cpu:
        data["gpu"]["name"] = "CPU x86_64 (2 cores)"
    for entry in data["training"]:
        if entry["model"] == "resnet50" and entry["precision"] == "fp32":
            entry["host_step_s"] = {"value": host_s, **MEASURED}
    return data


def test_with_the_hosts_time_a_step_takes_the_longer_of_host_and_device() -> None:
    """The plain step is the longer of the host's time to issue it and the device's to run
    it; K-FAC's fixed costs (host) hide behind a device that is behind, its arithmetic does
    not, and each part is what the phase adds to the whole step."""
    from kaisa_ray.plan import plan
    from tuner.cost import price

    job = workload("resnet50", batch_size=64, compute_method="inverse", kfac_approx="reduce")
    without, _ = forecast_profile(job, hardware_from_dict(with_measurements()), 1)
    device_s = without.step_s  # 64 images at the preset's throughput
    assert without.host_step_s is None
    layers = plan(list(without.layers), 1, 1.0, compute_method="inverse")
    additive = price(without, layers, 10, 100)
    for host_s, device_bound in ((0.25 * device_s, True), (4.0 * device_s, False)):
        profile, basis = forecast_profile(job, hardware_from_dict(with_host_step(host_s)), 1)
        assert profile.host_step_s == pytest.approx(host_s)
        assert profile.device_step_s == pytest.approx(device_s)
        assert profile.step_s == pytest.approx(max(host_s, device_s))
        assert "the host issues it in" in basis.step_source
        assert 0 < profile.precondition_device_share < 1
        assert 0 < profile.factor_device_share <= 1
        candidate = price(profile, layers, 10, 100)
        added = sum(candidate.breakdown.values())
        assert candidate.step_s == pytest.approx(profile.step_s + added)
        if device_bound:  # the fixed costs hide: less than the parts added up
            assert added < sum(additive.breakdown.values())
            device = without.step_s + sum(
                additive.breakdown[k] * s
                for k, s in (
                    ("factors", profile.factor_device_share),
                    ("precondition", profile.precondition_device_share),
                    ("decompositions", 1.0),
                    ("communication", 1.0),
                )
            )
            assert candidate.step_s == pytest.approx(device)
        else:  # the host decides: every part in full, on top of the host's step
            assert candidate.breakdown == pytest.approx(additive.breakdown)
            assert candidate.step_s == pytest.approx(host_s + sum(additive.breakdown.values()))


def test_a_cpu_profile_adds_the_parts_whatever_host_time_it_holds() -> None:
    job = workload("resnet50", batch_size=8, compute_method="inverse", kfac_approx="reduce")
    profile, _ = forecast_profile(job, hardware_from_dict(with_host_step(1.0, cpu=True)), 1)
    assert profile.host_step_s is None
    assert profile.device_step_s is None


def test_a_host_step_without_its_source_is_refused_by_name() -> None:
    data = with_host_step(0.01)
    for entry in data["training"]:
        if "host_step_s" in entry:
            entry["host_step_s"] = {"value": 0.01}
    with pytest.raises(HardwareProfileError, match=r"training\[\d+\]\.host_step_s\.kind"):
        hardware_from_dict(data)


def test_a_models_measured_factor_work_replaces_the_estimate_at_its_batch_only() -> None:
    from tuner.forecast import factor_work_seconds

    data = with_measurements()
    work = {"value": 0.0123, **MEASURED}
    data["kernels"] = [
        {"model": "resnet20", "batch": 8, "kfac_approx": "reduce", "factor_work_s": work}
    ]
    hw = hardware_from_dict(data)
    reduce8 = workload("resnet20", batch_size=8, kfac_approx="reduce")
    assert factor_work_seconds(reduce8, hw) == 0.0123
    assert (
        "resnet20's own factor work at batch 8, reduce"
        in forecast_profile(reduce8, hw, 1)[1].terms[0]
    )
    for other in (
        workload("resnet20", batch_size=16, kfac_approx="reduce"),
        workload("resnet20", batch_size=8, kfac_approx="expand"),
    ):
        assert factor_work_seconds(other, hw) != 0.0123  # estimated from the rates
    data["kernels"][0]["kfac_approx"] = "sideways"
    with pytest.raises(HardwareProfileError, match=r"kernels\[0\]\.kfac_approx: 'sideways'"):
        hardware_from_dict(data)


def with_model_host(factors_s: float, precondition_s: float) -> dict[str, Any]:
    """The measured profile with ResNet-50's own K-FAC host costs (``kfac_host_s``)."""
    data = with_measurements()
    data["kfac_host_s"] = [
        {"model": "resnet50", "phase": "factors", "kfac_approx": "reduce"}
        | {"value": factors_s, **MEASURED},
        {"model": "resnet50", "phase": "precondition", "compute_method": "inverse"}
        | {"value": precondition_s, **MEASURED},
    ]
    return data


def test_a_models_own_host_costs_replace_the_stand_ins_for_that_model_and_variant() -> None:
    """Where ``measure-node --model`` timed K-FAC's host costs on the model itself, the
    forecast's fixed costs are those (a factor update: the measured seconds; preconditioning:
    shared equally by the layers) instead of the tiny stand-in's per layer; another method,
    approximation, scaling or model keeps the stand-in's."""
    from tuner.forecast import factor_seconds, group_products

    stand_in = hardware_from_dict(with_measurements())
    own = hardware_from_dict(with_model_host(3e-3, 1.08e-3))
    job = workload("resnet50", batch_size=32, compute_method="inverse", kfac_approx="reduce")
    layers = len(job.layers)
    assert layers == 54
    work = 1e-9  # the products negligible beside the fixed costs: max() picks the fixed
    assert factor_seconds(job, own, work) == pytest.approx(3e-3)
    assert factor_seconds(job, stand_in, work) == pytest.approx(2e-4 * layers)
    profile, basis = forecast_profile(job, own, 1)
    fixed = 1.08e-3 / layers  # each layer's share; on a GPU a share is the longer of the two
    groups = group_products(job, own)
    for x, share in zip(job.layers, profile.layer_precondition_s, strict=True):
        seconds, count = groups[(x.a_dim, x.g_dim, x.groups, x.diagonal_a)]
        assert share == pytest.approx(max(seconds / count, fixed))
    assert profile.layer_precondition_s != precondition_seconds(job, stand_in)
    assert "resnet50's own, timed on one-sample steps" in " ".join(basis.terms)
    for other in (
        workload("resnet50", batch_size=32, compute_method="eigen", kfac_approx="reduce"),
        workload("resnet50", batch_size=32, compute_method="eigen", scaling="adam-eigenbasis"),
    ):
        assert precondition_seconds(other, own) == precondition_seconds(other, stand_in)
    expand = workload("resnet50", batch_size=32, compute_method="inverse", kfac_approx="expand")
    assert factor_seconds(expand, own, work) == factor_seconds(expand, stand_in, work)
    lenet = workload("lenet", batch_size=32, compute_method="inverse", kfac_approx="reduce")
    mine, theirs = forecast_profile(lenet, own, 1)[0], forecast_profile(lenet, stand_in, 1)[0]
    assert (mine.factor_s, mine.layer_precondition_s) == (
        theirs.factor_s,
        theirs.layer_precondition_s,
    )


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"model": "resnet50", "phase": "inverse", "value": 1e-3}, "kfac_host_s[0].phase:"),
        (
            {"model": "resnet50", "phase": "factors", "compute_method": "eigen", "value": 1e-3},
            "kfac_host_s[0].kfac_approx: None is not one of",
        ),
        (
            {"model": "resnet50", "phase": "precondition", "compute_method": "x", "value": 1e-3},
            "kfac_host_s[0].compute_method: 'x' is not one of eigen, inverse",
        ),
        (
            {"model": "resnet50", "phase": "factors", "kfac_approx": "reduce", "value": -1.0},
            "kfac_host_s[0].value: -1.0 must not be negative",
        ),
        (
            {"model": "resnet50", "phase": "factors", "kfac_approx": "reduce", "valu": 1.0},
            "kfac_host_s[0]: unknown field(s) valu",
        ),
    ],
)
def test_a_bad_model_host_cost_is_named(entry: dict[str, Any], problem: str) -> None:
    data = with_measurements()
    data["kfac_host_s"] = [entry | MEASURED]
    with pytest.raises(HardwareProfileError) as raised:
        hardware_from_dict(data)
    assert any(p.startswith(problem) for p in raised.value.problems), raised.value.problems


def test_steady_seconds_runs_its_calls_back_to_back_after_one_warm_up() -> None:
    from tuner.measure import steady_seconds

    calls: list[int] = []
    seconds = steady_seconds(lambda: calls.append(1), torch.device("cpu"), 7)
    assert len(calls) == 8
    assert seconds >= 0


@pytest.mark.parametrize("steady", [False, True])
def test_the_models_own_host_costs_are_timed_on_the_model(steady: bool) -> None:
    """``model_kfac_host`` (what ``measure-node --model`` runs on a GPU) on LeNet on this CPU:
    an entry per method and per approximation, each a measured, non-negative difference of
    whole steps, that the profile's loader takes; the model keeps no hook."""
    from kaisa_train.plan_cli import _model_to_time
    from tuner.node_kfac import model_kfac_host

    timed = _model_to_time("lenet:8")
    entries = model_kfac_host(timed, torch.device("cpu"), 3, "this test's CPU", steady=steady)
    keys = {(e["phase"], e.get("compute_method") or e.get("kfac_approx")) for e in entries}
    assert keys == {
        ("precondition", "eigen"),
        ("precondition", "inverse"),
        ("factors", "reduce"),
        ("factors", "expand"),
    }
    assert all(e["value"] >= 0 and e["kind"] == "measured" for e in entries)
    data = with_measurements()
    data["kfac_host_s"] = entries
    hw = hardware_from_dict(data)
    assert hw.model_host("lenet", "factors", "expand") is not None


def test_an_embeddings_diagonal_a_is_priced_without_a_solver_or_a_product_on_its_side() -> None:
    """An embedding's A is decomposed from its diagonal and its basis is the identity
    (``kaisa_ray.decomposition``): the plan prices no solver for it and only G's side of
    its preconditioning, in a shape group apart from dense layers of its shape."""
    from tuner.cost import _layer_seconds, precondition_flops
    from tuner.forecast import group_products

    hw = hardware_from_dict(preset())
    job = workload("char-transformer", batch_size=32, compute_method="eigen", embeddings=True)
    tokens = next(x for x in job.layers if x.name == "tokens")
    assert tokens.diagonal_a
    assert (tokens.a_dim, tokens.g_dim) == (256, 64)
    assert not any(x.diagonal_a for x in job.layers if x.name not in ("tokens", "positions"))
    seconds, count = group_products(job, hw)[(256, 64, 1, True)]
    assert count == 1
    assert seconds == 2 * hw.product_seconds(64, 64, 256)  # eigen: into the basis and back
    assert precondition_flops(tokens, "eigen") == 2 * (2.0 * 64 * 256 * 64)
    profile, _ = forecast_profile(job, hw, 1)
    priced = {x.name: x for x in _layer_seconds(profile)}
    assert priced["tokens"].a_s == 0.0
    assert priced["tokens"].g_s == profile.decomposition.seconds(64) > 0
    assert priced["head"].a_s > 0  # a dense A of the same model
