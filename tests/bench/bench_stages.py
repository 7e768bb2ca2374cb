"""Every data-plane stage on the real corpora: docs/s, MB/s and peak memory per stage.

    .venv/bin/python -m tests.bench.bench_stages [--data-dir data] [--output out/bench/stages]
        [--scale K [K ...]] [--json PATH]

Each stage runs in its own child process (its command-line entry point, in-process
DirectRunner) so its peak resident memory (VmHWM) is its own. MB/s counts the UTF-8 text of
the stage's input documents. Needs the corpora (`make corpora`).

``--scale K [K ...]`` runs the chain once per factor K on a corpus K times the demo's
(default: 1 and 4, ~6 min on 2 cores; ``--scale 1``: the demo corpus alone, ~1.5 min). Copy 0
of every raw record is the record itself; copies 1..K-1 get the id ``<id>/x<k>`` and a
deterministic per-copy letter substitution (a permutation of a-z seeded by k, upper case
alike) applied to every ASCII word of 4+ letters that is not one of the quality filter's stop
words. A copy therefore keeps its word lengths, line and paragraph structure, punctuation, stop
words and its own repetitions (so the quality filter scores it much as the original) but
shares almost no word 5-gram with the original or another copy: exact and fuzzy dedup see
distinct documents (paragraphs without a 4-letter word, e.g. lone punctuation or numbers, stay
shared as they already are across documents). The evaluation sets are not scaled. With more
than one factor it ends with a table of peaks per stage side by side and their ratio, beside
the peak of an idle stage process (interpreter, Beam and the stage module imported, nothing
run), which every stage's peak includes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipelines.beam_io import read_documents
from pipelines.manifest import read_manifest
from pipelines.quality import STOP_WORDS

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


IDLE = """
import importlib, sys
import apache_beam, apache_beam.runners.direct.direct_runner
for module in sys.argv[1:]:
    importlib.import_module(module)
status = open("/proc/self/status").read()
print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
"""

_SCALED_WORD = re.compile(r"[A-Za-z]{4,}")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def perturbation(copy: int) -> Callable[[str], str]:
    """Copy ``copy``'s text rewrite: its own letter substitution on every 4+ letter ASCII word
    but the quality filter's stop words (copy 0: the text unchanged)."""
    if copy == 0:
        return lambda text: text
    letters = list(_LETTERS)
    random.Random(f"bench_stages-scale-{copy}").shuffle(letters)
    table = str.maketrans(_LETTERS + _LETTERS.upper(), "".join(letters) + "".join(letters).upper())

    def word(match: re.Match[str]) -> str:
        w = match.group(0)
        return w if w.lower() in STOP_WORDS else w.translate(table)

    return lambda text: _SCALED_WORD.sub(word, text)


def scaled_corpus(raw: list[str], scale: int, folder: Path) -> list[str]:
    """The raw corpora ``scale`` times over (see the module's docstring), one file per source."""
    if scale == 1:
        return raw
    folder.mkdir(parents=True, exist_ok=True)
    rewrites = [perturbation(k) for k in range(scale)]
    paths = []
    for path in raw:
        target = folder / Path(path).name
        with gzip.open(path, "rt") as src:
            records = [json.loads(line) for line in src]
        with gzip.open(target, "wt", compresslevel=1) as dst:
            for k, rewrite in enumerate(rewrites):
                for record in records:
                    if k:
                        record = dict(record, id=f"{record['id']}/x{k}")
                        if isinstance(record.get("text"), str):
                            record["text"] = rewrite(record["text"])
                    dst.write(json.dumps(record, sort_keys=True) + "\n")
        paths.append(str(target))
    return paths


def idle_peak_mb(modules: list[str]) -> int:
    """VmHWM of a child that imports Beam's DirectRunner and ``modules`` and runs nothing."""
    out = subprocess.run(
        [sys.executable, "-c", IDLE, *modules], capture_output=True, text=True, check=True
    )
    return round(int(out.stdout.split()[-1]) / 1024)


def text_megabytes(paths: list[str]) -> float:
    total = 0
    for path in paths:
        if Path(path).is_dir():
            total += sum(len(d["text"].encode()) for d in read_documents(path))
        else:
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


def run_chain(raw: list[str], evals: list[str], config: dict, out: Path) -> list[dict]:
    """Every stage in turn, each on the previous one's output under ``out``; a row per stage."""

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
    return rows


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    parser.add_argument("--output", type=Path, default=Path("out/bench/stages"))
    parser.add_argument(
        "--scale",
        type=int,
        nargs="+",
        default=[1, 4],
        help="corpus size factors, one run of the chain each (default: 1 4)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    from pipelines.corpora import fetch

    config = json.loads(Path("pipelines/demo_config.json").read_text())
    raw = sorted(fetch.raw_paths(args.data_dir).values())
    evals = sorted(fetch.eval_paths(args.data_dir).values())
    results: dict[int, list[dict]] = {}
    for scale in args.scale:
        out = args.output / f"x{scale}"
        print(f"== {scale}x corpus, load average {loadavg()}", flush=True)
        corpus = scaled_corpus(raw, scale, args.output / f"corpus-x{scale}")
        rows = run_chain(corpus, evals, config, out)
        results[scale] = rows
        print()
        print(f"{scale}x corpus (load average after: {loadavg()}):")
        print()
        print("| stage | docs in | input MB | seconds | docs/s | MB/s | peak MB |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['stage']} | {r['docs_in']:,} | {r['input_mb']} | {r['seconds']} |"
                f" {r['docs_per_s']:,} | {r['mb_per_s']} | {r['peak_mb']} |"
            )
        print()
    if len(results) > 1:
        lo, hi = min(results), max(results)
        modules = [f"pipelines.{r['stage']}" for r in results[lo]]
        idle = {m.split(".")[-1]: idle_peak_mb([m]) for m in modules}
        print(f"Peak memory, {lo}x against {hi}x (idle = the stage's imports alone):")
        print()
        print(
            f"| stage | docs in {lo}x / {hi}x | input MB {lo}x / {hi}x | seconds {lo}x / {hi}x"
            f" | idle MB | peak MB {lo}x | peak MB {hi}x | peak ratio | above-idle ratio |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for a, b in zip(results[lo], results[hi], strict=True):
            base = idle[a["stage"]]
            above = (b["peak_mb"] - base) / max(a["peak_mb"] - base, 1)
            print(
                f"| {a['stage']} | {a['docs_in']:,} / {b['docs_in']:,} |"
                f" {a['input_mb']} / {b['input_mb']} | {a['seconds']} / {b['seconds']} |"
                f" {base} | {a['peak_mb']} | {b['peak_mb']} |"
                f" {b['peak_mb'] / a['peak_mb']:.2f}x | {above:.2f}x |"
            )
            a["idle_mb"] = b["idle_mb"] = base
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
