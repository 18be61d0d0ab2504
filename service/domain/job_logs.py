"""The service's copy of its jobs' logs, kept past Ray's.

Ray keeps a Ray Job's log with its cluster: the embedded head's logs go with it when the
service stops it, and a cluster's head forgets its jobs when it restarts. So when a job's Ray
Job ends (the job finished, or a graceful stop of the service interrupted it) the follower
copies its log here, one file per job under ``<data_dir>/logs`` (mode 0600, like the
database: a log may show what a job read). A resumed job has one Ray Job per life; its file
holds each ended life's log in turn, each under a line naming its Ray Job, and ``/logs``
serves the file with the live log of the life now running after it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

__all__ = ["LogArchive"]

logger = logging.getLogger(__name__)

MAX_BYTES = 8 * 2**20
"""A kept life's log at most (its end, where a failure shows): a job that prints every step
for days does not fill the service's disk."""

_JOB_ID = re.compile(r"^[0-9a-f]{1,32}$")


class LogArchive:
    """Jobs' logs as files in ``directory`` (created 0700 when first written)."""

    def __init__(self, directory: Path, *, max_bytes: int = MAX_BYTES) -> None:
        self.directory = directory
        self.max_bytes = max_bytes

    def path(self, job_id: str) -> Path:
        if not _JOB_ID.match(job_id):  # ids are the store's hex: never a path of the client's
            raise ValueError(f"not a job id: {job_id!r}")
        return self.directory / f"{job_id}.log"

    def keep(self, job_id: str, submission_id: str, text: str) -> None:
        """Add the log of one ended life of the job (its Ray Job ``submission_id``); a life
        kept before is not added twice."""
        path = self.path(job_id)
        header = self.header(submission_id)
        if path.exists() and header in path.read_text(errors="replace"):
            return
        data = text.encode(errors="replace")
        if len(data) > self.max_bytes:
            cut = len(data) - self.max_bytes
            data = f"[the first {cut} bytes are left out]\n".encode() + data[cut:]
        if data and not data.endswith(b"\n"):
            data += b"\n"
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(descriptor, "ab") as out:
            out.write(header.encode() + data)

    @staticmethod
    def header(submission_id: str) -> str:
        """The line a kept life's log starts with."""
        return f"----- kaisa-ray: the log of Ray Job {submission_id} -----\n"

    def read(self, job_id: str) -> str | None:
        """The kept logs of the job's ended lives (None: none kept)."""
        try:
            return self.path(job_id).read_text(errors="replace")
        except FileNotFoundError:
            return None

    def delete(self, job_id: str) -> None:
        try:
            self.path(job_id).unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            logger.warning("could not delete the kept log of job %s: %s", job_id, err)
