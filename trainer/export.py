"""Hugging Face export: ``python -m trainer.export --config FILE --tokenizer SPM --out DIR``.

Writes one checkpoint of a dense training run as a folder that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads as ``LlamaForCausalLM`` and
``AutoTokenizer.from_pretrained(DIR)`` loads as a fast tokenizer that encodes text exactly as
the run's sentencepiece model does, so a trained model can be evaluated, served or shared with
the rest of the ecosystem without our code::

    DIR/  (local or gs://, through fsspec)
        config.json             LlamaConfig: shapes, rope_theta, norm eps, special ids
        generation_config.json  bos/eos/pad ids (greedy by default)
        model.safetensors       float32 weights under the Llama names, nn.Linear layout (out, in)
        tokenizer.json          the sentencepiece BPE model as a `tokenizers` pipeline
        tokenizer.model         the sentencepiece model itself (copied byte for byte)
        tokenizer_config.json   no BOS/EOS added, special tokens named
        special_tokens_map.json
        slipway_export.json     provenance: checkpoint, step, tokenizer sha256, our config
        README.md

Layout mapping (ours: raw arrays ``(in, ..., out)`` stacked over layers; theirs: ``(out, in)``):
``embed`` (V, D) -> ``model.embed_tokens.weight``; ``attn.wq`` (D, H, hd) -> ``q_proj``
(H*hd, D), ``wk``/``wv`` (D, K, hd) -> ``k_proj``/``v_proj`` (K*hd, D), ``wo`` (H, hd, D) ->
``o_proj`` (D, H*hd); ``mlp.w_gate``/``w_up`` (D, F) -> ``gate_proj``/``up_proj`` (F, D),
``w_down`` (F, D) -> ``down_proj`` (D, F); ``attn_norm``/``mlp_norm`` -> ``input_layernorm``/
``post_attention_layernorm``; ``final_norm`` -> ``model.norm``; ``lm_head`` (D, V) ->
``lm_head.weight`` (V, D), left out when tied. Our rotary rotates the halves (x[i], x[i+hd/2])
as transformers' ``rotate_half`` does, and query head h reads kv head h // (H/K) as its
``repeat_kv`` does, so no head is permuted (the parity tests check logits, not this comment).

The tokenizer.json is written by hand from the sentencepiece model (a minimal protobuf reader
below; neither ``tokenizers`` nor ``transformers`` is needed, the trainer image has neither):
sentencepiece's BPE merges, highest piece score first, over the whole normalized text (it
never pre-splits words), with byte fallback; the vocabulary's merges are every split of a
piece into two pieces. Left to itself, transformers would convert ``tokenizer.model`` through
protobuf and its Llama converter, which prepends "▁" unless told otherwise and depends on the
installed protobuf (in this venv that conversion fails outright).

Refused before anything is computed (exit 2, the message names the problem): a missing
checkpoint, a tokenizer whose vocabulary is not the checkpoint's embedding rows, a tokenizer
feature the export cannot reproduce, and mixture-of-experts models (see ``check_exportable``).

Deterministic: the same checkpoint and tokenizer give byte-identical files (no timestamps, the
output folder's own path is recorded nowhere).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import struct
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from trainer import rundir
from trainer.config import ConfigError, TrainConfig, load_config, to_dict

EMBED_ARRAY = "params.embed"  # the embedding's leaf in a checkpoint (trainer/checkpoint.py)
WHITESPACE = "\u2581"  # sentencepiece's escaped space


class ExportError(ValueError):
    """A checkpoint or tokenizer that cannot be exported; nothing has been computed."""


# ---------------------------------------------------------------------------------------------
# sentencepiece model (protobuf wire format, only the fields the export needs)

# SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# TrainerSpec.ModelType
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}


@dataclass(frozen=True)
class Piece:
    piece: str
    score: float
    type: int


@dataclass(frozen=True)
class SentencePieceModel:
    """What the export reads from a sentencepiece ``ModelProto`` (proto2 defaults filled)."""

    pieces: tuple[Piece, ...]
    model_type: str = "unigram"
    byte_fallback: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    treat_whitespace_as_suffix: bool = False
    normalizer_name: str = ""
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def special(self, which: str) -> str | None:
        """The piece of ``unk``, ``bos``, ``eos`` or ``pad``; None when the model has none."""
        i = getattr(self, f"{which}_id")
        return self.pieces[i].piece if 0 <= i < len(self.pieces) else None


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message: varints as int, 32/64-bit as
    raw bytes, length-delimited as bytes."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ExportError(f"tokenizer: not a sentencepiece model (protobuf wire type {wire})")
        out.append((num, wire, value))
    if pos != len(buf):
        raise ExportError("tokenizer: not a sentencepiece model (truncated protobuf)")
    return out


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def parse_sentencepiece(data: bytes) -> SentencePieceModel:
    """A serialized sentencepiece ``ModelProto`` -> :class:`SentencePieceModel`. Field numbers
    from sentencepiece_model.proto: ModelProto pieces=1, trainer_spec=2, normalizer_spec=3."""
    try:
        return _parse_sentencepiece(data)
    except ExportError:
        raise
    except (IndexError, ValueError, AttributeError, TypeError, struct.error) as e:
        raise ExportError(f"tokenizer: not a sentencepiece model ({e!r})") from None


def _parse_sentencepiece(data: bytes) -> SentencePieceModel:
    top = _fields(data)
    pieces: list[Piece] = []
    kw: dict[str, Any] = {}
    for num, _, value in top:
        if num == 1:
            p = {"piece": "", "score": 0.0, "type": NORMAL}
            for n, _, v in _fields(value):
                if n == 1:
                    p["piece"] = v.decode("utf-8")
                elif n == 2:
                    p["score"] = struct.unpack("<f", v)[0]
                elif n == 3:
                    p["type"] = v
            pieces.append(Piece(**p))
        elif num == 2:  # TrainerSpec
            names = {
                3: "model_type",
                35: "byte_fallback",
                24: "treat_whitespace_as_suffix",
                40: "unk_id",
                41: "bos_id",
                42: "eos_id",
                43: "pad_id",
            }
            for n, _, v in _fields(value):
                if n in names:
                    kw[names[n]] = v
        elif num == 3:  # NormalizerSpec
            flags = {3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}
            for n, _, v in _fields(value):
                if n == 1:
                    kw["normalizer_name"] = v.decode("utf-8")
                elif n == 2:
                    kw["precompiled_charsmap"] = bytes(v)
                elif n in flags:
                    kw[flags[n]] = bool(v)
    if not pieces:
        raise ExportError("tokenizer: not a sentencepiece model (no pieces)")
    kw["model_type"] = MODEL_TYPES.get(kw.get("model_type", 1), str(kw.get("model_type")))
    for k in ("byte_fallback", "treat_whitespace_as_suffix"):
        if k in kw:
            kw[k] = bool(kw[k])
    for k in ("unk_id", "bos_id", "eos_id", "pad_id"):
        if k in kw:
            kw[k] = _signed(kw[k])
    return SentencePieceModel(pieces=tuple(pieces), **kw)


def check_tokenizer(sp: SentencePieceModel) -> None:
    """Refuse what ``tokenizer_json`` cannot reproduce exactly (ExportError names it)."""
    problems = []
    if sp.model_type != "bpe":
        problems.append(f"model_type is {sp.model_type} (only BPE is exported)")
    if sp.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces is on (whitespace runs would be collapsed)")
    if not sp.escape_whitespaces:
        problems.append("escape_whitespaces is off")
    if sp.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix is on")
    odd = sorted({p.type for p in sp.pieces} & {USER_DEFINED, UNUSED})
    if odd:
        problems.append(f"it has user-defined or unused pieces (types {odd})")
    if sp.eos_id < 0:
        problems.append("it has no EOS piece (documents end with EOS)")
    if problems:
        raise ExportError("tokenizer: cannot be exported exactly: " + "; ".join(problems))


def tokenizer_json(sp: SentencePieceModel) -> dict[str, Any]:
    """The ``tokenizers`` pipeline that encodes as sentencepiece BPE does.

    Sentencepiece BPE starts from the characters of the whole normalized text (spaces escaped
    as "▁", no pre-split into words) and repeatedly merges the adjacent pair whose concatenation
    is the highest-scoring piece, leftmost first on ties; characters outside the vocabulary
    become byte pieces. ``tokenizers``' BPE merges the lowest-ranked pair, leftmost first on
    ties, so the merges are every split of every normal piece into two normal pieces, ranked by
    the piece's score (then id). No pre-tokenizer, no post-processor (no BOS/EOS added)."""
    check_tokenizer(sp)
    vocab = {p.piece: i for i, p in enumerate(sp.pieces)}
    normal = {p.piece for p in sp.pieces if p.type == NORMAL}
    order = sorted(
        (i for i, p in enumerate(sp.pieces) if p.type == NORMAL and len(p.piece) > 1),
        key=lambda i: (-sp.pieces[i].score, i),
    )
    merges = []
    for i in order:
        s = sp.pieces[i].piece
        for k in range(1, len(s)):
            if s[:k] in normal and s[k:] in normal:
                merges.append([s[:k], s[k:]])
    normalizers: list[dict[str, Any]] = []
    if sp.precompiled_charsmap:
        normalizers.append(
            {
                "type": "Precompiled",
                "precompiled_charsmap": base64.b64encode(sp.precompiled_charsmap).decode("ascii"),
            }
        )
    if sp.add_dummy_prefix:
        normalizers.append({"type": "Prepend", "prepend": WHITESPACE})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": WHITESPACE})
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": WHITESPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if sp.add_dummy_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    added = [
        {
            "id": i,
            "content": p.piece,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, p in enumerate(sp.pieces)
        if p.type in (CONTROL, UNKNOWN)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": sp.special("unk"),
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": sp.byte_fallback,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def tokenizer_files(sp: SentencePieceModel) -> dict[str, dict[str, Any]]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json. ``split_special_tokens``
    makes a literal "</s>" in text encode as characters, as sentencepiece does; the special ids
    are still the model's (and skipped when decoding with ``skip_special_tokens``)."""
    specials = {
        f"{k}_token": sp.special(k)
        for k in ("bos", "eos", "unk", "pad")
        if sp.special(k) is not None
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": sp.add_dummy_prefix,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        **specials,
    }
    return {
        "tokenizer.json": tokenizer_json(sp),
        "tokenizer_config.json": config,
        "special_tokens_map.json": specials,
    }


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
    sp = parse_sentencepiece(data)
    if sp.vocab_size != vocab:
        raise ExportError(
            f"tokenizer: vocabulary size {sp.vocab_size} ({tokenizer_path}) does not match "
            f"the checkpoint's {vocab} embedding rows ({checkpoint}): not the run's tokenizer"
        )
    if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
        raise ExportError(
            f"model.vocab_size: {cfg.model.vocab_size} in the config, {vocab} in the checkpoint"
        )
    check_tokenizer(sp)
    return Source(cfg, step, checkpoint, vocab, sp, data)


# ---------------------------------------------------------------------------------------------
# weights


def hf_state_dict(params: Any) -> dict[str, np.ndarray]:
    """Our parameters (a ``Transformer``; any array type) -> float32 numpy arrays under the
    Llama names, nn.Linear weights (out, in). See the module docstring for the mapping."""
    cfg = params.cfg
    f32 = lambda a: np.ascontiguousarray(np.asarray(a, dtype=np.float32))  # noqa: E731
    d = cfg.hidden_dim
    layers = params.layers
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": f32(params.embed)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        wq, wk, wv, wo = (np.asarray(getattr(layers.attn, n)[i]) for n in ("wq", "wk", "wv", "wo"))
        out[p + "self_attn.q_proj.weight"] = f32(wq.reshape(d, -1).T)
        out[p + "self_attn.k_proj.weight"] = f32(wk.reshape(d, -1).T)
        out[p + "self_attn.v_proj.weight"] = f32(wv.reshape(d, -1).T)
        out[p + "self_attn.o_proj.weight"] = f32(wo.reshape(-1, d).T)
        out[p + "mlp.gate_proj.weight"] = f32(np.asarray(layers.mlp.w_gate[i]).T)
        out[p + "mlp.up_proj.weight"] = f32(np.asarray(layers.mlp.w_up[i]).T)
        out[p + "mlp.down_proj.weight"] = f32(np.asarray(layers.mlp.w_down[i]).T)
        out[p + "input_layernorm.weight"] = f32(layers.attn_norm.weight[i])
        out[p + "post_attention_layernorm.weight"] = f32(layers.mlp_norm.weight[i])
    out["model.norm.weight"] = f32(params.final_norm.weight)
    if params.lm_head is not None:
        out["lm_head.weight"] = f32(np.asarray(params.lm_head).T)
    return out


def hf_config(mcfg: Any, cfg: TrainConfig, sp: SentencePieceModel) -> dict[str, Any]:
    """config.json of ``LlamaForCausalLM`` for the resolved model config ``mcfg``."""
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
        "torch_dtype": "float32",
        **ids,
    }


