"""A worker process of the service's ``WorkerPool``: ``python -m service.plan_worker``.

It does the service's CPU-bound pricing away from the process that answers requests: a
plan (``kaisa_train.planning.plan_job``: minutes of pure Python for BERT-Large on 4096
GPUs) or a model's memory footprint (``kaisa_train.footprint``: building a model, maybe
a plugin's, on the meta device), one task at a time. The pool kills it when a task runs past
its time limit, when the client that asked has gone, and when the service stops.

Protocol: one JSON object a line on stdin (``{"kind": "plan", ...}``), one on the protocol
stream for each (``{"ok": result}``, ``{"refused": why}`` for a task that cannot be done as
asked, ``{"error": traceback}``); the first line it writes is ``{"ready": pid}``. Anything the
libraries print goes to stderr (the service's log), never into the protocol. It runs at the
lowest CPU priority, dies with its parent (``PR_SET_PDEATHSIG``), ignores Ctrl-C (the pool
ends it) and exits by itself after ``--idle-s`` seconds without a task.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import sys
import traceback
from typing import IO, Any

__all__ = ["handle", "main"]

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a service killed with -9 leaves no
    plan running on)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the pool's kill on stop still applies
        return
    if os.getppid() == 1:  # the parent died before the call
        os._exit(0)


def _plan(task: dict[str, Any]) -> dict[str, Any]:
    from kaisa_train.planning import PlanRequest, plan_job
    from kaisa_train.shapes import build_on_meta

    fields = dict(task["request"])
    fields["budgets"] = tuple(fields.get("budgets", ()))
    fields["intervals"] = tuple(tuple(pair) for pair in fields["intervals"])
    if fields.get("skip_layers") is not None:
        fields["skip_layers"] = tuple(fields["skip_layers"])
    request = PlanRequest(**fields)
    try:
        build_on_meta(request.model, request.params)  # the constructor's own checks first
    except ValueError as err:
        from kaisa_ray.errors import ConfigurationError

        raise ConfigurationError(f"model {request.model!r} cannot be built: {err}") from err
    report: dict[str, Any] = plan_job(request).to_json()
    return report


def _footprint(task: dict[str, Any]) -> dict[str, Any]:
    from kaisa_train.footprint import footprint

    return footprint(task["model"], task["params"], **task["options"]).as_json()


KINDS = {"plan": _plan, "footprint": _footprint}


def handle(task: dict[str, Any]) -> dict[str, Any]:
    """One task's answer (also run in process by the tests)."""
    from kaisa_ray.errors import ConfigurationError

    try:
        return {"ok": KINDS[task["kind"]](task)}
    except ConfigurationError as err:
        return {"refused": str(err)}
    except Exception:
        return {"error": traceback.format_exc()[-4000:]}


def _serve(protocol: IO[str], idle_s: float) -> None:
    stdin = sys.stdin.buffer
    while True:
        readable, _, _ = select.select([stdin], [], [], idle_s)
        if not readable:
            return  # idle: the pool starts another when it needs one
        line = stdin.readline()
        if not line:
            return  # the pool closed our stdin
        answer = handle(json.loads(line))
        protocol.write(json.dumps(answer) + "\n")
        protocol.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=600)
    args = parser.parse_args()
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpriority(os.PRIO_PROCESS, 0, 19)  # every request of the service goes first
    # The protocol gets stdout's descriptor to itself; print() and libraries write to stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import kaisa_train.footprint  # the slow imports, before "ready"
    import kaisa_train.planning  # noqa: F401

    protocol.write(json.dumps({"ready": os.getpid()}) + "\n")
    protocol.flush()
    _serve(protocol, args.idle_s)


if __name__ == "__main__":
    main()
