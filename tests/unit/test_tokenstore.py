"""The token store contract: shards + ledger, flat random access, refusal of unfinished stores."""

from __future__ import annotations

import numpy as np
import pytest
import tensorstore as ts

import tokenstore
from tokenstore import TokenStore, TokenStoreError


def _build(root: str, shards: dict[str, list[list[int]]]) -> TokenStore:
    written = [tokenstore.write_shard(root, name, docs) for name, docs in shards.items()]
    tokenstore.finalize(root, written, vocab_size=100, eos_id=0, tokenizer_sha256="abc")
    return TokenStore.open(root)


def test_flat_windows_span_shards_in_ledger_order(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[*rng.integers(1, 100, size=rng.integers(1, 50)).tolist(), 0] for _ in range(40)]
    # Written out of order: the ledger orders shards by name.
    store = _build(str(tmp_path), {"b": docs[20:], "a": docs[:20], "c": []})
    flat = np.concatenate([np.asarray(d, dtype=np.uint32) for d in docs])
    assert store.num_tokens == len(flat)
    assert store.num_docs == 40
    for start, length in [(0, 1), (0, len(flat)), (5, 300), (len(flat) - 7, 7), (17, 0)]:
        np.testing.assert_array_equal(store.read(start, length), flat[start : start + length])
    for i in (0, 19, 20, 39):
        np.testing.assert_array_equal(store.document(i), np.asarray(docs[i], dtype=np.uint32))


def test_window_outside_store_is_an_error(tmp_path):
    store = _build(str(tmp_path), {"a": [[1, 2, 0]]})
    with pytest.raises(IndexError, match="outside store"):
        store.read(1, 3)
    with pytest.raises(IndexError):
        store.document(1)


def test_unfinalized_store_is_refused(tmp_path):
    tokenstore.write_shard(str(tmp_path), "a", [[1, 0]])
    with pytest.raises(TokenStoreError, match="not a finalized token store"):
        TokenStore.open(str(tmp_path))


def test_ledger_records_counts_and_tokenizer(tmp_path):
    store = _build(str(tmp_path), {"a": [[1, 0], [2, 3, 0]]})
    ledger = store.ledger
    assert (ledger.num_tokens, ledger.num_docs, ledger.vocab_size, ledger.eos_id) == (5, 2, 100, 0)
    assert ledger.tokenizer_sha256 == "abc"
    assert TokenStore.open(str(tmp_path)).ledger == ledger


def test_same_documents_give_identical_bytes(tmp_path):
    docs = {"a": [[1, 2, 0], [3, 0]], "b": [[4, 0]]}
    _build(str(tmp_path / "x"), docs)
    _build(str(tmp_path / "y"), docs)
    files_x = sorted(
        p.relative_to(tmp_path / "x") for p in (tmp_path / "x").rglob("*") if p.is_file()
    )
    files_y = sorted(
        p.relative_to(tmp_path / "y") for p in (tmp_path / "y").rglob("*") if p.is_file()
    )
    assert files_x == files_y
    for rel in files_x:
        assert (tmp_path / "x" / rel).read_bytes() == (tmp_path / "y" / rel).read_bytes()


def _files(root) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_a_shard_written_in_pieces_is_the_shard_written_at_once(tmp_path):
    """Growing the arrays chunk by chunk leaves the bytes of one write of the whole shard."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 100, size=rng.integers(1, 40_000)).astype(np.uint32) for _ in range(30)]
    at_once = tmp_path / "at_once" / "shards" / "s"
    for kind, dtype, values in (
        ("tokens", "uint32", np.concatenate(docs)),
        ("offsets", "int64", np.concatenate([[0], np.cumsum([len(d) for d in docs])])),
    ):
        chunk = tokenstore.store.TOKEN_CHUNK if kind == "tokens" else tokenstore.store.OFFSET_CHUNK
        spec = tokenstore.store._array_spec(str(at_once / kind), dtype, len(values), chunk)
        ts.open(spec).result().write(values.astype(dtype)).result()

    writer = tokenstore.ShardWriter(str(tmp_path / "pieces"), "s", flush_chunks=1)
    for doc in docs:
        writer.add(doc)
    ledger = writer.close()
    assert (ledger.num_docs, ledger.num_tokens) == (30, sum(len(d) for d in docs))
    assert ledger.num_tokens > 4 * tokenstore.store.TOKEN_CHUNK  # several flushes happened
    assert _files(tmp_path / "pieces" / "shards" / "s") == _files(at_once)
