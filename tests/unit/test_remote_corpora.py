"""Corpora on an object store: fetch stages locally and uploads, the graph reads it there.

``memory://`` is fsspec's in-process filesystem, standing in for ``gs://`` (same fsspec calls;
no bucket is reachable here). The registry fetch itself is replaced by one that writes the
tiny synthetic corpora, as ``pipelines.corpora.fetch.fetch`` would lay them out.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import fsspec
import pytest

from tests.support.tiny_pipeline import make_corpora, tiny_conf


@pytest.fixture
def bucket():
    fs = fsspec.filesystem("memory")
    root = "memory://corpora-test"
    yield root
    if fs.exists("/corpora-test"):
        fs.rm("/corpora-test", recursive=True)


@pytest.fixture
def fake_fetch(tmp_path, monkeypatch):
    """Replaces the registry fetch: writes synthetic corpora into the folder it is given."""
    from pipelines.corpora import fetch

    calls: list[tuple[str, list[str]]] = []
    synthetic = make_corpora(tmp_path / "synthetic")

    def fetch_synthetic(data_dir, only=None, **_):
        calls.append((str(data_dir), list(only or [])))
        infos = []
        for folder in ("raw", "eval"):
            for f in sorted((synthetic / folder).iterdir()):
                name = f.name.removesuffix(".jsonl.gz")
                if folder == "raw" and name not in (only or [name]):
                    continue
                if folder == "eval" and "eval" not in (only or ["eval"]):
                    continue
                out = Path(data_dir) / folder / f.name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(f.read_bytes())
                infos.append(
                    fetch.OutputInfo(name, folder, f"{folder}/{f.name}", 0, 0, 0, "", True)
                )
        return infos

    monkeypatch.setattr(fetch, "fetch", fetch_synthetic)
    return calls


def test_remote_data_dir_is_staged_locally_and_uploaded(bucket, fake_fetch, monkeypatch):
    from operators.corpora import fetch_into

    monkeypatch.delenv("SLIPWAY_FETCH_CACHE", raising=False)
    written = fetch_into(bucket, ["brown", "eval"])
    staged = fake_fetch[0][0]
    assert "://" not in staged and not os.path.exists(staged)  # temporary, cleaned up
    assert f"{bucket}/raw/brown.jsonl.gz" in written
    assert f"{bucket}/raw/fortunes.jsonl.gz" not in written  # only what was missing
    fs = fsspec.filesystem("memory")
    with fs.open("/corpora-test/raw/brown.jsonl.gz", "rb") as f:
        assert gzip.decompress(f.read()).count(b"\n") > 0
    assert any(p.startswith(f"{bucket}/eval/") for p in written)


def test_graph_reads_remote_corpora_and_versions_them_by_content(
    bucket, fake_fetch, tmp_path, monkeypatch
):
    from airflow.sdk.definitions.param import ParamsDict

    from operators.corpora import fetch_into
    from operators.params import pipeline_params
    from operators.pipeline.graph import build_graph, content_id

    fetch_into(bucket, ["brown", "fortunes", "eval"])
    params = ParamsDict()
    params.update(pipeline_params())
    params.update(tiny_conf(tmp_path / "unused"))
    params["data_dir"] = ""  # the form takes gs:// only; the setting takes any fsspec URL
    monkeypatch.setenv("SLIPWAY_DATA_DIR", bucket)
    graph = build_graph(params.validate())
    assert graph.raw_inputs["brown"] == f"{bucket}/raw/brown.jsonl.gz"
    assert graph.eval_sets and all(
        p.startswith(f"{bucket}/eval/") for p in graph.eval_sets.values()
    )
    before = graph.stages["ingest"][0].step.key

    # Same bytes uploaded again: same version. New bytes: a new version.
    fs = fsspec.filesystem("memory")
    same = fs.cat_file("/corpora-test/raw/brown.jsonl.gz")
    fs.pipe_file("/corpora-test/raw/brown.jsonl.gz", same)
    assert build_graph(params.validate()).stages["ingest"][0].step.key == before
    fs.pipe_file("/corpora-test/raw/brown.jsonl.gz", gzip.compress(b'{"id": "x", "text": "y"}\n'))
    assert content_id(f"{bucket}/raw/brown.jsonl.gz").startswith("sha256:")
    assert build_graph(params.validate()).stages["ingest"][0].step.key != before


@pytest.mark.parametrize(
    "value, ok",
    [
        ("", True),
        ("/srv/corpora", True),
        ("gs://my-bucket/corpora/v1", True),
        ("data", False),  # relative
        ("/srv/../etc", False),
        ("gs://my-bucket/a/../b", False),
        ("/srv/corpora\nrm -rf", False),
        ("s3://elsewhere/x", False),
        ("gs://UPPER/x", False),
    ],
)
def test_data_dir_is_validated_by_the_form(value, ok):
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    from operators.params import pipeline_params

    params = ParamsDict()
    params.update(pipeline_params())
    if ok:
        params["data_dir"] = value  # assignment validates too
        params.validate()
    else:
        with pytest.raises(ParamValidationError, match="data_dir"):
            params["data_dir"] = value
            params.validate()
