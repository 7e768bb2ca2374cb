"""The DataTrove side of ``tests/bench/bench_datatrove.py``: one stage's DataTrove pipelines.

    .venv-datatrove/bin/python tests/bench/datatrove_side.py {quality,exact,exact_lines,minhash} \\
        --input DIR --work DIR [--tasks N] [--workers 1] [--min-line-words 3]

Runs in ``.venv-datatrove`` (``make bench`` builds it; DataTrove is no dependency of Slipway)
and imports only DataTrove, its dependencies and the standard library: nothing of Slipway's.
Reads the ``*.jsonl.gz`` files of ``--input`` (one task per file), writes kept documents under
``WORK/kept`` and removed ones under ``WORK/removed`` (DataTrove's JSONL, gzipped), and prints
one JSON line: ``{"seconds": ..., "steps": {step: seconds}}``, the time of the executors' runs
(interpreter start-up and imports excluded; the caller also times the whole process), and
``BENCH_PEAK_KB`` (its ``VmHWM``) on stderr.

Tokenization (offline-safe, and the same units as Slipway's stages): DataTrove 0.10.1 assigns
English to spaCy's blank ``en`` pipeline (``pip install spacy``, no model download; older
releases used NLTK's punkt, which needs a data download that fails offline). Every block here
gets a ``WordTokenizer`` of ours instead, so both sides tokenize the same way and DataTrove
does not pay for spaCy:

* ``WhitespaceWords`` (``text.split()``): Gopher's word statistics, as Slipway's quality stage
  computes them (whitespace tokens, punctuation attached);
* ``RegexWords`` (``re.findall(r"\\w+", text.lower())``, i.e. ``pipelines.text.words``):
  Gopher's n-gram repetition rules and the MinHash shingles (word 5-grams), as in Slipway.

Sentences (C4's sentence count, switched off here) would use a regex splitter.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup import (
    ExactDedupConfig,
    ExactDedupFilter,
    ExactDedupSignature,
    ExactFindDedups,
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
    SentDedupConfig,
    SentenceDedupFilter,
    SentenceDedupSignature,
    SentenceFindDedups,
)
from datatrove.pipeline.filters import (
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
)
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import TextNormConfig
from datatrove.utils.word_tokenizers import WordTokenizer

_WORD = re.compile(r"\w+", re.UNICODE)
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|\n|$)")


class _RegexSentences(WordTokenizer):
    def sent_tokenize(self, text: str) -> list[str]:
        return [s.strip() for s in _SENTENCE.findall(text) if s.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in _SENTENCE.finditer(text) if m.group().strip()]


class WhitespaceWords(_RegexSentences):
    """Whitespace tokens: Gopher's word statistics as the paper (and Slipway) count them."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()


class RegexWords(_RegexSentences):
    """Lowercased ``\\w+`` runs: Slipway's ``pipelines.text.words``."""

    def word_tokenize(self, text: str) -> list[str]:
        return _WORD.findall(text.lower())


def dedup_key(doc) -> str:
    """Exact dedup's content: Slipway's ``dedup_key_text`` (case, punctuation, spacing ignored)."""
    return " ".join(_WORD.findall(doc.text.lower()))


def lowercased(*, punctuation_to_spaces: bool) -> TextNormConfig:
    """DataTrove's text normalization cut down to Slipway's: lowercase, whitespace runs as one
    space, and punctuation to spaces or kept; no digit, diacritic, weekday or month rewriting."""
    return TextNormConfig(
        lowercase=True,
        norm_whitespace=True,
        remove_punctuation=punctuation_to_spaces,
        norm_unicode_diacritics=False,
        norm_numbers=False,
        norm_weekdays=False,
        norm_monthnames=False,
    )


def reader(folder: Path) -> JsonlReader:
    return JsonlReader(str(folder), glob_pattern="*.jsonl.gz", add_file_path=False)


def run(name: str, pipeline: list, work: Path, tasks: int, workers: int) -> float:
    executor = LocalPipelineExecutor(
        pipeline=pipeline, tasks=tasks, workers=workers, logging_dir=str(work / "logs" / name)
    )
    start = time.perf_counter()
    executor.run()
    return time.perf_counter() - start


