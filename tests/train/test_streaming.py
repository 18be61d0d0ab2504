"""Users' own files streamed by Ray Data (``dataset.name: image-folder | parquet | text``): the
spec's checks, each source's reader on small generated data, the held-out validation rule, a
worker's position in the stream, the bad-data errors naming the file, a 2-worker job that
checkpoints and resumes in place, and a language model's job and a sweep on streamed data."""

from __future__ import annotations

import io
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from PIL import Image
from pydantic import ValidationError
from support.cli_process import KAISA_RAY, run, user_env
from support.ray_head import RayHead, actors_alive
from support.ray_jobs import records

from kaisa_ray.errors import ConfigurationError
from kaisa_train.data_roots import within
from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR, load_idx_dataset
from kaisa_train.job import run_job
from kaisa_train.records import TrialState
from kaisa_train.spec import DatasetSpec, parse_job_spec
from kaisa_train.state import load_checkpoint_file
from kaisa_train.stream_files import cut_windows
from kaisa_train.stream_read import PARQUET_TASKS, Horizon, ReadParquet, parquet_per_task
from kaisa_train.stream_shard import StreamShard
from kaisa_train.stream_text import TEXT_RUN, held_windows
from kaisa_train.streaming import (
    MIN_BLOCK_BYTES,
    ROWS_PER_BLOCK,
    StreamCounts,
    block_bytes,
    open_stream,
    spare_cpus_message,
)

CLASSES = ("ant", "bee", "cat")


