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
- factors: the model's own factor work where ``measure-node --model NAME:BATCH`` timed it on
  the node at this batch and approximation (``kernels``), else each layer's extraction (a
  convolution's patch matrix or position sums, its output
  gradient: elements moved at the profile's measured rate of that work) and covariance
  products ``XᵀX`` (``rows × dim`` by its transpose, a layer's
  groups in one batched call) at the rate of the square product of the same volume
  (``Hardware.product_seconds``), at the rate table of the products' ``matmul_precision``
  (``tf32`` where the profile measured it);
- decompositions: seconds per factor as K-FAC decomposes it, from the profile's measured
  ``decompose_s`` table (batched where the model has several factors of that size), else
  ``eigh`` of one matrix (eigen) or ``n³`` flops at the matmul rate (inverse, an estimate);
- K-FAC's fixed cost of a factor update and of preconditioning (hooks, Python, launches,
  small operations): the model's own where ``measure-node --model`` timed them on a GPU
  (``kfac_host_s``), else per layer (and shape group) as ``measure-node`` measured it on tiny
  layers (``kfac_overhead_s``), else operations counted in this code at the kernel latency
  (an estimate); on a CPU they add to the arithmetic, on a GPU, where the host launches
  while the device computes, a phase takes the longer of the two;
- preconditioning: the products of each shape group (``kaisa_ray.batching``: the layers of one
  ``(a, g, groups)`` shape in one batched call; eigen four, inverse two), each at the rate of
  its volume, shared equally by the group's layers;
- communication: ``tuner.topology`` prices each of the plan's collectives by the nodes its
  group spans.

``choose(forecast_profile(...), budget)`` is then the tuner's choice, made exactly as it is made
for a measured profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from kaisa_ray.enums import ComputeMethod, FactorReduction, KFACApprox, Parallel, Scaling
from kaisa_ray.plan import Plan, PlannedLayer
from kaisa_ray.schedule import rows_mode
from tuner.cost import LinkFit, Profile, precondition_flops
from tuner.hardware import OVERHEAD_OPERATIONS, Hardware
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
    # K-FAC's float32 products ('highest', 'high', 'medium': the preconditioner's option)
    matmul_precision: str = "high"
    kfac_approx: str = KFACApprox.EXPAND  # the convolutions' factors (``KFACApprox``)
    sequence_approx: str = KFACApprox.EXPAND  # Linear layers' tokens (``sequence_approx``)
    # deferred: the factors all-reduced on decomposition steps only (kaisa_ray.enums)
    factor_reduction: str = FactorReduction.EVERY_UPDATE
    # (``rows`` and ``moved`` are already the approximation's; this names it for a profile's
    # factor work measured per approximation)
    # Per layer: elements the A and G factors' extraction moves before their products (a
    # convolution's patch matrix or position sums, its output gradient); empty: not priced
    moved: tuple[tuple[int, int], ...] = ()
    # FSDP2: the ranks the parameters, gradients and optimizer state are sharded over (1:
    # whole on every rank, DDP); a sharded step also gathers the K-FAC layers' gradients
    sharded_over: int = 1

    def __post_init__(self) -> None:
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={self.accumulation_steps} must be at least 1")
        if len(self.rows) != len(self.layers):
            raise ValueError(f"rows has {len(self.rows)} entries for {len(self.layers)} layers")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be at least 1")


@dataclass(frozen=True, kw_only=True)
class DecomposeTable:
    """``tuner.cost.DecompositionModel`` from a hardware profile: one factor of size ``n`` as
    K-FAC decomposes it (``Hardware.decomposition_seconds``), batched for the sizes in
    ``batched`` (the model has several factors of that size: exact under COMM-OPT, where every
    rank decomposes all of them; a rank of MEM-OPT may hold one of a size)."""

    hardware: Hardware
    method: str
    batched: frozenset[int] = frozenset()

    def seconds(self, n: int) -> float:
        return self.hardware.decomposition_seconds(self.method, n, batched=n in self.batched)[0]


@dataclass(frozen=True, kw_only=True)
class Basis:
    """Where the predicted plain step came from, for people reading a plan."""

    step_s: float
    step_source: str
    base_memory_bytes: int
    kfac_transient_bytes: int
    terms: tuple[str, ...] = ()  # what each K-FAC term rests on, for people reading a plan


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


def host_step(workload: Workload, hardware: Hardware) -> float | None:
    """Seconds the host takes to issue one plain training step, where the profile measured
    it on a GPU (a CPU's host is its device: None)."""
    if hardware.host_is_device:
        return None
    rate = hardware.training_rate(workload.model, workload.precision, workload.seq_len)
    if rate is None or rate.host_step_s is None:
        return None
    return rate.host_step_s.value * workload.accumulation_steps


