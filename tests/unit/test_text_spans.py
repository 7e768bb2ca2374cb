"""Span and n-gram helpers shared by quality, exact dedup and decontamination."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from pipelines.exact_dedup import remove_spans
from pipelines.text import (
    dedup_key_text,
    line_spans,
    ngram_hashes,
    ngram_hashes_by_length,
    normalize_text,
    paragraph_spans,
    sorted_unique,
    spaced_words,
    span_dedup_keys,
    token_hashes,
    words,
)


def pieces(text: str, spans: list[tuple[int, int]]) -> list[str]:
    return [text[s:e] for s, e in spans]


def test_lines_and_paragraphs():
    text = "  first line\nsecond line  \n\n \t\nthird paragraph\n\n\nlast"
    assert pieces(text, line_spans(text)) == [
        "first line",
        "second line",
        "third paragraph",
        "last",
    ]
    assert pieces(text, paragraph_spans(text)) == [
        "first line\nsecond line",
        "third paragraph",
        "last",
    ]
    assert paragraph_spans("") == [] and line_spans("\n\n") == []


def stripped_lines(text: str) -> list[tuple[int, int]]:
    """The definition: split at newlines, each line's ``strip()`` bounds, blank lines skipped."""
    spans, start = [], 0
    for line in text.split("\n"):
        if line.strip():
            left = start + len(line) - len(line.lstrip())
            spans.append((left, left + len(line.strip())))
        start += len(line) + 1
    return spans


def joined_paragraphs(text: str) -> list[tuple[int, int]]:
    """The definition: consecutive such lines joined unless a blank line lies between."""
    spans: list[tuple[int, int]] = []
    for start, end in stripped_lines(text):
        if spans and text.count("\n", spans[-1][1], start) < 2:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


# newlines, other whitespace (some of it line-breaking elsewhere), letters, symbols
ALPHABET = ["\n", "\n", " ", "\t", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\xa0", "\u2028", "\u3000"]
ALPHABET += ["a", "b", "é", "Z", "7", ".", "—", "\U0001f600"]


@pytest.mark.parametrize("seed", range(4))
def test_line_and_paragraph_spans_follow_their_definitions(seed):
    rng = random.Random(seed)
    for _ in range(500):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(40)))
        assert line_spans(text) == stripped_lines(text), repr(text)
        assert paragraph_spans(text) == joined_paragraphs(text), repr(text)


def test_regex_whitespace_is_str_isspace():
    """The span patterns' ``\\s`` must mean what ``str.strip`` strips, on every code point."""
    import re

    space = re.compile(r"\s")
    assert all(
        bool(space.match(chr(c))) == chr(c).isspace()
        for c in range(0x110000)
        if c < 0xD800 or c > 0xDFFF
    )


ASCII = ["\n", "\n", " ", " ", "\t", "\r", "\x0b", "\x0c", "\x1c", "\x1f", "a", "B", "z", "7"]
ASCII += ["_", ",", ".", "'", "-", "$", "\x00", "\x7f"]


def test_span_dedup_keys_equal_each_spans_dedup_key_text():
    rng = random.Random(5)
    for text in [
        "Hello,  World!\n\nThe  END. \tof it\nmore_words 42",
        "Ünïcode café\n\nplain ascii here\n\nΣίσυφος  writes",
        *(
            "".join(rng.choice([*ALPHABET, "x", "y", ",", "_"]) for _ in range(60))
            for _ in range(300)
        ),
        # ASCII only: the one-translation path, ASCII's other whitespace and "_" included
        *("".join(rng.choice(ASCII) for _ in range(60)) for _ in range(300)),
    ]:
        spans = paragraph_spans(text) + line_spans(text)
        expected = [dedup_key_text(text[s:e]).encode("utf-8") for s, e in spans]
        assert span_dedup_keys(text, spans) == expected, repr(text)


def test_paragraph_spans_accept_precomputed_lines():
    text = "a\nb\n\nc"
    assert paragraph_spans(text, line_spans(text)) == paragraph_spans(text)


def test_remove_spans_leaves_the_rest_as_it_was():
    text = "one two three\n\nfour five six\n\nseven eight nine"
    spans = paragraph_spans(text)
    assert remove_spans(text, [spans[1]], "paragraph") == "one two three\n\nseven eight nine"
    assert remove_spans(text, [spans[2]], "paragraph") == "one two three\n\nfour five six"
    lines = "a b\nc d\ne f"
    assert remove_spans(lines, [line_spans(lines)[0]], "line") == "c d\ne f"
    # Code keeps its indentation and its blank lines; the text's final newline stays.
    code = "def f(x):\n    if x:\n        return 1\n\n    return 2\n    shared = 1\n"
    units = line_spans(code)
    assert remove_spans(code, [units[1]], "line") == (
        "def f(x):\n        return 1\n\n    return 2\n    shared = 1\n"
    )
    assert remove_spans(code, [units[-1]], "line") == (
        "def f(x):\n    if x:\n        return 1\n\n    return 2\n"
    )
    indented = "  first\n  paragraph\n\n\n  second\n"
    first, _ = paragraph_spans(indented)
    assert remove_spans(indented, [first], "paragraph") == "  second\n"


