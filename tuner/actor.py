"""The tuner as a Ray actor: it receives profiles, chooses, and remembers what it profiled.

``TunerState`` is plain Python (unit-tested without Ray); ``Tuner`` is the same class as a
named, detached Ray actor, created on first use by ``tuner_actor()``. Profiles are cached by
``profile_key``: the model's structure, the batch each worker trains on, the job's K-FAC
options and the shape of the cluster that ran it (workers, nodes, devices, threads), so a
second identical job skips profiling and gets its decision at once (the key is computed on the
job's ranks: ``keys.py``; the actor's process imports no torch). The cache is bounded and
lives as long as the actor (that is, the Ray cluster); a head started by a standalone command
loads and saves it through the local store (``kaisa_train.local_store``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import ray

from tuner.choice import DEFAULT_INTERVALS, Decision, choose
from tuner.cost import Profile
from tuner.singleton import cluster_singleton

TUNER_NAME = "kaisa-ray-tuner"
TUNER_NAMESPACE = "kaisa-ray"
MAX_PROFILES = 256


class TunerState:
    """Profiles by key (least recently used dropped past ``max_profiles``), and choices."""

    def __init__(self, max_profiles: int = MAX_PROFILES) -> None:
        self._profiles: OrderedDict[str, Profile] = OrderedDict()
        self._max = max_profiles
        self.hits = 0
        self.misses = 0

    def lookup(self, key: str) -> Profile | None:
        """The cached profile for ``key``, or None (counted as a hit or a miss)."""
        profile = self._profiles.get(key)
        if profile is None:
            self.misses += 1
            return None
        self.hits += 1
        self._profiles.move_to_end(key)
        return profile

    def decide(
        self,
        key: str,
        profile: Profile | None,
        budget_bytes: int | None,
        max_overhead: float | None = None,
        intervals: Sequence[tuple[int, int]] = DEFAULT_INTERVALS,
        adaptive: bool = False,
        extra_bytes: int = 0,
    ) -> Decision:
        """Store ``profile`` under ``key`` (None: use the cached one), then ``choose`` (with
        ``adaptive``: the fraction and starting rung of intervals adapted online), counting
        ``extra_bytes`` more in every worker's memory than the profile holds (what this job
        keeps beside the model, such as a streamed dataset's window on a CPU worker; not
        cached with the profile).

        Raises:
            KeyError: ``profile`` is None and nothing is cached under ``key``.
            NoFeasibleCandidateError: nothing fits (from ``choose``).
        """
        if profile is None:
            if key not in self._profiles:
                raise KeyError(f"no profile cached under {key}; profile the job first")
            profile = self._profiles[key]
        else:
            self._profiles[key] = profile
            while len(self._profiles) > self._max:
                self._profiles.popitem(last=False)
        self._profiles.move_to_end(key)
        if extra_bytes:
            profile = replace(profile, base_memory_bytes=profile.base_memory_bytes + extra_bytes)
        return choose(
            profile,
            budget_bytes,
            max_overhead=max_overhead,
            intervals=[tuple(pair) for pair in intervals],  # type: ignore[misc]
            adaptive=adaptive,
        )

    def forget(self, key: str | None = None) -> int:
        """Drop one cached profile, or all (``key=None``); returns how many went."""
        if key is None:
            count = len(self._profiles)
            self._profiles.clear()
            return count
        return 1 if self._profiles.pop(key, None) is not None else 0

    def profiles(self) -> dict[str, Profile]:
        """Every cached profile by key, oldest first (what a local store keeps)."""
        return dict(self._profiles)

    def remember(self, profiles: dict[str, Profile]) -> int:
        """Cache ``profiles`` (from a local store) without counting hits or misses; the bound
        holds. Returns how many are cached."""
        for key, profile in profiles.items():
            if isinstance(profile, Profile):
                self._profiles[key] = profile
        while len(self._profiles) > self._max:
            self._profiles.popitem(last=False)
        return len(self._profiles)

    def stats(self) -> dict[str, int]:
        return {"profiles": len(self._profiles), "hits": self.hits, "misses": self.misses}


@ray.remote(num_cpus=0, max_restarts=-1)
class Tuner(TunerState):
    """``TunerState`` as a named Ray actor (no CPU reserved: it must never block a job)."""


def tuner_actor() -> Any:
    """The cluster's tuner (an actor handle), created on first use; needs Ray."""
    # Typed Any: Ray's stubs give actor method calls the result type Never.
    handle: Any = Tuner.options(  # type: ignore[attr-defined]
        name=TUNER_NAME, namespace=TUNER_NAMESPACE, **cluster_singleton()
    ).remote()
    return handle
