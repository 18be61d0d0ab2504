"""A multi-node Ray cluster on one machine, for ``test_multinode.py`` (run as a child process:
a process holds one Ray connection, and the test process is connected to the suite's head).

``python multinode_cluster.py OUT_JSON SHARED_DIR``: starts a head with no CPUs and two worker
nodes with one CPU each (``ray.cluster_utils.Cluster``), then runs two real 2-worker K-FAC
jobs with ``placement: strict-spread`` (one worker per node) that checkpoint to SHARED_DIR:

- ``returns``: once a checkpoint at step >= 20 exists, the node of rank 1 is removed (its
  raylet and workers killed), and a new node joins 2 s later: the job must resume from its
  checkpoint on the new node and finish.
- ``lost``: the same loss with no node coming back and ``scaling.resource_timeout_s: 5``:
  the job must fail saying why and where its latest checkpoint is.

Writes what happened (the jobs' results and progress records, the nodes) to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

os.environ.update(
    RAY_AUTH_MODE="disabled",  # a throwaway local cluster
    RAY_USAGE_STATS_ENABLED="0",
    RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.1",
    RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0",
    RAY_memory_monitor_refresh_ms="0",
)
os.environ.pop("RAY_ADDRESS", None)

import ray
from ray.cluster_utils import Cluster

from kaisa_ray.train.job import JobResult, run_job
from kaisa_ray.train.progress import read_progress
from kaisa_ray.train.spec import parse_job_spec

NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}


def job(name: str, **scaling: Any) -> Any:
    return parse_job_spec(
        {
            "name": name,
            "model": {"name": "lenet"},
            "dataset": {"name": "fashion-mnist", "batch_size": 32, "limit": 1024},
            "kfac": {"strategy": "mem-opt", "factor_update_steps": 5, "inv_update_steps": 10},
            "scaling": {"workers": 2, "placement": "strict-spread", **scaling},
            "stop": {"max_steps": 60},
            "eval_every": 10,
            "checkpoint": {"every_steps": 10, "keep": 10},
            "max_failures": 1,
            "seed": 5,
        }
    )


def run(
    cluster: Cluster, nodes: dict[str, Any], spec: Any, shared: str, node_returns: bool
) -> dict[str, Any]:
    """Run ``spec`` in a thread; from this (the main) thread, remove rank 1's node once a
    checkpoint at step >= 20 exists, and add a node back if ``node_returns``."""
    name = f"{spec.name}-{time.time_ns()}"
    box: dict[str, JobResult] = {}
    thread = threading.Thread(
        target=lambda: box.update(
            result=run_job(spec, storage_path=shared, run_name=name, progress=False)
        ),
        daemon=True,
    )
    thread.start()
    happened: dict[str, Any] = {"run": name}
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and thread.is_alive():
        records = read_progress(name)["records"]
        checkpoints = [r["step"] for r in records if r["kind"] == "checkpoint"]
        if checkpoints and checkpoints[-1] >= 20:
            victim = [r for r in records if r["kind"] == "worker" and r["rank"] == 1][-1]["node"]
            cluster.remove_node(nodes.pop(victim), allow_graceful=False)
            happened["removed"] = {"node": victim, "after_checkpoint": checkpoints[-1]}
            if node_returns:
                time.sleep(2)
                node = cluster.add_node(**NODE)  # the main thread: Ray sets signal handlers
                nodes[node.node_id] = node
                happened["added"] = node.node_id
            break
        time.sleep(0.1)
    thread.join(timeout=300)
    result = box["result"]
    # Rank 0 waited for its end record, the controller for each checkpoint record: the sink
    # has every record of the run.
    happened.update(
        succeeded=result.succeeded,
        error=result.error,
        metrics=result.metrics,
        checkpoint=result.checkpoint,
        records=read_progress(name)["records"],
    )
    return happened


def main(out: str, shared: str) -> None:
    began = time.monotonic()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": 100 * 2**20,
            "include_dashboard": False,
        },
    )
    try:
        nodes = {node.node_id: node for node in (cluster.add_node(**NODE) for _ in range(2))}
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        os.environ["RAY_ADDRESS"] = cluster.address  # what a Ray Job's driver sees
        report: dict[str, Any] = {
            "head": cluster.head_node.node_id,
            "first_nodes": sorted(nodes),
            "cluster_s": time.monotonic() - began,
        }
        report["returns"] = run(cluster, nodes, job("returns"), shared, node_returns=True)
        report["lost"] = run(
            cluster, nodes, job("lost", resource_timeout_s=5), shared, node_returns=False
        )
        report["total_s"] = time.monotonic() - began
        with open(out, "w") as handle:
            json.dump(report, handle)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
