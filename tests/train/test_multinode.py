"""Multi-node: a head and two worker nodes on this machine (``ray.cluster_utils.Cluster``, in
the child ``multinode_cluster.py``), a 2-worker K-FAC job placed one worker per node,
checkpoints on shared storage, and the loss of a node mid-run, twice: the job resumes from its
checkpoint when a node comes back, and, the second time, fails naming its latest checkpoint
when none does. (That a resumed job runs to its end, bit for bit as one that was not
interrupted: ``test_ray_train.py``.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_train.state import load_checkpoint_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.skipif(
        not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
    ),
]

CHILD = Path(__file__).with_name("multinode_cluster.py")


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("multinode")
    out, shared = work / "report.json", work / "shared"
    done = subprocess.run(
        [sys.executable, str(CHILD), str(out), str(shared)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report: dict[str, Any] = json.loads(out.read_text())
    report["shared"] = str(shared)
    return report


def kinds(run: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [r for r in run["records"] if r["kind"] == kind]


def test_workers_spread_one_per_node_and_resume_on_a_new_node(cluster_run: dict[str, Any]) -> None:
    run = cluster_run["run"]
    workers = kinds(run, "worker")
    first, second = workers[:2], workers[2:4]
    # strict-spread: one worker on each worker node, none on the head (it has no CPUs).
    assert sorted(w["node"] for w in first) == cluster_run["first_nodes"]
    removed = run["removed"][0]
    assert removed["node"] in {w["node"] for w in first if w["rank"] == 1}
    # The worker group came back after the loss, one worker per node again, one on the new node.
    assert len(second) == 2
    assert {w["node"] for w in second} == set(cluster_run["first_nodes"]) - {removed["node"]} | {
        run["added"]
    }
    starts = kinds(run, "start")
    # It resumed from the newest checkpoint Ray Train held at the loss: the newest checkpoint
    # record before the restart. (Ray Train's controller sends them once it holds one; a
    # record from rank 0 after its own report, as before, could name a checkpoint the
    # controller never took in: a worker lost before the controller polled the others'
    # reports leaves it unregistered, and the run resumed from an older one, 30 for 40.)
    before = [c["step"] for c in kinds(run, "checkpoint") if c["seq"] < starts[1]["seq"]]
    assert before[-1] >= removed["after_checkpoint"] >= 20
    assert [s["from_step"] for s in starts] == [0, before[-1]]
    assert "resumed_from" in starts[1]
    # ... and trained on: the second loss came after a checkpoint of the resumed workers.
    assert run["removed"][1]["after_checkpoint"] >= 40
    assert run["removed"][1]["node"] in {w["node"] for w in second if w["rank"] == 1}


def test_checkpoints_are_on_the_shared_storage(cluster_run: dict[str, Any]) -> None:
    run = cluster_run["run"]
    storage = Path(cluster_run["shared"]) / run["run"]
    states = sorted(storage.glob("checkpoint_*/state.pt"))
    assert len(states) >= 4  # steps 10, 20 before the first loss, then 30, 40 after it
    for path in states:
        state = load_checkpoint_file(path.parent)
        assert state["world_size"] == 2
        assert state["step"] % 10 == 0
        assert all(torch.isfinite(p).all() for p in state["model"].values())


def test_a_node_that_never_comes_back_fails_the_job_naming_the_checkpoint(
    cluster_run: dict[str, Any],
) -> None:
    run = cluster_run["run"]
    assert not run["succeeded"]
    error = run["error"]
    assert "did not get their resources within scaling.resource_timeout_s=45 s" in error
    assert "placement strict-spread" in error
    assert "a node left and none came back" in error
    checkpoint = error.split("kaisa-ray train --resume-from ")[1].rstrip("`.")
    state = load_checkpoint_file(checkpoint)
    # The newest checkpoint on the storage: the newest Ray Train held (recorded), or one
    # newer still that rank 0 had written when the node left, which the controller never
    # took in (a whole checkpoint all the same: it resumes).
    held = kinds(run, "checkpoint")[-1]["step"]
    assert state["step"] >= held >= run["removed"][1]["after_checkpoint"]
    assert state["step"] % 10 == 0  # a checkpoint of the job's every_steps
    assert len(kinds(run, "start")) == 2  # it never trained after the second loss
