"""Config: file loading (YAML/JSON), --set overrides, validation naming the field."""

from __future__ import annotations

import json

import pytest

from trainer.config import ConfigError, ModelConfig, load_config, parse_overrides, resolve_model

BASE = {
    "output_dir": "/tmp/run",
    "steps": 10,
    "data": {"sources": [{"path": "/data/a", "weight": 0.7}, {"path": "/data/b", "weight": 0.3}]},
    "model": {"preset": "nano"},
    "optimizer": {"warmup_steps": 2},
}


def test_yaml_and_json_files_and_overrides(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(BASE))
    (tmp_path / "c.yaml").write_text(
        "output_dir: /tmp/run\nsteps: 10\ndata:\n  sources:\n"
        "    - {path: /data/a, weight: 0.7}\n"
        "    - {path: /data/b, weight: 0.3}\nmodel: {preset: nano}\n"
        "optimizer: {warmup_steps: 2}\n"
    )
    a = load_config(str(tmp_path / "c.json"))
    b = load_config(str(tmp_path / "c.yaml"))
    assert a == b and a.data.sources[1].weight == 0.3
    c = load_config(
        str(tmp_path / "c.yaml"),
        [
            "steps=200",
            "optimizer.learning_rate=3e-4",
            "optimizer.decay=wsd",
            "model.tie_embeddings=true",
            "model.moe={num_experts: 4, top_k: 1}",
        ],
    )
    assert c.steps == 200 and c.optimizer.learning_rate == 3e-4 and c.optimizer.decay == "wsd"
    assert c.model.tie_embeddings and c.model.moe.num_experts == 4
    hash(c)  # frozen all the way down


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("steps=0", "steps"),
        ("optimizer.warmup_steps=11", "optimizer.warmup_steps"),
        ("optimizer.decay=exp", "optimizer.decay"),
        ("optimizer.beta2=1.5", "optimizer.beta2"),
        ("model.preset=13b", "model.preset"),
        ("model.num_kv_heads=3", "model.num_kv_heads"),
        ("model.moe={num_experts: 4, top_k: 4}", "model.moe.top_k"),
        ("data.sources=[{path: /a, weight: -1}]", "data.sources[0].weight"),
        ("data.sources=[]", "data.sources"),
        ("mesh.tensor=0", "mesh.tensor"),
        ("batch_size=abc", "batch_size"),
        ("model.colour=red", "model.colour"),
        ("distributed.mode=explicit", "distributed.coordinator_address"),
        ("checkpoint.keep=0", "checkpoint.keep"),
        ("checkpoint.write_threads=-1", "checkpoint.write_threads"),
    ],
)
def test_invalid_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*_flat(BASE), override])
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


def _flat(body, prefix=""):
    out = []
    for k, v in body.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={json.dumps(v)}")
    return out


def test_override_syntax():
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}
    with pytest.raises(ConfigError):
        parse_overrides(["novalue"])


def test_preset_resolution_fills_shape_and_vocab():
    m = resolve_model(ModelConfig(preset="600m", num_layers=2), vocab_size=1000)
    assert (m.hidden_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (
        1024,
        2,
        16,
        8,
        64,
    )
    assert m.vocab_size == 1000


def test_cli_rejects_bad_config_before_compute(tmp_path, capsys):
    from trainer.train import EXIT_CONFIG, main

    code = main(["--set", "output_dir=" + str(tmp_path), "--set", "steps=-5"])
    assert code == EXIT_CONFIG
    assert "steps: must be > 0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written, nothing computed


def test_config_from_an_fsspec_uri():
    # gs:// goes through the same fsspec path (with gcsfs installed); memory:// needs nothing
    import fsspec

    with fsspec.open("memory://slipway/run.yaml", "w") as f:
        f.write(json.dumps(BASE))
    cfg = load_config("memory://slipway/run.yaml", ["steps=7"])
    assert cfg.steps == 7 and cfg.model.preset == "nano"
    with pytest.raises(ConfigError) as err:
        fs = fsspec.filesystem("memory")
        fs.pipe("/slipway/bad.yaml", b"steps: [1, 2]\n")
        load_config("memory://slipway/bad.yaml")
    assert err.value.field == "steps"
