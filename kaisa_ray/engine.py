"""``KFACEngine``: what a ``KFACPreconditioner`` is once its keyword arguments are checked
(``kaisa_ray.options``): the layers and their factor hooks, the plan of who decomposes and
preconditions what, the communicator and the intervals' schedule, wired together once; each
step's factors, decompositions and preconditioning; staleness, accounting and checkpoints.
``kaisa_ray.preconditioner`` is the public constructor, with kfac-pytorch's keywords.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kaisa_ray import checkpoint
from kaisa_ray.apply import (
    GradientSetter,
)
from kaisa_ray.assembly import described, kfac_layers, require_cuda
from kaisa_ray.comm import Communicator
from kaisa_ray.curvature_updates import (
    all_finite,
    fold_factors,
    reduce_averages,
    update_decompositions,
)
from kaisa_ray.enums import (
    Parallel,
)
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.factor_hooks import FactorHooks
from kaisa_ray.fsdp_watch import ShardingWatch
from kaisa_ray.hyperparams import (
    resolve,
    resolve_int,
)
from kaisa_ray.intervals import IntervalChange, IntervalSchedule
from kaisa_ray.kfac_layer import KFACLayer
from kaisa_ray.layers import EmbeddingHelper
from kaisa_ray.options import (
    DAMPING,
    FACTOR_DECAY,
    KL_CLIP,
    LR,
    PreconditionerOptions,
)
from kaisa_ray.plan import Options, Plan, build_plan
from kaisa_ray.preconditioning import Preconditioning
from kaisa_ray.products import matmul_precision
from kaisa_ray.registration import discover
from kaisa_ray.sharding import RowExchange, ShardedGradients, sharded_layers
from kaisa_ray.staleness import PROBES, LayerStaleness
from kaisa_ray.strategy import resolve_grad_worker_fraction
from kaisa_ray.timing import PhaseTimes
from kaisa_ray.tracking import StalenessTracker

# The preconditioner's log, under the name users (and kaisa_ray.tracking) know it by.
logger = logging.getLogger("kaisa_ray.preconditioner")


def require_module(model: object) -> None:
    """Refuse anything but a ``torch.nn.Module`` (before its options are checked)."""
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"model must be a torch.nn.Module; got {type(model).__name__}.")


class KFACEngine:
    """K-FAC in the KAISA style, built from checked options: ``KFACPreconditioner``'s engine
    (construct a ``KFACPreconditioner``; its docstring says what each option means)."""

    def __init__(self, model: nn.Module, options: PreconditionerOptions) -> None:
        """The engine from checked options (``PreconditionerOptions.checked``): the layers and
        their hooks, the plan of who decomposes and preconditions what, the communicator, the
        intervals' schedule."""
        require_module(model)
        self.options = options
        self.compute_method = options.compute_method
        self.assignment_strategy = options.assignment_strategy
        self.kfac_approx = options.kfac_approx
        self.sequence_approx = options.sequence_approx
        self.running_average = options.running_average
        self.factor_scale = options.factor_scale
        self.matmul_precision = options.matmul_precision
        self.scaling = options.scaling
        self.adam_betas = options.adam_betas
        self.adam_eps = options.adam_eps
        self.basis_update = options.basis_update
        self.pi_damping = options.pi_damping
        self.factor_samples = options.factor_samples
        self.measures_staleness = options.measures_staleness
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        self.grad_worker_fraction = resolve_grad_worker_fraction(
            options.grad_worker_fraction, self.world_size
        )

        self._factor_update_steps = options.factor_update_steps
        self._inv_update_steps = options.inv_update_steps
        self._damping = options.damping
        self._factor_decay = options.factor_decay
        self._kl_clip = options.kl_clip
        self._lr = options.lr
        self.allreduce_bucket_cap_mb = options.allreduce_bucket_cap_mb
        self.colocate_factors = options.colocate_factors
        self.compute_eigenvalue_outer_product = options.compute_eigenvalue_outer_product
        self.symmetry_aware = options.symmetry_aware
        self.loglevel = options.loglevel
        # Host seconds per phase (kaisa_ray.timing); read and zero with times.reset().
        self.times = PhaseTimes()

        self.skip_layers = list(options.skip_layers)
        found, skipped = discover(
            model,
            skip_layers=self.skip_layers,
            kfac_approx=self.kfac_approx,
            sequence_approx=self.sequence_approx,
            factor_dtype=options.factor_dtype,
            inv_dtype=options.inv_dtype,
            embeddings=options.embeddings,
        )
        if not found:
            raise ConfigurationError(
                "model has nothing to precondition: K-FAC registers nn.Linear and nn.Conv2d "
                f"layers with trainable weights and found none (left alone: "
                f"{', '.join(skipped) or 'no parametrised modules'}). Loosen skip_layers, "
                "unfreeze a layer, or train this model with the base optimizer alone."
            )
        self._layers = kfac_layers(found, options)
        registered = [(reg.module, layer) for reg, layer in zip(found, self._layers, strict=True)]
        self._by_name = {layer.name: layer for layer in self._layers}

        # FSDP2 (checked now: a sharding K-FAC cannot take is refused before the first step)
        sharded = sharded_layers(((reg.name, reg.module) for reg in found), self.world_size)
        embedded = [reg.name for reg in found if isinstance(reg.helper, EmbeddingHelper)]
        if sharded and embedded:
            raise ConfigurationError(
                f"embeddings=True with FSDP2: the embeddings {', '.join(embedded)} are sharded "
                "by rows of the vocabulary, which K-FAC does not take; leave embeddings off "
                "(they go to the optimizer) or skip them (skip_layers)."
            )
        self.plan: Plan = build_plan(
            [reg.planned() for reg in found],
            self.world_size,
            self.grad_worker_fraction,
            Options(
                compute_method=self.compute_method,
                compute_eigenvalue_outer_product=options.compute_eigenvalue_outer_product,
                symmetry_aware=options.symmetry_aware,
                assignment_strategy=self.assignment_strategy,
                colocate_factors=options.colocate_factors,
                allreduce_bucket_cap_mb=options.allreduce_bucket_cap_mb,
                staleness_probes=PROBES if self.measures_staleness else 0,
                scaling=self.scaling,
                parallel=Parallel.FSDP if sharded else Parallel.DDP,
                factor_reduction=options.factor_reduction,
            ),
        )
        self.assignment = self.plan.assignment
        self._comm = Communicator(
            self.plan.schedule,
            self.rank,
            symmetric=options.symmetry_aware,
            device=self._layers[0].helper.weight().device,
        )

        self._hooks = FactorHooks(
            registered,
            self._comm,
            self.times,
            self._products,
            update_in_hook=options.update_factors_in_hook,
            accumulation_steps=options.accumulation_steps,
            factor_scale=options.factor_scale,
            world_size=self.world_size,
            symmetry_aware=options.symmetry_aware,
            grad_scaler=options.grad_scaler,
        )

        names = [layer.name for layer in self._layers]
        # When each layer updates: fixed (the reference) or adapted to measured staleness.
        self.schedule = (
            IntervalSchedule.adaptive(names, options.intervals)
            if options.intervals is not None
            else IntervalSchedule.fixed(
                names, options.factor_update_steps, options.inv_update_steps
            )
        )
        self._tracker = StalenessTracker(
            self._layers,
            self.assignment,
            self.rank,
            self.world_size,
            loglevel=options.loglevel,
            times=self.times,
        )

        if options.cuda_graphs:
            require_cuda(self._layers)
        # FSDP2: whether it shards the layers now, and the rows' exchange while a step runs
        self._sharding = ShardingWatch(self._layers, self.rank, self.world_size)
        self._rows: RowExchange | None = None
        self._steps = 0
        self.skipped_factor_updates = 0
        # Kept on the device from the first step on, so that a step need not wait for them
        # (skipped_steps and last_grad_scale read them).
        self._setter = GradientSetter()
        # This rank's preconditioning: its layers batched by shape, the results sent on, set.
        self._preconditioning = Preconditioning(
            self._layers,
            self._comm,
            self._preconditions,
            self.times,
            self._setter,
            self._products,
            cuda_graphs=options.cuda_graphs,
        )
        self.last_updates: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        self._plan_step(0)
        logger.log(
            options.loglevel,
            "KFACPreconditioner preconditions %d layers: %s; leaves to the optimizer: %s",
            len(self._layers),
            described(self._layers),
            ", ".join(skipped) or "nothing",
        )

    # -- hyperparameters at the current step ----------------------------------------------

    @property
    def cuda_graphs(self) -> bool:
        """Whether a step made of shape groups alone replays from a CUDA graph."""
        return self._preconditioning.cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, value: bool) -> None:
        self._preconditioning.cuda_graphs = value

    @property
    def accumulation_steps(self) -> int:
        """Forward/backward passes per optimizer step (the factor hooks' setting)."""
        return self._hooks.accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        self._hooks.accumulation_steps = value

    @property
    def update_factors_in_hook(self) -> bool:
        """Whether the hooks build the batch factors (else ``step()`` does)."""
        return self._hooks.update_in_hook

    @update_factors_in_hook.setter
    def update_factors_in_hook(self, value: bool) -> None:
        self._hooks.update_in_hook = value

    @property
    def steps(self) -> int:
        """Number of completed ``step()`` calls: the K-FAC step hyperparameters are called with."""
        return self._steps

    @property
    def damping(self) -> float:
        return resolve("damping", self._damping, self._steps, DAMPING)

    @property
    def factor_decay(self) -> float:
        return resolve("factor_decay", self._factor_decay, self._steps, FACTOR_DECAY)

    @property
    def kl_clip(self) -> float | None:
        if self._kl_clip is None:
            return None
        return resolve("kl_clip", self._kl_clip, self._steps, KL_CLIP)

    @property
    def lr(self) -> float:
        return resolve("lr", self._lr, self._steps, LR)

    @property
    def factor_update_steps(self) -> int:
        return resolve_int("factor_update_steps", self._factor_update_steps, self._steps)

    @property
    def inv_update_steps(self) -> int:
        return resolve_int("inv_update_steps", self._inv_update_steps, self._steps)

    @property
    def layers(self) -> tuple[KFACLayer, ...]:
        return tuple(self._layers)

    def _plan_step(self, step: int) -> None:
        """Which layers update their factors on ``step`` (the forward hooks need it before
        ``step()``), and the factor buckets the communicator launches for them."""
        now = self.schedule.factor_layers(step)
        self._hooks.plan(step, now)
        self._comm.use_factor_buckets(self.plan.schedule.restricted(now, ()))

    @property
    def _factor_now(self) -> frozenset[str]:
        """The layers whose factors the current step updates."""
        return self._hooks.now

    # -- the step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of the registered layers in place.

        On factor-update steps the batch factors seen since the last step (averaged over ranks)
        enter the running averages, unless a gradient or a factor is not finite (the step is
        then skipped for the factors and counted in ``skipped_factor_updates``). On
        inverse-update steps the decompositions are recomputed. If a gradient is not finite
        (a GradScaler overflow), the gradients are left as they are for the scaler to skip,
        and ``skipped_steps`` counts it. With several ranks every rank must call ``step()``;
        gradients must already be averaged over ranks (DDP does this; FSDP2's ``fully_shard``
        too: the step then works on the layers' whole gradients and leaves each rank its rows,
        see docs/fsdp.md).

        A step that updates neither factors nor decompositions never waits for the device:
        whether the gradients were finite, the KL clip's scale and the skipped-step count are
        decided on the device (read ``skipped_steps`` or ``last_grad_scale`` to wait).
        """
        sharded = self._sharded_now()
        factor_step = bool(self._factor_now)
        if factor_step:
            if not self.update_factors_in_hook:
                self._hooks.factor_saved()
            self._hooks.reduce()
        if sharded is None:
            self._step(factor_step)
            return
        if isinstance(sharded, RowExchange):
            with self.times.phase("communication"):
                sharded.gather()
            self._rows = sharded
            try:  # each rank's rows are set in place (on an error, as backward left them)
                self._step(factor_step)
            finally:
                self._rows = None
                sharded.release()
            return
        with self.times.phase("communication"):
            wholes = sharded.gather()
        try:
            self._step(factor_step)
        finally:  # on an error the shards stay as backward left them
            wholes.release()
        wholes.write_back()

    def _sharded_now(self) -> ShardedGradients | RowExchange | None:
        """Whole gradients for a model FSDP2 shards (built sharded or sharded since), else None:
        whether the first layer's weight is a ``DTensor`` decides, checked every step."""
        keeper, self.plan = self._sharding.now(
            self.plan, self._comm, self.grad_worker_fraction, cuda_graphs=self.cuda_graphs
        )
        return keeper

    def _step(self, factor_step: bool) -> None:
        """The step after its factors' reduction (and, under FSDP2, the gradients' gather)."""
        step = self._steps
        damping = self.damping
        active = [layer for layer in self._layers if layer.helper.has_grad()]
        times = self.times
        decompose = self.schedule.decomposition_layers(step)
        grads_finite: bool | None = None  # known where the step waits for the device anyway
        if factor_step:
            with times.phase("factors"):
                grads_finite, skipped = fold_factors(
                    self._layers,
                    active,
                    self._rows,
                    self.factor_decay,
                    self._comm.agree if self.plan.options.deferred else None,
                )
            if skipped:
                self.skipped_factor_updates += 1
                logger.log(
                    self.loglevel,
                    "K-FAC step %d: non-finite factors or gradients; "
                    "the running averages skip this step",
                    step,
                )
        for layer in self._layers:
            layer.reset_batch()
        self._comm.reset()

        stale: dict[str, torch.Tensor] = {}
        if self.measures_staleness and (self._factor_now or decompose):
            if grads_finite is None:
                grads_finite = all_finite(active, [], self._rows)[0]
            with times.phase("staleness"):
                stale = self._tracker.before_decompositions(
                    self._factor_now, decompose, grads_finite, damping, self._products
                )
        if decompose:
            update_decompositions(
                self._layers,
                decompose,
                damping,
                assignment=self.assignment,
                rank=self.rank,
                comm=self._comm,
                schedule=self.plan.schedule.restricted(self._factor_now, decompose),
                times=times,
            )

        preconditioned: Mapping[str, torch.Tensor] = {}
        if active:
            preconditioned = self._preconditioning.run(
                active, damping, self.kl_clip, self.lr, self._rows
            )

        if self.measures_staleness and decompose:
            with times.phase("staleness"):
                self._tracker.after_decompositions(
                    step, decompose, stale, preconditioned, self._comm, self.schedule
                )
        if factor_step or decompose:  # the step waited for the device anyway
            self._setter.warn_skipped(self._steps)

        # What this step updated: with ``plan.calls_at`` it names the step's collectives.
        self.last_updates = (self._factor_now, decompose)
        self._steps += 1
        self._plan_step(self._steps)

    # -- staleness --------------------------------------------------------------------------

    def staleness(self) -> list[LayerStaleness]:
        """Each layer's intervals now, why, and how stale its curvature was: the latest factor
        change since its last decomposition and what its last decomposition step measured
        (``kaisa_ray.staleness``). Empty unless staleness is measured."""
        if not self.measures_staleness:
            return []
        return self._tracker.readings(self.schedule, self._steps)

    def interval_changes(self) -> list[IntervalChange]:
        """The layers' moves between rungs since the last call (adaptive intervals)."""
        return self._tracker.interval_changes()

    def _preconditions(self, layer: KFACLayer) -> bool:
        return self.assignment.is_grad_worker(layer.name, self.rank)

    @property
    def skipped_steps(self) -> int:
        """Steps whose gradients were left as they were because one was not finite (reading
        it waits for the device)."""
        return self._setter.skipped_steps

    @property
    def last_grad_scale(self) -> float:
        """The KL clip's scale on the last step that set the gradients (1.0 without a clip;
        reading it waits for the device)."""
        return self._setter.last_grad_scale

    def _products(self) -> contextlib.AbstractContextManager[None]:
        """K-FAC's factor and preconditioning products at ``matmul_precision``."""
        return matmul_precision(self.matmul_precision)

    # -- accounting, checkpoints -----------------------------------------------------------

    def reset_batch(self) -> None:
        """Forget the factors of micro-batches seen since the last step."""
        for layer in self._layers:
            layer.reset_batch()

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state held now, by category, plus ``total``. Exact, not estimated."""
        graphed = self._preconditioning.graph_bytes
        sizes = {"factors": 0, "decompositions": 0, "buffers": self._setter.nbytes + graphed}
        for layer in self._layers:
            for key, value in layer.memory_usage().items():
                sizes[key] += value
        sizes["total"] = sum(sizes.values())
        return sizes

    def _hyperparameters(self) -> dict[str, float | int | None]:
        named: dict[str, Any] = {
            "factor_update_steps": self._factor_update_steps,
            "inv_update_steps": self._inv_update_steps,
            "damping": self._damping,
            "factor_decay": self._factor_decay,
            "kl_clip": self._kl_clip,
            "lr": self._lr,
        }
        return {k: v for k, v in named.items() if not callable(v)}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: step, counters, factors and decompositions.

        The result is complete and portable: it loads under any world size and strategy.
        When ``grad_worker_fraction < 1`` each rank holds only some layers' decompositions, so
        this call gathers the rest and is collective: call it on every rank (any rank's
        result is the whole checkpoint). With ``factor_reduction='deferred'`` it is collective
        too: every rank's running factors are averaged in place first.
        """
        if self.plan.options.deferred and self.world_size > 1 and self._steps > 0:
            # every rank's running factors averaged in place first, as a decomposition step
            # would: the checkpoint holds what every rank holds then (collective)
            with self.times.phase("communication"):
                reduce_averages(self._by_name, self._comm, self.plan.schedule)
        layers = checkpoint.layer_states(
            self._layers,
            self.assignment,
            self.rank,
            self._comm.group(tuple(range(self.world_size))) if self.world_size > 1 else None,
            gather=self._steps > 0 and self.assignment.grad_workers < self.world_size,
        )
        return {
            "steps": self._steps,
            "skipped_factor_updates": self.skipped_factor_updates,
            "skipped_steps": self.skipped_steps,
            "intervals": self.schedule.state_dict(),
            "compute_method": str(self.compute_method),
            "world_size": self.world_size,
            "grad_worker_fraction": self.grad_worker_fraction,
            "hyperparameters": self._hyperparameters(),
            "layers": layers,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; decompositions missing or of another method are rebuilt.

        Raises:
            StateDictError: if the layers or their shapes differ from this model's.
        """
        checkpoint.validate(self._layers, state_dict)
        ours = self._hyperparameters()
        for name, value in state_dict.get("hyperparameters", {}).items():
            current = ours.get(name)
            if name in ours and current != value:
                logger.log(
                    self.loglevel,
                    "checkpoint has %s=%r; keeping this preconditioner's %r",
                    name,
                    value,
                    current,
                )
        rebuild = checkpoint.restore(
            self._layers,
            state_dict["layers"],
            self.assignment,
            self.rank,
            same_method=state_dict.get("compute_method") == str(self.compute_method),
        )
        self._steps = int(state_dict["steps"])
        self.skipped_factor_updates = int(state_dict.get("skipped_factor_updates", 0))
        self._setter.restart_count(int(state_dict.get("skipped_steps", 0)))
        for problem in self.schedule.load_state_dict(state_dict.get("intervals") or {}):
            logger.log(
                self.loglevel, "checkpoint's adaptive intervals: %s; starting rung kept", problem
            )
        self._tracker.clear()
        self._plan_step(self._steps)
        for layer in rebuild:  # every worker of the layer computes the same thing locally
            layer.update_decomposition(self.damping)

    def remove_hooks(self) -> None:
        """Detach from the model (the preconditioner is unusable afterwards)."""
        self._hooks.remove()

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in sorted(self._hyperparameters().items()))
        return (
            f"KFACPreconditioner(layers={len(self._layers)}, compute_method="
            f"{self.compute_method.value!r}, kfac_approx={self.kfac_approx.value!r}, "
            f"steps={self._steps}, {params})"
        )
