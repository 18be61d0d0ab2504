"""The language-model workload: the byte-level corpus, the decoder-only transformer, and a job of
them trained with K-FAC by the worker's own loop (in-process, no Ray)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kaisa_ray import KFACPreconditioner
from kaisa_train.corpus import DEFAULT_FORTUNES_DIR, load_text_corpus, read_corpus
from kaisa_train.datasets import DatasetNotFoundError
from kaisa_train.optimizers import build_optimizer
from kaisa_train.planning import plan_job, request_from_spec
from kaisa_train.records import EvalRecord, Record
from kaisa_train.session import LocalSession
from kaisa_train.spec import JobSpecError, parse_job_spec
from kaisa_train.transformer import CharTransformer
from kaisa_train.worker import train
from kaisa_train.worker_config import TrainConfig


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    (tmp_path / "b-second").write_bytes(bytes(range(65, 91)) * 4)  # 104 bytes
    (tmp_path / "a-first").write_bytes(b"hello world\n" * 3)  # 36 bytes
    (tmp_path / "a-first.dat").write_bytes(b"\x00index")  # fortune's index: skipped
    (tmp_path / "a-first.u8").symlink_to(tmp_path / "a-first")  # a link: skipped
    return tmp_path


def test_the_corpus_is_every_text_file_in_name_order(corpus: Path) -> None:
    assert read_corpus(corpus) == b"hello world\n" * 3 + bytes(range(65, 91)) * 4


def test_windows_are_next_byte_pairs_and_the_splits_never_overlap(corpus: Path) -> None:
    data = read_corpus(corpus)
    x, y = load_text_corpus(corpus, "train", context=8)
    cut = int(len(data) * 0.9)  # 126 bytes of training text: 15 windows of 8 + 1
    assert x.shape == y.shape == (15, 8)
    assert x.dtype == torch.int64
    assert bytes(x.flatten().tolist()) == data[:120]
    assert torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted by one byte
    assert bytes(y.flatten().tolist()) == data[1:121]
    test_x, _ = load_text_corpus(corpus, "test", context=4)
    assert bytes(test_x.flatten().tolist()) == data[cut : cut + 12]
    assert load_text_corpus(corpus, "train", context=8, limit=2)[0].shape == (2, 8)


def test_a_missing_corpus_says_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="apt-get install fortunes"):
        load_text_corpus(tmp_path / "nowhere")
    with pytest.raises(DatasetNotFoundError, match="has no text files"):
        load_text_corpus(tmp_path)
    (tmp_path / "tiny").write_bytes(b"abc")
    with pytest.raises(ValueError, match="less than one window"):
        load_text_corpus(tmp_path, "test", context=8)
    with pytest.raises(ValueError, match="split='valid' is not valid"):
        load_text_corpus(tmp_path, "valid")


def test_the_transformer_is_causal_and_classifies_each_position() -> None:
    torch.manual_seed(0)
    model = CharTransformer(context=16, width=32, depth=2, heads=4).eval()
    tokens = torch.randint(0, 256, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 256, 16)  # (batch, vocabulary, positions): cross_entropy's layout
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    again = model(changed)
    torch.testing.assert_close(again[..., :10], logits[..., :10])  # the past ignores the future
    assert not torch.allclose(again[..., 10:], logits[..., 10:])
    with pytest.raises(ValueError, match="longer than the model's context 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_kfac_preconditions_every_linear_layer_of_the_transformer() -> None:
    model = CharTransformer(context=8, width=16, depth=2, heads=2)
    preconditioner = KFACPreconditioner(model, factor_scale="fisher", loglevel=0)
    names = {layer.name for layer in preconditioner.layers}
    per_block = {"attention.query", "attention.key", "attention.value", "attention.out", "up"}
    expected = {f"blocks.{b}.{n}" for b in range(2) for n in (*per_block, "down")} | {"head"}
    assert names == expected
    tokens = torch.randint(0, 256, (4, 8))
    F.cross_entropy(model(tokens), torch.randint(0, 256, (4, 8))).backward()
    preconditioner.step()  # the rows of every factor are the batch's 32 tokens
    for layer in preconditioner.layers:
        a, g = layer.factors()
        assert torch.isfinite(a).all()
        assert torch.isfinite(g).all()


@pytest.mark.skipif(
    not DEFAULT_FORTUNES_DIR.is_dir(), reason="needs Debian's fortunes (make setup installs it)"
)
@pytest.mark.parametrize("sequence_approx", ["expand", "reduce"])
def test_a_language_model_job_trains_with_kfac_in_the_worker_loop(sequence_approx: str) -> None:
    """Either form of the tokens' factors (``kfac.sequence_approx``) trains the job, and its
    plan request carries the form (``test_plan_shapes.py``: the rows it prices)."""
    spec = parse_job_spec(
        {
            "name": "lm",
            "model": {"name": "char-transformer", "params": {"width": 32, "depth": 1}},
            "dataset": {"name": "fortunes", "batch_size": 16, "limit": 400},
            "optimizer": {"name": "adamw", "lr": 0.004},
            "kfac": {
                "kl_clip": None,
                "factor_update_steps": 2,
                "inv_update_steps": 10,
                "sequence_approx": sequence_approx,
            },
            "stop": {"max_steps": 40, "target": {"metric": "test_loss", "value": 0.1}},
            "eval_every": 20,
            "checkpoint": {"every_steps": 1000},
        }
    )
    records: list[Record] = []
    train(TrainConfig(spec=spec, run="lm", progress_every=20), LocalSession(records.append))
    evals = [r for r in records if isinstance(r, EvalRecord)]
    assert [e.step for e in evals] == [20, 40]
    losses = [e.test_loss for e in evals]
    assert losses[0] is not None
    assert losses[1] is not None
    # per-token loss in nats: below uniform over 256 bytes (5.55) and falling
    assert losses[1] < losses[0] < 5.55
    accuracy = evals[-1].test_accuracy
    assert accuracy is not None
    assert 0.0 < accuracy < 1.0
    request = request_from_spec(spec, hardware="any")
    assert request.sequence_approx == sequence_approx


def test_a_model_param_the_transformer_does_not_take_is_refused() -> None:
    with pytest.raises(JobSpecError, match="width"):
        parse_job_spec(
            {
                "name": "lm",
                "model": {"name": "char-transformer", "params": {"widht": 32}},
                "dataset": {"name": "fortunes"},
                "stop": {"max_steps": 1},
            }
        )


@pytest.mark.skipif(
    not DEFAULT_FORTUNES_DIR.is_dir(), reason="needs Debian's fortunes (make setup installs it)"
)
def test_kfac_embeddings_precondition_both_embeddings_and_the_plan_prices_them() -> None:
    """``kfac.embeddings`` with Adam in the eigenbasis: the token and position embeddings are
    K-FAC layers (their parameters join the directed group, not Adam's own), the job trains,
    and its plan holds the embeddings' factors."""
    spec = parse_job_spec(
        {
            "name": "lm",
            "model": {"name": "char-transformer", "params": {"width": 32, "depth": 1}},
            "dataset": {"name": "fortunes", "batch_size": 16, "limit": 400},
            "optimizer": {"name": "sgd", "lr": 0.004, "momentum": 0.0},
            "kfac": {
                "compute_method": "eigen",
                "scaling": "adam-eigenbasis",
                "factor_update_steps": 1,
                "inv_update_steps": 5,
                "factor_samples": 4,
                "embeddings": True,
            },
            "stop": {"max_steps": 20},
            "eval_every": 20,
            "checkpoint": {"every_steps": 1000},
        }
    )
    kfac = spec.kfac
    assert not isinstance(kfac, str)
    model = CharTransformer(width=32, depth=1)
    optimizer = build_optimizer(spec.optimizer, model.parameters(), model=model, kfac=kfac)
    directed = {id(p) for g in optimizer.param_groups if g["preconditioned"] for p in g["params"]}
    assert id(model.tokens.weight) in directed
    assert id(model.positions.weight) in directed
    assert id(model.norm.weight) not in directed
    records: list[Record] = []
    train(TrainConfig(spec=spec, run="lm", progress_every=20), LocalSession(records.append))
    evals = [r for r in records if isinstance(r, EvalRecord)]
    assert evals[-1].test_loss is not None
    assert evals[-1].test_loss < 5.55  # below uniform over 256 bytes
    request = request_from_spec(spec, hardware="a100-80gb-hdr")
    report = plan_job(request).to_json()
    assert report["inputs"]["embeddings"] is True
    without = plan_job(dataclasses.replace(request, embeddings=False)).to_json()
    assert "embeddings" not in without["inputs"]
    assert report["model"]["kfac_layers"] == without["model"]["kfac_layers"] + 2
