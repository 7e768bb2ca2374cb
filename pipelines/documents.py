"""The document record shared by every pipeline stage (the Dolma convention).

A document is a plain dict ``{"id": str, "text": str, "source": str, "metadata": dict}``.
Plain dicts (rather than a dataclass) keep Beam's pickling cheap and let every stage add
attributes under ``metadata`` without a schema migration.

Anything that is not kept by a stage becomes a *dead letter*: a dict holding the reason, the
stage, where the record came from and the record itself, so nothing is ever lost silently.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from typing import Any

Document = dict[str, Any]
DeadLetter = dict[str, Any]

REQUIRED_FIELDS = ("id", "text", "source")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class InvalidRecord(ValueError):
    """A raw record that cannot become a document; ``reason`` is the counted drop reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def make_document(
    doc_id: str, text: str, source: str, metadata: Mapping[str, Any] | None = None
) -> Document:
    return {"id": doc_id, "text": text, "source": source, "metadata": dict(metadata or {})}


def validate_document(obj: Any) -> Document:
    """Check a decoded JSON object is a well-formed document; raise InvalidRecord if not."""
    if not isinstance(obj, dict):
        raise InvalidRecord("invalid_record", f"expected a JSON object, got {type(obj).__name__}")
    for field in REQUIRED_FIELDS:
        if field not in obj or obj[field] is None:
            raise InvalidRecord(f"missing_{field}", f"record has no {field!r} field")
        if not isinstance(obj[field], str):
            raise InvalidRecord(
                f"non_string_{field}", f"{field!r} is {type(obj[field]).__name__}, not a string"
            )
    metadata = obj.get("metadata")
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise InvalidRecord("invalid_metadata", "'metadata' must be a JSON object")
    return make_document(obj["id"], obj["text"], obj["source"], metadata)


def decode_line(raw: bytes) -> Any:
    """Decode one JSON line; raise InvalidRecord for bad UTF-8 or bad JSON."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidRecord("invalid_utf8", str(err)) from None
    if "\x00" in line:
        raise InvalidRecord("binary_data", "line contains NUL bytes")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise InvalidRecord("invalid_json", str(err)) from None
    # A lone surrogate escape ("\ud800") decodes to a str that cannot be encoded again, which
    # would crash the runner's coder far from here; only lines with such escapes pay the check.
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidRecord("invalid_unicode", f"lone surrogate: {err}") from None
    return obj


def dumps(record: Mapping[str, Any]) -> str:
    """Canonical JSON: sorted keys, no ASCII escaping, compact. Same record, same bytes."""
    return json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def raw_payload(raw: bytes | str | Any) -> Any:
    """Make any raw input JSON-safe for a dead letter without losing a byte of it."""
    if isinstance(raw, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(raw).decode("ascii")}
    return raw


def dead_letter(
    reason: str, stage: str, origin: str, record: Any, detail: str = "", **extra: Any
) -> DeadLetter:
    """A record that a stage did not keep, with the counted reason it was dropped."""
    letter: DeadLetter = {
        "reason": reason,
        "stage": stage,
        "origin": origin,
        "record": raw_payload(record),
    }
    if detail:
        letter["detail"] = detail[:2000]
    letter.update(extra)
    return letter


def dead_letter_sort_key(letter: DeadLetter) -> tuple[str, str]:
    """Dead letters in a shard: by record id and origin, then by their JSON line (the shard
    writer adds it, having encoded each letter once)."""
    record = letter.get("record")
    record_id = record.get("id", "") if isinstance(record, dict) else ""
    return (str(record_id), letter["origin"])
