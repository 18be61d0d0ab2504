"""The exception tree of the K-FAC core."""

from __future__ import annotations


class KaisaRayError(Exception):
    """Base class of every error raised by kaisa_ray on purpose."""


class ConfigurationError(KaisaRayError, ValueError):
    """A bad argument: the message names it, the value given, and the fix."""


class StateDictError(KaisaRayError, ValueError):
    """A checkpoint that does not match the model it is loaded into."""
