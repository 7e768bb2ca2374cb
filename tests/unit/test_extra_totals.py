"""Manifest totals in one combine: counts, sums and maxima, 0 for empty collections."""

from __future__ import annotations

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipelines.extra_totals import _Totals, extra_totals


def test_counts_sums_and_maxima_in_one_combine():
    with beam.Pipeline() as pipeline:
        sizes = pipeline | "Sizes" >> beam.Create([3, 9, 2, 9])
        nothing = pipeline | "Nothing" >> beam.Create([])
        totals = extra_totals(
            pipeline,
            "T",
            [
                ("clusters", "count", sizes),
                ("largest", "max", sizes),
                ("members", "sum", sizes),
                ("errors", "count", nothing),
                ("empty_max", "max", nothing),
                ("empty_sum", "sum", nothing),
            ],
        )
        expected = {
            "clusters": 4,
            "empty_max": 0,
            "empty_sum": 0,
            "errors": 0,
            "largest": 9,
            "members": 23,
        }
        assert_that(totals, equal_to([expected]))


def test_merging_partial_totals_keeps_each_kind():
    combine = _Totals({"n": "count", "top": "max"})
    parts = [{"n": 2, "top": 5}, {"n": 3, "top": 4}, {}]
    assert combine.merge_accumulators(parts) == {"n": 5, "top": 5}


@pytest.mark.parametrize(
    "parts",
    [[("a", "count", None), ("a", "sum", None)], [("a", "median", None)]],
)
def test_repeated_names_and_unknown_kinds_are_refused(parts):
    with pytest.raises(ValueError, match="distinct names and kinds"):
        extra_totals(beam.Pipeline(), "T", parts)
