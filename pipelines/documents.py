"""The document record shared by every pipeline stage (the Dolma convention).

A document is a plain dict ``{"id": str, "text": str, "source": str, "metadata": dict}``.
Plain dicts (rather than a dataclass) keep Beam's pickling cheap and let every stage add
attributes under ``metadata`` without a schema migration.

Anything that is not kept by a stage becomes a *dead letter*: a dict holding the reason, the
stage, where the record came from and the record itself, so nothing is ever lost silently.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

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
    except (ValueError, RecursionError) as err:
        # Not only JSONDecodeError: an integer past Python's 4,300-digit limit raises a plain
        # ValueError and deep nesting a RecursionError, and either, escaping, would end the
        # reading of the whole file (or the stage) instead of this one line.
        detail = (
            str(err) if isinstance(err, json.JSONDecodeError) else f"{type(err).__name__}: {err}"
        )
        raise InvalidRecord("invalid_json", detail) from None
    # A lone surrogate escape ("\ud800") decodes to a str that cannot be encoded again, which
    # would crash the runner's coder far from here; only lines with such escapes pay the check.
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidRecord("invalid_unicode", f"lone surrogate: {err}") from None
    return obj


def dumps(record: Mapping[str, Any]) -> str:
    """Canonical JSON: sorted keys, no ASCII escaping, compact. Same record, same bytes.

    Always strict JSON: a NaN or an infinity (JSON has no such number; Python's ``json`` would
    write ``NaN``, ``Infinity``) is written as the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"``, as ``json_safe`` converts it.
    """
    try:
        return json.dumps(
            record, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False
        )
    except ValueError:  # a non-finite float somewhere (rare: only such records pay the walk)
        return json.dumps(
            _finite(record),
            sort_keys=True,
            ensure_ascii=False,
            separators=(",", ":"),
            allow_nan=False,
        )


def non_finite_text(value: float) -> str:
    """A NaN or infinite float as a JSON string: ``"NaN"``, ``"Infinity"``, ``"-Infinity"``
    (Python's and ``Decimal``'s spellings of them)."""
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``non_finite_text`` (JSON types)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else non_finite_text(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


class UnrepresentableValue(ValueError):
    """A value with no JSON form (``json_safe``); ``path`` locates it inside the converted
    value, as keys and list indices."""

    def __init__(self, value: Any, why: str = "") -> None:
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        self.why = why or f"is a {kind}, which has no JSON form"
        self.path: list[str | int] = []
        super().__init__(self.why)

    def __str__(self) -> str:
        where = "".join(f"[{key!r}]" for key in self.path) or "the value"
        return f"{where} {self.why}"


_JSON_SCALARS = (str, int, float, bool, type(None))


def _iso_duration(nanoseconds: int) -> str:
    """ISO 8601 duration in days and seconds: ``P1DT3.5S``, ``-P0DT0.000000001S``."""
    sign = "-" if nanoseconds < 0 else ""
    days, rest = divmod(abs(nanoseconds), 86_400 * 10**9)
    seconds, fraction = divmod(rest, 10**9)
    decimals = f".{fraction:09d}".rstrip("0") if fraction else ""
    return f"{sign}P{days}DT{seconds}{decimals}S"


def json_safe(value: Any, *, strict: bool = True) -> Any:
    """``value`` made of JSON types only, the same for the same value in every process.

    Raw Parquet and Hugging Face columns hold what ``json.dumps`` refuses, or would write as
    no JSON parser reads it. They become:
    datetime, date and time: ISO 8601 (``isoformat``; NumPy's ``datetime_as_string``);
    NaN and infinite floats: ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (``non_finite_text``,
    as a ``Decimal`` of them, and NumPy's NaT as ``"NaT"``);
    timedelta: an ISO 8601 duration in days and seconds (``P1DT3.5S``); bytes:
    ``{"base64": ...}`` (the marker ``raw_payload`` uses for bytes that are not UTF-8);
    Decimal: its string (exact); NumPy scalars and arrays: Python values and lists; tuples:
    lists (named tuples: objects). Lists and dicts are converted all the way down. Anything
    else (and a dict key that is not a string) raises ``UnrepresentableValue``, or with
    ``strict=False`` becomes ``{"unrepresentable": "<module.type>"}``: a dead letter must
    always be writable, but a type's repr may hold a memory address, which would break
    byte-identical outputs.
    """
    try:
        return _json_safe(value, strict)
    except RecursionError:
        why = "is nested deeper than Python's recursion limit"
        if strict:
            raise UnrepresentableValue(value, why) from None
        return {"unrepresentable": why}


def _json_safe(value: Any, strict: bool) -> Any:
    if isinstance(value, float) and not math.isfinite(value):  # np.float64 too: a float
        return non_finite_text(value)
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, dict):
        converted: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                if strict:
                    raise UnrepresentableValue(key)
                key = dumps(_json_safe(key, strict))
            try:
                converted[key] = _json_safe(item, strict)
            except UnrepresentableValue as err:
                err.path.insert(0, key)
                raise
        return converted
    if isinstance(value, tuple) and hasattr(value, "_asdict"):  # a named tuple
        return _json_safe(value._asdict(), strict)
    if isinstance(value, list | tuple | np.ndarray):
        if isinstance(value, np.ndarray) and value.ndim == 0:
            return _json_safe(value[()], strict)
        items: list[Any] = []
        for index, item in enumerate(value):
            try:
                items.append(_json_safe(item, strict))
            except UnrepresentableValue as err:
                err.path.insert(0, index)
                raise
        return items
    if isinstance(value, datetime.date | datetime.time):  # datetime is a date
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        micros = (value.days * 86_400 + value.seconds) * 10**6 + value.microseconds
        return _iso_duration(micros * 1000 + getattr(value, "nanoseconds", 0))  # pandas' ns
    if isinstance(value, bytes | bytearray | memoryview):
        return {"base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, np.datetime64):
        return np.datetime_as_string(value)
    if isinstance(value, np.timedelta64):
        if np.isnat(value):
            return "NaT"
        return _iso_duration(int(value.astype("timedelta64[ns]").astype(np.int64)))
    if isinstance(value, np.generic):
        return _json_safe(value.item(), strict)
    if strict:
        raise UnrepresentableValue(value)
    return {"unrepresentable": f"{type(value).__module__}.{type(value).__qualname__}"}


def raw_payload(raw: bytes | str | Any) -> Any:
    """Make any raw input JSON-safe for a dead letter without losing a byte of it (values of
    types JSON lacks are converted as ``json_safe`` converts them)."""
    if isinstance(raw, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(raw).decode("ascii")}
    return json_safe(raw, strict=False)


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
