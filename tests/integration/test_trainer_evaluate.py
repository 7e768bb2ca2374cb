"""Evaluation entrypoint: loss, perplexity and bits-per-byte of a trained checkpoint on a
held-out store (different stdlib files than the training store, same tokenizer); an MoE
checkpoint is evaluated with its trained router bias, and one without a bias still loads."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

from tests.support.trainer_data import (
    stdlib_texts,
    traced_meshes,
    train_sentencepiece,
    write_random_store,
    write_text_store,
)
from tokenstore import TokenStore
from trainer import distributed as dist
from trainer.config import load_config
from trainer.evaluate import main as eval_main
from trainer.model import Transformer, document_batch
from trainer.restore import load_params
from trainer.train import loss_and_stats
from trainer.train import main as train_main


def test_evaluate_trained_checkpoint(tmp_path, capsys, monkeypatch):
    meshes = traced_meshes(monkeypatch)
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
    # the train step was traced under its mesh (what splash needs on TPU), then evaluation's
    assert meshes and set(meshes) == {dist.AXES}, meshes
    meshes.clear()
    capsys.readouterr()
    assert eval_main([*args, "--max-tokens", "8192", "--step", "30"]) == 0
    early = json.loads(capsys.readouterr().out)
    assert eval_main([*args, "--max-tokens", "8192"]) == 0
    final = json.loads(capsys.readouterr().out)
    assert meshes and set(meshes) == {dist.AXES}, meshes
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
    # Another tokenizer of the same size (its pieces mean other text): its store and the
    # tokenizer itself are refused by the hash the trainer recorded, before compute.
    other = train_sentencepiece(held_out, 512, str(tmp_path / "other-tok"))
    write_text_store(str(tmp_path / "other"), held_out, other)
    capsys.readouterr()
    assert eval_main([*args, "--store", str(tmp_path / "other")]) == 2
    assert "was tokenized with" in capsys.readouterr().err
    assert eval_main([*args, "--tokenizer", other]) == 2
    assert "is not the tokenizer of the model's training stores" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# MoE: evaluation selects experts with the checkpointed quantile-balancing bias

MOE_STEPS, MOE_BATCH, MOE_SEQ = 20, 8, 64
EVAL_WINDOWS = 2 * MOE_BATCH  # two full evaluation batches: no padding rows
# cheap XLA:CPU compiles, for the subprocesses (flags) and the in-process reference (options)
FAST_FLAGS = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _cli(module: str, sets: list[str], *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + FAST_FLAGS).strip(),
    }
    cmd = [sys.executable, "-m", module, *[x for s in sets for x in ("--set", s)], *args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]


def _reference_losses(params: Transformer, heldout: str, biases: list[np.ndarray]) -> list[float]:
    """The held-out loss as training computes it (``train.loss_and_stats``: the objective's
    forward) with each of ``biases``, on the windows and batches the evaluator reads (its
    routing groups: one batch on one device)."""
    store = TokenStore.open(heldout)
    windows = np.stack([store.read(w * MOE_SEQ, MOE_SEQ + 1) for w in range(EVAL_WINDOWS)])
    batches = [
        document_batch(jnp.asarray(windows[i : i + MOE_BATCH], jnp.int32), store.eos_id)
        for i in range(0, EVAL_WINDOWS, MOE_BATCH)
    ]

    def loss(p, bias, batch):
        return loss_and_stats(p, bias, batch, z_loss_coef=0.0, dtype=jnp.float32)[1]["loss"]

    fn = jax.jit(loss).lower(params, jnp.asarray(biases[0]), batches[0]).compile(FAST_COMPILE)
    # equal batches: the mean of the batch means is the mean over all evaluated tokens
    return [float(np.mean([fn(params, jnp.asarray(b), x) for x in batches])) for b in biases]


def test_moe_evaluation_uses_the_checkpointed_router_bias(tmp_path):
    train_store, heldout = str(tmp_path / "train"), str(tmp_path / "heldout")
    write_random_store(train_store, num_docs=300)
    write_random_store(heldout, num_docs=100, seed=1)
    run, old = tmp_path / "run", tmp_path / "old"
    sets = [
        f"data.sources=[{{path: {train_store}}}]",
        f"data.eval_sources=[{{path: {heldout}}}]",
        "model.preset=nano",
        "model.moe={num_experts: 4, top_k: 1, balancing: quantile}",
        # larger initial weights: the experts' outputs, hence the routing, matter after 20
        # steps (at 0.02 a different routing moved the loss by 2.5e-5; here by 1.7e-3)
        "model.init_std=0.1",
        f"steps={MOE_STEPS}",
        f"batch_size={MOE_BATCH}",
        f"seq_len={MOE_SEQ}",
        "optimizer.learning_rate=3e-3",
        "optimizer.warmup_steps=5",
        "checkpoint.save_every=0",
    ]
    _finish(_cli("trainer.train", [f"output_dir={run}", *sets]))
    # the same checkpoint as written before the bias was saved: no router_bias array
    shutil.copytree(run / "checkpoints", old / "checkpoints")
    shutil.rmtree(old / "checkpoints" / f"step-{MOE_STEPS:09d}" / "arrays" / "router_bias")
    evaluation = _cli(
        "trainer.evaluate",
        [f"output_dir={run}", *sets],
        "--max-tokens",
        str(EVAL_WINDOWS * MOE_SEQ),
    )
    # while it runs: the checkpointed bias, what the evaluator loads, the reference losses
    arrays = run / "checkpoints" / f"step-{MOE_STEPS:09d}" / "arrays" / "router_bias"
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(arrays)}}
    bias = ts.open(spec).result().read().result()
    assert bias.shape == (2, 4) and np.abs(bias).max() > 0.01  # quantile balancing moved it
    cfg = load_config(None, [f"output_dir={run}", *sets])
    mesh = dist.make_mesh(cfg.mesh, jax.devices()[:1])
    vocab = TokenStore.open(heldout).vocab_size
    loaded = load_params(cfg, vocab, mesh)
    np.testing.assert_array_equal(np.asarray(loaded[1]), bias)
    # a checkpoint without the bias still loads, with a zero bias (and the same parameters)
    loaded_old = load_params(load_config(None, [f"output_dir={old}", *sets]), vocab, mesh)
    np.testing.assert_array_equal(np.asarray(loaded_old[1]), np.zeros_like(bias))
    np.testing.assert_array_equal(loaded_old[0].embed, loaded[0].embed)
    assert loaded[0].cfg.moe.group_size == MOE_BATCH * MOE_SEQ  # one device: the whole batch
    with_bias, zero_bias = _reference_losses(loaded[0], heldout, [bias, np.zeros_like(bias)])
    _finish(evaluation)
    evaluated = json.loads((run / "eval" / f"step-{MOE_STEPS:09d}.json").read_text())
    evaluated = evaluated["results"][0]
    assert evaluated["tokens"] == EVAL_WINDOWS * MOE_SEQ
    # the bias changes routing enough to matter, far beyond float noise (evaluator and
    # reference agree to ~1e-7) ...
    assert abs(with_bias - zero_bias) > 5e-4 * with_bias
    # ... and the evaluator used the checkpointed one, as training does
    assert evaluated["loss"] == pytest.approx(with_bias, rel=2e-5)


def test_bits_per_byte_counts_every_byte_of_code_pieces(tmp_path):
    """Bytes per token by the tokenizer's token types: a learned piece spelled like a control
    token (``<>``, common in code) is two bytes, not none."""
    import sentencepiece as spm

    from tests.support.trainer_data import stdlib_texts, train_sentencepiece
    from trainer.evaluate import token_bytes

    code = "List<> a = new ArrayList<>(); Map<> m = new HashMap<>(); x <> y"
    model = train_sentencepiece([code] * 300 + stdlib_texts(100_000), 600, str(tmp_path / "t"))
    sp = spm.SentencePieceProcessor(model_file=model)
    assert sp.piece_to_id("<>") not in (sp.unk_id(), sp.bos_id(), sp.eos_id())  # a piece
    ids = sp.encode(code)
    assert sp.piece_to_id("<>") in ids
    # the text and the word marker sentencepiece puts before it
    assert sum(token_bytes(sp, t) for t in ids) == len(code.encode("utf-8")) + 1
    assert [token_bytes(sp, t) for t in (sp.bos_id(), sp.eos_id(), sp.unk_id())] == [0, 0, 0]
    assert token_bytes(sp, sp.piece_to_id("<0xE2>")) == 1  # byte fallback
