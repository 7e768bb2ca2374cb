"""Llama/MoE model: exact parameter counts, FLOPs, causal and packed-document masking."""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.config import ModelConfig, MoEConfig, resolve_model
from trainer.model import (
    PRESETS,
    Transformer,
    active_matmul_params,
    flops_per_token,
    init_model,
    param_count,
    segments_and_positions,
)


def _real_count(cfg: ModelConfig) -> int:
    shapes = eqx.filter_eval_shape(Transformer, cfg, jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_param_count_is_exact_for_every_preset(preset):
    cfg = resolve_model(ModelConfig(preset=preset), vocab_size=128256)
    assert param_count(cfg) == _real_count(cfg)


def test_marin_reference_sizes():
    # Llama-3 vocabulary, untied: the preset names count the embeddings as Marin does
    counts = {
        p: param_count(resolve_model(ModelConfig(preset=p), vocab_size=128256)) for p in PRESETS
    }
    assert 30e6 < counts["30m"] < 36e6
    assert 7.5e9 < counts["8b"] < 8.1e9  # Llama-3-8B: 8.03B
    assert counts["8b"] == 8_030_261_248


def test_tied_and_moe_counts_are_exact():
    base = resolve_model(ModelConfig(preset="nano", tie_embeddings=True), vocab_size=100)
    assert param_count(base) == _real_count(base)
    moe = resolve_model(
        ModelConfig(preset="nano", moe=MoEConfig(num_experts=4, top_k=2)), vocab_size=100
    )
    assert param_count(moe) == _real_count(moe)
    # active params: only top_k of the routed experts
    dense_part = active_matmul_params(moe)
    all_experts = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, top_k=4))
    assert active_matmul_params(all_experts) > dense_part


def test_flops_per_token_is_about_6n_plus_attention():
    cfg = resolve_model(ModelConfig(preset="150m"), vocab_size=32000)
    n = active_matmul_params(cfg)
    attn = 12 * cfg.num_layers * 4096 * cfg.num_heads * cfg.head_dim
    assert flops_per_token(cfg, 4096) == pytest.approx(6 * n + attn)


def _tiny(**kw) -> tuple[ModelConfig, Transformer]:
    cfg = resolve_model(
        ModelConfig(
            hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, **kw
        ),
        vocab_size=20,
    )
    return cfg, init_model(cfg, jax.random.key(0))


def test_segments_and_positions_from_eos():
    toks = jnp.array([[5, 6, 0, 7, 0, 8, 9]])
    seg, pos = segments_and_positions(toks, eos_id=0)
    np.testing.assert_array_equal(seg, [[0, 0, 0, 1, 1, 2, 2]])
    np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 1, 0, 1]])


@pytest.mark.parametrize("moe", [None, MoEConfig(num_experts=4, top_k=1, capacity_factor=0)])
def test_causal_and_packed_documents_do_not_leak(moe):
    _, model = _tiny(moe=moe)
    a = jnp.array([[3, 4, 5, 0, 6, 7, 8, 9]])
    b = a.at[0, 1].set(11)  # change document 1
    c = a.at[0, 7].set(12)  # change the future

    @jax.jit
    def run(t):
        seg, pos = segments_and_positions(t, 0)
        return model(t, seg, pos)[0]

    la, lb, lc = run(a), run(b), run(c)
    np.testing.assert_allclose(la[0, 4:], lb[0, 4:], atol=1e-6)  # document 2 never sees doc 1
    assert not np.allclose(la[0, 1:4], lb[0, 1:4])
    np.testing.assert_allclose(la[0, :7], lc[0, :7], atol=1e-6)  # nothing sees the future
    # a document packed after another equals the same document alone (positions reset)
    alone = run(jnp.array([[6, 7, 8, 9]]))
    np.testing.assert_allclose(la[0, 4:], alone[0], atol=1e-5)


def test_bfloat16_compute_keeps_float32_logits():
    _, model = _tiny()
    t = jnp.array([[1, 2, 3, 0]])
    seg, pos = segments_and_positions(t, 0)
    logits, _ = jax.jit(lambda: model(t, seg, pos, dtype=jnp.bfloat16))()
    ref, _ = jax.jit(lambda: model(t, seg, pos))()
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, ref, atol=5e-2)


def test_block_causal_attention_equals_full(monkeypatch):
    import trainer.model as model_module

    _, model = _tiny()
    toks = jax.random.randint(jax.random.key(3), (2, 64), 0, 20)  # many EOS (id 0): documents
    seg, pos = segments_and_positions(toks, 0)
    run = lambda: jax.jit(lambda: model(toks, seg, pos)[0])()  # noqa: E731
    monkeypatch.setattr(model_module, "ATTN_CHUNK", 16)  # 4 blocks
    blocked = run()
    monkeypatch.setattr(model_module, "ATTN_CHUNK", 1 << 20)  # one block: the plain path
    full = run()
    np.testing.assert_allclose(blocked, full, atol=1e-5)
