"""SentencePiece model helpers shared by tokenizer training (stage 6) and tokenization (stage 7).

One place decides the special ids, where a tokenizer directory keeps its model, how a model
is identified (sha256 of its bytes, recorded in the token store's ledger) and how documents
are encoded (batched, EOS appended, as numpy arrays), so the two stages cannot drift apart.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sentencepiece as sentencepiece_lib

from pipelines import storage

# The reserved ids, the first four of every vocabulary, are defined with the tokenizer's config.
from pipelines.configs import BOS_ID as BOS_ID
from pipelines.configs import EOS_ID as EOS_ID
from pipelines.configs import PAD_ID as PAD_ID
from pipelines.configs import SPECIAL_IDS as SPECIAL_IDS
from pipelines.configs import UNK_ID as UNK_ID
from pipelines.stage import StageError

MODEL_NAME = "tokenizer.model"
VOCAB_NAME = "tokenizer.vocab"

MAX_AUTO_THREADS = 8


class TokenizerError(StageError):
    """A tokenizer that is missing, or not the one the run was planned with."""


def model_path(dir_or_model: str) -> str:
    """A tokenizer directory (stage 6 output) or a ``.model`` file -> the model file's path."""
    if dir_or_model.endswith(".model"):
        return dir_or_model
    return storage.join(dir_or_model, MODEL_NAME)


@dataclass(frozen=True)
class TokenizerInfo:
    """What the token store's ledger records about the tokenizer that produced it."""

    path: str
    sha256: str
    vocab_size: int
    eos_id: int


def load_model_bytes(dir_or_model: str, expected_sha256: str | None = None) -> bytes:
    path = model_path(dir_or_model)
    if not storage.exists(path):
        raise TokenizerError(f"no sentencepiece model at {path}")
    data = storage.read_bytes(path)
    if expected_sha256 is not None and storage.sha256_hex(data) != expected_sha256:
        # The model changed between planning and running: tokens would not match the ledger.
        raise TokenizerError(f"{path} changed: sha256 is not {expected_sha256}")
    return data


def processor(model: bytes) -> sentencepiece_lib.SentencePieceProcessor:
    return sentencepiece_lib.SentencePieceProcessor(model_proto=model)


def describe(dir_or_model: str) -> TokenizerInfo:
    data = load_model_bytes(dir_or_model)
    sp = processor(data)
    if sp.eos_id() < 0:
        raise TokenizerError(f"{model_path(dir_or_model)} has no EOS piece")
    return TokenizerInfo(
        model_path(dir_or_model), storage.sha256_hex(data), sp.vocab_size(), sp.eos_id()
    )


def resolve_threads(threads: int) -> int:
    """0 means one encoding thread per CPU (capped): encoding is the stage's CPU cost."""
    if threads > 0:
        return threads
    return max(1, min(MAX_AUTO_THREADS, os.cpu_count() or 1))


def encode_with_eos(
    sp: sentencepiece_lib.SentencePieceProcessor, texts: Sequence[str], threads: int
) -> list[np.ndarray]:
    """Token ids of each text with EOS appended, one call for the whole batch (int32 arrays).

    A batch call runs in C++ across ``threads`` threads without the GIL; one Python call per
    document would cost more than the encoding of a short document itself.
    """
    if not texts:
        return []
    return sp.encode(list(texts), add_eos=True, return_type="numpy", num_threads=threads)


def vocab_text(sp: sentencepiece_lib.SentencePieceProcessor) -> str:
    """The ``.vocab`` listing (piece, tab, score per id), as ``spm_train`` writes it."""
    return "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.vocab_size()))
