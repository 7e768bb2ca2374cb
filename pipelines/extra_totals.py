"""Manifest ``extra`` totals (counts, sums, maxima of several collections) in one combine.

A stage reports many small totals: candidate pairs, clusters, the largest bucket... Each
``CombineGlobally`` adds about ten transforms to the pipeline, and building and translating a
pipeline costs time per transform (Beam inspects every DoFn's signature repeatedly), so a
stage with a dozen totals paid seconds for them. Here every total is one ``Map`` to a
``(name, kind, value)`` triple, and one combine adds them all up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import apache_beam as beam

KINDS = ("count", "sum", "max")  # elements, their sum, the largest (0 when there is none)


class _Totals(beam.CombineFn):
    """(name, kind, value) triples -> {name: total}; a ``None`` value only names the total."""

    def __init__(self, kinds: dict[str, str]) -> None:
        self.kinds = kinds

    def create_accumulator(self) -> dict[str, int]:
        return {}

    def add_input(self, totals: dict[str, int], item: tuple[str, str, Any]) -> dict[str, int]:
        name, kind, value = item
        current = totals.setdefault(name, 0)
        if value is not None:
            totals[name] = max(current, value) if kind == "max" else current + value
        return totals

    def merge_accumulators(self, accumulators: Any) -> dict[str, int]:
        merged: dict[str, int] = {}
        for totals in accumulators:
            for name, value in totals.items():
                if name in merged:
                    merged[name] = self._merge(name, merged[name], value)
                else:
                    merged[name] = value
        return merged

    def _merge(self, name: str, a: int, b: int) -> int:
        return max(a, b) if self.kinds[name] == "max" else a + b

    def extract_output(self, totals: dict[str, int]) -> dict[str, int]:
        return dict(sorted(totals.items()))


def extra_totals(
    pipeline: beam.Pipeline, label: str, parts: Sequence[tuple[str, str, beam.PCollection]]
) -> beam.PCollection:
    """One dict ``{name: total}`` for ``(name, kind, collection)`` parts: ``count`` counts the
    collection's elements, ``sum`` adds them, ``max`` takes the largest; an empty collection
    gives 0. Names must be distinct."""
    kinds = {name: kind for name, kind, _ in parts}
    if len(kinds) != len(parts) or not set(kinds.values()) <= set(KINDS):
        raise ValueError(f"extra totals need distinct names and kinds in {KINDS}: {parts}")
    tagged = [
        pcoll
        | f"{label}{name}"
        >> beam.Map(lambda value, n=name, k=kind: (n, k, 1 if k == "count" else value))
        for name, kind, pcoll in parts
    ]
    names = pipeline | f"{label}Names" >> beam.Create([(n, k, None) for n, k in kinds.items()])
    return (
        [names, *tagged]
        | f"{label}All" >> beam.Flatten()
        | f"{label}Totals" >> beam.CombineGlobally(_Totals(kinds))
    )
