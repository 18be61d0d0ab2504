"""The tuner's ``Profile`` of a job on hardware it has not run on: from layer shapes and a
hardware profile instead of from measurements on the job's workers.

``profile_job`` measures a profile on the real workers; ``forecast_profile`` predicts the same
fields from a ``Workload`` (what the model is, from its shapes: every K-FAC layer with the rows
its factors are built from, parameters, the activations kept for backward, forward flops) and
a ``Hardware`` profile (``tuner.hardware``):

- base memory: float32 parameters, gradients and optimizer state, plus the activations;
- K-FAC temporaries: the largest layer's batch factors, its ``eigh`` output (the old
  eigenvectors live until the new ones replace them) and, for convolutions with the
  ``expand`` approximation, the largest patch matrix;
- the plain step: the batch over a published training throughput of the model on this GPU,
  else the training flops (3 × forward) over the GPU's large-product matmul rate;
- factors: ``2 · rows · dim²`` flops per factor at the matmul rate for its size, plus the
  GPU's per-operation latency;
- decompositions: the profile's ``eigh`` times by size (``inverse``: ``n³`` flops of a
  Cholesky inverse at the matmul rate);
- preconditioning: ``precondition_flops`` per layer at the matmul rate for its size;
- communication: ``tuner.topology`` prices each of the plan's collectives by the nodes its
  group spans.

``choose(forecast_profile(...), budget)`` is then the tuner's choice, made exactly as it is made
for a measured profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from kaisa_ray.enums import ComputeMethod, Precision, Scaling
from kaisa_ray.plan import PlannedLayer
from tuner.cost import LinkFit, Profile, precondition_flops
from tuner.hardware import Hardware, SizeTable
from tuner.topology import Topology

FLOAT32 = 4


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One rank's training step as far as K-FAC and memory are concerned, from shapes."""

    model: str
    batch_size: int  # per rank and forward pass (the micro-batch with accumulation)
    seq_len: int | None  # language models: tokens per sample
    precision: str  # fp32 | bf16 | fp16
    layers: tuple[PlannedLayer, ...]
    rows: tuple[tuple[int, int], ...]  # per layer: rows of its A and G batch factors
    patch_bytes: int  # the largest Conv2d patch matrix K-FAC unfolds (expand), else 0
    parameters: int
    activation_bytes: int  # tensors autograd keeps for backward at this batch size
    forward_flops: float  # one forward pass of the batch
    optimizer_states: int = 1  # float32 tensors of state per parameter (SGD momentum: 1)
    compute_method: str = ComputeMethod.EIGEN
    scaling: str = Scaling.KRONECKER  # what the eigen method's state holds besides its bases
    # Forward and backward passes per optimizer step (gradient accumulation, as BERT's
    # pre-training runs it): factors are built from every pass, K-FAC's decompositions and
    # communication happen once per step.
    accumulation_steps: int = 1

    def __post_init__(self) -> None:
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={self.accumulation_steps} must be at least 1")
        if len(self.rows) != len(self.layers):
            raise ValueError(f"rows has {len(self.rows)} entries for {len(self.layers)} layers")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be at least 1")


@dataclass(frozen=True, kw_only=True)
class EighTable:
    """``tuner.cost.DecompositionModel`` from a hardware profile's ``eigh`` times."""

    table: SizeTable

    def seconds(self, n: int) -> float:
        return self.table.at(n)


@dataclass(frozen=True, kw_only=True)
class InverseRate:
    """Cholesky inverse of an ``n × n`` factor: about ``n³`` flops at the matmul rate."""

    hardware: Hardware

    def seconds(self, n: int) -> float:
        return self.hardware.matmul_seconds(float(n) ** 3, n)


@dataclass(frozen=True, kw_only=True)
class Basis:
    """Where the predicted plain step came from, for people reading a plan."""

    step_s: float
    step_source: str
    base_memory_bytes: int
    kfac_transient_bytes: int


def plain_step(workload: Workload, hardware: Hardware) -> tuple[float, str]:
    """Seconds of one plain training step, and what the figure rests on."""
    rate = hardware.training_rate(workload.model, workload.precision, workload.seq_len)
    samples = workload.batch_size * workload.accumulation_steps
    if rate is not None:
        seconds = samples / rate.samples_per_s.value
        where = f"{rate.samples_per_s.value:g} samples/s ({rate.samples_per_s.kind}: "
        return seconds, where + f"{rate.samples_per_s.source})"
    flops = 3.0 * workload.forward_flops * workload.accumulation_steps
    peak = hardware.matmul_rate(4096, workload.precision)
    return flops / peak, (
        f"estimate: 3 x {workload.forward_flops:.3g} forward flops at the GPU's large-product "
        f"{workload.precision} matmul rate ({peak / 1e12:.1f} Tflop/s); no published "
        f"throughput of {workload.model} on {hardware.gpu_name} in the profile"
    )


def memory_basis(workload: Workload) -> tuple[int, int]:
    """(base bytes, K-FAC temporaries) per rank."""
    weights = workload.parameters * FLOAT32 * (2 + workload.optimizer_states)
    base = weights + workload.activation_bytes
    widest = max(
        (layer.groups * (layer.a_dim**2 + layer.g_dim**2) for layer in workload.layers), default=0
    )
    largest = max((max(layer.a_dim, layer.g_dim) for layer in workload.layers), default=0)
    transient = FLOAT32 * (widest + largest**2) + workload.patch_bytes
    return base, transient


def forecast_profile(
    workload: Workload,
    hardware: Hardware,
    world_size: int,
    *,
    gpus_per_node: int | None = None,
) -> tuple[Profile, Basis]:
    """The tuner's profile of ``workload`` on ``world_size`` GPUs of ``hardware``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    factor_s = 0.0
    sandwich_s = sandwich_flops = 0.0
    for layer, (a_rows, g_rows) in zip(workload.layers, workload.rows, strict=True):
        k = layer.groups
        for dim, rows in ((layer.a_dim, a_rows), (layer.g_dim, g_rows)):
            one = hardware.matmul_seconds(2.0 * rows * dim * dim, dim, Precision.FP32)
            factor_s += k * one * workload.accumulation_steps
        flops = precondition_flops(layer, workload.compute_method)
        sandwich_flops += flops
        sandwich_s += hardware.matmul_seconds(flops, min(layer.a_dim, layer.g_dim), Precision.FP32)
    step_s, step_source = plain_step(workload, hardware)
    base, transient = memory_basis(workload)
    intra = hardware.intra_node
    link = LinkFit(latency_s=intra.latency_s.value, bytes_per_s=intra.allreduce_busbw.value)
    decomposition = (
        EighTable(table=hardware.eigh)
        if workload.compute_method == ComputeMethod.EIGEN
        else InverseRate(hardware=hardware)
    )
    profile = Profile(
        world_size=world_size,
        layers=tuple(workload.layers),
        base_memory_bytes=base,
        kfac_transient_bytes=transient,
        step_s=step_s,
        factor_s=factor_s,
        decomposition=decomposition,
        precondition_s_per_flop=sandwich_s / sandwich_flops if sandwich_flops else 0.0,
        allreduce=link,
        broadcast=link,
        compute_method=workload.compute_method,
        scaling=workload.scaling,
        topology=Topology.of(hardware, gpus_per_node),
    )
    return profile, Basis(
        step_s=step_s,
        step_source=step_source,
        base_memory_bytes=base,
        kfac_transient_bytes=transient,
    )
