"""Run a function on W processes joined by a gloo process group (CPU).

The processes are forked from a fork server that has imported torch, the project and the
tests' worker modules once (``multiprocessing``'s ``forkserver``): a rank starts in a fraction
of a second instead of importing torch again. The server has run no torch operation (no
thread pool to fork), and each rank is given the caller's environment as it is now.

Every child's exit code is checked, a child's traceback is surfaced in the failure, and a
hang fails within ``timeout`` seconds (all children are killed) instead of blocking the suite.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store: str,
    out: str,
    kwargs: dict[str, Any],
    backend: str,
    environ: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # NCCL: one GPU per rank
        dist.init_process_group(
            backend, init_method=f"file://{store}", rank=rank, world_size=world_size
        )
        result = fn(rank, world_size, **kwargs)
        dist.barrier()
        dist.destroy_process_group()
        _write(out, ("ok", result))
    except BaseException:
        _write(out, ("error", traceback.format_exc()))
        raise SystemExit(1) from None


def _write(out: str, payload: tuple[str, Any]) -> None:
    """Write whole or not at all: a child killed mid-write (a hang's clean-up) leaves no
    half-written file for the parent to misread."""
    with open(out + ".part", "wb") as handle:
        pickle.dump(payload, handle)
    os.replace(out + ".part", out)


# What every rank needs, imported once in the fork server (an import that fails is skipped
# there and done by the rank itself).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "kaisa_ray",
    "support.harness",
    "support.kfac_workers",
    "support.fsdp_workers",
]


def _context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout: float = 240.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """``fn(rank, world_size, **kwargs)`` on every rank (``backend`` gloo on the CPU, or nccl
    with rank r on GPU r); returns the results by rank."""
    context = _context()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        outs = [str(Path(tmp) / f"rank{r}.pkl") for r in range(world_size)]
        procs = [
            context.Process(
                target=_child,
                args=(fn, r, world_size, store, outs[r], kwargs, backend, dict(os.environ)),
            )
            for r in range(world_size)
        ]
        try:
            for proc in procs:
                proc.start()
            deadline = time.monotonic() + timeout
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        finally:  # also on an interrupted test: no child outlives it
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        errors = []
        results = []
        for rank, (proc, out) in enumerate(zip(procs, outs, strict=True)):
            status, payload = ("missing", None)
            if Path(out).exists():
                with open(out, "rb") as handle:
                    status, payload = pickle.load(handle)
            if status == "error":
                errors.append(f"rank {rank} raised:\n{payload}")
            elif proc.exitcode != 0 and rank not in hung:
                errors.append(f"rank {rank} exited with code {proc.exitcode}")
            results.append(payload)
        if hung:
            raise AssertionError(
                f"ranks {hung} of {world_size} still running after {timeout:.0f} s (a hang)"
                + ("\n" + "\n".join(errors) if errors else "")
            )
        if errors:
            raise AssertionError("\n".join(errors))
        return results
