"""Actor options for the cluster's long-lived named actors (torch-free: the progress sink's
process imports it, and must not pay for torch)."""

from __future__ import annotations

from typing import Any


def cluster_singleton() -> dict[str, Any]:
    """Actor options for the cluster's long-lived named actors (the tuner, the progress
    sink): no CPU (they must never block a job), on the head node (a worker node can leave the
    cluster, and the actor's state with it), and outside any placement group (created from a
    Ray Train worker, an actor would otherwise join the job's group and die with it)."""
    return {
        "num_cpus": 0,
        "resources": {"node:__internal_head__": 0.001},
        # An explicit strategy: Ray captures an actor into its creator's placement group only
        # when it has none (or a placement-group one).
        "scheduling_strategy": "DEFAULT",
        "lifetime": "detached",
        "get_if_exists": True,
    }
