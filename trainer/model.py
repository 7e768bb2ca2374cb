"""Llama-family decoder and its mixture-of-experts variant, in Equinox. The whole model is here.

Conventions:
- A model is a pytree whose leaves are exactly its parameters (all config is static), so it can
  be passed straight through ``jax.jit`` with per-leaf shardings.
- Weights are raw arrays laid out ``(in, ..., out)`` and applied with ``einsum``; each named
  weight has logical axes in ``PARAM_AXES`` which ``trainer.sharding`` maps to mesh axes.
- Layers are stacked along a leading axis. On accelerators they run with ``lax.scan`` (compile
  time constant in depth, which matters for 8B TPU runs); on the CPU backend one copy per
  layer is traced instead, which XLA:CPU runs faster (``ModelConfig.layer_loop``).
- Numerically sensitive pieces (norm statistics, softmax, router, loss) run in float32
  whatever the compute dtype.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import Array

from trainer.config import ModelConfig, MoEConfig

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
# modules


def _normal(key: Array, shape: tuple[int, ...], std: float) -> Array:
    return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)


def _materialized_transpose(a: Array) -> Array:
    """a.T as a real row-major array. The barrier stops XLA from folding the transpose back into
    the consuming dot's dimension numbers, which on CPU ends in a dot with a transposed operand
    that XLA handles by writing a big operand transposed inside an elementwise fusion (slow,
    strided) or by a slower dot kernel."""
    return jax.lax.optimization_barrier(a.T)


def _contract_out(a: Array, w: Array) -> Array:
    """a (N, *out) with w (K, *out) over ``out`` -> (N, K): an input gradient."""
    axes = tuple(range(1, w.ndim))
    return jax.lax.dot_general(a, w, ((axes, axes), ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def dense(x: Array, w: Array) -> Array:
    """x (..., K) @ w (K, *out) -> (..., *out), with a CPU-friendly backward pass.

    The weight gradient contracts over all tokens, the major axis of both x and dy. Autodiff
    leaves XLA:CPU to pick which of the two to transpose, and it picks badly (e.g. a (tokens,
    4 x hidden) activation gradient written transposed inside the SwiGLU fusion: 2x slower MLP
    backward at the 30m/75m shapes). Here the smaller of x and dy is transposed explicitly, so
    every matmul runs on row-major operands. Same math and FLOPs as autodiff. ``out`` may have
    several axes (e.g. (3, heads, head_dim) for fused q/k/v), so a weight sharded over one of
    them is never reshaped across its sharded axis."""
    return jnp.tensordot(x, w, axes=1)


def _dense_fwd(x, w):
    return dense(x, w), (x, w)


def _weight_grad(a: Array, b: Array) -> Array:
    """a^T b for token-major a (N, K) and b (N, *out) -> (K, *out), in float32: the
    contraction over tokens of every weight gradient. The narrower of a and b is transposed
    explicitly."""
    f32 = jnp.float32
    width = math.prod(b.shape[1:])
    if a.shape[1] <= width:
        return jnp.tensordot(_materialized_transpose(a), b, axes=1, preferred_element_type=f32)
    b_t = jax.lax.optimization_barrier(jnp.moveaxis(b, 0, -1))  # (*out, N), materialized
    return jnp.moveaxis(jnp.tensordot(b_t, a, axes=1, preferred_element_type=f32), -1, 0)


def _dense_bwd(res, dy):
    x, w = res
    x2, dy2 = x.reshape(-1, w.shape[0]), dy.reshape(-1, *w.shape[1:])
    dx = _contract_out(dy2, w)
    return dx.astype(x.dtype).reshape(x.shape), _weight_grad(x2, dy2).astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


@jax.custom_vjp
def swiglu(x: Array, w_gate_up: Array, w_down: Array) -> Array:
    """SwiGLU MLP (silu(x Wg) * (x Wu)) Wd, x (..., D), with ``w_gate_up`` = Wg and Wu stacked
    (D, 2, F): one (D x 2F) matmul forward, one for the input gradient and one for both weight
    gradients instead of two each (bigger matmuls, one transpose of x), and a weight sharded over
    F stays sharded. The backward keeps only x and x [Wg, Wu] (autodiff stores six (tokens x F)
    arrays per layer, which the layer scan writes and zero-fills every step) and runs every
    matmul on row-major operands as ``dense`` does."""
    gu = dense(x, w_gate_up)
    return dense(jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], w_down)


def _swiglu_fwd(x, w_gate_up, w_down):
    x2 = x.reshape(-1, x.shape[-1])
    gu = jnp.tensordot(x2, w_gate_up, axes=1)  # (N, 2, F)
    y = (jax.nn.silu(gu[:, 0]) * gu[:, 1]) @ w_down
    return y.reshape(x.shape), (x2, gu, w_gate_up, w_down)


def _swiglu_bwd(res, dy):
    x2, gu, w_gate_up, w_down = res
    f32 = jnp.float32
    dy2 = dy.reshape(-1, dy.shape[-1])
    gf, uf = gu[:, 0].astype(f32), gu[:, 1].astype(f32)
    sig = jax.nn.sigmoid(gf)
    silu = gf * sig
    h = (silu * uf).astype(gu.dtype)
    # against a row-major copy of Wd^T: XLA:CPU runs this (K = D) matmul ~1.7x faster than
    # contracting Wd's minor axis in place
    dh = jnp.dot(dy2, _materialized_transpose(w_down), preferred_element_type=f32)
    dg = dh * uf * sig * (1.0 + gf * (1.0 - sig))  # silu'
    dgu = jnp.stack([dg, dh * silu], axis=1).astype(gu.dtype)  # (N, 2, F)
    dx = _contract_out(dgu, w_gate_up)
    return (
        dx.astype(x2.dtype).reshape(dy.shape),
        _weight_grad(x2, dgu).astype(w_gate_up.dtype),
        _weight_grad(h, dy2).astype(w_down.dtype),
    )


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


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
_MASKED = -1e30  # finite: a fully masked row can never occur (each query sees itself)


def _query_blocks(s: int) -> list[tuple[int, int]]:
    """Query blocks [lo, hi); block i attends to keys [0, hi). One block when s is small."""
    chunk = max(ATTN_CHUNK, s // ATTN_MAX_BLOCKS)
    if s <= chunk or s % chunk:
        return [(0, s)]
    return [(i * chunk, (i + 1) * chunk) for i in range(s // chunk)]


def _block_bias(segments: Array, lo: int, hi: int) -> Array:
    """Additive mask (B, c, hi) of query block [lo, hi) against keys [0, hi): 0 where the key
    is not in the future and in the same document, else -1e30. Built from the (B, S) segment
    ids, never per head: adding it broadcasts inside the fused softmax."""
    causal = (lo + jnp.arange(hi - lo))[:, None] >= jnp.arange(hi)[None, :]
    same = segments[:, lo:hi, None] == segments[:, None, :hi]
    return jnp.where(causal[None] & same, 0.0, _MASKED)


def _block_bias_t(segments: Array, lo: int, hi: int) -> Array:
    """``_block_bias`` transposed, (B, hi, c), built in that layout: transposing the forward's
    mask instead makes XLA:CPU read it strided inside the backward's exp fusion (5x slower)."""
    causal = jnp.arange(hi)[:, None] <= (lo + jnp.arange(hi - lo))[None, :]
    same = segments[:, :hi, None] == segments[:, None, lo:hi]
    return jnp.where(causal[None] & same, 0.0, _MASKED)


