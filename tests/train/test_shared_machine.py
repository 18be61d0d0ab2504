"""kaisa-ray's own commands with other people's Ray instances on the same machine: another
user's ``ray start --head`` on Ray's default ports (it writes ``/tmp/ray/ray_current_cluster``)
and a second ``kaisa-ray serve`` with its embedded head, both running throughout.

Every command runs as a new user runs it: a real process, a fresh home, the venv on PATH
(as after ``source .venv/bin/activate``), no Ray or kaisa-ray variables set.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.cli_process import (
    ANY_OTHER,
    KAISA_RAY,
    ROOT,
    connected_to,
    own_heads_left,
    run,
    user_env,
)
from support.neighbours import DefaultPortsRay, MakeRun, neighbours

from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_train.head import start_head

pytestmark = [pytest.mark.ray]
NEEDS_DATA = pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
)
README_BLOCKS = re.compile(r"```bash\n(.*?)```", re.S)


@pytest.fixture(scope="module")
def others(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DefaultPortsRay, MakeRun]]:
    """The neighbours, for the whole module: the service runs the quickstart job meanwhile."""
    job = ROOT / "examples" / "quickstart.yaml"
    with neighbours(tmp_path_factory.mktemp("neighbours"), job) as found:
        yield found


# -- a head of its own ----------------------------------------------------------------------


def test_a_head_of_its_own_shares_nothing_with_the_others(
    others: tuple[DefaultPortsRay, MakeRun], tmp_path: Path
) -> None:
    """Free ports (Ray's defaults are taken), its own temp dir with its own address file (the
    machine's one still names the other head), RAY_ADDRESS pinned to it in every process of
    it; ``stop`` leaves no process and no file."""
    before = Path("/tmp/ray/ray_current_cluster").read_text()
    head = start_head(env={**user_env(tmp_path / "home"), "RAY_AUTH_MODE": "disabled"})
    try:
        ports = {int(head.gcs_address.rsplit(":", 1)[1]), int(head.dashboard_url.rsplit(":", 1)[1])}
        assert ports.isdisjoint({6379, 8265})
        assert (
            (Path(head.temp_dir) / "ray_current_cluster")
            .read_text()
            .strip()
            .endswith(head.gcs_address.rsplit(":", 1)[1])
        )
        assert Path("/tmp/ray/ray_current_cluster").read_text() == before
        # The raylet starts every worker (Ray Train's placement-group cleaner included) with
        # its own environment. (Python processes of Ray's rewrite their /proc environ with
        # setproctitle: not read here.)
        named = {_name(pid): pid for pid in _group(head.pid)}
        assert {"raylet", "gcs_server"} <= set(named), named
        for name in ("raylet", "gcs_server"):
            assert f"RAY_ADDRESS={head.gcs_address}" in _environ(named[name]).splitlines()
    finally:
        head.stop()
    assert not Path(head.temp_dir).exists()
    assert _group(head.pid) == []


def _group(pgid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid and _environ(int(entry.name)):
                    found.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return found


def _name(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _environ(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "environ").read_bytes().replace(b"\0", b"\n").decode()
    except OSError:  # gone, or a zombie
        return ""


def test_a_ray_address_nothing_answers_fails_at_once_naming_the_fix(tmp_path: Path) -> None:
    """A stale RAY_ADDRESS (a head stopped with ``kill``): an error in seconds that names the
    cause and the fix, not Ray's ten-minute retries."""
    from kaisa_train.head import free_port

    env = user_env(tmp_path / "home", RAY_ADDRESS=f"127.0.0.1:{free_port()}")
    done = run([KAISA_RAY, "train", "--config", "examples/quickstart.yaml"], env, ROOT, 120)
    assert done.returncode == 1, done.stdout + done.stderr
    message = " ".join(done.stderr.split())
    assert "but nothing answers there" in message
    assert "unset RAY_ADDRESS to let this command start a local Ray of its own" in message


# -- the README's commands, verbatim, beside the others ---------------------------------------


def readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"<!-- {marker}:begin -->")[1].split(f"<!-- {marker}:end -->")[0]
    return "\n".join(README_BLOCKS.findall(section))


