"""The run's sentencepiece tokenizer as Hugging Face files (``trainer/export.py`` writes them).

The tokenizer.json is written by hand from the sentencepiece model (a minimal protobuf reader
below; neither ``tokenizers`` nor ``transformers`` is needed, the trainer image has neither):
sentencepiece's BPE merges, highest piece score first, over the whole normalized text (it
never pre-splits words), with byte fallback; the vocabulary's merges are every split of a
piece into two pieces. Left to itself, transformers would convert ``tokenizer.model`` through
protobuf and its Llama converter, which prepends "▁" unless told otherwise and depends on the
installed protobuf (in this venv that conversion fails outright).

What cannot be reproduced exactly is refused (``check_tokenizer``: ``UnexportableTokenizer`` names it).
Encoding is the same, and so is decoding what encoding gives. Decoding ids a model generated
can differ: a run of byte pieces that is not valid UTF-8 becomes U+FFFD for its bad bytes in
sentencepiece, for all of its bytes in ``tokenizers``' ``ByteFallback`` (docs/export.md).
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any

WHITESPACE = "\u2581"  # sentencepiece's escaped space


class UnexportableTokenizer(ValueError):
    """A tokenizer file that is not a sentencepiece model, or one the export cannot reproduce."""


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
            raise UnexportableTokenizer(
                f"tokenizer: not a sentencepiece model (protobuf wire type {wire})"
            )
        out.append((num, wire, value))
    if pos != len(buf):
        raise UnexportableTokenizer("tokenizer: not a sentencepiece model (truncated protobuf)")
    return out


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def parse_sentencepiece(data: bytes) -> SentencePieceModel:
    """A serialized sentencepiece ``ModelProto`` -> :class:`SentencePieceModel`. Field numbers
    from sentencepiece_model.proto: ModelProto pieces=1, trainer_spec=2, normalizer_spec=3."""
    try:
        return _parse_sentencepiece(data)
    except UnexportableTokenizer:
        raise
    except (IndexError, ValueError, AttributeError, TypeError, struct.error) as e:
        raise UnexportableTokenizer(f"tokenizer: not a sentencepiece model ({e!r})") from None


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
        raise UnexportableTokenizer("tokenizer: not a sentencepiece model (no pieces)")
    kw["model_type"] = MODEL_TYPES.get(kw.get("model_type", 1), str(kw.get("model_type")))
    for k in ("byte_fallback", "treat_whitespace_as_suffix"):
        if k in kw:
            kw[k] = bool(kw[k])
    for k in ("unk_id", "bos_id", "eos_id", "pad_id"):
        if k in kw:
            kw[k] = _signed(kw[k])
    return SentencePieceModel(pieces=tuple(pieces), **kw)


def check_tokenizer(sp: SentencePieceModel) -> None:
    """Refuse what ``tokenizer_json`` cannot reproduce exactly (UnexportableTokenizer names it)."""
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
        raise UnexportableTokenizer("tokenizer: cannot be exported exactly: " + "; ".join(problems))


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
    # bos_token is the EOS piece (trainer.export: documents follow an EOS, never a BOS)
    pieces = {"bos": sp.special("eos")} | {k: sp.special(k) for k in ("eos", "unk", "pad")}
    specials = {f"{k}_token": piece for k, piece in pieces.items() if piece is not None}
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
