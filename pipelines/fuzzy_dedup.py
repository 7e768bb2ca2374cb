"""Stage 4, fuzzy dedup: MinHash LSH near-duplicate clusters, one canonical document kept each.

    python -m pipelines.fuzzy_dedup --input out/exact_dedup --output out/fuzzy_dedup \\
        --config '{"threshold": 0.8}' [--runner DataflowRunner ...]

Steps, all distributed on a distributed runner (no step gathers all documents or all edges on
one worker; a local runner's one process runs step 4 in one piece, see there):

1. **Signatures**: batches of documents -> MinHash signatures of their word 5-gram shingles
   (``pipelines.minhash``, vectorized), and one LSH bucket key per band.
2. **Candidates**: documents grouped by bucket; every member is linked to the bucket's head
   (its smallest node) rather than to every other member, so a bucket of ``m`` documents
   (boilerplate) costs ``m - 1`` candidate pairs, not ``m^2 / 2``.
3. **Verification**: a candidate pair becomes an edge only if the Jaccard estimated from the
   two full signatures reaches ``threshold`` (LSH collisions alone are not evidence).
4. **Connected components** of the edges by alternating *large-star* / *small-star* rounds
   (Kiveris et al., "Connected Components in MapReduce and Beyond", SoCC 2014), unrolled to
   ``max_rounds`` rounds inside the pipeline. Each round is two shuffles of the edge list and
   converges to one star per component centred on the component's smallest node.
   Convergence is checked locally at every node (the graph is a union of stars iff every node
   has either only larger neighbours or exactly one, smaller, neighbour) and counted per round.
   On a local runner, whose one process holds every edge anyway, the same rounds run on the
   whole edge list in one step and stop at convergence (same labels, same counts).
5. **Resolution**: nodes are ordered by (longest text, then smallest id), so the component
   minimum *is* the canonical document; it is kept, the rest are dead-lettered as
   ``fuzzy_duplicate`` with ``duplicate_of`` / ``cluster``. Every kept document carries
   ``metadata["fuzzy_dedup"] = {"cluster": canonical id, "cluster_size": n}``.

Non-convergence (a component still not a star after ``max_rounds``) is recorded in the
manifest (``cc_converged: false``, ``cc_unconverged_nodes``) and, by default, resolved by a
safe fallback: each node takes the smallest node of its closed neighbourhood as its cluster.
Every edge at every round joins two nodes of one true component, so the fallback can only
split a cluster (keep a few extra near-duplicates), never merge unrelated documents.
``fail_on_nonconvergence`` makes the stage fail instead.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam import pvalue

from pipelines import spill
from pipelines.beam_io import DEAD, stable_shard
from pipelines.configs import FuzzyDedupConfig
from pipelines.documents import Document, dead_letter, dumps
from pipelines.extra_totals import extra_totals
from pipelines.map_stage import (
    INPUT_DEAD,
    RECORDS_IN,
    ShardDocuments,
    input_shards,
    planned_shards,
    write_shard,
)
from pipelines.minhash import (
    MinHashParams,
    band_hashes,
    estimated_jaccard,
    lsh_error_areas,
    make_hasher,
    signatures,
)
from pipelines.stage import (
    DEFAULT_SHARDS,
    DocumentShards,
    Planned,
    StageOutputs,
    StageRun,
    run_as_command,
    stage_main,
)

log = logging.getLogger(__name__)

STAGE = "fuzzy_dedup"
REASON = "fuzzy_duplicate"
BANDS = "bands"
NO_SHINGLES = "no_shingles"
SIGNATURE_ERRORS = "signature_errors"
BUCKET_SIZE = "bucket_size"
UNCONVERGED = "unconverged"

# A node of the similarity graph: (-len(text), id). Tuples order by the longest text first,
# then the smallest id, so "the smallest node" is the canonical document, deterministically.
NodeKey = tuple[int, str]
Edge = tuple[NodeKey, NodeKey]  # always (larger, smaller)


class NonConvergenceError(RuntimeError):
    """Connected components were not resolved within ``max_rounds``."""


def node_key(doc: Document) -> NodeKey:
    return (-len(doc["text"]), doc["id"])


# ---- 1. signatures and band keys ---------------------------------------------------------------


class _Signatures(beam.DoFn):
    """A batch of documents -> signature blocks, and tagged ``BANDS`` bucket parts.

    Neither travels one document at a time: a shuffle record costs more than the 1 KiB
    signature it carries. The batch's signatures go as one block per node partition
    (``node_partition``), ``(partition, (nodes, signatures))``; its (band, bucket, node) triples
    as one part per bucket partition (``bucket % partitions``), instead of 23 records per
    document. A partition's parts together hold every member of each of its buckets, whichever
    batch they came from.
    """

    def __init__(self, params: MinHashParams, bands: int, rows: int, partitions: int) -> None:
        self.params = params
        self.bands = bands
        self.rows = rows
        self.partitions = partitions

    def setup(self) -> None:
        self.hasher = make_hasher(self.params)

    def process(self, batch: Sequence[Document]) -> Iterator[Any]:
        try:
            outputs = list(self._signatures(batch))
        except Exception:  # never lose the batch to one bad document: retry them one by one
            outputs = []
            for doc in batch:
                try:
                    outputs.extend(self._signatures([doc]))
                except Exception as err:
                    # Kept, as a singleton: failing to dedup a document must not drop it.
                    log.warning("%s: no signature for %r: %s", STAGE, doc.get("id"), err)
                    outputs.append(pvalue.TaggedOutput(SIGNATURE_ERRORS, doc.get("id")))
        yield from outputs

    def _signatures(self, batch: Sequence[Document]) -> Iterator[Any]:
        sigs, counts = signatures([doc["text"] for doc in batch], self.hasher)
        keys = band_hashes(sigs, self.bands, self.rows, self.params.seed)
        nodes = []
        for doc, count in zip(batch, counts, strict=True):
            node = node_key(doc)
            if count == 0:
                # No words at all: no shingle set to compare, so never anyone's duplicate.
                yield pvalue.TaggedOutput(NO_SHINGLES, node)
                continue
            nodes.append(node)
        with_shingles = counts > 0
        yield from signature_blocks(nodes, sigs[with_shingles], self.partitions)
        for partition, part in bucket_parts(keys[with_shingles], self.partitions):
            members = [nodes[i] for i in part.members.tolist()]
            yield pvalue.TaggedOutput(BANDS, (partition, (part.bands, part.buckets, members)))


def node_partition(node: NodeKey, partitions: int) -> int:
    """Where a node's signature block goes, and where its candidate pairs meet it."""
    return stable_shard(node[1], partitions)


