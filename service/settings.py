"""The service's settings: flags of ``kaisa-ray serve`` over ``KAISA_RAY_*`` environment
variables over these defaults (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


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
        # KAISA_RAY_STORAGE is what `kaisa-ray train` reads: one name for both works.
        validation_alias=AliasChoices(
            "storage_path", "KAISA_RAY_STORAGE_PATH", "KAISA_RAY_STORAGE"
        ),
        description="where jobs keep checkpoints, a directory or a URI (s3://bucket/prefix) "
        "[default: <data_dir>/runs with the embedded head; on a cluster, the jobs' own "
        "default, $KAISA_RAY_STORAGE on the cluster's nodes]; on a multi-node cluster, storage "
        "every node reaches",
    )
    token: SecretStr | None = None
    max_body_bytes: int = Field(default=256 * 1024, gt=0)
    poll_interval_s: float = Field(
        default=0.25, gt=0, description="how often the follower reads the jobs' progress"
    )
    status_interval_s: float = Field(
        default=1.0, gt=0, description="how often the follower asks Ray for the jobs' status"
    )
    embedded_cpus: int | None = Field(default=None, gt=0)

    @field_validator("storage_path")
    @classmethod
    def _storage(cls, storage: str | None) -> str | None:
        from kaisa_ray.train.storage import resolve_storage

        return None if not storage else resolve_storage(storage, create=False)

    @field_validator("token")
    @classmethod
    def _not_empty(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and not token.get_secret_value():
            return None
        return token

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
