"""BSD fortune cookies (Debian ``fortunes`` and ``fortunes-min``): one fortune, one document.

Fortune files live in ``usr/share/games/fortunes/``; entries are separated by lines holding
only ``%``. The ``.dat`` files beside them are binary indexes, and the ``.u8`` names are
symlinks to the same files, so both are skipped.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable

from pipelines.documents import Document, make_document

SOURCE = "fortunes"
FORTUNE_DIR = "usr/share/games/fortunes/"
_SEPARATOR = re.compile(r"^%[ \t]*$", re.MULTILINE)


def is_fortune_file(path: str) -> bool:
    if not path.startswith(FORTUNE_DIR):
        return False
    name = posixpath.basename(path)
    return bool(name) and "." not in name  # skips the binary .dat indexes and .u8 aliases


def split_fortunes(text: str) -> list[str]:
    """Entries of one fortune file, blank ones dropped; indentation inside an entry is kept."""
    text = text.replace("\r\n", "\n")
    entries = (entry.strip("\n").rstrip() for entry in _SEPARATOR.split(text))
    return [entry for entry in entries if entry.strip()]


def convert_file(name: str, text: str, package: str) -> list[Document]:
    width = 5  # zero-padded so ids sort in file order
    return [
        make_document(
            f"{SOURCE}/{name}/{index:0{width}d}",
            entry,
            SOURCE,
            {"file": name, "index": index, "package": package},
        )
        for index, entry in enumerate(split_fortunes(text))
    ]


def convert(members: Iterable[tuple[str, bytes, str]]) -> list[Document]:
    """``(path inside the .deb, bytes, package spec)`` -> documents of every fortune file."""
    docs = []
    for path, body, package in members:
        if is_fortune_file(path):
            name = posixpath.basename(path)
            docs.extend(convert_file(name, body.decode("utf-8", errors="replace"), package))
    return docs
