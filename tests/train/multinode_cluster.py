"""A multi-node Ray cluster on one machine, for ``test_multinode.py`` (run as a child process:
a process holds one Ray connection, and the test process is connected to the suite's head).

``python multinode_cluster.py OUT_JSON SHARED_DIR``: starts a head with no CPUs and two worker
nodes with one CPU each (``ray.cluster_utils.Cluster``), then runs one real 2-worker K-FAC job
with ``placement: strict-spread`` (one worker per node) that checkpoints to SHARED_DIR and
loses a node twice:

- once a checkpoint at step >= 20 exists, the node of rank 1 is removed (its raylet and
  workers killed), and a new node joins 2 s later: the job must resume from its checkpoint on
  the new node;
- once the resumed workers have recorded a checkpoint at step >= 40, the node of rank 1 is
  removed again, and none comes back: with ``scaling.resource_timeout_s`` the job must fail
  saying why and where its latest checkpoint is.

(One job for both losses: a job's start is most of its processes' CPU.) Writes what happened
(the job's result and progress records, the nodes) to OUT_JSON.
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

from kaisa_train.job import JobResult, run_job
from kaisa_train.progress import read_progress
from kaisa_train.spec import parse_job_spec

NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}


def job(name: str) -> Any:
    return parse_job_spec(
        {
            "name": name,
            "model": {"name": "lenet"},
            "dataset": {"name": "fashion-mnist", "batch_size": 32, "limit": 1024},
            "kfac": {"strategy": "mem-opt", "factor_update_steps": 5, "inv_update_steps": 10},
            # The timeout bounds each worker group's start: the first restart's, on the node
            # that came back (seconds), and the second's, for which no node comes.
            "scaling": {"workers": 2, "placement": "strict-spread", "resource_timeout_s": 45},
            "stop": {"max_steps": 200},  # it ends by the second loss, near step 40
            "eval_every": 10,
            "checkpoint": {"every_steps": 10, "keep": 20},
            "max_failures": 2,
            "seed": 5,
        }
    )


def run(cluster: Cluster, nodes: dict[str, Any], spec: Any, shared: str) -> dict[str, Any]:
    """Run ``spec`` in a thread; from this (the main) thread, remove rank 1's node once a
    checkpoint at step >= 20 exists and add a node back, then remove rank 1's node again once
    the resumed workers have a checkpoint at step >= 40, for good."""
    name = f"{spec.name}-{time.time_ns()}"
    box: dict[str, JobResult] = {}
    thread = threading.Thread(
        target=lambda: box.update(
            result=run_job(spec, storage_path=shared, run_name=name, progress=False)
        ),
        daemon=True,
    )
    thread.start()
    happened: dict[str, Any] = {"run": name, "removed": []}
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and thread.is_alive() and len(happened["removed"]) < 2:
        records = read_progress(name)["records"]
        starts = [r["seq"] for r in records if r["kind"] == "start"]
        at = 20 if not happened["removed"] else 40
        # A checkpoint of the current worker group: recorded after its start.
        checkpoints = [
            r["step"]
            for r in records
            if r["kind"] == "checkpoint" and starts and r["seq"] > starts[-1]
        ]
        workers = [r for r in records if r["kind"] == "worker" and r["rank"] == 1]
        if len(starts) == len(happened["removed"]) + 1 and checkpoints and checkpoints[-1] >= at:
            victim = workers[-1]["node"]
            cluster.remove_node(nodes.pop(victim), allow_graceful=False)
            happened["removed"].append({"node": victim, "after_checkpoint": checkpoints[-1]})
            if len(happened["removed"]) == 1:
                time.sleep(2)
                node = cluster.add_node(**NODE)  # the main thread: Ray sets signal handlers
                nodes[node.node_id] = node
                happened["added"] = node.node_id
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
        report["run"] = run(cluster, nodes, job("twice"), shared)
        report["total_s"] = time.monotonic() - began
        with open(out, "w") as handle:
            json.dump(report, handle)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
