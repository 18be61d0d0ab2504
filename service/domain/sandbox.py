"""The service's data sandbox: the JobSpecs it reads name ``dataset.data_dir`` only under
its data roots (``kaisa-ray serve --data-root``, repeatable; by default the built-in
datasets' own folders), checked by the JobSpec itself (``kaisa_train.data_roots``) while
this middleware holds the roots for the request being validated."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from kaisa_train.data_roots import within
from kaisa_train.registry import BUILTIN_DATASETS

__all__ = ["DataRoots", "default_data_roots"]


def default_data_roots() -> list[Path]:
    """The folders the built-in datasets read by default (Debian's packages')."""
    return sorted({e.default_dir for e in BUILTIN_DATASETS.values() if e.default_dir})


class DataRoots:
    """Every request is validated with ``roots`` as the data roots."""

    def __init__(self, app: ASGIApp, *, roots: Sequence[Path | str]) -> None:
        self.app, self.roots = app, list(roots)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with within(self.roots):
            await self.app(scope, receive, send)