def _attention_fwd_blocks(q: Array, k: Array, v: Array, segments: Array) -> tuple[Array, Array]:
    """q already scaled by 1/sqrt(hd). Returns the output and the row log-sum-exp (float32).
    The matmuls see a kv head's g query heads and c positions as one (g c) row axis: with a
    size-1 g axis of its own, XLA:CPU copies every score block to move that axis."""
    f32 = jnp.float32
    b, kh, g, _, hd = q.shape
    outs, lses = [], []
    for lo, hi in _query_blocks(q.shape[3]):
        c = hi - lo
        qb = q[:, :, :, lo:hi].reshape(b, kh, g * c, hd)
        s = jnp.einsum("bkmh,bkth->bkmt", qb, k[:, :, :hi], preferred_element_type=f32)
        s = s.reshape(b, kh, g, c, hi) + _block_bias(segments, lo, hi)[:, None, None]
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        # normalize the (c, hd) output rather than the (c, T) probabilities: one pass fewer
        o = jnp.einsum(
            "bkmt,bkth->bkmh",
            e.reshape(b, kh, g * c, hi).astype(v.dtype),
            v[:, :, :hi],
            preferred_element_type=f32,
        )
        outs.append((o.reshape(b, kh, g, c, hd) / total).astype(v.dtype))
        lses.append((m + jnp.log(total))[..., 0])
    return jnp.concatenate(outs, axis=3), jnp.concatenate(lses, axis=3)


