"""The CPU a command's processes used, every process counted: pytest selections of the suite.

``python benchmarks/suite_cpu.py -- .venv/bin/python -m pytest tests/train/test_ray_train.py``
turns on the kernel's process accounting (Debian's ``acct``; root), runs the command, and sums
the user and system CPU of every process that ended meanwhile, by process name: Ray's heads,
Ray Train's workers and controllers, job drivers, browsers and pytest itself, also those that
were reparented away from the command (which ``time`` never sees). The machine should be
otherwise idle: every process that ends during the run is counted. CPU-seconds, unlike wall
time, do not depend on what else shares the cores, so two runs of a test before and after a
change compare.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TICKS_PER_S = 100  # acct v3 on Linux: AHZ


def accounted(command: list[str]) -> tuple[int, float, list[tuple[str, float, int]]]:
    """Runs ``command`` under process accounting: its exit code, wall seconds, and one
    (name, CPU seconds, pid) for every process that ended while it ran."""
    for tool in ("accton", "dump-acct"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: apt-get install acct (and run as root)")
    with tempfile.TemporaryDirectory() as work:
        log = Path(work) / "pacct"
        log.touch()
        subprocess.run(["accton", str(log)], check=True, capture_output=True)
        began = time.monotonic()
        names: dict[int, str] = {}
        done = threading.Event()
        watcher = threading.Thread(target=_watch, args=(names, done), daemon=True)
        watcher.start()
        try:
            code = subprocess.call(command)
        finally:
            wall = time.monotonic() - began
            subprocess.run(["accton", "off"], check=True, capture_output=True)
            done.set()
            watcher.join()
        dumped = subprocess.run(
            ["dump-acct", str(log)], check=True, capture_output=True, text=True
        ).stdout
    processes = []
    for line in dumped.splitlines():
        fields = [field.strip() for field in line.split("|")]
        user, system = float(fields[2]), float(fields[3])
        pid = int(fields[9])
        processes.append((names.get(pid, fields[0]), (user + system) / TICKS_PER_S, pid))
    return code, wall, processes


def _watch(names: dict[int, str], done: threading.Event) -> None:
    """Each process's command line, read every half second (the kernel's record keeps only
    the name of its last thread): Ray's processes rename themselves (``ray::RayTrainWorker``)."""
    while not done.wait(0.5):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if line.strip():
                    names[int(entry.name)] = line.strip()


KINDS = [  # (a part of the command line, the kind it names), the first match wins
    ("ray::", None),  # Ray's actors and workers, by their own names
    ("gcs_server", "Ray head: gcs_server"),
    ("raylet", "Ray: raylet"),
    ("dashboard/agent.py", "Ray: dashboard agent"),
    ("runtime_env/agent", "Ray: runtime env agent"),
    ("dashboard/dashboard.py", "Ray head: dashboard"),
    ("log_monitor.py", "Ray: log monitor"),
    ("ray_client_server", "Ray head: client server"),
    ("monitor.py", "Ray head: monitor"),
    ("ray start", "ray start"),
    ("chrom", "chromium"),
    ("kaisa-ray serve", "kaisa-ray serve"),
    ("kaisa-ray", "kaisa-ray (other commands)"),
    ("xdist", "pytest worker"),
    ("pytest", "pytest"),
    ("multiprocessing", "python multiprocessing child"),
]


def kind(name: str) -> str:
    """What a process was, from its command line (or, for a process too short-lived to be
    seen, the name the kernel kept: 15 characters of its last thread's)."""
    for part, named in KINDS:
        if part in name:
            if named is None:
                return name.split()[0][:40]
            return named
    return name.split()[0].rsplit("/", 1)[-1][:40] if name.strip() else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25, help="process names to list")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    code, wall, processes = accounted(command)
    by_kind: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for name, cpu, _ in processes:
        by_kind[kind(name)] += cpu
        count[kind(name)] += 1
    total = sum(by_kind.values())
    print(f"\n{' '.join(command)}")
    print(f"exit {code}; wall {wall:.0f} s; CPU {total:.0f} s in {len(processes)} processes")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| process | count | CPU s | share |\n| --- | --- | --- | --- |")
    for name, cpu in by_kind.most_common(args.top):
        print(f"| {name} | {count[name]} | {cpu:.1f} | {cpu / total:.0%} |")
    sys.exit(code)


if __name__ == "__main__":
    main()
