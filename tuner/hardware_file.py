"""Hardware profiles read from a parsed file (``hardware_from_dict``): every field checked, and
every bad one named with what to write instead (the model itself is ``tuner.hardware``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, cast

from kaisa_ray.enums import Precision
from tuner.hardware import (
    APPROACHES,
    KINDS,
    METHODS,
    OVERHEAD_OPERATIONS,
    PRECISIONS,
    PRODUCT_PRECISIONS,
    Hardware,
    HardwareProfileError,
    LinkLevel,
    SizeTable,
    Sourced,
    TrainingRate,
)


def _number(data: Any, path: str, problems: list[str], *, positive: bool = True) -> Sourced | None:
    hint = f"write it as {{value: <number>, kind: <{'|'.join(KINDS)}>, source: <where from>}}"
    if not isinstance(data, Mapping):
        problems.append(f"{path}: a number needs its source; {hint}")
        return None
    unknown = sorted(
        set(data) - {"value", "kind", "source", "n", "count", "model", "precision", "seq_len"}
    )
    if unknown:
        problems.append(f"{path}: unknown field(s) {', '.join(unknown)}; {hint}")
    value, kind, source = data.get("value"), data.get("kind"), data.get("source")
    ok = True
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        problems.append(f"{path}.value: {value!r} is not a number; {hint}")
        ok = False
    elif positive and value <= 0:
        problems.append(f"{path}.value: {value!r} must be positive")
        ok = False
    if kind not in KINDS:
        problems.append(f"{path}.kind: {kind!r} is not one of {', '.join(KINDS)}")
        ok = False
    if not isinstance(source, str) or len(source.strip()) < 8:
        problems.append(
            f"{path}.source: every number says where it comes from (a datasheet, a cited "
            "benchmark, a measurement with its date and machine, or what an estimate rests on)"
        )
        ok = False
    if not ok:
        return None
    return Sourced(value=float(cast(float, value)), kind=str(kind), source=str(source).strip())


def _table(data: Any, path: str, problems: list[str], sources: dict[str, Sourced]) -> SizeTable:
    if not isinstance(data, list) or not data:
        problems.append(f"{path}: a list of {{n: <size>, value: ..., kind: ..., source: ...}}")
        return SizeTable(points=((1, Sourced(value=1.0, kind="estimate", source="invalid")),))
    points: list[tuple[int, Sourced]] = []
    for i, entry in enumerate(data):
        where = f"{path}[{i}]"
        n = entry.get("n") if isinstance(entry, Mapping) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            problems.append(f"{where}.n: {n!r} must be a positive whole matrix size")
            continue
        number = _number(entry, where, problems)
        if number is not None:
            points.append((n, number))
            sources[f"{path}[n={n}]"] = number
    sizes = [p[0] for p in points]
    if len(set(sizes)) != len(sizes):
        problems.append(f"{path}: each size n once, got {sorted(sizes)}")
    points.sort(key=lambda p: p[0])
    fallback = ((1, Sourced(value=1.0, kind="estimate", source="invalid")),)
    return SizeTable(points=tuple(points) or fallback)


def _level(data: Any, path: str, problems: list[str], sources: dict[str, Sourced]) -> LinkLevel:
    if not isinstance(data, Mapping):
        problems.append(f"{path}: needs latency_s, allreduce_busbw and broadcast_busbw")
        data = {}
    parts = {}
    for name in ("latency_s", "allreduce_busbw", "broadcast_busbw"):
        number = _number(data.get(name), f"{path}.{name}", problems)
        parts[name] = number or Sourced(value=1.0, kind="estimate", source="invalid")
        if number is not None:
            sources[f"{path}.{name}"] = number
    for extra in sorted(set(data) - set(parts)):
        problems.append(f"{path}.{extra}: unknown field (expected {', '.join(parts)})")
    return LinkLevel(**parts)


def hardware_from_dict(data: Any, origin: str = "hardware profile") -> Hardware:
    """Validate a parsed profile (see the module docstring for the format).

    Raises:
        HardwareProfileError: naming every missing, unsourced or malformed field.
    """
    problems: list[str] = []
    sources: dict[str, Sourced] = {}
    if not isinstance(data, Mapping):
        raise HardwareProfileError([f"expected a mapping, got {type(data).__name__}"], origin)
    known = {"name", "description", "gpu", "node", "links", "training", "kernels", "kfac_host_s"}
    for extra in sorted(set(data) - known):
        problems.append(f"{extra}: unknown field (expected {', '.join(sorted(known))})")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        problems.append("name: the profile's name, e.g. a100-80gb-hdr")
    gpu = data.get("gpu") if isinstance(data.get("gpu"), Mapping) else None
    if gpu is None:
        problems.append(
            "gpu: needs name, memory_bytes, kernel_latency_s, matmul_flops_per_s, eigh_s"
        )
        gpu = {}

    def number(value: Any, path: str) -> Sourced:
        found = _number(value, path, problems)
        if found is not None:
            sources[path] = found
        return found or Sourced(value=1.0, kind="estimate", source="invalid")

    memory = number(gpu.get("memory_bytes"), "gpu.memory_bytes")
    latency = number(gpu.get("kernel_latency_s"), "gpu.kernel_latency_s")
    matmul: dict[str, SizeTable] = {}
    rates = gpu.get("matmul_flops_per_s")
    if not isinstance(rates, Mapping) or Precision.FP32 not in rates:
        problems.append("gpu.matmul_flops_per_s: a table per precision, fp32 at least")
        rates = {}
    for precision, table in rates.items():
        if precision not in PRODUCT_PRECISIONS:
            problems.append(
                f"gpu.matmul_flops_per_s.{precision}: unknown precision "
                f"(expected {', '.join(PRODUCT_PRECISIONS)})"
            )
            continue
        matmul[precision] = _table(table, f"gpu.matmul_flops_per_s.{precision}", problems, sources)
    eigh = dataclasses.replace(
        _table(gpu.get("eigh_s"), "gpu.eigh_s", problems, sources), grow=True
    )
    decompose = _decompose(gpu.get("decompose_s"), problems, sources)
    overheads = gpu.get("kfac_overhead_s") or {}
    kfac_overhead: dict[str, Sourced] = {}
    if not isinstance(overheads, Mapping):
        problems.append(f"gpu.kfac_overhead_s: a mapping of {', '.join(OVERHEAD_OPERATIONS)}")
        overheads = {}
    for key, value in overheads.items():
        if key not in OVERHEAD_OPERATIONS:
            problems.append(
                f"gpu.kfac_overhead_s.{key}: unknown (expected {', '.join(OVERHEAD_OPERATIONS)})"
            )
            continue
        where = f"gpu.kfac_overhead_s.{key}"
        found = _number(value, where, problems, positive=False)  # 0: below what it resolves
        if found is not None and found.value < 0:
            problems.append(f"{where}.value: {found.value!r} must not be negative")
        elif found is not None:
            kfac_overhead[key] = sources[where] = found
    node = data.get("node")
    if not isinstance(node, Mapping):
        node = {}
    gpus = number(node.get("gpus"), "node.gpus")
    if gpus.value != int(gpus.value):
        problems.append(f"node.gpus.value: {gpus.value:g} GPUs per node must be a whole number")
    links = data.get("links") if isinstance(data.get("links"), Mapping) else None
    if links is None:
        problems.append("links: needs intra_node and inter_node")
        links = {}
    intra = _level(links.get("intra_node"), "links.intra_node", problems, sources)
    inter = _level(links.get("inter_node"), "links.inter_node", problems, sources)
    training: list[TrainingRate] = []
    for i, entry in enumerate(data.get("training") or []):
        where = f"training[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("model"), str):
            problems.append(f"{where}: needs model, precision, value, kind, source")
            continue
        precision = entry.get("precision")
        if precision not in PRECISIONS:
            problems.append(
                f"{where}.precision: {precision!r} is not one of {', '.join(PRECISIONS)}"
            )
            continue
        seq_len = entry.get("seq_len")
        if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
            problems.append(f"{where}.seq_len: {seq_len!r} must be a positive whole number")
            continue
        host = None
        if entry.get("host_step_s") is not None:
            host = _number(entry["host_step_s"], f"{where}.host_step_s", problems)
        rate = _number({k: v for k, v in entry.items() if k != "host_step_s"}, where, problems)
        if rate is not None:
            training.append(
                TrainingRate(
                    model=entry["model"],
                    precision=precision,
                    seq_len=seq_len,
                    samples_per_s=rate,
                    host_step_s=host,
                )
            )
            sources[f"{where}({entry['model']}, {precision})"] = rate
            if host is not None:
                sources[f"{where}.host_step_s({entry['model']}, {precision})"] = host
    extract = (
        number(gpu["extract_elements_per_s"], "gpu.extract_elements_per_s")
        if gpu.get("extract_elements_per_s") is not None
        else None
    )
    factor_work = _factor_work(data.get("kernels"), problems, sources)
    kfac_host = _kfac_host(data.get("kfac_host_s"), problems, sources)
    if problems:
        raise HardwareProfileError(problems, origin)
    return Hardware(
        name=str(name),
        description=str(data.get("description") or ""),
        gpu_name=str(gpu.get("name") or "GPU"),
        memory_bytes=memory,
        gpus_per_node=gpus,
        kernel_latency_s=latency,
        matmul=matmul,
        eigh=eigh,
        training=tuple(training),
        intra_node=intra,
        inter_node=inter,
        sources=sources,
        decompose=decompose,
        kfac_overhead=kfac_overhead,
        extract_elements_per_s=extract,
        factor_work=factor_work,
        kfac_host=kfac_host,
    )


def _factor_work(
    data: Any, problems: list[str], sources: dict[str, Sourced]
) -> dict[tuple[str, int, str], Sourced]:
    """``kernels``: entries ``{model, batch, kfac_approx, factor_work_s: {value, kind,
    source}}``, a model's factor work at a batch, as ``measure-node --model`` times it."""
    found: dict[tuple[str, int, str], Sourced] = {}
    if data is None:
        return found
    if not isinstance(data, list):
        problems.append("kernels: a list of {model, batch, kfac_approx, factor_work_s}")
        return found
    for i, entry in enumerate(data):
        where = f"kernels[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("model"), str):
            problems.append(f"{where}: needs model, batch, kfac_approx, factor_work_s")
            continue
        batch, approx = entry.get("batch"), entry.get("kfac_approx")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            problems.append(f"{where}.batch: {batch!r} must be a positive whole number")
            continue
        if approx not in APPROACHES:
            problems.append(
                f"{where}.kfac_approx: {approx!r} is not one of {', '.join(APPROACHES)}"
            )
            continue
        work = _number(entry.get("factor_work_s"), f"{where}.factor_work_s", problems)
        if work is not None:
            key = (entry["model"], batch, approx)
            found[key] = sources[f"{where}.factor_work_s({key[0]}, {batch}, {approx})"] = work
    return found


