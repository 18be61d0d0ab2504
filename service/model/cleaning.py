"""The progress sink's records, checked before they reach the job store.

A record comes from a job's own process (its rank 0, through the progress sink), so the service
treats it as input: ``clean`` returns a copy that the store can always hold and the API can
always serve, and says what it had to change; ``service.domain.interpretation`` then reads it as its
class (``kaisa_train.records``, where every kind is defined), and drops one that does not
read, saying why. Integers outside what SQLite's 64-bit columns and JSON's exact range hold
become None (a ``total_steps`` of 2**63 once made every follower pass fail); non-finite floats
become None (JSON has no NaN); the fields the follower reads as counters (``step``,
``total_steps``, ``rank``, ...) must be non-negative integers; anything that is not JSON is
written as a short string; deep nesting and long strings are cut. A record that is not a
mapping with a ``kind`` is dropped whole.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_INT = 2**53  # JSON's exact integers; far below SQLite's 2**63
MAX_DEPTH = 8
MAX_STRING = 64 * 1024
COUNTERS = ("step", "total_steps", "from_step", "rank", "world", "seq", "attempts")
"""Fields that must be non-negative integers where present (the follower counts with them)."""


# Terminal control sequences in text from a job's process (Ray colours its log prefixes, a
# traceback may carry them): CSI (colours, cursor moves), OSC (titles, links: up to BEL or
# ST), other two-byte escapes, and the C0 control characters but newline and tab.
_CONTROL = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]|[\x00-\x08\x0b-\x1f\x7f]"
)


def plain_text(text: str) -> str:
    """``text`` without terminal escapes and control characters: what a failure reason from
    Ray may carry, shown raw by the API, the CLI and the dashboard."""
    return _CONTROL.sub("", text)


@dataclass
class Cleaned:
    record: dict[str, Any] | None  # None: dropped whole
    problems: list[str] = field(default_factory=list)


def clean(record: Any) -> Cleaned:
    """A storable copy of ``record`` and what was wrong with it (empty: nothing)."""
    problems: list[str] = []
    if not isinstance(record, Mapping) or not isinstance(record.get("kind"), str):
        return Cleaned(None, [f"not a record with a kind: {_short(record)}"])
    value = _json(record, "", problems, 0)
    assert isinstance(value, dict)
    for name in COUNTERS:
        if name not in value or value[name] is None:
            continue
        count = value[name]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            problems.append(f"{name}: {_short(count)} is not a non-negative integer")
            value[name] = None
    return Cleaned(value, problems)


def _json(value: Any, where: str, problems: list[str], depth: int) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            problems.append(f"{where or 'record'}: a string of {len(value)} characters, cut")
            return value[:MAX_STRING]
        return value
    if isinstance(value, int):
        if -MAX_INT <= value <= MAX_INT:
            return value
        problems.append(f"{where}: {_short(value)} is out of range (|n| <= 2**53)")
        return None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth >= MAX_DEPTH:
        problems.append(f"{where}: nested deeper than {MAX_DEPTH} levels, dropped")
        return None
    if isinstance(value, Mapping):
        return {
            str(k): _json(v, f"{where}.{k}" if where else str(k), problems, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_json(v, f"{where}[{i}]", problems, depth + 1) for i, v in enumerate(value)]
    integer, floating = _numpy_types()
    if isinstance(value, integer):
        return _json(int(value), where, problems, depth)
    if isinstance(value, floating):
        return _json(float(value), where, problems, depth)
    problems.append(f"{where}: a {type(value).__name__}, kept as text")
    return _short(value)


def _numpy_types() -> tuple[Any, Any]:
    """numpy's integer and float scalar types (what a worker's metrics may be)."""
    import numpy

    return numpy.integer, numpy.floating


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