def _png(value: int, size: tuple[int, int] = (8, 6), mode: str = "L") -> bytes:
    channels = {"L": (), "RGB": (3,)}[mode]
    pixels = np.full((*size, *channels), value, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(out, format="PNG")
    return out.getvalue()


def image_folder(root: Path, per_class: int = 4, classes: tuple[str, ...] = CLASSES) -> Path:
    """Class ``k``'s images are all pixel value ``10 * k + i`` (i: the image's index)."""
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            (root / name / f"{i}.png").write_bytes(_png(10 * k + i))
    return root


def parquet_files(root: Path, rows: int = 12, files: int = 2) -> Path:
    root.mkdir(parents=True)
    per = rows // files
    for f in range(files):
        values = range(f * per, (f + 1) * per)
        pq.write_table(
            pa.table(
                {
                    "png": pa.array([_png(v) for v in values], type=pa.binary()),
                    "pixels": pa.array(
                        [np.full(48, v, np.uint8) for v in values], type=pa.list_(pa.uint8())
                    ),
                    "target": pa.array([v % 3 for v in values], type=pa.int64()),
                }
            ),
            root / f"part-{f}.parquet",
        )
    return root


def stream_spec(name: str, train: Path, validation: Path | None, **fields: Any) -> DatasetSpec:
    held = {} if validation is None else {"validation": str(validation)}
    return DatasetSpec(name=name, train=str(train), batch_size=4, **held, **fields)


def token_files(root: Path, rows: int = 6, length: int = 17, files: int = 3) -> Path:
    """Rows of ``length`` token ids: row ``r`` holds ``100 * r + i`` (i: the token's place)."""
    root.mkdir(parents=True)
    per = rows // files
    for f in range(files):
        tokens = [[100 * r + i for i in range(length)] for r in range(f * per, (f + 1) * per)]
        pq.write_table(
            pa.table({"ids": pa.array(tokens, type=pa.list_(pa.int32()))}),
            root / f"part-{f}.parquet",
        )
    return root


def text_folder(root: Path, sizes: tuple[int, ...] = (1000, 333, 2600)) -> Path:
    """``.txt`` files of ``sizes`` bytes, byte ``j`` of a file being ``j % 251`` (and one file
    that is not text, which is not read)."""
    root.mkdir(parents=True)
    for k, size in enumerate(sizes):
        (root / f"{k}.txt").write_bytes(bytes(j % 251 for j in range(size)))
    (root / "notes.md").write_text("not read")
    return root


def windows_of(pipeline: Any) -> np.ndarray:
    return np.concatenate(
        [b["window"] for b in pipeline.iter_batches(batch_size=None, batch_format="numpy")]
    )


def every_row(pipeline: Any) -> tuple[np.ndarray, np.ndarray]:
    batches = list(pipeline.iter_batches(batch_size=None, batch_format="numpy"))
    return np.concatenate([b["x"] for b in batches]), np.concatenate([b["y"] for b in batches])


# -- the spec ----------------------------------------------------------------------------------


def test_a_streamed_dataset_names_both_splits_and_nothing_else_takes_their_fields(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValidationError, match=r"needs dataset\.validation"):
        DatasetSpec(name="parquet", train=str(tmp_path))
    with pytest.raises(ValidationError, match=r"not data_dir"):
        DatasetSpec(name="image-folder", train="s3://b/t", validation="s3://b/v", data_dir=tmp_path)
    with pytest.raises(ValidationError, match=r"dataset\.train: .*missing does not exist"):
        DatasetSpec(name="parquet", train=str(tmp_path / "missing"), validation=str(tmp_path))
    with pytest.raises(ValidationError, match=r"dataset\.train is for the streamed datasets"):
        DatasetSpec(name="synthetic", train=str(tmp_path))
    with pytest.raises(ValidationError, match=r"image\.mean has 2 values for mode L"):
        DatasetSpec(
            name="parquet", train="s3://b/t", validation="s3://b/v", image={"mean": [0.1, 0.2]}
        )
    # A URI is the cluster's to read: nothing here looks at it.
    spec = DatasetSpec(name="parquet", train="s3://bucket/train", validation="gs://b/v")
    assert spec.streamed
    assert not DatasetSpec(name="synthetic").streamed


def test_each_source_takes_its_own_fields_and_one_validation_split(tmp_path: Path) -> None:
    uris = {"train": "s3://b/t", "validation": "s3://b/v"}
    with pytest.raises(ValidationError, match=r"dataset\.context does not apply to 'parquet'"):
        DatasetSpec(name="parquet", context=32, **uris)
    with pytest.raises(ValidationError, match=r"dataset\.image does not apply to 'text'"):
        DatasetSpec(name="text", image={"mode": "RGB"}, **uris)
    with pytest.raises(ValidationError, match=r"dataset\.columns does not apply to 'text'"):
        DatasetSpec(name="text", columns={"tokens": "ids"}, **uris)
    with pytest.raises(ValidationError, match=r"columns\.tokens .* without columns\.input"):
        DatasetSpec(name="parquet", columns={"tokens": "ids", "input": "x"}, **uris)
    with pytest.raises(ValidationError, match=r"both name a validation split: keep one"):
        DatasetSpec(name="text", validation_every=10, **uris)
    with pytest.raises(ValidationError, match=r"or dataset\.validation_every: k"):
        DatasetSpec(name="text", train="s3://b/t")
    tokens = DatasetSpec(
        name="parquet", train="s3://b/t", validation_every=5, columns={"tokens": "ids"}
    )
    assert tokens.sequences
    assert tokens.window == 64
    assert DatasetSpec(name="text", context=128, **uris).window == 128
    assert not DatasetSpec(name="parquet", **uris).sequences


def test_training_blocks_hold_about_a_thousand_rows_where_a_rows_size_is_known() -> None:
    uris = {"train": "s3://b/t", "validation": "s3://b/v"}
    gray = DatasetSpec(name="parquet", image={"size": [28, 28]}, **uris)
    assert block_bytes(gray, 128 << 20) == ROWS_PER_BLOCK * (28 * 28 * 4 + 8)
    rgb = DatasetSpec(name="image-folder", image={"mode": "RGB", "size": [32, 32]}, **uris)
    assert block_bytes(rgb, None) == ROWS_PER_BLOCK * (3 * 32 * 32 * 4 + 8)
    assert block_bytes(DatasetSpec(name="text", **uris), 128 << 20) == MIN_BLOCK_BYTES
    # Rows as large as ImageNet's keep Ray Data's default; images of their own size too.
    big = DatasetSpec(name="image-folder", image={"mode": "RGB", "size": [224, 224]}, **uris)
    assert block_bytes(big, 128 << 20) is None
    assert block_bytes(DatasetSpec(name="image-folder", **uris), 128 << 20) is None


def test_windows_overlap_by_one_and_held_out_runs_are_counted_exactly() -> None:
    cut = cut_windows(np.arange(10), 3)
    assert cut.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert cut_windows(np.arange(3), 3).shape == (0, 4)
    for every in (2, 3, 10):
        for windows in (0, 1, TEXT_RUN - 1, TEXT_RUN * every, 5 * TEXT_RUN * every + 77, 9999):
            runs = np.arange(windows) // TEXT_RUN
            assert held_windows(windows, every) == int((runs % every == every - 1).sum())


def test_a_held_out_split_that_would_be_empty_is_refused(tmp_path: Path) -> None:
    files = parquet_files(tmp_path / "train", files=2)
    with pytest.raises(ConfigurationError, match=r"has 2 file\(s\), so every 3th leaves no"):
        open_stream(stream_spec("parquet", files, None, validation_every=3))
    text = text_folder(tmp_path / "text", sizes=(200,))  # 49 windows: one run
    with pytest.raises(ConfigurationError, match=r"none of them in every 2th run"):
        open_stream(stream_spec("text", text, None, validation_every=2, context=4))
    with pytest.raises(ConfigurationError, match=r"holds no \.txt files"):
        open_stream(stream_spec("text", tmp_path / "train", tmp_path / "train"))


def test_a_service_reads_streamed_data_only_under_its_roots(tmp_path: Path) -> None:
    """Under a service's data roots: another system's URI is refused (the cluster's
    credentials are not the client's), a file:// or local:// URI is a local path, checked."""
    inside = tmp_path / "data"
    train = image_folder(inside / "train")
    with within([inside]):
        with pytest.raises(ValidationError, match=r"s3://b/t is another system's URI, not under"):
            DatasetSpec(name="parquet", train="s3://b/t", validation=f"file://{train}")
        with pytest.raises(ValidationError, match=r"/etc is not under this service's data"):
            DatasetSpec(name="image-folder", train=f"file://{train}", validation="local:///etc")
        spec = DatasetSpec(name="image-folder", train=f"file://{train}", validation=str(train))
    assert spec.train == f"file://{train}"
    assert DatasetSpec(name="parquet", train="s3://b/t", validation="gs://b/v").streamed


def test_a_streamed_job_leaves_ray_data_a_cpu() -> None:
    assert spare_cpus_message(4, 2, 1) is None
    refused = spare_cpus_message(2, 2, 1)
    assert refused is not None
    assert "Lower scaling.cpus_per_worker (e.g. to 0.5)" in refused
    assert spare_cpus_message(3, 1, 1, trials=2) is None
    at_once = spare_cpus_message(2, 1, 1, trials=2)  # each trial alone leaves a CPU: not both
    assert at_once is not None
    assert "all taken by 2 trials at once (sweep.concurrent)" in at_once
    assert "Lower sweep.concurrent (e.g. to 1)" in at_once
    alone = spare_cpus_message(2, 2, 1, trials=2)  # not even one trial fits
    assert alone is not None
    assert "Lower scaling.cpus_per_worker (e.g. to 0.5)" in alone


# -- what the driver checks before anything starts ----------------------------------------------


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("stray", r"loose\.png .*is not in a class subfolder of"),
        ("empty class", r"the class folder .*/dog holds no images"),
        ("no images", r"holds no images"),
        ("unknown class", r"class folders emu of .* are not in the training split"),
    ],
)
def test_an_image_folder_that_cannot_be_a_dataset_is_refused_naming_the_path(
    tmp_path: Path, layout: str, message: str
) -> None:
    train = image_folder(tmp_path / "train")
    validation = image_folder(tmp_path / "validation")
    if layout == "stray":
        (train / "loose.png").write_bytes(_png(1))
    elif layout == "empty class":
        (train / "dog").mkdir()
    elif layout == "no images":
        train = tmp_path / "nothing"
        (train / "a").mkdir(parents=True)
        (train / "a" / "notes.txt").write_text("not an image")
    else:
        image_folder(tmp_path / "emu", per_class=1, classes=("emu",))
        (tmp_path / "emu" / "emu").rename(validation / "emu")
    with pytest.raises(ConfigurationError, match=message):
        open_stream(stream_spec("image-folder", train, validation))


