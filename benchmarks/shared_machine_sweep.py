"""The README's sweep, verbatim and in full, beside other people's Ray on the same machine.

Issue 30 found that ``kaisa-ray sweep --config examples/fashion_mnist_sweep.yaml --output
best.yaml`` never finished when another Ray ran on the machine (a stopped trial's placement
group was never released, the next trial's workers waited forever). The suite's
``tests/train/test_shared_machine.py`` runs a reduced sweep (3 trials, one stopped by ASHA) beside
the others; this script runs the README's own: 16 trials of the LeNet job on Fashion-MNIST,
about 17 minutes on 2 cores.

Beside it, throughout: another user's ``ray start --head`` on Ray's default ports and temp
directory (it writes ``/tmp/ray/ray_current_cluster``), and a second ``kaisa-ray serve`` with
its embedded head running ``examples/quickstart.yaml``, as ``make run`` does (both from
``tests/support/neighbours.py``). The sweep runs as a new user runs it: in a fresh clone of this
commit (its ``.venv`` linked to this checkout's), a fresh home, no Ray or kaisa-ray variables,
the README's command line through ``bash``.

Reported: the sweep's exit status and wall-clock time, every trial's state, whether any
output carries Ray's "multiple active Ray instances" traceback, which GCS ports its drivers
connected to (never 6379, the other head's), whether its own head is gone afterwards, and
whether ``best.yaml`` validates.

Run ``python benchmarks/shared_machine_sweep.py`` (about 20 minutes); ``--write`` stores
``benchmarks/results/shared_machine_sweep.json`` and the table in ``benchmarks/README.md``;
``--from-json`` re-prints a stored run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
from report import machine, write_block  # noqa: E402
from support.cli_process import ANY_OTHER, connected_to, own_heads_left, user_env  # noqa: E402
from support.neighbours import neighbours  # noqa: E402

from kaisa_train.records import TrialState  # noqa: E402

RESULTS = HERE / "results"
COMMAND = ".venv/bin/kaisa-ray sweep --config examples/fashion_mnist_sweep.yaml --output best.yaml"
VALIDATE = ".venv/bin/kaisa-ray validate --config best.yaml"
TRIAL_ROW = re.compile(rf"^(\S+_\d{{5}})\s+({'|'.join(TrialState)})\b")


def readme_has_command() -> None:
    if COMMAND not in (ROOT / "README.md").read_text():
        raise SystemExit(f"README.md no longer has {COMMAND!r}: update this script")


def fresh_clone(where: Path) -> Path:
    clone = where / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    (clone / ".venv").symlink_to(ROOT / ".venv")
    return clone


def trial_states(stdout: str) -> dict[str, str]:
    """Each trial's final state from the table the sweep prints once it ends (the last row
    printed for a trial wins: the live lines come first)."""
    states: dict[str, str] = {}
    for line in stdout.splitlines():
        match = TRIAL_ROW.match(line.strip())
        if match:
            states[match[1]] = match[2]
    return states


def run(timeout_s: float) -> dict[str, Any]:
    readme_has_command()
    load_before = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="shared-machine-sweep-") as tmp:
        where = Path(tmp)
        clone = fresh_clone(where)
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True
        ).stdout.strip()  # the code the sweep ran, whatever this checkout holds by the end
        env = user_env(where / "home")
        with neighbours(where / "neighbours", ROOT / "examples" / "quickstart.yaml") as (
            other,
            served,
        ):
            started = time.monotonic()
            done = subprocess.run(
                ["bash", "-c", COMMAND],
                cwd=clone,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            seconds = time.monotonic() - started
            validated = subprocess.run(
                ["bash", "-c", VALIDATE], cwd=clone, env=env, capture_output=True, text=True
            )
            other_alive = other.process.poll() is None
            served_alive = served.process.poll() is None
        output = done.stdout + done.stderr
        states = trial_states(done.stdout)
        summary = re.search(r"sweep (\S+): (\d+) trials in (\d+) s", done.stdout)
        result = {
            "date": datetime.date.today().isoformat(),
            "commit": commit,
            "machine": machine(),
            "load_before": load_before,
            "command": COMMAND,
            "exit_status": done.returncode,
            "seconds": round(seconds, 1),
            "sweep_summary": summary[0] if summary else None,
            "trials": states,
            "multiple_instances_traceback": ANY_OTHER in output,
            "gcs_ports_connected": sorted(set(connected_to(output))),
            "own_heads_left": own_heads_left(output),
            "best_yaml_validates": validated.returncode == 0,
            "neighbours_still_running": other_alive and served_alive,
            "tail": output[-3000:],
        }
        shutil.rmtree(clone, ignore_errors=True)
    return result


def render(saved: dict[str, Any]) -> str:
    states: dict[str, str] = saved["trials"]
    counts: dict[str, int] = {}
    for state in states.values():
        counts[state] = counts.get(state, 0) + 1
    ended = sum(counts.get(s, 0) for s in ("SUCCEEDED", "STOPPED"))
    ok = (
        saved["exit_status"] == 0
        and len(states) == 16
        and ended == 16
        and not saved["multiple_instances_traceback"]
        and 6379 not in saved["gcs_ports_connected"]
        and not saved["own_heads_left"]
        and saved["best_yaml_validates"]
    )
    by_state = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"
    ports = ", ".join(str(p) for p in saved["gcs_ports_connected"]) or "none"
    return "\n".join(
        [
            f"Measured {saved['date']} at commit {saved['commit']} on {saved['machine']} "
            f"(before the run: {saved['load_before']}); beside a `ray start --head` on Ray's "
            "default ports and a second `kaisa-ray serve` running the quickstart job.",
            "",
            "| what | measured |",
            "| --- | --- |",
            f"| `{saved['command']}` | exit status {saved['exit_status']} after "
            f"{saved['seconds'] / 60:.1f} min |",
            f"| trials | {len(states)}: {by_state} |",
            f"| Ray's 'multiple active Ray instances' traceback | "
            f"{'printed' if saved['multiple_instances_traceback'] else 'none'} |",
            f"| GCS ports its drivers connected to | {ports} (the other head's: 6379) |",
            f"| its own head left behind | {', '.join(saved['own_heads_left']) or 'none'} |",
            f"| `kaisa-ray validate --config best.yaml` | "
            f"{'valid' if saved['best_yaml_validates'] else 'INVALID'} |",
            f"| the other Ray and service at the end | "
            f"{'still running' if saved['neighbours_still_running'] else 'GONE'} |",
            f"| verdict | {'PASS' if ok else 'FAIL'}: all 16 trials ended (trained to their "
            "stop or stopped by ASHA), no traceback, no other head reached, nothing left |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--from-json", type=Path, default=None)
    args = parser.parse_args()
    saved = json.loads(args.from_json.read_text()) if args.from_json else run(args.timeout_s)
    text = render(saved)
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "shared_machine_sweep.json").write_text(json.dumps(saved, indent=2) + "\n")
        write_block("shared-machine-sweep", text)


if __name__ == "__main__":
    main()
