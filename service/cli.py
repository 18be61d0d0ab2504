"""The service's commands, added to the ``kaisa-ray`` command line: ``serve`` runs the
service; ``submit``, ``jobs`` and ``cancel`` talk to a running one over REST."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click

from kaisa_ray.train.cli import main
from service.client import ServiceClient, ServiceClientError

__all__ = ["main"]

logger = logging.getLogger(__name__)

url_option = click.option(
    "--url", default=None, help="The service [default: $KAISA_RAY_URL or http://127.0.0.1:8000]."
)
token_option = click.option(
    "--token", default=None, help="The service's token [default: $KAISA_RAY_TOKEN]."
)


@main.command()
@click.option("--host", default=None, help="Interface to listen on [default: 127.0.0.1].")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="[default: 8000]")
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
@click.option("--token", default=None, help="Require 'Authorization: Bearer <token>'.")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The service's files: database, embedded Ray head, runs [default: ~/kaisa-ray].",
)
@click.option("--storage-path", default=None, help="Where jobs checkpoint [<data-dir>/runs].")
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
    from service.settings import Settings
    from service.store import DatabaseInUseError, sole_writer

    try:
        settings = Settings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as err:
        raise click.ClickException(f"bad service settings: {err}") from err
    if dry_run:
        shown = settings.model_dump(mode="json")
        shown["token"] = "<set>" if settings.token else None
        shown["database"], shown["storage"] = settings.database, settings.storage
        click.echo(json.dumps(shown, indent=2))
        return
    try:  # the lifespan takes the lock for good; this says it plainly, before uvicorn
        with sole_writer(settings.database):
            pass
    except DatabaseInUseError as err:
        raise click.ClickException(str(err)) from err
    app = create_app(settings)
    base = f"http://{settings.host}:{settings.port}"
    token = settings.token.get_secret_value() if settings.token else None
    if submit_file is not None:
        threading.Thread(
            target=_submit_when_up, args=(base, token, submit_file), daemon=True
        ).start()
    click.echo(f"kaisa-ray service on {base} (API docs at {base}/docs); Ctrl-C stops it")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")


def _submit_when_up(base: str, token: str | None, file: Path) -> None:
    client = ServiceClient(base, token)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                client._http.get("/readyz").raise_for_status()
                break
            except Exception:
                time.sleep(0.5)
        job = client.submit(_read(file))
        click.echo(
            f"submitted {file} as job {job['id']} ({job['state']}). Watch it:\n"
            f"  {base}/#/jobs/{job['id']}   (the dashboard, in a browser)\n"
            f"  kaisa-ray submit --follow-id {job['id']}   (a live progress bar)\n"
            f"  kaisa-ray jobs                         (every job)\n"
            f"  curl {base}/v1/jobs/{job['id']}\n"
            f"  curl -N {base}/v1/jobs/{job['id']}/events"
        )
    except (ServiceClientError, click.ClickException) as err:
        click.echo(f"could not submit {file}: {err}", err=True)
    finally:
        client.close()


def _read(file: Path) -> dict[str, Any]:
    import yaml

    try:
        text = file.read_text()
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise click.ClickException(f"cannot read {file}: {err}") from err
    if not isinstance(data, dict):
        raise click.ClickException(f"{file} does not hold a job (a mapping of fields)")
    return data


@main.command()
@click.argument(
    "job_file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option("--follow", is_flag=True, help="Show a live progress bar until the job ends.")
@click.option("--follow-id", default=None, help="Follow a job submitted earlier instead.")
@click.option("--idempotency-key", default=None, help="Retry-safe: the same key, the same job.")
@url_option
@token_option
def submit(
    job_file: Path | None,
    follow: bool,
    follow_id: str | None,
    idempotency_key: str | None,
    url: str | None,
    token: str | None,
) -> None:
    """Submit a job file to the service (and --follow it); exit 1 if it fails."""
    if (job_file is None) == (follow_id is None):
        raise click.UsageError("give a JOB_FILE to submit, or --follow-id ID to follow")
    client = ServiceClient(url, token)
    try:
        if job_file is not None:
            job = client.submit(_read(job_file), idempotency_key)
            click.echo(f"job {job['id']} ({job['name']}): {job['state']}")
            if not follow:
                return
            follow_id = job["id"]
        assert follow_id is not None
        final = _follow(client, follow_id)
    except ServiceClientError as err:
        raise click.ClickException(str(err)) from err
    finally:
        client.close()
    metrics = final.get("metrics", {})
    accuracy = metrics.get("test_accuracy")
    click.echo(
        f"job {final['id']} {final['state']} at step {final['progress']['step']}"
        + (f", test accuracy {accuracy:.4f}" if isinstance(accuracy, float) else "")
        + (f": {final['failure_reason']}" if final.get("failure_reason") else "")
    )
    if final["state"] != "SUCCEEDED":
        sys.exit(1)


def _follow(client: ServiceClient, job_id: str) -> dict[str, Any]:
    """Draw the job's progress from its event stream; return its final state."""
    from tqdm import tqdm

    bar = tqdm(total=None, unit="step", desc=job_id, file=sys.stderr, dynamic_ncols=True)
    job: dict[str, Any] = {}
    try:
        for event, data in client.events(job_id):
            if event == "state":
                job = data
                if data["progress"]["total"] and bar.total != data["progress"]["total"]:
                    bar.total = data["progress"]["total"]
                    bar.refresh()
                bar.set_description(f"{job_id} {data['state']}")
                _advance(bar, data["progress"]["step"])
            elif event == "progress":
                _advance(bar, int(data.get("step", 0)))
                bar.set_postfix(loss=f"{data.get('loss', float('nan')):.3f}", refresh=False)
            elif event == "eval":
                accuracy = data.get("test_accuracy")
                if isinstance(accuracy, float):
                    tqdm.write(f"step {data.get('step')}: test accuracy {accuracy:.4f}", sys.stderr)
            elif event == "tuner":
                tqdm.write(f"tuner chose {data.get('chosen')} ({data.get('how')})", sys.stderr)
    finally:
        bar.close()
    return job or client.job(job_id)


