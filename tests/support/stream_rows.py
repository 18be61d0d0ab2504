"""What a streamed dataset's two pipelines hold, in an order-free form that two runs (one from
local files, one from the same files on S3) can be compared by; run as a script, it does so
for the datasets named in a JSON file (``{case: DatasetSpec fields}``) and writes the answers
as JSON (a case whose data is refused: its error's message).

    python tests/support/stream_rows.py CASES.json OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["rows_of", "stream_rows"]


def rows_of(pipeline: Any) -> list[list[float]]:
    """Every row of ``pipeline``, each as its label (or nothing, for windows) and its values
    rounded, sorted: the training split is shuffled, so only the set of rows is the data's."""
    import numpy as np

    rows: list[list[float]] = []
    for batch in pipeline.iter_batches(batch_size=None, batch_format="numpy"):
        if "window" in batch:
            rows += [list(map(float, w)) for w in batch["window"]]
            continue
        x = np.asarray(batch["x"], np.float64).reshape(len(batch["y"]), -1)
        rows += [[float(y), *np.round(v, 4).tolist()] for y, v in zip(batch["y"], x, strict=True)]
    return sorted(rows)


def stream_rows(fields: dict[str, Any]) -> dict[str, Any]:
    """The counts and rows of both splits of the streamed dataset ``fields``, or its error."""
    from kaisa_ray.errors import ConfigurationError
    from kaisa_train.spec import DatasetSpec
    from kaisa_train.streaming import open_stream

    try:
        pipelines, counts = open_stream(DatasetSpec(**fields))
    except ConfigurationError as err:
        return {"error": str(err)}
    return {
        "counts": [counts.train_rows, counts.validation_rows],
        "classes": list(counts.classes or ()),
        "train": rows_of(pipelines["train"]),
        "validation": rows_of(pipelines["validation"]),
    }


def main() -> None:
    import ray

    cases = json.loads(Path(sys.argv[1]).read_text())
    ray.init()  # the cluster this Ray Job runs on
    answers = {name: stream_rows(fields) for name, fields in cases.items()}
    Path(sys.argv[2]).write_text(json.dumps(answers))


if __name__ == "__main__":
    main()
