"""Hugging Face export: ``python -m trainer.export --config FILE --tokenizer SPM --out DIR``.

Writes one checkpoint of a dense training run as a folder that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads as ``LlamaForCausalLM`` and
``AutoTokenizer.from_pretrained(DIR)`` loads as a fast tokenizer that encodes text exactly as
the run's sentencepiece model does, so a trained model can be evaluated, served or shared with
the rest of the ecosystem without our code::

    DIR/  (local or gs://, through fsspec)
        config.json             LlamaConfig: shapes, rope_theta, norm eps, special ids
        generation_config.json  bos/eos/pad ids (greedy by default)
        model.safetensors       the weights under the Llama names, nn.Linear layout (out, in),
                                float32 (or --dtype bfloat16); past --max-shard-size (5GB) as
                                model-0000k-of-0000n.safetensors + model.safetensors.index.json
        tokenizer.json          the sentencepiece BPE model as a `tokenizers` pipeline
        tokenizer.model         the sentencepiece model itself (copied byte for byte)
        tokenizer_config.json   no BOS/EOS added, special tokens named
        special_tokens_map.json
        README.md
        slipway_export.json     provenance: checkpoint, step, tokenizer sha256, our config,
                                every other file's sha256 (written last)

Layout mapping (ours: raw arrays ``(in, ..., out)`` stacked over layers; theirs: ``(out, in)``):
``embed`` (V, D) -> ``model.embed_tokens.weight``; ``attn.wq`` (D, H, hd) -> ``q_proj``
(H*hd, D), ``wk``/``wv`` (D, K, hd) -> ``k_proj``/``v_proj`` (K*hd, D), ``wo`` (H, hd, D) ->
``o_proj`` (D, H*hd); ``mlp.w_gate``/``w_up`` (D, F) -> ``gate_proj``/``up_proj`` (F, D),
``w_down`` (F, D) -> ``down_proj`` (D, F); ``attn_norm``/``mlp_norm`` -> ``input_layernorm``/
``post_attention_layernorm``; ``final_norm`` -> ``model.norm``; ``lm_head`` (D, V) ->
``lm_head.weight`` (V, D), left out when tied. Our rotary rotates the halves (x[i], x[i+hd/2])
as transformers' ``rotate_half`` does, and query head h reads kv head h // (H/K) as its
``repeat_kv`` does, so no head is permuted (the parity tests check logits, not this comment).

The tokenizer files come from ``trainer/hf_tokenizer.py``: the sentencepiece model read
without protobuf and written as a ``tokenizers`` pipeline that encodes exactly as it does.

Refused before anything is computed (exit 2, the message names the problem): a missing
checkpoint, a tokenizer whose vocabulary is not the checkpoint's embedding rows, a tokenizer
feature the export cannot reproduce, and mixture-of-experts models (see ``check_exportable``).

Deterministic: the same checkpoint and tokenizer give byte-identical files (no timestamps, the
output folder's own path is recorded nowhere). Host memory: the parameters once, plus one
shard in flight (about three times its size: the converted tensors, safetensors' buffer and
its copy as bytes), written before the next is built. An earlier export in ``--out`` loses its
provenance and weight files first, so no stale weights are left beside the new ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import fsspec
import ml_dtypes
import numpy as np

from trainer import rundir
from trainer.config import ConfigError, TrainConfig, load_config, to_dict
from trainer.export_files import PROVENANCE, SINGLE_WEIGHTS, WEIGHT_SHARD, WEIGHTS_INDEX
from trainer.hf_tokenizer import (
    SentencePieceModel,
    UnexportableTokenizer,
    check_tokenizer,
    parse_sentencepiece,
    tokenizer_files,
)

EMBED_ARRAY = "params.embed"  # the embedding's leaf in a checkpoint (trainer/checkpoint.py)


class ExportError(ValueError):
    """A checkpoint or tokenizer that cannot be exported; nothing has been computed."""


# ---------------------------------------------------------------------------------------------
# checks (cheap: files only)


@dataclass(frozen=True)
class Source:
    """The checkpoint to export, resolved and checked."""

    cfg: TrainConfig
    step: int
    checkpoint: str  # its folder
    vocab_size: int  # the checkpoint's embedding rows
    tokenizer: SentencePieceModel
    tokenizer_bytes: bytes


MOE_REFUSAL = (
    "model.moe: mixture-of-experts models are not exported: ours is top-k routing with a "
    "quantile-balancing selection bias (added to the router logits, softmax weights over the "
    "chosen experts, a capacity per routing group) plus one always-on shared expert; no "
    "transformers architecture routes the same way (Mixtral and Qwen-MoE have no selection "
    "bias; DeepSeek-V3 adds its bias to sigmoid scores and weights by normalized sigmoids), so "
    "the exported model would not compute this one's outputs"
)


def _array_shape(checkpoint: str, key: str) -> list[int] | None:
    """The shape of one checkpoint leaf from its zarr3 metadata (no data read)."""
    try:
        with fsspec.open(f"{checkpoint}/arrays/{key}/zarr.json", "r") as f:
            return list(json.load(f)["shape"])
    except (FileNotFoundError, KeyError, ValueError):
        return None


def resolve_checkpoint(cfg: TrainConfig, step: int | None = None) -> tuple[int, str, int]:
    """(step, folder, embedding rows) of the run's checkpoint ``step`` (default the latest
    complete one), from the files alone; ExportError when there is none."""
    if not cfg.output_dir:
        raise ConfigError("output_dir", "is required (where the checkpoints are)")
    root = rundir.checkpoints_dir(cfg.output_dir)
    committed = [s for s, _ in rundir.committed_steps(root)]
    if not committed:
        raise ExportError(f"checkpoint: no complete checkpoint under {root}")
    if step is None:
        step = committed[-1]
    elif step not in committed:
        raise ExportError(
            f"checkpoint: step {step} does not exist under {root} (complete ones: {committed})"
        )
    checkpoint = rundir.step_dir(root, step)
    shape = _array_shape(checkpoint, EMBED_ARRAY)
    if shape is None:
        raise ExportError(f"checkpoint: {checkpoint} has no {EMBED_ARRAY} array")
    return step, checkpoint, shape[0]


def check_exportable(cfg: TrainConfig, tokenizer_path: str, step: int | None = None) -> Source:
    """Everything the export can refuse, from files alone (ExportError, ConfigError)."""
    if cfg.model.moe is not None:
        raise ExportError(MOE_REFUSAL)
    step, checkpoint, vocab = resolve_checkpoint(cfg, step)
    try:
        with fsspec.open(tokenizer_path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ExportError(f"tokenizer: no file at {tokenizer_path}") from None
    trained = rundir.trained_tokenizer_sha256(cfg.output_dir)
    if trained and sha256(data) != trained:
        raise ExportError(
            f"tokenizer: {tokenizer_path} (sha256 {sha256(data)[:12]}) is not the tokenizer of "
            f"the model's training stores ({trained[:12]})"
        )
    try:
        sp = parse_sentencepiece(data)
        # More rows than pieces only where the config asked for them (model.vocab_size set
        # larger than the tokenizer's: padding, which a Hugging Face config also allows).
        padded = cfg.model.vocab_size == vocab and sp.vocab_size < vocab
        if sp.vocab_size != vocab and not padded:
            raise ExportError(
                f"tokenizer: vocabulary size {sp.vocab_size} ({tokenizer_path}) does not match "
                f"the checkpoint's {vocab} embedding rows ({checkpoint}): not the run's tokenizer"
            )
        if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
            raise ExportError(
                f"model.vocab_size: {cfg.model.vocab_size} in the config, {vocab} in the checkpoint"
            )
        check_tokenizer(sp)
    except UnexportableTokenizer as e:  # hf_tokenizer's refusals, as the export's own
        raise ExportError(str(e)) from None
    return Source(cfg, step, checkpoint, vocab, sp, data)


# ---------------------------------------------------------------------------------------------
# weights

WEIGHT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# huggingface_hub's MAX_SHARD_SIZE, the size of most Hub checkpoints' shards (transformers 5's
# save_pretrained defaults to 50GB: files that large are slow to move and to resume)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([KMGT]I?B|B)?", re.IGNORECASE)
_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """``5GB`` (10^9 bytes, as huggingface_hub reads it), ``1.5GB``, ``512MiB``, or bytes ->
    bytes; ValueError for anything else or nothing."""
    m = _SIZE.fullmatch(text.strip())
    size = int(Fraction(m[1]) * _UNITS[(m[2] or "B").upper()]) if m else 0
    if size <= 0:
        raise ValueError(f"{text!r} is not a size such as 5GB, 500MB, 2GiB or 1000000 (bytes)")
    return size


def hf_weights(params: Any) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters (a ``Transformer`` of host arrays) -> (Llama name, weight) in
    transformers' order, each nn.Linear weight (out, in). Views, not copies: a caller
    converts one shard's worth at a time. See the module docstring for the mapping."""
    cfg = params.cfg
    d = cfg.hidden_dim
    layers = params.layers
    attn = {n: np.asarray(getattr(layers.attn, n)) for n in ("wq", "wk", "wv", "wo")}
    mlp = {n: np.asarray(getattr(layers.mlp, n)) for n in ("w_gate", "w_up", "w_down")}
    attn_norm, mlp_norm = np.asarray(layers.attn_norm.weight), np.asarray(layers.mlp_norm.weight)
    yield "model.embed_tokens.weight", np.asarray(params.embed)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", attn["wq"][i].reshape(d, -1).T
        yield p + "self_attn.k_proj.weight", attn["wk"][i].reshape(d, -1).T
        yield p + "self_attn.v_proj.weight", attn["wv"][i].reshape(d, -1).T
        yield p + "self_attn.o_proj.weight", attn["wo"][i].reshape(-1, d).T
        yield p + "mlp.gate_proj.weight", mlp["w_gate"][i].T
        yield p + "mlp.up_proj.weight", mlp["w_up"][i].T
        yield p + "mlp.down_proj.weight", mlp["w_down"][i].T
        yield p + "input_layernorm.weight", attn_norm[i]
        yield p + "post_attention_layernorm.weight", mlp_norm[i]
    yield "model.norm.weight", np.asarray(params.final_norm.weight)
    if params.lm_head is not None:
        yield "lm_head.weight", np.asarray(params.lm_head).T


