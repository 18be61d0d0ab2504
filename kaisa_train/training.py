"""Everything one worker trains with, built from the job's spec (``Training.build``): the
model (in DDP when distributed, or sharded by FSDP2 with ``scaling.parallel: fsdp``), its
shard of the data, the optimizer and lr schedule, mixed precision, and K-FAC as the job asks
for it (with ``kfac: auto``, as the tuner chooses on these workers).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa_ray.amp import MixedPrecision, optimizer_step
from kaisa_ray.enums import Parallel, Precision
from kaisa_ray.preconditioner import KFACPreconditioner
from kaisa_ray.quadratic import QuadraticModelStep
from kaisa_ray.sharding import shard_layers
from kaisa_train.optimizers import build_optimizer, build_preconditioner, lr_factor
from kaisa_train.records import KFACChoice, TunerRecord
from kaisa_train.registry import model_factory
from kaisa_train.shard import AnyShard, StreamData, distributed, load_shard
from kaisa_train.spec import JobSpec, KFACSpec

__all__ = ["Training"]


@dataclass
class Training:
    """One worker's job, and where it is (``step``, the best test accuracy so far)."""

    spec: JobSpec
    rank: int
    world: int
    device: torch.device
    model: nn.Module
    net: nn.Module  # the DDP wrapper when distributed, else the model itself (also FSDP2's)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    preconditioner: KFACPreconditioner | None
    shard: AnyShard
    max_steps: int
    precision: MixedPrecision
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    decided: KFACChoice | None = None  # what kfac: auto chose (kept in checkpoints)
    tuning: TunerRecord | None = None  # the tuner's record, when it chose in this attempt
    quadratic: QuadraticModelStep | None = None  # kfac.update: quadratic-model
    step: int = 0
    best: dict[str, float] = field(default_factory=dict)

    @property
    def sharded(self) -> bool:
        """The model is sharded by FSDP2 over the workers (its state is gathered to save)."""
        fsdp = self.spec.scaling.parallel is Parallel.FSDP
        return fsdp and self.net is self.model and self.world > 1

    @classmethod
    def build(
        cls,
        spec: JobSpec,
        *,
        rank: int,
        world: int,
        device: torch.device,
        decided: KFACChoice | None = None,
        stream: StreamData | None = None,
    ) -> Training:
        """Everything a worker trains with. With ``kfac: auto`` the tuner profiles this job on
        these workers and chooses (collective), unless ``decided`` says what it chose.
        ``stream``: a streamed dataset's splits for this worker (from Ray Train)."""
        shard = load_shard(spec.dataset, spec.seed, rank, world, stream)
        if spec.stop.max_steps is not None:
            max_steps = spec.stop.max_steps
        else:
            max_steps = (spec.stop.max_epochs or 1) * shard.steps_per_epoch
        torch.manual_seed(spec.seed)
        random.seed(spec.seed)
        model = model_factory(spec.model.name)(**spec.model.params).to(device)
        net: nn.Module = model
        if distributed() and world > 1:
            if spec.scaling.parallel is Parallel.FSDP:
                # the model is its own wrapper; bf16 as FSDP2 runs it (and autocast, as DDP's)
                bf16 = spec.precision is Precision.BF16
                shard_layers(model, spec.scaling.shard_units, bf16=bf16)
            else:
                net = DistributedDataParallel(
                    model, device_ids=[device.index] if device.type == "cuda" else None
                )
        kfac = spec.kfac if isinstance(spec.kfac, KFACSpec) else None
        optimizer = build_optimizer(spec.optimizer, model.parameters(), model, kfac)
        precision = MixedPrecision(mode=spec.precision, device_type=device.type)
        scaler = precision.grad_scaler()
        tuning = None
        if kfac is not None and kfac.auto:
            if decided is None:
                from kaisa_train.auto_choice import choose_in_workers  # needs Ray

                decided, tuning = choose_in_workers(
                    spec, kfac, net, optimizer, shard, device, precision
                )
            kfac = kfac.model_copy(update=decided.spec_fields())
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_factor(spec.optimizer.schedule, max_steps)
        )
        intervals = None
        if decided is not None and decided.adaptive is not None:
            intervals = decided.adaptive.intervals()
        quadratic = None
        if kfac is not None and kfac.quadratic_model:
            quadratic = QuadraticModelStep(
                model,
                damping=kfac.damping,
                min_damping=kfac.damping_floor,
            )
        preconditioner = (
            build_preconditioner(
                kfac,
                net,
                optimizer,
                scaler,
                intervals,
                # One damping: the preconditioner's follows the quadratic model's λ.
                damping=None if quadratic is None else quadratic.current_damping,
            )
            if kfac is not None
            else None
        )
        return cls(
            spec=spec,
            rank=rank,
            world=world,
            device=device,
            model=model,
            net=net,
            optimizer=optimizer,
            scheduler=scheduler,
            preconditioner=preconditioner,
            shard=shard,
            max_steps=max_steps,
            precision=precision,
            scaler=scaler,
            decided=decided,
            tuning=tuning,
            quadratic=quadratic,
        )

    def update(self, loss: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Backward and the step: the optimizer's from the preconditioned gradients, then the
        lr schedule's; or, with ``kfac.update: quadratic-model``, K-FAC's own on the factors'
        examples of the batch (no lr, so no schedule)."""
        if self.quadratic is None or self.preconditioner is None:
            optimizer_step(loss, self.optimizer, self.preconditioner, self.scaler)
            self.scheduler.step()
            return
        loss.backward()  # type: ignore[no-untyped-call]
        self.quadratic.capture()
        self.preconditioner.step()
        # The factors' examples of this worker's batch (kfac.factor_samples), else all of it.
        kfac = self.spec.kfac
        n = (kfac.factor_samples if isinstance(kfac, KFACSpec) else None) or inputs.shape[0]
        self.quadratic.step(inputs[:n], targets[:n])

    @property
    def lr(self) -> float:
        """The step size of the last step: the optimizer's lr, or the quadratic model's α."""
        if self.quadratic is not None and self.quadratic.last is not None:
            return self.quadratic.last.alpha
        return float(self.optimizer.param_groups[0]["lr"])
