"""Evaluation entrypoint: loss, perplexity and bits-per-byte of a trained checkpoint on a
held-out store (different stdlib files than the training store, same tokenizer)."""

from __future__ import annotations

import json
import math

from trainer.evaluate import main as eval_main
from trainer.testing import stdlib_texts, train_sentencepiece, write_text_store
from trainer.train import main as train_main


def test_evaluate_trained_checkpoint(tmp_path, capsys):
    texts = stdlib_texts(300_000)
    held_out = stdlib_texts(100_000, skip=len(texts) + 5)
    tok = train_sentencepiece(texts, 512, str(tmp_path / "tok"))
    write_text_store(str(tmp_path / "train"), texts, tok)
    write_text_store(str(tmp_path / "heldout"), held_out, tok)
    sets = [
        f"output_dir={tmp_path / 'run'}",
        f"data.sources=[{{path: {tmp_path / 'train'}}}]",
        f"data.eval_sources=[{{path: {tmp_path / 'heldout'}}}]",
        "model.preset=nano",
        "steps=60",
        "batch_size=8",
        "seq_len=64",
        "optimizer.learning_rate=3e-3",
        "optimizer.warmup_steps=5",
        "checkpoint.save_every=30",
    ]
    args = [x for s in sets for x in ("--set", s)]
    assert train_main(args) == 0
    capsys.readouterr()
    assert eval_main([*args, "--max-tokens", "8192", "--step", "30"]) == 0
    early = json.loads(capsys.readouterr().out)
    assert eval_main([*args, "--max-tokens", "8192"]) == 0
    final = json.loads(capsys.readouterr().out)
    assert final["step"] == 60 and early["step"] == 30
    r = final["results"][0]
    assert r["tokens"] == (8192 // 64) * 64
    assert math.isclose(r["perplexity"], math.exp(r["loss"]), rel_tol=1e-9)
    assert 0 < r["bits_per_byte"] < 8 * r["loss"] / math.log(2)
    assert r["loss"] < early["results"][0]["loss"] < math.log(512) + 0.5
    saved = json.loads((tmp_path / "run" / "eval" / f"step-{60:09d}.json").read_text())
    assert saved == final
    # bytes counted from the evaluated tokens' pieces agree with the ledger's average
    assert eval_main([*args, "--max-tokens", "8192", "--tokenizer", tok]) == 0
    decoded = json.loads(capsys.readouterr().out)["results"][0]
    assert decoded["loss"] == r["loss"]
    assert math.isclose(decoded["bits_per_byte"], r["bits_per_byte"], rel_tol=0.25)
    # no held-out store anywhere: refused before compute
    assert eval_main(["--set", f"output_dir={tmp_path / 'run'}"]) == 2