def signature_blocks(
    nodes: list[NodeKey], sigs: np.ndarray, partitions: int
) -> Iterator[tuple[int, tuple[list[NodeKey], bytes]]]:
    """Nodes and their uint32 [nodes, num_perm] signatures -> one block per node partition."""
    if not nodes:
        return
    partition = np.array([node_partition(node, partitions) for node in nodes])
    order = np.argsort(partition, kind="stable")
    bounds = np.flatnonzero(np.diff(partition[order])) + 1
    for rows in np.split(order, bounds):
        yield (int(partition[rows[0]]), ([nodes[i] for i in rows.tolist()], sigs[rows].tobytes()))


def signatures_of(
    blocks: Iterable[tuple[list[NodeKey], bytes]], wanted: Iterable[NodeKey]
) -> dict[NodeKey, bytes]:
    """The signatures of the ``wanted`` nodes found in a partition's blocks. Two documents with
    one node key (same id, same length) both have a signature: the smaller bytes win."""
    wanted = set(wanted)
    found: dict[NodeKey, bytes] = {}
    for nodes, sig_bytes in blocks:
        width = len(sig_bytes) // max(1, len(nodes))
        for i, node in enumerate(nodes):
            node = tuple(node)  # coders may hand tuples back as lists
            if node in wanted:
                sig = sig_bytes[i * width : (i + 1) * width]
                found[node] = min(found.get(node, sig), sig)
    return found


