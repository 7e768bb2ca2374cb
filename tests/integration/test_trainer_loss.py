"""Loss goes down: nano on real text (Python stdlib source, sentencepiece trained here) ends
clearly below the unigram entropy of the data; the CLI writes metrics and a result file.
(The MoE training run is in test_trainer_moe_train.py.)"""

from __future__ import annotations

import json

import pytest

from tests.support.trainer_data import stdlib_texts, train_sentencepiece, write_text_store
from tokenstore import TokenStore
from trainer.data import unigram_entropy
from trainer.train import main


@pytest.fixture(scope="module")
def text_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    texts = stdlib_texts(1 << 20)
    model = train_sentencepiece(texts, 512, str(root / "tok"))
    write_text_store(str(root / "store"), texts, model)
    return str(root / "store")


def test_nano_loss_goes_clearly_below_unigram_entropy(text_store, tmp_path):
    out = tmp_path / "run"
    code = main(
        [
            "--set",
            f"output_dir={out}",
            "--set",
            f"data.sources=[{{path: {text_store}}}]",
            "--set",
            "model.preset=nano",
            "--set",
            "steps=300",
            "--set",
            "batch_size=16",
            "--set",
            "seq_len=128",
            "--set",
            "seed=0",
            "--set",
            "optimizer.learning_rate=3e-3",
            "--set",
            "optimizer.warmup_steps=20",
            "--set",
            "checkpoint.save_every=100",
        ]
    )
    assert code == 0
    entropy = unigram_entropy(TokenStore.open(text_store))
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "succeeded" and result["steps"] == 300 and result["error"] is None
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 301))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
        assert key in lines[-1]
    first = lines[0]["loss"]
    final = result["final_loss"]
    assert first > entropy  # starts near log(512) = 6.24
    assert final < entropy - 1.0, (first, final, entropy)  # 5.05 nats -> ~3.5
    assert json.loads((out / "config.json").read_text())["params"] == result["params"]
