"""Fuzzy dedup end to end: planted near-duplicates found, nothing lost, deterministic, linear."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from apache_beam.pvalue import TaggedOutput

from pipelines import fuzzy_dedup, spill
from pipelines.beam_io import read_dead_letters, read_documents
from pipelines.fuzzy_dedup import (
    FuzzyDedupConfig,
    NonConvergenceError,
    components_in_memory,
    convergence_summary,
)
from pipelines.minhash import jaccard, shingle_set
from pipelines.stage import StageError, config_from_mapping, run_stage
from tests.support.sharded import write_id_sharded_output

SEED = 20240611
POSITIVE = 0.85  # pairs above this true Jaccard must end up together (recall)
NEGATIVE = 0.6  # pairs below this true Jaccard must never end up together
MULTI_PROCESSING = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]


# ---- a corpus with planted near-duplicates at known Jaccard similarities ----------------------


def _vocabulary(rng: random.Random, size: int = 20_000) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choices(letters, k=rng.randint(3, 9))))
    return sorted(words)


def _shingles(words: list[str]) -> set[tuple[str, ...]]:
    return shingle_set(" ".join(words))


def _variant(base: list[str], target: float, rng: random.Random, vocab: list[str]) -> list[str]:
    """Replace/insert words until the exact shingle Jaccard with ``base`` is closest to target."""
    edits = [(rng.random() < 0.75, rng.random(), rng.choice(vocab)) for _ in range(len(base))]

    def apply(m: int) -> list[str]:
        words = list(base)
        for replace, where, word in edits[:m]:
            position = int(where * len(words))
            if replace:
                words[position] = word
            else:
                words.insert(position, word)
        return words

    base_set = _shingles(base)
    similarity = {}

    def sim(m: int) -> float:
        if m not in similarity:
            similarity[m] = jaccard(base_set, _shingles(apply(m)))
        return similarity[m]

    lo, hi = 0, len(edits)  # sim(lo) >= target > sim(hi), sim roughly decreasing in m
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if sim(mid) >= target else (lo, mid)
    best = min((lo, hi), key=lambda m: abs(sim(m) - target))
    return apply(max(best, 1))


def planted_corpus(seed: int, groups: int, singletons: int) -> tuple[list[dict], dict[str, int]]:
    """Documents and their planted group: a base document plus variants at target Jaccards.

    Per group: 2-4 near-duplicates (J in [0.86, 0.99]), 1-2 dissimilar rewrites (J 0.3-0.55)
    and, in a third of the groups, a grey-zone rewrite (J ~0.7) that should stay apart.
    Unrelated documents share no shingle (uniform words from a 20k vocabulary).
    """
    rng = random.Random(seed)
    vocab = _vocabulary(rng)
    texts: list[tuple[list[str], int]] = []
    for group in range(groups):
        base = rng.choices(vocab, k=rng.randint(80, 300))
        texts.append((base, group))
        targets = [rng.uniform(0.86, 0.99) for _ in range(rng.randint(2, 4))]
        targets += rng.sample([0.3, 0.45, 0.55], rng.randint(1, 2))
        if rng.random() < 1 / 3:
            targets.append(0.7)
        texts += [(_variant(base, t, rng, vocab), group) for t in targets]
    for i in range(singletons):
        texts.append((rng.choices(vocab, k=rng.randint(20, 300)), groups + i))
    rng.shuffle(texts)
    docs, group_of = [], {}
    for words, group in texts:
        doc_id = f"doc-{rng.getrandbits(48):012x}"
        # Sentence-like surface (case, punctuation) that tokenization must see through.
        text = " ".join(words).capitalize().replace(" ", ", ", 1) + "."
        docs.append({"id": doc_id, "text": text, "source": "planted", "metadata": {}})
        group_of[doc_id] = group
    return docs, group_of


def write_jsonl(path: Path, records: list[object]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def clusters_of(out: Path) -> tuple[dict[str, str], list[dict], list[dict]]:
    kept = list(read_documents(str(out)))
    letters = list(read_dead_letters(str(out)))
    cluster = {d["id"]: d["metadata"]["fuzzy_dedup"]["cluster"] for d in kept}
    for letter in letters:
        if letter["reason"] == "fuzzy_duplicate":
            cluster[letter["record"]["id"]] = letter["cluster"]
    return cluster, kept, letters


def _components(nodes: list[str], edges: list[tuple[str, str]]) -> dict[str, str]:
    parent = {n: n for n in nodes}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        parent[find(a)] = find(b)
    return {n: find(n) for n in nodes}


# ---- quality -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quality_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    docs, group_of = planted_corpus(SEED, groups=300, singletons=300)
    source = write_jsonl(root / "docs.jsonl", docs)
    run = run_stage(
        "fuzzy_dedup", fuzzy_dedup.build, FuzzyDedupConfig(), [source], str(root / "out")
    )
    return docs, group_of, root / "out", run


def test_planted_near_duplicates_are_found(quality_run):
    docs, group_of, out, run = quality_run
    cluster, _, _ = clusters_of(out)
    sets = {d["id"]: shingle_set(d["text"]) for d in docs}
    by_group: dict[int, list[str]] = defaultdict(list)
    for doc_id, group in group_of.items():
        by_group[group].append(doc_id)
    truth = {}  # exact Jaccard of every pair inside a planted group
    for members in by_group.values():
        for a, b in itertools.combinations(sorted(members), 2):
            truth[a, b] = jaccard(sets[a], sets[b])
    component = _components(list(sets), [p for p, j in truth.items() if j >= 0.8])

    members_of: dict[str, list[str]] = defaultdict(list)
    for doc_id, cid in cluster.items():
        members_of[cid].append(doc_id)
    together = [
        pair for ms in members_of.values() for pair in itertools.combinations(sorted(ms), 2)
    ]
    positives = [p for p, j in truth.items() if j > POSITIVE]
    found = [p for p in positives if cluster[p[0]] == cluster[p[1]]]
    correct = [p for p in together if component[p[0]] == component[p[1]]]
    lowest = min(truth.get(p) or jaccard(sets[p[0]], sets[p[1]]) for p in together)
    recall, precision = len(found) / len(positives), len(correct) / len(together)
    print(
        f"\nplanted quality: {len(docs)} docs, {len(positives)} pairs with J > {POSITIVE},"
        f" {len(together)} pairs clustered: recall {recall:.4f}, precision {precision:.4f},"
        f" lowest clustered J {lowest:.3f}, {run.seconds:.1f}s"
    )
    assert recall >= 0.95
    assert precision >= 0.99
    assert lowest >= NEGATIVE  # no pair below 0.6 ever ends up in one cluster


def test_nothing_lost_and_every_document_annotated(quality_run):
    docs, _, out, run = quality_run
    manifest = run.manifest
    cluster, kept, letters = clusters_of(out)
    assert manifest.records_in == len(docs)
    assert manifest.records_in == manifest.records_out + sum(manifest.dropped.values())
    assert set(manifest.dropped) == {"fuzzy_duplicate"}
    assert {d["id"] for d in kept} | {lt["record"]["id"] for lt in letters} == {
        d["id"] for d in docs
    }
    kept_ids = {d["id"] for d in kept}
    sizes: dict[str, int] = defaultdict(int)
    for cid in cluster.values():
        sizes[cid] += 1
    for doc in kept:
        info = doc["metadata"]["fuzzy_dedup"]
        assert info["cluster"] == doc["id"]  # the canonical document names its cluster
        assert info["cluster_size"] == sizes[doc["id"]]
    text_of = {d["id"]: d["text"] for d in docs}
    for letter in letters:
        assert letter["stage"] == "fuzzy_dedup"
        assert letter["duplicate_of"] == letter["cluster"] in kept_ids
        assert letter["record"]["metadata"]["fuzzy_dedup"]["cluster"] == letter["cluster"]
        # Canonical = longest text, then smallest id.
        canonical, mine = text_of[letter["duplicate_of"]], letter["record"]["text"]
        assert (len(canonical), letter["record"]["id"]) > (len(mine), letter["duplicate_of"])


def test_manifest_records_parameters_and_graph(quality_run):
    _, _, _, run = quality_run
    extra = run.manifest.extra
    assert (extra["num_perm"], extra["bands"], extra["rows"], extra["threshold"]) == (
        256,
        23,
        11,
        0.8,
    )
    assert extra["cc_converged"] is True and extra["cc_unconverged_nodes"] == 0
    assert 1 <= extra["cc_rounds"] <= extra["cc_max_rounds"] == 12
    assert extra["candidate_pairs"] >= extra["verified_edges"] > 0
    assert 290 <= extra["clusters"] <= 300  # about one cluster per planted group
    assert (
        extra["documents_in_clusters"] - extra["clusters"]
        == run.manifest.dropped["fuzzy_duplicate"]
    )
    print(
        "\nmanifest extra:",
        {k: v for k, v in extra.items() if k != "cc_unconverged_by_round"},
    )


# ---- determinism -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_input(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("small")
    docs, _ = planted_corpus(SEED + 1, groups=20, singletons=20)
    docs += [
        {"id": "no-words", "text": "... !!! ...", "source": "edge"},
        {"id": "same-id", "text": "one text here", "source": "edge"},
        {"id": "same-id", "text": "two text here", "source": "edge"},  # same id, same length
        {"id": "no-text", "source": "edge"},  # invalid: dead-lettered by the harness
    ]
    return write_jsonl(root / "docs.jsonl", docs)


def _command_line(
    source: str, out: Path, config: str, *beam_args: str
) -> subprocess.CompletedProcess:
    """``python -m pipelines.fuzzy_dedup ...`` in a child process, which must succeed."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.fuzzy_dedup",
            "--input",
            source,
            "--output",
            str(out),
            "--config",
            config,
            *beam_args,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_deterministic_in_process_and_multi_processing(small_input, tmp_path, digest):
    # In process through the harness, then on 2 worker processes through the command line
    # (which runs the stage as __main__: everything it ships to workers must pickle).
    config = FuzzyDedupConfig(max_rounds=2)  # fewer unrolled rounds: a faster, same-code run
    run = run_stage("fuzzy_dedup", fuzzy_dedup.build, config, [small_input], str(tmp_path / "a"))
    child = _command_line(small_input, tmp_path / "mp", '{"max_rounds": 2}', *MULTI_PROCESSING)
    stdout = child.stdout
    manifest = run.manifest
    assert json.loads(stdout)["config"] == dataclasses.asdict(config)
    assert (tmp_path / "mp" / "manifest.json").read_text() == stdout
    assert manifest.records_in == manifest.records_out + sum(manifest.dropped.values())
    assert manifest.dropped["duplicate_id"] == 1 and manifest.dropped["missing_text"] == 1
    assert manifest.extra["documents_without_shingles"] == 1
    assert manifest.extra["cc_converged"] is True
    assert digest(tmp_path / "a") == digest(tmp_path / "mp")


