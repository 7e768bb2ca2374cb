"""Decoding raw lines: every failure is an InvalidRecord with a countable reason."""

from __future__ import annotations

import pytest

from pipelines.documents import InvalidRecord, decode_line, validate_document


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"text": "cut', "invalid_json"),
        (b"caf\xe9", "invalid_utf8"),
        (b'{"text": "a\x00b"}', "binary_data"),
        (b'{"text": "lone \\ud800 surrogate"}', "invalid_unicode"),
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
