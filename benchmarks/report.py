"""What every benchmark script shares: the machine line and the README block it rewrites."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

README = Path(__file__).resolve().parent / "README.md"


def machine() -> str:
    """CPU model, cores, torch version, threads and the load average now."""
    cpu = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s) in the driver, load average {load}"
    )


def git_commit() -> str:
    """The short hash of the commit the benchmark ran at."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=README.parent,
    ).stdout.strip()


def write_block(name: str, table: str, readme: Path = README) -> None:
    """Replace the ``<!-- name:begin -->`` ... ``<!-- name:end -->`` block with ``table``."""
    text = readme.read_text() if readme.exists() else ""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{table}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text += "\n" + block + "\n"
    readme.write_text(text)


def table(header: str, columns: list[str], rows: list[list[str]]) -> str:
    """A Markdown table under a header line."""
    lines = [
        header,
        "",
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
