"""MinHash signatures and LSH banding, vectorized with numpy: the pure math of fuzzy dedup.

Everything here is a pure function of its inputs (no Beam, no I/O), so the Beam stage, the
tests and the benchmark share one implementation.

Pipeline of a batch of texts, each step one numpy pass over the whole batch:

1. words (``pipelines.text.spaced_words``) are joined into one byte buffer and hashed together with
   *tabulation hashing* (a random table per byte position, summed per word): one gather and one
   ``np.add.reduceat`` for the batch instead of a Python hash call per word or shingle;
2. word ``ngram``-grams (shingles) are hashed by a position-weighted sum of their word hashes,
   mixed with the murmur3 finalizer and cut to 32 bits;
3. each of ``num_perm`` hash functions is the affine bijection ``(a * x + b) mod 2**32`` (``a``
   odd) of the mixed shingle hash: datasketch's default "affine32" scheme, where uint32
   wraparound is the modulo, so numpy runs it as plain SIMD multiply-adds. The minimum per
   document is one ``np.minimum.reduceat`` over the concatenated shingles of many documents,
   in ``num_perm x chunk`` blocks that stay in cache;
4. LSH bands: ``bands x rows`` slices of the signature, each hashed to one uint64 bucket key.

All random constants come from a splitmix64 sequence of the seed, not from numpy's generators,
so signatures are identical across numpy versions, processes and machines.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipelines.text import spaced_words, words

U64 = np.uint64
MASK64 = (1 << 64) - 1
EMPTY = np.uint32(0xFFFFFFFF)  # signature value of a document without shingles
_TABLE_POSITIONS = 64  # byte positions with their own tabulation row (a power of two)
_CHUNK_CELLS = 1 << 21  # num_perm x shingles cells per block: 8 MiB of uint32


@dataclass(frozen=True)
class MinHashParams:
    num_perm: int = 256
    ngram: int = 5  # words per shingle
    seed: int = 1

    def __post_init__(self) -> None:
        if self.num_perm < 1 or self.ngram < 1:
            raise ValueError("need num_perm >= 1 and ngram >= 1")


@dataclass(frozen=True)
class Hasher:
    """The random constants of one ``MinHashParams`` (build with ``make_hasher``)."""

    params: MinHashParams
    byte_table: np.ndarray  # uint64 [_TABLE_POSITIONS * 256]: tabulation hash of words
    gram_weights: np.ndarray  # uint64 [ngram]: odd multipliers, position of a word in a shingle
    perm_a: np.ndarray  # uint32 [num_perm]: odd multipliers of the hash functions
    perm_b: np.ndarray  # uint32 [num_perm]


def splitmix64(seed: int, n: int) -> np.ndarray:
    """``n`` pseudo-random uint64 from ``seed``; plain integer math, stable everywhere."""
    out = np.empty(n, dtype=U64)
    state = seed & MASK64
    for i in range(n):
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        out[i] = z ^ (z >> 31)
    return out


def _byte_table(seed: int) -> np.ndarray:
    table = splitmix64(seed, _TABLE_POSITIONS * 256).reshape(_TABLE_POSITIONS, 256)
    table[:, 0x20] = 0  # the word separator adds nothing to a word's hash
    return table.ravel()


@functools.lru_cache(maxsize=16)
def make_hasher(params: MinHashParams) -> Hasher:
    # Distinct seeds per constant family so no two families share a stream.
    seed = params.seed * 0x100000001B3
    return Hasher(
        params=params,
        byte_table=_byte_table(seed + 1),
        gram_weights=splitmix64(seed + 2, params.ngram) | U64(1),
        perm_a=(splitmix64(seed + 3, params.num_perm) >> U64(32)).astype(np.uint32) | np.uint32(1),
        perm_b=(splitmix64(seed + 4, params.num_perm) >> U64(32)).astype(np.uint32),
    )


def fmix64(h: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer (a bijection): spreads every input bit over the output."""
    h = h ^ (h >> U64(33))
    h = h * U64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> U64(33))
    h = h * U64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> U64(33))