@dataclasses.dataclass(frozen=True)
class _Part:
    bands: bytes  # uint16 per triple
    buckets: bytes  # uint64 per triple
    members: np.ndarray  # row of each triple in the batch's key matrix


def bucket_parts(keys: np.ndarray, partitions: int) -> Iterator[tuple[int, _Part]]:
    """uint64 [docs, bands] bucket keys -> (partition, its triples) for each partition present."""
    docs, bands = keys.shape
    buckets = keys.ravel()
    band = np.tile(np.arange(bands, dtype=np.uint16), docs)
    member = np.repeat(np.arange(docs), bands)
    partition = (buckets % np.uint64(partitions)).astype(np.int64)
    order = np.argsort(partition, kind="stable")
    bounds = np.flatnonzero(np.diff(partition[order])) + 1
    for rows in np.split(order, bounds) if len(order) else []:
        yield (
            int(partition[rows[0]]),
            _Part(band[rows].tobytes(), buckets[rows].tobytes(), member[rows]),
        )


# ---- 2. and 3. candidates and verification -----------------------------------------------------


def link_partition(item: tuple[int, Iterable[tuple[bytes, bytes, list[NodeKey]]]]) -> Iterator[Any]:
    """One bucket partition's parts -> (member, head) for every member of a bucket but its head
    (the smallest node): linear in the bucket size, so a boilerplate bucket of ``m`` documents
    costs ``m - 1`` pairs. Tags each bucket of several members with its size (``BUCKET_SIZE``).
    """
    _, parts = item
    bands, buckets, members = [], [], []
    for band_bytes, bucket_bytes, nodes in parts:
        bands.append(np.frombuffer(band_bytes, dtype=np.uint16))
        buckets.append(np.frombuffer(bucket_bytes, dtype=np.uint64))
        members.extend(tuple(node) for node in nodes)  # coders may hand tuples back as lists
    if not members:
        return
    band = np.concatenate(bands)
    bucket = np.concatenate(buckets)
    order = np.lexsort((bucket, band))
    same = (band[order][1:] == band[order][:-1]) & (bucket[order][1:] == bucket[order][:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~same)))
    sizes = np.diff(np.append(starts, len(order)))
    for start, size in zip(starts[sizes > 1].tolist(), sizes[sizes > 1].tolist(), strict=True):
        bucket_members = [members[i] for i in order[start : start + size].tolist()]
        head = min(bucket_members)
        for member in bucket_members:
            if member != head:
                yield (member, head)
        yield pvalue.TaggedOutput(BUCKET_SIZE, size)


def attach_member_signatures(
    item: tuple[int, dict[str, Iterable[Any]]], partitions: int
) -> Iterator[Any]:
    """At a node partition: its signature blocks and its members' (member, head) links ->
    ``(head's partition, (head, member, member's signature))`` once per distinct pair (a pair
    recurs once per shared band)."""
    _, grouped = item
    heads_of: dict[NodeKey, set[NodeKey]] = {}
    for member, head in grouped["links"]:
        heads_of.setdefault(tuple(member), set()).add(tuple(head))
    if not heads_of:
        return
    sigs = signatures_of(grouped["sigs"], heads_of)
    for member in sorted(heads_of):
        for head in sorted(heads_of[member]):
            yield (node_partition(head, partitions), (head, member, sigs[member]))


