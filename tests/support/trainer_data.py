"""Small token stores for tests, demos and benchmarks (written with the real token-store writer)."""

from __future__ import annotations

import functools
import hashlib
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import tokenstore

# Real text that is the same on every machine: the first 52 modules, by name, of CPython
# 3.11.7's standard library (Python Software Foundation License; LICENSE.txt in the archive),
# committed rather than read from the running interpreter, whose stdlib differs by version.
STDLIB_SAMPLE = Path(__file__).with_name("texts") / "python-3.11.7-stdlib.tar.xz"


@functools.cache
def _stdlib_sample() -> tuple[str, ...]:
    with tarfile.open(STDLIB_SAMPLE) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.name.endswith(".py")), key=lambda m: m.name
        )
        return tuple(tar.extractfile(m).read().decode("utf-8", "replace") for m in members)


def stdlib_texts(max_bytes: int = 1 << 20, skip: int = 0) -> list[str]:
    """Real text: Python standard-library sources, in a fixed order (skip = held-out offset)."""
    texts, total = [], 0
    for text in _stdlib_sample()[skip:]:
        texts.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            return texts
    raise ValueError(
        f"the stdlib sample holds {total} bytes past module {skip}, fewer than the {max_bytes} "
        f"asked for: add modules to {STDLIB_SAMPLE.name}"
    )


def train_sentencepiece(texts: Sequence[str], vocab_size: int, model_dir: str) -> str:
    """Train a small BPE sentencepiece model (EOS id 2); returns the model file path."""
    import sentencepiece as spm

    os.makedirs(model_dir, exist_ok=True)
    prefix = os.path.join(model_dir, "sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(line for t in texts for line in t.splitlines() if line.strip()),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    return prefix + ".model"


def write_text_store(root: str, texts: Sequence[str], model_path: str, shards: int = 2) -> None:
    """Tokenize documents (each + EOS) with a sentencepiece model into a finalized store.

    The ledger's metadata records ``num_bytes`` (UTF-8 bytes of the text), which the evaluator
    uses for bits-per-byte.
    """
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_path)
    docs = [[*sp.encode(t), sp.eos_id()] for t in texts]
    written = []
    per = max(1, -(-len(docs) // shards))
    for i in range(0, len(docs), per):
        written.append(tokenstore.write_shard(root, f"shard-{i // per:05d}", docs[i : i + per]))
    with open(model_path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    tokenstore.finalize(
        root,
        written,
        vocab_size=sp.get_piece_size(),
        eos_id=sp.eos_id(),
        tokenizer_sha256=sha,
        metadata={"num_bytes": int(sum(len(t.encode("utf-8")) for t in texts))},
    )


def write_random_store(
    root: str,
    *,
    vocab_size: int = 64,
    num_docs: int = 400,
    seed: int = 0,
    shards: int = 2,
    tokenizer_sha256: str = "synthetic",
) -> None:
    """Synthetic documents with a learnable structure (a noisy repeating cycle), EOS = 0."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        n = int(rng.integers(8, 120))
        start = int(rng.integers(1, vocab_size))
        seq = (start + np.arange(n) * 3) % (vocab_size - 1) + 1
        noise = rng.random(n) < 0.1
        seq[noise] = rng.integers(1, vocab_size, noise.sum())
        docs.append([*seq.tolist(), 0])
    per = -(-num_docs // shards)
    written = [
        tokenstore.write_shard(root, f"shard-{i:05d}", docs[i * per : (i + 1) * per])
        for i in range(shards)
    ]
    tokenstore.finalize(
        root, written, vocab_size=vocab_size, eos_id=0, tokenizer_sha256=tokenizer_sha256
    )


__all__ = ["stdlib_texts", "train_sentencepiece", "write_random_store", "write_text_store"]


def loss_curve(out: str | os.PathLike[str], steps: int) -> np.ndarray:
    """The loss of every step of a finished run's metrics log (asserting steps 1..steps)."""
    import json
    from pathlib import Path

    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    return np.array([r["loss"] for r in rows])


def final_params(out: str | os.PathLike[str], steps: int) -> dict[str, np.ndarray]:
    """The parameter arrays of the run's checkpoint at ``steps``, read back from TensorStore."""
    import tensorstore as ts

    base = os.path.join(out, "checkpoints", f"step-{steps:09d}", "arrays")
    return {
        n: ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(base, n)}}
        )
        .result()
        .read()
        .result()
        for n in sorted(os.listdir(base))
        if n.startswith("params")
    }


def free_port() -> int:
    """A free loopback port (for a local ``jax.distributed`` coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def traced_meshes(monkeypatch) -> list[tuple[str, ...]]:
    """The abstract mesh's axis names each time the model's attention is traced from now on:
    what a kernel that must run per device (``kernels.per_device``) finds. A step jitted
    without ``distributed.on_mesh`` shows ``()``."""
    import jax

    import trainer.model as model

    seen: list[tuple[str, ...]] = []
    real = model.attention

    def attention(*args, **kwargs):
        seen.append(tuple(jax.sharding.get_abstract_mesh().axis_names))
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "attention", attention)
    return seen


def attention_inputs(b: int, s: int, h: int, kv_heads: int, hd: int, seed: int) -> tuple:
    """Random q (B, S, H, hd), k and v (B, S, K, hd), an output cotangent like q, and the (B, S)
    segment ids of packed documents (an EOS every 37 tokens): what the attention tests feed
    each implementation. Keys ``seed`` (arrays) and ``seed + 1`` (tokens)."""
    import jax

    from trainer.model import segments_and_positions

    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, s, h, hd))
    k, v = (jax.random.normal(kk, (b, s, kv_heads, hd)) for kk in keys[1:3])
    ct = jax.random.normal(keys[3], (b, s, h, hd))
    toks = jax.random.randint(jax.random.key(seed + 1), (b, s), 1, 20).at[:, ::37].set(0)
    seg, _ = segments_and_positions(toks, 0)
    return q, k, v, ct, seg
