"""Hardware profiles: what the cost model needs to price a job on GPUs it has not run on.

A profile describes one kind of node and the network between nodes: per-GPU memory, matrix
multiplication rates by the product's size, eigendecomposition times by matrix size, published
training throughputs of known models, and for each link level (NVLink inside a node,
InfiniBand or Ethernet between nodes) the latency and bus bandwidth of all-reduce and
broadcast as NCCL's tests report them. Every number carries where it comes from::

    memory_bytes: {value: 85899345920, kind: datasheet, source: "NVIDIA A100 datasheet: 80 GB"}

``kind`` is ``datasheet``, ``benchmark`` (a published measurement, cited), ``measured`` (by
``kaisa-ray plan measure-node`` on the machine named in ``source``, with its date) or
``estimate`` (``source`` says from what). ``hardware_from_dict`` validates a parsed file
(the YAML is read in the outer layer) and names every bad field with what to write instead.

Bus bandwidth (``busbw``) is the figure nccl-tests prints: for an all-reduce of ``S`` bytes
over ``p`` ranks taking ``t`` seconds, ``busbw = 2(p-1)/p · S / t``; for a broadcast,
``busbw = S / t``. It is roughly independent of ``p``, which is why profiles quote it.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from kaisa_ray.enums import ComputeMethod, KFACApprox, Precision
from kaisa_ray.errors import ConfigurationError

KINDS = ("datasheet", "benchmark", "measured", "estimate")
PRECISIONS = tuple(p.value for p in Precision)
TF32 = "tf32"  # float32 products at matmul precision 'high' (TensorFloat-32 on NVIDIA GPUs)
PRODUCT_PRECISIONS = (*PRECISIONS, TF32)
METHODS = tuple(m.value for m in ComputeMethod)
APPROACHES = tuple(str(member) for member in KFACApprox)
# Operations K-FAC runs per layer (or shape group) beyond its products, as counted with
# torch.profiler on this code (tests/tuner/test_plan_terms.py counts them again): the fallback of a
# profile that did not measure ``kfac_overhead_s``, each operation at the kernel latency. On one
# rank or COMM-OPT (the KL clip's products a group at a time); MEM-OPT and HYBRID-OPT add a
# few per layer (their clip takes one product per layer).
OVERHEAD_OPERATIONS = {
    "factors_per_layer": 8.0,
    "precondition_per_layer": 3.5,
    "precondition_per_group": 10.0,
}


class HardwareProfileError(ConfigurationError):
    """A hardware profile that does not describe hardware; lists every bad field."""

    def __init__(self, problems: Sequence[str], origin: str = "hardware profile") -> None:
        self.problems = list(problems)
        self.origin = origin
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{origin} is invalid ({len(self.problems)} problem(s)):\n{lines}")

    def __reduce__(self) -> tuple[type[HardwareProfileError], tuple[list[str], str]]:
        return (type(self), (self.problems, self.origin))


@dataclass(frozen=True, kw_only=True)
class Sourced:
    """One number and where it comes from."""

    value: float
    kind: str
    source: str


@dataclass(frozen=True, kw_only=True)
class SizeTable:
    """A quantity by matrix size ``n``, interpolated log-log between the listed sizes. Below
    the smallest size it is the smallest size's value; above the largest, the largest's
    (``grow=False``: a rate levels off) or the last segment's power law (``grow=True``: a
    time keeps growing, ``eigh``'s as n³)."""

    points: tuple[tuple[int, Sourced], ...]  # sorted by n
    grow: bool = False

    @property
    def kind(self) -> str:
        """The weakest kind among its points (``estimate`` if any point is one)."""
        kinds = {point.kind for _, point in self.points}
        return next((k for k in reversed(KINDS) if k in kinds), "estimate")

    def at(self, n: float) -> float:
        sizes = [p[0] for p in self.points]
        values = [p[1].value for p in self.points]
        if len(sizes) == 1 or n <= sizes[0]:
            return values[0]
        if n >= sizes[-1] and not self.grow:
            return values[-1]
        i = min(max(bisect.bisect_left(sizes, n), 1), len(sizes) - 1)
        x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
        y0, y1 = math.log(values[i - 1]), math.log(values[i])
        return math.exp(y0 + (y1 - y0) * (math.log(max(n, 1.0)) - x0) / (x1 - x0))


@dataclass(frozen=True, kw_only=True)
class TrainingRate:
    """A published (or measured) training throughput of a known model on one GPU."""

    model: str
    precision: str
    seq_len: int | None  # for language models: the sequence length it was measured at
    samples_per_s: Sourced
    # Seconds the host takes to issue one such step (its Python and launches, measured
    # without waiting for the device), where measured: a step takes the longer of this and
    # the device's time, and K-FAC's host work adds to this one.
    host_step_s: Sourced | None = None


