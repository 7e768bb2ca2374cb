"""The numpy MinHash/LSH math: exact against a slow reference, unbiased, stable, datasketch-equal."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pipelines import minhash
from pipelines.minhash import (
    EMPTY,
    MinHashParams,
    band_hashes,
    bucket_links,
    candidate_probability,
    estimated_jaccard,
    jaccard,
    lsh_error_areas,
    make_hasher,
    optimal_bands,
    shingle_hashes,
    shingle_set,
    signatures,
    splitmix64,
    verified,
    word_hashes,
)

HASHER = make_hasher(MinHashParams())
VOCAB = [f"w{i}" for i in range(20_000)]


def _texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(VOCAB, k=rng.randint(1, 120))) for _ in range(n)]
    texts += [
        "",
        "!!! ??? ...",  # no word characters: no shingles
        "Hello, World",  # fewer words than ngram: one shingle
        "Ünïcödé wörds — naïve café façade: ☃ 東京 東京 東京 東京 東京",
        "x" * 200 + " " + "x" * 199 + "y",  # long words (beyond the tabulation positions)
    ]
    return texts


def _reference_signature(text: str, hasher: minhash.Hasher) -> np.ndarray:
    """One shingle at a time, minimum taken with Python integers."""
    num_perm = hasher.params.num_perm
    shingles = shingle_set(text, hasher.params.ngram)
    if not shingles:
        return np.full(num_perm, EMPTY, dtype=np.uint32)
    best = [2**32] * num_perm
    for shingle in shingles:
        hashes, word_counts = word_hashes([" ".join(shingle).encode()], hasher)
        assert word_counts.tolist() == [len(shingle)]
        (value,), _ = shingle_hashes(hashes, word_counts, hasher)
        for p in range(num_perm):
            h = (int(hasher.perm_a[p]) * int(value) + int(hasher.perm_b[p])) % 2**32
            best[p] = min(best[p], h)
    return np.array(best, dtype=np.uint32)


@pytest.mark.parametrize("chunk_cells", [1, 3 * 64, 1 << 21])
def test_batched_signatures_equal_one_shingle_at_a_time(monkeypatch, chunk_cells):
    # Tiny blocks make documents straddle block boundaries, the tricky case of the reduceat.
    monkeypatch.setattr(minhash, "_CHUNK_CELLS", chunk_cells)
    hasher = make_hasher(MinHashParams(num_perm=64))
    texts = _texts(0, 12)
    sigs, counts = signatures(texts, hasher)
    for text, sig, count in zip(texts, sigs, counts, strict=True):
        assert count == len(shingle_set(text))
        np.testing.assert_array_equal(sig, _reference_signature(text, hasher))


def test_signatures_do_not_depend_on_batching():
    texts = _texts(1, 40)
    together, _ = signatures(texts, HASHER)
    alone = np.concatenate([signatures([t], HASHER)[0] for t in texts])
    np.testing.assert_array_equal(together, alone)


def test_signatures_are_pinned():
    # Same text, same signature: on any machine, process or numpy version (content-addressed
    # outputs depend on it). A deliberate change of the hashing must update this test.
    sigs, counts = signatures(["The quick brown fox jumps over the lazy dog."], HASHER)
    assert counts.tolist() == [5]
    assert sigs[0, :4].tolist() == [239171470, 71334830, 909871516, 1524094673]
    assert hex(int(splitmix64(0, 1)[0])) == "0xe220a8397b1dcdaf"  # the reference splitmix64


def test_no_words_means_no_shingles_and_short_texts_one_shingle():
    sigs, counts = signatures(
        ["", "  ...  ", "hello world", "Hello,  WORLD!", "hello there"], HASHER
    )
    assert counts.tolist() == [0, 0, 1, 1, 1]
    assert (sigs[:2] == EMPTY).all()
    np.testing.assert_array_equal(sigs[2], sigs[3])  # case and punctuation are not words
    assert estimated_jaccard(sigs[2], sigs[4]) < 0.05


def test_distinct_words_hash_apart():
    words = [
        "ab",
        "ba",
        "abc",
        "a" * 64 + "b",
        "a" * 63 + "ba",
        "b" + "a" * 64,  # the same (row, byte) multiset as "a" * 64 + "b"
        "x" * 300,
        "x" * 301,
        "東京",
        "京東",
    ]
    hashes, _ = word_hashes([" ".join(words).encode()], HASHER)
    assert len(set(hashes.tolist())) == len(words)
    # Word boundaries matter: "ab cd" and "abc d" are different word sequences.
    assert (
        signatures(["ab cd e f g"], HASHER)[0].tolist()
        != signatures(["abc d e f g"], HASHER)[0].tolist()
    )


def _variant(words: list[str], edits: int, rng: random.Random) -> list[str]:
    out = list(words)
    for _ in range(edits):
        out[rng.randrange(len(out))] = rng.choice(VOCAB)
    return out


def test_estimates_are_unbiased_with_binomial_noise():
    rng = random.Random(7)
    errors, variances = [], []
    for _ in range(300):
        base = rng.choices(VOCAB, k=rng.randint(100, 400))
        other = _variant(base, rng.randint(1, 40), rng)
        a, b = " ".join(base), " ".join(other)
        truth = jaccard(shingle_set(a), shingle_set(b))
        sigs, _ = signatures([a, b], HASHER)
        errors.append(float(estimated_jaccard(sigs[0], sigs[1])) - truth)
        variances.append(truth * (1 - truth) / HASHER.params.num_perm)
    errors = np.array(errors)
    assert abs(errors.mean()) < 0.005  # no bias (3 standard errors of the mean)
    ratio = float((errors**2).mean() / np.mean(variances))
    assert 0.7 < ratio < 1.4, ratio  # the spread of an ideal MinHash, no worse


def test_optimal_bands_equal_datasketch():
    from datasketch import lsh  # a dev dependency: a missing one must fail, not skip

    cases = [
        (0.8, 256, (0.5, 0.5)),
        (0.8, 256, (0.1, 0.9)),
        (0.5, 128, (0.5, 0.5)),
        (0.9, 128, (0.2, 0.8)),
    ]
    for threshold, num_perm, weights in cases:
        expected = lsh._optimal_param(threshold, num_perm, *weights)
        assert optimal_bands(threshold, num_perm, *weights) == expected


def test_default_lsh_curve_around_threshold():
    bands, rows = optimal_bands(0.8, 256, 0.1, 0.9)
    assert (bands, rows) == (23, 11)
    p = candidate_probability(np.array([0.3, 0.5, 0.8, 0.85, 0.9]), bands, rows)
    assert p[0] < 1e-4 and p[1] < 0.02  # dissimilar pairs rarely become candidates
    assert p[2] > 0.85 and p[3] > 0.98 and p[4] > 0.999
    fp, fn = lsh_error_areas(0.8, bands, rows)
    assert 0 < fn < fp < 0.1


def test_band_hashes_follow_band_equality():
    sigs, _ = signatures(_texts(2, 4)[:4], HASHER)
    changed = sigs.copy()
    changed[1, 11] ^= 1  # one value of band 1 (rows 11..21)
    keys, keys2 = band_hashes(sigs, 23, 11), band_hashes(changed, 23, 11)
    assert keys.shape == (4, 23) and keys.dtype == np.uint64
    assert (keys[0] == keys2[0]).all() and (keys[2:] == keys2[2:]).all()
    assert (keys[1] != keys2[1]).tolist() == [i == 1 for i in range(23)]
    with pytest.raises(ValueError):
        band_hashes(sigs, 30, 10)


def test_bucket_links_are_linear_and_deduplicated():
    # 1000 documents in one bucket of every band: 999 links to the head, not 499500 pairs.
    keys = np.zeros((1000, 4), dtype=np.uint64)
    pairs = bucket_links(keys)
    assert pairs.shape == (999, 2) and (pairs[:, 0] == 0).all()
    keys = np.array([[1, 5], [1, 6], [2, 6], [3, 7]], dtype=np.uint64)
    assert bucket_links(keys).tolist() == [[0, 1], [1, 2]]
    assert bucket_links(np.zeros((0, 3), dtype=np.uint64)).shape == (0, 2)


def test_verified_pairs_meet_the_threshold():
    rng = random.Random(3)
    base = rng.choices(VOCAB, k=300)
    texts = [" ".join(base), " ".join(_variant(base, 2, rng)), " ".join(_variant(base, 60, rng))]
    sigs, _ = signatures(texts, HASHER)
    assert verified(sigs, np.array([[0, 1], [0, 2]]), 0.8).tolist() == [True, False]


def test_params_are_validated():
    with pytest.raises(ValueError):
        MinHashParams(num_perm=0)
    with pytest.raises(ValueError):
        optimal_bands(1.0, 256)


def test_word_hashes_read_runs_of_spaces_and_empty_documents():
    """Spaces between, before and after words, and documents without words, change nothing
    but where each document's words are counted."""
    runs = [b"  ab  c ", b"", b"   ", b"d e", b"e"]
    single = [b"ab c", b"", b"", b"d e", b"e"]
    hashes, counts = word_hashes(runs, HASHER)
    expected, expected_counts = word_hashes(single, HASHER)
    np.testing.assert_array_equal(hashes, expected)
    assert counts.tolist() == expected_counts.tolist() == [2, 0, 0, 2, 1]
    assert hashes[3] == hashes[4] != hashes[0]  # the same word, wherever it is
    empty, none = word_hashes([b"", b" "], HASHER)
    assert empty.size == 0 and none.tolist() == [0, 0]
