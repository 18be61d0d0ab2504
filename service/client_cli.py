"""The ``kaisa-ray`` commands that talk to a running service over REST (``submit``, ``jobs``,
``cancel``), registered on the group in ``service.cli``; like it, they import neither torch nor
Ray, so that they start in a fraction of a second."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from kaisa_ray.enums import EvalMetric
from service.client import ServiceClient, ServiceClientError
from service.model.lifecycle import JobState

url_option = click.option(
    "--url", default=None, help="The service [default: $KAISA_RAY_URL or http://127.0.0.1:8000]."
)
token_option = click.option(
    "--token", default=None, help="The service's token [default: $KAISA_RAY_TOKEN]."
)


def read_job_file(file: Path) -> dict[str, Any]:
    """The job in ``file`` (YAML, or JSON by its suffix), or a ClickException naming why not."""
    import yaml

    try:
        text = file.read_text()
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise click.ClickException(f"cannot read {file}: {err}") from err
    if not isinstance(data, dict):
        raise click.ClickException(f"{file} does not hold a job (a mapping of fields)")
    return data


@click.command()
@click.argument(
    "job_file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option("--follow", is_flag=True, help="Show a live progress bar until the job ends.")
@click.option("--follow-id", default=None, help="Follow a job submitted earlier instead.")
@click.option("--idempotency-key", default=None, help="Retry-safe: the same key, the same job.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the job's id (for scripts).")
@url_option
@token_option
def submit(
    job_file: Path | None,
    follow: bool,
    follow_id: str | None,
    idempotency_key: str | None,
    quiet: bool,
    url: str | None,
    token: str | None,
) -> None:
    """Submit a job file to the service (and --follow it); exit 1 if it fails."""
    if (job_file is None) == (follow_id is None):
        raise click.UsageError("give a JOB_FILE to submit, or --follow-id ID to follow")
    client = ServiceClient(url, token)
    try:
        if job_file is not None:
            job = client.submit(read_job_file(job_file), idempotency_key)
            click.echo(job["id"] if quiet else f"job {job['id']} ({job['name']}): {job['state']}")
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
    accuracy = metrics.get(EvalMetric.TEST_ACCURACY)
    click.echo(
        f"job {final['id']} {final['state']} at step {final['progress']['step']}"
        + (f", test accuracy {accuracy:.4f}" if isinstance(accuracy, float) else "")
        + (f": {final['failure_reason']}" if final.get("failure_reason") else "")
    )
    if final["state"] != JobState.SUCCEEDED:
        sys.exit(1)


def _follow(client: ServiceClient, job_id: str) -> dict[str, Any]:
    """Show the job's progress from its event stream; return its final state. On a terminal,
    one progress bar redrawn in place (it ends at 100% for a job that met its target, with
    no time left to guess); elsewhere (a log, a pipe), a line per change of state and per
    evaluation, so that nothing is printed twice."""
    from kaisa_train.follow import Follower
    from kaisa_train.records import StartRecord, try_record

    follower = Follower(job_id, out=sys.stderr, bar_file=sys.stderr)
    job: dict[str, Any] = {}
    shown_state = ""
    try:
        for event, data in client.events(job_id):
            if event != "state":
                record, _ = try_record(data)  # the event's data is the record (with its kind)
                if record is not None and not isinstance(record, StartRecord):
                    follower.take(record)
                continue
            job = data
            progress = data["progress"]
            state = JobState(data["state"])
            if state != shown_state:
                shown_state = state
                if not follower.live:
                    follower.say(f"job {job_id}: {progress_text(data)}")
            if progress["total"] and follower.bar.total != progress["total"]:
                follower.bar.total = progress["total"]
                follower.bar.refresh()
            follower.bar.set_description(f"{job_id} {state}", refresh=False)
            follower.advance(progress["step"])
            if state.finished:
                follower.finish(done=state is JobState.SUCCEEDED)
    finally:
        follower.close()
    return job or client.job(job_id)


def progress_text(job: dict[str, Any]) -> str:
    """A job's state and progress in words: ``RUNNING 120/1000``, ``QUEUED (#3 in line)``,
    ``SUCCEEDED: target met at step 250 of 1000``."""
    state = job["state"]
    progress = job["progress"]
    if state == JobState.QUEUED and job.get("queue_position"):
        return f"QUEUED (#{job['queue_position']} in line)"
    if state == JobState.SUCCEEDED:
        if progress.get("target_met"):
            return f"SUCCEEDED: target met at step {progress['step']} of {progress['total']}"
        return f"SUCCEEDED at step {progress['step']}"
    if progress["total"]:
        return f"{state} {progress['step']}/{progress['total']}"
    return str(state)


@click.command()
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([state.value for state in JobState], case_sensitive=False),
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
        if job["state"] == JobState.SUCCEEDED:
            done = "done (target met)" if progress.get("target_met") else "done"
        elif job["state"] == JobState.QUEUED and job.get("queue_position"):
            done = f"queued #{job['queue_position']}"
        metrics = job["metrics"]
        kfac = job["spec"].get("kfac")
        strategy = (
            f"auto→{job['decision']['grad_worker_fraction']:g}"
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
                _number(metrics.get(EvalMetric.TEST_ACCURACY)),
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


@click.command()
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