# K-FAC's host phases a profile measures on a model, and the field that names each one's variant
HOST_PHASES = {"precondition": ("compute_method", METHODS), "factors": ("kfac_approx", APPROACHES)}


def _kfac_host(
    data: Any, problems: list[str], sources: dict[str, Sourced]
) -> dict[tuple[str, str, str], Sourced]:
    """``kfac_host_s``: entries ``{model, phase: precondition, compute_method, value, kind,
    source}`` or ``{model, phase: factors, kfac_approx, ...}``, K-FAC's host seconds on a
    model as ``measure-node --model`` times them on a GPU."""
    found: dict[tuple[str, str, str], Sourced] = {}
    if data is None:
        return found
    shape = "a list of {model, phase, compute_method or kfac_approx, value, kind, source}"
    if not isinstance(data, list):
        problems.append(f"kfac_host_s: {shape}")
        return found
    for i, entry in enumerate(data):
        where = f"kfac_host_s[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("model"), str):
            problems.append(f"{where}: needs model, phase and its variant, value, kind, source")
            continue
        phase = entry.get("phase")
        if phase not in HOST_PHASES:
            problems.append(f"{where}.phase: {phase!r} is not one of {', '.join(HOST_PHASES)}")
            continue
        key, allowed = HOST_PHASES[phase]
        variant = entry.get(key)
        if variant not in allowed:
            problems.append(f"{where}.{key}: {variant!r} is not one of {', '.join(allowed)}")
            continue
        number = {k: v for k, v in entry.items() if k not in ("phase", key)}
        seconds = _number(number, where, problems, positive=False)  # 0: below what it resolves
        if seconds is not None and seconds.value < 0:
            problems.append(f"{where}.value: {seconds.value!r} must not be negative")
        elif seconds is not None:
            ident = (entry["model"], str(phase), str(variant))
            found[ident] = sources[f"{where}({', '.join(ident)})"] = seconds
    return found


