"""The service's exceptions. Each maps to one HTTP status in one handler (``service.app``).

They are ``KaisaRayError``s, so one ``except KaisaRayError`` catches every error the project
raises on purpose, and they pickle (those with their own constructor arguments say how).
"""

from __future__ import annotations

from kaisa_ray.errors import KaisaRayError


class ServiceError(KaisaRayError):
    """Base of the service's errors; ``status`` is the HTTP status it maps to."""

    status = 500


class JobNotFoundError(ServiceError):
    status = 404

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(f"no job {job_id!r}; GET /v1/jobs lists the jobs there are")

    def __reduce__(self) -> tuple[type[JobNotFoundError], tuple[str]]:
        return (type(self), (self.job_id,))


class JobConflictError(ServiceError):
    """The request does not fit the job's state (delete a running job, cancel a finished one)
    or an idempotency key was reused for a different job."""

    status = 409


class RayUnavailableError(ServiceError):
    status = 503


class TookTooLongError(ServiceError):
    """A call that ``service.domain.restart.within`` waited for past its time (Ray, under load)."""


class DatabaseInUseError(ServiceError, RuntimeError):
    """Another service process has this SQLite database, or this data directory, open."""


class RayJobMissingError(ServiceError, LookupError):
    """Ray has no Ray Job of this submission id (its cluster was restarted, or it was
    deleted)."""

    status = 404


class InsecureBindError(ServiceError, ValueError):
    """A service reachable from other machines with no token."""
