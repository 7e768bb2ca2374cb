"""TensorStore (zarr3) implementation of the token store; see the package docstring."""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import tensorstore as ts

LEDGER_NAME = "ledger.json"
FORMAT = "slipway-token-store/v1"
TOKEN_DTYPE = np.uint32
TOKEN_CHUNK = 1 << 16  # 256 KiB of uint32 per chunk: random training windows decode little
READ_CACHE_BYTES = 128 << 20  # bounded chunk cache shared by the arrays of one reader
OFFSET_CHUNK = 1 << 16


class TokenStoreError(RuntimeError):
    """A store that is missing, unfinished, or inconsistent."""


def _kvstore(path: str) -> dict[str, Any]:
    if path.startswith("gs://"):
        bucket, _, key = path[len("gs://") :].partition("/")
        return {"driver": "gcs", "bucket": bucket, "path": key.rstrip("/") + "/"}
    if path.startswith("memory://"):
        return {"driver": "memory", "path": path[len("memory://") :].rstrip("/") + "/"}
    return {"driver": "file", "path": os.path.abspath(path).rstrip("/") + "/"}


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def _array_spec(path: str, dtype: str, shape: int, chunk: int) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": _kvstore(path),
        "metadata": {
            "shape": [shape],
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, chunk)]}},
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "zstd", "configuration": {"level": 3, "checksum": False}},
            ],
        },
        "create": True,
        "delete_existing": True,
    }


@dataclass(frozen=True)
class ShardLedger:
    name: str
    num_tokens: int
    num_docs: int


@dataclass(frozen=True)
class Ledger:
    shards: list[ShardLedger]
    vocab_size: int
    eos_id: int
    tokenizer_sha256: str
    metadata: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_docs(self) -> int:
        return sum(s.num_docs for s in self.shards)

    def to_json(self) -> str:
        body = asdict(self)
        body["num_tokens"] = self.num_tokens
        body["num_docs"] = self.num_docs
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        body = json.loads(text)
        if body.get("format") != FORMAT:
            raise TokenStoreError(f"unknown token store format {body.get('format')!r}")
        body.pop("num_tokens", None)
        body.pop("num_docs", None)
        body["shards"] = [ShardLedger(**s) for s in body["shards"]]
        return cls(**body)


class _GrowingArray:
    """A 1-d zarr3 array written front to back in whole chunks, grown (``resize``) as it goes.

    zarr3 stores every chunk whole, so growing the array and writing chunk-aligned blocks
    leaves the same chunk files and the same ``zarr.json`` as one write of the finished
    array: the bytes do not depend on how the writer was fed.
    """

    def __init__(self, path: str, dtype: np.dtype, chunk: int, flush_chunks: int) -> None:
        self._array = ts.open(_array_spec(path, np.dtype(dtype).name, 0, chunk)).result()
        self._dtype = dtype
        self._chunk = chunk
        self._flush_at = chunk * flush_chunks
        self._pending: list[np.ndarray] = []
        self._pending_len = 0
        self.size = 0  # elements written to the array so far

    def append(self, values: np.ndarray) -> None:
        self._pending.append(values)
        self._pending_len += len(values)
        if self._pending_len >= self._flush_at:
            self._flush(final=False)

    def close(self) -> None:
        self._flush(final=True)

    def _flush(self, final: bool) -> None:
        if not self._pending_len:
            return
        block = np.concatenate(self._pending).astype(self._dtype, copy=False)
        take = len(block) if final else len(block) - len(block) % self._chunk
        start, end = self.size, self.size + take
        self._array = self._array.resize(exclusive_max=[end], expand_only=True).result()
        self._array[start:end].write(block[:take]).result()
        self.size = end
        rest = block[take:]
        self._pending = [rest] if len(rest) else []
        self._pending_len = len(rest)


class ShardWriter:
    """Writes one shard a document at a time; holds at most ``flush_chunks`` chunks of tokens.

    The shard is unreadable until ``finalize`` lists it in the ledger, so a half-written shard
    (a failed worker) is never read; a rerun overwrites it.
    """

    def __init__(self, root: str, name: str, flush_chunks: int = 16) -> None:
        base = _join(root, "shards", name)
        self.name = name
        self._tokens = _GrowingArray(_join(base, "tokens"), TOKEN_DTYPE, TOKEN_CHUNK, flush_chunks)
        self._offsets = _GrowingArray(_join(base, "offsets"), np.int64, OFFSET_CHUNK, 1)
        self._ends: list[int] = [0]  # document end offsets not yet handed to ``_offsets``
        self._num_tokens = 0
        self._num_docs = 0

    def add(self, document: Sequence[int]) -> None:
        """Append one tokenized document (its EOS included)."""
        tokens = np.asarray(document, dtype=TOKEN_DTYPE)
        self._tokens.append(tokens)
        self._num_tokens += len(tokens)
        self._num_docs += 1
        self._ends.append(self._num_tokens)
        if len(self._ends) >= OFFSET_CHUNK:
            self._flush_ends()

    def _flush_ends(self) -> None:
        self._offsets.append(np.array(self._ends, dtype=np.int64))
        self._ends = []

    def close(self) -> ShardLedger:
        self._tokens.close()
        self._flush_ends()
        self._offsets.close()
        return ShardLedger(name=self.name, num_tokens=self._num_tokens, num_docs=self._num_docs)


