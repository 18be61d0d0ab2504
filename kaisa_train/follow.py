"""The one follower: a run's progress shown from its records, the same way at every front
door (``kaisa-ray train`` and ``sweep`` read the progress sink, ``kaisa-ray submit --follow``
the service's event stream, ``kaisa-ray example`` its own loop).

On a terminal, a progress bar redrawn in place with the lines above it; elsewhere (a log, a
pipe), a line per evaluation, decision, change of a layer's K-FAC intervals and trial change,
and nothing printed twice. A sweep's
trials are a table, redrawn on a terminal.

Torch-free and Ray-free: the service's client commands use it.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm.auto import tqdm

from kaisa_train.records import (
    EvalRecord,
    IntervalsRecord,
    Record,
    StartRecord,
    StepRecord,
    TrialRecord,
    TunerRecord,
)
from kaisa_train.tables import TrialTable, change_line, decision_line

__all__ = ["Follower", "eval_line"]


def eval_line(record: EvalRecord) -> str:
    """``step 20: test accuracy 0.8125, test loss 0.5012, 3.2 s`` (what the record has)."""
    text = f"step {record.step}:"
    parts = []
    if record.test_accuracy is not None:
        parts.append(f"test accuracy {record.test_accuracy:.4f}")
    if record.test_loss is not None:
        parts.append(f"test loss {record.test_loss:.4f}")
    if record.elapsed_s is not None:
        parts.append(f"{record.elapsed_s:.1f} s")
    return f"{text} {', '.join(parts)}" if parts else text


class Follower:
    """Shows one run's progress from its records (``take``).

    Args:
        label: What the bar says (the run or job).
        show: Show anything at all (False: only collect ``evals``).
        live: Draw in place (a bar; a sweep's table redrawn); default: ``out`` is a terminal.
        out: Where lines go (and the table); the bar goes to ``bar_file``.
        bar_file: The bar's stream (stderr by default).
        table: A sweep's trial table: its trial records update it.
        bar: Draw the progress bar when live (a sweep has none: its table is the progress).
    """

    def __init__(
        self,
        label: str,
        *,
        show: bool = True,
        live: bool | None = None,
        out: IO[str] | None = None,
        bar_file: IO[str] | None = None,
        table: TrialTable | None = None,
        bar: bool = True,
    ) -> None:
        self.out = out or sys.stdout
        self.bar_file = bar_file or sys.stderr
        self.show = show
        self.live = self.bar_file.isatty() if live is None else live
        self.evals: list[EvalRecord] = []
        self.table = table
        self._drawn = 0  # lines of the table last drawn in place
        self.bar: Any = tqdm(
            total=None,
            desc=label,
            unit="step",
            file=self.bar_file,
            dynamic_ncols=True,
            disable=not (show and bar and self.live),
        )

    def say(self, text: str) -> None:
        """A line, above the bar when there is one."""
        if not self.show:
            return
        if not self.bar.disable:
            tqdm.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    def advance(self, step: int) -> None:
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def take(self, record: Record) -> None:
        """Show what one record says."""
        if isinstance(record, StartRecord):
            if record.total_steps:
                self.bar.total = record.total_steps
            self.bar.n = record.from_step
            if record.resumed_from:
                self.say(f"resumed at step {record.from_step} from {record.resumed_from}")
            self.bar.refresh()
        elif isinstance(record, StepRecord):
            self.advance(record.step)
            self.bar.set_postfix(
                loss=_num(record.loss, ".4f"),
                acc=_num(record.accuracy, ".3f"),
                samples_s=_num(record.samples_per_s, ".0f"),
                refresh=True,
            )
        elif isinstance(record, EvalRecord):
            self.evals.append(record)
            self.say(eval_line(record))
        elif isinstance(record, TunerRecord):
            self.say(decision_line(record))
        elif isinstance(record, IntervalsRecord):
            for change in record.changes:
                self.say(change_line(change))
        elif isinstance(record, TrialRecord) and self.table is not None:
            line = self.table.update(record)
            if self.show and self.live:
                text = self.table.render()
                print(
                    (f"\x1b[{self._drawn}F\x1b[J" if self._drawn else "") + text,
                    file=self.out,
                    flush=True,
                )
                self._drawn = text.count("\n") + 1
            elif line:
                self.say(line)

    def finish(self, done: bool) -> None:
        """The run ended: a done run's bar at 100%, with no time left to guess."""
        if done and self.bar.n:
            self.bar.total = self.bar.n
        self.bar.bar_format = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}]"
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