def test_the_shard_path_writes_what_the_shuffle_path_writes(small_input, tmp_path, digest):
    """An id-sharded stage output is read shard by shard (documents never shuffled; here on 2
    worker processes), the same files as a glob through the harness: the same bytes."""
    lines = Path(small_input).read_text().splitlines()
    docs = [json.loads(line) for line in lines if "no-text" not in line]
    bad = [line + "\n" for line in lines if "no-text" in line]
    sharded = write_id_sharded_output(tmp_path / "sharded", docs, 3, {2: bad})
    config = FuzzyDedupConfig(max_rounds=2)
    files = str(sharded / "data" / "*.jsonl.gz")
    shuffled = run_stage(
        "fuzzy_dedup", fuzzy_dedup.build, config, [files], str(tmp_path / "s"), num_shards=3
    )
    child = _command_line(
        str(sharded),
        tmp_path / "by_shard",
        '{"max_rounds": 2}',
        "--num_shards=3",
        *MULTI_PROCESSING,
    )
    assert "documents stay in their shard" in child.stderr
    by_shard = json.loads(child.stdout)
    for name in ("records_in", "records_out", "dropped", "extra"):
        assert by_shard[name] == getattr(shuffled.manifest, name), name
    assert by_shard["dropped"]["duplicate_id"] == 1 and by_shard["dropped"]["missing_text"] == 1
    for sub in ("data", "dead_letter"):
        assert digest(tmp_path / "by_shard" / sub) == digest(tmp_path / "s" / sub), sub