def quality(args: argparse.Namespace) -> dict[str, float]:
    # Slipway's default thresholds are the papers', which are DataTrove's defaults too.
    def removed(name: str) -> JsonlWriter:
        return JsonlWriter(str(args.work / "removed" / name))

    pipeline = [
        reader(args.input),
        GopherRepetitionFilter(language=RegexWords(), exclusion_writer=removed("repetition")),
        GopherQualityFilter(language=WhitespaceWords(), exclusion_writer=removed("gopher")),
        # C4 as FineWeb runs it (no line removal for missing terminal punctuation: the
        # document-level 0.12 floor below instead), without the sentence count and the
        # curly-bracket rule, which Slipway does not have. Its javascript and policy rules
        # remove lines (Slipway drops documents with over 20% such lines).
        C4QualityFilter(
            filter_no_terminal_punct=False,
            min_num_sentences=-1,
            filter_curly_bracket=False,
            language=RegexWords(),
            exclusion_writer=removed("c4"),
        ),
        # Only FineWeb's terminal-punctuation floor (Slipway's
        # min_terminal_punctuation_line_fraction); its other rules are switched off.
        FineWebQualityFilter(
            line_punct_thr=0.12,
            short_line_thr=1.0,
            char_duplicates_ratio=1.0,
            new_line_ratio=float("inf"),
            language=RegexWords(),
            exclusion_writer=removed("fineweb"),
        ),
        JsonlWriter(str(args.work / "kept")),
    ]
    return {"filters": run("quality", pipeline, args.work, args.tasks, args.workers)}


def filter_step(args: argparse.Namespace, make_filter: Callable[[JsonlWriter], object]) -> float:
    """A dedup's last stage: the input through ``make_filter(writer of the removed)`` into
    ``kept/``, the removed into ``removed/`` (what the recall/precision check reads)."""
    removed = JsonlWriter(str(args.work / "removed"))
    return run(
        "filter",
        [reader(args.input), make_filter(removed), JsonlWriter(str(args.work / "kept"))],
        args.work,
        args.tasks,
        args.workers,
    )


EXACT = ExactDedupConfig(content_getter=dedup_key, hash_config=HashConfig(precision=64))


def exact_duplicates(args: argparse.Namespace, steps: dict[str, float]) -> Callable[..., object]:
    """Exact dedup's first two stages (signatures, then the duplicates found), timed into
    ``steps``; returns a maker of its filter, ``(exclusion writer or None) -> filter``."""
    sigs, dups = args.work / "sigs", args.work / "dups"
    steps["signatures"] = run(
        "signatures",
        [reader(args.input), ExactDedupSignature(output_folder=str(sigs), config=EXACT)],
        args.work,
        args.tasks,
        args.workers,
    )
    steps["find_dedups"] = run(
        "find_dedups",
        [ExactFindDedups(data_folder=str(sigs), output_folder=str(dups), config=EXACT)],
        args.work,
        1,
        1,
    )
    return lambda removed=None: ExactDedupFilter(
        data_folder=str(dups), config=EXACT, exclusion_writer=removed
    )


def exact(args: argparse.Namespace) -> dict[str, float]:
    steps: dict[str, float] = {}
    exact_filter = exact_duplicates(args, steps)
    steps["filter"] = filter_step(args, exact_filter)
    return steps


