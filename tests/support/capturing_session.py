"""The worker's loop in this process, at the ``Session`` seam (no Ray): the records kept, every
checkpoint kept by its step (written and read back as ``RaySession`` writes ``state.pt``), and
a resume from a given state."""

from __future__ import annotations

import io
from typing import Any

import torch

from kaisa_train.records import IntervalsRecord, Record


class CapturingSession:
    rank, world = 0, 1
    device = torch.device("cpu")
    keeps_checkpoints = True

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.records: list[Record] = []
        self.saved: dict[int, dict[str, Any]] = {}
        self.state = state

    def stream(self) -> None:
        return None  # the data is in memory

    def push(self, *records: Record, wait: bool = False) -> None:
        self.records += records

    def report(self, metrics: dict[str, Any], state: dict[str, Any] | None) -> None:
        if state is not None:  # written out at once, as RaySession writes state.pt
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            self.saved[int(metrics["step"])] = torch.load(buffer, weights_only=True)

    def resume(self) -> tuple[dict[str, Any] | None, str | None]:
        return (self.state, "checkpoint") if self.state is not None else (None, None)

    def intervals(self) -> list[IntervalsRecord]:
        return [r for r in self.records if isinstance(r, IntervalsRecord)]
