"""Artifact fields read from what a step left in its output directory."""

from __future__ import annotations

import hashlib
from typing import Any


def describe_documents(output_dir: str) -> dict[str, Any]:
    """``content_hash`` and ``counts`` of a pipeline stage output, from its manifest.

    The content hash is the sha256 over the shard paths and their sha256s (data and dead
    letters): it names the bytes, not the manifest's formatting, so an identical rerun gives
    the same hash. Returns ``{}`` when the directory has no manifest (an unfinished stage).
    """
    # Lazily: the manifest module is the data contract's one owner (and pulls in fsspec).
    from pipelines.manifest import has_manifest, read_manifest

    if not has_manifest(output_dir):
        return {}
    manifest = read_manifest(output_dir)
    digest = hashlib.sha256()
    for shard in sorted([*manifest.shards, *manifest.dead_letter_shards], key=lambda s: s.path):
        digest.update(f"{shard.path}\0{shard.sha256}\n".encode())
    return {
        "content_hash": f"sha256:{digest.hexdigest()}",
        "counts": {
            "records_in": manifest.records_in,
            "records_out": manifest.records_out,
            "dropped": dict(manifest.dropped),
        },
        "config": dict(manifest.config),
    }


def describe_stage_output(output_dir: str) -> dict[str, Any]:
    """Counts, config, content hash and manifest extras (tokens, vocabulary) of an output."""
    from pipelines.manifest import has_manifest, read_manifest  # the data contract's owner

    fields = describe_documents(output_dir)
    if has_manifest(output_dir):
        extra = read_manifest(output_dir).extra
        keep = ("num_tokens", "vocab_size", "tokenizer_sha256", "num_documents", "sample")
        fields.setdefault("counts", {}).update({k: extra[k] for k in keep if k in extra})
    return fields
