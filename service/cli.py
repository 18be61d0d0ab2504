"""The ``kaisa-ray`` command line, one group defined here: ``serve`` runs the service;
``submit``, ``jobs`` and ``cancel`` (``service.client_cli``) talk to a running one over REST;
the training commands (``train``, ``validate``, ``tune``, ``sweep`` from ``kaisa_train.cli``,
``example`` from ``kaisa_train.example_cli``, and ``plan`` and ``measure-node`` from
``kaisa_train.plan_cli``) are loaded only when one of them runs, so that the client commands
start in a fraction of a second: they import neither torch nor Ray."""

from __future__ import annotations

import importlib
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click

from kaisa_ray.enums import EvalMetric
from service.client import ServiceClient, ServiceClientError
from service.client_cli import cancel, jobs, progress_text, read_job_file, submit
from service.model.lifecycle import JobState

__all__ = ["main"]

logger = logging.getLogger(__name__)

TRAINING_COMMANDS = {
    "example": "kaisa_train.example_cli:example",
    "validate": "kaisa_train.cli:validate",
    "train": "kaisa_train.cli:train",
    "tune": "kaisa_train.cli:tune",
    "sweep": "kaisa_train.cli:sweep",
    "plan": "kaisa_train.plan_cli:plan",
    "measure-node": "kaisa_train.plan_cli:measure_node",
    "head": "kaisa_train.head_cli:head",
}
"""The training commands, by where they are defined: they import torch (and Ray), so they
are imported only when they run."""

TRAINING_HELP = {
    "example": "Train LeNetCNN on Fashion-MNIST with SGD, K-FAC preconditioned unless --no-kfac.",
    "validate": "Check a job file and print it with every default filled in; exit 1 naming each "
    "bad field.",
    "train": "Train a job on Ray Train: locally, or on the cluster when run by `ray job submit`.",
    "tune": "Choose K-FAC's strategy for a `kfac: auto` job without training: profile the job "
    "on its own workers, print the candidate table and the decision (with adapted intervals: "
    "each layer's cost on every rung).",
    "sweep": "Run a job's hyperparameter sweep on Ray Tune; print its trials and the best spec.",
    "plan": "What K-FAC would cost for a job (--config/--spec) or a model (--model, --workers, "
    "--batch) on GPUs of a hardware profile: memory and collectives per strategy, time per "
    "step and its parts per candidate, and the tuner's choice under each --budget.",
    "measure-node": "Measure this machine's GPU (matmul rates by size, eigh times, launch "
    "latency, the intra-node collectives when several GPUs are visible, ResNet-50 training "
    "throughput) into a hardware profile; every measured number says when, where and with what "
    "it was measured.",
    "head": "A Ray head of its own for `ray job submit`: free ports, its own temp directory, "
    "every process of it pinned to it (RAY_ADDRESS); other Ray instances on the machine neither "
    "see it nor are seen by it.",
}
"""Each training command's short help as its own docstring gives it, so that ``kaisa-ray
--help`` lists them without importing them (``tests/service/test_service_cli.py`` checks that
each equals the command's own)."""


class _Commands(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *TRAINING_COMMANDS})

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list, as click writes it, with the training commands' short help from
        ``TRAINING_HELP`` instead of from the commands themselves (which import torch)."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            if name in TRAINING_HELP:
                stand_in = click.Command(name, help=TRAINING_HELP[name])  # click's truncation
                rows.append((name, stand_in.get_short_help_str(limit)))
                continue
            command = super().get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        where = TRAINING_COMMANDS.get(name)
        if where is not None:
            module, attribute = where.split(":")
            command: click.Command = getattr(importlib.import_module(module), attribute)
            return command
        return super().get_command(ctx, name)


