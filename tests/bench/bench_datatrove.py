"""Our data-plane stages against the equivalent DataTrove pipelines, on the same documents.

    .venv/bin/python -m tests.bench.bench_datatrove [--quick] [--output out/bench/datatrove]
        [--near N] [--exact N] [--json PATH]

Needs the corpora (``make corpora``) and DataTrove's own venv ``.venv-datatrove`` (``make
bench`` builds it; DataTrove is no dependency of Slipway). Issue 18's target: ours >= 2x
DataTrove's documents/s, per stage.

**Input.** The five ``data/raw`` corpora (all of them; ``--quick``: their first MB of text
each) plus *planted* duplicates of known documents (originals with 100-20,000 words, chosen by
a fixed seed): ``--exact`` copies that only differ in case, spacing or punctuation (exact dedup's
ground truth), and ``--near`` copies with 0.5-1.5% of their words replaced, deleted or
duplicated (MinHash dedup's ground truth: word 5-gram Jaccard ~0.82-1.0 with the original,
printed per run).
``pipelines.ingest`` turns them into the documents every stage reads (4 id-sharded gzipped
JSONL shards); DataTrove's ``JsonlReader`` reads the very same shard files (one task each).
Every stage, on both sides, runs on that one set of documents (not chained), so each pair
compares the same work.

**Running.** Each side of each stage is one child process, timed from the outside (wall
seconds, interpreter start-up and imports included: ~1.3 s for Beam, ~0.5 s for DataTrove) and by
its own clock ("stage s": ours the stage's log line, i.e. pipeline build + run; DataTrove's the
executors' runs); peak MB is the child's ``VmHWM`` at exit (its peak resident memory; not
``ru_maxrss`` from ``os.wait4``, which on Linux includes the forking parent's RSS). Ours: ``python -m
pipelines.<stage>`` (in-process DirectRunner, 4 output shards, ``pipelines/demo_config.json``);
DataTrove: ``tests/bench/datatrove_side.py`` with ``.venv-datatrove``'s python,
``LocalPipelineExecutor`` with ``workers=1`` (tasks in sequence, in process). Our in-process
DirectRunner is one thread too, but for its shard writer, which gzips on a second thread (zlib
releases the GIL): on these 2 cores that is up to ~1.5 s of fuzzy dedup's work beside the
stage (docs/benchmarks.md). docs/s and the ratio use wall seconds; the ratio is ours /
DataTrove's docs/s.

**Stages and what differs** (DataTrove 0.10.1):

1. *Quality*: ours = Gopher quality + repetition rules and C4/FineWeb-style rules, every score
   computed for every document (they are stored in ``metadata["quality"]``), demo per-source
   thresholds. DataTrove = ``GopherRepetitionFilter`` + ``GopherQualityFilter`` +
   ``C4QualityFilter`` (FineWeb's settings: no terminal-punctuation line removal; sentence count
   and curly-bracket rule off, as ours has neither) + ``FineWebQualityFilter`` reduced to its
   0.12 terminal-punctuation floor (ours' ``min_terminal_punctuation_line_fraction``), the
   papers' thresholds (ours' defaults) for every source, each filter stopping at its first
   failed rule. C4's javascript / policy rules remove lines there; ours drops documents with
   over 20% such lines. Agreement is reported against ours' default thresholds for every source,
   re-applied to our stored scores (``apply_thresholds``).
2. *Exact dedup*: ours = document level + cross-document paragraph marking (the demo config),
   and, like for like, document level alone (``dedup_paragraphs: false``). DataTrove =
   ``ExactDedupSignature`` + ``ExactFindDedups`` + ``ExactDedupFilter`` on documents, its
   content the same normalized text (lowercased ``\\w+`` runs joined by spaces), xxhash64.
   Recall: planted copies found; precision: removed documents whose normalized text equals a
   kept one's.
   *At both levels*, like for like: ours with ``paragraph_unit: line`` and
   ``remove_duplicate_paragraphs: true`` (documents, then every line repeated from another
   kept document cut out). DataTrove = the exact dedup above, then its sentence dedup on lines
   (``SentDedupConfig(n_sentences=1, split_sentences=False)``, the same normalization: lowercase,
   punctuation to spaces; ``min_words_to_remove_span`` = ours' ``min_paragraph_words``; no
   minimum document size), the sentence signatures taken from the exact filter's stream (its
   cheapest arrangement: it reads the input three times, ours twice). What each cuts differs: DataTrove also cuts
   lines repeated within one document (ours leaves them to the quality stage), and it
   compares every line, keeping a run of repeated lines only when the run's first line is
   short (ours never compares a short line). The documents with lines cut are counted on
   each side, and those cut by both.
3. *MinHash dedup*: ours = ``pipelines.fuzzy_dedup`` (256 permutations, 23 bands x 11 rows,
   candidates verified at signature Jaccard >= 0.8, connected components). DataTrove =
   ``MinhashDedupSignature`` / ``Buckets`` / ``Cluster`` / ``Filter`` with 23 buckets x 11
   hashes (253 hashes: it has no separate permutation count), xxhash64 shingles mod 2^61 - 1,
   every bucket collision a duplicate (no verification). Same shingles: word 5-grams of the
   same words (lowercased ``\\w+``; DataTrove's punctuation, digit and diacritic rewriting
   off). Recall: planted near-duplicate pairs that end in one cluster with one of the two
   removed; precision: removed documents whose exact shingle Jaccard with some other member of
   their cluster reaches 0.8.

**Tokenizers** (offline-safe): DataTrove 0.10.1 gives English spaCy's blank ``en`` pipeline
(no model download, but the ``spacy`` package and its cost); older releases used NLTK's punkt,
whose data download fails offline. The DataTrove side passes its blocks tokenizers that
reproduce ours instead (see ``datatrove_side.py``), so both sides split text the same way and
DataTrove gets its cheapest configuration.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import xxhash  # noqa: E402

from pipelines.beam_io import read_dead_letters, read_documents  # noqa: E402
from pipelines.configs import ExactDedupConfig, FuzzyDedupConfig, QualityThresholds  # noqa: E402
from pipelines.manifest import read_manifest  # noqa: E402
from pipelines.quality import apply_thresholds  # noqa: E402
from pipelines.text import dedup_key_text, words  # noqa: E402
from tests.bench.bench_minhash import _raw_records  # noqa: E402
from tests.bench.bench_stages import CHILD as STAGE_CHILD  # noqa: E402
from tests.bench.bench_stages import run_stage  # noqa: E402

DATATROVE_PYTHON = ROOT / ".venv-datatrove" / "bin" / "python"
SIDE = ROOT / "tests" / "bench" / "datatrove_side.py"
STAGE_LOG = re.compile(r"stage \w+: .*\(([0-9.]+)s\)")
SEED = 18
QUICK_MB = 1.0  # text per source, with --quick
NEAR_RATES = (0.005, 0.01, 0.015)  # fraction of a planted near-duplicate's words edited


# --- input: the corpora plus planted duplicates --------------------------------------------


def _exact_variant(text: str, k: int) -> str:
    """Same text for exact dedup (case, spacing, punctuation), different bytes."""
    if k % 3 == 0:
        return text.upper()
    if k % 3 == 1:
        return text.replace(" ", "  ")
    return text.replace(".", "!") + " ..."


def _near_variant(text: str, rate: float, rng: random.Random) -> str:
    """The text with ``rate`` of its whitespace tokens replaced, deleted or duplicated."""
    parts = re.split(r"(\s+)", text)
    positions = [i for i in range(0, len(parts), 2) if parts[i]]
    vocabulary = [parts[i] for i in positions]
    for i in rng.sample(positions, max(1, round(rate * len(positions)))):
        edit = rng.randrange(3)
        if edit == 0:
            parts[i] = rng.choice(vocabulary) + "x"
        elif edit == 1:
            parts[i] = ""
        else:
            parts[i] = parts[i] + " " + parts[i]
    return "".join(parts)


def plant(
    by_source: dict[str, list[dict]], n_exact: int, n_near: int
) -> tuple[list[dict], list[tuple[str, str]], list[tuple[str, str]]]:
    """Planted copies (raw records) and their (original id, copy id) pairs: exact, near."""
    rng = random.Random(SEED)
    candidates = sorted(
        (
            record
            for records in by_source.values()
            for record in records
            if 100 <= len(words(record["text"])) <= 20_000
        ),
        key=lambda r: r["id"],
    )
    chosen = rng.sample(candidates, n_exact + n_near)
    planted, exact_pairs, near_pairs = [], [], []
    for k, original in enumerate(chosen):
        if k < n_exact:
            copy_id, text = f"planted/exact-{k:04d}", _exact_variant(original["text"], k)
            exact_pairs.append((original["id"], copy_id))
        else:
            rate = NEAR_RATES[k % len(NEAR_RATES)]
            copy_id = f"planted/near-{k - n_exact:04d}"
            text = _near_variant(original["text"], rate, rng)
            near_pairs.append((original["id"], copy_id))
        planted.append({"id": copy_id, "text": text, "source": original["source"]})
    return planted, exact_pairs, near_pairs


def first_megabytes(records: list[dict], megabytes: float) -> list[dict]:
    taken, total = [], 0
    for record in records:
        if total >= megabytes * 1e6:
            break
        taken.append(record)
        total += len(record["text"].encode("utf-8"))
    return taken


def write_jsonl_gz(path: Path, records: list[dict]) -> str:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return str(path)


# --- running one side of one stage ---------------------------------------------------------


def run_child(argv: list[str]) -> dict:
    """Run a command: its wall seconds, its own report of its peak RSS, and its output.

    The peak is the child's ``VmHWM`` at exit (``BENCH_PEAK_KB`` on stderr), not the
    ``ru_maxrss`` of ``os.wait4``: Linux carries the forking parent's RSS into the child's
    ``ru_maxrss`` across ``exec``, and this parent holds the corpus.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        code = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=err, check=False).returncode
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode("utf-8", "replace")
        stderr = err.read().decode("utf-8", "replace")
    if code != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed ({code}):\n{stderr[-4000:]}")
    peak_kb = int(stderr.rsplit("BENCH_PEAK_KB ", 1)[1].split()[0])
    return {"wall": wall, "peak_mb": peak_kb / 1024, "stdout": stdout, "stderr": stderr}


