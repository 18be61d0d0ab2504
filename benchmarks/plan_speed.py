"""How long ``kaisa-ray plan`` takes: BERT-Large and ResNet-50 at 8 to 65,536 GPUs, the code
of a commit (``--before``, a worktree of it) against this one's.

Two figures per model and world size, each measured in a fresh process of the tree measured
(its own ``kaisa_ray``, ``tuner`` and ``service`` on ``PYTHONPATH``, this venv's packages):

- **the planner**: ``plan_job`` for the model on the ``a100-80gb-hdr`` preset at the default
  intervals and budget, with the model's shapes already built (``kaisa_train.shapes``: one
  meta forward pass, the same for any world size): every strategy's assignment, schedule,
  memory, collectives and priced candidates, the tuner's choice. The median of ``--repeats``
  runs (one for the old code where it is slow);
- **the command end to end**: ``kaisa-ray plan --model M --workers W --batch B`` as a user
  runs it, the whole process: Python, imports (torch among them), the shapes, the planner
  and the printing.

Times are seconds of CPU (a process's own, from ``resource``), the wall clock beside them: on
this shared machine the load moves the wall clock by several times. Where the old code runs
past ``--cpu-limit`` seconds of CPU it is stopped (``RLIMIT_CPU``) and the cell says so;
world sizes above the first it did not finish are not run on it (every part of it grew with
W or W²). The shapes' own time is printed once per model.

    git worktree add --detach /tmp/kaisa-before a85ad65
    python benchmarks/plan_speed.py --before /tmp/kaisa-before --write

``--write`` stores the table in benchmarks/README.md. Timings on this shared machine move
with its load: the before and after of a cell run one after the other, and the load average
is recorded with each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from report import git_commit, machine, table, write_block

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"bert-large": 8, "resnet50": 32}  # model: batch per GPU
WORLDS = (8, 64, 1024, 4096, 65536)

# Run in the tree measured: its planner, the model's shapes built once, then plan_job timed.
CHILD = """
import json, statistics, sys, time
from kaisa_train import planning
from kaisa_train.shapes import workload
model, batch, world, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
began = time.process_time()
job = workload(model, batch_size=batch)
first = time.process_time() - began
began = time.process_time()
job = workload(model, batch_size=batch)
again = time.process_time() - began
planning.workload = lambda *args, **kwargs: job  # the shapes, built: the planner alone
request = planning.PlanRequest(
    model=model, batch_size=batch, workers=world, hardware="a100-80gb-hdr"
)
walls, cpus = [], []
for _ in range(repeats):
    wall, cpu = time.perf_counter(), time.process_time()
    report = planning.plan_job(request).to_json()
    walls.append(time.perf_counter() - wall)
    cpus.append(time.process_time() - cpu)
