"""Hyperparameters that are a constant or a callable of the K-FAC step.

The reference implementation's convention: every schedule-able hyperparameter is either a
number or ``f(step) -> number``, evaluated with the preconditioner's step counter (the number
of completed ``step()`` calls).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kaisa_ray.errors import ConfigurationError

FloatParam = float | Callable[[int], float]
IntParam = int | Callable[[int], int]


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """Allowed range of a hyperparameter and the advice given when it is violated."""

    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    advice: str = ""

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (
            value < self.low or (value == self.low and not self.low_inclusive)
        ):
            return False
        return not (
            self.high is not None
            and (value > self.high or (value == self.high and not self.high_inclusive))
        )

    def describe(self) -> str:
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        left = "[" if self.low_inclusive and self.low is not None else "("
        right = "]" if self.high_inclusive and self.high is not None else ")"
        return f"{left}{lo}, {hi}{right}"


def check_value(name: str, value: float, bounds: Bounds, *, step: int | None = None) -> float:
    """Validate one resolved value; raise ``ConfigurationError`` naming it and the fix."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(
            f"{name} must be a number or a callable of the step returning one; "
            f"got {value!r} of type {type(value).__name__}."
        )
    if not bounds.contains(float(value)):
        where = "" if step is None else f" (returned by the callable at step {step})"
        raise ConfigurationError(
            f"{name}={value!r}{where} is outside {bounds.describe()}. {bounds.advice}".strip()
        )
    return value


def check_param(name: str, param: FloatParam | IntParam, bounds: Bounds) -> None:
    """Validate a constant at construction; callables are checked each time they are used."""
    if callable(param):
        return
    check_value(name, param, bounds)


def resolve(name: str, param: FloatParam | IntParam, step: int, bounds: Bounds) -> float:
    """Evaluate ``param`` at ``step`` and validate the result."""
    if callable(param):
        return check_value(name, param(step), bounds, step=step)
    return param


def resolve_int(name: str, param: IntParam, step: int) -> int:
    """Evaluate an interval (a positive integer) at ``step``."""
    value = param(step) if callable(param) else param
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        where = f" (returned by the callable at step {step})" if callable(param) else ""
        raise ConfigurationError(
            f"{name}={value!r}{where} must be a positive integer number of steps, "
            "for example 1 (every step) or 10."
        )
    return value
