"""The streamed datasets' closed sets (``dataset.name``, ``dataset.image.mode``), apart from
the reading (``streaming.py``), so that the JobSpec names them without importing it."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["BadRecords", "ImageMode", "StreamSource", "is_uri", "local_path"]


class BadRecords(StrEnum):
    """What a streamed job does with a record it cannot read (``dataset.bad_records``)."""

    FAIL = "fail"  # the job fails, the error naming the file and the fix
    SKIP = "skip"  # the record is left out and counted (``skipped_rows`` in the step records)


class ImageMode(StrEnum):
    """The channels images are converted to (PIL's modes)."""

    GRAY = "L"
    RGB = "RGB"


class StreamSource(StrEnum):
    """The datasets a job streams from a user's own files (``dataset.name``)."""

    IMAGE_FOLDER = "image-folder"  # one subfolder per class, images in it (torchvision's layout)
    PARQUET = "parquet"  # an input and a label column, or a token column (a language model's)
    TEXT = "text"  # text files (*.txt) cut into byte windows (a byte-level language model's)


LOCAL_SCHEMES = ("file://", "local://")  # URIs of a path on the nodes' own disks


def is_uri(path: str) -> bool:
    """``s3://...``, ``gs://...`` and the like: another system's, read by Ray Data (a
    ``file://`` or ``local://`` URI names a local path: checked as one)."""
    return "://" in path and not path.startswith(LOCAL_SCHEMES)


def local_path(path: str) -> str:
    """The local path a plain path or a ``file://`` / ``local://`` URI names."""
    for scheme in LOCAL_SCHEMES:
        if path.startswith(scheme):
            return path[len(scheme) :]
    return path