def verify_candidates(
    item: tuple[int, dict[str, Iterable[Any]]], threshold: float, chunk: int = 4096
) -> Iterator[Edge]:
    """At a node partition: keep the (member, head) edges of its heads whose estimated Jaccard
    reaches the threshold, comparing ``chunk`` members at a time."""
    _, grouped = item
    members_of: dict[NodeKey, list[tuple[NodeKey, bytes]]] = {}
    for head, member, sig in grouped["candidates"]:
        members_of.setdefault(tuple(head), []).append((tuple(member), sig))
    if not members_of:
        return
    head_sigs = signatures_of(grouped["sigs"], members_of)
    for head in sorted(members_of):
        head_sig = np.frombuffer(head_sigs[head], dtype=np.uint32)
        members = members_of[head]
        for start in range(0, len(members), chunk):
            block = members[start : start + chunk]
            member_sigs = np.frombuffer(b"".join(sig for _, sig in block), dtype=np.uint32)
            similarity = estimated_jaccard(member_sigs.reshape(len(block), -1), head_sig)
            for (member, _), value in zip(block, similarity, strict=True):
                if value >= threshold:
                    yield (member, head)


# ---- 4. connected components: large-star / small-star ------------------------------------------


def star_summary(node: NodeKey, neighbors: Iterable[NodeKey]) -> tuple[NodeKey, bool]:
    """One streaming pass: (smallest node of the closed neighbourhood, locally converged).

    A node is locally converged when it looks like a star centre (only larger neighbours) or a
    leaf (exactly one neighbour, smaller). When every node is, the graph is a disjoint union of
    stars centred on their components' minima: a leaf's neighbour has a larger neighbour (the
    leaf), so it is a centre. Streaming (no set) keeps a hub with millions of leaves cheap.
    """
    smallest, first, several = node, None, False
    for v in neighbors:
        if first is None:
            first = v
        elif v != first:
            several = True
        smallest = min(smallest, v)
    leaf = first is not None and not several and first < node
    return smallest, smallest == node or leaf


def large_star(
    node: NodeKey, neighbors: Iterable[NodeKey], smallest: NodeKey | None = None
) -> Iterator[Edge]:
    """Connect every strictly larger neighbour to the smallest node of the closed neighbourhood."""
    if smallest is None:
        smallest, _ = star_summary(node, neighbors)
    for v in neighbors:
        if v > node:
            yield (v, smallest)


def small_star(node: NodeKey, smaller: set[NodeKey]) -> Iterator[Edge]:
    """Connect the node and its smaller neighbours to the smallest of them."""
    smallest = min(smaller)
    yield (node, smallest)
    for v in smaller:
        if v != smallest:
            yield (v, smallest)


def both_directions(edge: Edge) -> Iterator[tuple[NodeKey, NodeKey]]:
    yield edge
    yield (edge[1], edge[0])


def _large_star_step(item: tuple[NodeKey, Iterable[NodeKey]], round_index: int) -> Iterator[Any]:
    node, neighbors = item
    smallest, converged = star_summary(node, neighbors)
    if not converged:
        yield pvalue.TaggedOutput(UNCONVERGED, (round_index, 1))
    # A repeated neighbour repeats its edge; small-star's set removes the copy.
    yield from large_star(node, neighbors, smallest)


def _small_star_step(item: tuple[NodeKey, Iterable[NodeKey]]) -> Iterator[Edge]:
    node, smaller = item
    # Only neighbours smaller than the node arrive here: few, even at a hub (the hub is small).
    yield from small_star(node, set(smaller))


def _label_step(item: tuple[NodeKey, Iterable[NodeKey]], round_index: int) -> Iterator[Any]:
    """Final labels: the smallest node of the closed neighbourhood (the centre, once converged)."""
    node, neighbors = item
    smallest, converged = star_summary(node, neighbors)
    if not converged:
        yield pvalue.TaggedOutput(UNCONVERGED, (round_index, 1))
    yield (smallest, node)


def _adjacency(edges: Iterable[Edge]) -> Iterator[tuple[NodeKey, list[NodeKey]]]:
    neighbors: dict[NodeKey, list[NodeKey]] = {}
    for a, b in edges:
        neighbors.setdefault(a, []).append(b)
        neighbors.setdefault(b, []).append(a)
    return iter(neighbors.items())


