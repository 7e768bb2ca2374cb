"""A small trained model for the parity tests: our trainer, our tokenizer trainer, real text.

The tokenizer is trained by the pipeline's own ``pipelines.train_tokenizer.train_model`` (BPE,
byte fallback, no dummy prefix, pad/unk/bos/eos = 0/1/2/3), as ``make demo`` trains it, on the
Brown Corpus and the evaluation sets' own text (fetched into ``data/`` like the corpora tests
do; cached after the first run), so that the benchmark prompts tokenize as English. The model
is trained for a few steps by ``python -m trainer.train``'s ``main``: enough that its logits are
no longer uniform, cheap enough for ``make test``. Grouped-query attention (4 query heads over 2
kv heads) and untied embeddings, so that the export's layouts are all exercised.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(os.environ.get("SLIPWAY_CORPORA_DATA_DIR", REPO / "data"))
VOCAB = 1024
SEQ_LEN = 256


@dataclass(frozen=True)
class TinyRun:
    """A trained run: its config file (as the pipeline writes it), output dir, tokenizer."""

    config: str  # the trainer config file, as the pipeline's train step leaves it
    output_dir: str
    tokenizer: str  # the sentencepiece model file
    eval_dir: str  # the fetched evaluation sets (``{task}.jsonl.gz``)
    steps: int


def _texts(path: Path, limit: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(limit), f, strict=False)]


@pytest.fixture(scope="session")
def corpora_dir() -> Path:
    from pipelines.corpora import fetch as corpora_fetch

    corpora_fetch.fetch(DATA_DIR)
    return DATA_DIR


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, corpora_dir: Path) -> TinyRun:
    from pipelines.configs import TrainTokenizerConfig
    from pipelines.train_tokenizer import train_model
    from tests.support.trainer_data import write_text_store
    from trainer.train import main as train_main

    root = tmp_path_factory.mktemp("tiny_run")
    prose = _texts(corpora_dir / "raw" / "brown.jsonl.gz", 500)
    for task in ("hellaswag", "piqa", "arc_easy", "winogrande", "boolq", "lambada"):
        prose += _texts(corpora_dir / "eval" / f"{task}.jsonl.gz", 300)
    lines = [line for text in prose for line in text.splitlines() if line.strip()]
    model = train_model(lines, TrainTokenizerConfig(vocab_size=VOCAB, num_threads=1))
    tok = root / "tokenizer.model"
    tok.write_bytes(model)
    write_text_store(str(root / "train"), prose, str(tok))

    out = root / "run"
    sets = [
        f"output_dir={out}",
        f"data.sources=[{{path: {root / 'train'}}}]",
        "model.hidden_dim=64",
        "model.intermediate_dim=176",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "steps=40",
        "batch_size=8",
        f"seq_len={SEQ_LEN}",
        "optimizer.learning_rate=3e-3",
        "optimizer.warmup_steps=4",
        "checkpoint.save_every=40",
    ]
    assert train_main([x for s in sets for x in ("--set", s)]) == 0
    # the resolved config, as the pipeline's train step keeps it beside the run
    config = root / "trainer_config.json"
    resolved = json.loads((out / "config.json").read_text(encoding="utf-8"))["config"]
    config.write_text(json.dumps(resolved, indent=2), encoding="utf-8")
    return TinyRun(
        config=str(config),
        output_dir=str(out),
        tokenizer=str(tok),
        eval_dir=str(corpora_dir / "eval"),
        steps=40,
    )
