"""``kaisa-ray head start`` and ``kaisa-ray head stop``: a Ray head for ``ray job submit`` that
shares nothing with other Ray instances on the machine (``kaisa_train.head``).

``start`` returns once the head is up and prints its job server's address (what ``ray job
submit --address`` takes) on stdout, so a script can wait for it and use it::

    HEAD=$(kaisa-ray head start --num-cpus 4)
    ray job submit --address "$HEAD" --working-dir . -- kaisa-ray train --config job.yaml
    kaisa-ray head stop "$HEAD"

The heads it started are recorded in the local store's folder (``heads/``), which is how
``stop`` finds one by either of its addresses; ``stop`` ends that head's processes only
(``ray stop`` would end every Ray on the machine, other people's too).
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

from kaisa_train.head import Head, HeadStartError, head_environment, start_head
from kaisa_train.local_store import cache_dir

__all__ = ["head"]

logger = logging.getLogger(__name__)


def heads_dir() -> Path:
    return cache_dir() / "heads"


def _record(head: Head) -> Path:
    return heads_dir() / f"{head.dashboard_url.rsplit(':', 1)[1]}.json"


def _recorded() -> list[Head]:
    found = []
    for path in sorted(heads_dir().glob("*.json")):
        try:
            found.append(Head.from_json(path.read_text()))
        except (OSError, ValueError, TypeError):
            path.unlink(missing_ok=True)
    return found


@click.group()
def head() -> None:
    """A Ray head of its own for `ray job submit`: free ports, its own temp directory, every
    process of it pinned to it (RAY_ADDRESS); other Ray instances on the machine neither see
    it nor are seen by it."""


@head.command()
@click.option("--num-cpus", type=click.FloatRange(min=0), default=None, help="[default: cores]")
@click.option(
    "--object-store-memory",
    type=click.IntRange(min=78 * 2**20),
    default=None,
    help="Bytes [default: Ray's].",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=120,
    show_default=True,
    help="Seconds to wait for the head to come up.",
)
def start(num_cpus: float | None, object_store_memory: int | None, timeout: float) -> None:
    """Start a head and wait until its job server answers; print the job server's address
    (for `ray job submit --address`) on stdout, and how to reach and stop it on stderr.
    Ray's auth settings (RAY_AUTH_MODE, the token) come from this environment."""
    try:
        started = start_head(
            env=head_environment(),
            num_cpus=num_cpus,
            object_store_bytes=object_store_memory,
            timeout_s=timeout,
        )
    except HeadStartError as err:
        raise click.ClickException(str(err)) from err
    record = _record(started)
    record.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    record.write_text(started.to_json())
    click.echo(
        f"Ray head up: job server {started.dashboard_url}, GCS {started.gcs_address} (for "
        f"RAY_ADDRESS), logs in {started.temp_dir}; stop it with `kaisa-ray head stop "
        f"{started.dashboard_url}`",
        err=True,
    )
    click.echo(started.dashboard_url)


@head.command()
@click.argument("address", required=False)
def stop(address: str | None) -> None:
    """Stop a head started by `kaisa-ray head start`, found by its job server's or its GCS
    address (either is accepted; none: the only one running)."""
    heads = _recorded()
    if address is not None:
        wanted = address.strip().rstrip("/")
        heads = [h for h in heads if wanted in (h.dashboard_url, h.gcs_address)]
    if not heads:
        raise click.ClickException(
            "no head started by `kaisa-ray head start` is recorded"
            + (f" at {address}" if address else "")
            + f" (in {heads_dir()}): it was stopped already, or started otherwise"
        )
    if len(heads) > 1:
        listed = ", ".join(h.dashboard_url for h in heads)
        raise click.ClickException(f"several heads are running ({listed}): name one")
    (found,) = heads
    was_running = found.running()
    found.stop(grace_s=5)
    _record(found).unlink(missing_ok=True)
    click.echo(
        f"stopped the Ray head at {found.dashboard_url}"
        if was_running
        else f"the Ray head at {found.dashboard_url} had stopped already; forgot it",
        err=True,
    )
