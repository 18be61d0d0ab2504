"""ResNet-50 and BERT-Large as shapes: built on the meta device they hold nothing, K-FAC sees
the layers KAISA's authors preconditioned, and ``plan()``'s per-rank memory equals what the
layer shapes give by hand (pure and fast: no process group, no data)."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

from kaisa_ray.plan import STEP_SCALAR_BYTES, plan
from kaisa_train.registry import model_names
from kaisa_train.shapes import build_on_meta, workload

FLOAT32 = 4


def resident_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def resnet50_shapes() -> dict[str, tuple[int, int]]:
    """(A, G) widths of every K-FAC layer of ResNet-50 v1.5, from the architecture (He et al.
    2016, Table 1): 7×7 stem, bottlenecks 1×1 / 3×3 / 1×1×4 in stages of 3, 4, 6, 3."""
    shapes = {"conv1": (3 * 7 * 7, 64)}
    channels = 64
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for block in range(blocks):
            name = f"layer{stage}.{block}"
            shapes[f"{name}.conv1"] = (channels, width)
            shapes[f"{name}.conv2"] = (width * 9, width)
            shapes[f"{name}.conv3"] = (width, width * 4)
            if block == 0:
                shapes[f"{name}.downsample.0"] = (channels, width * 4)
            channels = width * 4
    shapes["fc"] = (2048 + 1, 1000)  # the classifier has a bias: one more input column
    return shapes


def bert_large_shapes() -> dict[str, tuple[int, int]]:
    """BERT-Large's Linear layers that K-FAC preconditions with KAISA's skip list (no
    embeddings, no masked-LM head): hidden 1024, intermediate 4096, all with biases."""
    shapes = {}
    for i in range(24):
        for part in ("attention.self.query", "attention.self.key", "attention.self.value"):
            shapes[f"encoder.{i}.{part}"] = (1025, 1024)
        shapes[f"encoder.{i}.attention.output.dense"] = (1025, 1024)
        shapes[f"encoder.{i}.intermediate.dense"] = (1025, 4096)
        shapes[f"encoder.{i}.output.dense"] = (4097, 1024)
    shapes["pooler.dense"] = (1025, 1024)
    shapes["cls.seq_relationship"] = (1025, 2)
    return shapes


SHAPES = {"resnet50": resnet50_shapes, "bert-large": bert_large_shapes}


def test_the_large_models_are_registered() -> None:
    assert {"resnet50", "bert-large"} <= set(model_names())


@pytest.mark.parametrize(
    ("name", "params", "parameters"),
    [
        ("resnet50", {}, 25_557_032),  # torchvision's resnet50 has exactly these
        ("bert-large", {"seq_len": 128}, 336_226_108),  # tied decoder counted once
    ],
)
def test_meta_models_allocate_nothing(name: str, params: dict[str, int], parameters: int) -> None:
    workload("lenet", batch_size=2)  # loads the code paths (meta kernels, flop counter) once
    workload("bert-large", batch_size=1, params={"seq_len": 4, "layers": 1, "hidden": 64})
    before = resident_bytes()
    model = build_on_meta(name, params)
    job = workload(name, batch_size=32, params=params)  # builds again and runs a forward
    grown = resident_bytes() - before
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors
    assert all(t.is_meta for t in tensors)
    assert job.parameters == sum(p.numel() for p in model.parameters()) == parameters
    # Real float32 weights alone would take parameters × 4 bytes (102 MB, 1.3 GB), and the
    # activations the forward pass keeps are job.activation_bytes (GBs): none of it exists.
    assert job.activation_bytes > 2 * 2**30
    assert grown < 64 * 2**20, f"building and running {name} on meta grew RSS by {grown} bytes"


@pytest.mark.parametrize("name", ["resnet50", "bert-large"])
def test_kfac_sees_the_layers_of_the_architecture(name: str) -> None:
    job = workload(name, batch_size=2, params={"seq_len": 128} if name == "bert-large" else {})
    found = {layer.name: (layer.a_dim, layer.g_dim) for layer in job.layers}
    assert found == SHAPES[name]()


def test_factor_rows_are_what_each_layer_sees_per_step() -> None:
    resnet = workload("resnet50", batch_size=32)
    rows = dict(zip((layer.name for layer in resnet.layers), resnet.rows, strict=True))
    assert rows["conv1"] == (32 * 112 * 112, 32 * 112 * 112)  # stride 2 on 224×224
    assert rows["layer4.2.conv2"] == (32 * 7 * 7, 32 * 7 * 7)
    assert rows["fc"] == (32, 32)
    reduced = workload("resnet50", batch_size=32, kfac_approx="reduce")
    assert dict(zip((x.name for x in reduced.layers), reduced.rows, strict=True))["conv1"] == (
        32,
        32,
    )
    bert = workload("bert-large", batch_size=4, params={"seq_len": 128})
    rows = dict(zip((layer.name for layer in bert.layers), bert.rows, strict=True))
    # The pooler and the next-sentence head see one token per sample; the rest every token.
    assert rows.pop("pooler.dense") == rows.pop("cls.seq_relationship") == (4, 4)
    assert set(rows.values()) == {(4 * 128, 4 * 128)}
    assert bert.seq_len == 128
    # sequence_approx reduce: a sequence is one row; moved still counts every token
    reduced = workload(
        "bert-large", batch_size=4, params={"seq_len": 128}, sequence_approx="reduce"
    )
    assert set(reduced.rows) == {(4, 4)}
    assert reduced.sequence_approx == "reduce"
    assert all(m[0] >= 4 * 128 for m in reduced.moved)


def decomposition_bytes(a: int, g: int) -> int:
    """Eigen method: Q_A, λ_A, Q_G, λ_G and the g × a table of eigenvalue products."""
    return FLOAT32 * (a * a + a + g * g + g + g * a)


@pytest.mark.parametrize("name", ["resnet50", "bert-large"])
@pytest.mark.parametrize("world", [8, 64, 256])
def test_plan_memory_per_rank_equals_the_shapes(name: str, world: int) -> None:
    shapes = SHAPES[name]()
    factors = sum(FLOAT32 * (a * a + g * g) for a, g in shapes.values())
    every_decomposition = sum(decomposition_bytes(a, g) for a, g in shapes.values())
    layers = workload(name, batch_size=1, params={"seq_len": 8} if name == "bert-large" else {})
    for fraction in (1.0, 0.5, 0.125, 1 / world):
        ranks = plan(list(layers.layers), world, fraction).ranks
        holders = round(fraction * world)
        for rank in ranks:
            assert rank.memory["factors"] == factors  # every rank keeps every running factor
            # and a buffer of the same size, and the step's two device scalars
            assert rank.memory["buffers"] == factors + STEP_SCALAR_BYTES
            assert rank.memory["total"] == sum(
                rank.memory[k] for k in ("factors", "decompositions", "buffers")
            )
        # Each layer's decomposition lives on f·W ranks: f·W copies of all of them in total.
        assert sum(r.memory["decompositions"] for r in ranks) == holders * every_decomposition
        worst = max(r.memory["decompositions"] for r in ranks)
        if fraction == 1.0:
            assert {r.memory["decompositions"] for r in ranks} == {every_decomposition}
        else:
            assert every_decomposition * holders / world <= worst < every_decomposition


def test_the_figures_the_readme_states() -> None:
    """docs/planning.md's table of fp32 K-FAC state per rank comes from these numbers."""
    resnet = sum(FLOAT32 * (a * a + g * g) for a, g in resnet50_shapes().values())
    bert = sum(FLOAT32 * (a * a + g * g) for a, g in bert_large_shapes().values())
    assert round(resnet / 2**20, 1) == 586.9
    assert round(bert / 2**30, 2) == 3.95


def test_bert_refuses_images_saying_what_it_takes() -> None:
    with torch.device("meta"):
        model = build_on_meta("bert-large", {"seq_len": 8})
        with pytest.raises(TypeError, match="integer token ids"):
            model(torch.empty(2, 1, 28, 28))


def test_a_model_without_an_input_shape_cannot_be_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    from kaisa_ray.errors import ConfigurationError
    from kaisa_train import registry

    monkeypatch.setitem(registry.BUILTIN_MODELS, "bare", lambda: torch.nn.Linear(4, 2))
    with pytest.raises(ConfigurationError, match="example_input"):
        workload("bare", batch_size=2)
