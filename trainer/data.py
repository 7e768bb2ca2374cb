"""Deterministic, seeded, block-based mixture of token stores.

A training sequence is a window of ``seq_len + 1`` tokens (inputs and shifted targets) starting
at a multiple of ``seq_len`` in one source's flat token array. Global sequence number ``g``
(= step * batch_size + row) is mapped to a window by pure arithmetic:

1. block ``g // block`` holds exactly ``round(w_i * block)`` sequences of source ``i``
   (largest-remainder rounding so counts sum to ``block``; Levanter's block mixture), in an
   order shuffled by ``(seed, block)``;
2. the ``m``-th sequence of source ``i`` overall is window ``perm_{seed,i,epoch}(m mod n_i)``
   of that source, where ``perm`` is a keyed Feistel permutation (cycle-walking), so each
   epoch visits every window once in a fresh order without materializing anything.

So the batch at step ``n`` is a pure function of ``(seed, n)``: resuming needs no loader state,
and each host reads only its own rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from tokenstore import TokenStore


def block_counts(weights: Sequence[float], block: int) -> np.ndarray:
    """Per-source counts in a block: round(w_i * block), fixed up to sum exactly to block."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    exact = w * block
    counts = np.floor(exact).astype(np.int64)
    short = block - counts.sum()
    order = np.argsort(-(exact - counts), kind="stable")  # largest remainders first
    counts[order[:short]] += 1
    return counts


def _key(*parts: int) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def feistel_permute(x: np.ndarray, n: int, key: int, rounds: int = 4) -> np.ndarray:
    """A keyed bijection of [0, n) applied to x (vectorized; cycle-walking over a power of 4)."""
    if n <= 1:
        return np.zeros_like(x)
    bits = max(2, int(np.ceil(np.log2(n))))
    bits += bits % 2
    half = bits // 2
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(_key(key, r) & ((1 << 32) - 1)) for r in range(rounds)]

    def once(v: np.ndarray) -> np.ndarray:
        left, right = v >> np.uint64(half), v & mask
        for k in keys:
            f = (right * np.uint64(0x9E3779B1) + k) & np.uint64(0xFFFFFFFF)
            f = ((f ^ (f >> np.uint64(15))) * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
            f = (f ^ (f >> np.uint64(12))) & mask
            left, right = right, left ^ f
        return (left << np.uint64(half)) | right

    v = np.asarray(x, dtype=np.uint64)
    out = once(v)
    pending = out >= n
    while pending.any():  # cycle-walk: re-apply until inside [0, n); terminates (bijection)
        out[pending] = once(out[pending])
        pending = out >= n
    return out.astype(np.int64)


class MixtureLoader:
    def __init__(
        self,
        stores: Sequence[TokenStore],
        weights: Sequence[float],
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        block_size: int = 2048,
    ) -> None:
        if len(stores) != len(weights) or not stores:
            raise ValueError("need one weight per store")
        self.stores = list(stores)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.block_size = block_size
        self.counts = block_counts(weights, block_size)
        self.windows = [(s.num_tokens - 1) // seq_len for s in self.stores]
        for i, (n, c) in enumerate(zip(self.windows, self.counts, strict=True)):
            if c > 0 and n < 1:
                raise ValueError(
                    f"data.sources[{i}] has {self.stores[i].num_tokens} tokens: fewer than one "
                    f"window of seq_len + 1 = {seq_len + 1}"
                )
        vocab = {s.vocab_size for s in self.stores}
        eos = {s.eos_id for s in self.stores}
        if len(vocab) != 1 or len(eos) != 1:
            raise ValueError(f"token stores disagree on vocab_size {vocab} or eos_id {eos}")
        # Two tokenizers of one size agree on both: only the ledger's hash tells them apart,
        # and mixing them would train on ids that mean different pieces.
        tokenizers = [s.ledger.tokenizer_sha256 for s in self.stores]
        if len(set(tokenizers)) != 1:
            shown = ", ".join(f"data.sources[{i}]: {t[:12]}" for i, t in enumerate(tokenizers))
            raise ValueError(f"token stores were made with different tokenizers ({shown})")
        self.vocab_size, self.eos_id = vocab.pop(), eos.pop()

    @lru_cache(maxsize=4)  # noqa: B019 - a handful of blocks per loader, freed with it
    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index-within-source) of every position of a block."""
        src = np.repeat(np.arange(len(self.counts)), self.counts)
        rng = np.random.default_rng([self.seed, block, 0x5EED])
        src = src[rng.permutation(self.block_size)]
        rank = np.empty(self.block_size, np.int64)
        for i, c in enumerate(self.counts):
            where = np.nonzero(src == i)[0]
            rank[where] = block * c + np.arange(len(where))
        return src, rank

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sequence numbers -> (source, window start token)."""
        g = np.asarray(g, np.int64)
        src = np.empty(len(g), np.int64)
        idx = np.empty(len(g), np.int64)
        for block in np.unique(g // self.block_size):
            here = g // self.block_size == block
            s, m = self._block(int(block))
            p = g[here] % self.block_size
            src[here], idx[here] = s[p], m[p]
        start = np.empty(len(g), np.int64)
        windows = np.asarray(self.windows, np.int64)
        epoch, r = np.divmod(idx, np.maximum(windows[src], 1))
        # one vectorized permutation per (source, epoch) present: a batch touches one or two
        for i, e in {(int(a), int(b)) for a, b in zip(src, epoch, strict=True)}:
            sel = (src == i) & (epoch == e)
            w = feistel_permute(r[sel], int(windows[i]), _key(self.seed, i, e))
            start[sel] = w * self.seq_len
        return src, start

    def rows(self, step: int, rows: Sequence[int] | range) -> np.ndarray:
        """Rows ``rows`` of the global batch at ``step``: int32 (len(rows), seq_len + 1)."""
        g = step * self.batch_size + np.asarray(list(rows), np.int64)
        src, start = self.locate(g)
        out = np.empty((len(g), self.seq_len + 1), np.int32)
        for j in range(len(g)):
            out[j] = self.stores[src[j]].read(int(start[j]), self.seq_len + 1)
        return out

    def batch(self, step: int) -> np.ndarray:
        return self.rows(step, range(self.batch_size))


def unigram_entropy(store: TokenStore, max_tokens: int = 1 << 22) -> float:
    """Unigram entropy of the store's tokens in nats (the loss of the best context-free model)."""
    toks = store.read(0, min(store.num_tokens, max_tokens)).astype(np.int64)
    counts = np.bincount(toks, minlength=store.vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
