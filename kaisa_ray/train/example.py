"""End-to-end example: LeNetCNN on Fashion-MNIST with SGD, optionally K-FAC preconditioned."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from kaisa_ray.train.datasets import load_idx_dataset
from kaisa_ray.train.models import LeNetCNN

__all__ = ["evaluate", "run_example"]

logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 1000
) -> float:
    """Classification accuracy of a model over a whole data set.

    Args:
        model: The classifier; it is put in eval mode and back into its previous mode.
        images: Inputs, batched along the first dimension.
        labels: Integer class labels, one per input.
        batch_size: How many inputs to push through the model at once.

    Returns:
        The fraction of inputs whose arg-max logit is the label (0.0 for an empty set).
    """
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, images.shape[0], batch_size):
        logits = model(images[start : start + batch_size])
        correct += int((logits.argmax(dim=1) == labels[start : start + batch_size]).sum())
    model.train(was_training)
    return correct / max(images.shape[0], 1)


def _check_positive(**values: float | int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def run_example(
    *,
    steps: int,
    batch_size: int = 128,
    kfac: bool = True,
    factor_update_steps: int = 5,
    inv_update_steps: int = 50,
    damping: float = 0.1,
    kl_clip: float | None = 0.001,
    lr: float = 0.05,
    kfac_approx: str = "reduce",
    momentum: float = 0.9,
    eval_every: int = 25,
    seed: int = 0,
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

    The defaults are the fastest K-FAC configuration of ``benchmarks/optimizers_fashion_mnist.py``
    (the reference implementation's damping, KL clip and lr, with K-FAC-reduce at 5/50).
        momentum: SGD momentum; Nesterov momentum is used when it is positive.
        eval_every: Steps between test-set evaluations.
        seed: Seed for model initialisation and mini-batch shuffling.
        data_dir: Directory with the Fashion-MNIST IDX files; defaults to Debian's
            ``dataset-fashion-mnist`` location.
        threads: If given, the number of intra-op threads torch may use.
        progress: Show a tqdm progress bar (on stderr).

    Returns:
        One dict per evaluation with keys ``step``, ``loss`` (mean training loss since the
        previous record), ``test_accuracy`` and ``elapsed_s`` (seconds since training began,
        evaluation time included).

    Raises:
        ValueError: If a count, size or rate is not positive, or momentum is negative.
        kaisa_ray.train.datasets.DatasetNotFoundError: If the data files are missing.
        kaisa_ray.train.datasets.IDXFormatError: If a data file is corrupt.
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

    train_x, train_y = load_idx_dataset(data_dir, "train")
    test_x, test_y = load_idx_dataset(data_dir, "test")
    logger.info(
        "training LeNetCNN for %d steps (batch %d, %s) on %d samples; testing on %d",
        steps,
        batch_size,
        "K-FAC" if kfac else "plain SGD",
        train_x.shape[0],
        test_x.shape[0],
    )

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = LeNetCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)
    preconditioner = None
    if kfac:
        from kaisa_ray import KFACPreconditioner  # imported here: only the K-FAC path needs it

        preconditioner = KFACPreconditioner(
            model,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            kl_clip=kl_clip,
            lr=lr,
            kfac_approx=kfac_approx,
        )
    criterion = nn.CrossEntropyLoss()

    history: list[dict[str, Any]] = []
    order = torch.randperm(train_x.shape[0], generator=gen)
    cursor = 0
    loss_sum, loss_count, samples, train_s = 0.0, 0, 0, 0.0
    accuracy = 0.0
    start = time.perf_counter()
    model.train()
    # Route log records through tqdm while the bar is shown, so that they do not break it.
    redirect = logging_redirect_tqdm() if progress else contextlib.nullcontext()
    bar = tqdm(range(1, steps + 1), desc="train", unit="step", disable=not progress)
    with redirect, bar:
        for step in bar:
            tick = time.perf_counter()
            if cursor + batch_size > order.shape[0]:  # new epoch: reshuffle, drop the remainder
                order = torch.randperm(train_x.shape[0], generator=gen)
                cursor = 0
            index = order[cursor : cursor + batch_size]
            cursor += batch_size
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(train_x[index]), train_y[index])
            loss.backward()
            if preconditioner is not None:
                preconditioner.step()
            optimizer.step()
            train_s += time.perf_counter() - tick
            samples += index.shape[0]
            loss_value = float(loss.detach())
            loss_sum += loss_value
            loss_count += 1

            if step % eval_every == 0 or step == steps:
                accuracy = evaluate(model, test_x, test_y)
                record = {
                    "step": step,
                    "loss": loss_sum / loss_count,
                    "test_accuracy": accuracy,
                    "elapsed_s": time.perf_counter() - start,
                }
                history.append(record)
                logger.info(
                    "step %d: loss %.4f, test accuracy %.4f, %.1f s",
                    step,
                    record["loss"],
                    accuracy,
                    record["elapsed_s"],
                )
                loss_sum, loss_count = 0.0, 0
            bar.set_postfix(
                loss=f"{loss_value:.4f}",
                acc=f"{accuracy:.4f}" if history else "-",
                samples_s=f"{samples / max(train_s, 1e-9):.0f}",
                refresh=False,
            )
    return history
