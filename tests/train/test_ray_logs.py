"""Ray's consoles, quiet (``kaisa_train.ray_logs``): what Ray Data and Ray Train print
at INFO stays in their log files, out of a job's output."""

from __future__ import annotations

import logging

import pytest


def test_ray_data_s_console_takes_warnings_only_and_a_user_s_own_configuration_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The quiet configuration loads in Ray Data's own loader: its console handler passes a
    warning and drops INFO lines and the progress-bar notice; every record still reaches the
    file handler. A head's environment gets it unless the user named a configuration."""
    from ray.data._internal.logging import configure_logging

    from kaisa_train.ray_logs import CONFIG, VARIABLE, quiet_environment, quiet_here

    env = {VARIABLE: "/etc/my-ray-data-logging.yaml"}
    quiet_environment(env)
    assert env[VARIABLE] == "/etc/my-ray-data-logging.yaml"
    fresh: dict[str, str] = {}
    quiet_environment(fresh)
    assert fresh[VARIABLE] == str(CONFIG)

    monkeypatch.delenv(VARIABLE, raising=False)
    try:
        quiet_here()
        handlers = {type(h).__name__: h for h in logging.getLogger("ray.data").handlers}
        console, file = handlers["PlainRayHandler"], handlers["SessionFileHandler"]

        def shown(handler: logging.Handler, level: int, message: str) -> bool:
            record = logging.LogRecord("ray.data", level, __file__, 1, message, None, None)
            return record.levelno >= handler.level and bool(handler.filter(record))

        assert not shown(console, logging.INFO, "Starting execution of Dataset train_0")
        assert not shown(console, logging.WARNING, "Progress bars disabled. To enable, ...")
        assert shown(console, logging.WARNING, "a read task failed")
        assert shown(file, logging.INFO, "Starting execution of Dataset train_0")
    finally:
        monkeypatch.delenv(VARIABLE, raising=False)
        configure_logging()  # Ray's defaults again for the tests after this one


def test_ray_train_s_report_line_is_quiet_in_a_worker() -> None:
    """Ray Train logs each report under a logger named by its module's file (not under
    ``ray.train``, which the run's ``LoggingConfig`` reaches): that logger is the one quieted.
    (A job's output without Ray Train's lines: ``test_ray_train.py``'s ``ray job submit``.)"""
    from ray.train.v2._internal.execution import context

    from kaisa_train.ray_logs import quiet_train_reports

    assert context.logger.name == context.__file__  # where Ray logs "Reporting training result"
    before = context.logger.level
    try:
        quiet_train_reports()
        assert not context.logger.isEnabledFor(logging.INFO)
        assert context.logger.isEnabledFor(logging.WARNING)
    finally:
        context.logger.setLevel(before)


def test_a_head_on_one_machine_has_no_preemption_watcher_unless_asked() -> None:
    """No node of a one-machine head is ever drained: Ray Train's watcher (an actor a run, and
    a C++ error line in every job's output) is off there; a value the user set is kept."""
    from kaisa_train.ray_logs import PREEMPTION_WATCHER, quiet_environment

    fresh: dict[str, str] = {}
    quiet_environment(fresh)
    assert fresh[PREEMPTION_WATCHER] == "0"
    asked = {PREEMPTION_WATCHER: "1"}
    quiet_environment(asked)
    assert asked[PREEMPTION_WATCHER] == "1"


def test_a_head_on_one_machine_lists_its_log_folder_at_ray_s_slower_pace() -> None:
    from kaisa_train.ray_logs import LOG_LISTING, quiet_environment

    fresh: dict[str, str] = {}
    quiet_environment(fresh)
    assert fresh[LOG_LISTING] == "0"
    asked = {LOG_LISTING: "1000"}
    quiet_environment(asked)
    assert asked[LOG_LISTING] == "1000"
