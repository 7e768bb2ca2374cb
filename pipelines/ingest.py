"""Stage 1, ingest: raw records -> canonical documents (id, text, source, metadata).

Raw records come from JSONL/Parquet files or Hugging Face datasets. Text is normalized
(``pipelines.text.normalize_text``); records without an id get a stable one derived from their
source and text; fields other than id/text/source/metadata are kept under ``metadata``, with
values JSON lacks (timestamps, bytes, decimals, NumPy values) converted by
``pipelines.documents.json_safe`` (a record holding a value it cannot convert is dropped as
``unrepresentable_metadata``).
Duplicate ids keep one record (deterministically) and dead-letter the rest.

    python -m pipelines.ingest --input 'data/raw/*.jsonl.gz' --output out/ingest \\
        --config '{"source": "web"}'
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import apache_beam as beam
import xxhash
from apache_beam import pvalue

from pipelines import spill
from pipelines.beam_io import DEAD
from pipelines.configs import IngestConfig
from pipelines.documents import (
    Document,
    UnrepresentableValue,
    dead_letter,
    json_safe,
    make_document,
)
from pipelines.stage import StageOutputs, StageRun, run_as_command, stage_main
from pipelines.text import normalize_text

STAGE = "ingest"


def stable_id(source: str, text: str) -> str:
    return f"{source}/{xxhash.xxh3_128_hexdigest(text.encode('utf-8'))[:24]}"


def to_document(item: tuple[str, Any], config: IngestConfig) -> Iterator[Any]:
    origin, obj = item
    try:
        yield from _to_document(origin, obj, config)
    except Exception as err:  # one bad record must never take the pipeline down
        yield pvalue.TaggedOutput(
            DEAD,
            dead_letter("processing_error", STAGE, origin, obj, f"{type(err).__name__}: {err}"),
        )


def _to_document(origin: str, obj: Any, config: IngestConfig) -> Iterator[Any]:
    def drop(reason: str, detail: str = "") -> pvalue.TaggedOutput:
        return pvalue.TaggedOutput(DEAD, dead_letter(reason, STAGE, origin, obj, detail))

    if not isinstance(obj, dict):
        yield drop("invalid_record", f"expected a JSON object, got {type(obj).__name__}")
        return
    text = obj.get(config.text_field)
    if text is None:
        yield drop("missing_text", f"no {config.text_field!r} field")
        return
    if not isinstance(text, str):
        yield drop("non_string_text", f"{config.text_field!r} is {type(text).__name__}")
        return
    source = obj.get("source")
    source = source if isinstance(source, str) and source else (config.source or "unknown")
    if len(text) > config.max_chars:
        yield drop("too_long", f"{len(text)} characters > max_chars={config.max_chars}")
        return
    text = normalize_text(text)
    if len(text) < config.min_chars:
        yield drop("empty_text", "no text left after normalization")
        return
    raw_id = obj.get(config.id_field)
    if isinstance(raw_id, int | str) and not isinstance(raw_id, bool) and str(raw_id).strip():
        doc_id = str(raw_id).strip()
    else:
        doc_id = stable_id(source, text)
    metadata = dict(obj["metadata"]) if isinstance(obj.get("metadata"), dict) else {}
    for key, value in obj.items():
        if key not in (config.text_field, config.id_field, "source", "metadata"):
            metadata.setdefault(key, value)
    try:
        # Parquet and Hugging Face columns hold timestamps, bytes, decimals, NumPy values:
        # converted here, or the shard writer's json.dumps would fail the whole stage.
        metadata = json_safe(metadata)
    except UnrepresentableValue as err:
        yield drop("unrepresentable_metadata", f"metadata {err}")
        return
    yield (doc_id, (origin, make_document(doc_id, text, source, metadata)))


def resolve_duplicate_ids(item: tuple[str, Iterable[tuple[str, Document]]]) -> Iterator[Any]:
    """Keep one document per id: the smallest (text hash, origin), so the choice is stable."""
    _, candidates = item
    ranked = sorted(
        candidates, key=lambda c: (xxhash.xxh3_128_hexdigest(c[1]["text"].encode()), c[0])
    )
    yield ranked[0][1]
    for origin, doc in ranked[1:]:
        yield pvalue.TaggedOutput(
            DEAD,
            dead_letter("duplicate_id", STAGE, origin, doc, duplicate_of=ranked[0][0]),
        )


def build(records: beam.PCollection, config: IngestConfig) -> StageOutputs:
    converted = records | "ToDocument" >> beam.FlatMap(to_document, config).with_outputs(
        DEAD, main="docs"
    )
    resolved = (
        converted["docs"]
        | "GroupById" >> spill.GroupByKey()
        | "ResolveIds" >> beam.FlatMap(resolve_duplicate_ids).with_outputs(DEAD, main="docs")
    )
    dropped = (converted[DEAD], resolved[DEAD]) | "IngestDropped" >> beam.Flatten()
    return StageOutputs(resolved["docs"], dropped)


def main(argv: Sequence[str] | None = None) -> StageRun:
    return stage_main(STAGE, __doc__ or STAGE, IngestConfig, build, argv, raw_records=True)


if __name__ == "__main__":
    run_as_command(main)
