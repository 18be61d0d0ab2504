"""Run storage: local directories and URIs of shared filesystems; placement; ``--dry-run``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kaisa_ray.errors import ConfigurationError
from kaisa_train.spec import JobSpecError, parse_job_spec
from kaisa_train.storage import (
    STORAGE_ENV,
    checkpoint_file_exists,
    checkpoint_location,
    local_checkpoint,
    resolve_storage,
)
from service.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fashion_mnist.yaml"


def test_a_local_path_is_made_absolute_and_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_storage("runs/a", create=False) == str(tmp_path / "runs" / "a")
    assert not (tmp_path / "runs").exists()  # a dry run creates nothing
    assert resolve_storage("runs/a") == str(tmp_path / "runs" / "a")
    assert (tmp_path / "runs" / "a").is_dir()


def test_the_default_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STORAGE_ENV, str(tmp_path / "shared"))
    assert resolve_storage() == str(tmp_path / "shared")
    monkeypatch.setenv(STORAGE_ENV, "s3://bucket/runs")
    assert resolve_storage() == "s3://bucket/runs"


@pytest.mark.parametrize(
    "uri", ["s3://bucket/prefix", "gs://bucket", "hdfs://namenode:8020/runs", "file:///mnt/nfs"]
)
def test_uris_of_filesystems_ray_train_opens_are_kept_as_given(uri: str) -> None:
    assert resolve_storage(uri) == uri


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("ftp://host/runs", r"scheme 'ftp'.*cannot open.*s3://bucket/prefix"),
        ("s3:///no-bucket", r"names no bucket.*s3://bucket/prefix"),
        ("file://otherhost/runs", r"names a host.*file:///absolute/path"),
    ],
)
def test_a_uri_ray_train_cannot_use_is_refused_with_the_fix(uri: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        resolve_storage(uri)


def test_a_file_is_not_storage(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigurationError, match="is a file; give a directory"):
        resolve_storage(tmp_path / "f")


def test_checkpoints_are_found_and_read_by_path_and_by_uri(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run" / "checkpoint_000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.pt").write_bytes(b"state")
    for location in (str(checkpoint), f"file://{checkpoint}"):
        assert checkpoint_file_exists(location, "state.pt")
        assert not checkpoint_file_exists(location, "other.pt")
        with local_checkpoint(location) as directory:
            assert (directory / "state.pt").read_bytes() == b"state"


def test_a_checkpoint_location_gets_its_scheme_back() -> None:
    assert (
        checkpoint_location("b/runs/r/checkpoint_1", "s3://b/runs") == "s3://b/runs/r/checkpoint_1"
    )
    assert checkpoint_location("/mnt/r/checkpoint_1", "file:///mnt") == "/mnt/r/checkpoint_1"
    assert checkpoint_location("/home/r/checkpoint_1", "/home") == "/home/r/checkpoint_1"


def job(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "p",
        "model": {"name": "mlp"},
        "dataset": {"name": "synthetic"},
        "stop": {"max_steps": 1},
    }
    spec.update(overrides)
    return spec


@pytest.mark.parametrize(
    ("placement", "ray_name"),
    [
        ("pack", "PACK"),
        ("spread", "SPREAD"),
        ("strict-pack", "STRICT_PACK"),
        ("strict-spread", "STRICT_SPREAD"),
    ],
)
def test_placement_names_ray_placement_strategy(placement: str, ray_name: str) -> None:
    spec = parse_job_spec(job(scaling={"workers": 2, "placement": placement}))
    assert spec.scaling.placement_strategy == ray_name


def test_an_unknown_placement_and_precision_are_named() -> None:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(job(scaling={"placement": "scatter"}, precision="fp8"))
    fields = [problem.split(":")[0] for problem in caught.value.problems]
    assert fields == ["precision", "scaling.placement"]


def test_train_dry_run_prints_the_plan_without_starting_ray(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    result = CliRunner().invoke(
        main,
        ["train", "--config", str(EXAMPLE), "--dry-run", "--storage-path", "s3://bucket/runs"],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["workers"] == 2
    assert plan["resources_per_worker"] == {"CPU": 1.0}
    assert plan["placement_strategy"] == "PACK"
    assert plan["backend"] == "gloo"
    assert plan["storage"] == "s3://bucket/runs"
    assert plan["ray_address"] == "http://head:8265"


def test_train_dry_run_refuses_bad_storage_and_bad_jobs(tmp_path: Path) -> None:
    runner = CliRunner()
    bad_storage = runner.invoke(
        main, ["train", "--config", str(EXAMPLE), "--dry-run", "--storage-path", "ftp://x/y"]
    )
    assert bad_storage.exit_code == 1
    assert "scheme 'ftp'" in bad_storage.output
    bad_job = tmp_path / "bad.yaml"
    bad_job.write_text(EXAMPLE.read_text().replace("workers: 2", "workers: 0"))
    refused = runner.invoke(main, ["train", "--config", str(bad_job), "--dry-run"])
    assert refused.exit_code == 1
    assert "scaling.workers" in refused.output


def test_the_service_gives_jobs_its_storage_and_never_its_own_disk_to_a_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.settings import Settings

    monkeypatch.delenv("KAISA_RAY_STORAGE", raising=False)
    assert Settings(data_dir=tmp_path).storage == str(tmp_path / "runs")  # embedded head
    assert Settings(data_dir=tmp_path, ray_address="head:6379").storage is None
    monkeypatch.setenv("KAISA_RAY_STORAGE", "s3://bucket/runs")  # `kaisa-ray train`'s name
    assert Settings(ray_address="head:6379").storage == "s3://bucket/runs"
    monkeypatch.setenv("KAISA_RAY_STORAGE_PATH", "/mnt/shared")  # the flag's own name wins
    assert Settings().storage == "/mnt/shared"
    with pytest.raises(ValueError, match="scheme 'ftp'"):
        Settings(storage_path="ftp://host/runs")
