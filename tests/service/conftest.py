"""Fixtures for the service's modules (a module that defines its own of the same name uses its
own): kept here, not in ``tests/conftest.py``, so that the core's tests need no FastAPI (the GPU
machine's image has none)."""

from support.browser import browser  # noqa: F401
from support.service_app import service  # noqa: F401
