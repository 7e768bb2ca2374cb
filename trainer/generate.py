"""Sampling from a checkpoint with a KV cache: ``python -m trainer.generate``.

    python -m trainer.generate --config FILE [--set a.b=c ...] [--step N] --tokenizer SPM \\
        --prompts FILE|- [--max-new-tokens 64] [--temperature 0] [--top-p 1.0] [--seed 0] \\
        [--batch-size 8] [--output FILE]

Prompts: one per line, or JSON lines with a ``"prompt"`` field (blank lines skipped). Each is
encoded as documents were in training, without BOS (an empty prompt starts from EOS, the token
a document follows in a packed window). Output: one JSON line per prompt (``prompt``,
``completion`` text, ``token_ids`` of the completion, ``stopped``: ``eos`` or ``length``), to
``--output`` or stdout. Greedy with ``--temperature 0`` (the default), else temperature and
nucleus (``--top-p``) sampling, seeded with ``jax.random`` (the same seed and prompts give the
same samples). Generation stops at EOS (kept as the last token id, not in the text) or after
``--max-new-tokens``.

Why here and not in ``trainer/model.py``: the model's forward is the training path (packed
documents, blocked attention over whole windows); decoding needs attention against a cache.
The cached forward below reuses the model's own weights and pieces (``Attention.wq/wk/wv/wo``,
``rotary``, ``RMSNorm``, ``MLP``) and is checked against the full forward: greedy decoding
with the cache gives exactly the tokens of argmax over ``Transformer.__call__`` step by step
(tests/unit/test_export.py), and transformers' greedy ``generate`` on the exported model
(tests/parity/).

How it runs: the prompts of a batch are left-padded to a common length P (rounded up to a
multiple of 16, so a few shapes serve many prompts) and the cache holds P + max_new_tokens
slots per layer: (layers, B, P + N, kv heads, head_dim) for keys and for values. Row b's
tokens sit at slots ``offset_b ..``, its RoPE position is ``slot - offset_b`` and a query sees
the slots from ``offset_b`` up to its own. One jitted prefill writes the prompts' keys and
values, then one jitted decode step per token (static shapes; the slot is a traced scalar)
feeds the last token at the next slot. Mixture-of-experts models are refused: their routing
takes top-k with a per-group capacity over all the tokens of a call, which a token-at-a-time
cache cannot reproduce (see docs/export.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from trainer.config import ConfigError, TrainConfig, load_config
from trainer.model import MLP, Block, Transformer, rotary

PROMPT_MULTIPLE = 16  # prompt lengths are padded up to a multiple of this (fewer compilations)
MASKED = -1e30  # finite: a padding query that sees nothing averages instead of giving NaN

MOE_REFUSAL = (
    "model.moe: generation does not support mixture-of-experts models: their routing picks "
    "top-k experts with a capacity per group of tokens, which decoding one token at a time "
    "with a cache would not reproduce"
)


class GenerateError(ValueError):
    """Nothing to generate from (MoE model, bad prompts); nothing has been computed."""


# ---------------------------------------------------------------------------------------------
# the cached forward


def _layer(
    block: Block,
    x: Array,
    k_cache: Array,
    v_cache: Array,
    start: Array,
    positions: Array,
    visible: Array,
) -> tuple[Array, Array, Array]:
    """One decoder block over new tokens x (B, S, D) at cache slots ``start .. start+S-1``:
    writes their keys and values into k_cache, v_cache (B, T, K, hd) and attends over the
    slots ``visible`` (B, S, T) marks. positions: (B, S) RoPE positions. Same math as
    ``Block.__call__``: pre-norm, rotary q/k, softmax in float32, GQA head h -> kv h // (H/K)."""
    attn = block.attn
    dt = x.dtype
    b, s, d = x.shape
    h = block.attn_norm(x)
    q = jnp.einsum("bsd,dhk->bshk", h, attn.wq.astype(dt))
    k = jnp.einsum("bsd,dhk->bshk", h, attn.wk.astype(dt))
    v = jnp.einsum("bsd,dhk->bshk", h, attn.wv.astype(dt))
    q = rotary(q, positions, attn.rope_theta)
    k = rotary(k, positions, attn.rope_theta)
    zero = jnp.zeros((), start.dtype)
    k_cache = jax.lax.dynamic_update_slice(
        k_cache, k.astype(k_cache.dtype), (zero, start, zero, zero)
    )
    v_cache = jax.lax.dynamic_update_slice(
        v_cache, v.astype(v_cache.dtype), (zero, start, zero, zero)
    )
    heads, kv_heads, hd = attn.num_heads, attn.num_kv_heads, q.shape[-1]
    qg = q.reshape(b, s, kv_heads, heads // kv_heads, hd)
    scores = jnp.einsum(
        "bskgd,btkd->bkgst", qg, k_cache.astype(dt), preferred_element_type=jnp.float32
    ) / math.sqrt(hd)
    scores = jnp.where(visible[:, None, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v_cache.astype(dt)).reshape(b, s, heads * hd)
    x = x + jnp.einsum("bse,ed->bsd", out, attn.wo.astype(dt).reshape(heads * hd, d))
    assert isinstance(block.mlp, MLP), MOE_REFUSAL
    return x + block.mlp(block.mlp_norm(x)), k_cache, v_cache


def cached_forward(
    params: Transformer,
    tokens: Array,
    caches: tuple[Array, Array],
    start: Array,
    offsets: Array,
    dtype: Any = jnp.float32,
) -> tuple[Array, tuple[Array, Array]]:
    """tokens (B, S) at cache slots ``start .. start+S-1``; caches (keys, values), each
    (layers, B, T, K, hd); offsets (B,): each row's first slot -> float32 logits (B, S, V) and
    the updated caches."""
    k_all, v_all = caches
    t = k_all.shape[2]
    s = tokens.shape[1]
    slots = start + jnp.arange(s, dtype=start.dtype)  # (S,)
    positions = slots[None, :] - offsets[:, None]  # (B, S)
    keys = jnp.arange(t, dtype=start.dtype)
    visible = (keys[None, None, :] <= slots[None, :, None]) & (
        keys[None, None, :] >= offsets[:, None, None]
    )  # (B, S, T)
    x = jnp.take(params.embed, tokens, axis=0).astype(dtype)
    layer_params, static = _split_layers(params)

    def body(h, xs):
        p, kc, vc = xs
        h, kc, vc = _layer(static(p), h, kc, vc, start, positions, visible)
        return h, (kc, vc)

    x, (k_all, v_all) = jax.lax.scan(body, x, (layer_params, k_all, v_all))
    x = params.final_norm(x)
    logits = jnp.einsum(
        "bsd,dv->bsv", x, params.head().astype(dtype), preferred_element_type=jnp.float32
    )
    return logits, (k_all, v_all)


def _split_layers(params: Transformer):
    import equinox as eqx

    p, static = eqx.partition(params.layers, eqx.is_array)
    return p, lambda leaves: eqx.combine(leaves, static)


def pick(logits: Array, key: Array, temperature: Array, top_p: Array, greedy: bool) -> Array:
    """Next token per row from float32 logits (B, V) -> (B,) int32: argmax when ``greedy``,
    else a sample at ``temperature`` from the smallest set of tokens whose probability reaches
    ``top_p`` (nucleus; ties at the cut are kept)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / temperature
    probs = jax.nn.softmax(scaled, axis=-1)
    ordered = jnp.sort(probs, axis=-1)[:, ::-1]
    before = jnp.cumsum(ordered, axis=-1) - ordered  # mass of the more likely tokens
    kept = jnp.where(before < top_p, ordered, jnp.inf)
    cutoff = jnp.min(kept, axis=-1, keepdims=True)  # the least likely token still in the set
    masked = jnp.where(probs >= cutoff, scaled, -jnp.inf)
    return jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("greedy", "dtype"))
def _prefill(params, tokens, caches, offsets, key, temperature, top_p, *, greedy, dtype):
    logits, caches = cached_forward(params, tokens, caches, jnp.int32(0), offsets, dtype)
    return pick(logits[:, -1], key, temperature, top_p, greedy), caches


@functools.partial(jax.jit, static_argnames=("greedy", "dtype"), donate_argnums=(2,))
def _decode(params, token, caches, slot, offsets, key, temperature, top_p, *, greedy, dtype):
    logits, caches = cached_forward(params, token[:, None], caches, slot, offsets, dtype)
    return pick(logits[:, -1], key, temperature, top_p, greedy), caches


# ---------------------------------------------------------------------------------------------
# the library function


def generate(
    params: Transformer,
    prompts_token_ids: Sequence[Sequence[int]],
    *,
    eos_id: int,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 8,
    dtype: Any = jnp.float32,
) -> list[list[int]]:
    """The new token ids of each prompt: up to ``max_new_tokens``, ending at the first EOS
    (included) if one comes. ``temperature`` 0 is greedy. Prompts are token ids without BOS; an
    empty one starts from ``[eos_id]``. Deterministic for a given ``seed``, prompts and
    ``batch_size`` (the batch a prompt shares decides its random stream)."""
    if params.cfg.moe is not None:
        raise GenerateError(MOE_REFUSAL)
    if max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise GenerateError(f"need temperature >= 0 and 0 < top_p <= 1 ({temperature}, {top_p})")
    prompts = [list(p) if len(p) else [eos_id] for p in prompts_token_ids]
    out: list[list[int]] = []
    for first in range(0, len(prompts), batch_size):
        key = jax.random.fold_in(jax.random.key(seed), first)
        out += _generate_batch(
            params,
            prompts[first : first + batch_size],
            eos_id=eos_id,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            key=key,
            dtype=dtype,
        )
    return out


def _generate_batch(
    params: Transformer,
    prompts: list[list[int]],
    *,
    eos_id: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    key: Array,
    dtype: Any,
) -> list[list[int]]:
    cfg = params.cfg
    b = len(prompts)
    p = -(-max(len(x) for x in prompts) // PROMPT_MULTIPLE) * PROMPT_MULTIPLE
    tokens = np.full((b, p), eos_id, np.int32)  # left padding (never attended to)
    offsets = np.zeros((b,), np.int32)
    for i, x in enumerate(prompts):
        offsets[i] = p - len(x)
        tokens[i, offsets[i] :] = x
    shape = (cfg.num_layers, b, p + max_new_tokens, cfg.num_kv_heads, cfg.head_dim)
    caches = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    greedy = temperature == 0
    temp = jnp.float32(temperature if not greedy else 1.0)
    nucleus = jnp.float32(top_p)
    offsets_j = jnp.asarray(offsets)
    token, caches = _prefill(
        params,
        jnp.asarray(tokens),
        caches,
        offsets_j,
        jax.random.fold_in(key, 0),
        temp,
        nucleus,
        greedy=greedy,
        dtype=dtype,
    )
    steps = [np.asarray(token)]
    for i in range(1, max_new_tokens):
        if all((np.stack(steps) == eos_id).any(axis=0)):
            break  # every row has stopped
        token, caches = _decode(
            params,
            token,
            caches,
            jnp.int32(p + i - 1),
            offsets_j,
            jax.random.fold_in(key, i),
            temp,
            nucleus,
            greedy=greedy,
            dtype=dtype,
        )
        steps.append(np.asarray(token))
    drawn = np.stack(steps, axis=1)  # (B, steps)
    out = []
    for row in drawn.tolist():
        out.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return out


def generate_text(
    params: Transformer, tokenizer: Any, prompts: Sequence[str], **kwargs: Any
) -> list[dict[str, Any]]:
    """``generate`` on text with a sentencepiece processor: one record per prompt (prompt,
    completion text without EOS, token_ids of the completion, stopped: eos or length). For the
    evaluation's samples and the CLI."""
    eos = tokenizer.eos_id()
    ids = generate(params, [tokenizer.encode(p) for p in prompts], eos_id=eos, **kwargs)
    records = []
    for prompt, new in zip(prompts, ids, strict=True):
        stopped = bool(new) and new[-1] == eos
        text = tokenizer.decode(new[:-1] if stopped else new)
        records.append(
            {
                "prompt": prompt,
                "completion": text,
                "token_ids": new,
                "stopped": "eos" if stopped else "length",
            }
        )
    return records


# ---------------------------------------------------------------------------------------------
# command line


def read_prompts(text: str) -> list[str]:
    """One prompt per line, or JSON lines with a "prompt" field; blank lines skipped."""
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                body = json.loads(line)
            except ValueError:
                body = None
            if isinstance(body, dict):
                if not isinstance(body.get("prompt"), str):
                    raise GenerateError(f"prompts line {n}: a JSON line needs a string 'prompt'")
                prompts.append(body["prompt"])
                continue
        prompts.append(line)
    return prompts


def _check(cfg: TrainConfig, step: int | None, tokenizer_path: str):
    """Refusals from files alone: MoE, missing checkpoint, tokenizer vs checkpoint vocabulary.
    -> (checkpoint step, embedding rows, tokenizer bytes)."""
    from trainer.export import ExportError, resolve_checkpoint

    if cfg.model.moe is not None:
        raise GenerateError(MOE_REFUSAL)
    try:
        step, _, vocab = resolve_checkpoint(cfg, step)
        with fsspec.open(tokenizer_path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise GenerateError(f"tokenizer: no file at {tokenizer_path}") from None
    except ExportError as e:
        raise GenerateError(str(e)) from None
    return step, vocab, data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.generate")
    parser.add_argument("--config", required=True, help="the training run's config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--tokenizer", required=True, help="the run's sentencepiece model")
    parser.add_argument("--prompts", required=True, help="prompts file (local, gs://) or -")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--output", default="", help="JSONL output (default stdout)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, require_data=False)
        step, vocab, model_bytes = _check(cfg, args.step, args.tokenizer)
        if args.prompts == "-":
            text = sys.stdin.read()
        else:
            with fsspec.open(args.prompts, "r", encoding="utf-8") as f:
                text = f.read()
        prompts = read_prompts(text)
        if not prompts:
            raise GenerateError(f"no prompts in {args.prompts}")
        import sentencepiece as spm

        try:
            tokenizer = spm.SentencePieceProcessor(model_proto=model_bytes)
        except RuntimeError as e:  # sentencepiece's parse error
            raise GenerateError(f"tokenizer: {args.tokenizer} is not a sentencepiece model") from e
        if tokenizer.vocab_size() != vocab:
            # A model padded past its tokenizer could sample an id no piece decodes.
            raise GenerateError(
                f"tokenizer: vocabulary size {tokenizer.vocab_size()} ({args.tokenizer}) does "
                f"not match the checkpoint's {vocab} embedding rows (generation needs a piece "
                "for every row)"
            )
        if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
            raise GenerateError("need --max-new-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1")
        longest = max(len(tokenizer.encode(p)) for p in prompts) + args.max_new_tokens
        if longest > cfg.seq_len:
            print(
                f"warning: a prompt and its new tokens reach {longest} positions, past the "
                f"{cfg.seq_len} the model was trained on (seq_len): the positions after "
                "them were never trained",
                file=sys.stderr,
            )
    except (ConfigError, GenerateError, OSError) as e:
        print(f"cannot generate: {e}", file=sys.stderr)
        return 2
    try:
        from trainer import distributed as dist
        from trainer.restore import load_params

        dist.initialize(cfg.distributed)
        mesh = dist.make_mesh(cfg.mesh)
        params, _, _, _ = load_params(cfg, vocab, mesh, step)
        dtype = jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32
        records = generate_text(
            params,
            tokenizer,
            prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            batch_size=args.batch_size,
            dtype=dtype,
        )
    except Exception:
        traceback.print_exc()
        return 1
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if args.output:
        with fsspec.open(args.output, "w", encoding="utf-8") as f:
            f.write(lines)
    else:
        sys.stdout.write(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
