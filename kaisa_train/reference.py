"""``docs/jobspec.md``, the JobSpec reference, generated from the schema itself.

Every field of ``JobSpec`` (nested sections included), with its type, its bounds and why
they are there (``spec.LIMITS``), its default and an example. Regenerate after changing the
spec (a test fails while the file is stale)::

    .venv/bin/python -m kaisa_train.reference --write
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

from kaisa_train.spec import LIMITS, REFERENCE, JobSpec
from kaisa_train.stream_sources import ImageMode, StreamSource

DOC = Path(__file__).resolve().parents[1] / REFERENCE
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fashion_mnist.yaml"

_BOUND_WORDS = {
    "minimum": ">=",
    "exclusiveMinimum": ">",
    "maximum": "<=",
    "exclusiveMaximum": "<",
    "minLength": "length >=",
    "maxLength": "length <=",
    "minItems": "items >=",
    "maxItems": "items <=",
    "minProperties": "entries >=",
    "maxProperties": "entries <=",
    "pattern": "matches",
}


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return dict(defs[ref.rsplit("/", 1)[1]])
    return schema


def _type(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    schema = _resolve(schema, defs)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_type(option, defs) for option in schema[key])
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return " or ".join(json.dumps(v) for v in schema["enum"])
    if "properties" in schema:
        return "section"
    kind = schema.get("type")
    if kind == "array":
        if "prefixItems" in schema:
            return "[" + ", ".join(_type(i, defs) for i in schema["prefixItems"]) + "]"
        return f"list of {_type(schema.get('items', {}), defs)}"
    if kind == "object" and "additionalProperties" in schema:
        values = schema["additionalProperties"]
        return f"map of {_type(values, defs) if isinstance(values, dict) else 'any'}"
    if kind is None:
        return "any"
    return str(kind)


def _bounds(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    schema = _resolve(schema, defs)
    found = [f"{word} {schema[key]}" for key, word in _BOUND_WORDS.items() if key in schema]
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key, []):
            inner = _bounds(option, defs)
            if inner:
                found.append(inner)
    if schema.get("type") == "array":
        items = schema.get("items")
        if isinstance(items, dict) and _bounds(items, defs):
            found.append(f"each {_bounds(items, defs)}")
        for item in schema.get("prefixItems", []):
            if _bounds(item, defs):
                found.append(f"each {_bounds(item, defs)}")
                break
    if schema.get("type") == "number":
        found.append("finite")
    return ", ".join(dict.fromkeys(found))


def _section(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any] | None:
    """The nested section (a model's schema) a field holds, if any."""
    schema = _resolve(schema, defs)
    if "properties" in schema:
        return schema
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key, []):
            found = _section(option, defs)
            if found is not None:
                return found
    values = schema.get("additionalProperties")
    if isinstance(values, dict):
        found = _section(values, defs)
        if found is not None:
            return {**found, "_map": True}
    return None


def _rows(
    schema: dict[str, Any], defs: dict[str, Any], prefix: str, example: Any
) -> list[list[str]]:
    rows = []
    required = set(schema.get("required", []))
    for name, field in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        shown = _resolve(field, defs)
        default = "(required)" if name in required else json.dumps(field.get("default"))
        if _section(field, defs) is not None and name not in required:
            default = "its fields' defaults" if field.get("default") is not None else "null"
        sample = example.get(name) if isinstance(example, dict) else None
        inner = _section(field, defs)
        description = " ".join(
            str(field.get("description") or shown.get("description") or "").split()
        )
        key = path.replace("sweep.space.<field>", "sweep.space.*")
        reason = LIMITS.get(key)
        notes = "; ".join(part for part in (description, reason and f"bound: {reason}") if part)
        rows.append(
            [
                f"`{path}`",
                _type(field, defs),
                _bounds(field, defs) or "-",
                default if default != "null" else "null",
                json.dumps(sample) if sample is not None and inner is None else "-",
                notes or "-",
            ]
        )
        if inner is not None:
            nested = f"{path}.<field>." if inner.get("_map") else f"{path}."
            rows += _rows(inner, defs, nested, sample if isinstance(sample, dict) else None)
    return rows


STARTER = {"name": "my-kfac-job", "stop.max_steps": 1000}
"""What a new job's form starts from where the JobSpec has no default (its name and its
length are the user's to give): an example, never applied to a spec."""


def field_defaults() -> dict[str, Any]:
    """The JobSpec's default of every field that has one (not null), by dotted name
    (``optimizer.lr``), read from its JSON schema: what a client pre-fills a form with, and
    the ``example`` command's defaults."""
    return dict(_field_defaults())


@functools.cache
def _field_defaults() -> dict[str, Any]:
    schema = JobSpec.model_json_schema()
    defs = schema.get("$defs", {})
    found: dict[str, Any] = {}

    def walk(section: dict[str, Any], prefix: str) -> None:
        for name, field in section.get("properties", {}).items():
            inner = _section(field, defs)
            if inner is not None and not inner.get("_map"):
                walk(inner, f"{prefix}{name}.")
            elif field.get("default") is not None:
                found[f"{prefix}{name}"] = field["default"]

    walk(schema, "")
    return found


