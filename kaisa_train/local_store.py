"""What standalone ``kaisa-ray`` commands share across runs, in the user's cache folder
(``$XDG_CACHE_HOME/kaisa-ray``, by default ``~/.cache/kaisa-ray``).

A ``kaisa-ray train``, ``tune`` or ``sweep`` without ``RAY_ADDRESS`` runs on a Ray head of its
own that stops when the command ends (``connection.py``), and with it the progress sink and the
tuner actor. So that ``kaisa-ray tune --history RUN`` finds a run an earlier command made, and
``train`` after ``tune`` skips profiling, that head saves here, when it stops, every run's
records (one JSON-lines file a run, the newest ``MAX_RUNS`` kept) and the tuner's profiles
(a pickle of ``tuner.cost.Profile`` by profile key: they depend on the machine, the threads and
the torch version, all in the key; an unreadable file is ignored and rewritten).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["LocalStore", "cache_dir"]

logger = logging.getLogger(__name__)

MAX_RUNS = 500
_RUN_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=-]{0,250}$")
PROFILES_FORMAT = 1  # bump when tuner.cost.Profile changes incompatibly


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kaisa-ray``, or ``~/.cache/kaisa-ray``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kaisa-ray"


def _write(path: Path, data: bytes) -> None:
    """``data`` to ``path`` at once (a temp file renamed), readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


class LocalStore:
    """Run records and tuner profiles under ``root`` [default: ``cache_dir()``]."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cache_dir()

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def profiles_file(self) -> Path:
        return self.root / "tuner-profiles.pickle"

    def _run_file(self, run: str) -> Path:
        if not _RUN_FILE.match(run):
            raise ValueError(f"run name {run!r} cannot name a file of the local store")
        return self.runs_dir / f"{run}.jsonl"

    def save_run(self, run: str, records: list[dict[str, Any]]) -> None:
        """A run's records (as the progress sink holds them), replacing what was kept."""
        text = "".join(json.dumps(r, default=str) + "\n" for r in records)
        path = self._run_file(run)
        with self._locked():
            _write(path, text.encode())
            self._prune()

    def run_records(self, run: str) -> list[dict[str, Any]] | None:
        """The records kept for ``run``, or None when none were."""
        try:
            path = self._run_file(run)
            lines = path.read_text().splitlines()
        except (OSError, ValueError):
            return None
        return [json.loads(line) for line in lines if line.strip()]

    def runs(self) -> list[str]:
        """The runs kept, newest first."""
        files = sorted(self.runs_dir.glob("*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True)
        return [p.name.removesuffix(".jsonl") for p in files]

    def _prune(self) -> None:
        for old in self.runs()[MAX_RUNS:]:
            (self.runs_dir / f"{old}.jsonl").unlink(missing_ok=True)

    def save_profiles(self, profiles: dict[str, Any]) -> None:
        """The tuner's profiles by key, merged over what was kept (under a lock: two commands
        that end at once both keep theirs)."""
        with self._locked():
            kept = {**self.profiles(), **profiles}
            data = pickle.dumps({"format": PROFILES_FORMAT, "profiles": kept})
            _write(self.profiles_file, data)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def profiles(self) -> dict[str, Any]:
        """The tuner's profiles kept here; none when the file is missing or unreadable."""
        try:
            data = pickle.loads(self.profiles_file.read_bytes())  # this user's own file (0600)
        except FileNotFoundError:
            return {}
        except Exception as err:  # a file from another version: start afresh
            logger.warning("ignoring the tuner profiles in %s: %s", self.profiles_file, err)
            return {}
        if not isinstance(data, dict) or data.get("format") != PROFILES_FORMAT:
            return {}
        profiles = data.get("profiles")
        return dict(profiles) if isinstance(profiles, dict) else {}
