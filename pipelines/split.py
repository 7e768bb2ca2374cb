"""Held-out split: clean documents -> per-source train and held-out files.

The trainer mixes *per-source* token stores by weight, and evaluation wants a held-out set
per source, so the decontaminated documents are split by source and by a stable hash of their
id: the held-out part of a source is its documents with the smallest ``sha1(id)``, at least
``heldout_fraction`` of them and at least ``min_heldout_chars`` of text (so a small source still
has a few evaluation windows), never more than half. Same documents -> same split, on any
machine and in any order.

Used by the ``split`` task (``operators/split.py``) and the data-plane walker
(``operators/pipeline/dataplane.py``).

Output (inputs of the ``tokenize`` stage, which reads JSONL.gz files)::

    train/<source>.jsonl.gz    heldout/<source>.jsonl.gz    split.json (counts)

Every input document is counted: in its source's train or held-out file, or, when its source
is not one the run trains on, under ``other_sources`` (``split.json``, the step's result, and a
warning).

It streams line by line through fsspec (memory: one sha1 and length per document), which is
right for this project's corpora; at web scale this belongs in a Beam stage in ``pipelines/``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec

from pipelines.manifest import read_manifest
from pipelines.storage import join

log = logging.getLogger(__name__)


def _documents(stage_output: str) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """(raw line, document) for every kept document of a stage output, shard by shard."""
    for path in read_manifest(stage_output).shard_paths(stage_output):
        with fsspec.open(path, "rb", compression="gzip" if path.endswith(".gz") else None) as f:
            for line in f:
                if line.strip():
                    yield line, json.loads(line)


def _key(doc_id: str) -> bytes:
    return hashlib.sha1(doc_id.encode("utf-8")).digest()


def split_documents(
    stage_output: str,
    out: str,
    sources: Sequence[str],
    heldout_fraction: float,
    min_heldout_chars: int,
) -> dict[str, Any]:
    """Write ``train/`` and ``heldout/`` files for ``sources``; returns the counts: per source
    train and held-out, and every input document accounted for: ``records_in`` = the sources'
    documents + ``other_sources`` (documents of a source the run does not train on, e.g.
    ingest's ``unknown``: counted by source, not written). ``split.json`` holds the same but
    ``records_in``, and ``other_sources`` only when there are any."""
    wanted = set(sources)
    # Pass 1: per source, (hash, id, chars) of each document: decide the held-out ids.
    seen: dict[str, list[tuple[bytes, str, int]]] = defaultdict(list)
    counted: dict[str, int] = defaultdict(int)
    records_in = 0
    for _, doc in _documents(stage_output):
        records_in += 1
        if doc.get("source") in wanted:
            seen[doc["source"]].append((_key(doc["id"]), doc["id"], len(doc["text"])))
        else:
            counted[str(doc.get("source"))] += 1
    others = dict(sorted(counted.items()))
    if others:
        log.warning(
            "split: %d documents of sources the run does not train on, not written: %s",
            sum(others.values()),
            others,
        )
    heldout: set[str] = set()
    for source in sources:
        docs = sorted(seen.get(source, []))
        if len(docs) < 2:
            raise ValueError(f"source {source!r}: {len(docs)} clean documents; need >= 2 to split")
        want = max(1, math.ceil(heldout_fraction * len(docs)))
        chars = 0
        for i, (_, doc_id, n) in enumerate(docs):
            if i >= len(docs) // 2 or (i >= want and chars >= min_heldout_chars):
                break
            heldout.add(doc_id)
            chars += n
    # Pass 2: copy each document's line, unchanged, into its file (gzip without timestamps).
    counts: dict[str, dict[str, int]] = {s: {"train": 0, "heldout": 0} for s in sources}
    files = {}
    try:
        for source in sources:
            for kind in ("train", "heldout"):
                raw = fsspec.open(join(out, kind, f"{source}.jsonl.gz"), "wb").open()
                files[source, kind] = (raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0))
        for line, doc in _documents(stage_output):
            source = doc.get("source")
            if source not in wanted:
                continue
            kind = "heldout" if doc["id"] in heldout else "train"
            files[source, kind][1].write(line if line.endswith(b"\n") else line + b"\n")
            counts[source][kind] += 1
    finally:
        for raw, gz in files.values():
            gz.close()
            raw.close()
    written = sum(n["train"] + n["heldout"] for n in counts.values())
    if written + sum(others.values()) != records_in:  # the input changed between the passes
        raise RuntimeError(
            f"split: {records_in} documents read, {written} written and "
            f"{sum(others.values())} of other sources: the input changed while it was split"
        )
    summary: dict[str, Any] = {"sources": counts, "heldout_fraction": heldout_fraction}
    if others:  # only then: a split of the run's own sources keeps its split.json bytes
        summary["other_sources"] = others
    with fsspec.open(join(out, "split.json"), "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    # the step's result (its marker, lineage) always accounts for every document
    return {"records_in": records_in, "other_sources": others, **summary}
