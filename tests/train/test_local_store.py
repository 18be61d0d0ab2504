"""What standalone commands leave for the next (``kaisa_train.local_store``), and the
pieces of the connection that need no Ray: the store's files, the tuner's profiles through
it, ``tune --history`` read from it, and how an address is judged."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.profiles import profile

from kaisa_train.connection import cluster_address
from kaisa_train.head import free_port, reachable
from kaisa_train.local_store import MAX_RUNS, LocalStore, cache_dir
from kaisa_train.records import IntervalChangeRow, IntervalsRecord, LayerIntervals, StepRecord
from service.cli import main
from tuner.actor import TunerState


def test_the_store_lives_in_the_users_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "kaisa-ray"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kaisa-ray"


def test_runs_are_kept_newest_first_and_bounded(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    assert store.run_records("none") is None
    records = [StepRecord(step=10, loss=0.5).wire(), StepRecord(step=20, loss=0.4).wire()]
    store.save_run("run-a.t_00001", records)
    assert store.run_records("run-a.t_00001") == records
    assert (store.runs_dir / "run-a.t_00001.jsonl").stat().st_mode & 0o077 == 0
    with pytest.raises(ValueError, match="cannot name a file"):
        store.save_run("../escape", records)
    assert store.run_records("../escape") is None
    for index in range(MAX_RUNS + 2):
        store.save_run(f"run-{index}", [])
    kept = store.runs()
    assert len(kept) == MAX_RUNS
    assert "run-a.t_00001" not in kept  # the oldest went first


def test_the_tuners_profiles_go_through_the_store(tmp_path: Path) -> None:
    """What one head's tuner profiled, the next head's tuner knows: a hit, not a miss."""
    first = TunerState()
    first.decide("key", profile(), None)
    store = LocalStore(tmp_path)
    store.save_profiles(first.profiles())
    second = TunerState()
    assert second.remember(store.profiles()) == 1
    assert second.lookup("key") == profile()
    assert second.stats() == {"profiles": 1, "hits": 1, "misses": 0}
    bounded = TunerState(max_profiles=1)
    assert bounded.remember({"a": profile(), "b": profile(), "junk": "not a profile"}) == 1  # type: ignore[dict-item]
    assert bounded.lookup("b") is not None


def test_an_unreadable_or_foreign_profiles_file_is_ignored(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.profiles_file.parent.mkdir(parents=True, exist_ok=True)
    store.profiles_file.write_bytes(b"not a pickle")
    assert store.profiles() == {}
    store.profiles_file.write_bytes(pickle.dumps({"format": 0, "profiles": {"k": 1}}))
    assert store.profiles() == {}
    store.save_profiles({"key": profile()})  # rewritten in the current format
    assert list(store.profiles()) == ["key"]


def test_tune_history_reads_a_stored_run_without_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No RAY_ADDRESS: the run's intervals from the local store, and no Ray is started; a run
    the store lacks is an error that names where it looked and why a run may not be there."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    layer = LayerIntervals(
        layer="fc1", factor_update_steps=10, inv_update_steps=100, change_a=0.1,
        change_g=0.2, measured_step=50, interval_change_a=0.1, interval_change_g=0.2,
        angle=3.5, reason="within target",
    )  # fmt: skip
    change = IntervalChangeRow(
        step=100, layer="fc1", before=(5, 50), after=(10, 100), angle=3.5, gap=50,
        reason="stale curvature within half the target",
    )  # fmt: skip
    record = IntervalsRecord(step=100, adaptive=True, layers=[layer], changes=[change])
    LocalStore().save_run("stored-run", [StepRecord(step=100).wire(), record.wire()])

    def no_ray() -> None:
        raise AssertionError("tune --history started Ray")

    monkeypatch.setattr("kaisa_train.cli.ensure_ray", no_ray)
    result = CliRunner().invoke(main, ["tune", "--history", "stored-run"])
    assert result.exit_code == 0, result.output
    assert "fc1" in result.output
    assert "10/100 at step 100" in result.output

    missing = CliRunner().invoke(main, ["tune", "--history", "other-run"])
    assert missing.exit_code == 1
    message = " ".join(missing.output.split())
    assert f"run 'other-run' has no intervals records in the local store ({tmp_path}" in message
    assert "keeps them in that cluster's progress sink while the cluster runs" in message


def test_an_address_is_judged_before_connecting() -> None:
    assert not reachable(f"127.0.0.1:{free_port()}")
    assert not reachable("not-an-address")


@pytest.mark.parametrize(("value", "expected"), [("", None), ("local", None), (" h:1 ", "h:1")])
def test_no_address_or_local_means_a_head_of_its_own(
    value: str, expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", value)
    assert cluster_address() == expected


def test_a_stale_address_file_is_named_for_ray_address_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RAY_ADDRESS=auto reads the address the last ``ray start`` left; a dead one is an error
    at once that names the file and the fix (Ray itself would retry for minutes)."""
    from kaisa_ray.errors import ConfigurationError
    from kaisa_train import connection

    left = tmp_path / "ray_current_cluster"
    dead = f"127.0.0.1:{free_port()}"
    left.write_text(dead)
    monkeypatch.setattr(connection, "RAY_CURRENT_CLUSTER", left)
    with pytest.raises(ConfigurationError, match=rf"names {dead}, but nothing answers there") as e:
        connection._connect("auto")
    assert f"Remove the file (rm {left})" in str(e.value)


@pytest.mark.parametrize("address", ["http://127.0.0.1:8265", "HTTPS://head.example:443"])
def test_a_job_server_address_is_refused_naming_the_gcs_address_instead(address: str) -> None:
    """The address ``kaisa-ray head start`` prints first (for ``ray job submit``) is not one a
    driver can connect to: an error that says which one to use, not Ray's traceback."""
    from kaisa_ray.errors import ConfigurationError
    from kaisa_train import connection

    with pytest.raises(ConfigurationError, match="is a job server") as e:
        connection._connect(address)
    assert "GCS address, host:port" in str(e.value)
    assert "unset it to let this command start a local Ray of its own" in str(e.value)
