"""Pure text helpers shared by stages: normalization and word/n-gram tokenization."""

from __future__ import annotations

import re
import unicodedata

# Control characters other than tab and newline, plus BOM and zero-width characters.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\u200b-\u200d\u2060]")
_TRAILING_SPACE = re.compile(r"[ \t\u00a0]+$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")
_WORD = re.compile(r"\w+", re.UNICODE)


def normalize_text(text: str) -> str:
    """NFC, unified newlines, control characters removed, trailing spaces and blank runs trimmed.

    Leading indentation is kept: code is a source too.
    """
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip("\n ")


def words(text: str) -> list[str]:
    """Lowercased word tokens (letters/digits/underscore), the unit of dedup and decontamination."""
    return _WORD.findall(text.lower())


def dedup_key_text(text: str) -> str:
    """Text as compared by exact dedup: case, punctuation and whitespace differences ignored."""
    return " ".join(words(text))
