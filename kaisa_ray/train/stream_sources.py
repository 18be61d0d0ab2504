"""The streamed datasets' closed sets (``dataset.name``, ``dataset.image.mode``), apart from
the reading (``streaming.py``), so that the JobSpec names them without importing it."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["BadRecords", "ImageMode", "StreamSource", "is_uri"]


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


def is_uri(path: str) -> bool:
    """``s3://...``, ``gs://...`` and the like: read by Ray Data, not checked here."""
    return "://" in path