print(json.dumps({
    "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
    "shapes_first_s": first, "shapes_s": again, "strategies": len(report["strategies"]),
}))
"""
CLI = "import sys; from service.cli import main; sys.argv[0] = 'kaisa-ray'; sys.exit(main())"


@dataclass(frozen=True, kw_only=True)
class Result:
    wall_s: float | None = None  # None: stopped at the limit (the note says which)
    cpu_s: float | None = None
    shapes_first_s: float | None = None
    shapes_s: float | None = None
    note: str = ""


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), RAY_AUTH_MODE="disabled")
    env.pop("PYTHONSTARTUP", None)
    return env


def _run(command: list[str], tree: Path, cpu_limit: float) -> tuple[str, float, float] | str:
    """Run ``command`` in ``tree`` with at most ``cpu_limit`` seconds of CPU (then SIGXCPU;
    CPU, not wall: on this shared machine the load moves the wall clock by several times).
    Its stdout, wall and CPU seconds; or why it stopped."""
    limit = int(cpu_limit)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 5))

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            cwd=tree,
            env=_env(tree),
            capture_output=True,
            text=True,
            timeout=20 * cpu_limit,  # a safety net only
            preexec_fn=limited,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"stopped after {20 * cpu_limit:.0f} s of wall time"
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - used.ru_utime) + (after.ru_stime - used.ru_stime)
    if done.returncode == -signal.SIGXCPU or (done.returncode < 0 and cpu >= limit):
        return f"did not finish in {limit} s of CPU"
    if done.returncode != 0:
        raise RuntimeError(f"{command[3:]} failed in {tree}:\n{done.stderr[-3000:]}")
    return done.stdout, wall, cpu


def planner(tree: Path, model: str, world: int, repeats: int, cpu_limit: float) -> Result:
    command = [sys.executable, "-c", CHILD, model, str(MODELS[model]), str(world), str(repeats)]
    ran = _run(command, tree, cpu_limit)
    if isinstance(ran, str):
        return Result(note=ran)
    found = json.loads(ran[0].strip().splitlines()[-1])
    return Result(
        wall_s=found["wall_s"],
        cpu_s=found["cpu_s"],
        shapes_first_s=found["shapes_first_s"],
        shapes_s=found["shapes_s"],
    )


def end_to_end(tree: Path, model: str, world: int, cpu_limit: float) -> Result:
    command = [sys.executable, "-c", CLI, "plan", "--model", model, "--workers", str(world)]
    command += ["--batch", str(MODELS[model])]
    ran = _run(command, tree, cpu_limit)
    if isinstance(ran, str):
        return Result(note=ran)
    return Result(wall_s=ran[1], cpu_s=ran[2])


def _seconds(result: Result | None, cpu: bool = True) -> str:
    if result is None:
        return "not run"
    value = result.cpu_s if cpu else result.wall_s
    if value is None:
        return result.note
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a worktree of the commit to compare with")
    parser.add_argument(
        "--cpu-limit", type=float, default=240.0, help="CPU seconds the old code may take"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of the planner per cell")
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument("--no-cli", action="store_true", help="skip the end-to-end runs")
    parser.add_argument("--write", action="store_true", help="store the table")
    parser.add_argument(
        "--block", default="plan-speed", help="the README block to store it in (with --write)"
    )
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.UTC)
    before_commit = ""
    if args.before is not None:
        before_commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=args.before,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    rows, shapes = [], {}
    slowest = 0.0
    for model in MODELS:
        gave_up = False
        for world in args.worlds:
            load = _load()
            after = planner(ROOT, model, world, args.repeats, cpu_limit=600)
            if after.wall_s is None or after.cpu_s is None:
                raise RuntimeError(f"the planner {after.note} at {world} GPUs ({model})")
            shapes[model] = after
            before: Result | None = None
            if args.before is not None and not gave_up:
                repeats = args.repeats if world <= 64 else 1
                before = planner(args.before, model, world, repeats, args.cpu_limit)
                gave_up = before.cpu_s is None
            cli_after = cli_before = None
            if not args.no_cli:
                cli_after = end_to_end(ROOT, model, world, cpu_limit=600)
                if before is not None and before.cpu_s is not None:
                    cli_before = end_to_end(args.before, model, world, args.cpu_limit)
            slowest = max(slowest, after.cpu_s, after.wall_s)
            ratio = "-"
            if before is not None and before.cpu_s is not None:
                ratio = f"{before.cpu_s / after.cpu_s:,.0f}x"
            rows.append(
                [
                    model,
                    f"{world:,}",
                    _seconds(before),
                    _seconds(after),
                    _seconds(after, cpu=False),
                    ratio,
                    _seconds(cli_before) if cli_before is not None else "-",
                    _seconds(cli_after) if cli_after is not None else "-",
                    _seconds(cli_after, cpu=False) if cli_after is not None else "-",
                    load,
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
    shape_lines = [
        f"{model} {r.shapes_first_s:.2f} s the first time in a process (torch imports its "
        f"compiler stack for the meta kernels), {r.shapes_s:.2f} s after"
        for model, r in shapes.items()
        if r.shapes_first_s is not None and r.shapes_s is not None
    ]
    header = (
        f"Measured {started:%Y-%m-%d %H:%M} UTC on {machine()}; after: commit {git_commit()}"
        + (f", before: commit {before_commit}" if before_commit else "")
        + ". Seconds of CPU unless marked wall (the load on this shared machine moves the wall "
        "clock by several times; CPU is what one idle core would take). The planner: "
        f"`plan_job` on the a100-80gb-hdr preset with the model's shapes built, the median of "
        f"{args.repeats} runs (the old code: one run from 1024 GPUs on, stopped at "
        f"{args.cpu_limit:.0f} s of CPU, and not run at larger sizes once stopped). End to "
        "end: `kaisa-ray plan --model M --workers W --batch B` in a fresh process (Python, the "
        "imports, the shapes, the planner, the printing), one run. Load: the 1-minute load "
        "average when the cell began."
    )
    text = table(
        header,
        [
            "model",
            "GPUs",
            "planner before",
            "planner after",
            "after, wall",
            "speed-up",
            "end to end before",
            "end to end after",
            "after, wall",
            "load",
        ],
        rows,
    )
    text += (
        "\n\nThe model's shapes (one meta forward pass, the same at every world size; CPU): "
        + "; ".join(shape_lines)
        + f". The slowest planner after: {slowest:.3f} s."
    )
    print(text)
    if args.write:
        write_block(args.block, text)


if __name__ == "__main__":
    main()
