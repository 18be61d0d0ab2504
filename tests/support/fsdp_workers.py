"""Workers for the FSDP2 tests (``run_distributed`` spawns them: module-level functions)."""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.errors import ConfigurationError


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    steps: range,
    preconditioner: KFACPreconditioner | None = None,
) -> None:
    for step in steps:
        x, y = _data(step, 0, rank)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if preconditioner is not None:
            preconditioner.step()
        optimizer.step()


def _data(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 5, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def _shard(model: nn.Sequential) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)


def sharded_after_build(rank: int, world_size: int) -> tuple[str, float]:
    """A model sharded after its preconditioner was built, against one sharded before: the
    plan's parallelism, and the largest difference of their parameters after 4 steps."""
    before, after = _model(), _model()
    _shard(before)
    first = KFACPreconditioner(before, factor_update_steps=1, inv_update_steps=2)
    second = KFACPreconditioner(after, factor_update_steps=1, inv_update_steps=2)
    _shard(after)
    _train(before, torch.optim.SGD(before.parameters(), lr=0.1), rank, range(4), first)
    _train(after, torch.optim.SGD(after.parameters(), lr=0.1), rank, range(4), second)
    difference = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()  # type: ignore[operator]
        for a, b in zip(before.parameters(), after.parameters(), strict=True)
    )
    return str(second.plan.options.parallel), difference


def partly_sharded(rank: int, world_size: int) -> str:
    """What the preconditioner says of a model whose first K-FAC layer is sharded and whose
    second is not."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model[0])
    try:
        KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    except ConfigurationError as err:
        return str(err)
    return "no error"


def sharded_embeddings(rank: int, world_size: int) -> str:
    """What the preconditioner says of ``embeddings=True`` on a model whose K-FAC layers, an
    embedding among them, are all sharded."""
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Embedding(8, 4), nn.Flatten(), nn.Linear(4 * 3, 2))
    fully_shard(model[0])
    fully_shard(model[2])
    try:
        KFACPreconditioner(model, embeddings=True)
    except ConfigurationError as err:
        return str(err)
    return "no error"


def checkpoint_round_trip(rank: int, world_size: int) -> dict[str, object]:
    """A sharded model with Adam: 3 steps, its state saved whole (as a job's checkpoint
    holds it), loaded into a second sharded model and Adam; both take 2 more steps. Returns
    whether they ended equal, and whether a plain model and Adam load the saved state."""
    from types import SimpleNamespace

    from kaisa_ray.sharding import shard_layers
    from kaisa_train.state import _load_whole_states, _whole_states

    def built() -> tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner]:
        model = _model()
        shard_layers(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, optimizer, KFACPreconditioner(model, factor_update_steps=1)

    first, first_optimizer, _ = built()
    _train(first, first_optimizer, rank, range(3))
    saved = SimpleNamespace(model=first, optimizer=first_optimizer, sharded=True)
    written = io.BytesIO()  # as a checkpoint file holds it (nothing shared with the first)
    torch.save(_whole_states(saved), written)  # type: ignore[arg-type]
    written.seek(0)
    model_state, optimizer_state = torch.load(written, weights_only=True)
    second, second_optimizer, _ = built()
    loaded = SimpleNamespace(model=second, optimizer=second_optimizer, sharded=True)
    _load_whole_states(loaded, model_state, optimizer_state)  # type: ignore[arg-type]
    _train(first, first_optimizer, rank, range(3, 5))
    _train(second, second_optimizer, rank, range(3, 5))
    equal = all(
        torch.equal(a.full_tensor(), b.full_tensor())  # type: ignore[operator]
        for a, b in zip(first.parameters(), second.parameters(), strict=True)
    )
    plain = _model()
    plain.load_state_dict(model_state)
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    plain_optimizer.load_state_dict(optimizer_state)
    moments = [s["exp_avg"] for s in plain_optimizer.state.values()]
    return {
        "equal": equal,
        "plain_types": sorted({type(t).__name__ for t in model_state.values()}),
        "moments": [tuple(m.shape) for m in moments],
    }


def accumulated(rank: int, world_size: int, strategy: str) -> float:
    """Two micro-batches a step (FSDP2's ``set_requires_gradient_sync``, DDP's ``no_sync``),
    K-FAC with ``accumulation_steps=2`` under ``strategy``: the largest relative difference
    of the sharded model's parameters from DDP's after 4 steps."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel

    from kaisa_ray.sharding import shard_layers

    ended = {}
    for fsdp in (False, True):
        model = _model()
        net: nn.Module = model
        if fsdp:
            shard_layers(model)
        else:
            net = DistributedDataParallel(model)
        preconditioner = KFACPreconditioner(
            net,
            factor_update_steps=1,
            inv_update_steps=2,
            accumulation_steps=2,
            grad_worker_fraction=strategy,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            optimizer.zero_grad()
            for micro in range(2):
                last = micro == 1
                if fsdp:
                    model.set_requires_gradient_sync(last)  # type: ignore[operator]
                quiet = contextlib.nullcontext() if fsdp or last else net.no_sync()  # type: ignore[operator]
                with quiet:
                    x, y = _data(step, micro, rank)
                    (F.cross_entropy(net(x), y) / 2).backward()
            preconditioner.step()
            optimizer.step()
        ended[fsdp] = [
            (p.full_tensor() if fsdp else p).detach().clone()  # type: ignore[operator]
            for p in model.parameters()
        ]
    return max(
        ((a - b).abs().max() / a.abs().max()).item()
        for a, b in zip(ended[False], ended[True], strict=True)
    )


def bf16_parameters(rank: int, world_size: int, strategy: str) -> dict[str, object]:
    """FSDP2's ``MixedPrecisionPolicy`` (bf16 parameters in forward and backward, fp32
    gradient reduction) against fp32, K-FAC under ``strategy`` on both: the losses of 6
    steps, the gradients' dtype K-FAC preconditioned, and the factors' dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    said: dict[str, object] = {}
    for name, policy in (
        ("fp32", MixedPrecisionPolicy()),
        ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    ):
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        preconditioner = KFACPreconditioner(
            model, factor_update_steps=1, inv_update_steps=2, grad_worker_fraction=strategy
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(6):
            x, y = _data(step, 0, rank)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            said[f"{name}_grad_dtype"] = str(model[0].weight.grad.dtype)  # type: ignore[union-attr]
            preconditioner.step()
            optimizer.step()
            losses.append(loss.item())
        said[f"{name}_losses"] = losses
        said[f"{name}_factor_dtype"] = str(preconditioner.layers[0].a_factor.dtype)  # type: ignore[union-attr]
    return said


def hybrid_sharded(rank: int, world_size: int) -> str:
    """What the preconditioner says of a model sharded over a 2-D mesh (HSDP: replicated over
    one dimension, sharded over the other)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    try:
        KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    except ConfigurationError as err:
        return str(err)
    return "no error"


def profiled(rank: int, world_size: int) -> object:
    """``kfac: auto``'s profile (``tuner.profile.profile_job``) of a LeNet sharded as a job
    shards it (``shard_layers``), with AdamW, on random batches."""
    from kaisa_ray.sharding import shard_layers
    from kaisa_train.models import LeNetCNN
    from tuner.profile import profile_job

    torch.manual_seed(0)
    model = LeNetCNN()
    shard_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(32, 1, 28, 28, generator=generator), torch.randint(0, 10, (32,)))
        for _ in range(4)
    ]
    before = [p.full_tensor().clone() for p in model.parameters()]  # type: ignore[operator]
    result = profile_job(
        model, optimizer, lambda i: batches[i % 4], F.cross_entropy, torch.device("cpu"), steps=2
    )
    after = [p.full_tensor() for p in model.parameters()]  # type: ignore[operator]
    restored = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return result.profile, restored


