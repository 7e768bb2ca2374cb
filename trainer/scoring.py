"""Benchmark scoring: batched log-likelihoods of (context, continuation) requests and the
metrics lm-evaluation-harness reports (``acc``, ``acc_norm``, their standard errors, LAMBADA's
perplexity).

Tokenization follows the harness's ``_encode_pair`` (``lm_eval/api/model.py``): trailing
spaces of the context move to the continuation, the whole string is encoded, and the
continuation's tokens are what follows the context's own encoding. No BOS is added (the
documents the model trained on carry none). A request longer than the model's context keeps
its last ``max_len + 1`` tokens, as the harness's HF backend does.

Requests are sorted by length and scored in batches padded to a power-of-two length (a few
compiled shapes instead of one per length); every process builds the same batch and the
scores come back replicated, so the same code runs on one CPU or across a TPU slice.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from trainer import distributed as dist
from trainer.model import Transformer
from trainer.tasks import Example, Task, chance

log = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]
MIN_BUCKET = 32
LOGIT_CHUNK = 128  # positions per logits chunk: bounds the (B, chunk, V) float32 buffer


def encode_pair(encode: Encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens), split as the harness splits them."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids) :]


@dataclass(frozen=True)
class Scored:
    """A request's summed log-likelihood, whether every continuation token was the greedy
    (argmax) prediction, its continuation's token count, and whether its context was cut
    from the left to fit the model's context (as the harness does, silently)."""

    loglikelihood: float
    is_greedy: bool
    tokens: int
    truncated: bool = False


def _bucket(n: int, max_len: int) -> int:
    return min(max_len, max(MIN_BUCKET, 1 << (n - 1).bit_length()))


