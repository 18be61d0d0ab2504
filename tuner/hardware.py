"""Hardware profiles: what the cost model needs to price a job on GPUs it has not run on.

A profile describes one kind of node and the network between nodes: per-GPU memory, matrix
multiplication rates by the product's size, eigendecomposition times by matrix size, published
training throughputs of known models, and for each link level (NVLink inside a node,
InfiniBand or Ethernet between nodes) the latency and bus bandwidth of all-reduce and
broadcast as NCCL's tests report them. Every number carries where it comes from::

    memory_bytes: {value: 85899345920, kind: datasheet, source: "NVIDIA A100 datasheet: 80 GB"}

``kind`` is ``datasheet``, ``benchmark`` (a published measurement, cited), ``measured`` (by
``kaisa-ray plan measure-node`` on the machine named in ``source``, with its date) or
``estimate`` (``source`` says from what). ``tuner.hardware_file.hardware_from_dict``
validates a parsed file (the YAML is read in the outer layer) and names every bad field with
what to write instead.

Bus bandwidth (``busbw``) is the figure nccl-tests prints: for an all-reduce of ``S`` bytes
over ``p`` ranks taking ``t`` seconds, ``busbw = 2(p-1)/p · S / t``; for a broadcast,
``busbw = S / t``. It is roughly independent of ``p``, which is why profiles quote it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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
