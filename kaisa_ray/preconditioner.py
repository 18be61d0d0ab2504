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
import math
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from kaisa_ray.enums import (
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    KFACApprox,
    parse_enum,
)
from kaisa_ray.errors import ConfigurationError, StateDictError
from kaisa_ray.hyperparams import (
    Bounds,
    FloatParam,
    IntParam,
    check_param,
    resolve,
    resolve_int,
)
from kaisa_ray.kfac_layer import KFACLayer
from kaisa_ray.layers import describe_shapes, make_helper
from kaisa_ray.strategy import resolve_grad_worker_fraction

logger = logging.getLogger(__name__)

DAMPING = Bounds(
    low=0.0,
    low_inclusive=False,
    advice="Use a positive damping such as 0.003 (small steps damp less) to 0.1.",
)
FACTOR_DECAY = Bounds(
    low=0.0,
    high=1.0,
    high_inclusive=False,
    advice="Use a running-average decay in [0, 1), typically 0.95.",
)
KL_CLIP = Bounds(
    low=0.0, low_inclusive=False, advice="Use a positive kl_clip such as 0.001, or None to disable."
)
LR = Bounds(low=0.0, advice="Pass the optimizer's learning rate (a float >= 0 or a schedule).")


class _Scaler(Protocol):
    def get_scale(self) -> float: ...


GradScalerLike = _Scaler | Callable[[], float]


def _skip_reason(name: str, module: nn.Module, patterns: Sequence[re.Pattern[str]]) -> str | None:
    cls = type(module).__name__
    if any(p.match(name) or p.match(cls) for p in patterns):
        return "skip_layers"
    if cls == "NonDynamicallyQuantizableLinear":
        return "used by MultiheadAttention through its weight, not its forward"
    weight = getattr(module, "weight", None)
    if isinstance(weight, nn.parameter.UninitializedParameter):
        raise ConfigurationError(
            f"layer {name!r} is a lazy module that has not been initialised; run one forward "
            "pass before creating the KFACPreconditioner."
        )
    if not isinstance(weight, torch.Tensor) or not weight.requires_grad:
        return "frozen"
    return None