# ---- scale shapes: a big bucket, a long chain, a document that breaks hashing ------------------


def _pages(n: int) -> list[dict]:
    """Boilerplate pages: one 400-word template plus one word each, all in the same buckets."""
    rng = random.Random(SEED)
    vocab = _vocabulary(rng, 5_000)
    boilerplate = " ".join(rng.choices(vocab, k=400))
    docs = [
        {"id": f"page-{i:04d}", "text": f"{boilerplate} {rng.choice(vocab)}", "source": "web"}
        for i in range(n)
    ]
    docs[123]["text"] += " and a longer footer"  # the longest text is the canonical one
    return docs


def _chain(n: int, shift: int = 10, width: int = 200) -> list[dict]:
    """Sliding windows over one word stream: neighbours J~0.9, ends of the chain J = 0."""
    rng = random.Random(SEED + 2)
    stream = rng.choices(_vocabulary(rng, 5_000), k=shift * n + width)
    docs = [
        {"id": f"c{rng.getrandbits(32):08x}", "text": " ".join(stream[i * shift :][:width])}
        for i in range(n)
    ]
    return [dict(d, source="chain") for d in docs]


@pytest.fixture(scope="module")
def shapes_run(tmp_path_factory):
    """One run over 300 boilerplate pages, a 40-document chain and a document that breaks."""
    root = tmp_path_factory.mktemp("shapes")
    real = fuzzy_dedup.signatures

    def fragile(texts, hasher):
        if any("BOOM" in t for t in texts):
            raise ValueError("cannot hash this")
        return real(texts, hasher)

    docs = [*_pages(300), *_chain(40), {"id": "bad", "text": "BOOM " * 20, "source": "edge"}]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fuzzy_dedup, "signatures", fragile)  # the in-process runner sees it
        run = run_stage(
            "fuzzy_dedup",
            fuzzy_dedup.build,
            FuzzyDedupConfig(max_rounds=6),
            [write_jsonl(root / "docs.jsonl", docs)],
            str(root / "out"),
        )
    kept = {d["id"]: d for d in read_documents(str(root / "out"))}
    return run.manifest, kept


