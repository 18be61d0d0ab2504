"""``cuda_graphs=True`` on this CPU, at the seam where the capture happens: a stand-in for
``torch.cuda.CUDAGraph`` that replays the first step's closure, with the tensors it was built
on, on every later step (what a CUDA graph does with the addresses it recorded). Anything the
graphed path rebinds instead of writing in place (a buffer, a scalar, the clip's kept scale)
then shows as a difference from the eager steps. The real capture is in
``tests/core/test_gpu.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.graphs import CONFIGS, graphed_kwargs
from support.models import grouped_and_odd, repeated_shapes
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from kaisa_ray import KFACPreconditioner, batching
from kaisa_ray.graphs import GraphedPreconditioning


class _Recorded(TorchDispatchMode):
    """A CUDA graph on the CPU: records every operation of the capture step's run (which
    is that step's result) with the very tensors it read and wrote; a replay runs the
    operations again, no Python, each later operation reading what the earlier ones of the
    same replay produced. Python that rebinds a tensor instead of writing into it, or a
    value read at capture and fixed since, then shows as a difference from eager steps."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, Any, Any, Any]] = []
        self.replays = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out

    def replay(self) -> None:
        self.replays += 1
        produced: dict[int, torch.Tensor] = {}

        def now(x: Any) -> Any:
            return produced.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, out in self.calls:
            new = func(*tree_map(now, args), **tree_map(now, kwargs))
            for old, made in zip(tree_leaves(out), tree_leaves(new), strict=True):
                if isinstance(old, torch.Tensor):
                    produced[id(old)] = made


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[_Recorded]:
    made: list[_Recorded] = []

    def capture(self: GraphedPreconditioning, body: Callable[[], None]) -> None:
        graph = _Recorded()
        with graph:
            body()
        made.append(graph)
        self.graph = graph  # type: ignore[assignment]
        self.captures += 1

    monkeypatch.setattr(GraphedPreconditioning, "_capture", capture)
    return made


def _train(model: nn.Module, preconditioner: KFACPreconditioner, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 2, 6, 6, generator=g)
        y = torch.randint(0, 5, (16,), generator=g)
        optimizer.zero_grad(set_to_none=True)  # new gradient tensors every step
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
        optimizer.step()


@pytest.mark.parametrize("model_of", [repeated_shapes, grouped_and_odd])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_replaying_the_first_steps_work_equals_the_eager_steps(
    recorded: list[_Recorded], config: str, model_of: Callable[[], nn.Module]
) -> None:
    """Damping and learning rate change every step (the graph reads them from scalars on
    the device), the KL clip scales, factors and decompositions update in between."""
    kwargs = graphed_kwargs(config)
    graphed_model, eager_model = model_of(), model_of()
    graphed = KFACPreconditioner(graphed_model, **kwargs)
    graphed.cuda_graphs = True  # past the device check: the seam stands in for CUDA
    eager = KFACPreconditioner(eager_model, **kwargs)
    _train(graphed_model, graphed, 11)
    _train(eager_model, eager, 11)
    for a, b in zip(graphed_model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if kwargs["kl_clip"] is not None:
        assert eager.last_grad_scale < 1.0
    assert graphed.last_grad_scale == pytest.approx(eager.last_grad_scale, rel=1e-6)
    # captured on the first step whose groups are all decomposed (the second under Adam in
    # the eigenbasis, whose moments the first step creates), replayed on every later one
    assert len(recorded) == 1
    assert recorded[0].replays >= 9


def test_a_replayed_step_keeps_raw_gradients_that_are_not_finite_and_counts_them(
    recorded: list[_Recorded],
) -> None:
    model = repeated_shapes()
    preconditioner = KFACPreconditioner(model, factor_update_steps=3, inv_update_steps=6)
    preconditioner.cuda_graphs = True
    _train(model, preconditioner, 4)
    scale = preconditioner.last_grad_scale
    x, y = torch.randn(16, 2, 6, 6), torch.randint(0, 5, (16,))
    for param in model.parameters():
        param.grad = None
    F.cross_entropy(model(x), y).backward()
    first = next(model.parameters())
    assert first.grad is not None
    first.grad[0].fill_(float("nan"))
    raw = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    preconditioner.step()  # step 4: neither factors nor decompositions
    assert preconditioner.last_updates == (frozenset(), frozenset())
    assert preconditioner.skipped_steps == 1
    assert preconditioner.last_grad_scale == scale  # the clip's scale kept, not NaN
    for before, param in zip(raw, model.parameters(), strict=True):
        torch.testing.assert_close(param.grad, before, equal_nan=True)
    # the next steps precondition again; step 6 waits for the device and warns
    with pytest.warns(RuntimeWarning, match="not finite on 1 step"):
        _train(model, preconditioner, 2)
    assert preconditioner.skipped_steps == 1
    assert len(recorded) == 1


def test_a_layer_left_out_of_the_groups_runs_the_step_without_the_graph(
    recorded: list[_Recorded],
) -> None:
    model = repeated_shapes()
    preconditioner = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2)
    preconditioner.cuda_graphs = True
    _train(model, preconditioner, 3)  # decompositions on steps 0 and 2, in the same buffers
    assert len(recorded) == 1
    layout = next(iter(preconditioner._preconditioning.graphs))
    assert layout.gather(keep=True).raw_flats[0] is layout.gather(keep=True).raw_flats[0]
    # the first group without its decompositions in the storage: layer by layer for it
    preconditioner._preconditioning.groups[0].storage.clear()
    recorded.clear()
    _train(model, preconditioner, 1)  # step 3: no decomposition
    assert recorded == []


def test_the_kept_buffers_are_the_same_every_step_and_the_fresh_ones_are_not() -> None:
    model = repeated_shapes()
    preconditioner = KFACPreconditioner(model)
    _train(model, preconditioner, 1)
    layout = batching.GradientLayout(preconditioner._preconditioning.groups)
    kept, again = layout.gather(keep=True), layout.gather(keep=True)
    assert kept is again
    assert kept.raw_flats[0] is again.raw_flats[0]
    assert layout.gather().raw_flats[0] is not kept.raw_flats[0]
    grads = [p.grad for p in model.parameters()]
    assert all(any(g is grad for grad in kept.grads) for g in grads if g is not None)


def test_the_kept_buffers_count_in_the_memory_usage(recorded: list[_Recorded]) -> None:
    model = repeated_shapes()
    preconditioner = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2)
    _train(model, preconditioner, 1)
    eager = preconditioner.memory_usage()
    preconditioner.cuda_graphs = True
    _train(model, preconditioner, 1)
    graphed = preconditioner.memory_usage()
    grouped = sum(
        layer.helper.weight().numel() + (b.numel() if (b := layer.helper.bias()) is not None else 0)
        for group in preconditioner._preconditioning.groups
        for layer in group.layers
    )
    kept = graphed["buffers"] - eager["buffers"]
    # raw and preconditioned copies of the grouped gradients, each group's share aligned
    assert (
        2 * grouped * 4
        <= kept
        <= 2 * (grouped + batching.ALIGN * len(preconditioner._preconditioning.groups)) * 4
    )
    assert graphed["total"] - eager["total"] == kept
