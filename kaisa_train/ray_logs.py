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

Ray Train's preemption watcher: an actor a run that watches for nodes being drained (cloud
preemption, an autoscaler scaling down), and whose creation prints a C++ error line in every
job's output (its constructor arguments in the object store, ray-project/ray#53727). The heads
kaisa-ray starts are one machine's, where no node is drained: ``quiet_environment`` turns it
off there (``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0``) unless the environment names a value. A
cluster's own head (``ray start`` on it, KubeRay) keeps Ray's default, the watcher on.

Ray's log monitor (a process a node, which sends the workers' output to their drivers) lists
the node's log folder on every pass, ten a second, until the folder holds 1000 files, and
every 0.5 s past that: ``quiet_environment`` gives a head kaisa-ray starts the second pace
(``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0``), a new worker's first lines then reaching its
driver up to 0.5 s later, for less than half the monitor's CPU. A value the user set is
kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

__all__ = [
    "CONFIG",
    "LOG_LISTING",
    "PREEMPTION_WATCHER",
    "VARIABLE",
    "QuietConsole",
    "quiet_environment",
    "quiet_here",
    "quiet_train_reports",
]

VARIABLE = "RAY_DATA_LOGGING_CONFIG"
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
LOG_LISTING = "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"
CONFIG = Path(__file__).with_name("ray_data_logging.yaml")
NOTICES = ("Progress bars disabled", "Progress bars for operators disabled")


class QuietConsole(logging.Filter):
    """Drops Ray Data's notices about its progress bars (warnings about a setting we chose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(NOTICES)


def quiet_environment(env: MutableMapping[str, str]) -> None:
    """Point ``env`` (the environment of a head on one machine) at the quiet configuration,
    turn Ray Train's preemption watcher off and pace the log monitor's listing of the log
    folder at 0.5 s, each unless ``env`` names a value of its own."""
    env.setdefault(VARIABLE, str(CONFIG))
    env.setdefault(PREEMPTION_WATCHER, "0")
    env.setdefault(LOG_LISTING, "0")


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
