"""Benchmark of stage 7 (tokenize) against raw SentencePiece encoding of the same text.

    .venv/bin/python -m tests.bench.bench_tokenize [--quick] [--threads N] [--json PATH]

Corpus: the Python standard library's own sources (real text: code and English docstrings),
written as gzipped JSONL and run through stage 1 (``pipelines.ingest``), so that tokenize reads
what it reads in the pipeline: a documents stage output, id-sharded into 8 shards. A tokenizer
is trained in the same run by stage 6 (``pipelines.train_tokenizer``). Then, on the same
documents:

* raw: ``sp.encode(texts, add_eos=True, return_type="numpy", num_threads=N)`` in batches,
  texts already in memory: the ceiling for any tokenization stage;
* shard path: what one stage worker does (sort a shard, ``encode_rows``, ``write_shard``),
  for every shard in turn;
* stage: ``python -m pipelines.tokenize`` end to end on the DirectRunner (read gzipped JSONL,
  parse, encode, write, ledger, manifest; the id-sharded input maps shard k to store shard k,
  no shuffle), in process and with ``multi_processing`` (2 workers). Run as a child process;
  its time is the stage's own log line (pipeline build + run, not interpreter start-up) and its
  peak memory is the child's ``VmHWM`` (in-process run; ``multi_processing`` workers are not
  counted);
* stage, shuffle path: the same in process with ``shuffle=True`` (re-shard by id through a
  GroupByKey, what inputs that are not id-sharded stage outputs get).

Ratios are throughput ratios to raw encoding with the same thread count (>= 0.6 is the goal).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tokenstore  # noqa: E402
from pipelines import ingest, spm, tokenize, train_tokenizer  # noqa: E402
from pipelines.artifact_stage import run_artifact_stage  # noqa: E402
from pipelines.beam_io import read_documents, stable_shard  # noqa: E402
from pipelines.stage import run_stage  # noqa: E402
from pipelines.text import normalize_text  # noqa: E402
from pipelines.tokenize import encode_rows, token_shard_name  # noqa: E402

STAGE_LOG = re.compile(r"stage tokenize: .*\(([0-9.]+)s\)")


def stdlib_documents(max_bytes: int) -> Iterator[dict]:
    """Standard-library sources in path order until ``max_bytes`` of UTF-8 text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = normalize_text(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if not text:
            continue
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            return
        total += size
        yield {"id": str(path.relative_to(root)), "text": text, "source": "stdlib"}


def write_inputs(directory: Path, max_bytes: int, files: int) -> tuple[int, int]:
    docs = size = 0
    with contextlib.ExitStack() as stack:
        handles = [
            stack.enter_context(
                gzip.open(directory / f"in-{i:02d}.jsonl.gz", "wt", encoding="utf-8")
            )
            for i in range(files)
        ]
        for doc in stdlib_documents(max_bytes):
            handles[docs % files].write(json.dumps(doc, ensure_ascii=False) + "\n")
            docs += 1
            size += len(doc["text"].encode("utf-8"))
    return docs, size


def read_inputs(directory: Path) -> list[tuple[str, str]]:
    return [(d["id"], d["text"]) for d in read_documents(str(directory))]


def encode_raw(sp, texts: list[str], threads: int, batch_docs: int) -> int:
    tokens = 0
    for i in range(0, len(texts), batch_docs):
        tokens += sum(len(t) for t in spm.encode_with_eos(sp, texts[i : i + batch_docs], threads))
    return tokens


def shard_path(sp, rows, threads: int, batch_docs: int, num_shards: int, out: Path) -> None:
    """What the stage's workers do, shard after shard, without Beam around it."""
    shards: list[list[tuple[str, str]]] = [[] for _ in range(num_shards)]
    for row in rows:
        shards[stable_shard(row[0], num_shards)].append(row)
    for index, shard in enumerate(shards):
        tokens, letters = encode_rows(sp, sorted(shard), threads, batch_docs)
        assert not letters
        tokenstore.write_shard(str(out), token_shard_name(index, num_shards), tokens)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: all threads, not children)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def run_stage_in_process(
    inputs, tokenizer, out, threads, batch_docs, num_shards, shuffle: bool = False
) -> None:
    config = tokenize.TokenizeConfig(
        str(tokenizer), encode_threads=threads, batch_docs=batch_docs, shuffle=shuffle
    )
    tokenize.run(config, [str(inputs)], str(out), num_shards=num_shards)