def _token_scores(
    params: Transformer,
    router_bias: Array,
    tokens: Array,
    targets: Array,
    lengths: Array,
    *,
    dtype,
) -> tuple[Array, Array]:
    """tokens, targets (B, L), each row's length (B, 1) -> log p(target) (B, L) float32 and
    target == argmax (B, L).

    One document per row (segment 0), positions from 0; padding at the end of a row is never
    attended to by the tokens before it. An MoE model routes each row as its own group, and
    padding takes no expert capacity, so a request scores the same whatever it is batched
    with. The logits are computed ``LOGIT_CHUNK`` positions at a time so a large vocabulary
    never materializes (B, L, V) at once."""
    b, s = tokens.shape
    segments = jnp.zeros((b, s), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    valid = positions < lengths
    x, _ = params.hidden(tokens, segments, positions, router_bias, dtype, valid, route_rows=True)
    head = params.head().astype(dtype)
    chunk = math.gcd(s, LOGIT_CHUNK)  # a divisor of s: buckets are powers of two, max_len any
    n = s // chunk
    xc = x.reshape(b, n, chunk, -1).swapaxes(0, 1)  # (n, B, chunk, D)
    tc = targets.reshape(b, n, chunk).swapaxes(0, 1)

    def one(args):
        xs, ts = args
        # float32 accumulation whatever the compute dtype: bfloat16 logits tie near-equal
        # tokens (argmax then takes the lowest id) and round log-likelihoods
        logits = jnp.einsum("bcd,dv->bcv", xs, head, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, ts[..., None], axis=-1)[..., 0]
        return picked - lse, jnp.argmax(logits, axis=-1) == ts

    lp, greedy = jax.lax.map(one, (xc, tc))
    return lp.swapaxes(0, 1).reshape(b, s), greedy.swapaxes(0, 1).reshape(b, s)


class Scorer:
    """Log-likelihoods of token requests under one model, batched over a device mesh.

    ``batch_size`` rows per batch (a multiple of the mesh's data-parallel size); ``max_len``
    the model's context (the run's ``seq_len``). ``fixed_length`` pads every batch to
    ``max_len``: MoE routing groups are sized for the training window."""

    def __init__(
        self,
        params: Transformer,
        router_bias: Array,
        shardings: Any,
        mesh,
        *,
        batch_size: int,
        max_len: int,
        dtype=jnp.float32,
        fixed_length: bool = False,
    ) -> None:
        dp = dist.data_parallel_size(mesh)
        if batch_size % dp:
            raise ValueError(f"batch size {batch_size} is not a multiple of {dp} (data parallel)")
        self.params, self.router_bias = params, router_bias
        self.batch_size, self.max_len, self.fixed_length = batch_size, max_len, fixed_length
        self._rows = dist.batch_sharding(mesh)
        self._step = jax.jit(
            dist.on_mesh(lambda p, r, t, y, n: _token_scores(p, r, t, y, n, dtype=dtype), mesh),
            in_shardings=(shardings, dist.replicated(mesh), self._rows, self._rows, self._rows),
            out_shardings=dist.replicated(mesh),
        )

    def _array(self, x: np.ndarray) -> Array:
        return jax.make_array_from_callback(x.shape, self._rows, lambda index: x[index])

    def score(
        self,
        requests: Sequence[tuple[Sequence[int], Sequence[int]]],
        progress: Callable[[int, int], None] | None = None,
    ) -> list[Scored]:
        """(context ids, continuation ids) per request -> its :class:`Scored`, in order."""
        windows = []
        cut: list[bool] = []
        for ctx, cont in requests:
            if not cont:
                raise ValueError("a request with an empty continuation")
            ids = [*ctx, *cont][-(self.max_len + 1) :]
            windows.append((ids[:-1], ids[1:], min(len(cont), len(ids) - 1)))
            cut.append(len(ctx) + len(cont) > len(ids))
        # longest first, as the harness orders them: equal lengths share a bucket
        order = sorted(range(len(windows)), key=lambda i: (-len(windows[i][0]), i))
        out: list[Scored | None] = [None] * len(windows)
        done = 0
        i = 0
        while i < len(order):
            length = self.max_len if self.fixed_length else None
            if length is None:
                length = _bucket(len(windows[order[i]][0]), self.max_len)
            batch = order[i : i + self.batch_size]
            i += len(batch)
            tokens = np.zeros((self.batch_size, length), np.int32)
            targets = np.zeros((self.batch_size, length), np.int32)
            # (B, 1): laid out by rows, as the tokens; rows past the requests have length 0
            lengths = np.zeros((self.batch_size, 1), np.int32)
            for row, r in enumerate(batch):
                inp, tgt, _ = windows[r]
                tokens[row, : len(inp)], targets[row, : len(tgt)] = inp, tgt
                lengths[row, 0] = len(inp)
            lp, greedy = self._step(
                self.params,
                self.router_bias,
                self._array(tokens),
                self._array(targets),
                self._array(lengths),
            )
            lp, greedy = np.asarray(lp), np.asarray(greedy)
            for row, r in enumerate(batch):
                inp, _, n_cont = windows[r]
                span = slice(len(inp) - n_cont, len(inp))
                out[r] = Scored(
                    float(lp[row, span].sum()), bool(greedy[row, span].all()), n_cont, cut[r]
                )
            done += len(batch)
            if progress is not None:
                progress(done, len(windows))
        return [s for s in out if s is not None]


# --- metrics -----------------------------------------------------------------------------------


def mean_stderr(values: Sequence[float]) -> float | None:
    """The harness's standard error of a mean: sample standard deviation (n - 1) / sqrt(n)."""
    n = len(values)
    if n < 2:
        return None
    return float(np.std(np.asarray(values, np.float64), ddof=1) / math.sqrt(n))


def pooled_stderr(values: Sequence[float], groups: Sequence[str]) -> float | None:
    """The harness's stderr of a size-weighted group mean (lm-eval's ``pooled_sample_stderr``
    over the group's leaf tasks, each with its own sample stderr): the variance within the
    groups pooled, sqrt(SSW / (N - k) / N), where the spread between the groups' means does
    not count. A group of one value adds nothing to either sum (the harness reports no stderr
    for such a subtask, and so none for the group); None when no group has two."""
    by_group: dict[str, list[float]] = {}
    for value, group in zip(values, groups, strict=True):
        by_group.setdefault(group, []).append(value)
    n, k = len(values), len(by_group)
    if n - k < 1:
        return None
    within = sum(
        float(np.sum((np.asarray(v, np.float64) - np.mean(v)) ** 2)) for v in by_group.values()
    )
    return math.sqrt(within / (n - k) / n)


def example_results(task: Task, example: Example, scored: Sequence[Scored]) -> dict[str, Any]:
    """One example's per-request scores and outcome (the harness's ``process_results``)."""
    lls = [s.loglikelihood for s in scored]
    row: dict[str, Any] = {"doc_id": example.doc_id, "gold": example.gold, "loglikelihoods": lls}
    row["truncated"] = any(s.truncated for s in scored)
    if task.kind == "loglikelihood":
        row["acc"] = float(scored[0].is_greedy)
        row["tokens"] = scored[0].tokens
        return row
    pred = int(np.argmax(lls))
    row["pred"], row["acc"] = pred, float(pred == example.gold)
    if task.acc_norm:
        lengths = np.asarray([float(len(c)) for c in example.choices])
        row["pred_norm"] = int(np.argmax(np.asarray(lls) / lengths))
        row["acc_norm"] = float(row["pred_norm"] == example.gold)
    return row


def perplexity_of(nll: float) -> float:
    """exp(mean negative log-likelihood); infinite past float range (a diverged model's loss
    of 800 nats is a metric the gate refuses, not an OverflowError that loses the run)."""
    try:
        return math.exp(nll)
    except OverflowError:
        return math.inf


def task_metrics(task: Task, examples: Sequence[Example], rows: Sequence[dict]) -> dict[str, Any]:
    """A task's summary: n, shots, acc and acc_norm with standard errors, chance, perplexity,
    and how many examples had a context cut to fit."""
    accs = [r["acc"] for r in rows]
    norms = [r["acc_norm"] for r in rows] if task.acc_norm else []
    group_of = {e.doc_id: e.group for e in examples if e.group}
    stderr = mean_stderr
    if group_of:  # the harness's group of subtasks (MMLU's subjects)
        groups = [group_of[r["doc_id"]] for r in rows]
        stderr = functools.partial(pooled_stderr, groups=groups)
    perplexity = None
    if task.kind == "loglikelihood":
        # the harness's perplexity aggregation: exp(-mean log-likelihood per example)
        perplexity = perplexity_of(-float(np.mean([r["loglikelihoods"][0] for r in rows])))
    return {
        "task": task.name,
        "n": len(rows),
        "shots": task.shots,
        "acc": float(np.mean(accs)) if accs else None,
        "acc_stderr": stderr(accs),
        "acc_norm": float(np.mean(norms)) if norms else None,
        "acc_norm_stderr": stderr(norms) if norms else None,
        "chance": chance(task, examples),
        "perplexity": perplexity,
        # examples with a request whose context was cut from the left to fit seq_len: their
        # shots or passage were partly unseen (the harness cuts silently; this says how often)
        "truncated": sum(bool(r.get("truncated")) for r in rows),
    }


def evaluate_task(
    scorer: Scorer, encode: Encode, task: Task, examples: Sequence[Example]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Score every example of a task: (its metrics, one result row per example)."""
    flat = [r for e in examples for r in e.requests]
    started = time.monotonic()
    last = [started]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] >= 10.0:
            last[0] = now
            rate = done / max(now - started, 1e-9)
            eta = (total - done) / max(rate, 1e-9)
            log.info("%s: %d/%d requests, %.1f/s, %.0f s left", task.name, done, total, rate, eta)

    scored = scorer.score([encode_pair(encode, r.context, r.continuation) for r in flat], progress)
    rows, k = [], 0
    for e in examples:
        rows.append(example_results(task, e, scored[k : k + len(e.requests)]))
        k += len(e.requests)
    return task_metrics(task, examples, rows), rows
