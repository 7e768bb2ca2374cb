"""Test helpers shared by the suite and the benchmarks (never shipped in a package)."""
