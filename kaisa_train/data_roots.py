"""Where a job may read its data from, when someone else's server runs it.

``kaisa-ray train`` and ``ray job submit`` run a user's own job as that user: any folder
goes. The job service runs jobs that clients send, as the service's user, so it accepts a
``dataset.data_dir`` only under its data roots (``kaisa-ray serve --data-root``): a client
must not make a job read the folder that holds the cluster's token, say, nor learn which
folders exist on the host from the answers. The service sets the roots for the validation
of each request (``within``); a JobSpec validated outside such a block is not restricted.

A root may also be a URI prefix (``s3://bucket/datasets``): a streamed dataset on another
system is accepted under it (same scheme and bucket, the root's path segments first), and
only there, since the cluster reads it with the service's credentials, not the client's. Such
a URI may not carry a query or fragment (``?endpoint_override=...`` would send those
credentials elsewhere) or a ``.``/``..`` segment.

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
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kaisa_train.stream_sources import is_uri, local_path

__all__ = ["Roots", "check_root", "check_uri", "root_of", "roots_now", "within"]


@dataclass(frozen=True)
class Roots:
    """The data roots in force: folders (resolved) and URI prefixes (``s3://bucket/prefix``:
    another system's storage, which the cluster reads with its own credentials)."""

    folders: tuple[Path, ...]
    uris: tuple[str, ...]

    def listed(self) -> str:
        return ", ".join([*map(str, self.folders), *self.uris]) or "none"


_ROOTS: ContextVar[Roots | None] = ContextVar("kaisa_ray_data_roots", default=None)
FIX = "put the data under one of them, or start the service with --data-root DIR"


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _uri_parts(uri: str) -> tuple[str, str, tuple[str, ...]]:
    """A URI's scheme (lower case), host or bucket, and path segments; ``ValueError`` for one
    whose meaning depends on more than that (a query or fragment: options such as another
    endpoint are the service's to set, not a client's) or whose path steps out (``..``)."""
    parts = urlsplit(uri)
    if not parts.scheme or not parts.netloc:
        raise ValueError(f"{uri} is not a URI with a scheme and a bucket or host (s3://bucket/key)")
    if "?" in uri or "#" in uri:  # a query or fragment, even an empty one
        raise ValueError(
            f"{uri} has a query or a fragment: under this service's data roots a URI names its "
            "data by scheme, bucket and path only (the filesystem's options are the service's)"
        )
    if "@" in parts.netloc:
        raise ValueError(f"{uri} carries credentials: the service's are the cluster's own")
    segments = tuple(parts.path.removesuffix("/").split("/")[1:]) if parts.path else ()
    if any(s in ("", ".", "..") for s in segments):
        raise ValueError(
            f"{uri} has an empty, '.' or '..' segment (a '//' or a step out of the path): "
            "name the data by its own path"
        )
    return parts.scheme.lower(), parts.netloc, segments


def root_of(root: Path | str) -> Path | str:
    """A data root as the service keeps it: a URI (``s3://bucket/prefix``) checked and
    without a trailing slash, or a folder (``~`` expanded, not yet resolved)."""
    if isinstance(root, str) and is_uri(root):
        scheme, host, segments = _uri_parts(root)
        return f"{scheme}://{host}" + "".join(f"/{s}" for s in segments)
    return Path(local_path(str(root))).expanduser()  # a file:// or local:// URI: its path


@contextmanager
def within(roots: Sequence[Path | str]) -> Iterator[None]:
    """Validate the JobSpecs of this block with their data only under ``roots`` (folders, and
    URI prefixes for data on another system)."""
    kept = [root_of(r) for r in roots]
    token = _ROOTS.set(
        Roots(
            folders=tuple(_resolved(r) for r in kept if isinstance(r, Path)),
            uris=tuple(r for r in kept if isinstance(r, str)),
        )
    )
    try:
        yield
    finally:
        _ROOTS.reset(token)


def roots_now() -> Roots | None:
    """The data roots in force (None: no restriction)."""
    return _ROOTS.get()


def check_root(path: Path) -> None:
    """Raise ``ValueError`` unless ``path`` is under a data root in force (or none is)."""
    roots = _ROOTS.get()
    if roots is None:
        return
    listed = roots.listed()
    if not path.is_absolute():
        raise ValueError(
            f"{path} is a relative path: give an absolute path under this service's data "
            f"roots ({listed}); {FIX}"
        )
    found = _resolved(path)
    if not any(found == root or found.is_relative_to(root) for root in roots.folders):
        raise ValueError(f"{path} is not under this service's data roots ({listed}): {FIX}")


def check_uri(uri: str) -> None:
    """Raise ``ValueError`` unless the URI ``uri`` (another system's data) is under a URI data
    root in force (or none is): the same scheme and bucket, and the root's path segments
    first."""
    roots = _ROOTS.get()
    if roots is None:
        return
    scheme, host, segments = _uri_parts(uri)
    for root in roots.uris:
        r_scheme, r_host, r_segments = _uri_parts(root)
        if (scheme, host) == (r_scheme, r_host) and segments[: len(r_segments)] == r_segments:
            return
    raise ValueError(
        f"{uri} is another system's URI, not under this service's data roots "
        f"({roots.listed()}), and the cluster would read it with the service's credentials: "
        "put the data under one of them, or start the service with --data-root naming its "
        "prefix (e.g. s3://bucket/datasets); or run the job yourself (kaisa-ray train, ray "
        "job submit) with your own credentials"
    )
