"""Stage 2, quality filter: Gopher (MassiveText) and C4 heuristic rules, scored then thresholded.

Every document gets its raw rule scores in ``metadata["quality"]`` whether it is kept or not,
so a different set of thresholds can be re-applied later with ``apply_thresholds`` without
re-reading or re-scoring the text. A document that fails a rule is dropped with reason
``quality:<first failed rule>`` (rules are checked in the fixed order of ``RULES``) and every
failed rule listed under ``failed_rules`` in its dead letter.

Thresholds default to the papers' values (Rae et al. 2021, "Scaling Language Models", appendix
A; Raffel et al. 2020, C4) and can be overridden globally and per source:

    python -m pipelines.quality --input out/ingest --output out/quality --config '{
        "thresholds": {"min_words": 40},
        "sources": {"python-stdlib": {"enabled": false}, "fortunes": {"min_words": 3}}}'

Scoring is linear in the text (plus an n log n sort for the n-gram statistics), so a
multi-megabyte document costs seconds, never minutes.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam import pvalue

from pipelines.beam_io import DEAD
from pipelines.configs import QualityConfig, QualityThresholds
from pipelines.documents import Document, dead_letter
from pipelines.map_stage import MapDocuments, MapParts
from pipelines.stage import StageRun, run_as_command, stage_main
from pipelines.text import (
    ASCII_WORD_CHARS,
    first_of_runs,
    line_spans,
    ngram_hashes_by_length,
    paragraph_spans,
    token_hashes,
    words,
)

STAGE = "quality"

# Gopher's stop words: real prose uses them, boilerplate and word salad rarely do.
STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
BULLETS = ("•", "-", "*", "‣", "◦", "⁃", "·", "–", "—", "▪", "●", "○", "■", "□", "➢", "→")
ELLIPSES = ("...", "…")
# C4 keeps lines that end in terminal punctuation (a closing quote counts).
TERMINAL_PUNCTUATION = (".", "!", "?", '"', "”", "'", "’")
# C4 drops lines mentioning javascript and cookie/privacy-policy boilerplate.
BOILERPLATE_MARKERS = (
    "javascript",
    "cookie policy",
    "privacy policy",
    "terms of use",
    "uses cookies",
    "use of cookies",
    "use cookies",
    "accept cookies",
)
TOP_NGRAM_SIZES = (2, 3, 4)
DUPLICATE_NGRAM_SIZES = (5, 6, 7, 8, 9, 10)

# Whitespace tokens (what ``str.split()`` gives) without a word character ("symbol" tokens) /
# without a letter of any script: whole tokens, bounded by whitespace or the text's ends. Both
# are rare in text, so counting them is cheaper than counting their complements.
_SYMBOL_TOKEN = re.compile(r"(?<!\S)[^\w\s]+(?!\S)")


@functools.cache
def _no_letter_token() -> re.Pattern[str]:
    """Tokens without a letter (``str.isalpha``, as DataTrove counts alpha words): made of
    non-word characters, digits, '_' and the other numerals ``\\w`` matches (½, ², Ⅻ, ③),
    which ``\\d`` does not. Built on first use: the numerals are found by a scan of Unicode."""
    numerals = "".join(
        chr(c)
        for c in range(0x110000)
        if chr(c).isnumeric() and not chr(c).isalpha() and not chr(c).isdecimal()
    )
    return re.compile(rf"(?<!\S)(?:[^\w\s]|[\d_{re.escape(numerals)}])+(?!\S)")


# ASCII text's tokens with a letter, counted without a regex scan or a string per token: letters
# become "x", whitespace (``str.isspace``, as ``str.split`` and ``\s`` see it) a space, every
# other byte is deleted; each such token is then one run of "x" after a space or at the start.
_ASCII_LETTERS = bytes(c for c in range(128) if chr(c).isalpha())
_ASCII_SPACE = bytes(c for c in range(128) if chr(c).isspace())
_LETTER_MARKS = bytes.maketrans(
    _ASCII_LETTERS + _ASCII_SPACE, b"x" * len(_ASCII_LETTERS) + b" " * len(_ASCII_SPACE)
)
_NEITHER = bytes(c for c in range(256) if c not in _ASCII_LETTERS + _ASCII_SPACE)
# ASCII text's symbol tokens (no word character) by a regex over character classes: a space,
# "w" for ``\w``, "s" for anything else. A run of "s" between spaces is such a token, and the
# scan finds each by its leading space instead of trying every position.
_SYMBOL_CLASSES = bytes(
    ord(" ") if c in _ASCII_SPACE else ord("w") if c in ASCII_WORD_CHARS else ord("s")
    for c in range(256)
)
_SYMBOL_RUN = re.compile(rb" s+(?= )")
_LOREM = re.compile(r"lorem\s+ipsum", re.IGNORECASE)
_BULLET_CHARS = frozenset(BULLETS)
_TERMINAL_CHARS = frozenset(TERMINAL_PUNCTUATION)
_BOILERPLATE = re.compile("|".join(map(re.escape, BOILERPLATE_MARKERS)))
SCORE_DIGITS = 6


# --- thresholds -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A threshold field of ``QualityThresholds`` checked against one score."""

    name: str  # the threshold field, and the rule name in drop reasons
    score: str  # the key in ``metadata["quality"]``

    @property
    def is_min(self) -> bool:
        return self.name.startswith("min_")


