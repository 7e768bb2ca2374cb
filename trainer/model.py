"""Llama-family decoder and its mixture-of-experts variant, in Equinox. The whole model is here.

Conventions:
- A model is a pytree whose leaves are exactly its parameters (all config is static), so it can
  be passed straight through ``jax.jit`` with per-leaf shardings.
- Weights are raw arrays laid out ``(in, ..., out)`` and applied with ``einsum``; each named
  weight has logical axes in ``PARAM_AXES`` which ``trainer.sharding`` maps to mesh axes.
- Layers are stacked along a leading axis and run with ``lax.scan``: compile time is constant in
  depth, which matters on CPU tests as much as on 8B TPU runs.
- Numerically sensitive pieces (norm statistics, softmax, router, loss) run in float32
  whatever the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import Array

from trainer.config import ModelConfig, MoEConfig

# ---------------------------------------------------------------------------------------------
# presets: shapes mirroring Marin's experiments/llama.py. The vocabulary comes from the token
# store at run time; the "30m"-style names count Llama-3's 128,256-token vocabulary as Marin does.


@dataclass(frozen=True)
class Shape:
    hidden_dim: int
    intermediate_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    seq_len: int = 1024  # Marin's default context for the preset (informative)


PRESETS: dict[str, Shape] = {
    "nano": Shape(32, 128, 2, 2, 2, seq_len=512),
    "30m": Shape(128, 448, 4, 4, 4),
    "75m": Shape(256, 896, 8, 4, 4),
    "150m": Shape(512, 1792, 6, 8, 8, seq_len=4096),
    "300m": Shape(768, 2688, 12, 12, 12, seq_len=4096),
    "600m": Shape(1024, 3584, 24, 16, 8, seq_len=4096),
    "1.4b": Shape(2048, 7168, 16, 16, 8, seq_len=4096),
    "8b": Shape(4096, 14336, 32, 32, 8, seq_len=4096),
}

# logical axes per named weight (after the leading stacked-layer axis, if any)
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "wq": ("embed", "heads", None),
    "wk": ("embed", "heads", None),
    "wv": ("embed", "heads", None),
    "wo": ("heads", None, "embed"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "router": ("embed", None),
    "e_gate": ("expert", "embed", "mlp"),
    "e_up": ("expert", "embed", "mlp"),
    "e_down": ("expert", "mlp", "embed"),
    "weight": (None,),  # norms
}
NO_DECAY = {"embed", "weight"}  # norms and embeddings (the model has no biases)


# ---------------------------------------------------------------------------------------------
# counting


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of ``Transformer(cfg)`` (tested against the real pytree)."""
    d, hd, L = cfg.hidden_dim, cfg.head_dim, cfg.num_layers
    attn = d * hd * (cfg.num_heads * 2 + cfg.num_kv_heads * 2)
    if cfg.moe is None:
        mlp = 3 * d * cfg.intermediate_dim
    else:
        m = cfg.moe
        mlp = d * m.num_experts + 3 * d * m.shared_expert_dim + m.num_experts * 3 * d * m.expert_dim
    layer = attn + mlp + 2 * d
    head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
    return cfg.vocab_size * d + L * layer + d + head


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights touched by matmuls per token (routed experts: only top_k of them; no embedding
    lookup, but the output projection counts even when tied)."""
    d, hd, L = cfg.hidden_dim, cfg.head_dim, cfg.num_layers
    attn = d * hd * (cfg.num_heads * 2 + cfg.num_kv_heads * 2)
    if cfg.moe is None:
        mlp = 3 * d * cfg.intermediate_dim
    else:
        m = cfg.moe
        mlp = d * m.num_experts + 3 * d * m.shared_expert_dim + m.top_k * 3 * d * m.expert_dim
    return L * (attn + mlp) + d * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 3 x forward (backward = 2 x forward).

    Forward = 2 x active matmul params + attention scores and values, 2 x 2 x L x seq x H x hd
    (full, not causal-halved: the PaLM/Marin MFU convention, and what the dense kernel computes).
    """
    attn = 2 * 2 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
    return 3.0 * (2.0 * active_matmul_params(cfg) + attn)


# ---------------------------------------------------------------------------------------------
# modules


def _normal(key: Array, shape: tuple[int, ...], std: float) -> Array:
    return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)


class RMSNorm(eqx.Module):
    weight: Array
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float):
        self.weight = jnp.ones((dim,), jnp.float32)
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight).astype(x.dtype)