def _scale(q: Array) -> Array:
    return q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)


@jax.custom_vjp
def block_causal_attention(q: Array, k: Array, v: Array, segments: Array) -> Array:
    """Softmax attention, causal and within documents, heads-major:
    q (B, K, G, S, hd), k/v (B, K, S, hd), segments (B, S) -> (B, K, G, S, hd).

    Query blocks attend only to keys up to their own end, so the all-masked upper triangle of
    blocks is never computed. Scores and softmax are float32. The backward pass is the
    flash-attention one: only the output and the row log-sum-exp are kept, and each block's
    probabilities are recomputed from q and k. Keeping (B, H, S, S) probabilities per layer
    instead costs more on CPU (writing, zero-filling and re-reading them through the layer
    scan) than the extra q.k matmul; on an accelerator it is what saves the memory."""
    return _attention_fwd_blocks(_scale(q), k, v, segments)[0]


def _attention_fwd(q, k, v, segments):
    qs = _scale(q)
    out, lse = _attention_fwd_blocks(qs, k, v, segments)
    return out, (qs, k, v, segments, out, lse)


def _attention_bwd(res, d_out):
    """Flash-attention backward, computed key-major: scores^T (keys x queries) come straight out
    of k @ q^T, so P^T and dS^T are produced in the layout that dV = P^T dO and dK = dS^T Q
    consume, and dQ^T = K^T dS^T. Only (B, K, S, hd)-sized operands are ever transposed, never
    the (keys x queries) blocks (which XLA:CPU would otherwise write transposed, slowly).
    ``qs`` is q / sqrt(hd), so dK = dS^T qs and dQ = dS K / sqrt(hd)."""
    qs, k, v, segments, out, lse = res
    f32 = jnp.float32
    # D_i = sum_h dO_ih O_ih = sum_j P_ij dP_ij (the softmax Jacobian's row term), as a
    # matrix-vector product: XLA:CPU's reduce over a short minor axis is ~10x slower
    prod = d_out.astype(f32) * out.astype(f32)
    delta = jnp.matmul(prod, jnp.ones((prod.shape[-1],), f32))  # (B, K, G, S)
    k_t = _materialized_transpose_last2(k)  # (B, K, hd, S)
    dq_parts = []
    dk = jnp.zeros(k.shape, f32)
    dv = jnp.zeros(v.shape, f32)
    b, kh, g, _, hd = qs.shape
    for lo, hi in _query_blocks(qs.shape[3]):
        c = hi - lo
        qb, dob = qs[:, :, :, lo:hi], d_out[:, :, :, lo:hi]  # (B, K, G, c, hd)
        # (g, c) merged into one row axis m, as in the forward
        qb_t = _materialized_transpose_heads(qb).reshape(b, kh, hd, g * c)
        dob_t = _materialized_transpose_heads(dob).reshape(b, kh, hd, g * c)
        qb, dob = qb.reshape(b, kh, g * c, hd), dob.reshape(b, kh, g * c, hd)
        s_t = jnp.einsum("bkth,bkhm->bktm", k[:, :, :hi], qb_t, preferred_element_type=f32)
        bias_t = _block_bias_t(segments, lo, hi)  # (B, T, c)
        s_t = s_t.reshape(b, kh, hi, g, c) + bias_t[:, None, :, None, :]
        p_t = jnp.exp(s_t - lse[:, :, None, :, lo:hi])  # (B, K, T, G, c)
        dv = dv.at[:, :, :hi].add(
            jnp.einsum(
                "bktm,bkmh->bkth",
                p_t.reshape(b, kh, hi, g * c).astype(dob.dtype),
                dob,
                preferred_element_type=f32,
            )
        )
        dp_t = jnp.einsum("bkth,bkhm->bktm", v[:, :, :hi], dob_t, preferred_element_type=f32)
        dp_t = dp_t.reshape(b, kh, hi, g, c)
        ds_t = (p_t * (dp_t - delta[:, :, None, :, lo:hi])).astype(qs.dtype)
        ds_t = ds_t.reshape(b, kh, hi, g * c)
        dk = dk.at[:, :, :hi].add(
            jnp.einsum("bktm,bkmh->bkth", ds_t, qb, preferred_element_type=f32)
        )
        dq_t = jnp.einsum("bkht,bktm->bkhm", k_t[..., :hi], ds_t, preferred_element_type=f32)
        dq_parts.append(dq_t.reshape(b, kh, hd, g, c).transpose(0, 1, 3, 4, 2))  # (B, K, G, c, hd)
    dq = _scale(jnp.concatenate(dq_parts, axis=3))
    return dq.astype(qs.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


def _materialized_transpose_last2(a: Array) -> Array:
    return jax.lax.optimization_barrier(jnp.swapaxes(a, -1, -2))


def _materialized_transpose_heads(a: Array) -> Array:
    """(B, K, G, c, hd) -> (B, K, hd, G, c), materialized (see ``_materialized_transpose``)."""
    return jax.lax.optimization_barrier(a.transpose(0, 1, 4, 2, 3))


block_causal_attention.defvjp(_attention_fwd, _attention_bwd)


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
        b, s, d = x.shape
        dt = x.dtype

        # one matmul for the projections of equal shape, stacked on a new axis (the heads axis
        # keeps its sharding): q, k and v together when every head has its own kv head, else
        # q alone and k with v
        if self.num_heads == self.num_kv_heads:
            qkv = dense(x, jnp.stack([self.wq, self.wk, self.wv], axis=1).astype(dt))
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, S, heads, hd)
        else:
            q = dense(x, self.wq.astype(dt))
            kv = dense(x, jnp.stack([self.wk, self.wv], axis=1).astype(dt))
            k, v = kv[:, :, 0], kv[:, :, 1]
        q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        hd = q.shape[-1]
        g = self.num_heads // self.num_kv_heads  # grouped-query: g query heads per kv head
        # heads-major for the attention core: its matmuls batch over (B, K) with the g query
        # heads of a kv head and the positions as one M dimension (no broadcast of k or v)
        qh = q.reshape(b, s, self.num_kv_heads, g, hd).transpose(0, 2, 3, 1, 4)
        out = block_causal_attention(qh, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), segments)
        out = out.transpose(0, 3, 1, 2, 4).reshape(b, s, self.num_heads * hd)
        return dense(out, self.wo.astype(dt).reshape(self.num_heads * hd, d))


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
        w_gate_up = jnp.stack([self.w_gate, self.w_up], axis=1).astype(dt)  # (D, 2, F)
        return swiglu(x, w_gate_up, self.w_down.astype(dt))


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
        # routing groups: runs of gs consecutive tokens, row-major. The trainer and evaluator set
        # gs to the tokens one device holds (``resolve_model(tokens_per_device=)``): the batch
        # rows are split into contiguous blocks over the devices, so group g is device g's shard
        # and each quantile is taken over a device's tokens without crossing devices. 0 (a
        # direct call): all the tokens of the call are one group.
        gs = m.group_size or b * s
        xg = x.reshape(b * s // gs, gs, d)
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
        # beta averaged over groups (by default one per data-parallel device): the one bias
        # every device selects with next step
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

    def hidden(
        self,
        tokens: Array,
        segments: Array,
        positions: Array,
        router_bias: Array | None = None,
        dtype: jnp.dtype = jnp.float32,
    ) -> tuple[Array, dict[str, Array]]:
        """tokens, segments, positions: (B, S) -> final-normed hidden states (B, S, D) in
        ``dtype``, per-layer MoE stats. The output projection is ``head()``."""
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
        if unroll_layers(cfg):
            per_layer = []
            for i in range(cfg.num_layers):
                layer_i = jax.tree_util.tree_map(operator.itemgetter(i), (params, router_bias))
                x, layer_stats = body(x, layer_i)
                per_layer.append(layer_stats)
            stats = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_layer)
        else:
            x, stats = jax.lax.scan(body, x, (params, router_bias))
        return self.final_norm(x), stats

    def head(self) -> Array:
        """The output projection (D, V): ``lm_head``, or the embedding when tied."""
        return self.embed.T if self.lm_head is None else self.lm_head

    def __call__(
        self,
        tokens: Array,
        segments: Array,
        positions: Array,
        router_bias: Array | None = None,
        dtype: jnp.dtype = jnp.float32,
    ) -> tuple[Array, dict[str, Array]]:
        """tokens, segments, positions: (B, S) -> float32 logits (B, S, V), per-layer MoE stats.
        Training and evaluation do not materialize the logits: see ``fused_cross_entropy``."""
        x, stats = self.hidden(tokens, segments, positions, router_bias, dtype)
        logits = jnp.einsum("bsd,dv->bsv", x, self.head().astype(dtype))
        return logits.astype(jnp.float32), stats


