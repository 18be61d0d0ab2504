"""Where a K-FAC step's time goes: host wall time per phase, accumulated until reset.

The phases are those of BENCHMARKS.md: ``factors`` (batch covariances in the hooks, running
averages), ``decompositions`` (eigen or inverse), ``precondition`` (applying them, KL clip)
and ``communication`` (launching and waiting for the factor all-reduce and the broadcasts),
and ``staleness`` (measuring it, ``kaisa_ray.staleness``: 0 unless it is measured; its
all-reduce counts as communication).
They do not overlap, so their sum is K-FAC's share of a step. On CUDA the times are host
times: kernels still running when a phase ends are counted in whichever phase waits for them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("factors", "decompositions", "precondition", "communication", "staleness")


class PhaseTimes:
    """Seconds spent in each phase since construction or the last ``reset()``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def reset(self) -> dict[str, float]:
        """Return the accumulated seconds and start again from zero."""
        out = dict(self.seconds)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        return out
