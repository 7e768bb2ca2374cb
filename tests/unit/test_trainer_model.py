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
from trainer.model import Transformer, document_batch, init_model, segments_and_positions
from trainer.shapes import PRESETS, active_matmul_params, flops_per_token, param_count


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
    shape = dict(hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
    cfg = resolve_model(ModelConfig(**(shape | kw)), vocab_size=20)
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
    import trainer.kernels as kernels

    _, model = _tiny()
    toks = jax.random.randint(jax.random.key(3), (2, 64), 0, 20)  # many EOS (id 0): documents
    seg, pos = segments_and_positions(toks, 0)
    run = lambda: jax.jit(lambda: model(toks, seg, pos)[0])()  # noqa: E731
    monkeypatch.setattr(kernels, "ATTN_CHUNK", 16)  # 4 blocks
    blocked = run()
    monkeypatch.setattr(kernels, "ATTN_CHUNK", 1 << 20)  # one block: the plain path
    full = run()
    np.testing.assert_allclose(blocked, full, atol=1e-5)


def test_flops_per_token_matches_palm_and_levanter():
    # PaLM appendix B: 6 N + 12 L H Q T per token for training, N = matmul parameters (the
    # output projection included), H query heads of size Q, T = sequence length. Levanter's
    # lm_flops_per_token (x3 for training) is the same plus a 3 H T mask term per layer that
    # neither counts as matmul FLOPs nor as MFU here. GQA: k/v projections have K heads.
    cfg = resolve_model(ModelConfig(preset="600m"), vocab_size=128256)
    d, hd, L, h, k, f, t = 1024, 64, 24, 16, 8, 3584, 4096
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (hd, h, k)
    n = L * (d * hd * (2 * h + 2 * k) + 3 * d * f) + d * 128256
    assert active_matmul_params(cfg) == n
    assert flops_per_token(cfg, t) == 6 * n + 12 * L * h * hd * t
    levanter_fwd = L * (2 * 3 * d * f + 2 * d * (h * hd + 2 * k * hd) + 2 * d * h * hd)
    levanter_fwd += L * (2 * t * h * hd + 2 * t * h * hd) + 2 * d * 128256
    assert flops_per_token(cfg, t) == 3 * levanter_fwd


def _reference_objective(model, tokens, eos_id, z_loss_coef):
    """The model's loss written with plain jnp and autodiff only: full (S x S) masked softmax
    attention, full logits, gather of the target logit. The reference for the custom-VJP
    pieces (block-causal flash attention, dense, SwiGLU, fused chunked cross-entropy)."""
    from trainer.model import rotary

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seg, pos = segments_and_positions(inputs, eos_id)
    cfg = model.cfg
    s = inputs.shape[1]
    mask = jnp.tril(jnp.ones((s, s), bool))[None] & (seg[:, :, None] == seg[:, None, :])

    def norm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * w

    x = model.embed[inputs]
    for i in range(cfg.num_layers):
        layer = jax.tree_util.tree_map(lambda a, i=i: a[i], model.layers)
        a = layer.attn
        hx = norm(x, layer.attn_norm.weight)
        q = rotary(jnp.einsum("bsd,dhk->bshk", hx, a.wq), pos, cfg.rope_theta)
        k = rotary(jnp.einsum("bsd,dhk->bshk", hx, a.wk), pos, cfg.rope_theta)
        v = jnp.einsum("bsd,dhk->bshk", hx, a.wv)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bshk,bthk->bhst", q, k) / math.sqrt(cfg.head_dim)
        p = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
        x = x + jnp.einsum("bshk,hkd->bsd", jnp.einsum("bhst,bthk->bshk", p, v), a.wo)
        hx = norm(x, layer.mlp_norm.weight)
        m = layer.mlp
        x = x + (jax.nn.silu(hx @ m.w_gate) * (hx @ m.w_up)) @ m.w_down
    logits = norm(x, model.final_norm.weight) @ model.lm_head
    lse = jax.nn.logsumexp(logits, axis=-1)
    nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll) + z_loss_coef * jnp.mean(lse**2)