def ours(module: str, inputs: Path, output: Path, config: dict) -> dict:
    # bench_stages' child: runs the module as ``python -m`` would, reports VmHWM at exit.
    argv = [sys.executable, "-c", STAGE_CHILD, f"pipelines.{module}", "--input", str(inputs)]
    run = run_child([*argv, "--output", str(output), "--config", json.dumps(config)])
    run["stage_seconds"] = float(STAGE_LOG.findall(run["stderr"])[-1])
    return run


def datatrove(stage: str, inputs: Path, work: Path, *options: str) -> dict:
    shutil.rmtree(work, ignore_errors=True)  # the executor skips tasks it finds completed
    argv = [str(DATATROVE_PYTHON), str(SIDE), stage, "--input", str(inputs), "--work", str(work)]
    run = run_child([*argv, *options])
    result = json.loads(run["stdout"].strip().splitlines()[-1])
    run["stage_seconds"] = result["seconds"]
    run["steps"] = result["steps"]
    return run


def datatrove_docs(folder: Path) -> list[dict]:
    docs = []
    for path in sorted(folder.rglob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            docs.extend(json.loads(line) for line in handle)
    return docs


# --- scoring the outputs -------------------------------------------------------------------


def shingles(text: str, n: int) -> set[str]:
    ws = words(text)
    if len(ws) < n:
        return {" ".join(ws)} if ws else set()
    return {" ".join(ws[i : i + n]) for i in range(len(ws) - n + 1)}


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def pair_recall(pairs: list[tuple[str, str]], removed: set[str], cluster: dict[str, str]) -> float:
    """Pairs with one side removed (and, where clusters are known, both in one cluster)."""
    found = 0
    for a, b in pairs:
        same = cluster.get(a) is not None and cluster.get(a) == cluster.get(b)
        found += (a in removed or b in removed) and (not cluster or same)
    return found / len(pairs) if pairs else float("nan")


def exact_scores(
    texts: dict[str, str], removed: set[str], pairs: list[tuple[str, str]]
) -> tuple[float, float]:
    def key(doc_id: str) -> str:
        return xxhash.xxh3_128_hexdigest(dedup_key_text(texts[doc_id]).encode("utf-8"))

    kept_keys = {key(i) for i in texts if i not in removed}
    precision = sum(key(i) in kept_keys for i in removed) / len(removed) if removed else 1.0
    return pair_recall(pairs, removed, {}), precision


def near_scores(
    texts: dict[str, str],
    removed: set[str],
    cluster: dict[str, str],
    pairs: list[tuple[str, str]],
    config: FuzzyDedupConfig,
) -> tuple[float, float]:
    members = defaultdict(list)
    for doc_id, c in sorted(cluster.items()):
        members[c].append(doc_id)
    cache: dict[str, set[str]] = {}

    def sh(doc_id: str) -> set[str]:
        if doc_id not in cache:
            cache[doc_id] = shingles(texts[doc_id], config.ngram)
        return cache[doc_id]

    good = 0
    for doc_id in removed:
        others = [m for m in members[cluster.get(doc_id)] if m != doc_id][:200]
        good += any(jaccard(sh(doc_id), sh(m)) >= config.threshold for m in others)
    precision = good / len(removed) if removed else 1.0
    return pair_recall(pairs, removed, cluster), precision


# --- the benchmark -------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_MB:g} MB a source")
    parser.add_argument("--output", type=Path, default=ROOT / "out" / "bench" / "datatrove")
    parser.add_argument("--near", type=int, default=None, help="planted near-duplicates")
    parser.add_argument("--exact", type=int, default=None, help="planted exact duplicates")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if not DATATROVE_PYTHON.exists():
        raise SystemExit(f"no {DATATROVE_PYTHON.relative_to(ROOT)}: run `make bench`")
    n_near = args.near if args.near is not None else (60 if args.quick else 300)
    n_exact = args.exact if args.exact is not None else (60 if args.quick else 300)
    out = args.output
    shutil.rmtree(out, ignore_errors=True)
    (out / "raw").mkdir(parents=True)
    demo = json.loads((ROOT / "pipelines" / "demo_config.json").read_text())

    by_source = _raw_records()
    if args.quick:
        by_source = {s: first_megabytes(records, QUICK_MB) for s, records in by_source.items()}
    planted, exact_pairs, near_pairs = plant(by_source, n_exact, n_near)
    raw = [write_jsonl_gz(out / "raw" / f"{s}.jsonl.gz", r) for s, r in by_source.items()]
    raw.append(write_jsonl_gz(out / "raw" / "planted.jsonl.gz", planted))
    ingest = run_stage("ingest", raw, out / "ingest", ["--config", json.dumps(demo["ingest"])])
    docs = list(read_documents(str(out / "ingest")))
    texts = {d["id"]: d["text"] for d in docs}
    megabytes = sum(len(t.encode("utf-8")) for t in texts.values()) / 1e6
    # DataTrove reads the very shard files our stages read.
    shards = out / "datatrove_input"
    shards.mkdir()
    for path in read_manifest(str(out / "ingest")).shard_paths(str(out / "ingest")):
        shutil.copy(path, shards / Path(path).name)
    fuzzy = FuzzyDedupConfig(**demo["fuzzy_dedup"])
    near_j = sorted(
        jaccard(shingles(texts[a], fuzzy.ngram), shingles(texts[b], fuzzy.ngram))
        for a, b in near_pairs
        if a in texts and b in texts
    )
    print(
        f"input: {len(docs):,} documents, {megabytes:.1f} MB (ingest {ingest['seconds']} s);"
        f" planted {len(exact_pairs)} exact and {len(near_pairs)} near duplicates (5-gram"
        f" Jaccard {near_j[0]:.2f}-{near_j[-1]:.2f}, median {near_j[len(near_j) // 2]:.2f})",
        flush=True,
    )
    rows: list[dict] = []

    def row(stage: str, side: str, run: dict, **extra) -> dict:
        r = {
            "stage": stage,
            "side": side,
            "wall_s": round(run["wall"], 2),
            "stage_s": round(run["stage_seconds"], 2),
            "docs_per_s": round(len(docs) / run["wall"]),
            "mb_per_s": round(megabytes / run["wall"], 2),
            "peak_mb": round(run["peak_mb"]),
            **extra,
        }
        if "steps" in run:
            r["steps"] = {k: round(v, 2) for k, v in run["steps"].items()}
        rows.append(r)
        print(json.dumps(r), flush=True)
        return r

    # 1. quality
    mine = ours("quality", out / "ingest", out / "quality", demo["quality"])
    kept = {d["id"] for d in read_documents(str(out / "quality"))}
    scores = {d["id"]: d["metadata"]["quality"] for d in read_documents(str(out / "quality"))}
    for letter in read_dead_letters(str(out / "quality")):
        scores[letter["record"]["id"]] = letter["record"]["metadata"]["quality"]
    default = QualityThresholds()
    kept_default = {i for i, s in scores.items() if not apply_thresholds(s, default)}
    theirs = datatrove("quality", shards, out / "dt_quality")
    dt_kept = {d["id"] for d in datatrove_docs(out / "dt_quality" / "kept")}
    agree = sum((i in kept_default) == (i in dt_kept) for i in texts) / len(texts)
    row("quality", "ours", mine, kept=len(kept), kept_default_thresholds=len(kept_default))
    row("quality", "datatrove", theirs, kept=len(dt_kept), agreement=round(agree, 4))

    # 2. exact dedup
    for side_name, config in (
        ("ours", demo["exact_dedup"]),
        ("ours, documents only", {**demo["exact_dedup"], "dedup_paragraphs": False}),
    ):
        name = "exact_dedup" if side_name == "ours" else "exact_dedup_docs"
        mine = ours("exact_dedup", out / "ingest", out / name, config)
        removed = {
            letter["record"]["id"]
            for letter in read_dead_letters(str(out / name))
            if letter["reason"] == "exact_duplicate"
        }
        recall, precision = exact_scores(texts, removed, exact_pairs)
        row(
            "exact_dedup", side_name, mine, removed=len(removed), recall=recall, precision=precision
        )
    theirs = datatrove("exact", shards, out / "dt_exact")
    removed = {d["id"] for d in datatrove_docs(out / "dt_exact" / "removed")}
    recall, precision = exact_scores(texts, removed, exact_pairs)
    row(
        "exact_dedup", "datatrove", theirs, removed=len(removed), recall=recall, precision=precision
    )

    # 2b. exact dedup at both levels, like for like: documents, then repeated lines removed
    lines = {**demo["exact_dedup"], "paragraph_unit": "line", "remove_duplicate_paragraphs": True}
    mine = ours("exact_dedup", out / "ingest", out / "exact_dedup_lines", lines)
    removed, changed = set(), set()
    for letter in read_dead_letters(str(out / "exact_dedup_lines")):
        doc_id = letter["record"]["id"]
        (removed if letter["reason"] == "exact_duplicate" else changed).add(doc_id)
    changed |= {
        d["id"]
        for d in read_documents(str(out / "exact_dedup_lines"))
        if d["text"] != texts[d["id"]]
    }
    recall, precision = exact_scores(texts, removed, exact_pairs)
    row(
        "exact_dedup_lines",
        "ours (documents + lines)",
        mine,
        removed=len(removed),
        changed=len(changed),
        recall=recall,
        precision=precision,
    )
    min_words = str(ExactDedupConfig(**lines).min_paragraph_words)
    theirs = datatrove("exact_lines", shards, out / "dt_exact_lines", "--min-line-words", min_words)
    removed = {d["id"] for d in datatrove_docs(out / "dt_exact_lines" / "removed")}
    dt_kept = {d["id"]: d["text"] for d in datatrove_docs(out / "dt_exact_lines" / "kept")}
    # Documents left empty are dropped without a record there: changed too.
    dt_changed = {i for i in texts if i not in removed and dt_kept.get(i) != texts[i]}
    recall, precision = exact_scores(texts, removed, exact_pairs)
    row(
        "exact_dedup_lines",
        "datatrove",
        theirs,
        removed=len(removed),
        changed=len(dt_changed),
        changed_by_both=len(changed & dt_changed),
        recall=recall,
        precision=precision,
    )

    # 3. MinHash dedup
    mine = ours("fuzzy_dedup", out / "ingest", out / "fuzzy_dedup", demo["fuzzy_dedup"])
    cluster = {
        d["id"]: d["metadata"]["fuzzy_dedup"]["cluster"]
        for d in read_documents(str(out / "fuzzy_dedup"))
    }
    removed = set()
    for letter in read_dead_letters(str(out / "fuzzy_dedup")):
        if letter["reason"] == "fuzzy_duplicate":
            removed.add(letter["record"]["id"])
            cluster[letter["record"]["id"]] = letter["cluster"]
    recall, precision = near_scores(texts, removed, cluster, near_pairs, fuzzy)
    row("minhash_dedup", "ours", mine, removed=len(removed), recall=recall, precision=precision)
    bands, rows_per_band = fuzzy.lsh()
    theirs = datatrove("minhash", shards, out / "dt_minhash")
    removed, cluster = set(), {}
    for part in ("kept", "removed"):
        for d in datatrove_docs(out / "dt_minhash" / part):
            c = d.get("metadata", {}).get("minhash_cluster_id", -1)
            if c != -1:
                cluster[d["id"]] = f"c{c}"
            if part == "removed":
                removed.add(d["id"])
    recall, precision = near_scores(texts, removed, cluster, near_pairs, fuzzy)
    row(
        "minhash_dedup",
        "datatrove",
        theirs,
        removed=len(removed),
        recall=recall,
        precision=precision,
    )

    print_tables(rows, len(docs), megabytes, (bands, rows_per_band))
    if args.json:
        Path(args.json).write_text(json.dumps({"documents": len(docs), "rows": rows}, indent=2))


def print_tables(rows: list[dict], n_docs: int, megabytes: float, lsh: tuple[int, int]) -> None:
    print(f"\n{n_docs:,} documents, {megabytes:.1f} MB; MinHash {lsh[0]} bands x {lsh[1]} rows")
    print(
        "| stage | side | wall s | stage s | docs/s | MB/s | peak MB | result | recall | precision |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        result = (f"{r['kept']:,} kept" if "kept" in r else f"{r['removed']:,} removed") + (
            f" ({r['agreement']:.1%} agree)" if "agreement" in r else ""
        )
        if "changed" in r:
            result += f", {r['changed']:,} with lines cut" + (
                f" ({r['changed_by_both']:,} by both)" if "changed_by_both" in r else ""
            )
        recall = f"{r['recall']:.3f}" if "recall" in r else ""
        precision = f"{r['precision']:.3f}" if "precision" in r else ""
        print(
            f"| {r['stage']} | {r['side']} | {r['wall_s']} | {r['stage_s']} | {r['docs_per_s']:,} |"
            f" {r['mb_per_s']} | {r['peak_mb']} | {result} | {recall} | {precision} |"
        )
    print()
    by_stage = defaultdict(dict)
    for r in rows:
        by_stage[r["stage"]][r["side"]] = r
    for stage, sides in by_stage.items():
        theirs = sides["datatrove"]
        for side, r in sides.items():
            if side == "datatrove":
                continue
            wall = theirs["wall_s"] / r["wall_s"]
            inner = theirs["stage_s"] / r["stage_s"]
            verdict = "meets" if wall >= 2 else "misses"
            print(
                f"ratio {stage} ({side} / datatrove): {wall:.2f}x docs/s"
                f" (stage time alone {inner:.2f}x); {verdict} the 2x target"
            )


if __name__ == "__main__":
    main()
