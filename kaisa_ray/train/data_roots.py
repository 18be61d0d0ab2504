"""Where a job may read its data from, when someone else's server runs it.

``kaisa-ray train`` and ``ray job submit`` run a user's own job as that user: any folder
goes. The job service runs jobs that clients send, as the service's user, so it accepts a
``dataset.data_dir`` only under its data roots (``kaisa-ray serve --data-root``): a client
must not make a job read the folder that holds the cluster's token, say, nor learn which
folders exist on the host from the answers. The service sets the roots for the validation
of each request (``within``); a JobSpec validated outside such a block is not restricted.

The path is resolved first (symlinks followed, ``..`` folded), and the refusal is the same
sentence whether the path exists or not; a relative path is refused as such (relative to
what, on which node?).

Example:
    >>> from pathlib import Path
    >>> with within([Path("/srv/data")]):
    ...     check_root(Path("/srv/data/mnist"))
    >>> with within([Path("/srv/data")]):
    ...     check_root(Path("/srv/data/../secrets"))
    Traceback (most recent call last):
    ...
    ValueError: /srv/data/../secrets is not under this service's data roots (/srv/data): \
put the data under one of them, or start the service with --data-root DIR
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

__all__ = ["check_root", "roots_now", "within"]

_ROOTS: ContextVar[tuple[Path, ...] | None] = ContextVar("kaisa_ray_data_roots", default=None)


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


@contextmanager
def within(roots: Sequence[Path]) -> Iterator[None]:
    """Validate the JobSpecs of this block with ``dataset.data_dir`` only under ``roots``."""
    token = _ROOTS.set(tuple(_resolved(Path(r).expanduser()) for r in roots))
    try:
        yield
    finally:
        _ROOTS.reset(token)


def roots_now() -> tuple[Path, ...] | None:
    """The data roots in force (None: no restriction)."""
    return _ROOTS.get()


def check_root(path: Path) -> None:
    """Raise ``ValueError`` unless ``path`` is under a data root in force (or none is)."""
    roots = _ROOTS.get()
    if roots is None:
        return
    listed = ", ".join(str(r) for r in roots) or "none"
    fix = "put the data under one of them, or start the service with --data-root DIR"
    if not path.is_absolute():
        raise ValueError(
            f"{path} is a relative path: give an absolute path under this service's data "
            f"roots ({listed}); {fix}"
        )
    found = _resolved(path)
    if not any(found == root or found.is_relative_to(root) for root in roots):
        raise ValueError(f"{path} is not under this service's data roots ({listed}): {fix}")
