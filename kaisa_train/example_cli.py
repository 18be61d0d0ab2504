"""The ``kaisa-ray example`` command: the example training run (LeNetCNN on Fashion-MNIST in
this process, K-FAC unless ``--no-kfac``), with every setting a flag, each defaulting to the
JobSpec's. Torch is imported when the example runs, not for ``--help``.
"""

from __future__ import annotations

from pathlib import Path

import click

from kaisa_ray.enums import EvalMetric, KFACApprox
from kaisa_train.reference import field_defaults

DEFAULTS = field_defaults()

__all__ = ["example"]


@click.command()
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=500,
    show_default=True,
    help="Optimizer steps (mini-batches) to train for.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=DEFAULTS["dataset.batch_size"],
    show_default=True,
    help="Training mini-batch size.",
)
@click.option(
    "--kfac/--no-kfac",
    default=True,
    show_default=True,
    help="Precondition SGD with K-FAC, or train with plain SGD.",
)
@click.option(
    "--factor-update-steps",
    type=click.IntRange(min=1),
    default=DEFAULTS["kfac.factor_update_steps"],
    show_default=True,
    help="K-FAC: steps between Kronecker factor updates.",
)
@click.option(
    "--inv-update-steps",
    type=click.IntRange(min=1),
    default=DEFAULTS["kfac.inv_update_steps"],
    show_default=True,
    help="K-FAC: steps between factor inverse updates.",
)
@click.option(
    "--damping",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULTS["kfac.damping"],
    show_default=True,
    help="K-FAC: Tikhonov damping.",
)
@click.option(
    "--kfac-approx",
    type=click.Choice([m.value for m in KFACApprox]),
    default=DEFAULTS["kfac.kfac_approx"],
    show_default=True,
    help="K-FAC: Conv2d factors over every position (expand) or position means (reduce).",
)
@click.option(
    "--kl-clip",
    type=click.FloatRange(min=0),
    default=DEFAULTS["kfac.kl_clip"],
    show_default=True,
    help="K-FAC: KL-clipping bound; 0 disables clipping.",
)
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULTS["optimizer.lr"],
    show_default=True,
    help="SGD learning rate (K-FAC's KL clip uses it too).",
)
@click.option(
    "--momentum",
    type=click.FloatRange(min=0),
    default=DEFAULTS["optimizer.momentum"],
    show_default=True,
    help="SGD (Nesterov) momentum.",
)
@click.option(
    "--eval-every",
    type=click.IntRange(min=1),
    default=DEFAULTS["eval_every"],
    show_default=True,
    help="Steps between full test-set evaluations.",
)
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Directory with the Fashion-MNIST IDX files "
    "[default: Debian's dataset-fashion-mnist location].",
)
@click.option("--seed", type=int, default=DEFAULTS["seed"], show_default=True, help="Random seed.")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Torch intra-op threads [default: torch's choice].",
)
@click.option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="Show a progress bar on stderr.",
)
def example(
    *,
    steps: int,
    batch_size: int,
    kfac: bool,
    factor_update_steps: int,
    inv_update_steps: int,
    damping: float,
    kfac_approx: str,
    kl_clip: float,
    lr: float,
    momentum: float,
    eval_every: int,
    data_dir: Path | None,
    seed: int,
    threads: int | None,
    progress: bool,
) -> None:
    """Train LeNetCNN on Fashion-MNIST with SGD, K-FAC preconditioned unless --no-kfac."""
    from kaisa_train.datasets import DatasetNotFoundError, IDXFormatError
    from kaisa_train.example import run_example

    try:
        history = run_example(
            steps=steps,
            batch_size=batch_size,
            kfac=kfac,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            kl_clip=kl_clip if kl_clip > 0 else None,
            lr=lr,
            kfac_approx=kfac_approx,
            momentum=momentum,
            eval_every=eval_every,
            seed=seed,
            data_dir=data_dir,
            threads=threads,
            progress=progress,
        )
    except (DatasetNotFoundError, IDXFormatError) as err:
        raise click.ClickException(str(err)) from err
    final = history[-1]
    click.echo(
        f"{'K-FAC' if kfac else 'SGD'}: final test accuracy {final[EvalMetric.TEST_ACCURACY]:.4f} "
        f"after {final['step']} steps in {final['elapsed_s']:.1f} s"
    )
