"""Measured tensor memory of a piece of training, on CUDA and on CPU.

On CUDA the allocator keeps a peak (``torch.cuda.max_memory_allocated``). On CPU there is no
allocator statistic, so ``TensorMemory`` counts it: a dispatch mode sees every tensor an
operator returns, adds its storage's bytes once, and subtracts them when the storage is freed.
The peak is of tensors created inside the ``with`` block plus the ``existing`` tensors the
caller passes (the model's parameters, say), each until it is freed. What it counts is tensor
memory — parameters, gradients, optimizer state, activations, K-FAC state and every
temporary — which is what a memory budget for training is about. The interpreter, libraries
and the data set held in host memory are not counted, nor on CPU the scratch space an
operator allocates and frees inside itself (LAPACK's workspace in ``eigh``: about 2n²
numbers for an n×n factor while it runs); on CUDA the allocator's peak includes that too.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Counter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def count(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as live until it is freed (once per storage)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        if key in self._seen:
            self._seen.discard(key)
            self.live -= nbytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and item.device.type == "cpu":
                self.count(item)
        return out


class TensorMemory:
    """Peak and live bytes of tensors created inside ``with TensorMemory(device) as m:``.

    ``existing`` tensors (parameters, gradients, optimizer state) count as live from the
    start, and stop counting when they are freed inside the block, so the figures are of
    everything the step holds, not only of what it created.
    """

    def __init__(
        self, device: torch.device | str = "cpu", existing: Iterable[torch.Tensor] = ()
    ) -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.live_bytes = 0
        self._existing = list(existing)
        self._counter: _Counter | None = None
        self._start = 0

    def __enter__(self) -> TensorMemory:
        if self.device.type == "cuda":
            # Garbage in reference cycles (a dropped model and its hooks) would otherwise be
            # counted at the start and may be freed inside the window, lowering the peak.
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device) - tensor_bytes(
                t for t in self._existing if t.device.type == "cuda"
            )
        else:
            self._counter = _Counter()
            for tensor in self._existing:
                if tensor.device.type == "cpu":
                    self._counter.count(tensor)
            self._counter.__enter__()  # type: ignore[no-untyped-call]
        self._existing = []
        return self

    def reset_peak(self) -> None:
        """Start the peak again from what is live now."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._counter is not None:
            self._counter.peak = self._counter.live

    def update(self) -> None:
        """Read the figures now (also done on exit)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.live_bytes = torch.cuda.memory_allocated(self.device) - self._start
        elif self._counter is not None:
            self.peak_bytes, self.live_bytes = self._counter.peak, self._counter.live

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._counter is not None:
            self._counter.__exit__(kind, value, traceback)  # type: ignore[no-untyped-call]
        self.update()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages among ``tensors`` (shared storage counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())