# The order is the order rules are checked in: the first failure names the drop reason.
RULES: tuple[Rule, ...] = (
    Rule("min_words", "word_count"),
    Rule("max_words", "word_count"),
    Rule("min_mean_word_length", "mean_word_length"),
    Rule("max_mean_word_length", "mean_word_length"),
    Rule("max_hash_word_ratio", "hash_word_ratio"),
    Rule("max_ellipsis_word_ratio", "ellipsis_word_ratio"),
    Rule("max_bullet_line_fraction", "bullet_line_fraction"),
    Rule("max_ellipsis_line_fraction", "ellipsis_line_fraction"),
    Rule("min_alpha_word_fraction", "alpha_word_fraction"),
    Rule("min_stop_words", "stop_words"),
    Rule("min_terminal_punctuation_line_fraction", "terminal_punctuation_line_fraction"),
    Rule("max_lorem_ipsum", "lorem_ipsum"),
    Rule("max_boilerplate_line_fraction", "boilerplate_line_fraction"),
    Rule("max_curly_brackets", "curly_brackets"),
    Rule("max_duplicate_line_fraction", "duplicate_line_fraction"),
    Rule("max_duplicate_paragraph_fraction", "duplicate_paragraph_fraction"),
    Rule("max_duplicate_line_char_fraction", "duplicate_line_char_fraction"),
    Rule("max_duplicate_paragraph_char_fraction", "duplicate_paragraph_char_fraction"),
    *(
        Rule(f"max_top_{n}gram_char_fraction", f"top_{n}gram_char_fraction")
        for n in TOP_NGRAM_SIZES
    ),
    *(
        Rule(f"max_duplicate_{n}gram_char_fraction", f"duplicate_{n}gram_char_fraction")
        for n in DUPLICATE_NGRAM_SIZES
    ),
)


def apply_thresholds(scores: Mapping[str, float], thresholds: QualityThresholds) -> list[str]:
    """Names of the rules ``scores`` fail, in ``RULES`` order; empty means the document passes.

    Pure: used by the stage and to re-apply other thresholds to stored ``metadata["quality"]``.
    A missing score fails its rule (it cannot be shown to pass).
    """
    if not thresholds.enabled:
        return []
    failed = []
    for rule in RULES:
        limit = getattr(thresholds, rule.name)
        if limit is None:
            continue
        score = scores.get(rule.score)
        if score is None or (score < limit if rule.is_min else score > limit):
            failed.append(rule.name)
    return failed


