"""Numbers in a job description are numbers: ``true`` is not 1.

Pydantic's lax mode reads a boolean as an integer or a float (``batch_size: true`` became a
batch of 1, ``kfac.strategy: true`` a gradient worker fraction of 1.0). A YAML or JSON
``true`` where a number belongs is a mistake; ``NoBooleanNumbers`` refuses it on every field
of a model whose type does not take a boolean, in lists and tuples too (``choice: [true]``,
``hidden: [true]``), and leaves every other lax conversion (a string to an enum) as it is.
"""

from __future__ import annotations

import functools
import json
import typing
from typing import Any

from pydantic import BaseModel, ValidationInfo, field_validator

__all__ = ["NoBooleanNumbers", "takes_bool"]


@functools.cache
def takes_bool(annotation: Any) -> bool:
    """Whether a field typed ``annotation`` may hold a boolean (``bool`` or ``Any`` anywhere
    in it, through unions, ``Annotated``, lists and dicts)."""
    if annotation is bool or annotation is Any:
        return True
    return any(takes_bool(arg) for arg in typing.get_args(annotation) if not _is_metadata(arg))


def _is_metadata(arg: Any) -> bool:
    """``Annotated``'s constraints (``Field(ge=1)``...) and ``Literal``'s values: not types."""
    return not (isinstance(arg, type) or typing.get_origin(arg) is not None or arg is Any)


def _booleans(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, list | tuple):
        return any(_booleans(item) for item in value)
    return False


class NoBooleanNumbers(BaseModel):
    """A base for models whose numeric fields refuse ``true``/``false``."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None or not _booleans(value):
            return value
        field = cls.model_fields.get(info.field_name)
        annotation: Any = None if field is None else field.annotation
        if field is None or takes_bool(annotation):
            return value
        raise ValueError(
            f"{json.dumps(value)} holds a boolean where a number belongs; write the number "
            "(1, not true)"
        )
