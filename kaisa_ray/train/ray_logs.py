"""Ray's consoles, quiet: a job's output shows Ray's warnings and errors, not the INFO lines
of its machinery. Everything still goes to the Ray session's log files.

Ray Data: each pipeline's start, plan and end, and its notice that progress bars are off
(kaisa-ray turns them off). Ray Data reads its logging configuration from
``RAY_DATA_LOGGING_CONFIG`` when ``ray.data`` is imported, in every process:
``quiet_environment`` gives a head's processes (the pipelines' coordinators run there) this
package's configuration, and ``quiet_here`` this process's. A variable the user set is left as
it is.

Ray Train: its ``ray.train`` loggers take the level of the run's ``LoggingConfig`` (the
trainer sets WARNING), but a worker's line for each report is logged under a logger named by
its module's file, which that setting does not reach: ``quiet_train_reports`` sets that one's
level in a worker.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

__all__ = [
    "CONFIG",
    "VARIABLE",
    "QuietConsole",
    "quiet_environment",
    "quiet_here",
    "quiet_train_reports",
]

VARIABLE = "RAY_DATA_LOGGING_CONFIG"
CONFIG = Path(__file__).with_name("ray_data_logging.yaml")
NOTICES = ("Progress bars disabled", "Progress bars for operators disabled")


class QuietConsole(logging.Filter):
    """Drops Ray Data's notices about its progress bars (warnings about a setting we chose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(NOTICES)


def quiet_environment(env: MutableMapping[str, str]) -> None:
    """Point ``env`` (a head's or a job's environment) at the quiet configuration, unless it
    names one of its own."""
    env.setdefault(VARIABLE, str(CONFIG))


def quiet_here() -> None:
    """This process's Ray Data console, quiet: where the variable is unset, set and applied
    (``ray.data`` may have been imported before); where it is set, Ray Data read it at import
    (the user's own, or a head's)."""
    if VARIABLE in os.environ:
        return
    os.environ[VARIABLE] = str(CONFIG)
    from ray.data._internal.logging import configure_logging

    configure_logging()


def quiet_train_reports() -> None:
    """In a Ray Train worker: its line for each ``ray.train.report`` at WARNING and above only
    (a no-op where Ray Train logs it elsewhere)."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray Train: its lines show, nothing else changes
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)
