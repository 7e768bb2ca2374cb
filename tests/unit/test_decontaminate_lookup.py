"""Decontamination's lookup: the bitmap prefilter of large eval tables never loses a match."""

from __future__ import annotations

import random

import numpy as np

from pipelines.configs import DecontaminateConfig
from pipelines.decontaminate import (
    PREFILTER_MIN_HASHES,
    EvalLookup,
    HashPrefilter,
    build_index,
)


def _hashes(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.unique(rng.integers(0, 2**64, size=n, dtype=np.uint64))


def test_prefilter_keeps_every_member_and_rules_out_most_others():
    rng = np.random.default_rng(0)
    table = _hashes(rng, 50_000)
    prefilter = HashPrefilter(table)
    assert prefilter.maybe(table).all()
    assert prefilter.bitmap.nbytes * 8 >= 32 * len(table)  # ~32 bits per hash
    others = np.setdiff1d(_hashes(rng, 200_000), table)
    passed = prefilter.maybe(others).mean()
    assert passed < 0.1, passed  # ~3% expected; a wrong shift or bit order passes ~all or none
    # the edges: one hash (5 bits: a 4-byte bitmap), and none
    one = HashPrefilter(table[:1])
    assert one.maybe(table[:1]).all() and one.bitmap.nbytes >= 4
    assert not HashPrefilter(table[:0]).maybe(table).any()


def test_large_tables_match_exactly_as_without_the_prefilter():
    rng = random.Random(0)
    vocabulary = [f"w{i}" for i in range(3000)]
    eval_docs = [
        {"id": f"e{i}", "text": " ".join(rng.choices(vocabulary, k=30)), "source": s}
        for i, s in enumerate(["arc"] * 250 + ["piqa"] * 150)
    ]
    # texts of 8-12 words are used whole: small tables, searched without a prefilter
    eval_docs += [
        {"id": f"s{i}", "text": " ".join(rng.choices(vocabulary, k=9)), "source": "piqa"}
        for i in range(20)
    ]
    lookup = EvalLookup(build_index(eval_docs, DecontaminateConfig(ngram=13, min_short_words=8)))
    assert len(lookup.tables[13][0]) >= PREFILTER_MIN_HASHES and 13 in lookup.prefilters
    assert 9 in lookup.tables and 9 not in lookup.prefilters

    docs = []
    for i in range(300):
        words = rng.choices(vocabulary, k=rng.randint(5, 400))
        if i % 3 == 0:  # a passage of an eval text (13+ words, or a short text whole)
            source = rng.choice(eval_docs)["text"].split()
            start = rng.randint(0, max(0, len(source) - 13))
            at = rng.randint(0, len(words))
            words[at:at] = source[start : start + rng.randint(13, 30)]
        docs.append(" ".join(words))

    with_prefilter = [lookup.matches(text, 1) for text in docs]
    lookup.prefilters = {}  # every table searched in full: the reference
    without = [lookup.matches(text, 1) for text in docs]
    assert with_prefilter == without
    matched = [m for m, _ in with_prefilter if m]
    assert 90 <= len(matched) <= 150, len(matched)  # the planted passages (and only they) match
