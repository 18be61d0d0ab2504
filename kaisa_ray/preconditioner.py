"""``KFACPreconditioner``: K-FAC gradient preconditioning added to a training loop in two lines.

Example:
    >>> import torch
    >>> from kaisa_ray import KFACPreconditioner
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> preconditioner = KFACPreconditioner(model, inv_update_steps=10, damping=0.003, lr=0.1)
    >>> loss = model(torch.randn(16, 4)).square().mean()
    >>> loss.backward()
    >>> preconditioner.step()  # replaces .grad of the two Linear layers
    >>> optimizer.step()

The keyword arguments are those of the reference KAISA implementation (kfac-pytorch's
``KFACPreconditioner``) with the same meaning, so switching is a change of import. Where the
reference is awkward this one does better: ``kl_clip=None`` disables clipping, dilation,
'same' padding, ``padding_mode`` and grouped convolutions are handled exactly, non-finite steps
never enter the running averages, and a failed ``eigh`` falls back instead of crashing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from kaisa_ray.engine import KFACEngine, require_module
from kaisa_ray.enums import (
    AssignmentStrategy,
    BasisUpdate,
    ComputeMethod,
    DistributedStrategy,
    FactorReduction,
    FactorScale,
    KFACApprox,
    MatmulPrecision,
    RunningAverage,
    Scaling,
)
from kaisa_ray.hyperparams import FloatParam, IntParam
from kaisa_ray.intervals import AdaptiveIntervals
from kaisa_ray.options import GradScalerLike, PreconditionerOptions


class KFACPreconditioner(KFACEngine):
    """K-FAC gradient preconditioner in the KAISA style.

    Call ``step()`` after ``loss.backward()`` (and after ``GradScaler.unscale_``, if any) and
    before ``optimizer.step()``; it replaces the ``.grad`` of every registered ``nn.Linear``
    and ``nn.Conv2d`` with its preconditioned value. Every other module is left to the
    optimizer.

    Args:
        model: the model whose layers to precondition.
        factor_update_steps: steps between factor updates (int or ``f(step)``).
        inv_update_steps: steps between decomposition updates; best a multiple of
            ``factor_update_steps``.
        damping: Tikhonov damping γ > 0 (float or ``f(step)``).
        factor_decay: running-average decay of the factors, in [0, 1).
        kl_clip: KL clipping κ: gradients are scaled by ``min(1, sqrt(κ / |lr² Σ P·∇|))``;
            ``None`` disables clipping.
        lr: the optimizer's learning rate, used only by the KL clip.
        accumulation_steps: forward/backward passes per optimizer step; factors are the mean
            over them, equal to one batch of the combined size.
        allreduce_bucket_cap_mb: bucket size of the factor all-reduce (distributed runs).
        assignment_strategy: 'compute' (cost n³) or 'memory' (n²) load balancing.
        colocate_factors: keep a layer's A and G decompositions on the same rank.
        compute_method: 'eigen' or 'inverse'.
        compute_eigenvalue_outer_product: eigen method only: precompute
            ``1/(λ_G λ_Aᵀ + γ)`` on decomposition steps.
        grad_worker_fraction: KAISA's f: 'comm-opt' (1), 'mem-opt' (1/W), 'hybrid-opt' (0.5)
            or a float in (0, 1] with f·W dividing W.
        symmetry_aware: communicate only the upper triangle of the symmetric factors.
        grad_scaler: a ``torch.amp.GradScaler`` (or a callable returning the current loss
            scale) whose scale is removed from the output gradients before they enter G.
        factor_dtype: dtype of the factors (default: the layer's dtype, at least float32).
        inv_dtype: dtype of the decompositions (default: as ``factor_dtype``).
        skip_layers: regular expressions matched (``re.match``) against module names and class
            names; matching layers are left to the optimizer.
        update_factors_in_hook: compute batch factors in the module hooks (default) rather
            than keeping inputs and output gradients until ``step()``.
        loglevel: level of the preconditioner's log lines.
        kfac_approx: 'expand' or 'reduce' factors for Conv2d layers (Eschenhagen et al. 2023).
        sequence_approx: 'expand' (every token a row, the reference's factors) or 'reduce'
            (one row per sequence: its mean input and its summed output gradients, the
            factors' products over ``N`` rows instead of ``N·T``) for Linear layers whose
            input has more than two dimensions, e.g. a transformer's ``(N, T, d)``.
        running_average: 'identity' (the reference: the averages start at the identity) or
            'debiased' (they start at zero and are bias-corrected as in Adam, so the first
            update is the first batch's factor).
        factor_scale: 'reference' (kfac-pytorch's units: G from the mean loss's gradients,
            conv rows divided by the positions) or 'fisher' (the Fisher's own Kronecker
            factors from per-example gradients: damping in natural units, the same at every
            batch size; the loss must be a mean over the examples, or over the rows a Linear
            layer sees, e.g. tokens).
        pi_damping: split the damping between A and G by π (Martens & Grosse 2015, §6.3)
            instead of adding γ to ``λ_G λ_A`` (eigen) or to each factor (inverse).
        factor_samples: build each step's factors from at most this many examples of each
            (micro-)batch per rank (an unbiased estimate that costs a fraction at large
            batches); None uses them all.
        intervals: per-layer intervals adapted online to the measured staleness of each
            layer's curvature (``kaisa_ray.intervals.AdaptiveIntervals``) instead of the fixed
            ``factor_update_steps`` and ``inv_update_steps`` (leave those at their defaults).
        measure_staleness: measure how stale each layer's curvature is on its factor and
            decomposition updates (``kaisa_ray.staleness``; read it with ``staleness()``).
            Default: on with ``intervals``, which decide from it, else off.
        matmul_precision: the float32 precision of K-FAC's factor and preconditioning
            products, as ``torch.set_float32_matmul_precision`` names them: 'highest',
            'high' (TF32 on CUDA) or 'medium' (also bfloat16 products on CPUs with them);
            decompositions always run at 'highest'. Applies to float32 products only.
        scaling: what divides the gradient in the eigenbasis (eigen method): 'kronecker'
            (the damped eigenvalue products: K-FAC), 'ekfac' (the per-example gradients'
            second moments in the eigenbasis plus γ, fitted on each factor update with
            ``factor_decay``: EKFAC, ``kaisa_ray.ekfac``; every rank must hold the bases, so
            with several ranks only 'comm-opt'), or 'adam-eigenbasis' (Adam's moments of
            the rotated gradient, as SOAP keeps them in Shampoo's: the preconditioned
            gradient is then an Adam step's direction, for an optimizer without moments of
            its own such as SGD without momentum; ``damping`` is unused, ``adam_eps`` takes its
            place, and ``kl_clip`` is best None).
        adam_betas: the moments' decays (β₁, β₂) under 'adam-eigenbasis'.
        adam_eps: ε added to ``√v̂`` under 'adam-eigenbasis'.
        basis_update: how a decomposition step after the first refreshes the bases under
            'adam-eigenbasis' or 'ekfac': 'eigh' (an eigendecomposition of each factor) or
            'power-qr' (one power iteration from the basis held and a QR factorisation, as
            SOAP refreshes its bases: about half the cost; ``kaisa_ray.solvers.power_qr``).
        factor_reduction: 'every-update' (the reference's: each factor step's batch factors
            are all-reduced) or 'deferred' (each rank folds its own batch factors, and the
            running averages are all-reduced on decomposition steps only: the same factors at
            every decomposition, up to rounding, for ``inv_update_steps /
            factor_update_steps`` times fewer factor all-reduces; ``state_dict()`` is then
            collective; not with 'ekfac', measured staleness or FSDP2).
        cuda_graphs: replay a step's preconditioning of the layers batched by shape from a
            CUDA graph (``kaisa_ray.graphs``): one launch where Python launched each product
            and check, at the cost of keeping two copies of those layers' gradients between
            steps. CUDA only; a step whose layers are not all batched, or that receives
            preconditioned gradients from other ranks, runs as without it.
        embeddings: also precondition ``nn.Embedding`` layers, as Linear layers of one-hot
            inputs (``kaisa_ray.layers.EmbeddingHelper``): A is the diagonal of the indices'
            frequencies, held as its diagonal and decomposed from it (no solver, no
            product on its side, memory linear in ``num_embeddings``; ``plan()`` prices
            it). The input's first
            dimension must be its examples: skip an embedding called with an index shared
            by the batch (positions from ``arange``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: IntParam = 1,
        inv_update_steps: IntParam = 1,
        damping: FloatParam = 0.001,
        factor_decay: FloatParam = 0.95,
        kl_clip: FloatParam | None = 0.001,
        lr: FloatParam = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: DistributedStrategy | float | str = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        grad_scaler: GradScalerLike | None = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype | None = None,
        skip_layers: Iterable[str] | str | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.INFO,
        kfac_approx: KFACApprox | str = KFACApprox.EXPAND,
        sequence_approx: KFACApprox | str = KFACApprox.EXPAND,
        running_average: RunningAverage | str = RunningAverage.IDENTITY,
        factor_scale: FactorScale | str = FactorScale.REFERENCE,
        pi_damping: bool = False,
        factor_samples: int | None = None,
        intervals: AdaptiveIntervals | None = None,
        measure_staleness: bool | None = None,
        matmul_precision: MatmulPrecision | str = MatmulPrecision.HIGH,
        scaling: Scaling | str = Scaling.KRONECKER,
        adam_betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        basis_update: BasisUpdate | str = BasisUpdate.EIGH,
        factor_reduction: FactorReduction | str = FactorReduction.EVERY_UPDATE,
        cuda_graphs: bool = False,
        embeddings: bool = False,
    ) -> None:
        require_module(model)
        options = PreconditionerOptions.checked(
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            accumulation_steps=accumulation_steps,
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            assignment_strategy=assignment_strategy,
            colocate_factors=colocate_factors,
            compute_method=compute_method,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            grad_worker_fraction=grad_worker_fraction,
            symmetry_aware=symmetry_aware,
            grad_scaler=grad_scaler,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            skip_layers=skip_layers,
            update_factors_in_hook=update_factors_in_hook,
            loglevel=loglevel,
            kfac_approx=kfac_approx,
            sequence_approx=sequence_approx,
            running_average=running_average,
            factor_scale=factor_scale,
            pi_damping=pi_damping,
            factor_samples=factor_samples,
            intervals=intervals,
            measure_staleness=measure_staleness,
            matmul_precision=matmul_precision,
            scaling=scaling,
            adam_betas=adam_betas,
            adam_eps=adam_eps,
            basis_update=basis_update,
            factor_reduction=factor_reduction,
            cuda_graphs=cuda_graphs,
            embeddings=embeddings,
        )
        super().__init__(model, options)
