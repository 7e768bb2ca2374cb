"""Hugging Face export and KV-cache generation, without torch or transformers.

A tiny model is initialized and saved as a real checkpoint (the trainer's ``Checkpointer``,
under the run layout ``trainer.restore.load_params`` reads), with a sentencepiece BPE model
trained like the pipeline's (byte fallback, no dummy prefix, identity normalization). The
export's refusals, its safetensors names, shapes and layouts, its determinism and its
tokenizer.json (through the ``tokenizers`` library when installed) are checked here; the
logits against transformers are tests/parity/test_hf_parity.py's. Generation: greedy decoding
with the cache gives exactly argmax over the full forward, step by step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm

from tests.support.trainer_data import stdlib_texts
from trainer import export as ex
from trainer import generate as gen
from trainer import hf_tokenizer as hft
from trainer.checkpoint import Checkpointer
from trainer.config import ModelConfig, MoEConfig, resolve_model
from trainer.model import Transformer, init_model

VOCAB = 512
SEQ = 64


class _State(NamedTuple):  # leaves saved as params.<name>, as the trainer's TrainState
    params: Transformer


def _spm(path: Path, vocab: int) -> str:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(
            line for t in stdlib_texts(200_000) for line in t.splitlines() if line.strip()
        ),
        model_prefix=str(path),
        vocab_size=vocab,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        num_threads=1,
        minloglevel=2,
    )
    return f"{path}.model"


def _model_cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_dim=32,
        intermediate_dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        init_std=0.3,  # peaked logits: argmax is far from ties
    )
    return ModelConfig(**{**base, **kw})


def _run(root: Path, step: int = 3, **model) -> tuple[str, Transformer]:
    """A run folder with one checkpoint of a random model; returns (config file, params)."""
    out = root / "run"
    body = {
        "output_dir": str(out),
        "seq_len": SEQ,
        "batch_size": 2,
        "steps": 10,
        "optimizer": {"warmup_steps": 0},
        "model": {k: v for k, v in _model_cfg(**model).__dict__.items() if k != "moe"},
    }
    if model.get("moe"):
        body["model"]["moe"] = model["moe"]
    config = root / "config.json"
    config.write_text(json.dumps(body), encoding="utf-8")
    if not model.get("moe"):
        params = init_model(resolve_model(_model_cfg(**model)), jax.random.key(1))
        ck = Checkpointer(str(out / "checkpoints"), async_save=False)
        ck.save(step, _State(params))
        ck.close()
        return str(config), params
    return str(config), None  # type: ignore[return-value]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return _spm(tmp_path_factory.mktemp("tok") / "sp", VOCAB)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, Transformer]:
    return _run(tmp_path_factory.mktemp("run"))


# ---------------------------------------------------------------------------------------------
# the sentencepiece reader and tokenizer.json


def test_protobuf_reader_matches_sentencepiece(tok):
    data = Path(tok).read_bytes()
    model = hft.parse_sentencepiece(data)
    sp = spm.SentencePieceProcessor(model_proto=data)
    assert model.vocab_size == sp.vocab_size() == VOCAB
    for i, p in enumerate(model.pieces):
        assert p.piece == sp.id_to_piece(i)
        assert p.score == pytest.approx(sp.get_score(i))
        assert (p.type == hft.BYTE) == sp.is_byte(i)
        assert (p.type == hft.CONTROL) == sp.is_control(i)
        assert (p.type == hft.UNKNOWN) == sp.is_unknown(i)
    assert (model.pad_id, model.unk_id, model.bos_id, model.eos_id) == (0, 1, 2, 3)
    assert model.model_type == "bpe" and model.byte_fallback
    assert not model.add_dummy_prefix and not model.remove_extra_whitespaces
    assert model.normalizer_name == "identity" and model.precompiled_charsmap == b""


def test_tokenizer_json_encodes_as_sentencepiece(tok):
    data = Path(tok).read_bytes()
    files = hft.tokenizer_files(hft.parse_sentencepiece(data))
    body = files["tokenizer.json"]
    assert body["pre_tokenizer"] is None and body["post_processor"] is None
    assert body["model"]["type"] == "BPE" and body["model"]["byte_fallback"]
    assert body["normalizer"]["normalizers"] == [
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    ]
    config = files["tokenizer_config.json"]
    assert config["add_bos_token"] is False and config["add_eos_token"] is False
    assert config["eos_token"] == "</s>" and config["pad_token"] == "<pad>"
    assert config["bos_token"] == "</s>"  # what documents were trained after
    import tokenizers  # transformers' (requirements-parity.txt); the export never imports it

    fast = tokenizers.Tokenizer.from_str(json.dumps(body))
    # transformers sets this from split_special_tokens: "</s>" in text is text, as in spm
    fast.encode_special_tokens = True
    sp = spm.SentencePieceProcessor(model_proto=data)
    texts = [t[:2000] for t in stdlib_texts(400_000, skip=40)]
    texts += ["  two  spaces\ttab\n", "émoji 🎉 日本語", " lead", "a</s>b", "", "\u2581x"]
    for text in texts:
        ids = sp.encode(text)
        assert fast.encode(text, add_special_tokens=False).ids == ids, text[:80]
        assert fast.decode(ids, skip_special_tokens=False) == sp.decode(ids)


def test_tokenizer_refusals(tmp_path):
    sp = hft.parse_sentencepiece(Path(_dummy_prefix_spm(tmp_path)).read_bytes())
    with pytest.raises(hft.UnexportableTokenizer, match="remove_extra_whitespaces"):
        hft.check_tokenizer(sp)
    with pytest.raises(hft.UnexportableTokenizer, match="not a sentencepiece model"):
        hft.parse_sentencepiece(b"\x0f\x00garbage")


def _dummy_prefix_spm(tmp_path: Path) -> str:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["hello world"] * 50 + ["some other words here"] * 50),
        model_prefix=str(tmp_path / "d"),
        vocab_size=40,
        model_type="bpe",
        minloglevel=2,
        num_threads=1,
    )
    return str(tmp_path / "d.model")


# ---------------------------------------------------------------------------------------------
# the export


def test_export_names_shapes_layout(run, tok, tmp_path):
    from safetensors.numpy import load_file

    config, params = run
    assert ex.main(["--config", config, "--tokenizer", tok, "--out", str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "slipway_export.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    w = load_file(out / "model.safetensors")
    d, f, v, hd = 32, 64, VOCAB, 8
    expected = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    expected["lm_head.weight"] = (v, d)
    for i in range(2):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (4 * hd, d),
            p + "self_attn.k_proj.weight": (2 * hd, d),
            p + "self_attn.v_proj.weight": (2 * hd, d),
            p + "self_attn.o_proj.weight": (d, 4 * hd),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    assert {k: a.shape for k, a in w.items()} == expected
    assert all(a.dtype == np.float32 for a in w.values())
    layers = params.layers
    np.testing.assert_array_equal(w["model.embed_tokens.weight"], params.embed)
    np.testing.assert_array_equal(w["lm_head.weight"], np.asarray(params.lm_head).T)
    np.testing.assert_array_equal(
        w["model.layers.1.self_attn.q_proj.weight"], np.asarray(layers.attn.wq[1]).reshape(d, -1).T
    )
    np.testing.assert_array_equal(
        w["model.layers.0.self_attn.o_proj.weight"], np.asarray(layers.attn.wo[0]).reshape(-1, d).T
    )
    np.testing.assert_array_equal(
        w["model.layers.1.mlp.down_proj.weight"], np.asarray(layers.mlp.w_down[1]).T
    )
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (4, 2, hd)
    assert hf["max_position_embeddings"] == SEQ and hf["tie_word_embeddings"] is False
    # documents start after an EOS (never a BOS): generation and lm-eval's prefix start there
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (3, 3, 0)
    prov = json.loads((out / "slipway_export.json").read_text())
    assert prov["source"]["step"] == 3 and prov["source"]["checkpoint"].endswith("step-000000003")
    assert prov["tokenizer"]["sha256"] == ex.sha256(Path(tok).read_bytes())
    assert prov["config"]["model"]["hidden_dim"] == 32
    assert (out / "tokenizer.model").read_bytes() == Path(tok).read_bytes()
    assert prov["config_sha256"] in (out / "README.md").read_text()


def test_export_tied_embeddings_has_no_lm_head(tmp_path, tok):
    from safetensors.numpy import load_file

    config, _ = _run(tmp_path, tie_embeddings=True)
    assert ex.main(["--config", config, "--tokenizer", tok, "--out", str(tmp_path / "hf")]) == 0
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"]


def test_export_is_deterministic(run, tok, tmp_path, digest):
    config, _ = run
    for name in ("a", "b"):
        args = ["--config", config, "--tokenizer", tok, "--out", str(tmp_path / name)]
        assert ex.main(args) == 0
    assert digest(tmp_path / "a") == digest(tmp_path / "b")


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """A safetensors file's tensors as (dtype, shape, raw bytes), whatever the dtype
    (safetensors' NumPy API cannot read bfloat16)."""
    import safetensors

    return {
        name: (t["dtype"], tuple(t["shape"]), bytes(t["data"]))
        for name, t in safetensors.deserialize(path.read_bytes())
    }


def _exported(run: tuple[str, Transformer], tok: str, out: Path, *options: str) -> Path:
    assert ex.main(["--config", run[0], "--tokenizer", tok, "--out", str(out), *options]) == 0
    return out


def test_a_model_past_max_shard_size_is_written_as_transformers_shards(run, tok, tmp_path):
    whole = _tensors(_exported(run, tok, tmp_path / "one") / "model.safetensors")
    out = _exported(run, tok, tmp_path / "sharded", "--max-shard-size", "20KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 3 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(whole)  # every weight, once
    assert set(index["weight_map"].values()) == set(shards)
    merged: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for shard in shards:
        held = _tensors(out / shard)
        assert {k for k, f in index["weight_map"].items() if f == shard} == set(held)
        size = sum(len(data) for _, _, data in held.values())
        assert size <= 20_000 or len(held) == 1, (shard, size)  # only a weight alone may pass
        merged |= held
    assert merged == whole  # the same names, dtypes, shapes and bytes as the single file
    assert index["metadata"]["total_size"] == sum(len(d) for _, _, d in whole.values())
    # a weight past the limit (64 KiB) alone in its shard where it comes: the embedding first
    assert set(_tensors(out / shards[0])) == {"model.embed_tokens.weight"}
    assert {"lm_head.weight"} in [set(_tensors(out / shard)) for shard in shards]
    prov = json.loads((out / "slipway_export.json").read_text())
    written = sorted(p.name for p in out.iterdir() if p.name != "slipway_export.json")
    assert sorted(prov["files"]) == written
    assert all(prov["files"][f] == ex.sha256((out / f).read_bytes()) for f in written)


def test_an_export_over_an_earlier_one_leaves_no_stale_weights(run, tok, tmp_path):
    # transformers loads model.safetensors before it looks for an index: a sharded export
    # over a single-file one must not leave the old file (or the old provenance) behind
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own")
    single = sorted(p.name for p in _exported(run, tok, out).iterdir())
    _exported(run, tok, out, "--max-shard-size", "20KB")
    assert not (out / "model.safetensors").exists()
    assert (out / "model.safetensors.index.json").exists()
    _exported(run, tok, out)
    assert sorted(p.name for p in out.iterdir()) == single  # no shard and no index left
    assert (out / "notes.txt").read_text() == "the user's own"
    prov = json.loads((out / "slipway_export.json").read_text())
    assert sorted(prov["files"]) == sorted(set(single) - {"slipway_export.json", "notes.txt"})


def test_bfloat16_export_rounds_each_weight_once(run, tok, tmp_path):
    import ml_dtypes

    f32 = _tensors(_exported(run, tok, tmp_path / "f32") / "model.safetensors")
    bf16 = _tensors(
        _exported(run, tok, tmp_path / "bf16", "--dtype", "bfloat16") / "model.safetensors"
    )
    assert set(bf16) == set(f32)
    for name, (dtype, shape, data) in bf16.items():
        assert (dtype, shape) == ("BF16", f32[name][1])
        want = np.frombuffer(f32[name][2], np.float32).astype(ml_dtypes.bfloat16)
        assert data == want.tobytes(), name
    hf = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert hf["torch_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "bf16" / "slipway_export.json").read_text())["dtype"] == (
        "bfloat16"
    )
    assert "(bfloat16 safetensors)" in (tmp_path / "bf16" / "README.md").read_text()


def test_shards_are_converted_and_written_one_at_a_time(tmp_path, tok):
    """The host holds the parameters plus one shard in flight, not the model's weights
    converted and serialized whole (numpy's and bytes' allocations are traced; safetensors'
    own buffer, freed once copied into bytes, is not)."""
    import tracemalloc

    from trainer.config import load_config

    config, _ = _run(tmp_path, hidden_dim=128, intermediate_dim=384, num_layers=6)
    source = ex.check_exportable(load_config(config, require_data=False), tok)
    params = ex.load_source_params(source)
    total = sum(w.size * 4 for _, w in ex.hf_weights(params))
    largest = max(w.size * 4 for _, w in ex.hf_weights(params))
    tracemalloc.start()
    try:
        files = ex.export_files(source, params, max_shard_bytes=total // 16)
        ex.write_files(str(tmp_path / "hf"), files)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    shards = len(list((tmp_path / "hf").glob("model-*.safetensors")))
    assert shards >= 8
    # one shard converted and one serialized (measured 2.2 shards; 3.2 when the last shard's
    # bytes were still held while the next was built); the whole model would be 2 x total
    assert peak < 2.5 * max(largest, total // 16), (peak, total)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-shard-size", "5 GB"),
        ("--max-shard-size", "5GB;rm -rf /"),
        ("--max-shard-size", "0"),
        ("--max-shard-size", "5XB"),
        ("--dtype", "float16"),
    ],
)
def test_refuses_bad_export_options(run, tok, tmp_path, capsys, flag, value):
    config, _ = run
    argv = ["--config", config, "--tokenizer", tok, "--out", str(tmp_path / "hf"), flag, value]
    with pytest.raises(SystemExit) as exit_:
        ex.main(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_sizes_and_shard_plans():
    assert ex.parse_size("5GB") == ex.parse_size("5gb") == 5 * 10**9  # as huggingface_hub
    assert ex.parse_size("1.5GB") == 1_500_000_000
    assert ex.parse_size("2GiB") == 2 * 2**30
    assert ex.parse_size("1000") == 1000
    for bad in ("", "0", "0.1B", "\u0665GB", "5 GB", "1e9", "GB"):
        with pytest.raises(ValueError, match="is not a size"):
            ex.parse_size(bad)
    # huggingface_hub's cut (tests/parity checks it against the library): a weight past the
    # limit alone where it comes, the open shard kept open
    sizes = [("a", 4), ("b", 4), ("c", 9), ("d", 2), ("e", 3), ("f", 6)]
    assert ex.plan_shards(sizes, 8) == [["c"], ["a", "b"], ["d", "e"], ["f"]]
    assert ex.plan_shards([("a", 4), ("c", 9), ("d", 2)], 8) == [["c"], ["a", "d"]]
    assert ex.plan_shards(sizes, 100) == [["a", "b", "c", "d", "e", "f"]]


def _refused(capsys, argv: list[str], *needles: str) -> None:
    assert ex.main(argv) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err


def test_refuses_missing_checkpoint(run, tok, tmp_path, capsys):
    config, _ = run
    out = str(tmp_path / "hf")
    _refused(
        capsys,
        ["--config", config, "--tokenizer", tok, "--out", out, "--step", "7"],
        "step 7 does not exist",
        "complete ones: [3]",
    )
    elsewhere = ["--set", f"output_dir={tmp_path}/nothing"]
    _refused(
        capsys,
        ["--config", config, *elsewhere, "--tokenizer", tok, "--out", out],
        "no complete checkpoint",
    )
    assert not (tmp_path / "hf").exists()


def test_refuses_vocabulary_mismatch(run, tmp_path, capsys):
    config, _ = run
    other = _spm(tmp_path / "other", VOCAB + 40)
    _refused(
        capsys,
        ["--config", config, "--tokenizer", other, "--out", str(tmp_path / "hf")],
        f"vocabulary size {VOCAB + 40}",
        f"checkpoint's {VOCAB} embedding rows",
    )
    _refused(
        capsys,
        ["--config", config, "--tokenizer", str(tmp_path / "none.model"), "--out", "x"],
        "no file at",
    )
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x0f\x00garbage")  # hf_tokenizer's refusal, through the CLI
    _refused(
        capsys,
        ["--config", config, "--tokenizer", str(garbage), "--out", "x"],
        "tokenizer: not a sentencepiece model",
    )


def test_refuses_a_tokenizer_of_the_same_size_that_did_not_make_the_training_stores(
    tok, tmp_path, capsys
):
    # Same vocabulary size as the checkpoint: only the hash the trainer recorded in the run's
    # config.json (its training stores' tokenizer) tells the two apart.
    config, _ = _run(tmp_path)
    recorded = tmp_path / "run" / "config.json"
    recorded.write_text(json.dumps({"tokenizer_sha256": "0" * 64}), encoding="utf-8")
    argv = ["--config", config, "--tokenizer", tok, "--out", str(tmp_path / "hf")]
    _refused(capsys, argv, "is not the tokenizer of the model's training stores (000000000000)")
    assert not (tmp_path / "hf").exists()
    recorded.write_text(json.dumps({"tokenizer_sha256": ex.sha256(Path(tok).read_bytes())}))
    assert ex.main(argv) == 0


def test_a_model_padded_past_its_tokenizer_exports(tok, tmp_path, capsys):
    # model.vocab_size set larger than the tokenizer (padding rows, which the trainer allows):
    # the export keeps every row; a size the config did not ask for is still refused.
    config, _ = _run(tmp_path, vocab_size=VOCAB + 64)
    out = tmp_path / "hf"
    assert ex.main(["--config", config, "--tokenizer", tok, "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB + 64
    unpadded = ["--set", "model.vocab_size=0"]
    argv = ["--config", config, *unpadded, "--tokenizer", tok, "--out", str(tmp_path / "x")]
    _refused(capsys, argv, f"checkpoint's {VOCAB + 64} embedding rows")


def test_refuses_moe_before_reading_anything(tmp_path, tok, capsys):
    config, _ = _run(tmp_path, moe={"num_experts": 4, "top_k": 2})  # no checkpoint at all
    _refused(
        capsys,
        ["--config", config, "--tokenizer", tok, "--out", str(tmp_path / "hf")],
        "mixture-of-experts",
        "quantile-balancing selection bias",
        "shared expert",
        "no transformers architecture",
    )
    args = ["--config", config, "--tokenizer", tok, "--prompts", "-"]
    assert gen.main(args) == 2
    assert "mixture-of-experts" in capsys.readouterr().err


def test_export_and_generate_import_no_reference_or_platform_library():
    """The trainer image has neither torch nor transformers; the trainer never imports Airflow
    or Beam. A fresh interpreter: other tests of a session may have imported them."""
    code = (
        "import sys, trainer.export, trainer.generate; "
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers', 'airflow', "
        "'apache_beam') if m in sys.modules))"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# generation


@jax.jit
def _window_logits(params: Transformer, x: jax.Array) -> jax.Array:
    """The full forward over one window (1, SEQ): segments all 0, positions arange."""
    return params(x, jnp.zeros_like(x), jnp.arange(x.shape[1])[None])[0][0]


def _full_greedy(params: Transformer, prompt: list[int], n: int, eos: int) -> list[int]:
    """Argmax over the full forward, one token at a time. The window is right-padded to SEQ
    (one compilation): causal attention, so the padding never reaches earlier positions."""
    seq, new = list(prompt), []
    for _ in range(n):
        x = jnp.asarray([seq + [0] * (SEQ - len(seq))], jnp.int32)
        t = int(jnp.argmax(_window_logits(params, x)[len(seq) - 1]))
        new.append(t)
        seq.append(t)
        if t == eos:
            break
    return new


@pytest.mark.parametrize("tie", [False, True])
def test_cached_greedy_equals_full_forward_argmax(tie):
    params = init_model(resolve_model(_model_cfg(tie_embeddings=tie)), jax.random.key(2))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, VOCAB, n).tolist() for n in (1, 5, 17, 30)]
    got = gen.generate(params, prompts, eos_id=-1, max_new_tokens=12, batch_size=4)
    assert got == [_full_greedy(params, p, 12, -1) for p in prompts]
    # batch composition does not change greedy tokens
    assert got == [gen.generate(params, [p], eos_id=-1, max_new_tokens=12)[0] for p in prompts]


def test_cached_logits_match_full_forward():
    params = init_model(resolve_model(_model_cfg()), jax.random.key(3))
    seq = np.random.default_rng(1).integers(4, VOCAB, 20).tolist()
    full = _window_logits(params, jnp.asarray([seq + [0] * (SEQ - 20)], jnp.int32))[:20]
    shape = (2, 1, 24, 2, 8)
    caches = (jnp.zeros(shape), jnp.zeros(shape))
    off = jnp.asarray([4], jnp.int32)  # 4 slots of left padding
    padded = jnp.asarray([[0] * 4 + seq[:12]], jnp.int32)
    step = jax.jit(gen.cached_forward)
    first, caches = step(params, padded, caches, jnp.int32(0), off)
    rest = []
    for i, t in enumerate(seq[12:]):
        lg, caches = step(params, jnp.asarray([[t]], jnp.int32), caches, jnp.int32(16 + i), off)
        rest.append(lg[0, 0])
    cached = jnp.concatenate([first[0, 4:], jnp.stack(rest)])
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=0)


def test_generation_stops_at_eos_and_is_seeded():
    params = init_model(resolve_model(_model_cfg()), jax.random.key(2))
    prompt = [5, 6, 7, 8]
    greedy = gen.generate(params, [prompt], eos_id=-1, max_new_tokens=10)[0]
    eos = greedy[3]  # pretend the 4th greedy token is EOS: generation stops there, EOS kept
    stop = greedy.index(eos) + 1
    assert gen.generate(params, [prompt], eos_id=eos, max_new_tokens=10)[0] == greedy[:stop]
    kw = dict(eos_id=-1, max_new_tokens=10, temperature=1.0, top_p=0.9)
    a = gen.generate(params, [prompt, prompt[:2]], seed=7, **kw)
    assert a == gen.generate(params, [prompt, prompt[:2]], seed=7, **kw)
    assert a != gen.generate(params, [prompt, prompt[:2]], seed=8, **kw)
    assert all(0 <= t < VOCAB for row in a for t in row)
    # a nucleus that holds only the most likely token is greedy, whatever the temperature
    kw.update(top_p=1e-6, temperature=2.0)
    assert gen.generate(params, [prompt], seed=3, **kw)[0] == greedy


def test_pick_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    seen = {
        int(gen.pick(logits, jax.random.key(i), jnp.float32(1), jnp.float32(0.7), False)[0])
        for i in range(200)
    }
    assert seen == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops there


def test_generate_refuses_moe():
    cfg = resolve_model(_model_cfg(moe=MoEConfig(num_experts=4, top_k=2)))
    params = jax.eval_shape(lambda k: Transformer(cfg, k), jax.random.key(0))
    with pytest.raises(gen.GenerateError, match="mixture-of-experts"):
        gen.generate(params, [[5]], eos_id=3)


def test_read_prompts():
    text = 'plain line\n\n{"prompt": "from json", "id": 1}\n{not json\n'
    assert gen.read_prompts(text) == ["plain line", "from json", "{not json"]
    with pytest.raises(gen.GenerateError, match="line 1"):
        gen.read_prompts('{"text": "no prompt"}')


def test_generate_cli(run, tok, tmp_path, capsys):
    config, params = run
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('def main():\n{"prompt": "import os"}\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    args = ["--config", config, "--tokenizer", tok, "--prompts", str(prompts)]
    assert gen.main([*args, "--max-new-tokens", "6", "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [r["prompt"] for r in rows] == ["def main():", "import os"]
    sp = spm.SentencePieceProcessor(model_file=tok)
    for r in rows:
        assert r["token_ids"] == _full_greedy(params, sp.encode(r["prompt"]), 6, 3)
        assert r["stopped"] in ("eos", "length")
        ids = r["token_ids"][:-1] if r["stopped"] == "eos" else r["token_ids"]
        assert r["completion"] == sp.decode(ids)
    assert "past the" not in capsys.readouterr().err
    # a generation longer than the trained context runs, and says so
    assert gen.main([*args, "--max-new-tokens", str(SEQ), "--output", str(out)]) == 0
    assert f"positions, past the {SEQ} the model was trained on" in capsys.readouterr().err
    assert gen.main([*args, "--step", "9"]) == 2
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x0f\x00garbage")  # a parse error, not a traceback (exit 1)
    bad = ["--config", config, "--tokenizer", str(garbage), "--prompts", str(prompts)]
    assert gen.main(bad) == 2
