"""The service's settings: flags of ``kaisa-ray serve`` over ``KAISA_RAY_*`` environment
variables over these defaults (pydantic-settings)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from pydantic import AliasChoices, ByteSize, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.errors import InsecureBindError

MAX_WORKERS = 4096  # the JobSpec's own bound (kaisa_train.spec.MAX_WORKERS)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KAISA_RAY_", extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    ray_address: str | None = Field(
        default=None,
        description="the Ray cluster's GCS address (host:6379); none: start an embedded head",
    )
    dashboard_url: str | None = Field(
        default=None, description="the cluster's job server [default: from the cluster]"
    )
    data_dir: Path = Path.home() / "kaisa-ray"
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL [default: sqlite:///<data_dir>/jobs.db]"
    )
    storage_path: str | None = Field(
        default=None,
        # KAISA_RAY_STORAGE is what `kaisa-ray train` reads: one name for both works;
        # the checkpoint root is the same setting by the name the operator looks for.
        validation_alias=AliasChoices(
            "storage_path",
            "checkpoint_root",
            "KAISA_RAY_STORAGE_PATH",
            "KAISA_RAY_STORAGE",
            "KAISA_RAY_CHECKPOINT_ROOT",
        ),
        description="the checkpoint root: where jobs keep checkpoints, a directory (on a disk "
        "of its own, say, so that checkpoints never fill the database's) or a URI "
        "(s3://bucket/prefix) "
        "[default: <data_dir>/runs with the embedded head; on a cluster, the jobs' own "
        "default, $KAISA_RAY_STORAGE on the cluster's nodes]; on a multi-node cluster, storage "
        "every node reaches",
    )
    token: SecretStr | None = Field(
        default=None, description="the API's bearer token (prefer $KAISA_RAY_TOKEN or a file)"
    )
    token_file: Path | None = Field(
        default=None, description="a file holding the token (its first line); not with token"
    )
    insecure: bool = Field(
        default=False,
        description="allow a non-loopback host without a token (anyone who reaches the port "
        "can run jobs)",
    )
    data_roots: list[Path | str] = Field(
        default_factory=list,
        max_length=64,
        description="the folders under which a job may read its data (dataset.data_dir, a "
        "streamed dataset's paths; symlinks and .. resolved), and URI prefixes (s3://bucket/"
        "prefix) under which it may stream data from another system with the cluster's "
        "credentials [default: the built-in datasets' own folders]",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Host names answered without a token besides 127.0.0.1, ::1 and "
        "localhost (a guard against DNS rebinding; with a token, any name is)",
    )
    max_body_bytes: int = Field(default=64 * 1024, gt=0, le=16 * 2**20)
    header_timeout_s: float = Field(
        default=10,
        gt=0,
        le=600,
        description="how long a connection may take to send a request's headers before it is "
        "closed",
    )
    min_free_bytes: ByteSize = Field(
        default=ByteSize(256 * 2**20),
        ge=0,
        description="/readyz answers 503 while a disk the service writes to (the data "
        "directory's, the checkpoint root's) has less free space",
    )
    max_workers: int = Field(
        default=64, gt=0, le=MAX_WORKERS, description="the most workers one job may ask for"
    )
    max_gpus_per_worker: float = Field(
        default=8, ge=0, le=16, description="the most GPUs one worker may ask for"
    )
    min_cpus_per_worker: float = Field(
        default=0.5,
        ge=0,
        le=1024,
        description="the fewest CPUs one worker may ask for (below it Ray packs any number of "
        "workers on a node)",
    )
    max_model_bytes: ByteSize = Field(
        default=ByteSize(16 * 2**30),
        gt=0,
        description="the most a job's model may hold per worker: its float32 parameters and "
        "its activations at the job's batch size, computed on the meta device",
    )
    max_plans: int = Field(
        default_factory=lambda: max(1, (os.cpu_count() or 2) // 2),
        gt=0,
        le=256,
        description="plans (POST /v1/plan) computed at once, each in a process of its own; "
        "more are answered 429 [default: half the machine's cores]",
    )
    plan_timeout_s: float = Field(
        default=60,
        gt=0,
        le=3600,
        description="how long one plan may compute before it is ended (504)",
    )
    max_running: int | None = Field(
        default=None,
        gt=0,
        le=10_000,
        description="jobs in Ray at once; the rest wait QUEUED in order [default: as many as "
        "the cluster's CPUs hold, each job's workers and driver counted]",
    )
    driver_cpus: float = Field(
        default=0.25,
        ge=0,
        le=64,
        description="CPUs each job's Ray Job driver reserves (its entrypoint_num_cpus)",
    )
    post_rate: float = Field(
        default=20, gt=0, le=1e6, description="POST requests per second per client (sustained)"
    )
    post_burst: int = Field(
        default=40, gt=0, le=10**6, description="POST requests per client in a burst"
    )
    lost_grace_s: float = Field(
        default=30,
        ge=0,
        le=86400,
        description="how long a running job's Ray Job may be missing from Ray before the job "
        "is FAILED as lost with its cluster",
    )
    idempotency_ttl_s: float = Field(
        default=24 * 3600, gt=0, description="how long an Idempotency-Key names its job"
    )
    poll_interval_s: float = Field(
        default=0.25, gt=0, description="how often the follower reads the jobs' progress"
    )
    status_interval_s: float = Field(
        default=1.0, gt=0, description="how often the follower asks Ray for the jobs' status"
    )
    embedded_cpus: int | None = Field(
        default=None,
        gt=0,
        description="logical CPUs of the embedded Ray head [default: the machine's cores and "
        "one more, the job drivers' share: each driver reserves driver_cpus, so a job whose "
        "workers take every core still starts]",
    )

    @property
    def head_cpus(self) -> int:
        """The embedded head's logical CPUs (see ``embedded_cpus``)."""
        return self.embedded_cpus or (os.cpu_count() or 1) + 1

    @field_validator("storage_path")
    @classmethod
    def _storage(cls, storage: str | None) -> str | None:
        from kaisa_train.storage import resolve_storage

        return None if not storage else resolve_storage(storage, create=False)

    @field_validator("data_roots", mode="before")
    @classmethod
    def _roots(cls, roots: object) -> object:
        """A folder as a ``Path``; a URI (``s3://bucket/prefix``) as its checked string."""
        from kaisa_train.data_roots import root_of

        if not isinstance(roots, (list, tuple)):
            return roots
        return [root_of(r) if isinstance(r, (str, Path)) else r for r in roots]

    @field_validator("token")
    @classmethod
    def _not_empty(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and not token.get_secret_value():
            return None  # an empty variable is an unset one
        return token

    @model_validator(mode="after")
    def _token_and_bind(self) -> Settings:
        if self.token_file is not None:
            if self.token is not None:
                raise ValueError("give the token or a token file, not both")
            try:
                line = (
                    self.token_file.read_text().splitlines()[0].strip()
                    if (self.token_file.stat().st_size)
                    else ""
                )
            except OSError as err:
                raise ValueError(f"cannot read the token file {self.token_file}: {err}") from None
            if not line:
                raise ValueError(f"the token file {self.token_file} is empty")
            _check_token(line, f"the token in {self.token_file}")
            object.__setattr__(self, "token", SecretStr(line))
        elif self.token is not None:
            _check_token(self.token.get_secret_value(), "the token ($KAISA_RAY_TOKEN, --token)")
        if self.token is None and not self.insecure and not loopback(self.host):
            raise InsecureBindError(
                f"refusing to serve on {self.host} without a token: anyone who reaches that "
                "address could run jobs on the cluster. Set a token ($KAISA_RAY_TOKEN or "
                "--token-file), bind 127.0.0.1, or pass --insecure if the network is yours alone"
            )
        return self

    @property
    def roots(self) -> list[Path | str]:
        """The data roots in force: the configured ones, or the datasets' own folders."""
        from service.domain.sandbox import default_data_roots

        return list(self.data_roots) or list[Path | str](default_data_roots())

    @property
    def secret(self) -> str | None:
        """The token's value, or None for an open API."""
        return self.token.get_secret_value() if self.token is not None else None

    @property
    def database(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'jobs.db'}"

    @property
    def storage(self) -> str | None:
        """What jobs get as --storage-path: with the embedded head a folder of the data
        directory by default; on a cluster only what was configured (the service's own disk
        is not the cluster's)."""
        if self.storage_path or self.ray_address:
            return self.storage_path
        return str(self.data_dir / "runs")


MIN_TOKEN_LENGTH = 8


def _check_token(token: str, where: str) -> None:
    """A token a client can send and no one guesses: no whitespace (a bearer credential has
    none, so a token with it, a lone space above all, could never be sent), not short."""
    fix = "make one with: python3 -c 'import secrets; print(secrets.token_hex(16))'"
    if any(c.isspace() for c in token):
        raise ValueError(
            f"{where} contains whitespace ({len(token)} characters, "
            f"{sum(c.isspace() for c in token)} of them blank): a bearer token cannot; {fix}"
        )
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"{where} has {len(token)} characters; use at least {MIN_TOKEN_LENGTH}: {fix}"
        )


def loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
