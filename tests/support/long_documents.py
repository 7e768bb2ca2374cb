"""Documents of many megabytes for the quality filter's test and benchmark: prose-like lines
(8-20 words drawn from a real paragraph's vocabulary, seeded) and one token with no space.

A single crawled page can be megabytes long; the filter must score it in time linear in its
length. The test checks what such a page scores; ``tests/bench/bench_quality_scaling.py``
times it at growing sizes.
"""

from __future__ import annotations

import numpy as np

ENGLISH = (
    "The history of the river valley is closely tied to the farmers who settled there in the"
    " early years of the century. They cleared the land, built small houses with timber from"
    " the nearby hills, and planted wheat and barley along the banks. Over time the villages"
    " grew into market towns, and the roads that connected them carried goods to the coast."
    " Many of the old stone bridges still stand today, and visitors come to see them in the"
    " summer months when the water is low. Local historians have collected letters, diaries"
    " and photographs from those years, and the small museum near the church shows how people"
    " lived, worked and traded with each other before the railway arrived."
)

SHAPES = ("prose", "one_long_token")


def prose(chars: int) -> str:
    """``chars`` characters of lines of 8-20 words from ``ENGLISH``'s vocabulary."""
    rng = np.random.default_rng(0)
    vocab = ENGLISH.replace(",", "").replace(".", "").lower().split()
    words = [vocab[i] for i in rng.integers(0, len(vocab), chars // 5).tolist()]
    lengths = rng.integers(8, 21, len(words) // 8).tolist()
    lines, at = [], 0
    for length in lengths:
        if at >= len(words):
            break
        lines.append(" ".join(words[at : at + length]) + ".")
        at += length
    return "\n".join(lines)[:chars]


def long_document(shape: str, chars: int) -> str:
    """A document of exactly ``chars`` characters of the given shape (one of ``SHAPES``)."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    text = prose(chars) if shape == "prose" else "x" * chars
    if len(text) != chars:
        raise ValueError(f"asked for {chars} characters of {shape}, made {len(text)}")
    return text
