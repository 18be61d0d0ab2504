"""A small client of the service's REST API (httpx), used by ``kaisa-ray submit/jobs/cancel``.

Example::

    client = ServiceClient("http://127.0.0.1:8000", token="...")
    job = client.submit(yaml.safe_load(open("job.yaml")))
    for event, data in client.events(job["id"]):
        print(event, data)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx

from kaisa_ray.errors import KaisaRayError

DEFAULT_URL = "http://127.0.0.1:8000"


class ServiceClientError(KaisaRayError):
    """The service refused a request or could not be reached; the message says why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[type[ServiceClientError], tuple[str, int | None]]:
        return (type(self), (str(self), self.status))


class ServiceClient:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30):
        self.url = (url or os.environ.get("KAISA_RAY_URL") or DEFAULT_URL).rstrip("/")
        token = token or os.environ.get("KAISA_RAY_TOKEN") or _token_file()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise ServiceClientError(
                f"cannot reach the service at {self.url} ({err}); is `kaisa-ray serve` running? "
                "Set --url or $KAISA_RAY_URL"
            ) from err
        if response.status_code >= 400:
            raise _refused(response)
        return response

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        job: dict[str, Any] = self._call("POST", "/v1/jobs", json=spec, headers=headers).json()
        return job

    def registry(self) -> dict[str, Any]:
        """What a job may name, and every closed set the service's answers use."""
        found: dict[str, Any] = self._call("GET", "/v1/registry").json()
        return found

    def job(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = self._call("GET", f"/v1/jobs/{job_id}").json()
        return job

    def jobs(self, states: list[str] | None = None, limit: int = 50) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if states:
            params["state"] = states
        page: dict[str, Any] = self._call("GET", "/v1/jobs", params=params).json()
        return page

    def cancel(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = self._call("POST", f"/v1/jobs/{job_id}/cancel").json()
        return job

    def metrics(self, job_id: str, kinds: list[str] | None = None) -> dict[str, Any]:
        params = {"kind": kinds} if kinds else {}
        history: dict[str, Any] = self._call(
            "GET", f"/v1/jobs/{job_id}/metrics", params=params
        ).json()
        return history

    def logs(self, job_id: str) -> str:
        return self._call("GET", f"/v1/jobs/{job_id}/logs").text

    def events(self, job_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """The job's server-sent events as ``(event, data)``, until the stream ends."""
        try:
            with self._http.stream(
                "GET", f"/v1/jobs/{job_id}/events", timeout=httpx.Timeout(30, read=None)
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _refused(response)
                event, data = "message", list[str]()
                for line in response.iter_lines():
                    if not line:
                        if data:
                            yield event, json.loads("\n".join(data))
                        event, data = "message", []
                    elif line.startswith(":"):
                        continue  # a ping
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
        except httpx.HTTPError as err:
            raise ServiceClientError(f"the event stream from {self.url} broke: {err}") from err


def _token_file() -> str | None:
    """The first line of ``$KAISA_RAY_TOKEN_FILE``, if it names a file (what the service
    reads too)."""
    path = os.environ.get("KAISA_RAY_TOKEN_FILE")
    if not path:
        return None
    try:
        lines = open(os.path.expanduser(path)).read().splitlines()  # noqa: SIM115
    except OSError as err:
        raise ServiceClientError(f"cannot read $KAISA_RAY_TOKEN_FILE ({path}): {err}") from err
    return lines[0].strip() if lines else None


def _refused(response: httpx.Response) -> ServiceClientError:
    """The error for a refused request: its status and the body's ``detail``."""
    try:
        body = response.json()
        detail = body.get("detail", body) if isinstance(body, dict) else body
    except ValueError:
        detail = response.text
    return ServiceClientError(f"{response.status_code}: {detail}", response.status_code)
