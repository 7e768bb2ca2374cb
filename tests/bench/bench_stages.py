"""Every data-plane stage on the real corpora: docs/s, MB/s and peak memory per stage.

    .venv/bin/python -m tests.bench.bench_stages [--data-dir data] [--output out/bench/stages]

Each stage runs in its own child process (its command-line entry point, in-process
DirectRunner) so its peak resident memory (VmHWM) is its own. MB/s counts the UTF-8 text of
the stage's input documents. Needs the corpora (`make corpora`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipelines.beam_io import read_documents
from pipelines.manifest import read_manifest

CHILD = """
import atexit, json, runpy, sys
def report():
    status = open("/proc/self/status").read()
    hwm = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))
    print("BENCH_PEAK_KB " + hwm, file=sys.stderr)
atexit.register(report)
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__")
"""


def text_megabytes(paths: list[str]) -> float:
    total = 0
    for path in paths:
        if Path(path).is_dir():
            total += sum(len(d["text"].encode()) for d in read_documents(path))
        else:
            import gzip

            with gzip.open(path, "rt") as handle:
                total += sum(len(json.loads(line).get("text", "").encode()) for line in handle)
    return total / 1e6


def run_stage(module: str, inputs: list[str], output: Path, extra: list[str]) -> dict:
    argv = [sys.executable, "-c", CHILD, f"pipelines.{module}"]
    for path in inputs:
        argv += ["--input", path]
    argv += ["--output", str(output), *extra]
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{module} failed:\n{proc.stderr[-3000:]}")
    peak_kb = int(proc.stderr.rsplit("BENCH_PEAK_KB ", 1)[1].split()[0])
    manifest = read_manifest(str(output))
    mb = text_megabytes(inputs)
    return {
        "stage": module,
        "docs_in": manifest.records_in,
        "seconds": round(seconds, 1),
        "docs_per_s": round(manifest.records_in / seconds),
        "mb_per_s": round(mb / seconds, 2),
        "input_mb": round(mb, 1),
        "peak_mb": round(peak_kb / 1024),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--output", type=Path, default=Path("out/bench/stages"))
    args = parser.parse_args()
    from pipelines.corpora import fetch

    config = json.loads(Path("pipelines/demo_config.json").read_text())
    raw = sorted(fetch.raw_paths(args.data_dir).values())
    evals = sorted(fetch.eval_paths(args.data_dir).values())
    out = args.output

    def cfg(stage: str) -> list[str]:
        return ["--config", json.dumps(config.get(stage, {}))]

    plan = [
        ("ingest", raw, "ingest", cfg("ingest")),
        ("quality", [str(out / "ingest")], "quality", cfg("quality")),
        ("exact_dedup", [str(out / "quality")], "exact_dedup", cfg("exact_dedup")),
        ("fuzzy_dedup", [str(out / "exact_dedup")], "fuzzy_dedup", cfg("fuzzy_dedup")),
        (
            "decontaminate",
            [str(out / "fuzzy_dedup")],
            "decontaminate",
            [*cfg("decontaminate"), *[a for e in evals for a in ("--eval_set", e)]],
        ),
        ("train_tokenizer", [str(out / "decontaminate")], "tokenizer", cfg("train_tokenizer")),
        (
            "tokenize",
            [str(out / "decontaminate")],
            "tokens",
            [*cfg("tokenize"), "--tokenizer", str(out / "tokenizer")],
        ),
    ]
    rows = []
    for module, inputs, name, extra in plan:
        row = run_stage(module, inputs, out / name, extra)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print()
    print("| stage | docs in | input MB | seconds | docs/s | MB/s | peak MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['stage']} | {r['docs_in']:,} | {r['input_mb']} | {r['seconds']} |"
            f" {r['docs_per_s']:,} | {r['mb_per_s']} | {r['peak_mb']} |"
        )


if __name__ == "__main__":
    main()
