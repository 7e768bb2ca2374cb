"""A mixture-of-experts nano trains through the real loop and logs expert-load imbalance,
capacity drops and the auxiliary-loss value every step."""

from __future__ import annotations

import json

from trainer.config import load_config
from trainer.testing import write_random_store


def test_moe_trains_and_logs_expert_stats(tmp_path):
    store = str(tmp_path / "store")
    write_random_store(store, num_docs=400)
    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"data.sources=[{{path: {store}}}]",
            "model.preset=nano",
            "model.moe={num_experts: 4, top_k: 1, capacity_factor: 1.0}",
            "steps=30",
            "batch_size=8",
            "seq_len=64",
            "optimizer.learning_rate=3e-3",
            "optimizer.warmup_steps=5",
            "checkpoint.save_every=0",
        ],
    )
    from trainer.train import train

    result = train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert result["status"] == "succeeded"
    assert {"moe_imbalance_cv", "moe_drop_frac", "moe_aux_loss"} <= set(lines[-1])
    assert 0 <= lines[-1]["moe_drop_frac"] < 1
    assert lines[-1]["loss"] < lines[0]["loss"]