def by_units(rank: int, world_size: int) -> dict[str, object]:
    """A model of two blocks (a Linear and a ReLU, a Linear) sharded as a job shards it under
    each ``ShardUnits``, K-FAC under MEM-OPT: how many units FSDP2 made, and the largest
    relative difference of the parameters from DDP's after 4 steps."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from kaisa_ray.sharding import shard_layers

    def built() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(nn.Linear(5, 7), nn.ReLU()), nn.Linear(7, 3))

    def trained(model: nn.Module, net: nn.Module) -> list[torch.Tensor]:
        preconditioner = KFACPreconditioner(
            net, factor_update_steps=1, inv_update_steps=2, grad_worker_fraction="mem-opt"
        )
        _train(net, torch.optim.SGD(model.parameters(), lr=0.1), rank, range(4), preconditioner)
        return [
            getattr(p, "full_tensor", lambda p=p: p)().detach().clone() for p in model.parameters()
        ]

    plain = built()
    expected = trained(plain, DistributedDataParallel(plain))
    said: dict[str, object] = {}
    for units in ("layers", "blocks", "model"):
        model = built()
        shard_layers(model, units)
        said[f"{units}_units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
        ended = trained(model, model)
        said[f"{units}_difference"] = max(
            ((a - b).abs().max() / b.abs().max()).item()
            for a, b in zip(ended, expected, strict=True)
        )
    return said


def job_in_bf16(rank: int, world_size: int) -> dict[str, object]:
    """A sharded job's worker (``Training.build``, ``scaling.parallel: fsdp``) with
    ``precision: bf16`` and MEM-OPT: three of its training steps (``worker._train_step``).
    What dtype the layers computed in, the dtypes of the shards, their gradients and K-FAC's
    factors, and the losses."""
    from kaisa_train.spec import parse_job_spec
    from kaisa_train.training import Training
    from kaisa_train.worker import Window, _train_step

    spec = parse_job_spec(
        {
            "name": "bf16",
            "model": {"name": "lenet"},
            "dataset": {"name": "fashion-mnist", "batch_size": 16, "limit": 256},
            "optimizer": {"name": "adamw", "lr": 0.001},
            "kfac": {"strategy": "mem-opt", "factor_update_steps": 1, "inv_update_steps": 2},
            "scaling": {"workers": 2, "parallel": "fsdp"},
            "precision": "bf16",
            "stop": {"max_steps": 3},
        }
    )
    training = Training.build(spec, rank=rank, world=world_size, device=torch.device("cpu"))
    seen: set[str] = set()
    layer = training.model.fc1  # type: ignore[union-attr]
    layer.register_forward_hook(lambda m, i, o: seen.add(str(o.dtype)))  # what it computed in
    window = Window()
    losses = []
    for step in range(1, 4):  # a job's steps count from 1
        _train_step(training, nn.CrossEntropyLoss(), step, window)
        losses.append(window.loss)
    assert training.preconditioner is not None
    return {
        "computed": sorted(seen),
        "shard": str(layer.weight.dtype),
        "grad": str(layer.weight.grad.dtype),
        "factor": str(training.preconditioner.layers[2].a_factor.dtype),  # type: ignore[union-attr]
        "rows_mode": type(training.preconditioner._sharding.keeper).__name__,
        "losses": losses,
    }
