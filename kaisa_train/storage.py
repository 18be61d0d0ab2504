"""Where runs keep their files and checkpoints: a local directory, or shared storage by URI.

Ray Train writes every checkpoint to ``<storage>/<run>/checkpoint_*``. On one machine any
local directory does. On a multi-node cluster every node must reach the same storage, so that
a worker group restarted on other nodes finds the checkpoints: a network filesystem mounted
at the same path on every node, or a URI of a filesystem that pyarrow understands
(``s3://bucket/prefix``, ``gs://bucket/prefix``, ``hdfs://...``, ``abfs://...``;
``file:///path`` is a local path written as a URI). Ray Train reads and writes it; nothing
here contacts a remote store, so a URI is checked for its form only.

Storage is chosen by whoever runs the job (``--storage-path``, ``$KAISA_RAY_STORAGE``, the
service's setting), never by the job spec: a spec posted over REST cannot pick where on the
cluster its files are written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from kaisa_ray.errors import ConfigurationError

__all__ = [
    "STORAGE_ENV",
    "URI_SCHEMES",
    "checkpoint_file_exists",
    "checkpoint_location",
    "default_storage",
    "is_uri",
    "latest_checkpoint",
    "local_checkpoint",
    "resolve_storage",
]

STORAGE_ENV = "KAISA_RAY_STORAGE"

# The schemes pyarrow's FileSystem.from_uri resolves (Ray Train opens storage with it).
URI_SCHEMES = frozenset({"file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss"})


def is_uri(location: str | Path) -> bool:
    return "://" in str(location)


def default_storage() -> str:
    """``$KAISA_RAY_STORAGE``, or ``~/kaisa-ray/runs``."""
    return os.environ.get(STORAGE_ENV) or str(Path.home() / "kaisa-ray" / "runs")


def _check_uri(uri: str) -> None:
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme not in URI_SCHEMES:
        raise ConfigurationError(
            f"storage {uri!r} has the scheme {scheme!r}, which pyarrow (and so Ray Train) "
            f"cannot open; use a local path, or one of {', '.join(sorted(URI_SCHEMES))} "
            "(e.g. s3://bucket/prefix)"
        )
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigurationError(
                f"storage {uri!r} names a host; a file URI is file:///absolute/path"
            )
    elif not parsed.netloc:
        raise ConfigurationError(
            f"storage {uri!r} names no bucket or host; write it as {scheme}://bucket/prefix"
        )


def resolve_storage(location: str | Path | None = None, *, create: bool = True) -> str:
    """The storage Ray Train gets: a URI as given (its form checked), or a local directory,
    made absolute (and created unless ``create`` is False). ``None``: ``default_storage()``.

    Raises:
        ConfigurationError: a URI of a filesystem Ray Train cannot open, or a local path that
            cannot be a directory.
    """
    raw = str(location) if location is not None else default_storage()
    if is_uri(raw):
        _check_uri(raw)
        return raw
    path = Path(raw).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigurationError(f"storage {path} is a file; give a directory")
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigurationError(f"cannot create the storage directory {path}: {err}") from err
    return str(path)


def checkpoint_file_exists(checkpoint: str | Path, name: str) -> bool:
    """Whether the checkpoint directory (a path or a URI) holds the file ``name``."""
    if not is_uri(checkpoint):
        return (Path(checkpoint) / name).is_file()
    import pyarrow.fs

    filesystem, path = pyarrow.fs.FileSystem.from_uri(str(checkpoint))
    info = filesystem.get_file_info(f"{path.rstrip('/')}/{name}")
    return bool(info.type == pyarrow.fs.FileType.File)


def checkpoint_location(path: str, storage: str) -> str:
    """A checkpoint's location as a user passes it back (``--resume-from``): Ray Train gives
    the path inside the storage's filesystem (``bucket/prefix/run/checkpoint_...``), so a
    remote storage's scheme is put back in front."""
    if not is_uri(storage):
        return path
    scheme = urlparse(storage).scheme.lower()
    return path if scheme == "file" else f"{scheme}://{path.lstrip('/')}"


def latest_checkpoint(storage: str, run: str, name: str) -> str | None:
    """The newest ``checkpoint_*`` directory of ``run`` in ``storage`` that holds ``name``
    (Ray Train names them by time), as a user passes it back; None if there is none."""
    import pyarrow.fs

    if is_uri(storage):
        filesystem, root = pyarrow.fs.FileSystem.from_uri(storage)
    else:
        filesystem, root = pyarrow.fs.LocalFileSystem(), storage
    selector = pyarrow.fs.FileSelector(f"{root.rstrip('/')}/{run}", allow_not_found=True)
    found = sorted(
        info.path
        for info in filesystem.get_file_info(selector)
        if info.type == pyarrow.fs.FileType.Directory
        and info.base_name.startswith("checkpoint_")
        and filesystem.get_file_info(f"{info.path}/{name}").type == pyarrow.fs.FileType.File
    )
    return checkpoint_location(found[-1], storage) if found else None


@contextmanager
def local_checkpoint(checkpoint: str | Path) -> Iterator[Path]:
    """The checkpoint directory on this machine: itself when local, else a downloaded copy
    (removed when the block ends)."""
    if not is_uri(checkpoint):
        yield Path(checkpoint)
        return
    import ray.train

    with ray.train.Checkpoint(str(checkpoint)).as_directory() as directory:
        yield Path(directory)