def components_in_memory(edges: Iterable[Edge], max_rounds: int) -> Iterator[Any]:
    """``ConnectedComponents``' rounds applied to the whole edge list in one process: the same
    steps, so the same labels and the same tagged per-round ``UNCONVERGED`` counts."""
    current = [(tuple(a), tuple(b)) for a, b in edges]  # coders may hand tuples back as lists
    for r in range(1, max_rounds + 1):
        large: list[Edge] = []
        unconverged = 0
        for item in _adjacency(current):
            for out in _large_star_step(item, r):
                if isinstance(out, pvalue.TaggedOutput):
                    unconverged += 1
                    yield out
                else:
                    large.append(out)
        if not unconverged:
            break  # a union of stars: both steps give it back as it is, round after round
        smaller: dict[NodeKey, list[NodeKey]] = {}
        for a, b in large:
            smaller.setdefault(a, []).append(b)
        current = [edge for item in smaller.items() for edge in _small_star_step(item)]
    for item in _adjacency(current):
        yield from _label_step(item, max_rounds + 1)


class ConnectedComponents(beam.PTransform):
    """Edges (larger, smaller) -> (root, node) for every node with an edge; + tagged round stats.

    ``unconverged`` holds (round, 1) per node not yet in star shape at the *input* of that
    round; round ``max_rounds + 1`` is the final labelling. On a local runner the rounds run in
    one step (``components_in_memory``), stopping once every component is a star.
    """

    def __init__(self, max_rounds: int) -> None:
        super().__init__()
        self.max_rounds = max_rounds

    def expand(self, edges: beam.PCollection) -> dict[str, beam.PCollection]:
        if spill.runs_locally(edges.pipeline):
            # One process holds every edge anyway; two shuffles a round of a few thousand edges
            # cost more than the rounds themselves.
            found = (
                edges
                | "AllEdges" >> beam.combiners.ToList()
                | "Rounds"
                >> beam.FlatMap(components_in_memory, self.max_rounds).with_outputs(
                    UNCONVERGED, main="labels"
                )
            )
            return {"labels": found["labels"], UNCONVERGED: found[UNCONVERGED]}
        stats = []
        for r in range(1, self.max_rounds + 1):
            large = (
                edges
                | f"LargeStarSend{r}" >> beam.FlatMap(both_directions)
                | f"LargeStarGroup{r}" >> beam.GroupByKey()
                | f"LargeStar{r}"
                >> beam.FlatMap(_large_star_step, r).with_outputs(UNCONVERGED, main="edges")
            )
            stats.append(large[UNCONVERGED])
            # Edges are (larger, smaller): keyed by the larger end, exactly what small-star needs.
            edges = (
                large["edges"]
                | f"SmallStarGroup{r}" >> beam.GroupByKey()
                | f"SmallStar{r}" >> beam.FlatMap(_small_star_step)
            )
        labels = (
            edges
            | "LabelSend" >> beam.FlatMap(both_directions)
            | "LabelGroup" >> beam.GroupByKey()
            | "Label"
            >> beam.FlatMap(_label_step, self.max_rounds + 1).with_outputs(
                UNCONVERGED, main="labels"
            )
        )
        stats.append(labels[UNCONVERGED])
        unconverged = stats | "UnconvergedByRound" >> beam.Flatten()
        return {"labels": labels["labels"], UNCONVERGED: unconverged}


def convergence_summary(
    counts: Iterable[tuple[int, int]], max_rounds: int, fail: bool
) -> dict[str, Any]:
    """Manifest facts from the per-round unconverged-node counts; raises if asked to."""
    by_round = [count for _, count in sorted(counts)]
    # by_round[k] counts the nodes not yet in star shape after k rounds.
    rounds = next((k for k, count in enumerate(by_round) if count == 0), None)
    converged = by_round[-1] == 0
    if not converged:
        message = (
            f"{STAGE}: connected components did not converge in {max_rounds} rounds"
            f" ({by_round[-1]} nodes unresolved; unconverged by round {by_round})"
        )
        if fail:
            raise NonConvergenceError(message + "; raise max_rounds")
        log.warning("%s; falling back to neighbourhood minima (clusters may be split)", message)
    return {
        "cc_converged": converged,
        "cc_max_rounds": max_rounds,
        "cc_rounds": rounds,
        "cc_unconverged_by_round": by_round,
        "cc_unconverged_nodes": by_round[-1],
    }


