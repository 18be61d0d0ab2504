"""Hardware profiles (every number sourced, bad files named field by field) and the topology
that prices each collective by the nodes its group spans. Pure and fast."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from kaisa_ray.assignment import LayerShape
from kaisa_ray.plan import plan
from kaisa_train.planning import HARDWARE_DIR, hardware_names, load_hardware
from tuner.choice import choose
from tuner.cost import CubicFit, LinkFit, Profile
from tuner.hardware import KINDS, HardwareProfileError, LinkLevel, Sourced
from tuner.hardware_file import hardware_from_dict
from tuner.topology import Topology

PRESETS = ["a100-80gb-hdr", "h100-80gb-ndr"]


def raw(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((HARDWARE_DIR / f"{name}.yaml").read_text())
    return data


def numbers(node: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Every number in a parsed profile, with the mapping it sits in (None: a bare number)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                found.append((f"{path}.{key}", value, node))
            else:
                found += numbers(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if isinstance(value, int | float):
                found.append((f"{path}[{i}]", value, None))
            else:
                found += numbers(value, f"{path}[{i}]")
    return found


def test_the_presets_are_listed() -> None:
    assert set(PRESETS) <= set(hardware_names())


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_number_carries_its_source(name: str) -> None:
    data = raw(name)
    found = numbers(data)
    assert len(found) > 40
    for path, _value, holder in found:
        if path.endswith((".n", ".seq_len")):  # the sizes a number is given at, not numbers
            continue
        assert holder is not None, f"{path} is a bare number"
        assert holder["kind"] in KINDS, path
        assert len(holder["source"]) > 20, f"{path} has no real source: {holder['source']!r}"
        if holder["kind"] == "estimate":  # an estimate says what it rests on
            assert any(
                w in holder["source"] for w in ("assum", "x ", "/ ", "as ", "estimate", "taken")
            ), f"{path}: {holder['source']}"
        if holder["kind"] == "benchmark":  # a published measurement is cited
            assert "github.com" in holder["source"] or "README" in holder["source"], path
    hardware = load_hardware(name)
    assert hardware.name == name
    assert hardware.node_size == 8
    assert hardware.memory_bytes.value == 80 * 2**30
    # The loader keeps each number's source, by path, for plans to report.
    assert len(hardware.sources) == len([p for p in found if not p[0].endswith((".n", ".seq_len"))])


def test_a100_figures_are_the_cited_ones() -> None:
    a100 = load_hardware("a100-80gb-hdr")
    assert a100.intra_node.allreduce_busbw.value == 232.54e9  # nccl-tests issue 175
    assert a100.inter_node.allreduce_busbw.value == 192e9  # nccl issue 812
    rate = a100.training_rate("resnet50", "fp32")
    assert rate is not None
    assert rate.samples_per_s.value == 938
    bert = a100.training_rate("bert-large", "fp16", seq_len=128)
    assert bert is not None
    assert bert.samples_per_s.value == 580
    long = a100.training_rate("bert-large", "fp16", seq_len=512)
    assert long is not None
    assert long.samples_per_s.value == 210


def test_size_tables_interpolate_log_log_and_extend_as_they_should() -> None:
    a100 = load_hardware("a100-80gb-hdr")
    assert a100.eigh_seconds(4096) == pytest.approx(0.3187)
    # between two listed sizes: on the power law through them
    low, high = a100.eigh_seconds(2048), a100.eigh_seconds(4096)
    slope = math.log(high / low) / math.log(2)
    assert a100.eigh_seconds(3000) == pytest.approx(low * (3000 / 2048) ** slope, rel=1e-9)
    assert a100.eigh_seconds(16384) > a100.eigh_seconds(8192) * 7  # a time keeps growing
    assert a100.matmul_rate(16384) == a100.matmul_rate(4096)  # a rate levels off
    assert a100.matmul_rate(8) == a100.matmul_rate(64)


def invalid(data: dict[str, Any]) -> str:
    with pytest.raises(HardwareProfileError) as err:
        hardware_from_dict(data, "test profile")
    return str(err.value)


def test_a_bare_number_is_refused_with_the_format_to_use() -> None:
    data = raw("a100-80gb-hdr")
    data["gpu"]["memory_bytes"] = 85899345920
    message = invalid(data)
    assert "gpu.memory_bytes: a number needs its source" in message
    assert "{value: <number>, kind: <datasheet|benchmark|measured|estimate>" in message


def test_every_bad_field_is_named_at_once() -> None:
    data = raw("h100-80gb-ndr")
    data["links"]["inter_node"]["latency_s"]["source"] = ""
    data["links"]["intra_node"]["allreduce_busbw"]["kind"] = "guess"
    data["gpu"]["eigh_s"][0]["value"] = -1
    data["gpu"]["matmul_flops_per_s"]["fp8"] = []
    del data["links"]["intra_node"]["broadcast_busbw"]
    message = invalid(data)
    assert "(5 problem(s))" in message
    assert "links.inter_node.latency_s.source: every number says where it comes from" in message
    assert "links.intra_node.allreduce_busbw.kind: 'guess' is not one of" in message
    assert "gpu.eigh_s[0].value: -1 must be positive" in message
    assert "gpu.matmul_flops_per_s.fp8: unknown precision" in message
    assert "links.intra_node.broadcast_busbw: a number needs its source" in message


def test_an_unknown_preset_lists_the_presets(tmp_path: Path) -> None:
    from kaisa_ray.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"unknown hardware 'v100'.*a100-80gb-hdr"):
        load_hardware("v100")
    broken = tmp_path / "node.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ConfigurationError, match="not valid YAML"):
        load_hardware(broken)
    copied = tmp_path / "copy.yaml"
    data = copy.deepcopy(raw("a100-80gb-hdr"))
    data["name"] = "copy"
    copied.write_text(yaml.safe_dump(data))
    assert load_hardware(copied).name == "copy"


TOPOLOGY = Topology.of(load_hardware("a100-80gb-hdr"))


def test_a_group_inside_a_node_runs_on_nvlink() -> None:
    group = tuple(range(8))
    assert TOPOLOGY.span(group) == (1, 8)
    assert TOPOLOGY.bandwidth("all_reduce", group) == 232.54e9
    # nccl-tests' model: latency + 2(p-1)/p · S / busbw
    expected = 1e-5 + 2 * 7 / 8 * 2**30 / 232.54e9
    assert TOPOLOGY.seconds("all_reduce", group, 2**30) == pytest.approx(expected, rel=1e-12)
    assert TOPOLOGY.seconds("broadcast", group, 2**30) == pytest.approx(1e-5 + 2**30 / 195.1e9)
    assert TOPOLOGY.seconds("broadcast", (3,), 2**30) == 0.0  # nobody to send to


def test_whole_nodes_share_all_adapters_and_a_column_gets_one() -> None:
    whole = tuple(range(64))  # 8 full nodes
    column = tuple(range(0, 64, 8))  # one rank on each of the 8 nodes: KAISA's column at f=1/8
    assert TOPOLOGY.bandwidth("all_reduce", whole) == 192e9
    assert TOPOLOGY.span(column) == (8, 1)
    assert TOPOLOGY.bandwidth("broadcast", column) == pytest.approx(192e9 / 8)
    slower = TOPOLOGY.seconds("broadcast", column, 2**28)
    faster = TOPOLOGY.seconds("broadcast", tuple(range(8)), 2**28)
    assert slower == pytest.approx(4.6e-5 + 2**28 / 24e9)
    assert slower > 7 * faster


def test_kaisas_grid_at_a_node_sized_fraction_keeps_gradients_on_nvlink() -> None:
    layers = [LayerShape(name=f"l{i}", a_dim=1025, g_dim=1024) for i in range(16)]
    strategy = plan(layers, 64, 1 / 8)
    rows = strategy.assignment.receiver_groups()
    columns = strategy.assignment.worker_groups()
    assert all(TOPOLOGY.span(row)[0] == 1 for row in rows)  # gradient broadcasts in a node
    assert all(TOPOLOGY.span(col) == (8, 1) for col in columns)  # decompositions across nodes


def profile(topology: Topology | None, world: int) -> Profile:
    slow = LinkFit(latency_s=1e-4, bytes_per_s=1e9)
    return Profile(
        world_size=world,
        layers=tuple(LayerShape(name=f"l{i}", a_dim=1025, g_dim=1024) for i in range(16)),
        base_memory_bytes=2**30,
        step_s=0.1,
        factor_s=0.05,
        decomposition=CubicFit(c0=1e-3, c3=1e-11),
        precondition_s_per_flop=1e-13,
        allreduce=slow,
        broadcast=slow,
        topology=topology,
    )


def ethernet(gpus_per_node: int) -> Topology:
    """NVLink inside a node, one 100 Gb/s Ethernet link per node between nodes."""

    def sourced(value: float) -> Sourced:
        return Sourced(value=value, kind="estimate", source="a test network")

    hardware = load_hardware("a100-80gb-hdr")
    between = LinkLevel(
        latency_s=sourced(5e-5), allreduce_busbw=sourced(12.5e9), broadcast_busbw=sourced(12.5e9)
    )
    return Topology(gpus_per_node=gpus_per_node, intra_node=hardware.intra_node, inter_node=between)


def test_the_span_of_a_group_changes_the_tuners_choice() -> None:
    """Sixteen GPUs in one node or over two with a slow link between them: MEM-OPT's
    every-step gradient broadcast spans all sixteen, so across nodes the fraction whose
    receiver rows stay inside a node (f = 1/8: rows of 8) wins instead."""
    one_node = choose(profile(ethernet(16), 16), None).chosen
    two_nodes = choose(profile(ethernet(8), 16), None).chosen
    assert one_node.grad_worker_fraction == 1 / 16
    assert two_nodes.grad_worker_fraction == 1 / 8
    table = choose(profile(ethernet(8), 16), None).candidates
    slowest = max(table, key=lambda c: c.breakdown["communication"])
    assert slowest.grad_worker_fraction == 1 / 16  # its broadcast crosses the slow link
    # Without a topology the measured α–β fits price every call the same, as before.
    flat = choose(profile(None, 16), None).chosen
    assert flat.breakdown["communication"] > two_nodes.breakdown["communication"]