@dataclass(frozen=True, kw_only=True)
class LinkLevel:
    """One level of the network: latency and bus bandwidth of NCCL's all-reduce and broadcast
    when the group fills the level (every GPU of each node it spans)."""

    latency_s: Sourced
    allreduce_busbw: Sourced  # bytes per second
    broadcast_busbw: Sourced  # bytes per second


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """A node kind and its network, every number with its source."""

    name: str
    description: str
    gpu_name: str
    memory_bytes: Sourced
    gpus_per_node: Sourced
    kernel_latency_s: Sourced  # fixed cost of each K-FAC operation (launch, small kernels)
    # precision -> flop/s of a square n×n product (any product is priced at the square size
    # of the same volume: ``product_seconds``); ``tf32``: float32 at matmul precision 'high'
    matmul: dict[str, SizeTable]
    eigh: SizeTable  # seconds of torch.linalg.eigh of one float32 n×n matrix
    training: tuple[TrainingRate, ...]
    # The factor work of one factor update of a model's every K-FAC layer, measured on this
    # node at a batch size (``measure-node --model NAME:BATCH``): (model, batch, kfac_approx)
    factor_work: dict[tuple[str, int, str], Sourced] = field(default_factory=dict)
    intra_node: LinkLevel
    inter_node: LinkLevel
    sources: dict[str, Sourced] = field(default_factory=dict)  # every number, by its path
    # Seconds per float32 factor of size n as K-FAC decomposes it (``kaisa_ray.batching.
    # decompose``, damping included), by method: (one factor alone, one of a batch of several
    # of the same size); either may be missing.
    decompose: dict[str, tuple[SizeTable | None, SizeTable | None]] = field(default_factory=dict)
    # K-FAC's fixed seconds where its arithmetic is negligible (hooks, Python, launches):
    # 'factors_per_layer', 'precondition_per_layer', 'precondition_per_group'
    kfac_overhead: dict[str, Sourced] = field(default_factory=dict)
    # Elements per second of K-FAC's factor extraction (a convolution's position sums, as
    # ``measure-node`` times it on a reference convolution); None: not measured
    extract_elements_per_s: Sourced | None = None
    # K-FAC's host seconds on a model itself (``measure-node --model`` on a GPU): what its
    # preconditioning adds to a step, by compute method, and one factor update of every
    # layer, by approximation: (model, 'precondition' | 'factors', method | approximation)
    kfac_host: dict[tuple[str, str, str], Sourced] = field(default_factory=dict)

    def model_host(self, model: str, phase: str, variant: str) -> Sourced | None:
        """K-FAC's measured host seconds of ``phase`` on ``model`` (``kfac_host``), or None."""
        return self.kfac_host.get((model, phase, variant))

    def overhead(self, name: str) -> tuple[float, str]:
        """K-FAC's fixed cost ``name`` (see ``kfac_overhead``) and its kind; without a
        measured one, ``OVERHEAD_OPERATIONS[name]`` operations at the kernel latency (an
        estimate)."""
        found = self.kfac_overhead.get(name)
        if found is not None:
            return found.value, found.kind
        return OVERHEAD_OPERATIONS[name] * self.kernel_latency_s.value, "estimate"

    @property
    def host_is_device(self) -> bool:
        """A CPU profile (``measure-node --device cpu``): K-FAC's fixed costs (Python, launches)
        run on the cores that do its arithmetic, so the two add up; on a GPU the host launches
        while the device computes, so a phase takes the longer of the two."""
        return self.gpu_name.startswith("CPU")

    @property
    def node_size(self) -> int:
        return int(self.gpus_per_node.value)

    def matmul_rate(self, n: float, precision: str = Precision.FP32) -> float:
        """Flop/s of a product whose smallest dimension is ``n``."""
        table = self.matmul.get(precision) or self.matmul[Precision.FP32]
        return table.at(n)

    def matmul_seconds(self, flops: float, n: float, precision: str = Precision.FP32) -> float:
        return self.kernel_latency_s.value + flops / self.matmul_rate(n, precision)

    def product_seconds(
        self, m: int, k: int, n: int, *, batch: int = 1, precision: str = Precision.FP32
    ) -> float:
        """Seconds of ``batch`` products of an ``m × k`` by a ``k × n`` matrix in one call: the
        latency plus ``2·batch·m·k·n`` flops at the rate of the square product of the same
        volume (size ``(batch·m·k·n)^(1/3)``). A tall-skinny product, K-FAC's covariance
        ``XᵀX`` of ``rows × dim`` above all, runs near the rate of its volume, far above the
        rate of a square product of its smallest side."""
        volume = float(batch) * m * k * n
        return self.kernel_latency_s.value + 2.0 * volume / self.matmul_rate(
            volume ** (1.0 / 3.0), precision
        )

    def product_precision(self, matmul_precision: str) -> str:
        """The rate table K-FAC's float32 products run at under ``matmul_precision``: ``tf32``
        for 'high' or 'medium' where the profile measured it, else ``fp32``."""
        if matmul_precision != "highest" and TF32 in self.matmul:
            return TF32
        return Precision.FP32.value

    def eigh_seconds(self, n: int) -> float:
        return self.eigh.at(n)

    def decomposition_seconds(self, method: str, n: int, *, batched: bool) -> tuple[float, str]:
        """Seconds of decomposing one ``n × n`` factor by ``method``, alone or as one of a
        batch of factors of its size, and the kind of the figure: the measured ``decompose``
        table where the profile has one (the other of alone/batched if only it was measured),
        else ``eigh`` of one matrix (eigen) or ``n³`` flops at the matmul rate (inverse: an
        estimate)."""
        alone, many = self.decompose.get(method, (None, None))
        table = (many or alone) if batched else (alone or many)
        if table is not None:
            return table.at(n), table.kind
        if method == ComputeMethod.EIGEN:
            return self.eigh.at(n), self.eigh.kind
        return self.matmul_seconds(float(n) ** 3, n), "estimate"

    def training_rate(
        self, model: str, precision: str, seq_len: int | None = None
    ) -> TrainingRate | None:
        """The listed throughput of ``model`` at ``precision`` (the nearest sequence length
        for language models), or None."""
        found = [r for r in self.training if r.model == model and r.precision == precision]
        if not found:
            return None
        if seq_len is None:
            return found[0]
        return min(found, key=lambda r: abs((r.seq_len or seq_len) - seq_len))


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