def exact_lines(args: argparse.Namespace) -> dict[str, float]:
    """Documents, then repeated lines across the kept documents, removed: ``exact`` followed by
    DataTrove's sentence dedup on lines (C4's three-sentence spans cut down to one line).

    DataTrove's cheapest arrangement of the two: the sentence signatures are taken from the
    exact filter's output as it streams (no intermediate write), and the last pass reads the
    input once more through both filters. So the input is read three times (ours reads it
    twice: since 417edb4 its first read also scans the paragraphs).
    """
    lines = SentDedupConfig(
        n_sentences=1,
        split_sentences=False,  # lines (``str.splitlines``), not sentences
        only_dedup_in_index=False,
        min_doc_words=0,  # keep every document that has text left, as ours
        min_num_sentences=0,
        # Not ours' rule: DataTrove compares every line, and keeps a run of consecutive
        # repeated lines when the run's first line is shorter (ours never compares such a line).
        min_words_to_remove_span=args.min_line_words,
        # Ours' key text: lowercase, punctuation to spaces, runs of spaces as one.
        norm_config=lowercased(punctuation_to_spaces=True),
        hash_config=HashConfig(precision=64, hash_fc="xxhash"),
    )
    line_sigs, line_dups = args.work / "line_sigs", args.work / "line_dups"
    words = RegexWords()
    steps: dict[str, float] = {}
    exact_filter = exact_duplicates(args, steps)
    steps["line_signatures"] = run(
        "line_signatures",
        [
            reader(args.input),
            exact_filter(),
            SentenceDedupSignature(output_folder=str(line_sigs), config=lines, language=words),
        ],
        args.work,
        args.tasks,
        args.workers,
    )
    steps["line_find_dedups"] = run(
        "line_find_dedups",
        [
            SentenceFindDedups(
                data_folder=str(line_sigs), output_folder=str(line_dups), config=lines
            )
        ],
        args.work,
        1,
        1,
    )
    steps["filter"] = run(
        "filter",
        [
            reader(args.input),
            exact_filter(JsonlWriter(str(args.work / "removed"))),
            SentenceDedupFilter(data_folder=str(line_dups), config=lines, language=words),
            JsonlWriter(str(args.work / "kept")),
        ],
        args.work,
        args.tasks,
        args.workers,
    )
    return steps


def minhash(args: argparse.Namespace) -> dict[str, float]:
    config = MinhashConfig(
        n_grams=args.ngram,
        num_buckets=args.bands,
        hashes_per_bucket=args.rows,
        seed=1,
        # Words as Slipway's: lowercase only (no punctuation, digit or diacritic rewriting).
        norm_config=lowercased(punctuation_to_spaces=False),
        hash_config=HashConfig(precision=64, hash_fc="xxhash"),
    )
    sigs, buckets, clusters = (args.work / d for d in ("sigs", "buckets", "clusters"))
    steps = {}
    steps["signatures"] = run(
        "signatures",
        [
            reader(args.input),
            MinhashDedupSignature(output_folder=str(sigs), config=config, language=RegexWords()),
        ],
        args.work,
        args.tasks,
        args.workers,
    )
    # Stage 2 runs one task per band (it asserts tasks % num_buckets == 0).
    steps["buckets"] = run(
        "buckets",
        [MinhashDedupBuckets(input_folder=str(sigs), output_folder=str(buckets), config=config)],
        args.work,
        config.num_buckets,
        args.workers,
    )
    steps["cluster"] = run(
        "cluster",
        [
            MinhashDedupCluster(
                input_folder=str(buckets),
                output_folder=str(clusters),
                config=config,
                save_cluster_id=True,
            )
        ],
        args.work,
        1,
        1,
    )
    steps["filter"] = filter_step(
        args,
        lambda removed: MinhashDedupFilter(
            input_folder=str(clusters), exclusion_writer=removed, load_cluster_ids=True
        ),
    )
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("quality", "exact", "exact_lines", "minhash"))
    parser.add_argument("--input", type=Path, required=True, help="folder of *.jsonl.gz")
    parser.add_argument("--work", type=Path, required=True, help="output and scratch folder")
    parser.add_argument("--tasks", type=int, default=0, help="0: one per input file")
    parser.add_argument("--workers", type=int, default=1, help="1: tasks in sequence, in process")
    parser.add_argument(
        "--min-line-words", type=int, default=3, help="exact_lines: shorter spans are kept"
    )
    parser.add_argument("--ngram", type=int, default=5)
    parser.add_argument("--bands", type=int, default=23)
    parser.add_argument("--rows", type=int, default=11)
    args = parser.parse_args(argv)
    args.tasks = args.tasks or len(list(args.input.glob("*.jsonl.gz")))
    stages = {"quality": quality, "exact": exact, "exact_lines": exact_lines, "minhash": minhash}
    steps = stages[args.stage](args)
    print(json.dumps({"seconds": sum(steps.values()), "steps": steps}), flush=True)
    # Peak resident memory of this process (the caller's measure, as for our stages).
    status = Path("/proc/self/status").read_text()
    peak = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))
    print(f"BENCH_PEAK_KB {peak}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
