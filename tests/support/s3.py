"""A real S3 server on this machine for the tests: moto's (the S3 API, served over HTTP on
127.0.0.1), bound once to a port of its own choosing, with the settings a Ray job needs to
read it (the standard AWS variables, which pyarrow, and so Ray Data, read)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["S3", "s3_server"]


@dataclass(frozen=True)
class S3:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str

    @property
    def env(self) -> dict[str, str]:
        """What a process reading this server's ``s3://`` URIs needs in its environment."""
        return {
            "AWS_ACCESS_KEY_ID": "kaisa-tests",
            "AWS_SECRET_ACCESS_KEY": "kaisa-tests",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def filesystem(self) -> Any:
        import pyarrow.fs

        env = self.env
        return pyarrow.fs.S3FileSystem(
            access_key=env["AWS_ACCESS_KEY_ID"],
            secret_key=env["AWS_SECRET_ACCESS_KEY"],
            region=env["AWS_REGION"],
            endpoint_override=self.endpoint,
            allow_bucket_creation=True,
        )

    def upload(self, local: Path, key: str) -> str:
        """Copies the folder (or file) ``local`` to ``key`` in the bucket; its ``s3://`` URI."""
        import pyarrow.fs

        pyarrow.fs.copy_files(
            str(local),
            f"{self.bucket}/{key}",
            source_filesystem=pyarrow.fs.LocalFileSystem(),
            destination_filesystem=self.filesystem(),
        )
        return f"s3://{self.bucket}/{key}"


@contextmanager
def s3_server(bucket: str = "kaisa") -> Iterator[S3]:
    """A moto S3 server with one empty bucket, stopped on exit."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        s3 = S3(endpoint=f"http://{host}:{port}", bucket=bucket)
        s3.filesystem().create_dir(bucket)
        yield s3
    finally:
        server.stop()
