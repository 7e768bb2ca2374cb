"""A step's version stands for what it computes: its config, and -- through the graph's
``OUTPUT_VERSIONS`` numbers -- the code and defaults its config does not spell out.

A default changed in ``pipelines/configs.py`` or ``trainer/config.py`` / ``trainer/shapes.py``
changes what a step writes but not its config: without a bump of its number, runs would
reuse outputs computed the old way. The digests below are of those defaults; when this test
fails, bump the step's number in ``operators/pipeline/graph.py`` ``OUTPUT_VERSIONS`` (so the
step and everything downstream recompute) and record the new digest and number here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from tests.support.tiny_pipeline import tiny_params

# kind -> (its OUTPUT_VERSIONS number, the digest of its config's defaults)
DEFAULTS = {
    "ingest": (0, "9611c8b86f87c611"),
    "quality": (1, "643110d30b7d2daa"),
    "exact_dedup": (1, "58f317ce148b6476"),
    "fuzzy_dedup": (0, "905fb65050e38fd2"),
    "decontaminate": (1, "c3233ac9d230a9f7"),
    "train_tokenizer": (1, "fac0146f727238c7"),
    "tokenize": (1, "f7345a436c411f46"),
    "train": (0, "f3d5e7dabb7c015b"),  # TrainConfig's defaults and every preset's shape
}


def _digest(body: object) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=list).encode()).hexdigest()[:16]


def _defaults(kind: str) -> object:
    from pipelines.configs import config_type
    from trainer.config import TrainConfig
    from trainer.shapes import PRESETS

    if kind == "train":
        presets = {name: dataclasses.asdict(shape) for name, shape in PRESETS.items()}
        return {"config": dataclasses.asdict(TrainConfig()), "presets": presets}
    return dataclasses.asdict(config_type(kind)())


@pytest.mark.parametrize("kind", sorted(DEFAULTS))
def test_a_changed_default_comes_with_a_bumped_output_version(kind):
    from operators.pipeline.graph import OUTPUT_VERSIONS

    found = (OUTPUT_VERSIONS[kind], _digest(_defaults(kind)))
    assert found == DEFAULTS[kind], (
        f"{kind}'s defaults or number changed: if what it writes changed, bump "
        f"OUTPUT_VERSIONS[{kind!r}] in operators/pipeline/graph.py; then record {found} here"
    )


@pytest.fixture
def params(tmp_path):
    return tiny_params(tmp_path / "data")


def test_a_bump_recomputes_the_step_and_everything_downstream(params, monkeypatch):
    from operators.pipeline import graph

    def keys() -> dict[str, str]:
        g = graph.build_graph(params)
        return {s.name: s.key for s in g.all_steps()}

    before = keys()
    number = graph.OUTPUT_VERSIONS["quality"]
    monkeypatch.setitem(graph.OUTPUT_VERSIONS, "quality", number + 1)
    after = keys()
    upstream = {"ingest"}
    changed = {name for name in before if before[name] != after[name]}
    assert "quality" in changed and not changed & upstream
    assert {"exact_dedup", "split", "train", "evaluate", "export"} <= changed
    monkeypatch.setitem(graph.OUTPUT_VERSIONS, "quality", number)
    assert keys() == before
    # 0 enters no version: the versions from before the numbers stand
    monkeypatch.setitem(graph.OUTPUT_VERSIONS, "ingest", 0)
    assert "output_version" not in graph.build_graph(params).stages["ingest"][0].step.config
