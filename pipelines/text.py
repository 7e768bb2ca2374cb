"""Pure text helpers shared by stages: normalization and word/n-gram tokenization."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

# Control characters other than tab and newline, plus BOM and zero-width characters.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\u200b-\u200d\u2060]")
_TRAILING_SPACE = re.compile(r"[ \t\u00a0]+$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")
_WORD = re.compile(r"\w+", re.UNICODE)
# The ASCII characters ``\w`` matches (letters, digits, "_"), and a byte translation that keeps
# them and turns every other byte into a space.
ASCII_WORD_CHARS = bytes(c for c in range(128) if chr(c).isalnum() or chr(c) == "_")
_ASCII_WORD_BYTES = bytes(c if c in ASCII_WORD_CHARS else 0x20 for c in range(256))


def normalize_text(text: str) -> str:
    """NFC, unified newlines, control characters removed, trailing spaces and blank runs trimmed.

    Indentation is kept on every line but the first (code is a source too): the text's leading
    and trailing newlines and spaces are stripped, so its first line loses its leading spaces
    (not its tabs). Ingest's texts, and so every later stage's outputs, depend on this form.
    """
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip("\n ")


def words(text: str) -> list[str]:
    """Lowercased word tokens (letters/digits/underscore), the unit of dedup and decontamination.
    ASCII text is split after one byte translation (``spaced_words``): 0.66 s instead of the
    regex's 1.07 s for the demo's 22,736 texts."""
    if text.isascii():
        return spaced_words(text).decode("ascii").split()
    return _WORD.findall(text.lower())


def spaced_words(text: str) -> bytes:
    r"""``words(text)`` in UTF-8, separated by runs of one or more spaces (maybe also leading or
    trailing): what vectorized hashing reads. ASCII text takes one byte translation instead of
    a regex match and a string per word; on ASCII, ``\w`` is exactly letters, digits and "_"."""
    if text.isascii():
        return text.lower().encode("ascii").translate(_ASCII_WORD_BYTES)
    return " ".join(words(text)).encode("utf-8")


def dedup_key_text(text: str) -> str:
    """Text as compared by exact dedup: case, punctuation and whitespace differences ignored."""
    if text.isascii():
        return b" ".join(spaced_words(text).split()).decode("ascii")
    return " ".join(words(text))


# --- spans and n-gram hashing (used by quality, exact dedup and decontamination) -------------


# A line's text without its surrounding whitespace: a non-space, then the rest of its line up
# to its last non-space. ``\s`` is ``str.isspace`` (both are ``Py_UNICODE_ISSPACE``), so these
# are ``line.strip()``'s bounds; only newlines separate lines.
_LINE = re.compile(r"\S(?:[^\n]*\S)?")
# A paragraph: such lines joined while one newline (and no blank line) lies between them. The
# possessive separators make a failed join give up at once instead of re-splitting whitespace.
_PARAGRAPH = re.compile(r"\S(?:[^\n]*\S)?(?:[^\S\n]*+\n[^\S\n]*+\S(?:[^\n]*\S)?)*+")


def line_spans(text: str) -> list[tuple[int, int]]:
    """``[start, end)`` spans of the non-blank lines of ``text`` (lines end at newlines only),
    each without its leading and trailing whitespace. Linear in the text, whatever its shape."""
    return [match.span() for match in _LINE.finditer(text)]


def paragraph_spans(
    text: str, lines: Sequence[tuple[int, int]] | None = None
) -> list[tuple[int, int]]:
    """Spans of paragraphs: maximal runs of non-blank lines, separated by blank lines.

    A paragraph runs from the first non-blank character of its first line to the last
    non-blank character of its last line, so the spans never include the separators.
    ``lines`` may pass ``line_spans(text)`` when the caller already has it.
    """
    if lines is None:
        return [match.span() for match in _PARAGRAPH.finditer(text)]
    spans: list[tuple[int, int]] = []
    previous_end = -1
    for start, end in lines:
        # Consecutive lines belong together unless a blank line (two newlines) lies between.
        if spans and text.count("\n", previous_end, start) < 2:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
        previous_end = end
    return spans


def span_dedup_keys(text: str, spans: Sequence[tuple[int, int]]) -> list[bytes]:
    """``dedup_key_text(text[start:end])`` in UTF-8 for each span; an ASCII text is lowered and
    translated once for all its spans."""
    if not text.isascii():
        return [dedup_key_text(text[s:e]).encode("utf-8", "surrogatepass") for s, e in spans]
    spaced = spaced_words(text)  # one byte per character: spans index it as they index text
    return [b" ".join(spaced[s:e].split()) for s, e in spans]


# Multiplier of the polynomial n-gram hash: an odd 64-bit constant (from splitmix64), so each
# step of the rolling hash is a bijection on 64-bit words.
_NGRAM_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def token_hashes(tokens: Sequence[str]) -> np.ndarray:
    """Stable 64-bit hashes (xxh3_64 of the UTF-8 token), one per token, as ``uint64``.

    Each distinct token is hashed once; the same token gets the same hash in every process.
    """
    table = {
        token: xxhash.xxh3_64_intdigest(token.encode("utf-8", "surrogatepass"))
        for token in dict.fromkeys(tokens)
    }
    return np.fromiter(map(table.__getitem__, tokens), dtype=np.uint64, count=len(tokens))


def ngram_hashes(hashes: np.ndarray, n: int) -> np.ndarray:
    """64-bit hashes of every contiguous n-gram of a token-hash array (``len - n + 1`` of them).

    ``h = ((t0 * M + t1) * M + t2) ...`` modulo 2**64 over random 64-bit token hashes: two
    different n-grams collide with probability about 2**-64. Vectorized, O(n * len) work.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    for _, grams in ngram_hashes_by_length(hashes, [n]):
        return grams
    return np.zeros(0, dtype=np.uint64)


def ngram_hashes_by_length(
    hashes: np.ndarray, lengths: Sequence[int]
) -> Iterator[tuple[int, np.ndarray]]:
    """``(n, ngram_hashes(hashes, n))`` for each ``n`` of ascending ``lengths``, each length
    grown from the previous one by one multiply-add (``h(n+1) = h(n) * M + t[i+n]``): max(n)
    passes over the text instead of sum(n), with the same hashes."""
    current = 0
    grams = np.zeros(0, dtype=np.uint64)
    for n in lengths:
        if n < 1 or n < current:
            raise ValueError("lengths must be >= 1 and ascending")
        count = len(hashes) - n + 1
        if count <= 0:
            return  # longer n-grams do not fit either
        if current == 0:
            grams, current = hashes.copy(), 1
        with np.errstate(over="ignore"):
            while current < n:
                grams = grams[: len(hashes) - current] * _NGRAM_MULTIPLIER + hashes[current:]
                current += 1
        yield n, grams[:count]


def first_of_runs(ordered: np.ndarray) -> np.ndarray:
    """Boolean mask of the elements of a sorted array that differ from their predecessor (the
    first of each run of equal values)."""
    first = np.empty(len(ordered), dtype=bool)
    if len(ordered):
        first[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return first


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` by one sort: NumPy's hash-based unique costs ~0.1 ms per call even for a
    few elements, and decontamination calls this once per document."""
    ordered = np.sort(values)
    return ordered[first_of_runs(ordered)]
