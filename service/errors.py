"""The service's exceptions. Each maps to one HTTP status in one handler (``service.app``)."""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the service's errors; ``status`` is the HTTP status it maps to."""

    status = 500


class JobNotFoundError(ServiceError):
    status = 404

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r}; GET /v1/jobs lists the jobs there are")


class JobConflictError(ServiceError):
    """The request does not fit the job's state (delete a running job, cancel a finished one)
    or an idempotency key was reused for a different job."""

    status = 409


class RayUnavailableError(ServiceError):
    status = 503
