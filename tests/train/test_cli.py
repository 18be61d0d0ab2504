"""The kaisa-ray command line (service.cli) and its training commands (kaisa_train.cli)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR
from service.cli import main


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_help(runner: CliRunner) -> None:
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    assert "example" in result.output


def test_example_help_lists_options(runner: CliRunner) -> None:
    result = runner.invoke(main, ["example", "--help"])
    assert result.exit_code == 0, result.output
    for option in (
        "--steps",
        "--no-kfac",
        "--factor-update-steps",
        "--inv-update-steps",
        "--damping",
        "--kl-clip",
        "--lr",
        "--data-dir",
        "--seed",
        "--threads",
    ):
        assert option in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "Invalid value for '--steps'"),
        (["--steps", "many"], "'many' is not a valid integer"),
        (["--damping", "0"], "Invalid value for '--damping'"),
        (["--lr", "-1"], "Invalid value for '--lr'"),
        (["--threads", "0"], "Invalid value for '--threads'"),
        (["--eval-every", "0"], "Invalid value for '--eval-every'"),
        (["--no-such-option"], "No such option"),
    ],
)
def test_bad_values_are_rejected(runner: CliRunner, args: list[str], message: str) -> None:
    result = runner.invoke(main, ["example", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_missing_data_dir_is_a_usage_error(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(main, ["example", "--data-dir", str(tmp_path / "none")])
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_empty_data_dir_names_the_fix(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(main, ["example", "--no-kfac", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert str(tmp_path) in result.output
    assert "apt-get install dataset-fashion-mnist" in result.output


@pytest.mark.slow
@pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="apt-get install dataset-fashion-mnist"
)
def test_example_without_kfac_on_real_data(runner: CliRunner) -> None:
    result = runner.invoke(
        main, ["example", "--no-kfac", "--steps", "3", "--eval-every", "3", "--threads", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "final test accuracy" in result.output
    assert "after 3 steps" in result.output


def test_every_example_job_is_valid(tmp_path: Path) -> None:
    """Each as it is; a streamed one with its splits' folders where the README's script
    writes them (made here, empty: validating does not read them)."""
    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
    assert len(examples) >= 2
    for example in examples:
        job = yaml.safe_load(example.read_text())
        if "train" in job["dataset"]:
            for split in ("train", "validation"):
                written = Path(job["dataset"][split])
                assert written.is_relative_to("/tmp/fashion-mnist-files"), written
                job["dataset"][split] = str(tmp_path / written.relative_to("/"))
                Path(job["dataset"][split]).mkdir(parents=True, exist_ok=True)
            example = tmp_path / example.name
            example.write_text(yaml.safe_dump(job))
        result = CliRunner().invoke(main, ["validate", "--config", str(example)])
        assert result.exit_code == 0, (example, result.output)


def test_validate_accepts_the_example_job_and_names_bad_fields(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "fashion_mnist.yaml"
    result = CliRunner().invoke(main, ["validate", "--config", str(example)])
    assert result.exit_code == 0, result.output
    assert '"name": "fashion-mnist-kfac"' in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        example.read_text()
        .replace("workers: 2", "workers: 0")
        .replace("memory_budget: 2GiB", "memory_budget: lots")
    )
    result = CliRunner().invoke(main, ["validate", "--config", str(bad)])
    assert result.exit_code == 1
    assert "scaling.workers" in result.output
    assert "memory_budget" in result.output


def test_errors_show_an_enum_by_its_value(tmp_path: Path) -> None:
    """A closed set's member appears in a message as the value a user writes ('comm-opt'),
    never as Python's repr (<DistributedStrategy.COMM_OPT: 'comm-opt'>)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nmodel: {name: lenet}\ndataset: {name: synthetic}\n"
        "kfac: {strategy: comm-opt, verify: 2}\n"
    )
    result = CliRunner().invoke(main, ["validate", "--config", str(bad)])
    assert result.exit_code == 1
    assert "set strategy: auto instead of 'comm-opt'" in " ".join(result.output.split())
    assert "<" not in result.output