# ---------------------------------------------------------------------------------------------
# loss: output projection + softmax cross-entropy, fused and chunked

LOSS_CHUNK_TOKENS = 256  # tokens per device per loss chunk: (256 x V) float32 logits at a time


def loss_chunk(seq_len: int, rows_per_device: int, vocab_size: int) -> int:
    """Positions per row in one loss chunk: a power-of-two divisor of ``seq_len`` such that a
    device's chunk holds about ``LOSS_CHUNK_TOKENS`` tokens (at least one position). Chunks run
    along the sequence, never the batch, so the batch sharding is untouched."""
    del vocab_size  # the budget is in tokens: matmul efficiency, not bytes, bounds it below
    want = max(1, LOSS_CHUNK_TOKENS // max(rows_per_device, 1))
    c = 1
    while c * 2 <= want and seq_len % (c * 2) == 0:
        c *= 2
    return c


def _xent_chunks(x: Array, head: Array, targets: Array, chunk: int, z_loss_coef: float | None):
    """Scan over sequence chunks. Per chunk: logits (B, c, V) in float32, log-sum-exp, the
    target's logit, and (when ``z_loss_coef`` is not None) d(objective)/d(logits) pushed through
    the projection right away, so no (B, S, V) tensor ever exists. Returns per-token nll and
    lse (B, S), and the gradients (dx (B, S, D), dhead (D, V)) of
    ``mean(nll) + z_loss_coef * mean(lse^2)`` when asked."""
    b, s, d = x.shape
    n = b * s
    xs = x.reshape(b, s // chunk, chunk, d).swapaxes(0, 1)  # (S/c, B, c, D)
    ts = targets.reshape(b, s // chunk, chunk).swapaxes(0, 1)
    with_grads = z_loss_coef is not None
    f32 = jnp.float32
    w = head.astype(x.dtype)  # compute dtype for the matmuls; dhead accumulates in float32
    # dx = dlogits @ head^T contracts over the vocabulary, head's minor axis: a row-major copy
    # of head^T (V x D, once per step) makes it a plain matmul (XLA:CPU: ~1.2x faster)
    w_t = _materialized_transpose(w)

    def body(dhead, xt):
        xc, tc = xt
        logits = jnp.einsum("bcd,dv->bcv", xc, w, preferred_element_type=f32)
        m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        e = jnp.exp(logits - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        lse = (m + jnp.log(total))[..., 0]
        # the target's logit from its row of head^T: (B, c, D) work instead of one more pass
        # over the (B, c, V) logits, and the vocabulary-parallel embedding lookup when the
        # vocabulary is sharded. Its gradient never goes through this gather (no scatter):
        # d/dlogits below uses the one-hot compare, fused into that elementwise pass.
        target_logit = jnp.einsum(
            "bcd,bcd->bc", xc, jnp.take(w_t, tc, axis=0), preferred_element_type=f32
        )
        nll = lse - target_logit
        if not with_grads:
            return dhead, (nll, lse, None)
        hit = jnp.arange(logits.shape[-1]) == tc[..., None]
        p = e / total
        # d/dlogits of mean(nll) + z * mean(lse^2): (p - onehot) / n + 2 z lse p / n
        dlogits = (p * (1.0 + 2.0 * z_loss_coef * lse[..., None]) - hit.astype(f32)) / n
        dlogits = dlogits.astype(xc.dtype)
        dx = jnp.einsum("bcv,vd->bcd", dlogits, w_t, preferred_element_type=f32)
        dhead = dhead + _weight_grad(xc.reshape(-1, d), dlogits.reshape(-1, dlogits.shape[-1]))
        return dhead, (nll, lse, dx.astype(xc.dtype))

    dhead0 = jnp.zeros(head.shape, f32) if with_grads else None
    dhead, (nll, lse, dx) = jax.lax.scan(body, dhead0, (xs, ts))
    nll, lse = nll.swapaxes(0, 1).reshape(b, s), lse.swapaxes(0, 1).reshape(b, s)
    if with_grads:
        dx = dx.swapaxes(0, 1).reshape(b, s, d)
    return nll, lse, dx, dhead


def token_nll(x: Array, head: Array, targets: Array, chunk: int) -> Array:
    """Per-token cross-entropy (B, S) in float32 of hidden states x (B, S, D) under the output
    projection ``head`` (D, V), computed chunk by chunk (forward only: evaluation)."""
    return _xent_chunks(x, head, targets, chunk, None)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_xent(x, head, targets, z_loss_coef, chunk):
    nll, lse, _, _ = _xent_chunks(x, head, targets, chunk, None)
    return jnp.mean(nll) + z_loss_coef * jnp.mean(lse**2), jnp.mean(nll)


def _fused_xent_fwd(x, head, targets, z_loss_coef, chunk):
    nll, lse, dx, dhead = _xent_chunks(x, head, targets, chunk, z_loss_coef)
    out = (jnp.mean(nll) + z_loss_coef * jnp.mean(lse**2), jnp.mean(nll))
    return out, (dx, dhead.astype(head.dtype))


def _fused_xent_bwd(z_loss_coef, chunk, res, g):
    dx, dhead = res
    g_objective, _ = g  # the plain loss is returned under stop_gradient: its cotangent is 0
    return (g_objective * dx).astype(dx.dtype), (g_objective * dhead).astype(dhead.dtype), None


_fused_xent.defvjp(_fused_xent_fwd, _fused_xent_bwd)


def fused_cross_entropy(
    x: Array, head: Array, targets: Array, *, z_loss_coef: float, chunk: int
) -> tuple[Array, Array]:
    """(objective, loss) of hidden states x (B, S, D), output projection ``head`` (D, V) and
    integer targets (B, S): loss = mean cross-entropy (nats), objective = loss + z_loss_coef x
    mean(logsumexp^2). Only the objective is differentiable.

    Equal to the softmax cross-entropy of ``x @ head`` but never materializes the (B, S, V)
    logits: the sequence is processed ``chunk`` positions at a time and, when differentiated,
    each chunk's gradient is computed in the forward pass (the objective is a fixed mean, so its
    cotangent is a scalar that only scales them). Same matmul FLOPs as autodiff, none of its
    (B, S, V) float32 temporaries, and no scatter for the target gather: 3-4x faster on CPU for
    an 8k vocabulary, and it bounds the memory of large-vocabulary heads anywhere."""
    objective, loss = _fused_xent(x, head, targets, float(z_loss_coef), chunk)
    return objective, jax.lax.stop_gradient(loss)


class Batch(NamedTuple):
    """A step's packed windows: ``tokens`` (B, S+1), whose inputs are ``tokens[:, :-1]`` and
    targets ``tokens[:, 1:]``, with the inputs' document ids and within-document positions
    (B, S) from ``segments_and_positions``."""

    tokens: Array
    segments: Array
    positions: Array


def document_batch(tokens: Array, eos_id: int) -> Batch:
    """``Batch`` of packed windows (B, S+1). Steps get it from ``jit_document_batch``."""
    segments, positions = segments_and_positions(tokens[:, :-1], eos_id)
    return Batch(tokens, segments, positions)


def jit_document_batch(eos_id: int, sharding=None):
    """``document_batch`` as a jitted computation of its own, outputs laid out as ``sharding``.

    Not part of the training or evaluation step: inside it, XLA:CPU fuses the last pass of the
    segment ids' cumulative sum into every attention-mask fusion of the unrolled layers, which
    makes the 30m step 1.4x slower. Computed outside, the ids reach the step as a ready array
    (as MaxText's input pipeline hands over segment ids)."""
    return jax.jit(functools.partial(document_batch, eos_id=eos_id), out_shardings=sharding)


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


def unroll_layers(cfg: ModelConfig) -> bool:
    """Whether ``Transformer.hidden`` traces one copy of the layer per layer instead of a scan.

    On XLA:CPU the scan's stacked per-layer residuals are zero-filled and copied in and out
    every step, and no layer's work overlaps another's: unrolled, the 30m step is 1.08x faster
    and the 75m 1.04x, with bit-identical results (docs/benchmarks.md, session 6). On
    accelerators the scan stays the default, as in MaxText and Levanter: unrolled compile time
    grows with depth (8-layer 75m on CPU: 12.9 vs 9.8 s). Decided at trace time, when the
    backend is known."""
    if cfg.layer_loop == "auto":
        return jax.default_backend() == "cpu"
    return cfg.layer_loop == "unroll"


@eqx.filter_jit
def init_model(cfg: ModelConfig, key: Array) -> Transformer:
    """Jitted construction: eager init dispatches thousands of tiny ops (seconds on CPU)."""
    return Transformer(cfg, key)
