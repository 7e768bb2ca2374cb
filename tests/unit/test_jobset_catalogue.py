"""TPU catalogue: shapes resolve to the GKE layout, and impossible ones fail with a reason."""

from __future__ import annotations

import pytest

from operators.jobset.catalogue import CATALOGUE, MAX_SLICES, ShapeError, lookup, resolve


@pytest.mark.parametrize(
    ("acc", "topo", "label", "machine", "chips", "hosts", "per_host"),
    [
        ("v4", "2x2x1", "tpu-v4-podslice", "ct4p-hightpu-4t", 4, 1, 4),
        ("v4", "2x2x4", "tpu-v4-podslice", "ct4p-hightpu-4t", 16, 4, 4),
        ("v4", "4x4x8", "tpu-v4-podslice", "ct4p-hightpu-4t", 128, 32, 4),
        ("v5e", "1x1", "tpu-v5-lite-podslice", "ct5lp-hightpu-1t", 1, 1, 1),
        ("v5e", "2x2", "tpu-v5-lite-podslice", "ct5lp-hightpu-4t", 4, 1, 4),
        ("v5e", "2x4", "tpu-v5-lite-podslice", "ct5lp-hightpu-8t", 8, 1, 8),
        ("v5e", "4x4", "tpu-v5-lite-podslice", "ct5lp-hightpu-4t", 16, 4, 4),
        ("v5e", "16x16", "tpu-v5-lite-podslice", "ct5lp-hightpu-4t", 256, 64, 4),
        ("v5p", "2x2x1", "tpu-v5p-slice", "ct5p-hightpu-4t", 4, 1, 4),
        ("v5p", "4x4x8", "tpu-v5p-slice", "ct5p-hightpu-4t", 128, 32, 4),
        ("v6e", "2x4", "tpu-v6e-slice", "ct6e-standard-8t", 8, 1, 8),
        ("v6e", "8x16", "tpu-v6e-slice", "ct6e-standard-4t", 128, 32, 4),
        ("tpu7x", "2x2x2", "tpu7x", "tpu7x-standard-4t", 8, 2, 4),
        ("cpu", "4", "", "", 4, 4, 1),
    ],
)
def test_resolve_layout(acc, topo, label, machine, chips, hosts, per_host):
    shape = resolve(acc, topo, 2)
    assert (shape.gke_accelerator, shape.machine_type) == (label, machine)
    assert (shape.chips_per_slice, shape.hosts_per_slice, shape.chips_per_host) == (
        chips,
        hosts,
        per_host,
    )
    assert shape.total_chips == 2 * chips and shape.total_hosts == 2 * hosts
    assert shape.multislice and shape.is_tpu == (acc != "cpu")


def test_every_entry_resolves_its_examples():
    for kind in CATALOGUE.values():
        for topo in kind.examples:
            shape = resolve(kind.name, topo)
            assert shape.hosts_per_slice * shape.chips_per_host == shape.chips_per_slice


@pytest.mark.parametrize("alias", ["v5p", "V5P", "tpu-v5p-slice", " v5p "])
def test_aliases(alias):
    assert lookup(alias).name == "v5p"
    assert lookup("tpu-v5-lite-podslice").name == "v5e"


@pytest.mark.parametrize(
    ("acc", "topo", "slices", "match"),
    [
        ("v3", "2x2", 1, "unknown accelerator 'v3'"),
        (None, "2x2", 1, "unknown accelerator"),
        ("v5p", "4x4", 1, "must be AxBxC"),
        ("v5e", "2x2x1", 1, r"must be AxB \(e.g. 4x4\)"),
        ("v5e", "3x3", 1, "not offered: allowed topologies: 1x1, 2x2, 2x4, 4x4"),
        ("v6e", "32x32", 1, "more than a full pod"),
        ("v4", "2x2x3", 1, "multiples of 4"),
        ("v4", "4x8x4", 1, "A<=B<=C"),
        ("v4", "16x16x32", 1, r"8192 chips, more than a full pod \(4096\)"),
        ("v5p", "2x2x0", 1, "positive integers"),
        ("v5p", "2x2x1 ", 1, "positive integers"),
        ("v5p", "2X2X1", 1, "positive integers"),
        ("cpu", "2x2", 1, "process count"),
        ("cpu", "65", 1, "at most 64 processes"),
        ("cpu", "16", 8, "128 local processes"),
        ("v5p", "2x2x1", 0, "at least 1"),
        ("v5p", "2x2x1", -2, "at least 1"),
        ("v5p", "2x2x1", True, "must be an integer"),
        ("v5p", "2x2x1", 1.5, "must be an integer"),
        ("v5p", "2x2x1", "2", "must be an integer"),
        ("v5p", "2x2x1", MAX_SLICES + 1, "more than Slipway allows"),
    ],
)
def test_errors(acc, topo, slices, match):
    with pytest.raises(ShapeError, match=match):
        resolve(acc, topo, slices)
