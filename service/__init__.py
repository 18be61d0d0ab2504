"""The job service (FastAPI); built by a later issue."""
