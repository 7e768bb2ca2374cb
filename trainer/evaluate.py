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

Benchmarks: ``--tasks piqa,hellaswag,...`` (``trainer/tasks.py``) with ``--task-data DIR``
(the fetched evaluation sets) and ``--tokenizer`` scores each task as lm-evaluation-harness
does (``trainer/scoring.py``): per task ``n``, ``acc``, ``acc_norm`` where the harness reports
it, their standard errors, the chance level, LAMBADA's perplexity, under ``benchmarks`` in the
result; ``--limit`` caps the examples per task and ``--details DIR`` keeps one JSONL of
per-example scores per task. ``--samples N``: greedy completions of N fixed prompts
(``trainer/generate.py``), under ``samples``. Task names, task data and the tokenizer (its
vocabulary against the checkpoint's) are checked before any parameter is loaded.

Writes ``output_dir/eval/step-XXXXXXXXX.json`` (or ``--output``) and prints the same JSON.
Exit codes: 0 ok, 1 failed, 2 invalid config, task, tokenizer or no checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
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
from trainer import distributed as dist
from trainer import hostmem, rundir, vector_width
from trainer.config import ConfigError, TrainConfig, load_config
from trainer.kernels import loss_chunk, token_nll
from trainer.model import Batch, Transformer, jit_document_batch
from trainer.restore import load_params, replicated
from trainer.scoring import perplexity_of
from trainer.tasks import Example, Task, TaskError, load_examples, parse_tasks


def _eval_step(
    params: Transformer, router_bias: Array, batch: Batch, weights, *, dtype, chunk: int
):
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    # the quantile-balancing bias decides expert selection: evaluate with the trained one, as
    # the model was trained and would be served (a zero bias routes differently)
    # a padding row (weight 0) takes no MoE expert capacity from the rows beside it
    valid = jnp.broadcast_to(weights[:, None] > 0, inputs.shape)
    x, _ = params.hidden(inputs, batch.segments, batch.positions, router_bias, dtype, valid)
    nll = token_nll(x, params.head(), targets, chunk)  # never the whole (B, S, V) logits
    return jnp.sum(nll * weights[:, None]), jnp.sum(weights) * targets.shape[1]


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
        router_bias = replicated(np.zeros(shape, np.float32), bias_sharding)
    n_windows = min((store.num_tokens - 1) // seq_len, max(1, max_tokens // seq_len))
    if n_windows < 1:
        raise ValueError(f"{store.root}: fewer than seq_len + 1 = {seq_len + 1} tokens")
    row_sharding = dist.batch_sharding(mesh)
    weight_sharding = dist.NamedSharding(mesh, dist.PartitionSpec(dist.BATCH_AXES))
    chunk = loss_chunk(seq_len, batch_size // dist.data_parallel_size(mesh), store.vocab_size)
    step = jax.jit(
        dist.on_mesh(lambda p, r, b, w: _eval_step(p, r, b, w, dtype=dtype, chunk=chunk), mesh),
        in_shardings=(shardings, bias_sharding, row_sharding, weight_sharding),
    )
    documents = jit_document_batch(store.eos_id, row_sharding)

    def global_array(x: np.ndarray, sharding):
        # every host builds the same (small) eval batch and hands over its own slices
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    # the bytes of every id, once: looked up per predicted token, not asked of sentencepiece
    id_bytes = token_byte_table(tokenizer) if tokenizer is not None else None
    total, count, decoded_bytes = 0.0, 0.0, 0
    for first in range(0, n_windows, batch_size):
        idx = list(range(first, min(first + batch_size, n_windows)))
        rows = np.zeros((batch_size, seq_len + 1), np.int32)
        weights = np.zeros((batch_size,), np.float32)
        for j, w in enumerate(idx):  # padding rows get weight 0
            rows[j] = store.read(w * seq_len, seq_len + 1)
            weights[j] = 1.0
            if id_bytes is not None:  # bytes of exactly the predicted (target) tokens
                decoded_bytes += int(id_bytes[rows[j, 1:]].sum())
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
        "perplexity": perplexity_of(loss),
        "bits_per_byte": bpb,
    }


def token_bytes(tokenizer: Any, token: int) -> int:
    """UTF-8 bytes a sentencepiece token stands for: a byte-fallback token one, a control or
    unknown token (<s>, </s>, <unk>) or an unused one none, the word marker a space. Judged
    by the model's token types, not the piece's spelling: code makes ordinary pieces such as
    ``<>``."""
    if tokenizer.is_byte(token):
        return 1
    if tokenizer.is_control(token) or tokenizer.is_unknown(token) or tokenizer.is_unused(token):
        return 0
    return len(tokenizer.id_to_piece(token).replace("\u2581", " ").encode("utf-8"))


def token_byte_table(tokenizer: Any) -> np.ndarray:
    """``token_bytes`` of every id of the tokenizer's vocabulary: (V,) int64."""
    return np.array([token_bytes(tokenizer, t) for t in range(tokenizer.get_piece_size())])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.evaluate")
    parser.add_argument("--config", help="the training run's config (local path or gs://)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C")
    parser.add_argument("--store", action="append", default=[], help="held-out token store")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--max-tokens", type=int, default=1 << 20)
    parser.add_argument("--batch-size", type=int, default=0, help="default: training batch")
    parser.add_argument("--output", default="", help="result JSON (default output_dir/eval/)")
    parser.add_argument(
        "--tokenizer", default="", help="sentencepiece model (bits-per-byte, tasks)"
    )
    parser.add_argument("--tasks", default="", help="benchmark tasks, comma-separated")
    parser.add_argument("--task-data", default="", help="folder of the evaluation sets")
    parser.add_argument("--limit", type=int, default=0, help="examples per task (0: all)")
    parser.add_argument("--details", default="", help="folder for per-example task results")
    parser.add_argument(
        "--samples",
        type=int,
        default=0,
        help=f"greedy completions of the first N of {len(SAMPLE_PROMPTS)} fixed prompts",
    )
    args = parser.parse_args(argv)
    hostmem.keep_step_memory_warm()  # before any JAX backend starts (CPU runs only)
    vector_width.prefer_host_vector_width()  # likewise (AVX-512 CPUs only)
    try:
        cfg = _load(args)
        stores = args.store or ([] if args.tasks else [s.path for s in cfg.data.eval_sources])
        if not stores and not args.tasks:
            raise ConfigError("data.eval_sources", "no held-out store (config or --store)")
        tokenizer = _tokenizer(args.tokenizer, cfg) if args.tokenizer else None
        if not 0 <= args.samples <= len(SAMPLE_PROMPTS):
            raise ConfigError("samples", f"must be in [0, {len(SAMPLE_PROMPTS)}]")
        benchmarks = _benchmarks(args, cfg, tokenizer)
    except (ConfigError, TaskError, OSError) as e:
        print(f"invalid config: {e}", file=sys.stderr)
        return 2
    try:
        dist.initialize(cfg.distributed)
        mesh = dist.make_mesh(cfg.mesh)
        opened = [TokenStore.open(p) for p in stores]
        _check_tokenizers(cfg, opened)
        batch = args.batch_size or cfg.batch_size
        vocab = opened[0].vocab_size if opened else _checkpoint_vocab(cfg, tokenizer)
        params, router_bias, shardings, step = load_params(
            cfg, vocab, mesh, args.step, batch_size=batch
        )
        dtype = jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32
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
        body: dict[str, Any] = {"step": step, "seq_len": cfg.seq_len, "results": results}
        if benchmarks:
            from trainer.scoring import Scorer

            scorer = Scorer(
                params,
                router_bias,
                shardings,
                mesh,
                batch_size=batch,
                max_len=cfg.seq_len,
                dtype=dtype,
                fixed_length=params.cfg.moe is not None,
            )
            body["benchmarks"] = _run_benchmarks(scorer, tokenizer, benchmarks, args.details)
        if args.samples:
            body["samples"] = _samples(params, tokenizer, args.samples, dtype)
    except ConfigError as e:
        print(f"invalid config: {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        return 1
    text = json.dumps(body, indent=2) + "\n"
    print(text, end="")
    if jax.process_index() == 0:
        out = args.output or rundir.eval_path(cfg.output_dir, step)
        _write_text(out, text)
    return 0


def _write_text(path: str, text: str) -> None:
    fs, local = fsspec.core.url_to_fs(path)
    fs.makedirs(local.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(local, "w") as f:
        f.write(text)


def _check_tokenizers(cfg: TrainConfig, stores: list[TokenStore]) -> None:
    """Every store was made with the tokenizer the model was trained on (its ledger's hash
    against the run's ``config.json``): the same vocabulary size is not the same pieces."""
    trained = rundir.trained_tokenizer_sha256(cfg.output_dir)
    for store in stores:
        if trained and store.ledger.tokenizer_sha256 != trained:
            raise ConfigError(
                "store",
                f"{store.root} was tokenized with {store.ledger.tokenizer_sha256[:12]}, the model "
                f"was trained on stores of {trained[:12]}: not its tokenizer",
            )


def _tokenizer(path: str, cfg: TrainConfig | None = None):
    """The sentencepiece model at ``path``; refused when the run's ``config.json`` names
    another tokenizer (by sha256) for its training stores."""
    import sentencepiece as spm

    try:
        with fsspec.open(path, "rb") as f:
            data = f.read()
        trained = rundir.trained_tokenizer_sha256(cfg.output_dir) if cfg else None
        if trained and hashlib.sha256(data).hexdigest() != trained:
            raise ConfigError(
                "tokenizer",
                f"{path} (sha256 {hashlib.sha256(data).hexdigest()[:12]}) is not the tokenizer "
                f"of the model's training stores ({trained[:12]})",
            )
        return spm.SentencePieceProcessor(model_proto=data)
    except FileNotFoundError as e:
        raise ConfigError("tokenizer", f"no sentencepiece model at {path}") from e
    except RuntimeError as e:  # sentencepiece's parse error
        raise ConfigError("tokenizer", f"{path} is not a sentencepiece model: {e}") from e


def _checkpoint_vocab(cfg: TrainConfig, tokenizer) -> int:
    vocab = rundir.trained_vocab_size(cfg.output_dir) or cfg.model.vocab_size
    if not vocab and tokenizer is not None:
        vocab = tokenizer.get_piece_size()
    if not vocab:
        raise ConfigError("model.vocab_size", "unknown: no store, no run config.json")
    return vocab


def _benchmarks(args, cfg: TrainConfig, tokenizer) -> list[tuple[Task, list[Example]]]:
    """The tasks and their examples, every input checked before any compute."""
    if not args.tasks:
        return []
    tasks = parse_tasks(args.tasks)
    if tokenizer is None:
        raise ConfigError("tokenizer", "--tasks needs --tokenizer (the run's sentencepiece model)")
    if not args.task_data:
        raise ConfigError("task_data", "--tasks needs --task-data (the evaluation sets' folder)")
    trained = rundir.trained_vocab_size(cfg.output_dir)
    pieces = tokenizer.get_piece_size()
    # A model may have more embedding rows than pieces (model.vocab_size set larger: padding
    # the trainer allows); never fewer, and a size the config did not ask for is another
    # tokenizer's.
    padded = bool(cfg.model.vocab_size) and cfg.model.vocab_size == trained and pieces < trained
    if trained is not None and trained != pieces and not padded:
        raise ConfigError(
            "tokenizer",
            f"{args.tokenizer} has {pieces} pieces but the checkpoint's model was trained with "
            f"a vocabulary of {trained}: not its tokenizer",
        )
    if args.limit < 0:
        raise ConfigError("limit", "must be >= 0")
    return [(t, load_examples(t, args.task_data, args.limit or None)) for t in tasks]


# Fixed prompts for the run's samples, one per kind of text the demo mixture holds (prose,
# reference, aphorism, code, email): the same prompts every run, so runs compare side by side.
SAMPLE_PROMPTS = (
    "The history of the city",
    "The economy of the country is based on",
    "A fool and his money",
    "def read_config(path):\n",
    "Dear friend, I am writing to",
)
SAMPLE_TOKENS = 32


def _samples(params: Transformer, tokenizer, n: int, dtype) -> dict[str, Any]:
    """Greedy completions of the first ``n`` fixed prompts, or why there are none."""
    from trainer.generate import GenerateError, generate_text

    if tokenizer is None:
        return {"skipped": "no --tokenizer to encode the prompts"}
    if jax.process_count() > 1:  # the sampler runs on one process's devices
        return {"skipped": "samples are drawn in single-process evaluations only"}
    try:
        records = generate_text(
            params, tokenizer, SAMPLE_PROMPTS[:n], max_new_tokens=SAMPLE_TOKENS, dtype=dtype
        )
    except GenerateError as e:  # an MoE model: its routing cannot decode a token at a time
        return {"skipped": str(e)}
    return {
        "decoding": f"greedy, up to {SAMPLE_TOKENS} tokens",
        "completions": [{k: r[k] for k in ("prompt", "completion", "stopped")} for r in records],
    }


def _run_benchmarks(scorer, tokenizer, benchmarks, details: str) -> dict[str, Any]:
    from trainer.scoring import evaluate_task

    encode = tokenizer.encode  # plain ids: no BOS, as the documents were encoded
    out: dict[str, Any] = {}
    for task, examples in benchmarks:
        metrics, rows = evaluate_task(scorer, encode, task, examples)
        out[task.name] = metrics
        if details and jax.process_index() == 0:
            lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
            _write_text(rundir.join(details, f"{task.name}.jsonl"), lines)
    return out


def _load(args) -> TrainConfig:
    cfg = load_config(args.config, args.overrides, require_data=False)
    if not cfg.output_dir:
        raise ConfigError("output_dir", "is required (where the checkpoints are)")
    return cfg


if __name__ == "__main__":
    sys.exit(main())
