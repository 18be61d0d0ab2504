"""End-to-end example: LeNetCNN on Fashion-MNIST with SGD, optionally K-FAC preconditioned.

``run_example`` is a job (a ``JobSpec``) trained by the same loop as every job
(``worker.train``), in this process (``session.LocalSession``): no Ray, one worker.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from kaisa_ray.enums import DistributedStrategy, EvalMetric, OptimizerName
from kaisa_train.follow import Follower
from kaisa_train.records import EvalRecord, Record, StepRecord
from kaisa_train.reference import field_defaults
from kaisa_train.session import LocalSession
from kaisa_train.shard import evaluate
from kaisa_train.spec import parse_job_spec
from kaisa_train.worker import train
from kaisa_train.worker_config import TrainConfig

__all__ = ["DEFAULTS", "evaluate", "run_example"]

DEFAULTS = field_defaults()
"""The JobSpec's defaults: the example's own (it is a job)."""

logger = logging.getLogger(__name__)


def _check_positive(**values: float | int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def run_example(
    *,
    steps: int,
    batch_size: int = DEFAULTS["dataset.batch_size"],
    kfac: bool = True,
    factor_update_steps: int = DEFAULTS["kfac.factor_update_steps"],
    inv_update_steps: int = DEFAULTS["kfac.inv_update_steps"],
    damping: float = DEFAULTS["kfac.damping"],
    kl_clip: float | None = DEFAULTS["kfac.kl_clip"],
    lr: float = DEFAULTS["optimizer.lr"],
    kfac_approx: str = DEFAULTS["kfac.kfac_approx"],
    momentum: float = DEFAULTS["optimizer.momentum"],
    eval_every: int = DEFAULTS["eval_every"],
    seed: int = DEFAULTS["seed"],
    data_dir: str | Path | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Trains LeNetCNN on Fashion-MNIST with SGD (Nesterov momentum), optionally with K-FAC.

    Every ``eval_every`` steps, and after the last step, the accuracy on the full test split
    is measured and a record is appended to the returned history.

    Args:
        steps: Number of optimizer steps (mini-batches) to train for.
        batch_size: Training mini-batch size.
        kfac: Precondition the gradients with ``kaisa_ray.KFACPreconditioner``.
        factor_update_steps: K-FAC: steps between Kronecker factor updates.
        inv_update_steps: K-FAC: steps between recomputations of the factor inverses.
        damping: K-FAC: Tikhonov damping added to the factors.
        kl_clip: K-FAC: KL-clipping bound on the update size; None disables clipping.
        lr: SGD learning rate (also passed to K-FAC for KL clipping).
        kfac_approx: K-FAC's Conv2d factors, 'expand' or 'reduce'.
        momentum: SGD momentum; Nesterov momentum is used when it is positive.
        eval_every: Steps between test-set evaluations.
        seed: Seed for model initialisation and mini-batch shuffling.
        data_dir: Directory with the Fashion-MNIST IDX files; defaults to Debian's
            ``dataset-fashion-mnist`` location.
        threads: If given, the number of intra-op threads torch may use.
        progress: Show a progress bar (on stderr, on a terminal) and each evaluation.

    The defaults are the JobSpec's (the reference implementation's damping, KL clip and lr,
    with K-FAC-reduce at 5/50).

    Returns:
        One dict per evaluation with keys ``step``, ``loss`` (mean training loss since the
        previous record), ``test_accuracy`` and ``elapsed_s`` (seconds since training began,
        evaluation time included).

    Raises:
        ValueError: If a count, size or rate is not positive, or momentum is negative.
        kaisa_train.datasets.DatasetNotFoundError: If the data files are missing.
        kaisa_train.datasets.IDXFormatError: If a data file is corrupt.
    """
    _check_positive(
        steps=steps,
        batch_size=batch_size,
        factor_update_steps=factor_update_steps,
        inv_update_steps=inv_update_steps,
        damping=damping,
        lr=lr,
        eval_every=eval_every,
    )
    if kl_clip is not None:
        _check_positive(kl_clip=kl_clip)
    if momentum < 0:
        raise ValueError(f"momentum must be non-negative, got {momentum}")
    if threads is not None:
        _check_positive(threads=threads)
        torch.set_num_threads(threads)
    dataset: dict[str, Any] = {"name": "fashion-mnist", "batch_size": batch_size}
    if data_dir is not None:
        dataset["data_dir"] = str(data_dir)
    spec = parse_job_spec(
        {
            "name": "example",
            "model": {"name": "lenet"},
            "dataset": dataset,
            "optimizer": {
                "name": OptimizerName.SGD.value,
                "lr": lr,
                "momentum": momentum,
                "nesterov": True,
            },
            "kfac": {
                "strategy": DistributedStrategy.COMM_OPT,
                "factor_update_steps": factor_update_steps,
                "inv_update_steps": inv_update_steps,
                "damping": damping,
                "kl_clip": kl_clip,
                "kfac_approx": kfac_approx,
            }
            if kfac
            else "off",
            "stop": {"max_steps": steps},
            "eval_every": eval_every,
            "checkpoint": {"every_steps": steps},
            "seed": seed,
        },
        "the example",
    )
    logger.info(
        "training LeNetCNN for %d steps (batch %d, %s)",
        steps,
        batch_size,
        "K-FAC" if kfac else "plain SGD",
    )
    follower = Follower("train", show=progress)
    losses: dict[int, float | None] = {}
    history: list[dict[str, Any]] = []

    def on_record(record: Record) -> None:
        follower.take(record)
        if isinstance(record, StepRecord):
            losses[record.step] = record.loss
        elif isinstance(record, EvalRecord):
            history.append(
                {
                    "step": record.step,
                    "loss": losses.get(record.step),
                    EvalMetric.TEST_ACCURACY.value: record.test_accuracy,
                    "elapsed_s": record.elapsed_s,
                }
            )

    try:
        # Step records as often as evaluations: each evaluation's loss is the mean since the
        # one before.
        train(
            TrainConfig(spec=spec, run="example", progress_every=eval_every),
            LocalSession(on_record),
        )
    finally:
        follower.close()
    return history
