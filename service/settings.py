"""The service's settings: flags of ``kaisa-ray serve`` over ``KAISA_RAY_*`` environment
variables over these defaults (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
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
        description="where jobs keep checkpoints [default: <data_dir>/runs]; on a multi-node "
        "cluster, storage every node reaches",
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
    def storage(self) -> str:
        return self.storage_path or str(self.data_dir / "runs")