@click.group(cls=_Commands)
@click.option("-v", "--verbose", count=True, help="Log more: -v for INFO, -vv for DEBUG.")
@click.version_option(package_name="kaisa-ray")
def main(verbose: int) -> None:
    """K-FAC second-order preconditioning in the KAISA style: training jobs on Ray, and the
    job service."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def program() -> str:
    """How the user ran this command (``.venv/bin/kaisa-ray``), for the hints it prints."""
    typed = sys.argv[0] if sys.argv else ""
    return typed if Path(typed).name == "kaisa-ray" else "kaisa-ray"


@main.command()
@click.option("--host", default=None, help="Interface to listen on [default: 127.0.0.1].")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="[default: 8000]; 0: a free one the OS picks (uvicorn's start line names it).",
)
@click.option(
    "--ray-address",
    default=None,
    help="A Ray cluster's GCS address (host:6379) [default: start an embedded local head].",
)
@click.option("--dashboard-url", default=None, help="The cluster's job server, if not found.")
@click.option(
    "--database-url",
    default=None,
    help="SQLAlchemy URL of the job store [default: sqlite:///<data-dir>/jobs.db].",
)
@click.option(
    "--token",
    default=None,
    help="Require 'Authorization: Bearer <token>'. Prefer $KAISA_RAY_TOKEN or --token-file: "
    "a command line is visible to every user of the machine.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Read the token from this file's first line [$KAISA_RAY_TOKEN_FILE].",
)
@click.option(
    "--insecure",
    is_flag=True,
    default=None,
    help="Serve a non-loopback --host without a token (anyone who reaches it can run jobs).",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="Without a token, also answer requests addressed to this name (repeatable) "
    "[default: 127.0.0.1, ::1 and localhost only].",
)
@click.option(
    "--max-running",
    type=click.IntRange(1, 10_000),
    default=None,
    help="Jobs in Ray at once; the rest wait QUEUED [default: what the cluster's CPUs hold].",
)
@click.option("--max-workers", type=click.IntRange(1, 4096), default=None, help="[default: 64]")
@click.option(
    "--max-gpus-per-worker", type=click.FloatRange(0, 16), default=None, help="[default: 8]"
)
@click.option(
    "--min-cpus-per-worker",
    type=click.FloatRange(0, 1024),
    default=None,
    help="The fewest CPUs one worker may ask for [default: 0.5].",
)
@click.option(
    "--max-model-bytes",
    default=None,
    help="The most a job's model may hold per worker, parameters and activations [16GiB].",
)
@click.option(
    "--max-plans",
    type=click.IntRange(1, 256),
    default=None,
    help="Plans (POST /v1/plan) computed at once [default: half the cores].",
)
@click.option(
    "--plan-timeout-s",
    type=click.FloatRange(min=0, min_open=True, max=3600),
    default=None,
    help="How long one plan may compute [default: 60].",
)
@click.option(
    "--driver-cpus",
    type=click.FloatRange(0, 64),
    default=None,
    help="CPUs each job's driver reserves in Ray [default: 0.25].",
)
@click.option(
    "--post-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="POSTs a second per client [default: 20].",
)
@click.option("--post-burst", type=click.IntRange(min=1), default=None, help="[default: 40]")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The service's files: database, embedded Ray head, runs [default: ~/kaisa-ray].",
)
@click.option(
    "--checkpoint-root",
    "--storage-path",
    "storage_path",
    default=None,
    help="Where jobs checkpoint, a folder or a URI [<data-dir>/runs]; a disk of its own keeps "
    "checkpoints from filling the database's.",
)
@click.option(
    "--data-root",
    "data_roots",
    multiple=True,
    help="A folder under which jobs may read their data, or a URI prefix (s3://bucket/prefix) "
    "under which they may stream it from another system with the cluster's credentials "
    "(repeatable) [default: the built-in datasets' folders].",
)
@click.option(
    "--min-free-bytes",
    default=None,
    help="/readyz fails below this much free space where the service writes [256MiB].",
)
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=None)
@click.option(
    "--submit",
    "submit_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Once the service is up, submit this job file to it (the README's main command).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check the settings, print them as JSON (the token hidden), and exit without "
    "serving or touching the database.",
)
def serve(submit_file: Path | None, dry_run: bool, **flags: Any) -> None:
    """Run the job service (REST API, event streams, metrics). Flags override the
    KAISA_RAY_* environment (KAISA_RAY_TOKEN, KAISA_RAY_DATABASE_URL, ...)."""
    import uvicorn
    from pydantic import ValidationError

    from service.app import create_app
    from service.errors import DatabaseInUseError
    from service.http_protocol import with_header_timeout
    from service.settings import Settings
    from service.store.database import sole_writer

    if flags.get("token"):
        click.echo(
            "warning: a token given with --token is visible to every user of this machine "
            "(ps); prefer $KAISA_RAY_TOKEN or --token-file",
            err=True,
        )
    try:
        # Unset flags (None; () for a repeatable one) leave the environment's settings.
        settings = Settings(**{k: v for k, v in flags.items() if v not in (None, ())})
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: "
            + str(e["msg"]).removeprefix("Value error, ")
            for e in err.errors()
        )
        raise click.ClickException(f"bad service settings: {problems}") from err
    if dry_run:
        shown = settings.model_dump(mode="json")
        shown["token"] = "<set>" if settings.token else None
        shown["database"], shown["storage"] = settings.database, settings.storage
        shown["data_roots"] = [str(root) for root in settings.roots]  # the defaults too
        click.echo(json.dumps(shown, indent=2))
        return
    try:  # the lifespan takes the lock for good; this says it plainly, before uvicorn
        with sole_writer(settings.database, settings.data_dir):
            pass
    except DatabaseInUseError as err:
        raise click.ClickException(str(err)) from err
    if submit_file is not None and settings.port == 0:
        raise click.UsageError("--submit posts to the service's own port: give --port a number")
    app = create_app(settings)
    base = f"http://{settings.host}:{settings.port}"
    token = settings.token.get_secret_value() if settings.token else None
    if submit_file is not None:
        threading.Thread(
            target=_submit_when_up, args=(base, token, submit_file), daemon=True
        ).start()
    if settings.port == 0:
        click.echo(f"kaisa-ray service on {settings.host}, a port the OS picks (uvicorn's line "
                   "below names it); Ctrl-C stops it")  # fmt: skip
    else:
        click.echo(f"kaisa-ray service on {base} (API docs at {base}/docs); Ctrl-C stops it")
    # uvicorn drains on SIGTERM as on SIGINT (what systemd, Docker and Kubernetes send): the
    # lifespan then stops the follower and the embedded Ray head, and logs "shutdown complete".
    logging.getLogger("service").setLevel(logging.INFO)
    # uvicorn re-raises the signal it stopped on once it has shut down; after a SIGTERM the
    # drain is done by then, so the process ends with status 0 (as a service manager expects).
    signal.signal(signal.SIGTERM, _drained)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        # A line per request (the dashboard's, every client's) only with `kaisa-ray -v serve`:
        # /metrics counts them by route and status.
        access_log=logging.getLogger().isEnabledFor(logging.INFO),
        timeout_graceful_shutdown=5,  # event streams never end on their own
        http=with_header_timeout(settings.header_timeout_s),  # half-sent requests: closed
    )


def _drained(signum: int, frame: Any) -> None:
    """SIGTERM, re-raised by uvicorn after its graceful shutdown: nothing left to do."""


def _submit_when_up(base: str, token: str | None, file: Path) -> None:
    """Submit ``file`` once the service answers, say where to watch it, then say each change
    of its state until it ends (a terminal that ran ``make run`` learns that it did)."""
    client = ServiceClient(base, token)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                client._http.get("/readyz").raise_for_status()
                break
            except Exception:
                time.sleep(0.5)
        job = client.submit(read_job_file(file))
        cli = program()
        click.echo(
            f"submitted {file} as job {job['id']} ({job['state']}). Watch it:\n"
            f"  {base}/#/jobs/{job['id']}   (the dashboard, in a browser)\n"
            f"  {cli} submit --follow-id {job['id']}   (a live progress bar)\n"
            f"  {cli} jobs                         (every job)\n"
            f"  curl {base}/v1/jobs/{job['id']}\n"
            f"  curl -N {base}/v1/jobs/{job['id']}/events"
        )
    except (ServiceClientError, click.ClickException) as err:
        click.echo(f"could not submit {file}: {err}", err=True)
        client.close()
        return
    try:
        _say_states(client, job["id"])
    except ServiceClientError as err:  # the service is stopping (Ctrl-C): nothing to say
        logger.debug("stopped following job %s: %s", job["id"], err)
    finally:
        client.close()


def _say_states(client: ServiceClient, job_id: str) -> None:
    """A line for each state the job enters, from its event stream, until it ends."""
    shown = ""
    for event, data in client.events(job_id):
        if event != "state" or data["state"] == shown:
            continue
        shown = data["state"]
        state = JobState(shown)
        line = f"job {job_id}: {progress_text(data)}"
        if state.finished:
            accuracy = (data.get("metrics") or {}).get(EvalMetric.TEST_ACCURACY)
            if isinstance(accuracy, float):
                line += f", test accuracy {accuracy:.4f}"
            if data.get("failure_reason"):
                line += f": {data['failure_reason']}"
            line += "; the service keeps running (Ctrl-C stops it)"
        click.echo(line)


for _command in (submit, jobs, cancel):  # the REST client's commands
    main.add_command(_command)