# -- the readers (Ray Data, on the test's Ray head) ---------------------------------------------


@pytest.mark.ray
def test_an_image_folder_is_read_with_its_folders_labels_and_the_specs_normalisation(
    ray_head: RayHead, tmp_path: Path
) -> None:
    train = image_folder(tmp_path / "train")
    validation = image_folder(tmp_path / "validation", per_class=2, classes=("bee",))
    spec = DatasetSpec(  # the training split by a file:// URI, read as its folder
        name="image-folder",
        train=f"file://{train}",
        validation=str(validation),
        batch_size=4,
        image={"mean": [0.5], "std": [0.25]},
    )
    pipelines, counts = open_stream(spec)
    assert counts == StreamCounts(12, 2, CLASSES)
    x, y = every_row(pipelines["train"])
    assert x.shape == (12, 1, 8, 6)
    assert x.dtype == np.float32
    value = (x[:, 0, 0, 0] * 0.25 + 0.5) * 255  # the pixel value, back from the normalisation
    np.testing.assert_allclose(value, np.round(value), atol=1e-3)
    assert sorted(zip(np.round(value).astype(int).tolist(), y.tolist(), strict=True)) == [
        (10 * k + i, k) for k in range(3) for i in range(4)
    ]
    _, y_val = every_row(pipelines["validation"])
    assert y_val.tolist() == [1, 1]  # "bee" is the training split's class 1


@pytest.mark.ray
@pytest.mark.parametrize("column", ["png", "pixels"])
def test_parquet_rows_become_images_from_bytes_or_numbers(
    ray_head: RayHead, tmp_path: Path, column: str
) -> None:
    files = parquet_files(tmp_path / "train")
    spec = stream_spec(
        "parquet",
        files,
        files,
        columns={"input": column, "label": "target"},
        image={"size": [8, 6], "mean": [0.0], "std": [1.0]},
        limit=10,
    )
    readers = footer_readers(ray_head)
    pipelines, counts = open_stream(spec)
    assert counts == StreamCounts(10, 10)
    x, y = every_row(pipelines["validation"])  # in file order (the training split: shuffled)
    assert x.shape == (10, 1, 8, 6)
    np.testing.assert_allclose(x[:, 0, 3, 2] * 255, np.arange(10), atol=1e-4)
    assert y.tolist() == [v % 3 for v in range(10)]
    # A count of these two files takes at most one footer reader, where Ray Data makes 32 new
    # actor processes a listing by default; the executions read the files in their own tasks.
    made = footer_readers(ray_head) - readers
    assert len(made) <= 2, len(made)


def footer_readers(head: RayHead) -> set[str]:
    """The ids of every Parquet footer reader the head has had, alive or ended."""
    from ray.util.state import list_actors

    found = list_actors(
        address=head.dashboard_url,
        filters=[("class_name", "=", "FooterReader")],
        limit=10_000,
        timeout=30,
    )
    return {actor.actor_id for actor in found}


@pytest.mark.ray
def test_an_image_folder_holds_out_every_kth_image_for_validation(
    ray_head: RayHead, tmp_path: Path
) -> None:
    train = image_folder(tmp_path / "train")  # 12 images, ant/0..3, bee/0..3, cat/0..3
    spec = stream_spec(
        "image-folder", train, None, validation_every=4, image={"mean": [0.0], "std": [1.0]}
    )
    pipelines, counts = open_stream(spec)
    assert counts == StreamCounts(9, 3, CLASSES)
    x_val, y_val = every_row(pipelines["validation"])
    x, _ = every_row(pipelines["train"])
    held = np.round(x_val[:, 0, 0, 0] * 255).astype(int).tolist()
    assert held == [3, 13, 23]  # the 4th, 8th and 12th in path order: one per class here
    assert y_val.tolist() == [0, 1, 2]
    kept = sorted(np.round(x[:, 0, 0, 0] * 255).astype(int).tolist())
    assert kept == sorted({10 * k + i for k in range(3) for i in range(4)} - set(held))