def test_ngram_hashes_are_stable_and_position_free():
    tokens = ["the", "cat", "sat", "on", "the", "mat", "the", "cat", "sat"]
    hashes = ngram_hashes(token_hashes(tokens), 3)
    assert len(hashes) == len(tokens) - 2 and hashes.dtype == np.uint64
    assert hashes[0] == hashes[6]  # "the cat sat" twice
    assert len(set(hashes.tolist())) == 6
    # The same n-gram hashes the same inside any text, in any process (xxh3, no salt).
    alone = ngram_hashes(token_hashes(["the", "cat", "sat"]), 3)
    assert alone.tolist() == [hashes[0]]
    assert ngram_hashes(token_hashes(["a"]), 3).tolist() == []


def test_token_hash_is_xxh3():
    import xxhash

    assert int(token_hashes(["slipway"])[0]) == xxhash.xxh3_64_intdigest(b"slipway")


@pytest.mark.parametrize("size", [0, 1, 7, 8, 13, 14, 200])
def test_ngram_hashes_by_length_match_one_length_at_a_time(size):
    """Grown length by length, the hashes equal the polynomial hash of each length written out
    in Python integers (and ``ngram_hashes``'s); lengths that no longer fit end the sequence."""
    hashes = np.random.default_rng(size).integers(0, 2**64 - 1, size, dtype=np.uint64)
    lengths = [2, 3, 5, 8, 9, 13, 20]
    grown = list(ngram_hashes_by_length(hashes, lengths))

    def polynomial(n: int) -> np.ndarray:
        values = []
        for i in range(size - n + 1):
            h = 0
            for t in hashes[i : i + n].tolist():
                h = (h * 0x9E3779B97F4A7C15 + t) % 2**64
            values.append(h)
        return np.array(values, dtype=np.uint64)

    expected = [(n, polynomial(n)) for n in lengths if size >= n]
    for n, want in expected:
        np.testing.assert_array_equal(ngram_hashes(hashes, n), want)
    assert [n for n, _ in grown] == [n for n, _ in expected]
    for (_, got), (_, want) in zip(grown, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_ngram_hashes_by_length_wants_ascending_lengths():
    with pytest.raises(ValueError, match="ascending"):
        list(ngram_hashes_by_length(np.arange(20, dtype=np.uint64), [5, 3]))


def test_sorted_unique_equals_numpy_unique():
    values = np.random.default_rng(3).integers(0, 50, 400, dtype=np.uint64)
    for part in (values[:0], values[:1], values):
        np.testing.assert_array_equal(sorted_unique(part), np.unique(part))


def test_ascii_fast_paths_tokenize_as_the_regex_does():
    """``words``, ``spaced_words`` and ``dedup_key_text`` translate ASCII text byte by byte;
    they must split exactly where the ``\\w+`` regex does on the lowered text, on every ASCII
    character and on text that is not ASCII (which takes the regex)."""
    every_ascii = "".join(chr(c) for c in range(128))
    rng = random.Random(7)
    alphabet = [chr(c) for c in range(128)] + list("ÄéßΣ東京ǅ٣ª\u00a0\u2028")
    texts = [every_ascii, "", "   ", "_a_ B9\tc\x00d", "Hello,  WORLD!", "naïve café"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(60))) for _ in range(500)]
    texts += [
        "".join(chr(rng.randrange(128)) for _ in range(rng.randrange(60))) for _ in range(500)
    ]
    for text in texts:
        expected = re.findall(r"\w+", text.lower())
        assert words(text) == expected, text
        assert spaced_words(text).split() == [w.encode() for w in expected], text
        assert dedup_key_text(text) == " ".join(expected), text
    assert words(every_ascii) == [
        "0123456789",
        "abcdefghijklmnopqrstuvwxyz",
        "_",
        "abcdefghijklmnopqrstuvwxyz",
    ]


def test_normalize_text_keeps_indentation_but_the_first_lines_spaces():
    """As its docstring says: every later stage's outputs depend on this exact form."""
    code = "\n\n    def area(r):\n        return r * r   \n\n\n\n# end\n"
    assert normalize_text(code) == "def area(r):\n        return r * r\n\n# end"
    assert normalize_text("\tindented by a tab") == "\tindented by a tab"