# ---- 5. resolution ----------------------------------------------------------------------------


def cluster_members(item: tuple[NodeKey, Iterable[NodeKey]]) -> Iterator[Any]:
    """(root, nodes) -> (node, (root, cluster size)) per node; tags the size once per cluster."""
    root, nodes = item
    size = sum(1 for _ in nodes)
    for node in nodes:
        yield (node, (root, size))
    yield pvalue.TaggedOutput("cluster_size", size)


def _with_cluster(doc: Document, info: dict[str, Any]) -> Document:
    return {**doc, "metadata": {**doc.get("metadata", {}), STAGE: info}}


def resolve(item: tuple[NodeKey, dict[str, Iterable[Any]]]) -> Iterator[Any]:
    """A node's documents and cluster -> the kept canonical document or dead letters."""
    node, grouped = item
    docs = list(grouped["docs"])
    if not docs:
        return
    if len(docs) > 1:  # same id and length: ordered by their bytes (the key costs an encoding)
        docs.sort(key=dumps)
    clusters = list(grouped["cluster"])
    root, size = clusters[0] if clusters else (node, 1)
    info = {"cluster": root[1], "cluster_size": size}
    first = _with_cluster(docs[0], info)
    if root == node:
        yield first
    else:
        yield pvalue.TaggedOutput(
            DEAD,
            dead_letter(
                REASON,
                STAGE,
                first["id"],
                first,
                f"near-duplicate (MinHash Jaccard) of {root[1]!r} in a cluster of {size}",
                duplicate_of=root[1],
                cluster=root[1],
                cluster_size=size,
            ),
        )
    for doc in docs[1:]:
        # Same id and same length as another input document: not a question of similarity.
        yield pvalue.TaggedOutput(
            DEAD,
            dead_letter(
                "duplicate_id",
                STAGE,
                doc["id"],
                _with_cluster(doc, info),
                "another input document has the same id and length",
                duplicate_of=first["id"],
            ),
        )


# ---- the stage ---------------------------------------------------------------------------------