def render() -> str:
    """The reference as Markdown."""
    import yaml

    schema = JobSpec.model_json_schema()
    defs = schema.get("$defs", {})
    example = yaml.safe_load(EXAMPLE.read_text())
    lines = [
        "# The JobSpec reference",
        "",
        "<!-- Generated by `python -m kaisa_train.reference --write` from the JobSpec "
        "schema (kaisa_train/spec.py); `test_the_jobspec_reference_is_current` "
        "(tests/service/test_service_abuse.py) fails while it is stale. Do not edit by hand. -->",
        "",
        "A job, as a YAML or JSON file (`kaisa-ray train --config`, `kaisa-ray submit`) or the "
        "body of `POST /v1/jobs` (JSON, or YAML with `Content-Type: application/yaml`). Unknown "
        "fields are refused (with the closest known name); every number is bounded, and floats "
        "must be finite. Examples are from "
        "[examples/fashion_mnist.yaml](../examples/fashion_mnist.yaml). `model.params` are the "
        "keyword arguments of the model's constructor, checked against its signature; a "
        "boolean is refused where a number belongs.",
        "",
        "On the job service (`kaisa-ray serve`), a job is also held to the service's own caps, "
        "and a sweep's every trial with its search space applied: workers and GPUs per job, "
        "CPUs per worker at least, the model's parameters and activations (computed on the "
        "meta device), and its predicted memory within the cluster's; and "
        "`dataset.data_dir` must be under the service's data roots (`--data-root`). "
        "[docs/service.md](service.md#caps-that-hold-on-every-path) lists them. "
        "`kaisa-ray train` and `ray job submit` apply only the bounds below.",
        "",
        "| field | type | bounds | default | example | notes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in _rows(schema, defs, "", example):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    lines += _stream_examples()
    return "\n".join(lines) + "\n"


STREAM_EXAMPLES: dict[str, tuple[str, dict[str, Any]]] = {
    StreamSource.IMAGE_FOLDER.value: (
        "An image folder (one subfolder per class), its own validation folder:",
        {
            "name": StreamSource.IMAGE_FOLDER.value,
            "train": "s3://bucket/imagenet/train",
            "validation": "s3://bucket/imagenet/val",
            "image": {
                "mode": ImageMode.RGB.value,
                "size": [224, 224],
                "mean": [0.485, 0.456, 0.406],
                "std": [0.229, 0.224, 0.225],
            },
            "batch_size": 64,
        },
    ),
    StreamSource.PARQUET.value: (
        "Parquet files of encoded images and labels, every 10th file held out for validation:",
        {
            "name": StreamSource.PARQUET.value,
            "train": "s3://bucket/fashion-mnist/parquet",
            "validation_every": 10,
            "columns": {"input": "image", "label": "label"},
            "image": {"mode": ImageMode.GRAY.value, "mean": [0.286], "std": [0.353]},
            "classes": 10,
        },
    ),
    "parquet (tokens)": (
        "Parquet files of a tokenised corpus (every row as many token ids), cut into windows "
        "of 257 tokens (256 inputs, each one's next token its target):",
        {
            "name": StreamSource.PARQUET.value,
            "train": "s3://bucket/corpus/train",
            "validation": "s3://bucket/corpus/validation",
            "columns": {"tokens": "input_ids"},
            "context": 256,
            "classes": 50257,
            "batch_size": 16,
        },
    ),
    StreamSource.TEXT.value: (
        "Text files (`*.txt`) cut into windows of 65 bytes (a byte-level model's 64 inputs "
        "and their next bytes), every 20th run of windows held out for validation:",
        {
            "name": StreamSource.TEXT.value,
            "train": "s3://bucket/books",
            "validation_every": 20,
            "context": 64,
            "batch_size": 32,
        },
    ),
}
"""One ``dataset`` section per streamed source (URIs: nothing here looks at them), each
checked by the JobSpec when the reference is rendered."""


def _stream_examples() -> list[str]:
    import yaml

    from kaisa_train.spec import DatasetSpec

    lines = [
        "",
        "## Streamed datasets: an example per source",
        "",
        "Your own files, read by Ray Data ([data.md](data.md)):",
    ]
    for title, (text, dataset) in STREAM_EXAMPLES.items():
        DatasetSpec.model_validate(dataset)  # a stale example fails the reference's test
        body = yaml.safe_dump({"dataset": dataset}, sort_keys=False, default_flow_style=False)
        lines += ["", f"**{title}.** {text}", "", "```yaml", body.rstrip(), "```"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC}")
    args = parser.parse_args()
    text = render()
    if args.write:
        DOC.write_text(text)
        sys.stdout.write(f"wrote {DOC}\n")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
