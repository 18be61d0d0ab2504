"""A multi-node Ray cluster on one machine, for ``test_multinode.py`` (run as a child process:
a process holds one Ray connection, and the test process is connected to the suite's head).

``python multinode_cluster.py OUT_JSON SHARED_DIR``: starts a head with no CPUs and two worker
nodes with one CPU each (``ray.cluster_utils.Cluster``), then runs one real 2-worker K-FAC job
with ``placement: strict-spread`` (one worker per node), ``max_failures: 2`` and
``scaling.resource_timeout_s: 5`` that checkpoints to SHARED_DIR, and loses a node twice:

- once a checkpoint at step >= 20 exists, the node of rank 1 is removed (its raylet and
  workers killed) and a new node joins at once: the job must resume from its checkpoint with
  one worker on the new node;
- once the resumed job has a checkpoint 20 steps past where it resumed, the node of its
  rank 1 is removed and none comes back: the job must fail within the timeout saying why and
  where its latest checkpoint is.

One job shows both (one Ray Train start-up, not two). Ray Train 2.60 treats the two losses
alike: each is a worker-group failure counted against ``max_failures`` (hence 2, so that the
second one is retried too), and every restart waits for its placement group at most
``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (the timeout, read from the controller's
environment by each new worker group), after which the controller error fails the job
(``controller_failure_limit`` 0). So the node that comes back must join within 5 s of the
restart: it is added as soon as the old one is gone.

Writes what happened (the job's result and progress records, the nodes) to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, cast

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

NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
Records = list[dict[str, Any]]


def job(name: str) -> Any:
    return parse_job_spec(
        {
            "name": name,
            "model": {"name": "lenet"},
            "dataset": {"name": "fashion-mnist", "batch_size": 32, "limit": 1024},
            "kfac": {"strategy": "mem-opt", "factor_update_steps": 5, "inv_update_steps": 10},
            "scaling": {"workers": 2, "placement": "strict-spread", "resource_timeout_s": 5},
            # Far more than it reaches: the second loss ends it (near step 50-70 here), and a
            # job that finished first would not show that loss.
            "stop": {"max_steps": 400},
            "eval_every": 10,
            "checkpoint": {"every_steps": 10, "keep": 10},
            "max_failures": 2,
            "seed": 5,
        }
    )


def wait_for(
    name: str, found: Callable[[Records], dict[str, Any] | None], alive: threading.Thread
) -> tuple[dict[str, Any], Records]:
    """The first record ``found`` picks out of the run's records, polled every 0.1 s."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and alive.is_alive():
        records = read_progress(name)["records"]
        hit = found(records)
        if hit is not None:
            return hit, records
        time.sleep(0.1)
    raise RuntimeError(f"run {name}: the record waited for never came (job ended or 240 s)")


def remove_rank_1(cluster: Cluster, nodes: dict[str, Any], records: Records) -> str:
    victim: str = [r for r in records if r["kind"] == "worker" and r["rank"] == 1][-1]["node"]
    cluster.remove_node(nodes.pop(victim), allow_graceful=False)
    return victim


def run(cluster: Cluster, nodes: dict[str, Any], shared: str) -> dict[str, Any]:
    """Run the job in a thread; from this (the main) thread, remove rank 1's node once a
    checkpoint at step >= 20 exists and add a node back, then remove rank 1's node again
    once the resumed job has a checkpoint 20 steps past its resume point."""
    spec = job("multinode")
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

    def checkpoint_at_least(step: int, after_seq: int) -> Callable[[Records], Any]:
        return lambda records: next(
            (
                r
                for r in reversed(records)
                if r["kind"] == "checkpoint" and r["seq"] > after_seq and r["step"] >= step
            ),
            None,
        )

    # The first loss, and a node back at once.
    held, records = wait_for(name, checkpoint_at_least(20, -1), thread)
    victim = remove_rank_1(cluster, nodes, records)
    happened["removed"].append(
        {"node": victim, "after_checkpoint": held["step"], "time": time.time()}
    )
    node = cluster.add_node(**NODE)  # the main thread: Ray sets signal handlers
    nodes[node.node_id] = node
    happened["added"] = {"node": node.node_id, "time": time.time()}

    # The resumed worker group's start record, then its checkpoint 20 steps on; the second
    # loss, and no node back.
    start, _ = wait_for(
        name,
        lambda records: next(
            (r for r in records if r["kind"] == "start" and r["seq"] > held["seq"]), None
        ),
        thread,
    )
    held, records = wait_for(
        name, checkpoint_at_least(start["from_step"] + 20, start["seq"]), thread
    )
    victim = remove_rank_1(cluster, nodes, records)
    happened["removed"].append(
        {"node": victim, "after_checkpoint": held["step"], "time": time.time()}
    )

    thread.join(timeout=300)
    result = box["result"]
    # The controller waited for each checkpoint record; the sink has every record of the run.
    happened.update(
        succeeded=result.succeeded,
        error=result.error,
        metrics=result.metrics,
        checkpoint=result.checkpoint,
        ended=time.time(),
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
            "head": cast(Any, cluster.head_node).node_id,  # typed None in Ray
            "first_nodes": sorted(nodes),
            "cluster_s": time.monotonic() - began,
        }
        report["job"] = run(cluster, nodes, shared)
        report["total_s"] = time.monotonic() - began
        with open(out, "w") as handle:
            json.dump(report, handle)
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
