"""A small job on Ray Train and the records it left in the progress sink."""

from __future__ import annotations

from typing import Any

from kaisa_train.progress import read_progress


def job(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "e2e",
        "model": {"name": "lenet"},
        "dataset": {"name": "fashion-mnist", "batch_size": 64, "limit": LIMIT},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "kfac": {"strategy": "comm-opt", "factor_update_steps": 5, "inv_update_steps": 20},
        "scaling": {"workers": 2},
        "stop": {"max_steps": 40},
        "eval_every": 20,
        "checkpoint": {"every_steps": 20, "keep": 10},
        "seed": 3,
    }
    spec.update(overrides)
    return spec


def records(run: str, kind: str) -> list[dict[str, Any]]:
    return list(read_progress(run, kinds=[kind])["records"])


LIMIT = 2048