# --- scoring ----------------------------------------------------------------------------------


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _duplicate_fractions(text: str, spans: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """Gopher's duplicate fractions: elements that repeat an earlier one, by count and by chars."""
    seen: set[str] = set()
    duplicates = duplicate_chars = 0
    for start, end in spans:
        piece = text[start:end]
        if piece in seen:
            duplicates += 1
            duplicate_chars += end - start
        else:
            seen.add(piece)
    return _ratio(duplicates, len(spans)), _ratio(duplicate_chars, len(text))


def _ngram_groups(grams: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group equal n-gram hashes with one sort: (order, group starts in it, group sizes)."""
    order = np.argsort(grams)
    starts = np.flatnonzero(first_of_runs(grams[order]))
    sizes = np.empty(len(starts), dtype=np.int64)
    sizes[:-1] = starts[1:] - starts[:-1]
    sizes[-1] = len(grams) - starts[-1]
    return order, starts, sizes


def _top_ngram_char_fraction(
    groups: tuple[np.ndarray, np.ndarray, np.ndarray], ends: np.ndarray, n: int, total: int
) -> float:
    """Characters covered by the most frequent n-gram, as a fraction of all word characters.

    Ties between equally frequent n-grams go to the longest one. Occurrences may overlap
    (``a a a``), so the raw product can exceed the text; it is capped at 1.
    """
    order, _, sizes = groups
    top = int(sizes.max())
    if top < 2:
        return 0.0
    char_lengths = ends[n:] - ends[:-n]  # characters of the n-gram starting at each position
    in_top_group = np.repeat(sizes == top, sizes)  # aligned with ``order``
    longest = int(char_lengths[order[in_top_group]].max())
    return min(1.0, top * longest / total)


def _duplicate_ngram_char_fraction(
    groups: tuple[np.ndarray, np.ndarray, np.ndarray], lengths: np.ndarray, n: int, total: int
) -> float:
    """Characters of words inside a repeated occurrence of some n-gram (each counted once).

    The first occurrence of an n-gram is not a repeat; every later one is (as in Gopher and
    datatrove), and a word covered by several repeats counts once.
    """
    order, starts, _ = groups
    count = len(order)
    positions = np.arange(len(lengths))
    # The latest repeat starting at or before each word (-n: none yet); the word is covered
    # when that repeat, n words long, reaches it.
    latest = np.full(len(lengths), -n, dtype=np.int64)
    latest[:count] = positions[:count]
    latest[np.minimum.reduceat(order, starts)] = -n  # first occurrences are not repeats
    np.maximum.accumulate(latest, out=latest)
    covered = latest > positions - n
    return float(lengths[covered].sum()) / total


def repetition_scores(tokens: Sequence[str]) -> dict[str, float]:
    """Gopher's n-gram repetition scores over word tokens (``pipelines.text.words``).

    Sizes are taken in ascending order, each n-gram hash grown from the last. Once no n-gram
    of some size repeats, none of a larger size can (its first n words would repeat too), so
    every larger size scores 0 without being grouped: most short documents stop at bigrams.
    """
    hashes = token_hashes(tokens)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    ends = np.concatenate(([0], np.cumsum(lengths)))
    total = int(ends[-1])
    scores = {f"top_{n}gram_char_fraction": 0.0 for n in TOP_NGRAM_SIZES}
    scores |= {f"duplicate_{n}gram_char_fraction": 0.0 for n in DUPLICATE_NGRAM_SIZES}
    if not total:
        return scores
    for n, grams in ngram_hashes_by_length(
        hashes, sorted({*TOP_NGRAM_SIZES, *DUPLICATE_NGRAM_SIZES})
    ):
        groups = _ngram_groups(grams)
        if len(groups[1]) == len(grams):  # no n-gram repeats: nor does any longer one
            break
        if n in TOP_NGRAM_SIZES:
            scores[f"top_{n}gram_char_fraction"] = _top_ngram_char_fraction(groups, ends, n, total)
        if n in DUPLICATE_NGRAM_SIZES:
            scores[f"duplicate_{n}gram_char_fraction"] = _duplicate_ngram_char_fraction(
                groups, lengths, n, total
            )
    return scores


def _word_scores(text: str, word_tokens: Sequence[str]) -> dict[str, float]:
    """Gopher's word statistics over whitespace tokens (punctuation attached, as in the paper).

    No Python loop over tokens: the tokens are ``str.split()``'s; symbol tokens and tokens
    with a letter are counted by scans of the whole text (``_token_kinds``). Stop words are
    counted over ``word_tokens`` (``pipelines.text.words`` of the text): ``words`` never spans
    whitespace, so that equals counting them token by token.
    """
    tokens = text.split()
    symbols, symbol_chars, alpha = _token_kinds(text, tokens)
    word_count = len(tokens) - symbols
    word_chars = sum(map(len, tokens)) - symbol_chars
    stop_words = sum(map(STOP_WORDS.__contains__, word_tokens))
    ellipses = sum(text.count(e) for e in ELLIPSES)
    return {
        "word_count": word_count,
        "mean_word_length": _ratio(word_chars, word_count),
        "hash_word_ratio": _ratio(text.count("#"), word_count),
        "ellipsis_word_ratio": _ratio(ellipses, word_count),
        "alpha_word_fraction": _ratio(alpha, len(tokens)),
        "stop_words": stop_words,
    }


def _token_kinds(text: str, tokens: Sequence[str]) -> tuple[int, int, int]:
    """Of ``tokens`` (``text.split()``): how many have no ``\\w`` character (symbol tokens),
    their characters, and how many hold a letter (a ``\\w`` that is no digit or "_"). ASCII
    text from its bytes' classes (0.2 s instead of 1.3 s for the demo's corpus); other text by
    two regular expressions whose matches are whole tokens."""
    if text.isascii():
        raw = text.encode("ascii")
        runs = _SYMBOL_RUN.findall(b" " + raw.translate(_SYMBOL_CLASSES) + b" ")  # " sss" each
        marks = raw.translate(_LETTER_MARKS, _NEITHER)
        letter_tokens = marks.count(b" x") + marks.startswith(b"x")
        return len(runs), sum(map(len, runs)) - len(runs), letter_tokens
    symbols = _SYMBOL_TOKEN.findall(text)
    no_letter = len(_no_letter_token().findall(text))
    return len(symbols), sum(map(len, symbols)), len(tokens) - no_letter


def _line_scores(text: str, spans: Sequence[tuple[int, int]]) -> dict[str, float]:
    """Per-line statistics over non-blank lines (blank lines only separate paragraphs).

    Lines are ``line_spans`` (stripped), so a line's first and last characters are
    ``text[start]`` and ``text[end - 1]``: each count is a set lookup per line, not a slice.
    """
    count = len(spans)
    bullets = sum(map(_BULLET_CHARS.__contains__, [text[start] for start, _ in spans]))
    lasts = [text[end - 1] for _, end in spans]
    terminal = sum(map(_TERMINAL_CHARS.__contains__, lasts))
    ellipsis = sum(
        1
        for (start, end), last in zip(spans, lasts, strict=True)
        if last == "…" or (last == "." and text.endswith("...", start, end))
    )
    return {
        "bullet_line_fraction": _ratio(bullets, count),
        "ellipsis_line_fraction": _ratio(ellipsis, count),
        "terminal_punctuation_line_fraction": _ratio(terminal, count),
        "boilerplate_line_fraction": _ratio(_boilerplate_lines(text, spans), count),
        "lorem_ipsum": len(_LOREM.findall(text)),
        "curly_brackets": text.count("{"),
    }


def _boilerplate_lines(text: str, spans: Sequence[tuple[int, int]]) -> int:
    """Lines whose lowercased text holds a boilerplate marker: one scan of the whole text.

    Markers are ASCII and hold no line break, so each match lies inside one line. Lowering
    the whole text maps offsets one to one unless some character lowers to several (``İ``);
    then each line is lowered on its own instead.
    """
    lowered = text.lower()
    if len(lowered) != len(text):
        return sum(1 for s, e in spans if _BOILERPLATE.search(text[s:e].lower()))
    starts = [start for start, _ in spans]
    lines = {
        bisect.bisect_right(starts, match.start()) - 1 for match in _BOILERPLATE.finditer(lowered)
    }
    return len(lines)


def score_text(text: str) -> dict[str, float]:
    """Every rule's raw score for one text, rounded so stored scores re-apply exactly."""
    spans = line_spans(text)
    paragraphs = paragraph_spans(text, spans)
    dup_lines, dup_line_chars = _duplicate_fractions(text, spans)
    dup_paragraphs, dup_paragraph_chars = _duplicate_fractions(text, paragraphs)
    word_tokens = words(text)
    scores: dict[str, float] = {
        **_word_scores(text, word_tokens),
        **_line_scores(text, spans),
        "duplicate_line_fraction": dup_lines,
        "duplicate_line_char_fraction": dup_line_chars,
        "duplicate_paragraph_fraction": dup_paragraphs,
        "duplicate_paragraph_char_fraction": dup_paragraph_chars,
        **repetition_scores(word_tokens),
    }
    return {
        key: value if isinstance(value, int) else round(float(value), SCORE_DIGITS)
        for key, value in sorted(scores.items())
    }


# --- the stage --------------------------------------------------------------------------------


def filter_document(
    doc: Document,
    defaults: QualityThresholds,
    by_source: Mapping[str, QualityThresholds],
) -> Iterator[Any]:
    """Score one document; yield it (scores attached) or a dead letter. Never raises."""
    try:
        yield from _filter_document(doc, defaults, by_source)
    except Exception as err:  # one bad record must never take the pipeline down
        yield pvalue.TaggedOutput(
            DEAD,
            dead_letter(
                "processing_error",
                STAGE,
                str(doc.get("id", "")) if isinstance(doc, dict) else "",
                doc,
                f"{type(err).__name__}: {err}",
            ),
        )


def _filter_document(
    doc: Document,
    defaults: QualityThresholds,
    by_source: Mapping[str, QualityThresholds],
) -> Iterator[Any]:
    scores = score_text(doc["text"])
    scored = {**doc, "metadata": {**doc["metadata"], "quality": scores}}
    failed = apply_thresholds(scores, by_source.get(doc["source"], defaults))
    if not failed:
        yield scored
        return
    yield pvalue.TaggedOutput(
        DEAD,
        dead_letter(
            f"quality:{failed[0]}",
            STAGE,
            doc["id"],
            scored,
            f"failed {', '.join(failed)}",
            failed_rules=failed,
        ),
    )


class FilterDocuments(beam.DoFn):
    """``filter_document`` as the per-document step of the map stage."""

    def __init__(self, config: QualityConfig) -> None:
        self.defaults = config.thresholds
        self.by_source = config.resolved()

    def process(self, doc: Document) -> Iterator[Any]:
        yield from filter_document(doc, self.defaults, self.by_source)


def parts(pipeline: beam.Pipeline, config: QualityConfig) -> MapParts:
    return MapParts(FilterDocuments(config))


build = MapDocuments(parts).build  # the harness's path, for callers that hold a collection


def main(argv: Sequence[str] | None = None) -> StageRun:
    return stage_main(STAGE, __doc__ or STAGE, QualityConfig, MapDocuments(parts), argv)


if __name__ == "__main__":
    run_as_command(main)
