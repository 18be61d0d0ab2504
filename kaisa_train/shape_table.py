"""The registered models as shapes stored ahead of time, so that planning needs no torch.

``kaisa-ray plan`` prices a model from what one forward pass on the meta device shows
(``kaisa_train.shapes.workload``): its K-FAC layers, the rows their factors are built from,
the activations autograd keeps and the forward flops. That pass needs torch, whose import alone
takes longer than the whole plan. So the built-in models' shapes at their default parameters
are stored here (``shape_table.json``, written by ``python -m kaisa_train.shapes --write``),
for both convolution approximations: the layers, and every quantity that grows with the batch
at batch sizes 1 and 2. Each such quantity is affine in the batch (rows are batch × positions,
activations and flops one term per example plus what does not depend on it), so the table gives
it at any batch size; ``tests/train/test_shape_table.py`` holds the table to the meta pass at
other batch sizes, and fails when a model's code changes without the table being rewritten.

A model with parameters of its own, a ``skip_layers`` other than its default, or one the table
does not list (a plugin, a model added since) is planned from the meta pass as before.

This module imports no torch; ``PLANNING`` says how to plan each registered model (its input,
built only when the meta pass runs, and KAISA's authors' default skips).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kaisa_ray.assignment import PlannedLayer
from kaisa_ray.enums import ComputeMethod, KFACApprox, OptimizerName, Precision, Scaling
from tuner.forecast import Workload

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["PLANNING", "TABLE", "Planning", "entry", "stored_workload", "with_options"]

TABLE = Path(__file__).with_name("shape_table.json")
BATCHES = (1, 2)
"""The batch sizes each growing quantity is stored at."""


@dataclass(frozen=True, kw_only=True)
class Planning:
    """How to plan a registered model: its input and the layers K-FAC leaves out by default."""

    example_input: Callable[[nn.Module, int], torch.Tensor] | None = None
    skip_layers: tuple[str, ...] = ()
    skip_source: str = ""  # where the default skip_layers come from
    seq_len_param: bool = False  # a language model: params carry seq_len


def _images(channels: int, side: int) -> Callable[[nn.Module, int], torch.Tensor]:
    def batch(model: nn.Module, n: int) -> torch.Tensor:
        import torch

        return torch.empty(n, channels, side, side, device="meta")

    return batch


def _resnet20_input(model: nn.Module, n: int) -> torch.Tensor:
    channels = int(getattr(getattr(model, "stem", None), "in_channels", 3))
    side = 28 if channels == 1 else 32  # Fashion-MNIST's 28×28 for one channel, CIFAR's 32
    return _images(channels, side)(model, n)


def _mlp_input(model: nn.Module, n: int) -> torch.Tensor:
    import torch
    from torch import nn

    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return torch.empty(n, first.in_features, device="meta")


PLANNING: dict[str, Planning] = {
    "lenet": Planning(example_input=_images(1, 28)),
    "mlp": Planning(example_input=_mlp_input),
    "resnet20": Planning(example_input=_resnet20_input),
    "resnet50": Planning(
        skip_source="every Conv2d and Linear, as gpauloski/kfac-pytorch's "
        "examples/torch_imagenet_resnet.py registers them (--skip-layers defaults to none)"
    ),
    "bert-large": Planning(
        skip_layers=(r"cls\.predictions",),
        skip_source="gpauloski/BERT-PyTorch run_pretraining.py: --kfac_skip_layers defaults to "
        "[BertLMPredictionHead, embedding] (the masked-LM head and the embeddings)",
        seq_len_param=True,
    ),
}

_GROWING = ("rows", "moved", "patch_bytes", "activation_bytes", "forward_flops")
"""The workload's fields that grow with the batch (``activation_bytes`` in float32)."""


def entry(at: Mapping[int, Workload]) -> dict[str, Any]:
    """A model's table entry from its meta passes at ``BATCHES`` (float32, default options)."""
    first = at[BATCHES[0]]
    for dtype in (d for layer in first.layers for d in _dtypes(layer)):
        if dtype != "float32":
            raise ValueError(f"{first.model}: a layer's state is {dtype}; the table is float32")
    return {
        "layers": [[x.name, x.a_dim, x.g_dim, x.groups] for x in first.layers],
        "parameters": first.parameters,
        "seq_len": first.seq_len,
        "at": {
            str(batch): {name: _plain(getattr(w, name)) for name in _GROWING}
            for batch, w in at.items()
        },
    }


def _dtypes(layer: PlannedLayer) -> Iterable[str]:
    for dtype in (layer.factor_dtype, layer.inv_dtype, layer.grad_dtype):
        yield str(dtype).removeprefix("torch.")


def _plain(value: Any) -> Any:
    return [list(v) for v in value] if isinstance(value, tuple) else value


@functools.cache
def _table() -> dict[str, Any]:
    if not TABLE.exists():
        return {}
    data: dict[str, Any] = json.loads(TABLE.read_text())
    return data


def _affine(one: Any, two: Any, batch: int) -> Any:
    """The value at ``batch`` of a quantity affine in the batch, from its values at 1 and 2."""
    if isinstance(one, list):
        return tuple(_affine(a, b, batch) for a, b in zip(one, two, strict=True))
    grown = one + (batch - 1) * (two - one)
    return type(one)(grown)


def with_options(
    job: Workload,
    *,
    precision: str = Precision.FP32,
    optimizer: str = OptimizerName.SGD.value,
    compute_method: str = ComputeMethod.EIGEN,
    scaling: str = Scaling.KRONECKER,
) -> Workload:
    """A model's float32 workload (from the meta pass or the table) under the job's options:
    what they change is not the model's shapes."""
    activations = job.activation_bytes
    if precision in (Precision.BF16, Precision.FP16):
        activations //= 2  # autocast keeps most saved activations in half precision
    return dataclasses.replace(
        job,
        precision=precision,
        activation_bytes=activations,
        optimizer_states=OptimizerName(optimizer).state_tensors,
        compute_method=compute_method,
        scaling=scaling,
    )


def stored_workload(
    name: str,
    *,
    batch_size: int,
    params: Mapping[str, Any] | None = None,
    kfac_approx: str = KFACApprox.EXPAND,
    skip_layers: Iterable[str] | None = None,
    sequence_approx: str = KFACApprox.EXPAND,
    embeddings: bool = False,
    **options: Any,
) -> Workload | None:
    """``shapes.workload``'s answer from the table, or None where the table does not hold it
    (parameters or skips of the caller's own, or a model it does not list); ``options`` as
    ``with_options`` takes them."""
    if sequence_approx != KFACApprox.EXPAND or embeddings:
        return None  # the table's Linear rows are every token, and it registers no embedding
    if params or skip_layers is not None or batch_size < 1:
        return None
    found = _table().get(name, {}).get(str(KFACApprox(kfac_approx)))
    if found is None:
        return None
    one, two = (found["at"][str(b)] for b in BATCHES)
    grown = {key: _affine(one[key], two[key], batch_size) for key in _GROWING}
    job = Workload(
        model=name,
        batch_size=batch_size,
        seq_len=found["seq_len"],
        precision=Precision.FP32,
        layers=tuple(
            PlannedLayer(name=n, a_dim=a, g_dim=g, groups=k) for n, a, g, k in found["layers"]
        ),
        parameters=found["parameters"],
        kfac_approx=str(KFACApprox(kfac_approx)),
        **grown,
    )
    return with_options(job, **options)