def checkout(tmp_path: Path) -> Path:
    """A checkout-like folder (what ``ray job submit --working-dir .`` uploads): the examples,
    the README, the .gitignore (which keeps the venv out of the upload) and the venv."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in (".venv", "examples", "README.md", ".gitignore"):
        (clone / name).symlink_to(ROOT / name)
    return clone


AUTO_JOB = {
    "name": "stored",
    "model": {"name": "mlp"},
    "dataset": {"name": "synthetic", "batch_size": 32},
    "kfac": {"strategy": "auto", "measure_staleness": True},
    "scaling": {"workers": 1},
    "stop": {"max_steps": 30},  # an intervals record every 10 steps
    "eval_every": 30,
}


@NEEDS_DATA
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_readme_commands_finish_beside_other_ray_instances(
    others: tuple[DefaultPortsRay, MakeRun], tmp_path: Path
) -> None:
    """Two terminals of one user at once, beside the others. In one, ``kaisa-ray tune`` of a
    ``kfac: auto`` job profiles it on a head of its own. In the other, the README's ``ray job
    submit`` block succeeds pasted as one block. Then, once both are done, ``train`` of the
    same job neither hangs nor profiles again (its profile from the local store the other
    terminal's ``tune`` wrote), and ``tune --history`` of that run needs no Ray at all. None
    connects to another head, none prints Ray's "multiple instances" traceback, none leaves a
    head behind. (The README's sweep as a command: ``test_streaming.py``'s streamed sweep and,
    with ASHA, ``test_service_e2e.py``'s sweep job.)"""
    clone = checkout(tmp_path)
    env = user_env(tmp_path / "home")
    (clone / "job.yaml").write_text(yaml.safe_dump(AUTO_JOB))
    out, err = (tmp_path / "tune.out").open("w"), (tmp_path / "tune.err").open("w")
    tuning = subprocess.Popen(
        [KAISA_RAY, "tune", "--config", "job.yaml"], cwd=clone, env=env, stdout=out, stderr=err
    )
    try:
        block = readme_block("ray-job-submit")
        assert "kaisa-ray head start" in block
        # Up to 10 min in a full run on a slow 2-core machine: a hang's bound, with room.
        done = run(["bash", "-c", "set -euo pipefail\n" + block], env, clone, 1200)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-6000:]
        assert re.search(r"Job 'raysubmit_\w+' succeeded", output), output[-4000:]
        assert re.search(r"run quickstart-\S+ finished at step 40", output), output[-4000:]
        assert "stopped the Ray head at http://127.0.0.1:" in output
        assert tuning.wait(timeout=1200) == 0, (tmp_path / "tune.err").read_text()[-6000:]
    finally:
        if tuning.poll() is None:
            tuning.kill()  # its head of its own goes with it (tied to it)
            tuning.wait(timeout=60)
        out.close()
        err.close()
    tuned = (tmp_path / "tune.out").read_text() + (tmp_path / "tune.err").read_text()
    assert "s of profiling" in tuned, tuned[-4000:]  # tune profiled...
    trained = run([KAISA_RAY, "train", "--config", "job.yaml"], env, clone, 1200)
    trained_output = trained.stdout + trained.stderr
    assert trained.returncode == 0, trained_output[-6000:]
    assert "profile from the tuner's cache" in trained_output  # ...and train did not, after it
    run_name = re.search(r"run (stored-\S+) finished at step 30", trained_output)
    assert run_name is not None, trained_output[-3000:]
    for said in (output, tuned, trained_output):
        assert ANY_OTHER not in said
        assert "PreemptionWatcher" not in said  # no node of one machine's head is drained
        assert 6379 not in connected_to(said)
        assert own_heads_left(said) == []
    assert list((tmp_path / "home" / ".cache" / "kaisa-ray" / "heads").glob("*.json")) == []

    history = run([KAISA_RAY, "tune", "--history", run_name[1]], env, clone, 120)
    assert history.returncode == 0, history.stdout + history.stderr
    assert connected_to(history.stdout + history.stderr) == []  # no Ray needed
    assert "net.1" in history.stdout  # the MLP's first Linear layer, by name


# -- make run, beside the others -----------------------------------------------------------


@NEEDS_DATA
def test_make_run_says_when_its_job_ended_without_a_line_per_request(
    others: tuple[DefaultPortsRay, MakeRun],
) -> None:
    """The other service is what ``make run`` runs (``serve --submit``): its terminal says
    each state of the job, then that it ended and how, and has no access-log line (the
    dashboard and every client poll it)."""
    _, served = others
    deadline = time.monotonic() + 300
    while "; the service keeps running (Ctrl-C stops it)" not in served.output():
        assert served.process.poll() is None, served.output()[-4000:]
        assert time.monotonic() < deadline, served.output()[-4000:]
        time.sleep(1)
    output = served.output()
    job = re.search(r"submitted \S+ as job (\w+)", output)
    assert job is not None, output[-4000:]
    assert f"job {job[1]}: RUNNING" in output
    assert re.search(
        rf"job {job[1]}: SUCCEEDED at step 40, test accuracy 0\.\d+; the service keeps running",
        output,
    ), output[-4000:]
    assert ' HTTP/1.1" ' not in output  # uvicorn's access log: '... "GET /readyz HTTP/1.1" 200'
    assert served.stop() == 0
    assert "shutdown complete" in served.output()
