"""Evaluation entrypoint: ``python -m trainer.evaluate --config FILE_OR_GS_URI [options]``.

Loads the parameters of a training run's checkpoint (the latest complete one under
``output_dir/checkpoints``, or ``--step``) and reports, for each held-out token store
(``data.eval_sources`` of the config, or ``--store PATH`` repeated):

- ``loss``: mean next-token cross-entropy in nats over non-overlapping ``seq_len`` windows read
  in order from the start of the store (``--max-tokens`` caps how many; packed documents are
  masked from each other exactly as in training);
- ``perplexity`` = exp(loss);
- ``bits_per_byte`` = total nats / ln 2 / UTF-8 bytes of the predicted tokens. Bytes come from
  the pieces of the evaluated target tokens with ``--tokenizer MODEL`` (a sentencepiece model),
  else from the ledger's ``metadata.num_bytes`` (bytes per token averaged over the store); null
  when neither is available.

Writes ``output_dir/eval/step-XXXXXXXXX.json`` (or ``--output``) and prints the same JSON.
Exit codes: 0 ok, 1 failed, 2 invalid config or no checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from typing import Any

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from tokenstore import TokenStore
from trainer import checkpoint as ckpt
from trainer import distributed as dist
from trainer import hostmem, rundir
from trainer.config import ConfigError, TrainConfig, load_config, resolve_model
from trainer.kernels import loss_chunk, token_nll
from trainer.model import Batch, Transformer, jit_document_batch

ROUTER_BIAS = "router_bias"  # TrainState.router_bias's leaf in a checkpoint


def _eval_step(
    params: Transformer, router_bias: Array, batch: Batch, weights, *, dtype, chunk: int
):
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    # the quantile-balancing bias decides expert selection: evaluate with the trained one, as
    # the model was trained and would be served (a zero bias routes differently)
    x, _ = params.hidden(inputs, batch.segments, batch.positions, router_bias, dtype)
    nll = token_nll(x, params.head(), targets, chunk)  # never the whole (B, S, V) logits
    return jnp.sum(nll * weights[:, None]), jnp.sum(weights) * targets.shape[1]


def load_params(
    cfg: TrainConfig,
    vocab_size: int,
    mesh,
    step: int | None = None,
    *,
    batch_size: int | None = None,
) -> tuple[Transformer, Array, Any, int]:
    """(parameters, router bias, parameter shardings, step) of checkpoint ``step`` (default the
    latest). Only ``params.*`` and ``router_bias`` are read, not the optimizer state.
    ``batch_size`` (default the training batch) sizes the MoE routing groups: each device's
    rows of an evaluation batch are one group, as in training. The router bias is the
    checkpointed quantile-balancing bias; zeros for a dense model or a checkpoint without one."""
    dp = dist.data_parallel_size(mesh)
    tokens_per_device = (batch_size or cfg.batch_size) // dp * cfg.seq_len
    mcfg = resolve_model(cfg.model, vocab_size=vocab_size, tokens_per_device=tokens_per_device)
    root = rundir.checkpoints_dir(cfg.output_dir)
    step = ckpt.latest_step(root) if step is None else step
    if step is None:
        raise ConfigError("output_dir", f"no complete checkpoint under {root}")
    abstract = jax.eval_shape(lambda k: Transformer(mcfg, k), jax.random.key(0))
    shardings = dist.param_shardings(abstract, mesh)
    target = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    checkpointer = ckpt.Checkpointer(root, process_index=0, process_count=1)
    params = checkpointer.restore(step, target, prefix="params.")
    n_experts = mcfg.moe.num_experts if mcfg.moe else 0
    bias_target = jax.ShapeDtypeStruct(
        (mcfg.num_layers, n_experts), jnp.float32, sharding=dist.replicated(mesh)
    )
    if n_experts and ckpt.has_array(root, step, ROUTER_BIAS):
        router_bias = checkpointer.restore(step, bias_target, prefix=ROUTER_BIAS)
    else:  # dense model (nothing to bias), or a checkpoint written without the bias
        router_bias = _replicated(np.zeros(bias_target.shape, np.float32), bias_target.sharding)
    checkpointer.close()
    return params, router_bias, shardings, step


def _replicated(x: np.ndarray, sharding) -> Array:
    """A host array (the same on every process) laid out as ``sharding``, each process handing
    over the pieces its devices hold, as the evaluation batches are built."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def evaluate_store(
    params,
    shardings,
    mesh,
    store: TokenStore,
    *,
    seq_len: int,
    batch_size: int,
    max_tokens: int,
    dtype,
    tokenizer=None,
    router_bias: Array | None = None,
) -> dict:
    """Metrics of one store (see the module docstring). ``router_bias`` (layers, experts): the
    MoE selection bias, from ``load_params``; None = zeros."""
    bias_sharding = dist.replicated(mesh)
    if router_bias is None:
        m = params.cfg.moe
        shape = (params.cfg.num_layers, m.num_experts if m else 0)
        router_bias = _replicated(np.zeros(shape, np.float32), bias_sharding)
    n_windows = min((store.num_tokens - 1) // seq_len, max(1, max_tokens // seq_len))
    if n_windows < 1:
        raise ValueError(f"{store.root}: fewer than seq_len + 1 = {seq_len + 1} tokens")
    row_sharding = dist.batch_sharding(mesh)
    weight_sharding = dist.NamedSharding(mesh, dist.PartitionSpec(dist.BATCH_AXES))
    chunk = loss_chunk(seq_len, batch_size // dist.data_parallel_size(mesh), store.vocab_size)
    step = jax.jit(
        lambda p, r, b, w: _eval_step(p, r, b, w, dtype=dtype, chunk=chunk),
        in_shardings=(shardings, bias_sharding, row_sharding, weight_sharding),
    )
    documents = jit_document_batch(store.eos_id, row_sharding)

    def global_array(x: np.ndarray, sharding):
        # every host builds the same (small) eval batch and hands over its own slices
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    total, count, decoded_bytes = 0.0, 0.0, 0
    for first in range(0, n_windows, batch_size):
        idx = list(range(first, min(first + batch_size, n_windows)))
        rows = np.zeros((batch_size, seq_len + 1), np.int32)
        weights = np.zeros((batch_size,), np.float32)
        for j, w in enumerate(idx):  # padding rows get weight 0
            rows[j] = store.read(w * seq_len, seq_len + 1)
            weights[j] = 1.0
            if tokenizer is not None:  # bytes of exactly the predicted (target) tokens
                pieces = [tokenizer.id_to_piece(int(t)) for t in rows[j, 1:]]
                decoded_bytes += sum(_piece_bytes(p) for p in pieces)
        batch = documents(global_array(rows, row_sharding))
        s, c = step(params, router_bias, batch, global_array(weights, weight_sharding))
        total += float(s)
        count += float(c)
    loss = total / count
    num_bytes = store.ledger.metadata.get("num_bytes")
    bpb = None
    if tokenizer is not None:
        bpb = total / math.log(2) / max(decoded_bytes, 1)
    elif num_bytes:
        bytes_covered = count * num_bytes / store.num_tokens
        bpb = total / math.log(2) / bytes_covered
    return {
        "store": store.root,
        "tokens": int(count),
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": bpb,
    }


def _piece_bytes(piece: str) -> int:
    """UTF-8 bytes a sentencepiece piece stands for: byte-fallback pieces (<0xAB>) are one
    byte, control pieces (<s>, </s>, <unk>) none, the word marker a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return 1
    if piece.startswith("<") and piece.endswith(">"):
        return 0
    return len(piece.replace("\u2581", " ").encode("utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.evaluate")
    parser.add_argument("--config", help="the training run's config (local path or gs://)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C")
    parser.add_argument("--store", action="append", default=[], help="held-out token store")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--max-tokens", type=int, default=1 << 20)
    parser.add_argument("--batch-size", type=int, default=0, help="default: training batch")
    parser.add_argument("--output", default="", help="result JSON (default output_dir/eval/)")
    parser.add_argument("--tokenizer", default="", help="sentencepiece model for bits-per-byte")
    args = parser.parse_args(argv)
    hostmem.keep_step_memory_warm()  # before any JAX backend starts (CPU runs only)
    try:
        cfg = _load(args)
        stores = args.store or [s.path for s in cfg.data.eval_sources]
        if not stores:
            raise ConfigError("data.eval_sources", "no held-out store (config or --store)")
    except (ConfigError, OSError) as e:
        print(f"invalid config: {e}", file=sys.stderr)
        return 2
    try:
        dist.initialize(cfg.distributed)
        mesh = dist.make_mesh(cfg.mesh)
        opened = [TokenStore.open(p) for p in stores]
        batch = args.batch_size or cfg.batch_size
        params, router_bias, shardings, step = load_params(
            cfg, opened[0].vocab_size, mesh, args.step, batch_size=batch
        )
        dtype = jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32
        tokenizer = None
        if args.tokenizer:
            import sentencepiece as spm

            with fsspec.open(args.tokenizer, "rb") as f:
                tokenizer = spm.SentencePieceProcessor(model_proto=f.read())
        results = [
            evaluate_store(
                params,
                shardings,
                mesh,
                s,
                seq_len=cfg.seq_len,
                batch_size=batch,
                max_tokens=args.max_tokens,
                dtype=dtype,
                tokenizer=tokenizer,
                router_bias=router_bias,
            )
            for s in opened
        ]
    except ConfigError as e:
        print(f"invalid config: {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        return 1
    body = {"step": step, "seq_len": cfg.seq_len, "results": results}
    text = json.dumps(body, indent=2) + "\n"
    print(text, end="")
    if jax.process_index() == 0:
        out = args.output or rundir.eval_path(cfg.output_dir, step)
        fs, path = fsspec.core.url_to_fs(out)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(path, "w") as f:
            f.write(text)
    return 0


def _load(args) -> TrainConfig:
    cfg = load_config(args.config, args.overrides, require_data=False)
    if not cfg.output_dir:
        raise ConfigError("output_dir", "is required (where the checkpoints are)")
    return cfg


if __name__ == "__main__":
    sys.exit(main())