def plan_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names cut into shards of at most ``max_bytes`` of weights each, as huggingface_hub's
    ``split_state_dict_into_shards_factory`` (which transformers saves with) cuts them: in
    order, a shard closed when the next weight would overflow it, and a weight larger than
    the limit put alone in a shard of its own where it comes, the open shard left open."""
    shards: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, size in sizes:
        if size > max_bytes:
            shards.append([name])
            continue
        if filled + size > max_bytes:
            shards.append(current)
            current, filled = [], 0
        current.append(name)
        filled += size
    if current:
        shards.append(current)
    return shards


def weight_files(
    params: Any, dtype: str = "float32", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> Iterator[tuple[str, bytes]]:
    """The safetensors files, one shard at a time (``model.safetensors`` when one suffices;
    else ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``, the
    layout transformers writes and reads), so the host holds the parameters plus one shard
    in flight, not the model three times over."""
    from safetensors.numpy import save as save_safetensors

    np_dtype = np.dtype(WEIGHT_DTYPES[dtype])
    weights = dict(hf_weights(params))
    sizes = [(name, w.size * np_dtype.itemsize) for name, w in weights.items()]
    shards = plan_shards(sizes, max_shard_bytes)
    names = (
        [SINGLE_WEIGHTS]
        if len(shards) == 1
        else [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    )
    for file, shard in zip(names, shards, strict=True):
        tensors = {n: np.ascontiguousarray(weights[n], dtype=np_dtype) for n in shard}
        yield file, save_safetensors(tensors, metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(size for _, size in sizes)},
            "weight_map": {
                n: file for file, shard in zip(names, shards, strict=True) for n in shard
            },
        }
        yield WEIGHTS_INDEX, _json_bytes(index, sort_keys=True)


def hf_config(
    mcfg: Any, cfg: TrainConfig, sp: SentencePieceModel, dtype: str = "float32"
) -> dict[str, Any]:
    """config.json of ``LlamaForCausalLM`` for the resolved model config ``mcfg``, whose
    weights are written in ``dtype``."""
    ids = {f"{k}_token_id": (i if i >= 0 else None) for k, i in _special_ids(sp).items()}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": mcfg.vocab_size,
        "hidden_size": mcfg.hidden_dim,
        "intermediate_size": mcfg.intermediate_dim,
        "num_hidden_layers": mcfg.num_layers,
        "num_attention_heads": mcfg.num_heads,
        "num_key_value_heads": mcfg.num_kv_heads,
        "head_dim": mcfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": mcfg.norm_eps,
        "rope_theta": mcfg.rope_theta,
        # transformers >= 5 reads rope_parameters (and converts rope_theta); 4.x reads rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": mcfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": mcfg.tie_embeddings,
        "initializer_range": mcfg.init_std,
        "use_cache": True,
        "torch_dtype": dtype,
        **ids,
    }


def _special_ids(sp: SentencePieceModel) -> dict[str, int]:
    """The ids transformers starts and ends with. The start is EOS, as GPT-2's: documents were
    encoded without BOS and packed after an EOS, so the BOS row of the embedding was never
    trained, and a generation (or lm-eval's prefix token) started from it would start from
    noise; the trainer's own ``generate`` starts from EOS too."""
    return {"bos": sp.eos_id, "eos": sp.eos_id, "pad": sp.pad_id}


def _json_bytes(body: Any, sort_keys: bool = False) -> bytes:
    return (json.dumps(body, indent=2, ensure_ascii=False, sort_keys=sort_keys) + "\n").encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_sha256(cfg: TrainConfig) -> str:
    return sha256(json.dumps(to_dict(cfg), sort_keys=True, separators=(",", ":")).encode())


def export_files(
    source: Source,
    params: Any,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Iterator[tuple[str, bytes]]:
    """Every file of the export folder as (name, bytes), one at a time: the weights first
    (a shard at a time), the provenance, which holds every other file's sha256, last. Pure:
    the same inputs give the same bytes."""
    cfg, sp = source.cfg, source.tokenizer
    mcfg = params.cfg

    def files() -> Iterator[tuple[str, bytes]]:
        yield from weight_files(params, dtype, max_shard_bytes)
        yield "config.json", _json_bytes(hf_config(mcfg, cfg, sp, dtype))
        generation = {f"{k}_token_id": i for k, i in _special_ids(sp).items() if i >= 0}
        yield "generation_config.json", _json_bytes({**generation, "do_sample": False})
        yield "tokenizer.model", source.tokenizer_bytes
        for name, body in tokenizer_files(sp).items():
            yield name, _json_bytes(body)
        yield "README.md", _readme(source, mcfg, dtype).encode("utf-8")

    hashes: dict[str, str] = {}
    for name, data in files():
        hashes[name] = sha256(data)
        yield name, data
        del data  # not held while the next shard is built
    provenance = {
        "format": "slipway-hf-export/v1",
        "architecture": "LlamaForCausalLM",
        "source": {
            "output_dir": cfg.output_dir,
            "checkpoint": source.checkpoint,
            "step": source.step,
        },
        "tokenizer": {"sha256": sha256(source.tokenizer_bytes), "vocab_size": sp.vocab_size},
        "config_sha256": config_sha256(cfg),
        "config": to_dict(cfg),
        "model": to_dict(mcfg),
        "dtype": dtype,
        "files": dict(sorted(hashes.items())),
    }
    yield PROVENANCE, _json_bytes(provenance)


def _readme(source: Source, mcfg: Any, dtype: str) -> str:
    cfg = source.cfg
    tied = "tied" if mcfg.tie_embeddings else "untied"
    return (
        "# Slipway export\n\n"
        "A decoder trained by Slipway's JAX trainer (`trainer/`), exported by "
        "`python -m trainer.export` as a Hugging Face `LlamaForCausalLM` "
        f"({dtype} safetensors) "
        "with its tokenizer (sentencepiece BPE, as `tokenizer.json` and `tokenizer.model`).\n\n"
        f"- checkpoint: `{source.checkpoint}` (step {source.step})\n"
        f"- config sha256: `{config_sha256(cfg)}` (the trainer config, in `{PROVENANCE}`)\n"
        f"- tokenizer sha256: `{sha256(source.tokenizer_bytes)}`\n"
        f"- shape: {mcfg.num_layers} layers, hidden {mcfg.hidden_dim}, {mcfg.num_heads} query "
        f"heads over {mcfg.num_kv_heads} kv heads of {mcfg.head_dim}, MLP {mcfg.intermediate_dim}, "
        f"vocabulary {mcfg.vocab_size}, {tied} embeddings, trained on {cfg.seq_len}-token "
        "windows\n\n"
        "Documents were encoded without BOS and end with EOS: encode a prompt with "
        "`add_special_tokens=False` (the tokenizer adds nothing anyway).\n\n"
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        'model = AutoModelForCausalLM.from_pretrained("DIR")\n'
        'tokenizer = AutoTokenizer.from_pretrained("DIR")\n'
        "```\n"
    )


def write_files(out: str, files: Iterable[tuple[str, bytes]]) -> None:
    """Write the files under ``out`` (local or gs://) in the order given (``export_files``
    gives the provenance last: a folder without it is an export that did not finish), each
    dropped once written. An earlier export's provenance, then its weight files, are removed
    first: a sharded export over a single-file one would leave ``model.safetensors``, which
    transformers loads before it looks for an index."""
    fs, base = fsspec.core.url_to_fs(out)
    base = base.rstrip("/")
    fs.makedirs(base, exist_ok=True)
    previous = [p for p in fs.ls(base, detail=False) if _is_export_owned(p.rsplit("/", 1)[-1])]
    for path in sorted(previous, key=lambda p: not p.endswith("/" + PROVENANCE)):
        fs.rm(path)
    for name, data in files:
        with fs.open(f"{base}/{name}", "wb") as f:
            f.write(data)
        del data  # the next shard is built while the loop variable would still hold this one


def _is_export_owned(name: str) -> bool:
    """The files whose names differ from one export to the next (and the provenance)."""
    return name in (PROVENANCE, SINGLE_WEIGHTS, WEIGHTS_INDEX) or bool(WEIGHT_SHARD.fullmatch(name))


def load_source_params(source: Source) -> Any:
    """The checkpoint's parameters as host numpy arrays: trainer.restore.load_params on the
    launch's mesh, then every leaf gathered whole (a collective: in a multi-host launch each
    process calls it, and process 0 writes the files)."""
    import jax
    from jax.experimental import multihost_utils

    from trainer import distributed as dist
    from trainer.restore import load_params

    dist.initialize(source.cfg.distributed)
    mesh = dist.make_mesh(source.cfg.mesh)
    params, _, _, _ = load_params(source.cfg, source.vocab_size, mesh, source.step)

    def host(x: Any) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree_util.tree_map(host, params)


def _shard_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:  # argparse names the option and exits 2
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__)
    parser.add_argument("--config", required=True, help="the training run's config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--tokenizer", required=True, help="the run's sentencepiece model")
    parser.add_argument("--out", required=True, help="output folder (local or gs://)")
    parser.add_argument(
        "--dtype",
        choices=sorted(WEIGHT_DTYPES),
        default="float32",
        help="the weights' type (default float32, the checkpoint's own: bfloat16 halves the "
        "folder and rounds every weight)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=_shard_size,
        default=DEFAULT_MAX_SHARD_BYTES,
        metavar="SIZE",
        help="the most weight bytes per safetensors file, e.g. 5GB (the default, as "
        "huggingface_hub's), 500MB, 2GiB: a larger model is written as shards with an index",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, require_data=False)
        source = check_exportable(cfg, args.tokenizer, args.step)
    except (ConfigError, ExportError, OSError) as e:
        print(f"cannot export: {e}", file=sys.stderr)
        return 2
    try:
        params = load_source_params(source)
        import jax

        if jax.process_index() == 0:
            files = export_files(source, params, args.dtype, args.max_shard_size)
            write_files(args.out, files)
    except Exception:
        traceback.print_exc()
        return 1
    print(
        json.dumps(
            {"out": args.out, "checkpoint": source.checkpoint, "step": source.step}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