def test_big_bucket_is_linked_linearly(shapes_run):
    manifest, kept = shapes_run
    extra = manifest.extra
    assert extra["largest_bucket"] >= 290  # a unique word may move a few out of a band
    # Members link to their bucket's head: a few heads per page (bands where the longest
    # page's footer moved it out) and at most one per band per chain document, where all
    # pairs of one 300-page bucket alone would be 300 * 299 / 2 = 44850.
    assert extra["candidate_pairs"] <= 3 * 300 + 23 * 40
    assert kept["page-0123"]["metadata"]["fuzzy_dedup"] == {
        "cluster": "page-0123",
        "cluster_size": 300,
    }
    assert not any(doc_id.startswith("page-") and doc_id != "page-0123" for doc_id in kept)


def test_transitive_chain_is_one_cluster(shapes_run):
    manifest, kept = shapes_run
    extra = manifest.extra
    assert extra["cc_converged"] is True and extra["cc_rounds"] > 1
    (chain,) = [d for d in kept.values() if d["source"] == "chain"]
    # The chain's two ends share no shingle: one cluster only through transitivity.
    assert chain["metadata"]["fuzzy_dedup"]["cluster_size"] == 40
    assert extra["clusters"] == 2 and extra["largest_cluster"] == 300
    assert manifest.records_out == 3 and manifest.dropped == {"fuzzy_duplicate": 338}


def test_a_document_that_breaks_hashing_is_kept(shapes_run):
    manifest, kept = shapes_run
    assert manifest.extra["signature_errors"] == 1
    assert kept["bad"]["metadata"]["fuzzy_dedup"] == {"cluster": "bad", "cluster_size": 1}


def test_nonconvergence_fails_only_when_asked():
    counts = [(1, 9), (2, 4), (3, 0)]
    assert convergence_summary(counts, 2, fail=True)["cc_rounds"] == 2
    with pytest.raises(NonConvergenceError, match="did not converge in 1 rounds"):
        convergence_summary([(1, 9), (2, 4)], 1, fail=True)
    summary = convergence_summary([(1, 9), (2, 4)], 1, fail=False)
    assert summary["cc_converged"] is False and summary["cc_rounds"] is None


