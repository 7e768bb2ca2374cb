"""Data: block mixture counts, batch = pure function of (seed, step), Feistel permutation."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.trainer_data import write_random_store
from tokenstore import TokenStore
from trainer.data import MixtureLoader, block_counts, feistel_permute


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000, 4097])
def test_feistel_is_a_bijection(n):
    out = feistel_permute(np.arange(n), n, key=123)
    assert sorted(out.tolist()) == list(range(n))
    if n > 10:
        assert not np.array_equal(out, np.arange(n))
        assert not np.array_equal(out, feistel_permute(np.arange(n), n, key=124))


def test_block_counts_round_and_sum():
    assert block_counts([0.7, 0.3], 10).tolist() == [7, 3]
    assert block_counts([1, 1, 1], 100).tolist() == [34, 33, 33]
    assert block_counts([0.5, 0.0, 0.5], 7).sum() == 7


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    write_random_store(str(root / "a"), num_docs=200, seed=1)
    write_random_store(str(root / "b"), num_docs=100, seed=2)
    return [TokenStore.open(str(root / "a")), TokenStore.open(str(root / "b"))]


def _loader(stores, seed=0, **kw):
    args = {"seq_len": 16, "batch_size": 8, "seed": seed, "block_size": 10, **kw}
    return MixtureLoader(stores, [0.7, 0.3], **args)


def test_each_block_holds_exact_counts(stores):
    loader = _loader(stores)
    for block in range(5):
        src, _ = loader.locate(np.arange(block * 10, block * 10 + 10))
        assert np.bincount(src, minlength=2).tolist() == [7, 3]


def test_batch_is_a_pure_function_of_seed_and_step(stores):
    a, b = _loader(stores), _loader(stores)
    for step in [5, 0, 3]:  # any order, fresh loader: same batch
        np.testing.assert_array_equal(a.batch(step), b.batch(step))
    assert not np.array_equal(a.batch(0), a.batch(1))
    assert not np.array_equal(a.batch(0), _loader(stores, seed=1).batch(0))
    rows = a.rows(2, [1, 6])  # a host reads only its rows
    np.testing.assert_array_equal(rows, a.batch(2)[[1, 6]])


def test_windows_are_real_store_windows_and_epochs_cover_everything(stores):
    loader = _loader(stores, seq_len=32)
    src, start = loader.locate(np.arange(0, 10 * 400))
    n_b = loader.windows[1]
    seen_b = start[src == 1] // 32
    # the first n_b picks from source b are a permutation of all its windows (one epoch)
    assert sorted(seen_b[:n_b].tolist()) == list(range(n_b))
    batch = loader.batch(0)
    assert batch.shape == (8, 33)
    s, st = loader.locate(np.arange(8))
    np.testing.assert_array_equal(batch[0], stores[s[0]].read(int(st[0]), 33))


def test_stores_of_two_tokenizers_of_one_size_are_refused(tmp_path, stores):
    # Same vocab_size and eos_id: only the ledger's tokenizer hash tells them apart.
    other = str(tmp_path / "other")
    write_random_store(other, num_docs=50, seed=3, tokenizer_sha256="f" * 64)
    with pytest.raises(
        ValueError,
        match=r"different tokenizers \(data.sources\[0\]: synthetic, "
        r"data.sources\[1\]: ffffffffffff\)",
    ):
        _loader([stores[0], TokenStore.open(other)])
