"""Documents stage outputs laid out as ``write_documents`` writes them, for tests of the paths
that read id-sharded inputs shard by shard (tokenize, the map stages)."""

from __future__ import annotations

from pathlib import Path

from pipelines import storage
from pipelines.beam_io import shard_name, stable_shard
from pipelines.documents import dumps
from pipelines.manifest import Manifest, ShardInfo


def write_id_sharded_output(
    root: Path,
    docs: list[dict],
    num_shards: int,
    extra_lines: dict[int, list[str]] | None = None,
    *,
    sort: bool = True,
) -> Path:
    """Shard ``k`` holds the documents with ``stable_shard(id) == k`` (sorted by id, then line,
    unless ``sort=False``), then ``extra_lines[k]`` (raw lines, newline included); a manifest
    lists the shards."""
    shards = []
    for k in range(num_shards):
        mine = [d for d in docs if stable_shard(d["id"], num_shards) == k]
        lines = [dumps(d) + "\n" for d in mine]
        if sort:
            lines = [line for _, line in sorted(zip([d["id"] for d in mine], lines, strict=True))]
        lines += (extra_lines or {}).get(k, [])
        data = storage.gzip_bytes("".join(lines).encode())
        relative = shard_name("data/part", k, num_shards)
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
        shards.append(ShardInfo(relative, len(lines), len(data), storage.sha256_hex(data)))
    total = sum(s.records for s in shards)
    Manifest("fixture", {}, [], total, total, {}, shards, []).write(str(root))
    return root