def rotary(x: Array, positions: Array, theta: float) -> Array:
    """Rotate pairs (x[..., i], x[..., i + hd/2]) by position-dependent angles (Llama layout).
    x: (B, S, H, hd); positions: (B, S)."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = positions.astype(jnp.float32)[..., None] * inv  # (B, S, hd/2)
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


ATTN_CHUNK = 128  # smallest query block of the block-causal attention loop
ATTN_MAX_BLOCKS = 8  # unrolled blocks at most (compile time); a TPU would use a flash kernel


def _attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """q (B, Sq, K, G, hd), k/v (B, T, K, hd), mask (B, Sq, T) -> (B, Sq, K, G, hd).
    Scores and softmax in float32."""
    scores = jnp.einsum("bskgh,btkh->bkgst", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgst,btkh->bskgh", probs, v)


class Attention(eqx.Module):
    wq: Array  # (D, H, hd)
    wk: Array  # (D, K, hd)
    wv: Array  # (D, K, hd)
    wo: Array  # (H, hd, D)
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)

    def __init__(self, cfg: ModelConfig, key: Array):
        d, h, k, hd = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = _normal(kq, (d, h, hd), cfg.init_std)
        self.wk = _normal(kk, (d, k, hd), cfg.init_std)
        self.wv = _normal(kv, (d, k, hd), cfg.init_std)
        # scaled init for residual outputs (GPT-2 / Levanter): keeps the residual stream O(1)
        self.wo = _normal(ko, (h, hd, d), cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.num_heads, self.num_kv_heads, self.rope_theta = h, k, cfg.rope_theta

    def __call__(self, x: Array, segments: Array, positions: Array) -> Array:
        b, s, _ = x.shape
        dt = x.dtype
        q = jnp.einsum("bsd,dhk->bshk", x, self.wq.astype(dt))
        k = jnp.einsum("bsd,dhk->bshk", x, self.wk.astype(dt))
        v = jnp.einsum("bsd,dhk->bshk", x, self.wv.astype(dt))
        q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        hd = q.shape[-1]
        g = self.num_heads // self.num_kv_heads  # grouped-query: g query heads per kv head
        q = q.reshape(b, s, self.num_kv_heads, g, hd)
        # causal AND same document: packed documents never see each other
        causal = jnp.tril(jnp.ones((s, s), bool))
        mask = causal[None] & (segments[:, :, None] == segments[:, None, :])  # (B, S, T)
        chunk = max(ATTN_CHUNK, s // ATTN_MAX_BLOCKS)
        if s > chunk and s % chunk == 0:
            # query blocks attend only to keys up to their end: the all-masked upper triangle
            # of blocks is never computed (2.5x faster attention on CPU at seq 512, 4 blocks)
            parts = []
            for i in range(s // chunk):
                lo, hi = i * chunk, (i + 1) * chunk
                parts.append(_attend(q[:, lo:hi], k[:, :hi], v[:, :hi], mask[:, lo:hi, :hi]))
            out = jnp.concatenate(parts, axis=1)
        else:
            out = _attend(q, k, v, mask)
        out = out.reshape(b, s, self.num_heads, hd)
        return jnp.einsum("bshk,hkd->bsd", out, self.wo.astype(dt))


class MLP(eqx.Module):
    w_gate: Array  # (D, F)
    w_up: Array  # (D, F)
    w_down: Array  # (F, D)

    def __init__(self, d: int, f: int, std: float, out_std: float, key: Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.w_gate = _normal(k1, (d, f), std)
        self.w_up = _normal(k2, (d, f), std)
        self.w_down = _normal(k3, (f, d), out_std)

    def __call__(self, x: Array) -> Array:
        dt = x.dtype
        h = jax.nn.silu(x @ self.w_gate.astype(dt)) * (x @ self.w_up.astype(dt))
        return h @ self.w_down.astype(dt)


# ---------------------------------------------------------------------------------------------
# mixture of experts


def route(
    logits: Array, bias: Array, top_k: int, capacity: int
) -> tuple[Array, Array, Array, Array, dict[str, Array]]:
    """Top-k routing of one group of T tokens over E experts (pure; float32).

    Selection uses ``logits + bias`` (bias is gradient-free, set by quantile balancing); combine
    weights come from the unbiased logits. Returns (expert index (T,k), slot (T,k), keep (T,k),
    weight (T,k), stats) where stats carries beta (E,), load (E,), drops and the aux loss terms.
    """
    t, e = logits.shape
    biased = logits + jax.lax.stop_gradient(bias)
    n_sel = min(top_k + 1, e)
    top_vals, top_idx = jax.lax.top_k(biased, n_sel)
    idx = top_idx[:, :top_k]
    # quantile balancing: a_t is token t's cutoff (its (k+1)-th biased score); expert e would
    # get exactly q tokens if its bias were -beta_e with beta_e the q-th largest s[t,e] - a_t.
    cutoff = top_vals[:, top_k] if n_sel > top_k else jnp.full((t,), -jnp.inf)
    q = max(1, (t * top_k) // e)
    margin = jax.lax.stop_gradient(logits - cutoff[:, None])  # (T, E)
    beta = jax.lax.top_k(margin.T, q)[0][:, q - 1]  # (E,)
    probs = jax.nn.softmax(logits, axis=-1)
    weight = jnp.take_along_axis(probs, idx, axis=-1)
    if top_k > 1:  # renormalize over the chosen experts; with k=1 keep p so the router learns
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(idx, e, dtype=jnp.int32)  # (T, k, E)
    # capacity: first choices claim slots before second choices, then in token order
    flat = onehot.transpose(1, 0, 2).reshape(top_k * t, e)
    slot = jnp.sum((jnp.cumsum(flat, axis=0) - 1) * flat, axis=-1).reshape(top_k, t).T
    keep = slot < capacity
    load = jnp.sum(onehot, axis=(0, 1)).astype(jnp.float32)  # assignments per expert, pre-drop
    stats = {
        "beta": beta,
        "load": load,
        "dropped": jnp.sum(~keep).astype(jnp.float32),
        "frac_routed": load / (t * top_k),
        "mean_prob": jnp.mean(probs, axis=0),
    }
    return idx, slot, keep, weight, stats


class MoE(eqx.Module):
    router: Array  # (D, E), applied in float32
    shared: MLP
    e_gate: Array  # (E, D, F)
    e_up: Array  # (E, D, F)
    e_down: Array  # (E, F, D)
    moe: MoEConfig = eqx.field(static=True)

    def __init__(self, cfg: ModelConfig, key: Array):
        m = cfg.moe
        assert m is not None
        d, f, e = cfg.hidden_dim, m.expert_dim, m.num_experts
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        kr, ks, k1, k2, k3 = jax.random.split(key, 5)
        self.router = _normal(kr, (d, e), cfg.init_std)
        self.shared = MLP(d, m.shared_expert_dim, cfg.init_std, out_std, ks)
        self.e_gate = _normal(k1, (e, d, f), cfg.init_std)
        self.e_up = _normal(k2, (e, d, f), cfg.init_std)
        self.e_down = _normal(k3, (e, f, d), out_std)
        self.moe = m

    def capacity(self, group: int) -> int:
        m = self.moe
        if m.capacity_factor <= 0:
            return group * m.top_k  # never drop
        return max(1, math.ceil(m.capacity_factor * group * m.top_k / m.num_experts))

    def __call__(self, x: Array, bias: Array) -> tuple[Array, dict[str, Array]]:
        b, s, d = x.shape
        m = self.moe
        gs = m.group_size or s
        xg = x.reshape(b * s // gs, gs, d)  # groups are independent: routing never crosses hosts
        cap = self.capacity(gs)
        logits = jnp.einsum("gtd,de->gte", xg.astype(jnp.float32), self.router)
        idx, slot, keep, weight, stats = jax.vmap(lambda lg: route(lg, bias, m.top_k, cap))(logits)

        def dispatch(xt, ix, sl, kp):
            buf = jnp.zeros((m.num_experts, cap, d), x.dtype)
            src = jnp.broadcast_to(xt[:, None, :], (*ix.shape, d))
            return buf.at[ix, jnp.where(kp, sl, cap)].set(src, mode="drop")

        buf = jax.vmap(dispatch)(xg, idx, slot, keep)  # (G, E, C, D)
        dt = x.dtype
        h = jax.nn.silu(jnp.einsum("gecd,edf->gecf", buf, self.e_gate.astype(dt)))
        h = h * jnp.einsum("gecd,edf->gecf", buf, self.e_up.astype(dt))
        y = jnp.einsum("gecf,efd->gecd", h, self.e_down.astype(dt))

        def combine(yg, ix, sl, kp, w):
            got = yg[ix, jnp.minimum(sl, cap - 1)]  # (T, k, D)
            return jnp.sum(got * (w * kp)[..., None].astype(dt), axis=1)

        out = jax.vmap(combine)(y, idx, slot, keep, weight).reshape(b, s, d)
        out = out + self.shared(x)
        # beta averaged over groups = over data-parallel devices, independent of mesh shape
        load = jnp.sum(stats["load"], axis=0)
        aux = m.num_experts * jnp.sum(
            jnp.mean(stats["frac_routed"], axis=0) * jnp.mean(stats["mean_prob"], axis=0)
        )
        return out, {
            "beta": jnp.mean(stats["beta"], axis=0),
            "load": load,
            "dropped": jnp.sum(stats["dropped"]),
            "assigned": jnp.asarray(b * s * m.top_k, jnp.float32),
            "aux_loss": aux,
        }


# ---------------------------------------------------------------------------------------------
# decoder


class Block(eqx.Module):
    attn_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: MLP | MoE

    def __init__(self, cfg: ModelConfig, key: Array):
        ka, km = jax.random.split(key)
        self.attn_norm = RMSNorm(cfg.hidden_dim, cfg.norm_eps)
        self.attn = Attention(cfg, ka)
        self.mlp_norm = RMSNorm(cfg.hidden_dim, cfg.norm_eps)
        if cfg.moe is None:
            out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
            self.mlp = MLP(cfg.hidden_dim, cfg.intermediate_dim, cfg.init_std, out_std, km)
        else:
            self.mlp = MoE(cfg, km)

    def __call__(self, x, segments, positions, bias):
        x = x + self.attn(self.attn_norm(x), segments, positions)
        if isinstance(self.mlp, MoE):
            y, stats = self.mlp(self.mlp_norm(x), bias)
        else:
            y, stats = self.mlp(self.mlp_norm(x)), {}
        return x + y, stats


class Transformer(eqx.Module):
    embed: Array  # (V, D)
    layers: Block  # stacked: every leaf has a leading num_layers axis
    final_norm: RMSNorm
    lm_head: Array | None  # (D, V); None when tied to embed
    cfg: ModelConfig = eqx.field(static=True)

    def __init__(self, cfg: ModelConfig, key: Array):
        ke, kl, kh = jax.random.split(key, 3)
        self.embed = _normal(ke, (cfg.vocab_size, cfg.hidden_dim), cfg.init_std)
        self.layers = eqx.filter_vmap(lambda k: Block(cfg, k))(jax.random.split(kl, cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_dim, cfg.norm_eps)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else _normal(kh, (cfg.hidden_dim, cfg.vocab_size), cfg.init_std)
        )
        self.cfg = cfg

    def __call__(
        self,
        tokens: Array,
        segments: Array,
        positions: Array,
        router_bias: Array | None = None,
        dtype: jnp.dtype = jnp.float32,
    ) -> tuple[Array, dict[str, Array]]:
        """tokens, segments, positions: (B, S) -> float32 logits (B, S, V), per-layer MoE stats."""
        cfg = self.cfg
        x = jnp.take(self.embed, tokens, axis=0).astype(dtype)
        params, static = eqx.partition(self.layers, eqx.is_array)
        if router_bias is None:
            router_bias = jnp.zeros((cfg.num_layers, cfg.moe.num_experts if cfg.moe else 0))

        def body(h, xs):
            p, bias = xs
            return eqx.combine(p, static)(h, segments, positions, bias)

        if cfg.remat:
            body = jax.checkpoint(body)
        x, stats = jax.lax.scan(body, x, (params, router_bias))
        x = self.final_norm(x)
        head = self.embed.T if self.lm_head is None else self.lm_head
        logits = jnp.einsum("bsd,dv->bsv", x, head.astype(dtype)).astype(jnp.float32)
        return logits, stats


def segments_and_positions(tokens: Array, eos_id: int) -> tuple[Array, Array]:
    """Document ids and within-document positions of a packed window (B, S).

    Every document ends with EOS, so a new document starts right after each EOS. The EOS itself
    belongs to the document it ends.
    """
    is_eos = (tokens == eos_id).astype(jnp.int32)
    segments = jnp.cumsum(is_eos, axis=1) - is_eos  # exclusive cumsum
    s = tokens.shape[1]
    idx = jnp.broadcast_to(jnp.arange(s), tokens.shape)
    starts = jnp.concatenate([jnp.ones_like(is_eos[:, :1]), is_eos[:, :-1]], axis=1)
    doc_start = jax.lax.cummax(jnp.where(starts > 0, idx, 0), axis=1)
    return segments, idx - doc_start


@eqx.filter_jit
def init_model(cfg: ModelConfig, key: Array) -> Transformer:
    """Jitted construction: eager init dispatches thousands of tiny ops (seconds on CPU)."""
    return Transformer(cfg, key)