@pytest.mark.ray
def test_text_files_become_byte_windows_and_every_kth_run_is_held_out(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """Three files of 1000, 333 and 2600 bytes at context 4: 249 + 83 + 649 windows of 5 bytes,
    numbered in path order; with validation_every=2 every second run of TEXT_RUN windows is
    validation, the rest training, and nothing is in both."""
    text = text_folder(tmp_path / "text")
    whole, counts = open_stream(stream_spec("text", text, text, context=4))
    assert counts == StreamCounts(981, 981)
    every = windows_of(whole["validation"])  # in path order
    assert every.dtype == np.uint8
    assert every.shape == (981, 5)
    assert every[:2].tolist() == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]]
    assert every[249].tolist() == [0, 1, 2, 3, 4]  # the second file's first window
    split, counts = open_stream(stream_spec("text", text, None, context=4, validation_every=2))
    odd = (np.arange(981) // TEXT_RUN) % 2 == 1
    assert counts == StreamCounts(int((~odd).sum()), int(odd.sum()))
    np.testing.assert_array_equal(windows_of(split["validation"]), every[odd])
    train = windows_of(split["train"])  # shuffled
    assert sorted(w.tobytes() for w in train) == sorted(w.tobytes() for w in every[~odd])


@pytest.mark.ray
def test_a_token_column_becomes_windows_of_its_rows_and_bad_rows_name_their_file(
    ray_head: RayHead, tmp_path: Path
) -> None:
    files = token_files(tmp_path / "tokens")  # 6 rows of 17 tokens in 3 files
    spec = stream_spec(
        "parquet", files, None, columns={"tokens": "ids"}, context=8, validation_every=3
    )
    pipelines, counts = open_stream(spec)
    assert counts == StreamCounts(8, 4)  # 2 windows a row; part-2 (rows 4 and 5) held out
    held = windows_of(pipelines["validation"])
    assert held.tolist() == [
        [400 + i for i in range(9)], [408 + i for i in range(9)],
        [500 + i for i in range(9)], [508 + i for i in range(9)],
    ]  # fmt: skip
    vocabulary = stream_spec(
        "parquet", files, files, columns={"tokens": "ids"}, context=8, classes=210
    )
    with pytest.raises(
        Exception,
        match=r"part-1\.parquet: token 210 in column 'ids' is outside the vocabulary \(0 to 209\)",
    ):
        open_stream(vocabulary)  # row 2 (200 to 216) is the first with a token past 209
    table = pq.read_table(files / "part-2.parquet").to_pydict()
    table["ids"][1] = table["ids"][1][:5]
    short = pa.array(table["ids"], type=pa.list_(pa.int32()))
    pq.write_table(pa.table({"ids": short}), files / "part-2.parquet")
    with pytest.raises(
        Exception,
        match=r"part-2\.parquet: a row of column 'ids' .*\(5,\); every row must be a list of 17",
    ):
        open_stream(spec)


@pytest.mark.ray
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("column", r"part-0\.parquet has no column 'png' \(it has .*pixels.*\)"),
        ("corrupt", r"part-1\.parquet: row \d+ of a batch of column 'png' is not a readable"),
        ("label", r"part-1\.parquet: label 7 in column 'target' is outside the classes \(0 to 2"),
    ],
)
def test_bad_parquet_data_is_an_error_naming_the_file_and_the_fix(
    ray_head: RayHead, tmp_path: Path, damage: str, message: str
) -> None:
    files = parquet_files(tmp_path / "train")
    if damage == "column":
        for part in files.iterdir():
            table = pq.read_table(part)
            pq.write_table(table.drop_columns(["png"]), part)
    else:
        table = pq.read_table(files / "part-1.parquet").to_pydict()
        if damage == "corrupt":
            table["png"][2] = b"\x89PNG not really"
        else:
            table["target"][2] = 7
        pq.write_table(pa.table(table), files / "part-1.parquet")
    spec = stream_spec(
        "parquet", files, files, columns={"input": "png", "label": "target"}, classes=3
    )

    def read() -> None:
        pipelines, _ = open_stream(spec)
        every_row(pipelines["validation"])

    # At the start (the column), or in Ray Data's task (its error carries ours).
    with pytest.raises(Exception, match=message):
        read()