def word_hashes(spaced: Sequence[bytes], hasher: Hasher) -> tuple[np.ndarray, np.ndarray]:
    """uint64 hash of every word of every document, concatenated in order, and the documents'
    word counts. ``spaced``: each document's words as ``pipelines.text.spaced_words`` gives
    them (UTF-8, separated by runs of spaces)."""
    joined = b" ".join(spaced)
    buf = np.frombuffer(joined, dtype=np.uint8)
    # Word characters never encode to a space byte (UTF-8 continuation bytes are >= 0x80), so
    # spaces are exactly the word boundaries; the table maps a space to 0 at every position,
    # so each word's segment (the word and the spaces after it) sums to the word's hash alone.
    is_sep = buf == 0x20
    is_start = ~is_sep
    is_start[1:] &= is_sep[:-1]
    starts = np.flatnonzero(is_start)
    lengths = np.fromiter(map(len, spaced), dtype=np.int64, count=len(spaced))
    ends = np.cumsum(lengths + 1) - 1  # one past each document's bytes (joined by one space)
    word_counts = np.searchsorted(starts, ends) - np.searchsorted(starts, ends - lengths)
    if starts.size == 0:
        return np.zeros(0, dtype=U64), word_counts
    index = np.arange(buf.size, dtype=np.int32 if buf.size < 2**31 else np.int64)
    position = index - np.maximum.accumulate(np.where(is_sep, index + 1, 0))
    values = hasher.byte_table[(position & (_TABLE_POSITIONS - 1)) << 8 | buf]
    if position.max() >= _TABLE_POSITIONS:
        # Rows repeat past 64 bytes; an odd factor per 64-byte block keeps long words that
        # differ only by a rotation of whole blocks (the same (row, byte) multiset) apart.
        values = values * ((position >> 6) * 2 + 1).astype(U64)
    return fmix64(np.add.reduceat(values, starts)), word_counts


def shingle_counts(word_counts: np.ndarray, ngram: int) -> np.ndarray:
    """Shingles per document: one per ngram window; a shorter non-empty document is one shingle."""
    return np.where(word_counts >= ngram, word_counts - ngram + 1, (word_counts > 0).astype(int))


def shingle_hashes(
    hashes: np.ndarray, word_counts: np.ndarray, hasher: Hasher
) -> tuple[np.ndarray, np.ndarray]:
    """uint32 hashes of every word ngram of every document (concatenated), and counts per doc."""
    ngram = hasher.params.ngram
    counts = shingle_counts(word_counts, ngram)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.uint32), counts
    word_starts = np.concatenate(([0], np.cumsum(word_counts)[:-1]))
    word_ends = word_starts + word_counts
    shingle_offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
    # Global index of each shingle's first word: its document's first word + its rank there.
    rank = np.arange(total) - np.repeat(shingle_offsets, counts)
    first = np.repeat(word_starts, counts) + rank
    end = np.repeat(word_ends, counts)
    padded = np.concatenate((hashes, np.zeros(ngram, dtype=U64)))
    acc = np.zeros(total, dtype=U64)
    for k in range(ngram):
        # Short documents have fewer than ngram words: their missing words count as 0.
        word = np.where(first + k < end, padded[first + k], U64(0))
        acc += word * hasher.gram_weights[k]
    # 32 bits per shingle: a collision between two distinct shingles (p = 2**-32 per pair)
    # moves a Jaccard estimate by far less than its sampling noise.
    return (fmix64(acc) >> U64(32)).astype(np.uint32), counts


