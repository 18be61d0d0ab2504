"""kaisa-ray's own commands with other people's Ray instances on the same machine: another
user's ``ray start --head`` on Ray's default ports (it writes ``/tmp/ray/ray_current_cluster``)
and a second ``kaisa-ray serve`` with its embedded head, both running throughout.

Every command runs as a new user runs it: a real process, a fresh home, the venv on PATH
(as after ``source .venv/bin/activate``), no Ray or kaisa-ray variables set.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from neighbours import DefaultPortsRay, MakeRun, neighbours
from ray_head import TEST_ENV, RayHead

from kaisa_ray.train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_ray.train.head import HEAD_PREFIX, start_head

pytestmark = [pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[1]
KAISA_RAY = str(ROOT / ".venv" / "bin" / "kaisa-ray")
NEEDS_DATA = pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
)
README_BLOCKS = re.compile(r"```bash\n(.*?)```", re.S)
ANY_OTHER = "Found multiple active Ray instances"


@pytest.fixture(scope="module")
def others(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DefaultPortsRay, MakeRun]]:
    """The neighbours, for the whole module: the service runs the quickstart job meanwhile."""
    job = ROOT / "examples" / "quickstart.yaml"
    with neighbours(tmp_path_factory.mktemp("neighbours"), job) as found:
        yield found


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A new user's environment: a fresh home, the venv first on PATH, no Ray settings but the
    suite's fast Ray Train health checks."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KAISA_RAY_", "RAY_", "VIRTUAL_ENV", "XDG_"))
    }
    env.update(TEST_ENV)
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), PATH=f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", **extra)
    return env


def run(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def connected_to(output: str) -> list[int]:
    """The GCS ports the Ray drivers in ``output`` connected to."""
    return [
        int(p)
        for p in re.findall(r"Connecting to existing Ray cluster at address: \S+:(\d+)", output)
    ]


def own_heads_left(output: str) -> list[str]:
    """The temp directories of heads of their own named in ``output`` that still exist."""
    named = set(re.findall(rf"/tmp/{HEAD_PREFIX}\w+", output))
    return sorted(d for d in named if Path(d).exists())


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
    from kaisa_ray.train.head import free_port

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


def reduced_sweep(clone: Path) -> Path:
    """The README's sweep example with fewer, shorter trials (the full one: 16 trials, about
    17 minutes here): the same model and scheduler, on 4096 images to 80%, over two learning
    rates far apart, so that ASHA certainly stops a trial at its first rung while its workers
    run, and another must start after it: Tune's seed 1 draws 0.05 (reaches 80%), then 0.0005
    twice (the first of these falls behind at step 25). Training here is deterministic: three
    trials at 0.0005 ended at the same accuracy to the digit."""
    spec = yaml.safe_load((ROOT / "examples" / "fashion_mnist_sweep.yaml").read_text())
    spec["dataset"]["limit"] = 4096
    spec["stop"] = {"max_steps": 150, "target": {"metric": "test_accuracy", "value": 0.8}}
    spec["checkpoint"] = {"every_steps": 150, "keep": 1}
    spec["sweep"]["trials"] = 3
    spec["sweep"]["space"] = {"optimizer.lr": {"choice": [0.05, 0.0005]}}
    spec["sweep"]["seed"] = 1
    spec["sweep"]["asha"] = {"grace_steps": 25, "reduction_factor": 2}
    path = clone / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@NEEDS_DATA
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_commands_finish_beside_other_ray_instances(
    others: tuple[DefaultPortsRay, MakeRun], tmp_path: Path
) -> None:
    """The README's sweep (reduced) ends every trial, its ``ray job submit`` block succeeds
    pasted as one block, and the next ``kaisa-ray train`` runs on a Ray of its own: none
    connects to the other heads, none prints Ray's "multiple instances" traceback, none
    leaves a head behind."""
    clone = checkout(tmp_path)
    env = user_env(tmp_path / "home")

    # The sweep: kaisa-ray sweep --config ... --output best.yaml, as in the README.
    sweep = reduced_sweep(clone)
    command = ["--config", str(sweep), "--output", "best.yaml"]
    assert (
        "kaisa-ray sweep --config examples/fashion_mnist_sweep.yaml --output best.yaml"
        in (ROOT / "README.md").read_text()
    )
    done = run([KAISA_RAY, "sweep", *command], env, clone, 600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert ANY_OTHER not in output
    assert re.search(r"sweep \S+: 3 trials in \d+ s\n", output), output[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r"^\S+_0000\d ", line)]
    states = [row[1] for row in rows]
    assert len(states) == 3, done.stdout[-3000:]
    assert set(states) <= {"SUCCEEDED", "STOPPED"}, done.stdout[-3000:]
    assert "STOPPED" in states[:-1], done.stdout[-3000:]  # ASHA stopped one, and one came after
    assert (clone / "best.yaml").is_file()
    assert run([KAISA_RAY, "validate", "--config", "best.yaml"], env, clone).returncode == 0
    assert 6379 not in connected_to(output)
    assert own_heads_left(output) == []

    # The `ray job submit` block, pasted as one block, then the next `kaisa-ray train`.
    block = readme_block("ray-job-submit")
    assert "kaisa-ray head start" in block
    script = block + "\nkaisa-ray train --config examples/quickstart.yaml --no-progress\n"
    done = run(["bash", "-c", "set -euo pipefail\n" + script], env, clone, 600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert re.search(r"Job 'raysubmit_\w+' succeeded", output), output[-4000:]
    finished = re.findall(r"run quickstart-\S+ finished at step 40", output)
    assert len(finished) == 2, output[-4000:]  # the submitted job's, and the next train's
    assert ANY_OTHER not in output
    assert 6379 not in connected_to(output)
    assert "stopped the Ray head at http://127.0.0.1:" in output
    assert own_heads_left(output) == []
    assert list((tmp_path / "home" / ".cache" / "kaisa-ray" / "heads").glob("*.json")) == []


# -- a sweep ends every trial, or says why not --------------------------------------------------


def tiny_sweep(tmp_path: Path, trials: int, **overrides: Any) -> Path:
    spec: dict[str, Any] = {
        "name": "tiny-sweep",
        "model": {"name": "mlp"},
        "dataset": {"name": "synthetic", "batch_size": 32},
        "kfac": {"strategy": "auto"},
        "scaling": {"workers": 1},
        "stop": {"max_steps": 2000},
        "eval_every": 50,
        "sweep": {
            "space": {"optimizer.lr": {"loguniform": [0.001, 0.1]}},
            "trials": trials,
            "scheduler": "none",
        },
    }
    spec.update(overrides)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_trial_whose_workers_cannot_be_placed_fails_saying_so(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """Five workers on a 4-CPU cluster: the trial fails after scaling.resource_timeout_s with
    the reason (the workers' and the cluster's resources) instead of waiting forever."""
    config = tiny_sweep(
        tmp_path, 1, scaling={"workers": 5, "cpus_per_worker": 1, "resource_timeout_s": 3}
    )
    env = {**user_env(tmp_path / "home"), "RAY_ADDRESS": ray_head.gcs_address}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ray_head.token)
    done = run([KAISA_RAY, "sweep", "--config", str(config)], env, tmp_path, 300)
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, output[-4000:]
    assert "FAILED" in output
    assert (
        "WorkersNotPlacedError: the job's 5 workers (1 CPU each, placement pack) did not get "
        "their resources within scaling.resource_timeout_s=3 s (the cluster has 4 CPU in all"
    ) in output
    assert "no trial reported time_to_target" in output or "no trial reported" in output


def test_ctrl_c_ends_a_sweep_without_a_result(tmp_path: Path) -> None:
    """Ctrl-C while a trial runs: the sweep says it was interrupted, exits 130 (not 0), writes
    no best spec, and its Ray of its own is gone."""
    config = tiny_sweep(tmp_path, 4)
    env = user_env(tmp_path / "home")
    process = subprocess.Popen(
        [KAISA_RAY, "sweep", "--config", str(config), "--output", "best.yaml"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    assert process.stdout is not None
    deadline = time.monotonic() + 240
    for line in process.stdout:
        lines.append(line)
        if re.match(r"trial \S+ RUNNING", line) or time.monotonic() > deadline:
            break
    assert any(re.match(r"trial \S+ RUNNING", line) for line in lines), "".join(lines)[-4000:]
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=180)
    output = "".join(lines) + rest
    assert process.returncode == 130, output[-4000:]
    assert "was interrupted before its 4 trials ended: no best spec is written" in output
    assert "did not end: the sweep was interrupted" in output
    assert not (tmp_path / "best.yaml").exists()
    assert own_heads_left(output) == []


# -- what one command leaves for the next -----------------------------------------------------


def test_train_after_tune_reuses_its_profile_and_history_finds_the_run(tmp_path: Path) -> None:
    """Separate commands, each on a Ray of its own: ``train`` after ``tune`` takes the profile
    from the local store (no profiling again), and ``tune --history`` finds the run ``train``
    made, with no Ray at all."""
    spec = {
        "name": "stored",
        "model": {"name": "mlp"},
        "dataset": {"name": "synthetic", "batch_size": 32},
        "kfac": {"strategy": "auto", "measure_staleness": True},
        "scaling": {"workers": 1},
        "stop": {"max_steps": 30},  # an intervals record every 10 steps
        "eval_every": 30,
    }
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(spec))
    env = user_env(tmp_path / "home")
    tuned = run([KAISA_RAY, "tune", "--config", str(config)], env, tmp_path)
    assert tuned.returncode == 0, (tuned.stdout + tuned.stderr)[-4000:]
    assert "s of profiling" in tuned.stdout
    store = tmp_path / "home" / ".cache" / "kaisa-ray"
    assert (store / "tuner-profiles.pickle").is_file()

    trained = run([KAISA_RAY, "train", "--config", str(config)], env, tmp_path)
    output = trained.stdout + trained.stderr
    assert trained.returncode == 0, output[-4000:]
    assert "profile from the tuner's cache" in output
    run_name = re.search(r"run (stored-\S+) finished at step 30", output)
    assert run_name is not None, output[-3000:]

    history = run([KAISA_RAY, "tune", "--history", run_name[1]], env, tmp_path, 60)
    assert history.returncode == 0, history.stdout + history.stderr
    assert "Connecting to" not in history.stdout + history.stderr  # no Ray needed
    assert "layer" in history.stdout.lower()

    missing = run([KAISA_RAY, "tune", "--history", "no-such-run"], env, tmp_path, 60)
    assert missing.returncode == 1
    message = " ".join(missing.stderr.split())
    assert f"the local store ({store / 'runs'})" in message
    assert "A `kaisa-ray train` without RAY_ADDRESS runs on a Ray of its own" in message


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