def _default_dtype(requested: torch.dtype | None, module: nn.Module) -> torch.dtype:
    if requested is not None:
        if not requested.is_floating_point:
            raise ConfigurationError(f"dtype {requested} is not a floating-point dtype.")
        return requested
    weight = getattr(module, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
    return torch.promote_types(dtype, torch.float32)


class KFACPreconditioner:
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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigurationError(
                f"model must be a torch.nn.Module; got {type(model).__name__}."
            )
        for name, value in (
            ("factor_update_steps", factor_update_steps),
            ("inv_update_steps", inv_update_steps),
        ):
            if not callable(value):
                resolve_int(name, value, 0)
        check_param("damping", damping, DAMPING)
        check_param("factor_decay", factor_decay, FACTOR_DECAY)
        if kl_clip is not None:
            check_param("kl_clip", kl_clip, KL_CLIP)
        check_param("lr", lr, LR)
        if (
            isinstance(accumulation_steps, bool)
            or not isinstance(accumulation_steps, int)
            or (accumulation_steps < 1)
        ):
            raise ConfigurationError(
                f"accumulation_steps={accumulation_steps!r} must be a positive integer: the "
                "number of forward/backward passes per optimizer step (1 without accumulation)."
            )
        if not allreduce_bucket_cap_mb > 0:
            raise ConfigurationError(
                f"allreduce_bucket_cap_mb={allreduce_bucket_cap_mb!r} must be positive (25 is "
                "the usual value)."
            )
        if (
            not callable(factor_update_steps)
            and not callable(inv_update_steps)
            and inv_update_steps % factor_update_steps != 0
        ):
            suggested = factor_update_steps * max(1, round(inv_update_steps / factor_update_steps))
            warnings.warn(
                f"inv_update_steps={inv_update_steps} is not a multiple of "
                f"factor_update_steps={factor_update_steps}: some decompositions will be "
                "recomputed from unchanged factors. Use a multiple, e.g. "
                f"inv_update_steps={suggested}.",
                UserWarning,
                stacklevel=2,
            )

        self.compute_method = parse_enum(ComputeMethod, compute_method, "compute_method")
        self.assignment_strategy = parse_enum(
            AssignmentStrategy, assignment_strategy, "assignment_strategy"
        )
        self.kfac_approx = parse_enum(KFACApprox, kfac_approx, "kfac_approx")
        self.world_size = (
            dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        )
        self.grad_worker_fraction = resolve_grad_worker_fraction(
            grad_worker_fraction, self.world_size
        )
        if self.world_size > 1:
            raise ConfigurationError(
                f"torch.distributed is initialised with world size {self.world_size}, but this "
                "build of kaisa_ray preconditions in one process only; running it per rank "
                "would let the ranks' factors drift apart. Use a single process for now."
            )

        self._factor_update_steps = factor_update_steps
        self._inv_update_steps = inv_update_steps
        self._damping = damping
        self._factor_decay = factor_decay
        self._kl_clip = kl_clip
        self._lr = lr
        self.accumulation_steps = accumulation_steps
        self.allreduce_bucket_cap_mb = allreduce_bucket_cap_mb
        self.colocate_factors = colocate_factors
        self.compute_eigenvalue_outer_product = compute_eigenvalue_outer_product
        self.symmetry_aware = symmetry_aware
        self.update_factors_in_hook = update_factors_in_hook
        self.loglevel = loglevel
        self._grad_scaler = grad_scaler
        self._grad_scale_cache: tuple[int, float] | None = None
        self.last_grad_scale = 1.0

        if isinstance(skip_layers, str):
            skip_layers = [skip_layers]
        self.skip_layers = list(skip_layers or [])
        try:
            patterns = [re.compile(p) for p in self.skip_layers]
        except re.error as exc:
            raise ConfigurationError(
                f"skip_layers contains an invalid regular expression: {exc}."
            ) from exc

        self._layers: list[KFACLayer] = []
        self._by_module: dict[nn.Module, KFACLayer] = {}
        skipped: list[str] = []
        for name, module in model.named_modules():
            helper = make_helper(module, self.kfac_approx)
            if helper is None:
                if any(True for _ in module.parameters(recurse=False)):
                    skipped.append(f"{name or '<root>'} ({type(module).__name__})")
                continue
            reason = _skip_reason(name, module, patterns)
            if reason is not None:
                skipped.append(f"{name} ({type(module).__name__}: {reason})")
                continue
            if module in self._by_module:  # the same module registered under two names
                continue
            layer = KFACLayer(
                name,
                helper,
                compute_method=self.compute_method,
                outer_product=compute_eigenvalue_outer_product,
                factor_dtype=_default_dtype(factor_dtype, module),
                inv_dtype=_default_dtype(inv_dtype or factor_dtype, module),
            )
            self._layers.append(layer)
            self._by_module[module] = layer
        if not self._layers:
            raise ConfigurationError(
                "model has nothing to precondition: K-FAC registers nn.Linear and nn.Conv2d "
                f"layers with trainable weights and found none (left alone: "
                f"{', '.join(skipped) or 'no parametrised modules'}). Loosen skip_layers, "
                "unfreeze a layer, or train this model with the base optimizer alone."
            )

        self._handles = []
        for module in self._by_module:
            self._handles.append(module.register_forward_hook(self._forward_hook))

        self._steps = 0
        self.skipped_factor_updates = 0
        self.skipped_steps = 0
        self._factor_step = self._is_factor_step(0)
        logger.log(
            loglevel,
            "KFACPreconditioner preconditions %d layers: %s; leaves to the optimizer: %s",
            len(self._layers),
            ", ".join(
                f"{lay.name} {type(lay.helper.module).__name__} [{describe_shapes(lay.helper)}]"
                for lay in self._layers
            ),
            ", ".join(skipped) or "nothing",
        )

    # -- hyperparameters at the current step ----------------------------------------------

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

    def _is_factor_step(self, step: int) -> bool:
        return step % resolve_int("factor_update_steps", self._factor_update_steps, step) == 0

    # -- hooks -----------------------------------------------------------------------------

    def _grad_scale(self) -> float:
        if self._grad_scaler is None:
            return 1.0
        if self._grad_scale_cache is not None and self._grad_scale_cache[0] == self._steps:
            return self._grad_scale_cache[1]
        scaler = self._grad_scaler
        get: Callable[[], float] = getattr(scaler, "get_scale", scaler)  # type: ignore[arg-type]
        scale = float(get())
        if not scale > 0:
            scale = 1.0  # a disabled GradScaler reports 1.0; anything else is not a scale
        self._grad_scale_cache = (self._steps, scale)
        return scale

    def _forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not (module.training and self._factor_step and torch.is_grad_enabled()):
            return
        if not isinstance(output, torch.Tensor) or not output.requires_grad or not args:
            return
        layer = self._by_module[module]
        inputs = args[0]
        with torch.no_grad():
            if self.update_factors_in_hook:
                layer.add_input(inputs)
            else:
                layer.saved_inputs.append(inputs.detach().clone())

        def on_grad(grad: torch.Tensor) -> None:
            with torch.no_grad():
                if self.update_factors_in_hook:
                    layer.add_grad_output(grad, self._grad_scale())
                else:
                    layer.saved_grad_outputs.append(grad.detach().clone())

        output.register_hook(on_grad)  # type: ignore[no-untyped-call]

    # -- the step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of the registered layers in place.

        On factor-update steps the batch factors seen since the last step enter the running
        averages, unless a gradient or a factor is not finite (the step is then skipped for
        the factors and counted in ``skipped_factor_updates``). On inverse-update steps the
        decompositions are recomputed. If a gradient is not finite (a GradScaler overflow),
        the gradients are left as they are for the scaler to skip, and ``skipped_steps``
        counts it.
        """
        step = self._steps
        damping = self.damping
        active = [layer for layer in self._layers if layer.helper.has_grad()]
        for layer in self._layers:
            if not self.update_factors_in_hook and self._factor_step:
                layer.factor_saved(self._grad_scale())
        grads = [layer.helper.grad() for layer in active]
        batches = [(layer, layer.batch_factors()) for layer in self._layers]
        ready = [(layer, b) for layer, b in batches if b is not None]

        checks = [torch.isfinite(g).all() for g in grads]
        n_grads = len(checks)
        for _, (a, g) in ready:
            checks += [torch.isfinite(a).all(), torch.isfinite(g).all()]
        flags = torch.stack(checks).tolist() if checks else []
        grads_finite = all(flags[:n_grads])
        factors_finite = all(flags[n_grads:])

        if ready:
            if grads_finite and factors_finite:
                decay = self.factor_decay
                for layer, (a, g) in ready:
                    layer.fold(a, g, decay)
            else:
                self.skipped_factor_updates += 1
                logger.log(
                    self.loglevel,
                    "K-FAC step %d: non-finite factors or gradients; "
                    "the running averages skip this step",
                    step,
                )
        for layer in self._layers:
            layer.reset_batch()

        if step % self.inv_update_steps == 0:
            for layer in self._layers:
                layer.update_decomposition(damping)

        if grads_finite and active:
            self._precondition(active, damping)
        elif active:
            self.skipped_steps += 1

        self._steps += 1
        self._factor_step = self._is_factor_step(self._steps)

    def _precondition(self, active: list[KFACLayer], damping: float) -> None:
        pairs = [layer.preconditioned_grad(damping) for layer in active]
        kl_clip = self.kl_clip
        dots = torch.stack([(p * g).sum().to(torch.float64) for g, p in pairs])
        finite = torch.stack([torch.isfinite(p).all() for _, p in pairs]).all()
        vg_sum, ok = float(dots.sum()), bool(finite)
        if not ok or not math.isfinite(vg_sum):
            self.skipped_steps += 1
            warnings.warn(
                f"K-FAC step {self._steps}: a preconditioned gradient was not finite; the raw "
                "gradients are kept for this step. Raise damping if this repeats.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        scale = 1.0
        if kl_clip is not None:
            vg_sum *= self.lr**2
            if vg_sum != 0.0:
                scale = min(1.0, math.sqrt(kl_clip / abs(vg_sum)))
        self.last_grad_scale = scale
        for layer, (_, preconditioned) in zip(active, pairs, strict=True):
            layer.helper.set_grad(preconditioned * scale if scale != 1.0 else preconditioned)

    # -- accounting, checkpoints -----------------------------------------------------------

    def reset_batch(self) -> None:
        """Forget the factors of micro-batches seen since the last step."""
        for layer in self._layers:
            layer.reset_batch()

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state held now, by category, plus ``total``. Exact, not estimated."""
        sizes = {"factors": 0, "decompositions": 0, "buffers": 0}
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
        """Everything needed to resume exactly: step, counters, factors and decompositions."""
        return {
            "steps": self._steps,
            "skipped_factor_updates": self.skipped_factor_updates,
            "skipped_steps": self.skipped_steps,
            "compute_method": str(self.compute_method),
            "hyperparameters": self._hyperparameters(),
            "layers": {layer.name: layer.state_dict() for layer in self._layers},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; decompositions missing or of another method are rebuilt.

        Raises:
            StateDictError: if the layers or their shapes differ from this model's.
        """
        if "steps" not in state_dict or "layers" not in state_dict:
            raise StateDictError(
                "not a KFACPreconditioner state dict (keys 'steps' and 'layers' are missing); "
                "pass the object returned by KFACPreconditioner.state_dict()."
            )
        saved = state_dict["layers"]
        ours = {layer.name for layer in self._layers}
        if set(saved) != ours:
            missing, extra = sorted(ours - set(saved)), sorted(set(saved) - ours)
            raise StateDictError(
                f"checkpoint layers do not match this model: missing {missing}, unexpected "
                f"{extra}. Load it into the same model with the same skip_layers."
            )
        same_method = state_dict.get("compute_method") == str(self.compute_method)
        for name, value in state_dict.get("hyperparameters", {}).items():
            current = self._hyperparameters().get(name)
            if name in self._hyperparameters() and current != value:
                logger.log(
                    self.loglevel,
                    "checkpoint has %s=%r; keeping this preconditioner's %r",
                    name,
                    value,
                    current,
                )
        rebuild: list[KFACLayer] = []
        for layer in self._layers:
            entry = saved[layer.name]
            device = layer.helper.weight().device
            for key, dim in (("a_factor", layer.helper.a_dim), ("g_factor", layer.helper.g_dim)):
                tensor = entry.get(key)
                expected = (layer.helper.groups, dim, dim)
                if tensor is not None and tuple(tensor.shape) != expected:
                    raise StateDictError(
                        f"layer {layer.name!r}: checkpoint {key} has shape {tuple(tensor.shape)}, "
                        f"this model needs {expected}. Was the checkpoint saved from another model?"
                    )
                setattr(
                    layer,
                    key,
                    None
                    if tensor is None
                    else tensor.to(device=device, dtype=layer.factor_dtype).clone(),
                )
            decomposition = entry.get("decomposition") or {}
            if same_method and decomposition:
                layer.decomposition.load(decomposition, device)
            else:
                rebuild.append(layer)
            layer.reset_batch()
        self._steps = int(state_dict["steps"])
        self.skipped_factor_updates = int(state_dict.get("skipped_factor_updates", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._factor_step = self._is_factor_step(self._steps)
        for layer in rebuild:
            layer.update_decomposition(self.damping)

    def remove_hooks(self) -> None:
        """Detach from the model (the preconditioner is unusable afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in sorted(self._hyperparameters().items()))
        return (
            f"KFACPreconditioner(layers={len(self._layers)}, compute_method="
            f"{self.compute_method.value!r}, kfac_approx={self.kfac_approx.value!r}, "
            f"steps={self._steps}, {params})"
        )
