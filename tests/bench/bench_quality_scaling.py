"""How the quality filter's scoring time grows with a document's length: it must stay linear.

    .venv/bin/python -m tests.bench.bench_quality_scaling [--megabytes 0.5 2 8 32] [--repeat 3]

A crawled page can be megabytes long (a log dump, a minified script, a table), and one
quadratic rule would stall a whole Beam worker on it. For each shape of
``tests/support/long_documents.py`` (prose-like lines; one token with no space) and each size,
``score_text`` is timed (median of ``--repeat``). The baseline is the same scorer on the
smallest size in the same run: the ratio of MB/s at each size to the smallest size's is 1.0
for linear time and falls as 1/size for quadratic (at 64x the smallest: 0.016). A least-squares
line through log time against log size, every size, gives the exponent k of time ~ size^k: 1
for linear, 2 for quadratic; sorting n-gram hashes (n log n, and arrays that outgrow the
caches) puts it a little above 1. The run fails if k reaches 1.5 for either shape. MB here
is 2^20 characters of text.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from pipelines.quality import score_text
from tests.support.long_documents import SHAPES, long_document

# Halfway from linear (1) to quadratic (2).
MAX_EXPONENT = 1.5


def fit_exponent(sizes: list[float], seconds: list[float]) -> float:
    """k of seconds ~ c * size^k: the slope of the least-squares line through the log-log
    points (two sizes at least, not all equal)."""
    if len(set(sizes)) < 2:
        raise ValueError(f"the fit needs two different sizes, got {sizes}")
    slope, _ = np.polyfit(np.log(sizes), np.log(seconds), 1)
    return float(slope)


def seconds(text: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        score_text(text)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, nargs="+", default=[0.5, 2, 8, 32])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sizes = sorted(args.megabytes)
    if len(set(sizes)) < 2 or sizes[0] <= 0:
        parser.error("--megabytes needs at least two different sizes above 0")

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print("| shape | MB | seconds | MB/s | MB/s ratio to the smallest |")
    print("|---|---|---|---|---|")
    exponents = {}
    for shape in SHAPES:
        times = []
        for megabytes in sizes:
            times.append(seconds(long_document(shape, int(megabytes * 1024 * 1024)), args.repeat))
            rate, base = megabytes / times[-1], sizes[0] / times[0]
            print(f"| {shape} | {megabytes:g} | {times[-1]:.3f} | {rate:.1f} | {rate / base:.2f} |")
        exponents[shape] = fit_exponent(sizes, times)
    for shape, k in exponents.items():
        verdict = "near-linear" if k < MAX_EXPONENT else "NOT linear"
        print(f"{shape}: time ~ size^{k:.2f} from {sizes[0]:g} to {sizes[-1]:g} MB ({verdict})")
    if max(exponents.values()) >= MAX_EXPONENT:
        sys.exit(1)


if __name__ == "__main__":
    main()