# The child reports its own peak RSS: VmHWM is per address space, so unlike ru_maxrss it does
# not inherit the (vfork) parent's high-water mark, which holds the whole corpus here.
CHILD = """
import sys
from pipelines.tokenize import main
main(sys.argv[1:])
status = open("/proc/self/status").read().split("VmHWM:")[1].split()[0]
print(f"VmHWM {status}", file=sys.stderr)
"""


def run_stage_child(
    inputs: Path, tokenizer: Path, out: Path, config: dict, extra: list[str]
) -> tuple[float, float]:
    """The stage as its command line runs it; returns (stage seconds, child peak RSS MiB)."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            "--input",
            str(inputs),
            "--tokenizer",
            str(tokenizer),
            "--output",
            str(out),
            "--config",
            json.dumps(config),
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    seconds = STAGE_LOG.search(done.stderr)
    peak_kib = re.search(r"VmHWM (\d+)", done.stderr)
    assert seconds and peak_kib, done.stderr[-2000:]
    return float(seconds.group(1)), int(peak_kib.group(1)) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 MB corpus instead of 48 MB")
    parser.add_argument("--threads", type=int, default=0, help="encode threads (0: per CPU)")
    parser.add_argument("--repeat", type=int, default=0, help="rounds, best kept (0: 1 quick, 2)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    max_bytes = (4 if args.quick else 48) << 20
    threads = spm.resolve_threads(args.threads)
    repeat = args.repeat or (1 if args.quick else 2)
    num_shards, batch_docs = 8, 1024
    results: dict = {"quick": args.quick, "threads": threads, "cpus": os.cpu_count()}

    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        work = Path(tmp)
        raw_inputs = work / "raw"
        raw_inputs.mkdir()
        docs, size = write_inputs(raw_inputs, max_bytes, files=8)
        inputs = work / "inputs"
        start = time.perf_counter()
        ingested = run_stage(
            ingest.STAGE,
            ingest.build,
            ingest.IngestConfig(),
            [str(raw_inputs)],
            str(inputs),
            num_shards=num_shards,
            raw_records=True,
        ).manifest
        assert ingested.records_out == docs, ingested.dropped
        results.update(docs=docs, mb=round(size / 1e6, 2))
        print(
            f"corpus: {docs} stdlib sources, {size / 1e6:.1f} MB;"
            f" ingest took {time.perf_counter() - start:.1f} s",
            flush=True,
        )

        vocab = 2000 if args.quick else 8000
        config = train_tokenizer.TrainTokenizerConfig(
            vocab_size=vocab, max_sample_chars=(1 if args.quick else 4) * 1_000_000
        )
        start = time.perf_counter()
        run_artifact_stage(
            train_tokenizer.STAGE,
            train_tokenizer.KIND,
            train_tokenizer.build,
            config,
            [str(inputs)],
            str(work / "tok"),
            num_shards=num_shards,
        )
        results["train_tokenizer_s"] = round(time.perf_counter() - start, 2)
        print(f"tokenizer: vocab {vocab}, stage took {results['train_tokenizer_s']} s", flush=True)

        rows = read_inputs(inputs)
        texts = [text for _, text in rows]
        sp = spm.processor((work / "tok" / spm.MODEL_NAME).read_bytes())
        encode_raw(sp, texts[:200], threads, batch_docs)  # warm-up
        shards = ["--num_shards", str(num_shards)]
        stage_config = {"encode_threads": threads, "batch_docs": batch_docs}
        stage_args = (inputs, work / "tok", work / "store", threads, batch_docs, num_shards)
        # Rounds interleave raw and stage runs so that a noisy neighbour hits both; best kept.
        # Wall and CPU seconds (process-wide, all threads): on a shared machine the CPU ratio
        # is the steadier measure of the stage's overhead.
        best: dict[str, tuple[float, float]] = {}
        for round_ in range(repeat):
            timings = {
                "raw": timed(lambda: encode_raw(sp, texts, threads, batch_docs)),
                "path": timed(
                    lambda: shard_path(sp, rows, threads, batch_docs, num_shards, work / "p")
                ),
                "stage": timed(lambda: run_stage_in_process(*stage_args)),
                "shuffle": timed(lambda: run_stage_in_process(*stage_args, shuffle=True)),
            }
            print(
                f"round {round_}: "
                + ", ".join(f"{k} {w:.2f} s wall / {c:.2f} s cpu" for k, (w, c) in timings.items()),
                flush=True,
            )
            for key, (wall, cpu) in timings.items():
                old = best.get(key, (float("inf"), float("inf")))
                best[key] = (min(old[0], wall), min(old[1], cpu))
        tokens = encode_raw(sp, texts, threads, batch_docs)
        raw1 = timed(lambda: encode_raw(sp, texts, 1, batch_docs))
        child_s, stage_rss = run_stage_child(
            inputs, work / "tok", work / "store-child", stage_config, shards
        )
        mp_config = {"encode_threads": 1, "batch_docs": batch_docs}
        mp_args = [*shards, "--direct_running_mode=multi_processing", "--direct_num_workers=2"]
        mp_s, _ = run_stage_child(inputs, work / "tok", work / "store-mp", mp_config, mp_args)
        store = tokenstore.TokenStore.open(str(work / "store"))
        assert store.num_tokens == tokens, (store.num_tokens, tokens)

    mb = size / 1e6
    raw_w, raw_c = best["raw"]
    results.update(
        tokens=tokens,
        repeat=repeat,
        load_average=[round(x, 2) for x in os.getloadavg()],
        seconds={k: {"wall": round(w, 3), "cpu": round(c, 3)} for k, (w, c) in best.items()},
        raw_1thread_s=round(raw1[0], 3),
        stage_cli_in_process_s=child_s,
        stage_cli_multi_processing_s=mp_s,
        shard_path_ratio_wall=round(raw_w / best["path"][0], 3),
        shard_path_ratio_cpu=round(raw_c / best["path"][1], 3),
        stage_ratio_wall=round(raw_w / best["stage"][0], 3),
        stage_ratio_cpu=round(raw_c / best["stage"][1], 3),
        stage_shuffle_ratio_wall=round(raw_w / best["shuffle"][0], 3),
        stage_cli_ratio_wall=round(raw_w / child_s, 3),
        stage_multi_processing_ratio_wall=round(raw_w / mp_s, 3),
        stage_peak_rss_mib=round(stage_rss, 1),
        bench_peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )
    table = [
        ("raw sp.encode", *best["raw"]),
        ("raw sp.encode, 1 thread", *raw1),
        ("shard path (sort+encode+write_shard)", *best["path"]),
        ("stage, in-process (run_artifact_stage)", *best["stage"]),
        ("stage, in-process, shuffle path", *best["shuffle"]),
        ("stage CLI, DirectRunner in-process", child_s, float("nan")),
        ("stage CLI, multi_processing x2, 1 thread", mp_s, float("nan")),
    ]
    print(f"\n{docs} docs, {mb:.1f} MB, {tokens} tokens, {threads} encode thread(s)")
    print(
        f"{'what':42} {'wall s':>7} {'docs/s':>7} {'MB/s':>6} {'ratio':>6} {'cpu s':>6} {'ratio':>6}"
    )
    for name, wall, cpu in table:
        print(
            f"{name:42} {wall:7.2f} {docs / wall:7.0f} {mb / wall:6.2f} {raw_w / wall:6.2f}"
            f" {cpu:6.2f} {raw_c / cpu:6.2f}"
        )
    print(
        f"peak RSS: stage CLI child (in-process) {results['stage_peak_rss_mib']} MiB,"
        f" bench process (holds the corpus) {results['bench_peak_rss_mib']} MiB;"
        f" load average {results['load_average']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
