"""Benchmark of stage 4 (fuzzy dedup): our numpy MinHash + LSH against datasketch, and the stage.

    .venv/bin/python -m tests.bench.bench_minhash [--quick] [--max-mb N] [--json PATH]

Corpus: the real-text corpora under ``data/raw`` (spam emails with their natural
near-duplicates, Brown, fortunes, the Factbook, Python sources), read in file order up to
``--max-mb`` MB of text; the Python standard library's sources when ``data/raw`` is absent.

On the same documents, same ``num_perm`` (256), shingles (word 5-grams of
``pipelines.text.words``), threshold (0.8) and LSH weights (so the same bands x rows):

* ours: ``pipelines.minhash.signatures`` in batches of 256 documents, ``band_hashes``,
  ``bucket_links`` (candidate pairs) and ``verified`` (signature Jaccard >= threshold);
* datasketch: per document ``MinHash.update_batch`` of the encoded shingles, then
  ``MinHashLSH.insert`` of all and ``MinHashLSH.query`` of each (its candidate pairs).

The ratio is our throughput over datasketch's (>= 2 is the goal); both include tokenization.
Then the whole Beam stage (``python -m pipelines.fuzzy_dedup``, DirectRunner in process, and
with ``multi_processing`` on 2 workers unless ``--quick``) runs on the same documents as a child
process: its time is the stage's own log line (pipeline build + run, not interpreter start-up)
and its peak memory the largest resident peak of any one of its processes (``CHILD``; with
``multi_processing`` the parent and its workers together hold more).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from pipelines.fuzzy_dedup import FuzzyDedupConfig  # noqa: E402
from pipelines.minhash import (  # noqa: E402
    band_hashes,
    bucket_links,
    make_hasher,
    signatures,
    verified,
)
from pipelines.text import words  # noqa: E402

STAGE_SECONDS = re.compile(r"STAGE_SECONDS ([0-9.]+)")
# The child runs the stage's own entry point and reports StageRun.seconds (pipeline build + run).
# The stage, then its peak memory: the largest of its own VmHWM and the ru_maxrss of the
# worker processes it waited for (multi_processing). Not ``os.wait4``'s ru_maxrss here: Linux
# carries the forking parent's RSS into a child's ru_maxrss across exec, and this parent holds
# the corpus and datasketch's index.
CHILD = """
import resource, sys
from pipelines import fuzzy_dedup
run = fuzzy_dedup.main(sys.argv[1:])
status = open("/proc/self/status").read()
own = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(f"STAGE_SECONDS {run.seconds}", file=sys.stderr)
print(f"BENCH_PEAK_KB {max(own, workers)}", file=sys.stderr)
"""
BATCH = 256


def _raw_records() -> dict[str, list[dict]]:
    by_source: dict[str, list[dict]] = {}
    for path in sorted((ROOT / "data" / "raw").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                by_source.setdefault(record["source"], []).append(record)
    if not by_source:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        by_source["stdlib"] = [
            {"id": str(p), "text": p.read_text("utf-8", "replace"), "source": "stdlib"}
            for p in sorted(stdlib.rglob("*.py"))
        ]
    return by_source


def corpus_documents(max_bytes: int) -> Iterator[dict]:
    """Documents of data/raw (or stdlib sources) in file order: an equal byte budget each."""
    by_source = _raw_records()
    budget = max_bytes / len(by_source)
    for source, records in sorted(by_source.items()):
        total = 0
        for record in records:
            if total >= budget:
                break
            total += len(record["text"].encode("utf-8"))
            yield {"id": record["id"], "text": record["text"], "source": source, "metadata": {}}


def ours(texts: list[str], config: FuzzyDedupConfig) -> dict:
    bands, rows = config.lsh()
    hasher = make_hasher(config.minhash)
    start = time.perf_counter()
    parts, counts = [], []
    for i in range(0, len(texts), BATCH):
        sigs, n = signatures(texts[i : i + BATCH], hasher)
        parts.append(sigs)
        counts.append(n)
    sigs, counts = np.concatenate(parts), np.concatenate(counts)
    hashed = time.perf_counter()
    keep = np.flatnonzero(counts > 0)
    pairs = keep[bucket_links(band_hashes(sigs[keep], bands, rows, config.seed))]
    edges = pairs[verified(sigs, pairs, config.threshold)]
    end = time.perf_counter()
    return {
        "seconds": end - start,
        "minhash_seconds": hashed - start,
        "candidate_pairs": len(pairs),
        "verified_pairs": len(edges),
    }


def datasketch_baseline(texts: list[str], config: FuzzyDedupConfig) -> dict:
    from datasketch import MinHash, MinHashLSH

    ngram = config.ngram
    weights = (config.false_positive_weight, config.false_negative_weight)
    start = time.perf_counter()
    lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm, weights=weights)
    sketches = {}
    for i, text in enumerate(texts):
        ws = words(text)
        if not ws:
            continue
        if len(ws) < ngram:
            shingles = [" ".join(ws).encode("utf-8")]
        else:
            shingles = [" ".join(ws[j : j + ngram]).encode("utf-8") for j in range(len(ws) - 4)]
        sketch = MinHash(num_perm=config.num_perm, seed=config.seed)
        sketch.update_batch(shingles)
        sketches[i] = sketch
        lsh.insert(i, sketch)
    hashed = time.perf_counter()
    pairs = {(min(i, j), max(i, j)) for i, s in sketches.items() for j in lsh.query(s) if j != i}
    end = time.perf_counter()
    return {
        "seconds": end - start,
        "minhash_seconds": hashed - start,
        "candidate_pairs": len(pairs),
        "bands_rows": [lsh.b, lsh.r],
    }


def run_stage_child(input_dir: Path, output: Path, beam_args: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-c",
        CHILD,
        "--input",
        str(input_dir),
        "--output",
        str(output),
        *beam_args,
    ]
    with tempfile.TemporaryFile() as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log).returncode
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
    if code != 0:
        raise RuntimeError(f"stage failed ({code}):\n{text[-3000:]}")
    seconds = float(STAGE_SECONDS.findall(text)[-1])
    manifest = json.loads((output / "manifest.json").read_text())
    return {
        "seconds": seconds,
        "peak_rss_mb": int(text.rsplit("BENCH_PEAK_KB ", 1)[1].split()[0]) / 1024,
        "records_out": manifest["records_out"],
        "dropped": manifest["dropped"],
        "cc_rounds": manifest["extra"]["cc_rounds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small corpus, in-process stage")
    parser.add_argument("--max-mb", type=float, default=None, help="corpus size in MB of text")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    max_mb = args.max_mb or (4.0 if args.quick else 24.0)
    docs = list(corpus_documents(int(max_mb * 1e6)))
    texts = [d["text"] for d in docs]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    config = FuzzyDedupConfig()
    print(
        f"corpus: {len(docs)} documents, {mb:.1f} MB; num_perm {config.num_perm},"
        f" threshold {config.threshold}, bands x rows {config.lsh()}"
    )

    results: dict = {"documents": len(docs), "megabytes": round(mb, 2)}
    ours(texts[:BATCH], config)  # warm-up: constants, numpy code paths
    mine = ours(texts, config)
    theirs = datasketch_baseline(texts, config)
    for name, r in (("ours", mine), ("datasketch", theirs)):
        r["docs_per_s"] = len(docs) / r["seconds"]
        r["mb_per_s"] = mb / r["seconds"]
        results[name] = r
        print(
            f"{name:>10}: {r['seconds']:7.2f}s  {r['docs_per_s']:9.0f} docs/s"
            f"  {r['mb_per_s']:6.2f} MB/s  (MinHash {r['minhash_seconds']:.2f}s,"
            f" {r['candidate_pairs']} candidate pairs)"
        )
    results["ratio"] = theirs["seconds"] / mine["seconds"]
    print(f"     ratio: {results['ratio']:.2f}x datasketch (MinHash + LSH candidates)")

    modes = [("in_process", [])]
    if not args.quick:
        modes.append(
            (
                "multi_processing_2",
                ["--direct_running_mode=multi_processing", "--direct_num_workers=2"],
            )
        )
    with tempfile.TemporaryDirectory() as tmp:
        input_dir = Path(tmp) / "input"
        input_dir.mkdir()
        shards = 8
        for s in range(shards):
            with gzip.open(input_dir / f"part-{s:05d}.jsonl.gz", "wt", encoding="utf-8") as f:
                for doc in docs[s::shards]:
                    f.write(json.dumps(doc) + "\n")
        for name, beam_args in modes:
            r = run_stage_child(input_dir, Path(tmp) / name, beam_args)
            r["docs_per_s"] = len(docs) / r["seconds"]
            r["mb_per_s"] = mb / r["seconds"]
            results[f"stage_{name}"] = r
            print(
                f"stage {name}: {r['seconds']:.1f}s  {r['docs_per_s']:.0f} docs/s"
                f"  {r['mb_per_s']:.2f} MB/s  peak RSS {r['peak_rss_mb']:.0f} MB"
                f"  ({r['records_out']} kept, dropped {r['dropped']}, {r['cc_rounds']} rounds)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