def _decompose(
    data: Any, problems: list[str], sources: dict[str, Sourced]
) -> dict[str, tuple[SizeTable | None, SizeTable | None]]:
    """``gpu.decompose_s``: per method, entries ``{n, count, value, kind, source}`` (seconds per
    factor when ``count`` factors of size n are decomposed together; count 1: alone)."""
    if data is None:
        return {}
    path = "gpu.decompose_s"
    if not isinstance(data, Mapping):
        problems.append(f"{path}: a list per method ({', '.join(METHODS)})")
        return {}
    found: dict[str, tuple[SizeTable | None, SizeTable | None]] = {}
    for method, entries in data.items():
        if method not in METHODS:
            problems.append(f"{path}.{method}: unknown method (expected {', '.join(METHODS)})")
            continue
        if not isinstance(entries, list) or not entries:
            problems.append(f"{path}.{method}: a list of {{n, count, value, kind, source}}")
            continue
        alone: list[Any] = []
        many: list[Any] = []
        for i, entry in enumerate(entries):
            count = entry.get("count") if isinstance(entry, Mapping) else None
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                problems.append(
                    f"{path}.{method}[{i}].count: {count!r} must be a positive whole number"
                )
                continue
            (alone if count == 1 else many).append(entry)
        tables: list[SizeTable | None] = []
        for label, part in (("alone", alone), ("batched", many)):
            if not part:
                tables.append(None)
                continue
            table = _table(part, f"{path}.{method}({label})", problems, sources)
            tables.append(dataclasses.replace(table, grow=True))
        found[method] = (tables[0], tables[1])
    return found