def memory_basis(workload: Workload) -> tuple[int, int]:
    """(base bytes, K-FAC temporaries) per rank. Sharded over ``W`` ranks (FSDP2), a rank
    holds ``1/W`` of the parameters, gradients and optimizer state (rounded up), and the step
    adds the K-FAC layers' whole gradients and the gather's buffer of every rank's rows
    (``kaisa_ray.sharding``: about twice the K-FAC layers' gradients), as COMM-OPT gathers
    them to every rank (``sharded_transient`` for the other strategies)."""
    shards = workload.sharded_over
    weights = -(-workload.parameters // shards) * FLOAT32 * (2 + workload.optimizer_states)
    base = weights + workload.activation_bytes
    transient = _common_transient(workload)
    if shards > 1:
        transient += FLOAT32 * sum(_gathered_and_whole(layer, shards) for layer in workload.layers)
    return base, transient


def sharded_transient(workload: Workload, strategy: Plan) -> int:
    """K-FAC's temporaries on the busiest rank of ``strategy`` for a workload sharded by FSDP2
    (``sharded_over`` ranks): ``memory_basis``'s under COMM-OPT; with fewer gradient workers
    than ranks (``plan.rows_mode``) only a layer's workers gather its rows, so at most the
    layers of the busiest worker's column, each whole and as much again (padded) for the
    gather's and the scatter's buffers."""
    if not rows_mode(strategy.assignment, strategy.options):
        return memory_basis(workload)[1]
    world = workload.sharded_over
    held: dict[int, int] = {}
    for layer in workload.layers:
        column = strategy.assignment.column_of(layer.name)
        held[column] = held.get(column, 0) + _gathered_and_whole(layer, world)
    return _common_transient(workload) + FLOAT32 * max(held.values(), default=0)


def _common_transient(workload: Workload) -> int:
    """K-FAC's temporaries under any parallelism: the widest layer's batch factors, the
    largest decomposition's workspace and the convolutions' patches."""
    widest = max((layer.factor_elements for layer in workload.layers), default=0)
    largest = max((layer.largest_solve for layer in workload.layers), default=0)
    return FLOAT32 * (widest + largest**2) + workload.patch_bytes


def _gathered_and_whole(layer: PlannedLayer, world: int) -> int:
    """Elements of a layer's gathered rows (every rank's ``⌈rows/W⌉``, padded) and of its
    whole gradient."""
    gathered = -(-layer.groups * layer.g_dim // world) * world * layer.a_dim
    return gathered + layer.groups * layer.g_dim * layer.a_dim


def factor_work_seconds(workload: Workload, hardware: Hardware) -> float:
    """The arithmetic of one factor update of every layer, one forward-backward pass: each
    layer's extraction (where the profile has its rate) and its ``A`` and ``G`` covariance
    products, a layer's groups batched."""
    measured = _measured_factor_work(workload, hardware)
    if measured is not None:
        return measured
    precision = hardware.product_precision(workload.matmul_precision)
    seconds = 0.0
    for layer, (a_rows, g_rows) in zip(workload.layers, workload.rows, strict=True):
        for dim, rows in ((layer.a_dim, a_rows), (layer.g_dim, g_rows)):
            seconds += hardware.product_seconds(
                dim, rows, dim, batch=layer.groups, precision=precision
            )
    rate = hardware.extract_elements_per_s
    if rate is not None:
        seconds += sum(a + g for a, g in workload.moved) / rate.value
    return seconds


def _measured_factor_work(workload: Workload, hardware: Hardware) -> float | None:
    """The factor work ``measure-node --model`` timed for this model at this batch and
    approximation, at the products' default precision, with a Linear layer's every token a
    row (none for another precision or reduced tokens)."""
    if workload.matmul_precision != "high" or workload.sequence_approx != KFACApprox.EXPAND:
        return None  # measure-node times the products at 'high', every token a row
    found = hardware.factor_work.get((workload.model, workload.batch_size, workload.kfac_approx))
    return None if found is None else found.value


def factor_seconds(workload: Workload, hardware: Hardware, work: float | None = None) -> float:
    """One factor update of every layer: ``factor_work_seconds`` (``work`` where the caller
    has it) once per forward-backward pass, and K-FAC's fixed cost of it (``_factor_host``;
    added on a CPU, the longer of the two on a GPU: ``Hardware.host_is_device``)."""
    seconds = factor_work_seconds(workload, hardware) if work is None else work
    fixed = _factor_host(workload, hardware)
    total = seconds + fixed if hardware.host_is_device else max(seconds, fixed)
    return total * workload.accumulation_steps


def _factor_host(workload: Workload, hardware: Hardware) -> float:
    """K-FAC's fixed seconds of one factor update of every layer: measured on the model
    itself where the profile has it (``kfac_host_s``), else the profile's cost per layer
    times the layers."""
    found = hardware.model_host(workload.model, "factors", str(workload.kfac_approx))
    if found is not None:
        return found.value
    return hardware.overhead("factors_per_layer")[0] * len(workload.layers)


def _precondition_host(workload: Workload, hardware: Hardware) -> float | None:
    """K-FAC's fixed seconds of preconditioning every layer a step, measured on the model
    itself (``kfac_host_s``, the Kronecker scaling's step), or None."""
    if workload.scaling != Scaling.KRONECKER:
        return None
    found = hardware.model_host(workload.model, "precondition", str(workload.compute_method))
    return None if found is None else found.value


# (a, g, groups, A diagonal): the layers preconditioned in one call
ShapeKey = tuple[int, int, int, bool]


def group_products(workload: Workload, hardware: Hardware) -> dict[ShapeKey, tuple[float, int]]:
    """Per shape group (``kaisa_ray.batching``: the layers of one ``(a, g, groups)`` shape in
    one batched call per product), the seconds of its preconditioning products, ``Q_Gᵀ ∇W Q_A``
    and back (eigen) or ``G⁻¹ ∇W A⁻¹`` (inverse), and its number of layers."""
    precision = hardware.product_precision(workload.matmul_precision)
    members: dict[ShapeKey, int] = {}
    for layer in workload.layers:
        key = (layer.a_dim, layer.g_dim, layer.groups, layer.diagonal_a)
        members[key] = members.get(key, 0) + 1
    sides = 2 if workload.compute_method == ComputeMethod.EIGEN else 1
    found = {}
    for (a, g, k, diagonal), count in members.items():
        batch = count * k
        one = hardware.product_seconds(g, g, a, batch=batch, precision=precision)
        # a diagonal A: no product on its side (the identity basis, a diagonal inverse)
        other = (
            0.0 if diagonal else hardware.product_seconds(g, a, a, batch=batch, precision=precision)
        )
        found[(a, g, k, diagonal)] = (sides * (one + other), count)
    return found


def precondition_seconds(
    workload: Workload,
    hardware: Hardware,
    groups: dict[ShapeKey, tuple[float, int]] | None = None,
) -> tuple[float, ...]:
    """Each layer's share of preconditioning one step: its group's products
    (``group_products``, or ``groups`` where the caller has them) split equally among the
    group's layers, with K-FAC's fixed cost per layer and its share of the group's (added on
    a CPU, the longer of the two on a GPU: ``Hardware.host_is_device``)."""
    groups = group_products(workload, hardware) if groups is None else groups
    per_layer, _ = hardware.overhead("precondition_per_layer")
    per_group, _ = hardware.overhead("precondition_per_group")
    measured = _precondition_host(workload, hardware)
    shares = []
    for x in workload.layers:
        seconds, count = groups[(x.a_dim, x.g_dim, x.groups, x.diagonal_a)]
        products = seconds / count
        if measured is not None:  # the model's own, shared equally by its layers
            fixed = measured / len(workload.layers)
        else:
            fixed = per_layer + per_group / count
        shares.append(products + fixed if hardware.host_is_device else max(products, fixed))
    return tuple(shares)


def _terms(workload: Workload, hardware: Hardware) -> tuple[str, ...]:
    precision = hardware.product_precision(workload.matmul_precision)
    table = hardware.matmul[precision]
    products = (
        f"{precision} matmul rates ({table.kind}) at the square size of each product's volume"
    )
    if precision != "tf32" and workload.matmul_precision != "highest":
        products += (
            f"; the products run at matmul precision '{workload.matmul_precision}' (TF32 on "
            "NVIDIA GPUs) but the profile has no tf32 rates, so they are priced at fp32's"
        )
    method = workload.compute_method
    alone, many = hardware.decompose.get(method, (None, None))
    measured = many or alone
    if measured is not None:
        decompositions = (
            f"{method} decompositions: the profile's decompose_s table ({measured.kind})"
        )
    elif method == ComputeMethod.EIGEN:
        decompositions = (
            f"eigen decompositions: eigh of one matrix ({hardware.eigh.kind}); no decompose_s "
            "table, so factors batched by size are priced one by one"
        )
    else:
        decompositions = (
            "inverse decompositions: estimate, n³ flops at the matmul rate (no decompose_s "
            "table in the profile)"
        )
    kinds = sorted({hardware.overhead(name)[1] for name in OVERHEAD_OPERATIONS})
    stand_in = (
        "the profile's kfac_overhead_s"
        if "estimate" not in kinds
        else "estimate, operations counted in this code at the profile's kernel latency "
        "(no kfac_overhead_s in the profile)"
    )
    fixed = f"K-FAC's fixed cost per layer and shape group (hooks, Python, launches): {stand_in}"
    factor_host = hardware.model_host(workload.model, "factors", str(workload.kfac_approx))
    own = [
        phase
        for phase, seconds in (
            ("factors", factor_host),
            ("precondition", _precondition_host(workload, hardware)),
        )
        if seconds is not None
    ]
    if own:
        fixed = (
            f"K-FAC's fixed cost of {' and '.join(own)} (hooks, Python, launches): "
            f"{workload.model}'s own, timed on one-sample steps (measure-node --model, "
            "kfac_host_s)" + ("" if len(own) == 2 else f"; the rest: {stand_in}")
        )
    rate = hardware.extract_elements_per_s
    extraction = (
        f"factor extraction (patches, position sums): the profile's extract rate ({rate.kind})"
        if rate is not None
        else "factor extraction (patches, position sums): not priced (no extract rate in the "
        "profile)"
    )
    if _measured_factor_work(workload, hardware) is not None:
        return (
            f"factors: {workload.model}'s own factor work at batch {workload.batch_size}, "
            f"{workload.kfac_approx} (measured by measure-node --model); preconditioning: "
            f"{products}",
            fixed,
            decompositions,
        )
    return (f"factors and preconditioning: {products}", extraction, fixed, decompositions)


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
    device_s, step_source = plain_step(workload, hardware)
    host_s = host_step(workload, hardware)
    step_s = device_s if host_s is None else max(host_s, device_s)
    if host_s is not None:
        step_source += (
            f"; the host issues it in {host_s * 1e3:.1f} ms (measured), the device runs it in "
            f"{device_s * 1e3:.1f} ms: the longer"
        )
    base, transient = memory_basis(workload)
    intra = hardware.intra_node
    link = LinkFit(latency_s=intra.latency_s.value, bytes_per_s=intra.allreduce_busbw.value)
    sizes: dict[int, int] = {}
    for layer in workload.layers:
        for dim in (layer.g_dim,) if layer.diagonal_a else (layer.a_dim, layer.g_dim):
            sizes[dim] = sizes.get(dim, 0) + layer.groups
    decomposition = DecomposeTable(
        hardware=hardware,
        method=str(workload.compute_method),
        batched=frozenset(n for n, count in sizes.items() if count > 1),
    )
    groups = group_products(workload, hardware)
    layer_precondition = precondition_seconds(workload, hardware, groups)
    flops = sum(precondition_flops(x, workload.compute_method) for x in workload.layers)
    work = factor_work_seconds(workload, hardware)
    factor_s = factor_seconds(workload, hardware, work)
    # the device's share of each: the products (and the factors' extraction), not the fixed
    # costs that the host spends launching them
    products = sum(seconds for seconds, _ in groups.values())
    precondition_s = sum(layer_precondition)
    factor_work = work * workload.accumulation_steps
    profile = Profile(
        world_size=world_size,
        layers=tuple(workload.layers),
        base_memory_bytes=base,
        kfac_transient_bytes=transient,
        step_s=step_s,
        factor_s=factor_s,
        decomposition=decomposition,
        precondition_s_per_flop=sum(layer_precondition) / flops if flops else 0.0,
        layer_precondition_s=layer_precondition,
        allreduce=link,
        broadcast=link,
        compute_method=workload.compute_method,
        scaling=workload.scaling,
        factor_reduction=workload.factor_reduction,
        parallel=Parallel.FSDP if workload.sharded_over > 1 else Parallel.DDP,
        topology=Topology.of(hardware, gpus_per_node),
        host_step_s=host_s,
        device_step_s=None if host_s is None else device_s,
        factor_device_share=min(1.0, factor_work / factor_s) if factor_s > 0 else 1.0,
        precondition_device_share=(
            min(1.0, products / precondition_s) if precondition_s > 0 else 1.0
        ),
    )
    return profile, Basis(
        step_s=step_s,
        step_source=step_source,
        base_memory_bytes=base,
        kfac_transient_bytes=transient,
        terms=_terms(workload, hardware),
    )
