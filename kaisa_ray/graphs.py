"""The shape groups' preconditioning as one CUDA graph (``cuda_graphs=True``).

A step's preconditioning of its shape groups launches the same kernels on the same buffers
every step: the batched products from the raw gradients' flat buffers into the outputs', the
finiteness check, the KL clip and the choice between preconditioned and raw gradients. Launched
one by one from Python they cost the host more than the device (a step's host time decides it
on a GPU that the model keeps busy); captured once, they are one launch a step. What stays
outside the graph: the copy of the parameters' gradients into the raw buffers and back (their
tensors change every step under ``zero_grad(set_to_none=True)``), and anything that waits for
the device.

The graph reads the decompositions where the groups' stacked storage keeps them (a
decomposition update writes into the same buffers), and the damping, the learning rate and the
KL clip from scalars on the device that are refilled when their value changes, so a schedule
of any of them needs no new capture. A new capture happens when the storage's buffers move,
the KL clip is switched on or off, or the matmul precision changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kaisa_ray import batching

if TYPE_CHECKING:
    from kaisa_ray.apply import GradientSetter
    from kaisa_ray.kfac_layer import KFACLayer


class _Scalar:
    """A float on the device, refilled (one launch, no wait) only when its value changes."""

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros((), dtype=torch.float64, device=device)
        self.value: float | None = None

    def set(self, value: float) -> torch.Tensor:
        if value != self.value:
            self.tensor.fill_(value)
            self.value = value
        return self.tensor


class GraphedPreconditioning:
    """One ``GradientLayout``'s preconditioning, captured in a CUDA graph on its first step
    (and again when what it reads moves), then replayed. Its raw and output flat buffers are
    kept between steps (two copies of the groups' gradients), and the graph's private memory
    pool keeps its temporaries."""

    def __init__(self, layout: batching.GradientLayout, setter: GradientSetter) -> None:
        self.layout = layout
        self.setter = setter
        device = next(device for _, device, _ in layout.arenas)
        self.device = device
        self.damping = _Scalar(device)
        self.lr = _Scalar(device)
        self.kl_clip = _Scalar(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple[object, ...] | None = None
        self.captures = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the raw and preconditioned gradients' buffers kept between steps (the
        graph's private pool of temporaries is the allocator's, not counted here)."""
        kept = self.layout.kept
        if kept is None:
            return 0
        return sum(t.nbytes for t in (*kept.raw_flats, *kept.out_flats))

    def _key(self, kl_clip: float | None) -> tuple[object, ...]:
        pointers = tuple(
            buffer.data_ptr() for group in self.layout.groups for buffer in group.storage.values()
        )
        return (pointers, kl_clip is None, torch.get_float32_matmul_precision())

    def run(
        self,
        damping: float,
        kl_clip: float | None,
        lr: float,
        order: Sequence[KFACLayer],
    ) -> batching.Gathered:
        """This step's preconditioning of the layout's groups, the gradients set; returns the
        gathered buffers (outputs preconditioned, before clipping)."""
        gathered = self.layout.gather(keep=True)
        damping_t = self.damping.set(damping)
        lr_t = self.lr.set(lr)
        clip_t = None if kl_clip is None else self.kl_clip.set(kl_clip)
        groups = self.layout.groups

        def body() -> None:
            batching.precondition(groups, gathered.raws, damping_t, gathered.outs)
            self.setter.set([], gathered, order, clip_t, lr_t, write_grads=False, group_dots=True)

        key = self._key(kl_clip)
        if self.graph is None or key != self.key:
            self.setter.state(self.device)  # made outside the graph, updated in it
            self._capture(body)
            self.key = key
        else:
            self.graph.replay()
        batching.copy_all(list(zip(gathered.grads, gathered.into, strict=True)))
        return gathered

    def _capture(self, body: Callable[[], None]) -> None:
        """Run ``body`` once on a side stream (this step's result, and the warm-up that CUDA
        graphs ask for), then capture it without running it."""
        self.graph = None
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            body()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a data loader's thread may use CUDA while this thread captures
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            body()
        current.wait_stream(side)
        self.graph = graph
        self.captures += 1
