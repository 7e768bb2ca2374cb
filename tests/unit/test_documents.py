"""Decoding raw lines: every failure is an InvalidRecord with a countable reason."""

from __future__ import annotations

import datetime
import decimal
import json

import numpy as np
import pytest

from pipelines.documents import (
    InvalidRecord,
    UnrepresentableValue,
    decode_line,
    dumps,
    json_safe,
    raw_payload,
    validate_document,
)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"text": "cut', "invalid_json"),
        (b"caf\xe9", "invalid_utf8"),
        (b'{"text": "a\x00b"}', "binary_data"),
        (b'{"text": "lone \\ud800 surrogate"}', "invalid_unicode"),
        # json.loads raises a plain ValueError past Python's 4,300-digit int limit, and a
        # RecursionError for deep nesting: still one bad line, not a bad file or a failed stage
        (b'{"n": ' + b"1" * 5000 + b"}", "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
    ],
)
def test_bad_lines_have_reasons(raw, reason):
    with pytest.raises(InvalidRecord) as err:
        decode_line(raw)
    assert err.value.reason == reason


def test_surrogate_pairs_are_fine():
    assert decode_line(b'{"text": "\\ud83d\\ude00"}') == {"text": "\U0001f600"}


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ({"text": "t", "source": "s"}, "missing_id"),
        ({"id": 1, "text": "t", "source": "s"}, "non_string_id"),
        ({"id": "i", "text": "t", "source": "s", "metadata": []}, "invalid_metadata"),
        ("just a string", "invalid_record"),
    ],
)
def test_invalid_documents(obj, reason):
    with pytest.raises(InvalidRecord) as err:
        validate_document(obj)
    assert err.value.reason == reason


def test_json_safe_gives_every_column_type_one_json_form():
    """What Parquet and Hugging Face rows hold besides JSON types, as ingest stores it."""
    value = {
        "at": datetime.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=datetime.UTC),
        "day": datetime.date(2024, 5, 6),
        "clock": datetime.time(7, 8, 9),
        "took": datetime.timedelta(days=1, seconds=2, microseconds=500_000),
        "back": -datetime.timedelta(seconds=1),
        "blob": b"\x00\xff",
        "price": decimal.Decimal("19.90"),
        "nested": [{"n": np.int64(3), "ok": np.bool_(True)}, (1, 2)],
        "array": np.array([[1.5, 2.0]]),
        "scalar": np.array(7),
        "np_at": np.datetime64("2024-05-06T07:08:09.000000001"),
        "np_took": np.timedelta64(1500, "ms"),
    }
    assert json_safe(value) == {
        "at": "2024-05-06T07:08:09.123456+00:00",
        "day": "2024-05-06",
        "clock": "07:08:09",
        "took": "P1DT2.5S",
        "back": "-P0DT1S",
        "blob": {"base64": "AP8="},
        "price": "19.90",
        "nested": [{"n": 3, "ok": True}, [1, 2]],
        "array": [[1.5, 2.0]],
        "scalar": 7,
        "np_at": "2024-05-06T07:08:09.000000001",
        "np_took": "P0DT1.5S",
    }
    assert dumps(json_safe(value)) == dumps(json_safe(dict(reversed(value.items()))))


def test_values_without_a_json_form_are_named_or_marked():
    with pytest.raises(UnrepresentableValue, match=r"\['a'\]\[1\] is a builtins.object"):
        json_safe({"a": [1, object()]})
    with pytest.raises(UnrepresentableValue):
        json_safe({1: "a key that is not a string"})
    # A dead letter must always be writable: the same values are marked, not raised.
    record = {"at": datetime.date(2024, 1, 1), "odd": object(), 2: "two"}
    assert raw_payload(record) == {
        "at": "2024-01-01",
        "odd": {"unrepresentable": "builtins.object"},
        "2": "two",
    }
    assert raw_payload(b"caf\xe9") == {"base64": "Y2Fm6Q=="}  # raw lines as before


def _strict_json(line: str) -> object:
    """json.loads, refusing what only Python's parser reads (NaN, Infinity, -Infinity)."""

    def refuse(constant: str) -> object:
        raise AssertionError(f"not JSON: {constant} in {line[:200]}")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_floats_are_written_as_strict_json():
    """JSON has no NaN or infinity: they are written as the strings Decimal spells them with,
    by ``json_safe`` (ingest's metadata, dead letters) and by ``dumps`` (every output line)."""
    record = {
        "id": "d",
        "metadata": {
            "nan": float("nan"),
            "inf": float("inf"),
            "list": [float("-inf"), 1.5, {"deep": np.float64("nan")}],
            "np32": np.float32("inf"),
            "ok": 2.0,
        },
    }
    expected_metadata = {
        "nan": "NaN",
        "inf": "Infinity",
        "list": ["-Infinity", 1.5, {"deep": "NaN"}],
        "np32": "Infinity",
        "ok": 2.0,
    }
    assert json_safe(record["metadata"]) == expected_metadata
    assert raw_payload(record)["metadata"] == expected_metadata
    plain = {**record, "metadata": {k: v for k, v in record["metadata"].items() if k != "np32"}}
    line = dumps(plain)
    assert _strict_json(line) == {
        "id": "d",
        "metadata": {k: v for k, v in expected_metadata.items() if k != "np32"},
    }
    # A NaN read from a JSON line (Python's parser accepts one) is written strictly too.
    assert _strict_json(dumps(decode_line(b'{"x": NaN, "y": -Infinity}'))) == {
        "x": "NaN",
        "y": "-Infinity",
    }
    assert dumps({"x": 1.5, "y": [1, "NaN"]}) == '{"x":1.5,"y":[1,"NaN"]}'  # others as before
