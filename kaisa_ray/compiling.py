"""Methods that run eagerly under ``torch.compile``, without importing ``torch._dynamo`` in a
process that never compiles.

``torch.compiler.disable`` as a plain decorator imports ``torch._dynamo`` when the class is
defined, about a second of CPU in every process that imports the preconditioner (each Ray Train
worker, each job's driver, the CLI). ``eager_under_compile`` applies it when the method is
looked up in a process where ``torch._dynamo`` is loaded, which ``torch.compile`` does before it
traces anything: the compiled model's hooks then find the disabled method (a graph break, the
method run eagerly), and an uncompiled model's hooks the plain one.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

import torch

T = TypeVar("T")

DYNAMO = "torch._dynamo"


class eager_under_compile(Generic[T]):  # noqa: N801 (a decorator, named as one)
    """Decorator for a method: ``torch.compiler.disable`` of it, applied once ``torch._dynamo``
    is loaded in this process (see the module's docstring)."""

    def __init__(self, method: Callable[..., T]) -> None:
        self._method = method
        self._disabled: Callable[..., T] | None = None
        self.__doc__ = method.__doc__
        self.__name__ = method.__name__

    def _resolved(self) -> Callable[..., T]:
        if DYNAMO not in sys.modules:
            return self._method
        if self._disabled is None:
            self._disabled = torch.compiler.disable(self._method)  # type: ignore[no-untyped-call]
        return self._disabled

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> eager_under_compile[T]: ...
    @overload
    def __get__(self, instance: object, owner: type[Any]) -> Callable[..., T]: ...
    def __get__(
        self, instance: object | None, owner: type[Any] | None = None
    ) -> eager_under_compile[T] | Callable[..., T]:
        if instance is None:
            return self
        return types.MethodType(self._resolved(), instance)