def _clusters(
    pipeline: beam.Pipeline, hashed: Any, config: FuzzyDedupConfig, partitions: int
) -> tuple[beam.PCollection, beam.PCollection]:
    """Signature blocks and band parts (``_Signatures``' outputs) -> (node, (root, cluster
    size)) for every node in a cluster, and the manifest extras. Steps 2-4 of the module
    docstring; candidate pairs meet their signatures at the node partitions."""
    bands, rows = config.lsh()
    sigs = hashed["sigs"]
    links = (
        hashed[BANDS]
        | "GroupPartitions" >> spill.GroupByKey()
        | "LinkToHead" >> beam.FlatMap(link_partition).with_outputs(BUCKET_SIZE, main="links")
    )
    member_links = links["links"] | "AtMemberPartition" >> beam.Map(
        lambda link: (node_partition(link[0], partitions), link)
    )
    candidates = (
        {"sigs": sigs, "links": member_links}
        | "AtMember" >> spill.CoGroupByKey()
        | "AttachSignature" >> beam.FlatMap(attach_member_signatures, partitions)
    )
    edges = (
        {"sigs": sigs, "candidates": candidates}
        | "AtHead" >> spill.CoGroupByKey()
        | "Verify" >> beam.FlatMap(verify_candidates, config.threshold)
    )

    components = edges | "Components" >> ConnectedComponents(config.max_rounds)
    clusters = (
        components["labels"]
        | "GroupClusters" >> beam.GroupByKey()
        | "ClusterMembers"
        >> beam.FlatMap(cluster_members).with_outputs("cluster_size", main="members")
    )

    fp_area, fn_area = lsh_error_areas(config.threshold, bands, rows)
    parameters = {
        "num_perm": config.num_perm,
        "ngram": config.ngram,
        "threshold": config.threshold,
        "bands": bands,
        "rows": rows,
        "lsh_false_positive_area": round(fp_area, 6),
        "lsh_false_negative_area": round(fn_area, 6),
        "canonical": "longest text, then smallest id",
    }
    round_counts = (
        (
            components[UNCONVERGED],
            pipeline
            | "AllRounds" >> beam.Create([(r, 0) for r in range(1, config.max_rounds + 2)]),
        )
        | "RoundStats" >> beam.Flatten()
        | "SumByRound" >> beam.CombinePerKey(sum)
        | "RoundsList" >> beam.combiners.ToList()
        | "Convergence"
        >> beam.Map(convergence_summary, config.max_rounds, config.fail_on_nonconvergence)
    )
    totals = extra_totals(
        pipeline,
        "Extra",
        [
            ("documents_without_shingles", "count", hashed[NO_SHINGLES]),
            ("signature_errors", "count", hashed[SIGNATURE_ERRORS]),
            ("multi_document_buckets", "count", links[BUCKET_SIZE]),
            ("largest_bucket", "max", links[BUCKET_SIZE]),
            ("candidate_pairs", "count", candidates),
            ("verified_edges", "count", edges),
            ("clusters", "count", clusters["cluster_size"]),
            ("largest_cluster", "max", clusters["cluster_size"]),
            ("documents_in_clusters", "sum", clusters["cluster_size"]),
        ],
    )
    extras = [pipeline | "Parameters" >> beam.Create([parameters]), round_counts, totals]
    return clusters["members"], extras | "FuzzyDedupExtra" >> beam.Flatten()


def bucket_partitions(num_shards: int) -> int:
    """How many partitions the band buckets are spread over: 16 per output shard (the shard
    count is what users size to the corpus), so a partition stays a small share of the work."""
    return 16 * num_shards


def build(
    docs: beam.PCollection,
    config: FuzzyDedupConfig,
    partitions: int = bucket_partitions(DEFAULT_SHARDS),
) -> StageOutputs:
    """The harness's path (any input): documents are batched, clustered, and joined with their
    cluster by node key."""
    bands, rows = config.lsh()
    hashed = (
        docs
        | "Batch"
        >> beam.BatchElements(min_batch_size=config.batch_size, max_batch_size=config.batch_size)
        | "MinHash"
        >> beam.ParDo(_Signatures(config.minhash, bands, rows, partitions)).with_outputs(
            BANDS, NO_SHINGLES, SIGNATURE_ERRORS, main="sigs"
        )
    )
    members, extra = _clusters(docs.pipeline, hashed, config, partitions)
    resolved = (
        {
            "docs": docs | "KeyByNode" >> beam.Map(lambda doc: (node_key(doc), doc)),
            "cluster": members,
        }
        | "JoinClusters" >> spill.CoGroupByKey()
        | "Resolve" >> beam.FlatMap(resolve).with_outputs(DEAD, main="kept")
    )
    return StageOutputs(resolved["kept"], resolved[DEAD], extra)


# ---- the shard path: id-sharded inputs, no shuffle of documents --------------------------------


class SignShard(beam.DoFn):
    """(shard index, input files) -> ``_Signatures``' outputs for the shard's documents, read
    in batches; plus the reading letters (``INPUT_DEAD``) and records read (``RECORDS_IN``)."""

    def __init__(self, signer: _Signatures, num_shards: int, batch_size: int) -> None:
        self.signer = signer
        self.num_shards = num_shards
        self.batch_size = batch_size

    def setup(self) -> None:
        self.signer.setup()

    def process(self, item: tuple[int, list[str]]) -> Iterator[Any]:
        index, paths = item
        documents = ShardDocuments(STAGE, index, paths, self.num_shards)
        stream = iter(documents)
        while batch := list(itertools.islice(stream, self.batch_size)):
            yield from documents.take_letters()
            yield from self.signer.process(batch)
        yield from documents.take_letters()
        yield pvalue.TaggedOutput(RECORDS_IN, documents.records)