def minhash(shingles: np.ndarray, counts: np.ndarray, hasher: Hasher) -> np.ndarray:
    """uint32 [docs, num_perm] signatures; documents without shingles get all ``EMPTY``."""
    num_perm = hasher.params.num_perm
    n_docs = counts.size
    sigs = np.full((n_docs, num_perm), EMPTY, dtype=np.uint32)
    nonempty = np.flatnonzero(counts > 0)
    if nonempty.size == 0:
        return sigs
    ends = np.cumsum(counts)[nonempty]
    starts = ends - counts[nonempty]
    total = int(ends[-1])
    chunk = max(1, _CHUNK_CELLS // num_perm)
    # [num_perm, chunk]: the reduction runs along contiguous memory, which numpy does with SIMD.
    block = np.empty((num_perm, chunk), dtype=np.uint32)
    a = hasher.perm_a[:, None]
    b = hasher.perm_b[:, None]
    for c0 in range(0, total, chunk):
        c1 = min(c0 + chunk, total)
        # Documents overlapping [c0, c1): each is one contiguous, non-empty run in it.
        d0 = int(np.searchsorted(ends, c0, side="right"))
        d1 = int(np.searchsorted(starts, c1, side="left"))
        values = block[:, : c1 - c0]
        np.multiply(shingles[None, c0:c1], a, out=values)  # wraps: arithmetic mod 2**32
        values += b
        seg = np.maximum(starts[d0:d1], c0) - c0
        docs = nonempty[d0:d1]
        sigs[docs] = np.minimum(sigs[docs], np.minimum.reduceat(values, seg, axis=1).T)
    return sigs


def signatures(texts: Sequence[str], hasher: Hasher) -> tuple[np.ndarray, np.ndarray]:
    """MinHash signatures of a batch of texts and their shingle counts, in a few numpy calls."""
    hashes, word_counts = word_hashes([spaced_words(t) for t in texts], hasher)
    shingles, counts = shingle_hashes(hashes, word_counts, hasher)
    return minhash(shingles, counts, hasher), counts


def band_hashes(sigs: np.ndarray, bands: int, rows: int, seed: int = 1) -> np.ndarray:
    """uint64 [docs, bands]: one bucket key per band of ``rows`` consecutive signature values."""
    if bands * rows > sigs.shape[1]:
        raise ValueError(f"bands*rows = {bands * rows} > num_perm = {sigs.shape[1]}")
    weights = splitmix64(seed * 0x100000001B3 + 5, rows) | U64(1)
    x = sigs[:, : bands * rows].reshape(sigs.shape[0], bands, rows).astype(U64)
    return fmix64((x * weights).sum(axis=2, dtype=U64))


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Fraction of equal signature values: an unbiased estimate of the shingle-set Jaccard."""
    return np.mean(a == b, axis=-1)


# ---- LSH parameters -------------------------------------------------------------------------


def candidate_probability(s: np.ndarray | float, bands: int, rows: int) -> np.ndarray:
    """P(two documents with Jaccard ``s`` share at least one band bucket)."""
    return 1.0 - (1.0 - np.asarray(s, dtype=np.float64) ** rows) ** bands


def _integral(bands: np.ndarray, rows: np.ndarray, lo: float, hi: float) -> np.ndarray:
    # Gauss-Legendre with 160 nodes is exact for polynomials of degree < 320; the integrand is
    # a polynomial of degree bands*rows <= num_perm, so this matches scipy's quad (datasketch).
    nodes, node_weights = np.polynomial.legendre.leggauss(160)
    s = (hi - lo) / 2 * nodes + (hi + lo) / 2
    p = 1.0 - (1.0 - s[None, :] ** rows[:, None]) ** bands[:, None]
    return (hi - lo) / 2 * (p * node_weights).sum(axis=1)


def lsh_error_areas(threshold: float, bands: int, rows: int) -> tuple[float, float]:
    """(false positive area below ``threshold``, false negative area above it)."""
    b, r = np.array([bands]), np.array([rows])
    fp = float(_integral(b, r, 0.0, threshold)[0])
    fn = float((1.0 - threshold) - _integral(b, r, threshold, 1.0)[0])
    return fp, fn


def optimal_bands(
    threshold: float,
    num_perm: int,
    false_positive_weight: float = 0.5,
    false_negative_weight: float = 0.5,
) -> tuple[int, int]:
    """(bands, rows) with bands*rows <= num_perm minimizing the weighted error areas.

    The same objective as datasketch's ``MinHashLSH._optimal_param``: the area under the
    candidate-probability S-curve below the threshold (false positives) and above it (false
    negatives), weighted. Ties go to the first (fewest bands) pair, as in datasketch.
    """
    if not 0.0 < threshold < 1.0:
        raise ValueError("threshold must be in (0, 1)")
    pairs = np.array([(b, r) for b in range(1, num_perm + 1) for r in range(1, num_perm // b + 1)])
    b, r = pairs[:, 0], pairs[:, 1]
    fp = _integral(b, r, 0.0, threshold)
    fn = (1.0 - threshold) - _integral(b, r, threshold, 1.0)
    best = int(np.argmin(fp * false_positive_weight + fn * false_negative_weight))
    return int(b[best]), int(r[best])


# ---- exact reference (tests, quality checks) --------------------------------------------------


def shingle_set(text: str, ngram: int = 5) -> set[tuple[str, ...]]:
    """The exact shingle set that ``signatures`` hashes: word ngrams, or all words if fewer."""
    ws = words(text)
    if 0 < len(ws) < ngram:
        return {tuple(ws)}
    return {tuple(ws[i : i + ngram]) for i in range(len(ws) - ngram + 1)}


def jaccard(a: set, b: set) -> float:
    if not a and not b:
        return 0.0
    return len(a & b) / len(a | b)


# ---- in-memory LSH (benchmarks, tests; the Beam stage does the same in a distributed way) -----


def bucket_links(band_keys: np.ndarray) -> np.ndarray:
    """Distinct candidate pairs ``[k, 2]`` (head, member) of an in-memory LSH index.

    Every band bucket holding several documents links each member to the bucket's smallest
    document index (its head) instead of emitting all pairs, so a bucket of ``m`` documents
    costs ``m - 1`` pairs, not ``m * (m - 1) / 2``: the rule the Beam stage applies per bucket.
    """
    n, b = band_keys.shape
    if n == 0:
        return np.zeros((0, 2), dtype=np.int64)
    band = np.tile(np.arange(b), n)
    doc = np.repeat(np.arange(n), b)
    key = band_keys.ravel()
    order = np.lexsort((doc, key, band))
    band, key, doc = band[order], key[order], doc[order]
    first = np.ones(order.size, dtype=bool)
    first[1:] = (band[1:] != band[:-1]) | (key[1:] != key[:-1])
    head = doc[first][np.cumsum(first) - 1]
    member = doc != head
    return np.unique(np.stack((head[member], doc[member]), axis=1), axis=0)


def verified(sigs: np.ndarray, pairs: np.ndarray, threshold: float) -> np.ndarray:
    """Boolean mask of the candidate pairs whose estimated Jaccard reaches ``threshold``."""
    return estimated_jaccard(sigs[pairs[:, 0]], sigs[pairs[:, 1]]) >= threshold
