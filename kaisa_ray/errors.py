"""The exception tree of the K-FAC core."""

from __future__ import annotations


class KaisaRayError(Exception):
    """Base class of every error raised by kaisa_ray on purpose."""


class ConfigurationError(KaisaRayError, ValueError):
    """A bad argument: the message names it, the value given, and the fix."""


class StateDictError(KaisaRayError, ValueError):
    """A checkpoint that does not match the model it is loaded into."""


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the caller's own code.

    Call it as the ``stacklevel=`` argument of ``warnings.warn``. It skips kaisa_ray's and
    torch's frames (``step()`` runs under a ``torch.no_grad`` decorator), so the warning
    names the user's line that called into the library.
    """
    import inspect
    from pathlib import Path

    import torch

    library = (str(Path(__file__).resolve().parent), str(Path(torch.__file__).resolve().parent))
    caller = inspect.currentframe()
    frame = caller.f_back if caller is not None else None  # the function calling warn()
    level = 1
    while frame is not None:
        if not str(Path(frame.f_code.co_filename).resolve()).startswith(library):
            return level
        frame = frame.f_back
        level += 1
    return 1