class ResolveShard(beam.DoFn):
    """(shard index, {"paths": [files], "decisions": [(node, (root, size))]}) -> output shard:
    the shard is read again and each document resolved as ``resolve`` does (bad records were
    dead-lettered by ``SignShard``'s reading, so they are skipped here)."""

    def __init__(self, output: str, num_shards: int) -> None:
        self.output = output
        self.num_shards = num_shards

    def process(self, item: tuple[int, dict[str, list[Any]]]) -> Iterator[Any]:
        index, grouped = item
        (paths,) = grouped["paths"]
        decisions = {
            tuple(node): (tuple(root), size) for node, (root, size) in grouped["decisions"]
        }
        documents = ShardDocuments(STAGE, index, paths, self.num_shards)
        yield from write_shard(
            self.output, index, self.num_shards, _resolve_runs(documents, decisions)
        )


def _resolve_runs(
    documents: Iterable[Document], decisions: dict[NodeKey, tuple[NodeKey, int]]
) -> Iterator[Any]:
    """Documents in id order -> ``resolve``'s outputs, node by node (documents of one node
    key are adjacent: a node key starts with nothing but the id and the length)."""
    for _, run in itertools.groupby(documents, key=lambda doc: doc["id"]):
        by_node: dict[NodeKey, list[Document]] = {}
        for doc in run:
            by_node.setdefault(node_key(doc), []).append(doc)
        for node in sorted(by_node):
            cluster = [decisions[node]] if node in decisions else []
            yield from resolve((node, {"docs": by_node[node], "cluster": cluster}))


@dataclasses.dataclass(frozen=True)
class FuzzyDedup:
    """The stage's output strategy: the shard path when the inputs are id-sharded stage outputs
    (``map_stage``: documents never leave their shard; signatures, band keys and decisions are
    what moves), else the harness's path (``build``). Both write the same bytes."""

    def expand(
        self,
        pipeline: beam.Pipeline,
        stage: str,
        config: FuzzyDedupConfig,
        inputs: list[str],
        output: str,
        num_shards: int,
    ) -> Planned:
        shards = input_shards(pipeline, stage, inputs, num_shards, "documents stay in their shard")
        if shards is None:
            partitioned = functools.partial(build, partitions=bucket_partitions(num_shards))
            return DocumentShards(partitioned).expand(
                pipeline, stage, config, inputs, output, num_shards
            )
        bands, rows = config.lsh()
        signer = _Signatures(config.minhash, bands, rows, bucket_partitions(num_shards))
        hashed = shards | "MinHashShards" >> beam.ParDo(
            SignShard(signer, num_shards, config.batch_size)
        ).with_outputs(BANDS, NO_SHINGLES, SIGNATURE_ERRORS, INPUT_DEAD, RECORDS_IN, main="sigs")
        members, extra = _clusters(pipeline, hashed, config, bucket_partitions(num_shards))
        decisions = members | "DecisionShard" >> beam.Map(
            lambda member: (stable_shard(member[0][1], num_shards), member)
        )
        resolved = (
            {"paths": shards, "decisions": decisions}
            | "JoinShardDecisions" >> spill.CoGroupByKey()
            | "ResolveShards"
            >> beam.ParDo(ResolveShard(output, num_shards)).with_outputs(DEAD, main="shards")
        )
        return planned_shards(
            hashed[RECORDS_IN], [hashed[INPUT_DEAD], resolved[DEAD]], resolved["shards"], extra
        )


def main(argv: Sequence[str] | None = None) -> StageRun:
    return stage_main(STAGE, __doc__ or STAGE, FuzzyDedupConfig, FuzzyDedup(), argv)


if __name__ == "__main__":
    run_as_command(main)