@pytest.mark.ray
def test_skipped_records_are_left_out_and_counted_with_their_files(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """bad_records: skip. A Parquet split with an unreadable image and a label outside the
    classes reads its 10 good rows and counts the 2 others, naming part-1.parquet; an image
    folder's unreadable file fails the job naming the file, or is skipped."""
    import ray

    files = parquet_files(tmp_path / "train")
    table = pq.read_table(files / "part-1.parquet").to_pydict()
    table["png"][2] = b"\x89PNG not really"
    table["target"][4] = 7
    pq.write_table(pa.table(table), files / "part-1.parquet")
    columns = {"input": "png", "label": "target"}
    plain = {"mean": [0.0], "std": [1.0]}
    spec = stream_spec(
        "parquet", files, files, columns=columns, classes=3, bad_records="skip", image=plain
    )
    pipelines, counts = open_stream(spec)
    x, _y = every_row(pipelines["validation"])
    assert x.shape == (10, 1, 8, 6)
    assert sorted(np.round(x[:, 0, 0, 0] * 255).astype(int).tolist()) == [
        v for v in range(12) if v not in (8, 10)
    ]
    count, reasons = ray.get(counts.ledger.total.remote())
    assert count == 2
    assert any("part-1.parquet: label 7 in column 'target'" in r for r in reasons)
    unreadable = r"part-1\.parquet: row \d+ of a batch of column 'png' is not a readable image"
    assert any(re.search(unreadable, r) for r in reasons), reasons

    images = image_folder(tmp_path / "images")
    (images / "bee" / "9.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(Exception, match=r"bee/9\.png: the file is not a readable image"):
        open_stream(stream_spec("image-folder", images, images))
    skipping, counts = open_stream(stream_spec("image-folder", images, images, bad_records="skip"))
    assert len(every_row(skipping["validation"])[1]) == 12
    assert ray.get(counts.ledger.total.remote())[0] == 1


# -- a worker's place in the stream (a fake split at the seam) ----------------------------------


class FakeSplit:
    """A split of ``rows`` rows whose batch ``b`` of an iteration holds the values
    ``iteration * 1000 + b``; counts the iterations started."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.iterations = 0

    def iter_torch_batches(self, *, batch_size: int, **_: Any) -> Iterator[dict[str, Any]]:
        self.iterations += 1
        started = self.iterations
        for b in range(self.rows // batch_size):
            yield {"x": torch.full((batch_size,), started * 1000 + b), "y": torch.zeros(1)}


def shard_of(train: FakeSplit, counted: int, epochs: int = 1) -> StreamShard:
    """Worker 0 of 2's shard of ``train``, whose rows the driver counted as ``counted``, read
    ``epochs`` epochs an execution."""
    return StreamShard.open(
        train,  # type: ignore[arg-type]
        FakeSplit(rows=4),  # type: ignore[arg-type]
        StreamCounts(train_rows=counted, validation_rows=8, epochs=epochs),
        batch_size=4,
        seed=0,
        rank=0,
        world=2,
        shuffle_buffer=0,
    )


def test_a_fits_skipped_records_ledger_ends_with_the_fit_even_when_it_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``stream_ended`` kills the ledger the trainer's config carries once the fit inside
    returns or raises; a fit without a ledger (in-memory data, ``bad_records: fail``) kills
    nothing."""
    from types import SimpleNamespace

    from kaisa_train import trainer as trainer_module
    from kaisa_train.streaming import StreamCounts

    killed: list[object] = []
    monkeypatch.setattr(trainer_module.ray, "kill", killed.append)
    ledger = object()
    fit = SimpleNamespace(train_loop_config={"stream": StreamCounts(8, 2, ledger=ledger)})
    with pytest.raises(RuntimeError), trainer_module.stream_ended(fit):  # type: ignore[arg-type]
        raise RuntimeError("the workers failed")
    assert killed == [ledger]
    for config in ({"stream": StreamCounts(8, 2)}, {"stream": None}, None):
        with trainer_module.stream_ended(SimpleNamespace(train_loop_config=config)):  # type: ignore[arg-type]
            pass
    assert killed == [ledger]


def test_a_worker_reads_its_epochs_in_order_and_a_jump_starts_a_fresh_iteration() -> None:
    train = FakeSplit(rows=20)
    shard = shard_of(train, counted=41)
    assert shard.steps_per_epoch == 5  # 41 rows over 2 workers: 20 each, 5 batches of 4
    assert [int(shard.batch(s)[0][0]) for s in range(1, 8)] == [
        1000, 1001, 1002, 1003, 1004,  # epoch 0: one iteration
        2000, 2001,  # epoch 1: the next
    ]  # fmt: skip
    assert shard.position(7) == (1, 1)
    # A resume at step 4 (epoch 0, batch 3): a fresh iteration, read from its start.
    assert int(shard.batch(4)[0][0]) == 3000
    assert int(shard.batch(5)[0][0]) == 3001
    assert int(shard.batch(6)[0][0]) == 4000  # the next epoch begins on time
    assert train.iterations == 4
    assert shard.waited_s > 0
    short = shard_of(FakeSplit(rows=8), counted=40)
    short.batch(1)
    short.batch(2)
    with pytest.raises(ConfigurationError, match="ran out at batch 2 of epoch 0"):
        short.batch(3)
    # bad_records: skip: rows skipped leave the epoch short; it is refilled from its start.
    skipping = shard_of(FakeSplit(rows=8), counted=40)
    skipping.ledger = object()
    assert [int(skipping.batch(s)[0][0]) for s in range(1, 7)] == [
        1000, 1001, 2000, 2001, 3000,  # epoch 0: 2 batches an iteration (8 rows), 3 of them
        4000,  # epoch 1
    ]  # fmt: skip


def test_one_iteration_reads_the_epochs_its_execution_holds_and_a_resume_rejoins_the_epochs() -> (
    None
):
    train = FakeSplit(rows=60)  # 3 epochs of 20 rows (5 batches) a worker, in one execution
    shard = shard_of(train, counted=41, epochs=3)
    assert [int(shard.batch(s)[0][0]) for s in range(1, 17)] == [
        *range(1000, 1015),  # epochs 0-2: one iteration, no new execution at their boundaries
        2000,  # epoch 3: the next execution
    ]
    assert train.iterations == 2
    # A resume at step 7 (epoch 1, batch 1): the rest of epoch 1 from a fresh iteration, then
    # the epochs from epoch 2 on, every row once each, from the next.
    assert [int(shard.batch(s)[0][0]) for s in range(7, 12)] == [3000, 3001, 3002, 3003, 4000]
    assert shard.position(11) == (2, 0)


def test_a_job_reads_its_epochs_in_one_execution() -> None:
    assert Horizon(workers=2, max_steps=1200).epochs(rows=60_000, batch_size=64) == 3
    assert Horizon(workers=2, max_steps=468).epochs(rows=60_000, batch_size=64) == 1
    assert Horizon(workers=2, max_epochs=7).epochs(rows=60_000, batch_size=64) == 7
    assert Horizon(workers=2, max_steps=10).epochs(rows=100, batch_size=64) == 1  # no batch


def test_a_parquet_split_of_many_files_reads_several_a_task_each_once_an_epoch() -> None:
    """At most ``PARQUET_TASKS`` read tasks an epoch (the driver lists one block a task), the
    files shared out so that each epoch reads every file once."""
    assert [parquet_per_task(n) for n in (1, 6, PARQUET_TASKS)] == [1, 1, 1]
    assert parquet_per_task(PARQUET_TASKS + 1) == 2
    assert parquet_per_task(10_000) == 40
    files = tuple(f"part-{i}.parquet" for i in range(1_000))
    read = ReadParquet(files, pyarrow.fs.LocalFileSystem(), "", 3, parquet_per_task(len(files)))
    assert read.tasks() == 250 <= PARQUET_TASKS
    for epoch in (0, 1):
        items = pa.table({"epoch": [epoch] * read.tasks(), "task": list(range(read.tasks()))})
        assert sorted(read.paths(items)) == sorted(files)


@pytest.mark.ray
def test_a_training_pipeline_reads_each_epoch_once_in_a_new_order_drawn_from_the_seed(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """Four epochs of six files in one execution: each epoch every file once, in the orders
    ``epoch_order`` draws from the seed (the same again from the same seed), the validation
    split one epoch in file order; capped at ``max_reads`` read tasks."""
    from kaisa_train.stream_read import MAX_READS, ReadBytes, epoch_order, read_files

    names = []
    for i in range(6):
        (tmp_path / f"{i}.txt").write_text(f"file {i}")
        names.append(str(tmp_path / f"{i}.txt"))
    read = ReadBytes(tuple(names), pyarrow.fs.LocalFileSystem(), "", 7, 2)
    ds, epochs = read_files(read, 4)
    assert epochs == 4
    ds.context.execution_options.preserve_order = True
    rows = [(str(r["path"]), bytes(r["bytes"]).decode()) for r in ds.iter_rows()]
    assert all(data == f"file {path[-5]}" for path, data in rows)
    paths = [p for p, _ in rows]
    assert [paths[e * 6 : e * 6 + 6] for e in range(4)] == [
        [names[i] for i in epoch_order(6, 7, e)] for e in range(4)
    ]
    assert len({tuple(paths[e * 6 : e * 6 + 6]) for e in range(4)}) > 1  # new orders
    assert all(sorted(paths[e * 6 : e * 6 + 6]) == names for e in range(4))
    assert epoch_order(6, 7, 2).tolist() == epoch_order(6, 7, 2).tolist()
    assert epoch_order(6, None, 2).tolist() == list(range(6))
    assert read_files(read, 2 * MAX_READS)[1] == MAX_READS // read.tasks()
    assert read_files(read, 100, max_reads=8)[1] == 2  # 3 tasks an epoch
    assert read_files(read, 100, max_reads=2)[1] == 1  # at least one epoch


# -- a job on Ray Train --------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
)
def test_a_two_worker_job_streams_an_image_folder_and_resumes_at_its_step(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """Fashion-MNIST's first images as a PNG folder (and one broken file, skipped), streamed to
    2 workers: the job learns (its accuracy well above chance), the step records say how long
    the workers waited for data and how many records were skipped, and a run resumed from the
    step-20 checkpoint starts at step 21 in the epoch the checkpoint names."""
    for split, rows in (("train", 1024), ("test", 256)):
        images, labels = load_idx_dataset(None, split, limit=rows, standardize=False)
        pixels = (images.squeeze(1) * 255).round().numpy().astype(np.uint8)
        for i, (image, label) in enumerate(zip(pixels, labels.tolist(), strict=True)):
            folder = tmp_path / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image, mode="L").save(folder / f"{i}.png")
    (tmp_path / "train" / "3" / "broken.png").write_bytes(b"\x89PNG cut short")
    spec = parse_job_spec(
        {
            "name": "streamed",
            "model": {"name": "lenet"},
            "dataset": {
                "name": "image-folder",
                "train": str(tmp_path / "train"),
                "validation": str(tmp_path / "test"),
                "image": {"mean": [0.286], "std": [0.353]},
                "batch_size": 32,
                "shuffle_buffer": 256,
                "bad_records": "skip",
            },
            "optimizer": {"name": "adamw", "lr": 0.008, "weight_decay": 0.0},
            "kfac": {"strategy": "comm-opt", "factor_update_steps": 5, "inv_update_steps": 20},
            "scaling": {"workers": 2, "cpus_per_worker": 1},
            "stop": {"max_steps": 40},
            "eval_every": 20,
            "checkpoint": {"every_steps": 20, "keep": 4},
            "seed": 1,
        }
    )
    result = run_job(spec, storage_path=tmp_path / "a", run_name="streamed", progress=False)
    assert result.succeeded, result.error
    assert result.metrics["step"] == 40
    assert result.metrics["test_accuracy"] > 0.5  # 10 classes: chance is 0.1
    steps = records("streamed", "step")
    assert [r["epoch"] for r in steps] == [0, 1, 1, 2]  # 1024 rows / 2 workers / 32: 16 a epoch
    assert all(r["data_wait_ms"] is not None and r["data_wait_ms"] >= 0 for r in steps)
    assert steps[-1]["skipped_rows"] >= 1  # broken.png, read (and skipped) every epoch
    at_20 = next(r for r in records("streamed", "checkpoint") if r["step"] == 20)
    assert load_checkpoint_file(at_20["path"])["sampler"]["epoch"] == 1  # step 21: epoch 1

    again = run_job(
        spec,
        storage_path=tmp_path / "b",
        run_name="streamed-again",
        resume_from=at_20["path"],
        progress=False,
    )
    assert again.succeeded, again.error
    (start,) = records("streamed-again", "start")
    assert start["from_step"] == 20
    assert [r["step"] for r in records("streamed-again", "step")] == [30, 40]
    assert again.metrics["test_accuracy"] > 0.5
    # Each run's skipped-records ledger ended with its run (this process runs several jobs).
    assert actors_alive(ray_head, "SkipLedger") == 0


@pytest.mark.ray
@pytest.mark.slow
def test_a_sweep_with_kfac_auto_trains_a_language_model_on_streamed_text(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """``kaisa-ray sweep`` (as a user runs it) of 2 trials over a folder of text files, a tenth
    held out by ``validation_every`` (first refused where its trials at once would take every
    CPU): every trial profiles its stream (kfac: auto), trains a
    byte-level transformer on it, and its validation loss ends below uniform over bytes."""
    folder = tmp_path / "text"
    folder.mkdir()
    lines = [
        f"the {w} fox jumps over the lazy dog number {i}.\n"
        for i in range(400)
        for w in ("quick", "slow")
    ]
    for k in range(4):
        (folder / f"{k}.txt").write_text("".join(lines[k * 200 : (k + 1) * 200]))
    config = {
        "name": "streamed-sweep",
        "model": {"name": "char-transformer", "params": {"width": 32, "depth": 1}},
        "dataset": {"name": "text", "train": str(folder), "validation_every": 5, "batch_size": 16},
        "optimizer": {"name": "adamw", "lr": 0.004},
        "kfac": {"strategy": "auto"},
        "scaling": {"workers": 1, "cpus_per_worker": 1},
        "stop": {"max_steps": 20},
        "eval_every": 20,
        "sweep": {
            "space": {"optimizer.lr": {"choice": [0.003, 0.01]}},
            "trials": 2,
            "concurrent": 2,
            "metric": "test_loss",
            "scheduler": "none",
        },
    }
    env = {**user_env(tmp_path / "home"), "RAY_ADDRESS": ray_head.gcs_address}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ray_head.token)
    # Two trials at once of 2 CPUs each would hold the head's 4 and leave Ray Data none (each
    # alone leaves 2): refused before any trial starts, where it used to hang.
    crowded = tmp_path / "crowded.yaml"
    crowded.write_text(yaml.safe_dump({**config, "scaling": {"workers": 1, "cpus_per_worker": 2}}))
    refused = run([KAISA_RAY, "sweep", "--config", str(crowded)], env, tmp_path, 300)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "all taken by 2 trials at once (sweep.concurrent)" in " ".join(refused.stderr.split())
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    args = [KAISA_RAY, "sweep", "--config", str(path), "--run-name", "streamed-sweep"]
    done = run([*args, "--output", "best.yaml"], env, tmp_path, 600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert yaml.safe_load((tmp_path / "best.yaml").read_text())["dataset"]["name"] == "text"
    # Ray Data's INFO lines and its notice about progress bars stay in its log (ray_logs.py)
    assert "Starting execution of Dataset" not in output, output[-4000:]
    assert "Progress bars disabled" not in output, output[-4000:]
    trials = records("streamed-sweep", "trial")
    ended = {r["trial"] for r in trials if r["state"] == TrialState.SUCCEEDED}
    assert len(ended) == 2, output[-3000:]
    losses = {r["trial"]: r["test_loss"] for r in trials if r.get("test_loss") is not None}
    assert set(losses) == ended
    assert all(loss < 5.55 for loss in losses.values()), losses  # uniform over 256 bytes
    # kfac: auto profiled on the stream (one trial at least: the other may find its profile
    # cached) and says what the data holds: 4096 rows (the shuffle window) and 2 batches of
    # 16, at 64 + 64 int64 tokens a row.
    tuners = [records(f"streamed-sweep.{trial}", "tuner")[0] for trial in ended]
    assert all(t["data_window_bytes"] == (4096 + 32) * 128 * 8 for t in tuners)
    profiled = [t for t in tuners if t["cache"] == "miss"]
    assert profiled
    assert all(t["data_ms_per_batch"] >= 0 for t in profiled)


def _fashion_mnist_parquet(root: Path, split: str, rows: int) -> Path:
    """The split's first ``rows`` images as one Parquet file: ``pixels`` (784 raw bytes) and
    ``label``, as ``scripts/fashion_mnist_files.py`` writes them."""
    images, labels = load_idx_dataset(None, split, limit=rows, standardize=False)
    pixels = (images.squeeze(1) * 255).round().numpy().astype(np.uint8).reshape(rows, -1)
    folder = root / split
    folder.mkdir(parents=True)
    table = pa.table(
        {
            "pixels": pa.array(list(pixels), type=pa.list_(pa.uint8())),
            "label": pa.array(labels.numpy(), type=pa.int64()),
        }
    )
    pq.write_table(table, folder / "part-0000.parquet")
    return folder


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
)
def test_every_source_reads_from_s3_as_from_local_files_and_a_job_trains_from_s3(
    ray_head: RayHead, tmp_path: Path
) -> None:
    """The same files on a real S3 server (moto's, on this machine) and on local disk: every
    source, with a named validation split or one held out by ``validation_every``, gives the
    same rows, counts and classes from ``s3://`` URIs as from the local paths, and an unreadable
    Parquet file is refused naming its ``s3://`` URI. Then ``kaisa-ray train`` as a Ray Job
    trains LeNet from Fashion-MNIST Parquet files on S3. The S3 settings reach the job as a
    user's would: the AWS variables in the job's runtime environment."""
    from ray.job_submission import JobStatus, JobSubmissionClient
    from support.s3 import s3_server
    from support.stream_rows import stream_rows

    data = tmp_path / "data"
    image_folder(data / "images" / "train")
    image_folder(data / "images" / "test", per_class=2)
    parquet_files(data / "parquet" / "train")
    parquet_files(data / "parquet" / "held", rows=16, files=4)
    text_folder(data / "text")
    (data / "broken").mkdir()
    (data / "broken" / "part-0.parquet").write_bytes(b"PAR1 cut short")
    pixels = {"input": "pixels", "label": "target"}
    cases: dict[str, dict[str, Any]] = {
        "images": {"name": "image-folder", "train": "images/train", "validation": "images/test"},
        "images held out": {"name": "image-folder", "train": "images/train", "validation_every": 3},
        "parquet": {
            "name": "parquet",
            "train": "parquet/train",
            "validation": "parquet/train/part-1.parquet",
            "columns": pixels,
            "image": {"size": [8, 6], "mean": [0.0], "std": [1.0]},
        },
        "parquet held out": {
            "name": "parquet",
            "train": "parquet/held",
            "validation_every": 2,
            "columns": {"input": "png", "label": "target"},
        },
        "text held out": {"name": "text", "train": "text", "validation_every": 2, "context": 16},
        "text files": {"name": "text", "train": "text/2.txt", "validation": "text/0.txt"},
        "unreadable": {
            "name": "parquet",
            "train": "broken",
            "validation": "broken",
            "columns": pixels,
        },
    }

    def located(base: str) -> dict[str, dict[str, Any]]:
        """The cases with their splits under ``base`` (a local folder or an ``s3://`` URI)."""
        splits = ("train", "validation")
        return {
            name: {
                **fields,
                "batch_size": 4,
                **{key: f"{base}/{fields[key]}" for key in splits if key in fields},
            }
            for name, fields in cases.items()
        }

    local = {name: stream_rows(fields) for name, fields in located(str(data)).items()}
    assert "is not a readable Parquet file" in local["unreadable"]["error"]
    assert local["images"]["classes"] == list(CLASSES)
    assert local["text held out"]["counts"][1] > 0

    with s3_server() as s3:
        base = s3.upload(data, "data")
        (tmp_path / "cases.json").write_text(json.dumps(located(base)))
        fmnist = tmp_path / "fmnist"
        train_uri = s3.upload(_fashion_mnist_parquet(fmnist, "train", 2048), "fmnist/train")
        test_uri = s3.upload(_fashion_mnist_parquet(fmnist, "test", 512), "fmnist/test")
        spec = {
            "name": "from-s3",
            "model": {"name": "lenet"},
            "dataset": {
                "name": "parquet",
                "train": train_uri,
                "validation": test_uri,
                "columns": {"input": "pixels", "label": "label"},
                "image": {"size": [28, 28], "mean": [0.286], "std": [0.353]},
                "batch_size": 64,
            },
            "optimizer": {"name": "adamw", "lr": 0.008, "weight_decay": 0.0},
            "kfac": {"strategy": "comm-opt", "factor_update_steps": 5, "inv_update_steps": 20},
            "scaling": {"workers": 1, "cpus_per_worker": 1},
            "stop": {"max_steps": 40},
            "eval_every": 40,
            "seed": 1,
        }
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
        run_name = f"from-s3-{tmp_path.name}"
        script = Path(__file__).resolve().parents[1] / "support" / "stream_rows.py"
        entrypoint = (
            f"{sys.executable} {script} {tmp_path / 'cases.json'} {tmp_path / 'rows.json'} && "
            f"{KAISA_RAY} train --config={tmp_path / 'job.yaml'} "
            f"--storage-path={tmp_path / 'runs'} --run-name={run_name}"
        )
        client = JobSubmissionClient(ray_head.dashboard_url)
        submission = client.submit_job(entrypoint=entrypoint, runtime_env={"env_vars": s3.env})
        deadline = time.monotonic() + 480
        while not (status := client.get_job_status(submission)).is_terminal():
            assert time.monotonic() < deadline, client.get_job_logs(submission)[-4000:]
            time.sleep(1)
        logs = client.get_job_logs(submission)
        assert status == JobStatus.SUCCEEDED, logs[-4000:]

    remote = json.loads((tmp_path / "rows.json").read_text())
    broken = remote.pop("unreadable")["error"]
    assert "s3://kaisa/data/broken/part-0.parquet is not a readable Parquet file" in broken
    local.pop("unreadable")
    for name, answer in local.items():
        assert remote[name] == answer, name
    (ended,) = records(run_name, "eval")
    assert ended["step"] == 40
    assert ended["test_accuracy"] > 0.5  # 10 classes: chance is 0.1
    assert all(r["data_wait_ms"] is not None for r in records(run_name, "step"))
