"""The job-file commands of the ``kaisa-ray`` command line: ``validate``, ``train``, ``tune``
and ``sweep`` (``example`` is in ``example_cli``, ``plan`` and ``measure-node`` in ``plan_cli``).

The command group is ``service.cli.main`` (the console script), which loads these commands
only when one of them runs: they import torch and Ray.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kaisa_ray.enums import EvalMetric
from kaisa_train.connection import cluster_address, ensure_ray, release_ray

if TYPE_CHECKING:
    from kaisa_train.spec import JobSpec

__all__ = ["job_options", "storage_option", "sweep", "train", "tune", "validate"]


config_option = click.option(
    "--config",
    "config",
    type=click.Path(path_type=Path),
    required=True,
    help="Job file (YAML or JSON); see examples/fashion_mnist.yaml.",
)

storage_option = click.option(
    "--storage-path",
    default=None,
    help="Where runs keep their files and checkpoints: a directory, or a URI such as "
    "s3://bucket/prefix [default: $KAISA_RAY_STORAGE or ~/kaisa-ray/runs]; on a multi-node "
    "cluster, storage every node can reach.",
)


def _load(config: Path) -> JobSpec:
    """The job file as a JobSpec, or exit 1 naming every bad field."""
    from kaisa_train.spec import JobSpecError, load_job_spec

    try:
        return load_job_spec(config)
    except JobSpecError as err:
        raise click.ClickException(str(err)) from err


def _parse(text: str) -> JobSpec:
    """A JSON job given on the command line, or exit 1 naming every bad field."""
    from kaisa_train.spec import JobSpecError, parse_job_spec

    try:
        return parse_job_spec(json.loads(text), "--spec")
    except json.JSONDecodeError as err:
        raise click.ClickException(f"--spec is not valid JSON: {err}") from err
    except JobSpecError as err:
        raise click.ClickException(str(err)) from err


def _job(config: Path | None, spec_json: str | None, spec_key: str | None = None) -> JobSpec:
    """The job from ``--config FILE``, ``--spec JSON`` or ``--spec-key KEY`` (one of them)."""
    if sum(given is not None for given in (config, spec_json, spec_key)) != 1:
        raise click.UsageError(
            "give the job as --config FILE, --spec JSON or --spec-key KEY (one of them)"
        )
    if spec_key is not None:
        return _parse(_read_key(spec_key))
    return _load(config) if config is not None else _parse(spec_json or "")


SPEC_NAMESPACE = "kaisa-ray"  # service.runner.SPEC_NAMESPACE


def _read_key(key: str) -> str:
    """The job the service left in the cluster's key-value store (the GCS) under ``key``:
    a spec of any size, where a command line has a limit."""
    from ray.experimental.internal_kv import _internal_kv_get

    ensure_ray()
    value = _internal_kv_get(key, namespace=SPEC_NAMESPACE)
    if value is None:
        raise click.ClickException(
            f"the cluster holds no job spec under {key!r} (namespace {SPEC_NAMESPACE!r}): it is "
            "put there by the kaisa-ray service before it submits the job; was the cluster "
            "restarted? Submit the job again"
        )
    return bytes(value).decode()


def job_options(command: Any) -> Any:
    """``--config FILE`` or ``--spec JSON``: the job a command runs."""
    command = click.option(
        "--spec-key",
        "spec_key",
        default=None,
        help="The job as the service left it in the cluster's key-value store (what the "
        "service's Ray Jobs run).",
    )(command)
    command = click.option(
        "--spec",
        "spec_json",
        default=None,
        help="The job as one JSON object instead of a file.",
    )(command)
    return click.option(
        "--config",
        "config",
        type=click.Path(path_type=Path),
        default=None,
        help="Job file (YAML or JSON); see examples/.",
    )(command)


@click.command()
@config_option
def validate(config: Path) -> None:
    """Check a job file and print it with every default filled in; exit 1 naming each bad field."""
    click.echo(_load(config).model_dump_json(indent=2))


@click.command()
@job_options
@storage_option
@click.option(
    "--resume-from",
    default=None,
    help="Start from this checkpoint (a run's checkpoint_* directory, a path or a URI) "
    "instead of from scratch.",
)
@click.option(
    "--run-name",
    default=None,
    help="Name of the run [default: unique, from the job name]; an existing run's name resumes it.",
)
@click.option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="Show a progress bar (on a terminal) and log each evaluation.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check the job and its storage, print how it would run (workers, resources, "
    "placement, storage) as JSON, and exit without starting Ray.",
)
def train(
    config: Path | None,
    spec_json: str | None,
    spec_key: str | None,
    storage_path: str | None,
    resume_from: str | None,
    run_name: str | None,
    progress: bool,
    dry_run: bool,
) -> None:
    """Train a job on Ray Train: locally, or on the cluster when run by `ray job submit`."""
    from kaisa_ray.errors import ConfigurationError
    from kaisa_train.job import describe_run, run_job

    spec = _job(config, spec_json, spec_key)
    if dry_run:
        try:
            plan = describe_run(spec, storage_path=storage_path, run_name=run_name)
        except ConfigurationError as err:
            raise click.ClickException(str(err)) from err
        click.echo(json.dumps(plan, indent=2))
        return
    try:
        result = run_job(
            spec,
            storage_path=storage_path,
            run_name=run_name,
            resume_from=resume_from,
            progress=progress,
        )
    except ConfigurationError as err:
        raise click.ClickException(str(err)) from err
    finally:
        release_ray()  # a local Ray of this command's own, if it started one
    if not result.succeeded:
        raise click.ClickException(f"run {result.run_name} failed: {result.error}")
    metrics = result.metrics
    accuracy = metrics.get(EvalMetric.TEST_ACCURACY)
    click.echo(
        f"run {result.run_name} finished at step {metrics.get('step')}"
        + (f", test accuracy {accuracy:.4f}" if accuracy is not None else "")
        + (f"; checkpoint {result.checkpoint}" if result.checkpoint else "")
    )


@click.command()
@click.option(
    "--config",
    "config",
    type=click.Path(path_type=Path),
    default=None,
    help="Job file (YAML or JSON) with kfac: auto; see examples/fashion_mnist_auto.yaml.",
)
@storage_option
@click.option(
    "--verify",
    type=click.IntRange(min=0, max=32),
    default=None,
    help="Measure the K best predicted candidates in short Ray Tune trials "
    "[default: the job's kfac.verify].",
)
@click.option(
    "--history",
    "history",
    metavar="RUN",
    default=None,
    help="Instead: each layer's K-FAC intervals over run RUN so far and why they changed "
    "(from its records in the Ray cluster's progress sink).",
)
def tune(
    config: Path | None, storage_path: str | None, verify: int | None, history: str | None
) -> None:
    """Choose K-FAC's strategy for a `kfac: auto` job without training: profile the job on its
    own workers, print the candidate table and the decision (with adapted intervals: each
    layer's cost on every rung). With --history RUN: how a run's intervals adapted."""
    from kaisa_ray.errors import ConfigurationError
    from kaisa_train.spec import KFACSpec
    from kaisa_train.tables import tuning_table

    if history is not None:
        if config is not None or verify is not None:
            raise click.UsageError("--history reads a run's records: give it alone")
        _print_history(history)
        return
    if config is None:
        raise click.UsageError("give --config (a job to tune) or --history RUN")
    from kaisa_train.tuning import tune_job

    spec = _load(config)
    if verify is not None and isinstance(spec.kfac, KFACSpec) and spec.kfac.auto:
        spec = spec.model_copy(update={"kfac": spec.kfac.model_copy(update={"verify": verify})})
    try:
        outcome = tune_job(spec, storage_path=storage_path)
    except ConfigurationError as err:
        raise click.ClickException(str(err)) from err
    finally:
        release_ray()  # a local Ray of this command's own: its profile goes to the local store
    click.echo(tuning_table(outcome.record))


def _print_history(run: str) -> None:
    """A run's intervals records: from the progress sink of the cluster in ``RAY_ADDRESS``,
    else (or when it has none) from the local store, where a standalone command's own Ray
    left them when it stopped."""
    from kaisa_ray.errors import ConfigurationError
    from kaisa_train.local_store import LocalStore
    from kaisa_train.records import IntervalsRecord, RecordKind, try_record
    from kaisa_train.tables import intervals_timeline

    address = cluster_address()
    found: list[dict[str, Any]] = []
    if address is not None:
        from kaisa_train.progress import read_progress

        try:
            ensure_ray()
        except ConfigurationError as err:
            raise click.ClickException(str(err)) from err
        found = read_progress(run, kinds=[RecordKind.INTERVALS])["records"]
    store = LocalStore()
    if not found:
        found = [r for r in store.run_records(run) or [] if r.get("kind") == RecordKind.INTERVALS]
    records = [r for r in (try_record(data)[0] for data in found) if isinstance(r, IntervalsRecord)]
    if not records:
        where = (
            f"the progress sink of the cluster at RAY_ADDRESS={address} nor in " if address else ""
        )
        raise click.ClickException(
            f"run {run!r} has no intervals records in {where}the local store "
            f"({store.runs_dir}). A `kaisa-ray train` without RAY_ADDRESS runs on a Ray of its "
            "own and keeps its runs' records there when it ends; a run on a cluster (`ray job "
            "submit`, the service) keeps them in that cluster's progress sink while the cluster "
            "runs: set RAY_ADDRESS to it. Is the name right (kaisa-ray train prints it), and "
            "does the job use kfac: auto (or kfac.measure_staleness)?"
        )
    click.echo(intervals_timeline(records))


@click.command()
@job_options
@storage_option
@click.option("--run-name", default=None, help="Name of the sweep [default: unique].")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the best trial's spec here, a ready-to-run job file [default: print it only].",
)
@click.option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="Show the live table of trials.",
)
@click.option("--dry-run", is_flag=True, help="Check the sweep, print its plan as JSON, and exit.")
def sweep(
    config: Path | None,
    spec_json: str | None,
    spec_key: str | None,
    storage_path: str | None,
    run_name: str | None,
    output: Path | None,
    progress: bool,
    dry_run: bool,
) -> None:
    """Run a job's hyperparameter sweep on Ray Tune; print its trials and the best spec."""
    import sys

    import yaml

    from kaisa_ray.errors import ConfigurationError
    from kaisa_train.follow import Follower
    from kaisa_train.progress import SinkReader
    from kaisa_train.records import RecordKind, TrialRecord
    from kaisa_train.sweep import CUT_SHORT, run_sweep
    from kaisa_train.tables import TrialTable
    from kaisa_train.trainer import unique_run_name

    spec = _job(config, spec_json, spec_key)
    if spec.sweep is None:
        raise click.ClickException(
            f"job {spec.name!r} has no sweep section; add one, or train it with `kaisa-ray train`"
        )
    if dry_run:
        plan = spec.sweep.model_dump(mode="json", exclude_none=True)
        plan["direction"] = spec.sweep.direction
        click.echo(json.dumps(plan, indent=2))
        return
    run = run_name or unique_run_name(spec.name)
    # A table redrawn in place on a terminal; else a line a change.
    table = TrialTable(list(spec.sweep.space))
    follower = Follower(run, show=progress, live=sys.stdout.isatty(), table=table, bar=False)
    reader = SinkReader(run, follower.take, kinds=[RecordKind.TRIAL])
    reader.start()
    try:
        result = run_sweep(spec, storage_path=storage_path, run_name=run)
    except ConfigurationError as err:
        raise click.ClickException(str(err)) from err
    finally:
        reader.stop()  # its last read has every trial record (run_sweep waited for them)
        follower.close()
        release_ray()  # a local Ray of this command's own, if it started one
    ended = len(result.trials) - sum(t.error == CUT_SHORT for t in result.trials)
    click.echo(
        f"\nsweep {result.run_name}: {len(result.trials)} trials in {result.seconds:.0f} s"
        + (f" (interrupted: {ended} of {result.planned} ended)" if result.interrupted else "")
    )
    for trial in result.trials:
        metrics = {k: v for k, v in trial.metrics.items() if k != "step"}
        table.update(
            TrialRecord.model_validate(
                {
                    "trial": trial.trial_id,
                    "params": trial.params,
                    "state": trial.state,
                    "error": trial.error,
                    "step": trial.step,
                    **metrics,
                }
            )
        )
    click.echo(table.render())
    for trial in result.trials:
        if trial.error:
            click.echo(f"trial {trial.trial_id} {trial.state}: {trial.error}")
    if result.interrupted:
        click.echo(
            f"sweep {result.run_name} was interrupted before its {result.planned} trials ended: "
            "no best spec is written"
            + (f" (to {output})" if output is not None else "")
            + "; run the sweep again to finish it",
            err=True,
        )
        raise click.exceptions.Exit(130)
    if result.best is None or result.best_spec is None:
        raise click.ClickException(
            f"no trial reported {result.metric}; see each trial's state and error above"
        )
    best = result.best
    header = (
        f"# The best trial of sweep {result.run_name}: {best.trial_id}, {result.metric} "
        f"{best.value:.4g} ({result.mode}); its checkpoint: {best.checkpoint}\n"
    )
    text = header + yaml.safe_dump(
        result.best_spec.model_dump(mode="json", exclude={"sweep"}), sort_keys=False
    )
    click.echo("\n" + text)
    if output is not None:
        output.write_text(text)
        click.echo(
            f"best spec written to {output}; run it with `kaisa-ray train --config {output}`"
        )