def _special_ids(sp: SentencePieceModel) -> dict[str, int]:
    return {"bos": sp.bos_id, "eos": sp.eos_id, "pad": sp.pad_id}


def _json_bytes(body: Any) -> bytes:
    return (json.dumps(body, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_sha256(cfg: TrainConfig) -> str:
    return sha256(json.dumps(to_dict(cfg), sort_keys=True, separators=(",", ":")).encode())


def export_files(source: Source, params: Any) -> dict[str, bytes]:
    """Every file of the export folder, by name (pure: the same inputs give the same bytes)."""
    from safetensors.numpy import save as save_safetensors

    cfg, sp = source.cfg, source.tokenizer
    mcfg = params.cfg
    weights = save_safetensors(hf_state_dict(params), metadata={"format": "pt"})
    files: dict[str, bytes] = {
        "config.json": _json_bytes(hf_config(mcfg, cfg, sp)),
        "generation_config.json": _json_bytes(
            {
                **{f"{k}_token_id": i for k, i in _special_ids(sp).items() if i >= 0},
                "do_sample": False,
            }
        ),
        "model.safetensors": weights,
        "tokenizer.model": source.tokenizer_bytes,
    }
    for name, body in tokenizer_files(sp).items():
        files[name] = _json_bytes(body)
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
        "files": {name: sha256(data) for name, data in sorted(files.items())},
    }
    files["slipway_export.json"] = _json_bytes(provenance)
    files["README.md"] = _readme(source, mcfg).encode("utf-8")
    return files


def _readme(source: Source, mcfg: Any) -> str:
    cfg = source.cfg
    tied = "tied" if mcfg.tie_embeddings else "untied"
    return (
        "# Slipway export\n\n"
        "A decoder trained by Slipway's JAX trainer (`trainer/`), exported by "
        "`python -m trainer.export` as a Hugging Face `LlamaForCausalLM` (float32 safetensors) "
        "with its tokenizer (sentencepiece BPE, as `tokenizer.json` and `tokenizer.model`).\n\n"
        f"- checkpoint: `{source.checkpoint}` (step {source.step})\n"
        f"- config sha256: `{config_sha256(cfg)}` (the trainer config, in `slipway_export.json`)\n"
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


def write_files(out: str, files: dict[str, bytes]) -> None:
    """Write the files under ``out`` (local or gs://), the provenance file last."""
    fs, base = fsspec.core.url_to_fs(out)
    fs.makedirs(base, exist_ok=True)
    last = "slipway_export.json"
    for name in [*sorted(n for n in files if n != last), last]:
        with fs.open(f"{base.rstrip('/')}/{name}", "wb") as f:
            f.write(files[name])


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


def export(cfg: TrainConfig, tokenizer_path: str, out: str, step: int | None = None) -> Source:
    """Check, load, convert and write; returns what was exported."""
    source = check_exportable(cfg, tokenizer_path, step)
    params = load_source_params(source)
    write_files(out, export_files(source, params))
    return source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__)
    parser.add_argument("--config", required=True, help="the training run's config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--tokenizer", required=True, help="the run's sentencepiece model")
    parser.add_argument("--out", required=True, help="output folder (local or gs://)")
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
            write_files(args.out, export_files(source, params))
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
