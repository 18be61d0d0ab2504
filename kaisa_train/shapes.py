"""A registered model as shapes: what ``kaisa-ray plan`` needs, computed on the meta device.

``workload(name, batch_size=...)`` builds the model under ``torch.device("meta")`` (parameters
with shapes and no storage: BERT-Large's 1.3 GB of weights take no memory), runs one forward
pass of a meta batch and reads, without computing anything:

- the layers K-FAC registers (``kaisa_ray.plan.layer_shapes``, the preconditioner's own rule)
  and, from hooks on them, the rows each layer's A and G batch factors are built from (a
  Linear's leading dimensions, e.g. batch × sequence; a Conv2d's batch × output positions with
  ``expand``, the batch with ``reduce``);
- the tensors autograd keeps for backward (``saved_tensors_hooks``), which is the activation
  memory of a training step at this batch size;
- the forward flops (``torch.utils.flop_counter``).

Models say how a batch of their input looks with an ``example_input(batch_size)`` method (the
large models here have one); the small built-in ones are listed below. KAISA's authors' layer
choices come with each model (``PLANNING[name].skip_layers``).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from kaisa_ray.enums import KFACApprox, Precision
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.registration import discover
from kaisa_train.registry import BUILTIN_MODELS, model_factory
from kaisa_train.shape_table import BATCHES, PLANNING, TABLE, Planning, entry, with_options
from tuner.forecast import Workload

__all__ = ["PLANNING", "Planning", "build_on_meta", "table", "workload"]

logger = logging.getLogger(__name__)


def build_on_meta(name: str, params: Mapping[str, Any] | None = None) -> nn.Module:
    """The registered model ``name`` with shapes only (no parameter memory)."""
    try:
        factory = model_factory(name)
    except KeyError as err:
        raise ConfigurationError(str(err.args[0])) from err
    try:
        with torch.device("meta"):
            model = factory(**dict(params or {}))
    except TypeError as err:
        raise ConfigurationError(f"model {name!r} does not take these params: {err}") from err
    return model


def example_batch(name: str, model: nn.Module, batch_size: int) -> torch.Tensor:
    """A batch of registered model ``name``'s input (its ``example_input`` or its planning's;
    on the meta device for a model built there)."""
    method = getattr(model, "example_input", None)
    if callable(method):
        found = method(batch_size)
        if isinstance(found, torch.Tensor):
            return found
    planning = PLANNING.get(name)
    if planning is None or planning.example_input is None:
        raise ConfigurationError(
            f"model {name!r} does not say what its input looks like, so it cannot be planned: "
            "give it an example_input(batch_size) method returning a batch of its input"
        )
    return planning.example_input(model, batch_size)


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage._cdata, storage.nbytes()


def workload(
    name: str,
    *,
    batch_size: int,
    params: Mapping[str, Any] | None = None,
    kfac_approx: str = KFACApprox.EXPAND,
    sequence_approx: str = KFACApprox.EXPAND,
    skip_layers: Iterable[str] | None = None,
    embeddings: bool = False,
    **options: Any,
) -> Workload:
    """What one rank's step of model ``name`` at ``batch_size`` is, from its shapes.

    Args:
        skip_layers: K-FAC's ``skip_layers``; None takes the model's default
            (``PLANNING[name].skip_layers``, KAISA's authors' choice).
        embeddings: K-FAC's ``embeddings``: the model's ``nn.Embedding`` layers registered.
        options: the job's ``precision``, ``optimizer``, ``compute_method`` and ``scaling``
            (``shape_table.with_options``).

    Example:
        >>> w = workload("resnet50", batch_size=32)
        >>> len(w.layers), max(layer.a_dim for layer in w.layers)
        (54, 4608)
    """
    if batch_size < 1:
        raise ConfigurationError(f"batch_size={batch_size} must be at least 1")
    model = build_on_meta(name, params)
    planning = PLANNING.get(name, Planning())
    skips = list(planning.skip_layers if skip_layers is None else skip_layers)
    registered, _ = discover(
        model, skip_layers=skips, kfac_approx=kfac_approx, embeddings=embeddings
    )
    rows: dict[str, tuple[int, int]] = {}
    moved: dict[str, tuple[int, int]] = {}
    patches = 0

    def hook(layer_name: str, module: nn.Module) -> Callable[..., None]:
        def seen(_module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            nonlocal patches
            if isinstance(module, nn.Conv2d):
                n, oh, ow = output.shape[0], output.shape[-2], output.shape[-1]
                positions = n * oh * ow
                a_rows = n if kfac_approx == KFACApprox.REDUCE else positions
                if kfac_approx != KFACApprox.REDUCE:
                    in_dim = module.in_channels * math.prod(module.kernel_size)
                    patches = max(patches, 4 * in_dim * positions)
                rows[layer_name] = (a_rows, a_rows)
                in_dim = module.in_channels * math.prod(module.kernel_size)
                moved[layer_name] = (
                    inputs[0].numel() * module.kernel_size[0]  # position sums, a row at a time
                    if kfac_approx == KFACApprox.REDUCE
                    else positions * in_dim,  # the patch matrix, copied once
                    output.numel(),  # the output gradient summed or permuted
                )
            elif isinstance(module, nn.Embedding):  # indices: every one a row, A counted
                count = inputs[0].numel()
                rows[layer_name] = (count, count)
                moved[layer_name] = (count, 0)
            else:
                x = inputs[0]
                reduced = sequence_approx == KFACApprox.REDUCE and x.dim() > 2
                count = x.shape[0] if reduced else math.prod(x.shape[:-1])
                rows[layer_name] = (count, count)
                # reduced: the input's mean and the output gradient's sum read every token
                moved[layer_name] = (x.numel(), output.numel() if reduced else 0)

        return seen

    handles = [r.module.register_forward_hook(hook(r.name, r.module)) for r in registered]
    parameters = {_storage(p)[0] for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage(tensor)
        if key not in parameters:
            saved[key] = nbytes
        return tensor

    x = example_batch(name, model, batch_size)
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            FlopCounterMode(display=False) as flops,
        ):
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    missing = [r.name for r in registered if r.name not in rows]
    if missing:
        raise ConfigurationError(
            f"model {name!r}: K-FAC layers {', '.join(missing)} are not used by its forward "
            "pass; skip them (skip_layers) to plan it"
        )
    job = Workload(
        model=name,
        batch_size=batch_size,
        seq_len=int(x.shape[1]) if planning.seq_len_param else None,
        precision=Precision.FP32,
        layers=tuple(r.planned() for r in registered),
        rows=tuple(rows[r.name] for r in registered),
        moved=tuple(moved[r.name] for r in registered),
        patch_bytes=patches,
        parameters=sum(p.numel() for p in model.parameters()),
        activation_bytes=sum(saved.values()),
        forward_flops=float(flops.get_total_flops()),
        kfac_approx=str(KFACApprox(kfac_approx)),
        sequence_approx=str(KFACApprox(sequence_approx)),
    )
    return with_options(job, **options)


def table() -> dict[str, Any]:
    """``shape_table.json`` as the code makes it now: every registered built-in model that
    says what its input looks like, at its default parameters, under each approximation."""
    out: dict[str, Any] = {}
    for name in sorted(BUILTIN_MODELS):
        try:
            out[name] = {
                str(approx): entry(
                    {b: workload(name, batch_size=b, kfac_approx=approx) for b in BATCHES}
                )
                for approx in KFACApprox
            }
        except ConfigurationError as err:
            if "does not say what its input looks like" not in str(err):
                raise
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m kaisa_train.shapes --write``: rewrite the stored shapes."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {TABLE.name}")
    args = parser.parse_args(argv)
    rows = [
        f"{json.dumps(name)}: {json.dumps(value, separators=(',', ':'), sort_keys=True)}"
        for name, value in sorted(table().items())
    ]
    text = "{\n" + ",\n".join(rows) + "\n}\n"  # a model a line, for readable diffs
    if args.write:
        TABLE.write_text(text)
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logger.info("wrote %s (%d bytes)", TABLE, len(text))
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
