"""``kaisa-ray`` commands as a new user runs them: a real process, a fresh home, the venv
first on PATH (as after ``source .venv/bin/activate``), no Ray or kaisa-ray settings but the
suite's fast Ray Train health checks."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from kaisa_train.head import HEAD_PREFIX
from support.ray_head import TEST_ENV

ROOT = Path(__file__).resolve().parents[2]
KAISA_RAY = str(ROOT / ".venv" / "bin" / "kaisa-ray")
ANY_OTHER = "Found multiple active Ray instances"  # Ray's cleaners, lost among several Rays


def user_env(home: Path, **extra: str) -> dict[str, str]:
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
    found = re.findall(r"Connecting to existing Ray cluster at address: \S+:(\d+)", output)
    return [int(port) for port in found]


def own_heads_left(output: str) -> list[str]:
    """The temp directories of heads of their own named in ``output`` that still exist."""
    named = set(re.findall(rf"/tmp/{HEAD_PREFIX}\w+", output))
    return sorted(d for d in named if Path(d).exists())