def _advance(bar: Any, step: int) -> None:
    if step > bar.n:
        bar.update(step - bar.n)


@main.command()
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice(
        [
            "QUEUED",
            "PROFILING",
            "RUNNING",
            "RECOVERING",
            "CANCELLING",
            "SUCCEEDED",
            "FAILED",
            "CANCELLED",
        ],
        case_sensitive=False,
    ),
    help="Only jobs in this state (repeatable).",
)
@click.option("--limit", type=click.IntRange(1, 500), default=50, show_default=True)
@url_option
@token_option
def jobs(states: tuple[str, ...], limit: int, url: str | None, token: str | None) -> None:
    """List the service's jobs, newest first."""
    client = ServiceClient(url, token)
    try:
        page = client.jobs([s.upper() for s in states], limit)
    except ServiceClientError as err:
        raise click.ClickException(str(err)) from err
    finally:
        client.close()
    rows = [("ID", "NAME", "STATE", "PROGRESS", "LOSS", "TEST ACC", "STRATEGY", "CREATED")]
    for job in page["jobs"]:
        progress = job["progress"]
        done = f"{progress['step']}/{progress['total']}" if progress["total"] else "-"
        metrics = job["metrics"]
        kfac = job["spec"].get("kfac")
        strategy = (
            f"auto→{job['decision']['strategy']}"
            if job.get("decision")
            else (kfac.get("strategy") if isinstance(kfac, dict) else str(kfac))
        )
        rows.append(
            (
                job["id"],
                job["name"],
                job["state"],
                done,
                _number(metrics.get("loss")),
                _number(metrics.get("test_accuracy")),
                str(strategy),
                job["created_at"][:19].replace("T", " "),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    if page["total"] > len(page["jobs"]):
        click.echo(f"({len(page['jobs'])} of {page['total']}; --limit shows more)")


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-"


@main.command()
@click.argument("job_id")
@url_option
@token_option
def cancel(job_id: str, url: str | None, token: str | None) -> None:
    """Cancel a job (CANCELLING now, CANCELLED once Ray has stopped it)."""
    client = ServiceClient(url, token)
    try:
        job = client.cancel(job_id)
    except ServiceClientError as err:
        raise click.ClickException(str(err)) from err
    finally:
        client.close()
    click.echo(f"job {job['id']}: {job['state']}")