# ---- connected components, without Beam --------------------------------------------------------


@pytest.mark.parametrize("shape", ["chain", "tree", "random"])
def test_star_rounds_find_the_components(shape):
    rng = random.Random(shape)
    nodes = [(0, f"n{i:05d}") for i in range(600)]
    rng.shuffle(nodes)
    if shape == "chain":
        edges = list(itertools.pairwise(nodes))
    elif shape == "tree":
        edges = [(nodes[i], nodes[rng.randrange(i)]) for i in range(1, len(nodes))]
    else:
        edges = [tuple(rng.sample(nodes, 2)) for _ in range(500)]
    edges = {(max(a, b), min(a, b)) for a, b in edges}
    outputs = list(components_in_memory(sorted(edges), 12))
    labels = [out for out in outputs if not isinstance(out, TaggedOutput)]
    unconverged_rounds = {out.value[0] for out in outputs if isinstance(out, TaggedOutput)}
    assert 1 in unconverged_rounds and 13 not in unconverged_rounds  # stars by the labelling
    expected = _components([n[1] for n in nodes], [(a[1], b[1]) for a, b in edges])  # union-find
    assert sorted(node for _, node in labels) == sorted({n for e in edges for n in e})
    for root, node in labels:
        assert expected[node[1]] == expected[root[1]]
        assert root == min(n for n in nodes if expected[n[1]] == expected[root[1]])


@pytest.mark.parametrize("max_rounds", [1, 6])
def test_in_memory_rounds_write_what_the_distributed_rounds_write(
    max_rounds, tmp_path, digest, monkeypatch
):
    """The local runner's one-step rounds against the unrolled ones (what Dataflow runs): same
    clusters and the same per-round counts, converged (6 rounds) or not (1 round)."""
    inputs = [write_jsonl(tmp_path / "chain.jsonl", _chain(40))]
    config = FuzzyDedupConfig(max_rounds=max_rounds)
    local = run_stage("fuzzy_dedup", fuzzy_dedup.build, config, inputs, str(tmp_path / "local"))
    monkeypatch.setattr(spill, "runs_locally", lambda pipeline: False)
    unrolled = run_stage("fuzzy_dedup", fuzzy_dedup.build, config, inputs, str(tmp_path / "out"))
    assert local.manifest.extra == unrolled.manifest.extra
    assert local.manifest.extra["cc_converged"] is (max_rounds == 6)
    for sub in ("data", "dead_letter"):
        assert digest(tmp_path / "local" / sub) == digest(tmp_path / "out" / sub), sub


# ---- non-convergence and config ----------------------------------------------------------------


def test_nonconvergence_is_recorded_and_falls_back_safely(tmp_path):
    # One round cannot resolve a 40-document chain: the run records it and falls back.
    run = run_stage(
        "fuzzy_dedup",
        fuzzy_dedup.build,
        FuzzyDedupConfig(max_rounds=1),
        [write_jsonl(tmp_path / "chain.jsonl", _chain(40))],
        str(tmp_path / "out"),
    )
    manifest = run.manifest
    extra = manifest.extra
    assert extra["cc_converged"] is False and extra["cc_rounds"] is None
    assert extra["cc_unconverged_nodes"] > 0
    # The fallback only splits the cluster: more documents kept, none lost.
    assert 1 < manifest.records_out < 40
    assert manifest.records_in == 40 == manifest.records_out + manifest.dropped["fuzzy_duplicate"]


def test_bad_config_is_refused():
    with pytest.raises(
        StageError, match=r"unknown config field\(s\) for FuzzyDedupConfig: treshold"
    ):
        config_from_mapping(FuzzyDedupConfig, {"treshold": 0.8})
    with pytest.raises(StageError, match="bands"):
        config_from_mapping(FuzzyDedupConfig, {"bands": 300, "rows": 2})
    with pytest.raises(StageError, match="threshold"):
        config_from_mapping(FuzzyDedupConfig, {"threshold": 1.5})
