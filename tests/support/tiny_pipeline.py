"""Tiny synthetic corpora and a matching run form, for the pipeline DAG's tests and demos."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "river",
    "mountain",
    "harbour",
    "ship",
    "timber",
    "sail",
    "rope",
    "hull",
    "keel",
    "mast",
    "deck",
    "captain",
    "crew",
    "voyage",
    "storm",
    "wind",
    "wave",
    "tide",
    "island",
    "coast",
    "village",
    "market",
    "bread",
    "cheese",
    "apple",
    "garden",
    "winter",
    "summer",
    "morning",
    "evening",
    "letter",
    "story",
    "history",
    "science",
    "music",
    "painting",
    "window",
    "door",
    "table",
    "chair",
    "teacher",
    "student",
    "engine",
    "railway",
    "station",
    "bridge",
    "tower",
    "castle",
    "forest",
    "meadow",
    "valley",
    "lantern",
]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 16))]
    return " ".join(words).capitalize() + "."


def _documents(source: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        text = "\n".join(
            " ".join(_sentence(rng) for _ in range(rng.randint(3, 5)))
            for _ in range(rng.randint(2, 4))
        )
        docs.append({"id": f"{source}-{i:04d}", "text": text, "source": source, "metadata": {}})
    return docs


def _write(path: Path, docs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(json.dumps(d, sort_keys=True) + "\n" for d in docs).encode()
    path.write_bytes(gzip.compress(body, mtime=0))


TINY_SOURCES = ("brown", "fortunes")

# The content-addressed steps a tiny_conf run records in lineage (the `fetch` task is not one).
TINY_STEPS = frozenset(
    {
        "ingest",
        "quality",
        "exact_dedup",
        "fuzzy_dedup",
        "decontaminate",
        "split",
        "train_tokenizer",
        *(f"tokens/{split}/{source}" for split in ("train", "heldout") for source in TINY_SOURCES),
        "tokens/eval/lambada",
        "train",
        "evaluate",
        "export",
    }
)


def _eval_set(task: str, split: str, docs: list[dict], fields) -> list[dict]:
    """Documents in the layout of the fetched evaluation sets (pipelines/corpora/evalsets.py):
    the task's split and raw fields in metadata."""
    rng = random.Random(task)
    return [{**d, "metadata": {"task": task, "split": split, **fields(d, rng)}} for d in docs]


def _piqa_fields(doc: dict, rng: random.Random) -> dict:
    choices = [_sentence(rng), _sentence(rng)]
    return {"goal": doc["text"].split(".")[0], "choices": choices, "answer": rng.randint(0, 1)}


# The benchmarks a tiny run scores (the form's eval_tasks), on the tiny evaluation sets.
TINY_EVAL_TASKS = ["piqa", "lambada_openai"]


def make_corpora(data_dir: Path, sources: tuple[str, ...] = TINY_SOURCES) -> Path:
    for k, source in enumerate(sources):
        _write(data_dir / "raw" / f"{source}.jsonl.gz", _documents(source, 60, k))
    lambada = _eval_set("lambada", "test", _documents("lambada", 20, 99), lambda d, r: {})
    _write(data_dir / "eval" / "lambada.jsonl.gz", lambada)
    piqa = _eval_set("piqa", "validation", _documents("piqa", 12, 98), _piqa_fields)
    _write(data_dir / "eval" / "piqa.jsonl.gz", piqa)
    return data_dir


def tiny_conf(data_dir: Path, **overrides: object) -> dict:
    """Run form for the tiny run: quality rules off (random text), small tokenizer and model."""
    conf = {
        "data_dir": str(data_dir),
        "sources": [{"name": "brown", "weight": 0.7}, {"name": "fortunes", "weight": 0.3}],
        "steps": 6,
        "batch_size": 4,
        "seq_len": 32,
        "warmup_steps": 1,
        "num_shards": 2,
        "heldout_fraction": 0.1,
        "eval_max_tokens": 512,
        "eval_tasks": TINY_EVAL_TASKS,
        "eval_task_limit": 10,
        "export_dtype": "bfloat16",  # the form's value reaches the export (float32: unit tests)
        "stage_configs": {
            "ingest": {},
            "quality": {"sources": {"brown": {"enabled": False}, "fortunes": {"enabled": False}}},
            "exact_dedup": {},
            "fuzzy_dedup": {},
            "decontaminate": {},
            "train_tokenizer": {"vocab_size": 512},
            "tokenize": {},
        },
    }
    conf.update(overrides)
    return conf


def tiny_params(data_dir: Path) -> dict:
    """The pipeline form's validated values for the tiny run on corpora made in ``data_dir``:
    what a task's ``params`` hold."""
    from airflow.sdk.definitions.param import ParamsDict

    from operators.params import pipeline_params

    p = ParamsDict()
    p.update(pipeline_params())
    p.update(tiny_conf(make_corpora(data_dir)))
    return p.validate()


def tiny_sweep_conf(data_dir: Path, **overrides: object) -> dict:
    """Sweep form for a tiny sweep: the tiny run's data fields, two budgets x three sizes
    (six cells of ~50 steps) and a forecast at 10x."""
    from operators.sweep.form import PIPELINE_ONLY, REPLACED_BY_RECIPE

    left_out = (*REPLACED_BY_RECIPE, *PIPELINE_ONLY)
    conf = {k: v for k, v in tiny_conf(data_dir).items() if k not in left_out}
    conf.update(
        {
            "budgets": [1e10, 3e10],
            "points": 3,
            "spread": 4.0,
            "forecast_budgets": [3e11],
            "seq_len": 128,
            "steps_per_run": 50,
            "metric_stores": ["heldout-brown", "heldout-fortunes"],
        }
    )
    conf.update(overrides)
    return conf


if __name__ == "__main__":  # python -m tests.support.tiny_pipeline DIR -> prints the conf
    import sys

    d = make_corpora(Path(sys.argv[1]))
    print(json.dumps(tiny_conf(d)))