def write_shard(root: str, name: str, documents: Iterable[Sequence[int]]) -> ShardLedger:
    """Write one shard from already-tokenized documents (each including its EOS)."""
    writer = ShardWriter(root, name)
    for document in documents:
        writer.add(document)
    return writer.close()


def _write_text(path: str, text: str) -> None:
    kv = ts.KvStore.open(_kvstore(os.path.dirname(path.rstrip("/")) or ".")).result()
    kv.write(os.path.basename(path), text.encode("utf-8")).result()


def _read_text(path: str) -> str | None:
    kv = ts.KvStore.open(_kvstore(os.path.dirname(path.rstrip("/")) or ".")).result()
    result = kv.read(os.path.basename(path)).result()
    if result.state != "value":
        return None
    return bytes(result.value).decode("utf-8")


def finalize(
    root: str,
    shards: Sequence[ShardLedger],
    *,
    vocab_size: int,
    eos_id: int,
    tokenizer_sha256: str,
    metadata: dict[str, Any] | None = None,
) -> Ledger:
    """Write the ledger (shards in name order): from now on the store is readable."""
    ordered = sorted(shards, key=lambda s: s.name)
    if len({s.name for s in ordered}) != len(ordered):
        raise TokenStoreError("duplicate shard names")
    ledger = Ledger(ordered, vocab_size, eos_id, tokenizer_sha256, dict(metadata or {}))
    _write_text(_join(root, LEDGER_NAME), ledger.to_json())
    return ledger


class TokenStore:
    """Read-only view of a finalized store as one flat token array.

    ``read(start, length)`` touches only the chunks that overlap the window, so memory stays
    bounded by the window size whatever the store's size.
    """

    def __init__(self, root: str, ledger: Ledger) -> None:
        self.root = root
        self.ledger = ledger
        starts = [0]
        for shard in ledger.shards:
            starts.append(starts[-1] + shard.num_tokens)
        self._token_starts = starts
        doc_starts = [0]
        for shard in ledger.shards:
            doc_starts.append(doc_starts[-1] + shard.num_docs)
        self._doc_starts = doc_starts
        self._arrays: dict[tuple[int, str], ts.TensorStore] = {}
        self._context = ts.Context({"cache_pool": {"total_bytes_limit": READ_CACHE_BYTES}})

    @classmethod
    def open(cls, root: str) -> TokenStore:
        text = _read_text(_join(root, LEDGER_NAME))
        if text is None:
            raise TokenStoreError(f"{root} has no {LEDGER_NAME}: not a finalized token store")
        return cls(root, Ledger.from_json(text))

    @property
    def num_tokens(self) -> int:
        return self._token_starts[-1]

    @property
    def num_docs(self) -> int:
        return self._doc_starts[-1]

    @property
    def vocab_size(self) -> int:
        return self.ledger.vocab_size

    @property
    def eos_id(self) -> int:
        return self.ledger.eos_id

    def _array(self, shard: int, kind: str) -> ts.TensorStore:
        key = (shard, kind)
        if key not in self._arrays:
            path = _join(self.root, "shards", self.ledger.shards[shard].name, kind)
            spec = {"driver": "zarr3", "kvstore": _kvstore(path), "open": True}
            self._arrays[key] = ts.open(spec, read=True, context=self._context).result()
        return self._arrays[key]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the flat array, as uint32."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(
                f"window [{start}, {start + length}) outside store of {self.num_tokens} tokens"
            )
        out = np.empty(length, dtype=TOKEN_DTYPE)
        pos = start
        while pos < start + length:
            shard = bisect.bisect_right(self._token_starts, pos) - 1
            shard_start = self._token_starts[shard]
            take = min(start + length, self._token_starts[shard + 1]) - pos
            local = pos - shard_start
            out[pos - start : pos - start + take] = (
                self._array(shard, "tokens")[local : local + take].read().result()
            )
            pos += take
        return out

    def document(self, index: int) -> np.ndarray:
        """The tokens of document ``index`` (global order: shards in ledger order)."""
        if not 0 <= index < self.num_docs:
            raise IndexError(f"document {index} outside store of {self.num_docs} documents")
        shard = bisect.bisect_right(self._doc_starts, index) - 1
        local = index - self._doc_starts[shard]
        begin, end = self._array(shard, "offsets")[local : local + 2].read().result()
        return self.read(self._token_starts[shard] + int(begin), int(end - begin))

    @cached_property
    def shard_token_starts(self) -> list[int]:
        return list(self._token_starts)