@pytest.mark.parametrize(
    ("z_loss_coef", "kv_heads", "attention"),
    # 4 query heads over 2 kv heads (grouped-query blocks; q, then k and v stacked), and one kv
    # head per query head (q, k and v in one stacked projection); every attention
    # implementation that runs on this machine's backend (cudnn needs a GPU, splash a TPU)
    [
        (0.0, 2, "blocked"),
        (1e-2, 2, "blocked"),
        (1e-2, 4, "blocked"),
        (0.0, 2, "xla"),
        (1e-2, 4, "xla"),
        (0.0, 2, "auto"),
    ],
)
def test_custom_gradients_match_plain_autodiff(monkeypatch, z_loss_coef, kv_heads, attention):
    import trainer.kernels as kernels
    from trainer.train import loss_and_stats

    monkeypatch.setattr(kernels, "ATTN_CHUNK", 16)  # 4 query blocks at seq 64
    _, model = _tiny(num_kv_heads=kv_heads, attention=attention)
    toks = jax.random.randint(jax.random.key(5), (3, 65), 1, 20)
    toks = toks.at[:, ::9].set(0)  # packed documents
    ref_fn = jax.jit(jax.value_and_grad(lambda m: _reference_objective(m, toks, 0, z_loss_coef)))
    with jax.default_matmul_precision("highest"):
        ref, ref_grads = ref_fn(model)
        for chunk in (1, 64):  # fused loss chunk: one position at a time, or the whole row
            fn = jax.jit(
                jax.value_and_grad(
                    lambda m, c=chunk: loss_and_stats(
                        m,
                        jnp.zeros((2, 0)),
                        document_batch(toks, 0),
                        z_loss_coef=z_loss_coef,
                        dtype=jnp.float32,
                        loss_chunk=c,
                    ),
                    has_aux=True,
                )
            )
            (obj, stats), grads = fn(model)
            np.testing.assert_allclose(obj, ref, rtol=1e-6)
            if z_loss_coef == 0:
                np.testing.assert_allclose(stats["loss"], ref, rtol=1e-6)
            for path, g, r in zip(
                jax.tree_util.tree_leaves_with_path(grads),
                jax.tree_util.tree_leaves(grads),
                jax.tree_util.tree_leaves(ref_grads),
                strict=True,
            ):
                scale = float(jnp.max(jnp.abs(r)))
                assert scale > 0, jax.tree_util.keystr(path[0])
                np.testing.assert_allclose(
                    g, r, atol=2e-5 * scale, err_msg=f"{jax.tree_util.keystr(path[0])} c={chunk}"
                )


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_accelerator_matmuls_match_plain_autodiff(monkeypatch, kv_heads):
    """``dense`` and ``swiglu`` as they run on accelerators (autodiff, no custom VJP, chosen at
    trace time from the backend, faked here as a TPU's) against the reference objective."""
    import trainer.kernels as kernels
    from trainer.train import loss_and_stats

    _, model = _tiny(num_kv_heads=kv_heads, attention="xla")
    toks = jax.random.randint(jax.random.key(6), (2, 33), 1, 20).at[:, ::7].set(0)
    x = jax.random.normal(jax.random.key(7), (2, 5, 8))
    wgu, wd = jax.random.normal(jax.random.key(8), (8, 2, 12)), jnp.ones((12, 8)) / 12
    with jax.default_matmul_precision("highest"):
        ref, ref_grads = jax.value_and_grad(lambda m: _reference_objective(m, toks, 0, 1e-2))(model)
        cpu = jax.grad(lambda *a: jnp.sum(kernels.swiglu(*a) ** 2), argnums=(0, 1, 2))(x, wgu, wd)
        monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
        acc = jax.grad(lambda *a: jnp.sum(kernels.swiglu(*a) ** 2), argnums=(0, 1, 2))(x, wgu, wd)
        obj, grads = jax.value_and_grad(
            lambda m: loss_and_stats(
                m, jnp.zeros((2, 0)), document_batch(toks, 0), z_loss_coef=1e-2, dtype=jnp.float32
            )[0]
        )(model)
    for a, c in zip(acc, cpu, strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(obj, ref, rtol=1e-6)
    leaves, ref_leaves = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)
    for g, r in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_allclose(g, r, atol=2e-5 * float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("group_bytes", [0, 1, 2 * 2 * 8 * 64 * 4, 1 << 30])
def test_accelerator_loss_head_gradient_groups_match_the_carry(monkeypatch, group_bytes):
    """The fused loss as it runs on accelerators (backend faked as a TPU's): the head gradient
    contracted over stacked dlogits per group of chunks (one chunk per group, two, all eight)
    or, with 0, carried through the chunk scan; against the CPU path's carry."""
    import trainer.kernels as kernels

    b, s, d, v = 2, 64, 16, 64
    x = jax.random.normal(jax.random.key(9), (b, s, d))
    head = jax.random.normal(jax.random.key(10), (d, v)) * 0.3
    targets = jax.random.randint(jax.random.key(11), (b, s), 0, v)

    def objective(x, head):
        return kernels.fused_cross_entropy(x, head, targets, z_loss_coef=1e-2, chunk=8)[0]

    with jax.default_matmul_precision("highest"):
        ref, ref_grads = jax.value_and_grad(objective, argnums=(0, 1))(x, head)
        monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
        monkeypatch.setattr(kernels, "LOSS_DHEAD_GROUP_BYTES", group_bytes)
        obj, grads = jax.value_and_grad(objective, argnums=(0, 1))(x, head)
    np.testing.assert_allclose(obj, ref, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_splash_attention_matches_blocked_in_interpret_mode(monkeypatch, kv_heads):
    """The splash wrapper (its tiles, sequence-minor q/k/v, grouped-query heads, packed
    documents) run by Pallas' interpreter on the CPU, forward and gradients, against the
    blocked attention. The TPU's speed is docs/benchmarks.md's; this checks the call."""
    import functools

    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    import trainer.kernels as kernels
    from tests.support.trainer_data import attention_inputs

    s = 256
    q, k, v, ct, seg = attention_inputs(2, s, 4, kv_heads, 64, seed=12)

    def run(impl):
        def f(q, k, v):
            return jnp.sum(kernels.attention(q, k, v, seg, impl) * ct)

        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    with jax.default_matmul_precision("highest"):
        ref = run("blocked")
        monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
        monkeypatch.setattr(
            sa, "make_splash_mha", functools.partial(sa.make_splash_mha, interpret=True)
        )
        got = run("splash")
    blk = kernels._splash_block_sizes(sa, s)
    assert blk.block_q == s and blk.q_layout == sa.QKVLayout.SEQ_MINOR  # 1024 halved to fit
    # 1024 tiles for 16-bit inputs; float32's overflow the v5e's scoped VMEM, so 512
    assert kernels._splash_block_sizes(sa, 2048, 2).block_kv_dkv == 1024
    assert kernels._splash_block_sizes(sa, 2048, 4).block_kv_dkv == 512
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("moe", [None, MoEConfig(num_experts=4, top_k=2)])
def test_scanned_and_unrolled_layers_agree(moe):
    from trainer.model import unroll_layers
    from trainer.train import loss_and_stats

    toks = jax.random.randint(jax.random.key(5), (3, 33), 1, 20).at[:, ::7].set(0)
    batch = document_batch(toks, 0)
    seg, pos = segments_and_positions(toks[:, :-1], 0)  # the batch carries the inputs' ids
    assert np.array_equal(batch.segments, seg) and np.array_equal(batch.positions, pos)
    results = {}
    for loop in ("scan", "unroll"):
        cfg, model = _tiny(moe=moe, layer_loop=loop)
        assert unroll_layers(cfg) == (loop == "unroll")
        bias = jnp.linspace(-0.1, 0.1, 2 * (moe.num_experts if moe else 0)).reshape(2, -1)
        fn = jax.jit(
            jax.value_and_grad(
                lambda m, b: loss_and_stats(m, b, batch, z_loss_coef=1e-3, dtype=jnp.float32),
                has_aux=True,
            )
        )
        results[loop] = fn(model, bias)
    (obj_s, stats_s), grads_s = results["scan"]
    (obj_u, stats_u), grads_u = results["unroll"]
    np.testing.assert_allclose(obj_u, obj_s, rtol=1e-6)
    assert stats_u.keys() == stats_s.keys()
    for k in stats_s:  # MoE stats are stacked per layer either way
        np.testing.assert_allclose(stats_u[k], stats_s[k], rtol=1e-5, atol=1e-7, err_msg=k)
    leaves_u, leaves_s = jax.tree_util.tree_leaves(grads_u), jax.tree_util.tree_leaves(grads_s)
    for g_u, g_s in zip(leaves_u, leaves_s, strict=True):
        np.testing.assert_allclose(g_u, g_s, rtol=1e-5, atol=1e-7)


def test_layer_loop_auto_unrolls_on_cpu_and_shallow_accelerator_models(monkeypatch):
    from trainer.model import UNROLL_MAX_LAYERS_ACCELERATOR, unroll_layers

    cfg, _ = _tiny()
    assert cfg.layer_loop == "auto" and unroll_layers(cfg)  # the tests run on the CPU backend
    deep = dataclasses.replace(cfg, num_layers=UNROLL_MAX_LAYERS_ACCELERATOR + 1)
    assert unroll_layers(deep)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert unroll_layers(cfg)  # shallow: unrolled on accelerators too
    assert not unroll_layers(deep)
    assert unroll_layers(dataclasses.replace(deep, layer_loop="unroll"))
    assert not unroll_layers(dataclasses.replace(cfg, layer_loop="scan"))


def test_token_nll_equals_logits_cross_entropy():
    from trainer.kernels import token_nll

    _, model = _tiny()
    toks = jax.random.randint(jax.random.key(6), (2, 33), 0, 20)
    inputs, targets = toks[:, :-1], toks[:, 1:]
    seg, pos = segments_and_positions(inputs, 0)
    logits, _ = model(inputs, seg, pos)
    ref = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    x, _ = model.hidden(inputs, seg, pos)
    for chunk in (1, 4, 32):
        np.testing.assert_allclose(token_nll(x, model.head(), targets, chunk), ref, atol=2e-5)


def test_attention_switch_names_and_refusals():
    import typing

    from trainer import kernels
    from trainer.config import ConfigError, from_dict

    literal = typing.get_type_hints(ModelConfig)["attention"]
    assert typing.get_args(literal) == kernels.ATTENTION_IMPLEMENTATIONS
    assert kernels.resolve_attention("auto", jnp.float32, "cpu") == "blocked"
    assert kernels.resolve_attention("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert kernels.resolve_attention("auto", jnp.float32, "gpu") == "xla"
    assert kernels.resolve_attention("auto", jnp.bfloat16, "tpu", seq_len=2048) == "splash"
    assert kernels.resolve_attention("auto", jnp.float32, "tpu", seq_len=384) == "splash"
    assert kernels.resolve_attention("auto", jnp.bfloat16, "tpu", seq_len=100) == "xla"
    assert kernels.resolve_attention("auto", jnp.bfloat16, "tpu") == "xla"
    assert kernels.resolve_attention("splash", jnp.bfloat16, "cpu") == "splash"
    with pytest.raises(ValueError, match="'flash': one of"):
        kernels.resolve_attention("flash", jnp.float32)
    with pytest.raises(ConfigError, match=r"model\.attention"):
        from_dict(ModelConfig, {"attention": "flash"}, "model")
    q = jnp.zeros((1, 8, 2, 4))
    seg = jnp.zeros((1, 8), jnp.int32)
    if jax.default_backend() != "tpu":
        with pytest.raises(RuntimeError, match="runs on TPU only"):
            kernels.attention(q, q, q, seg, "splash")
