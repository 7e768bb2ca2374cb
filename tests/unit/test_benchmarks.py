"""Benchmark tasks and their scorer (trainer/tasks.py, trainer/scoring.py) without PyTorch: the
harness's prompt formats on real evaluation documents, its tokenization split, the scorer's
log-likelihoods against the model's own full forward pass, the metrics' arithmetic, and the
entrypoint's refusals before any compute. tests/parity/test_lmeval_parity.py holds the scorer
against lm-evaluation-harness itself."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.trainer_data import traced_meshes
from trainer import distributed as dist
from trainer.config import MeshConfig, ModelConfig, resolve_model
from trainer.evaluate import main as eval_main
from trainer.model import Transformer
from trainer.scoring import (
    Scored,
    Scorer,
    encode_pair,
    example_results,
    mean_stderr,
    task_metrics,
)
from trainer.tasks import TASKS, Example, Request, TaskError, chance, load_examples, parse_tasks


def _write_set(root: Path, name: str, docs: list[dict]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with gzip.open(root / f"{name}.jsonl.gz", "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")


def _doc(task: str, i: int, split: str, text: str = "", **meta) -> dict:
    return {
        "id": f"{task}/{split}/{i:05d}",
        "text": text,
        "source": task,
        "metadata": {"task": task, "split": split, **meta},
    }


# --- the harness's formats ----------------------------------------------------------------------


def test_unknown_and_repeated_tasks_are_refused_by_name():
    with pytest.raises(TaskError, match="unknown task\\(s\\) hellaswagg"):
        parse_tasks("piqa,hellaswagg")
    with pytest.raises(TaskError, match="named twice"):
        parse_tasks(["piqa", "piqa"])
    assert [t.name for t in parse_tasks("piqa, boolq")] == ["piqa", "boolq"]


def test_prompt_formats(tmp_path):
    data = tmp_path / "eval"
    _write_set(
        data,
        "piqa",
        [_doc("piqa", 0, "validation", goal="Open a jar", choices=["twist", "cut"], answer=0)],
    )
    _write_set(
        data,
        "boolq",
        [
            _doc(
                "boolq",
                0,
                "validation",
                passage="Water is wet.",
                question="is water wet",
                choices=["yes", "no"],
                answer=0,
            )
        ],
    )
    sentence = "The cup fell because _ was slippery."
    _write_set(
        data,
        "winogrande",
        [_doc("winogrande", 0, "validation", sentence=sentence, choices=["it", "he"], answer=0)],
    )
    text = "he looked at the stone and said signs"
    _write_set(data, "lambada", [_doc("lambada", 0, "test", text=text)])
    mmlu = [
        _doc(
            "mmlu",
            i,
            split,
            question=f"Q{i}?",
            choices=list("wxyz"),
            answer=i % 4,
            subject="high_school_physics",
        )
        for i, split in enumerate(["dev"] * 5 + ["test"])
    ]
    _write_set(data, "mmlu", mmlu)

    (piqa,) = load_examples(TASKS["piqa"], str(data))
    assert piqa.requests == (
        Request("Question: Open a jar\nAnswer:", " twist"),
        Request("Question: Open a jar\nAnswer:", " cut"),
    )
    (boolq,) = load_examples(TASKS["boolq"], str(data))
    assert boolq.requests[0].context == "Water is wet.\nQuestion: is water wet?\nAnswer:"
    assert [r.continuation for r in boolq.requests] == [" no", " yes"] and boolq.gold == 1
    (wino,) = load_examples(TASKS["winogrande"], str(data))
    assert [r.context for r in wino.requests] == [
        "The cup fell because it",
        "The cup fell because he",
    ]
    assert {r.continuation for r in wino.requests} == {" was slippery."}
    (lam,) = load_examples(TASKS["lambada_openai"], str(data))
    assert lam.requests == (Request("he looked at the stone and said", " signs"),)
    (zero,) = load_examples(TASKS["mmlu"], str(data))
    head = (
        "The following are multiple choice questions (with answers) about high school physics.\n\n"
    )
    assert zero.requests[0].context == head + "Q5?\nA. w\nB. x\nC. y\nD. z\nAnswer:"
    assert [r.continuation for r in zero.requests] == [" A", " B", " C", " D"]
    (five,) = load_examples(TASKS["mmlu_5shot"], str(data))
    shots = "".join(f"Q{i}?\nA. w\nB. x\nC. y\nD. z\nAnswer: {'ABCD'[i % 4]}\n\n" for i in range(5))
    assert five.requests[0].context == head + shots + "Q5?\nA. w\nB. x\nC. y\nD. z\nAnswer:"


def test_task_data_problems_name_the_file(tmp_path):
    with pytest.raises(TaskError, match=r"no evaluation set at .*piqa\.jsonl\.gz"):
        load_examples(TASKS["piqa"], str(tmp_path))
    _write_set(tmp_path, "piqa", [_doc("piqa", 0, "validation", choices=["a", "b"], answer=0)])
    with pytest.raises(TaskError, match=r"lacks the field 'goal'.*make corpora"):
        load_examples(TASKS["piqa"], str(tmp_path))
    # a document that cannot be built names itself; a line that is no document, its line
    no_blank = _doc("winogrande", 3, "validation", sentence="no blank", choices=["a", "b"])
    _write_set(
        tmp_path, "winogrande", [no_blank | {"metadata": no_blank["metadata"] | {"answer": 0}}]
    )
    with pytest.raises(TaskError, match=r"document 'winogrande/validation/00003' cannot be built"):
        load_examples(TASKS["winogrande"], str(tmp_path))
    with gzip.open(tmp_path / "piqa.jsonl.gz", "wt") as f:
        f.write(json.dumps(_doc("piqa", 0, "validation")) + "\n" + '{"id": "cut' + "\n")
    with pytest.raises(TaskError, match=r"piqa\.jsonl\.gz:2: not an evaluation document"):
        load_examples(TASKS["piqa"], str(tmp_path))
    whole = gzip.compress(
        b"".join(json.dumps(_doc("piqa", 0, "validation")).encode() + b"\n" for _ in range(2000)),
        mtime=0,
    )
    (tmp_path / "piqa.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TaskError, match=r"piqa\.jsonl\.gz is truncated"):
        load_examples(TASKS["piqa"], str(tmp_path))


def test_real_evaluation_sets_build(corpora_eval_dir):
    """Every task builds from the fetched sets: the converter keeps what each prompt needs."""
    for name, task in TASKS.items():
        examples = load_examples(task, corpora_eval_dir, 30)
        assert len(examples) == 30, name
        for e in examples:
            assert e.requests and all(r.context and r.continuation for r in e.requests)
            assert 0 <= e.gold < len(e.requests) or task.kind == "loglikelihood"
    mmlu = load_examples(TASKS["mmlu"], corpora_eval_dir, 57)
    assert len({e.doc_id.split("/")[2] for e in mmlu}) == 57  # round-robin over subjects
    assert [e.group for e in mmlu] == [e.doc_id.split("/")[2] for e in mmlu]  # for the stderr
    # a limit takes the dataset's (the harness's) first questions, not the first ids: ARC's
    # ids sort by exam source, and Mercury's are two thirds of each test set
    easy = load_examples(TASKS["arc_easy"], corpora_eval_dir, 200)
    assert easy[0].doc_id == "arc_easy/test/Mercury_417466"
    assert "photosynthesis" in easy[0].requests[0].context
    challenge = load_examples(TASKS["arc_challenge"], corpora_eval_dir, 200)
    assert challenge[0].doc_id == "arc_challenge/test/Mercury_7175875"
    for limited in (easy, challenge):
        assert sum("Mercury" in e.doc_id for e in limited) > 100


@pytest.fixture(scope="module")
def corpora_eval_dir() -> str:
    from pipelines.corpora import fetch as corpora_fetch

    data = Path(__file__).resolve().parents[2] / "data"
    corpora_fetch.fetch(data)
    return str(data / "eval")


# --- tokenization split and metrics ------------------------------------------------------------


def test_encode_pair_moves_trailing_spaces_and_splits_the_whole():
    def encode(s: str) -> list[int]:  # one token per character, merging "ab"
        out, i = [], 0
        while i < len(s):
            if s.startswith("ab", i):
                out.append(1000)
                i += 2
            else:
                out.append(ord(s[i]))
                i += 1
        return out

    assert encode_pair(encode, "x ", "y") == ([ord("x")], [ord(" "), ord("y")])
    # the continuation is what follows the context's own encoding in the whole's
    ctx, cont = encode_pair(encode, "xa", "bc")
    assert ctx == [ord("x"), ord("a")] and cont == [ord("c")]  # "ab" merged across the boundary


def test_metrics_arithmetic():
    task = TASKS["piqa"]
    ex = Example("d", (Request("c", " aaaa"), Request("c", " b")), gold=1, choices=("aaaa", "b"))
    # summed: choice 0 wins (-2 > -3); per character: -0.5 vs -3 -> choice 0 again
    row = example_results(task, ex, [Scored(-2.0, False, 2), Scored(-3.0, False, 1)])
    assert (row["pred"], row["acc"], row["pred_norm"], row["acc_norm"]) == (0, 0.0, 0, 0.0)
    row = example_results(task, ex, [Scored(-4.0, False, 2), Scored(-3.0, False, 1)])
    assert (row["acc"], row["acc_norm"]) == (1.0, 0.0)  # -4/4 = -1 beats -3/1 for acc_norm
    assert row["truncated"] is False
    rows = [{"acc": a, "acc_norm": a} for a in (1.0, 0.0, 1.0, 1.0)]
    m = task_metrics(task, [ex] * 4, rows)
    assert m["acc"] == 0.75 and m["chance"] == 0.5 and m["truncated"] == 0
    cut = example_results(
        task, ex, [Scored(-4.0, False, 2, truncated=True), Scored(-3.0, False, 1)]
    )
    assert cut["truncated"] is True
    assert task_metrics(task, [ex] * 2, [cut, row])["truncated"] == 1
    assert m["acc_stderr"] == pytest.approx(math.sqrt(0.75 * 0.25 / 3))
    assert mean_stderr([1.0]) is None
    lam = TASKS["lambada_openai"]
    rows = [{"acc": 1.0, "loglikelihoods": [-1.0]}, {"acc": 0.0, "loglikelihoods": [-3.0]}]
    m = task_metrics(lam, [ex, ex], rows)
    assert m["perplexity"] == pytest.approx(math.exp(2.0)) and m["acc_norm"] is None
    # a diverged model's log-likelihood past float range: an infinite perplexity (which the
    # gate refuses as not finite), not an OverflowError that loses the whole evaluation
    m = task_metrics(lam, [ex], [{"acc": 0.0, "loglikelihoods": [-800.0]}])
    assert m["perplexity"] == math.inf
    assert chance(lam, [ex]) == 0.0


def test_mmlus_stderr_pools_its_subjects_as_the_harness_does():
    """lm-eval reports MMLU as a group of 57 subject tasks, its mean weighted by size and its
    stderr ``pooled_sample_stderr`` of the subjects' stderrs: the within-subject variance
    pooled (the spread between subjects' means does not count). Its formula, written out
    here, against ours on the same results."""
    task = TASKS["mmlu"]
    requests = tuple(Request("q", f" {c}") for c in "ABCD")
    accs = {"anatomy": [1.0, 0.0, 1.0], "virology": [0.0, 0.0], "law": [1.0, 1.0, 1.0, 0.0]}
    examples, rows = [], []
    for subject, values in accs.items():
        for i, a in enumerate(values):
            examples.append(
                Example(f"{subject}/{i}", requests, gold=0, choices=tuple("ABCD"), group=subject)
            )
            rows.append({"doc_id": f"{subject}/{i}", "acc": a})
    sizes = [len(v) for v in accs.values()]
    stderrs = [mean_stderr(v) for v in accs.values()]
    harness = math.sqrt(
        sum((n - 1) * se**2 * n for n, se in zip(sizes, stderrs, strict=True))
        / (sum(sizes) - len(sizes))
        / sum(sizes)
    )
    m = task_metrics(task, examples, rows)
    assert m["acc"] == pytest.approx(5 / 9) and m["acc_stderr"] == pytest.approx(harness)
    # not the stderr of the nine results taken as one task
    assert m["acc_stderr"] < mean_stderr([a for v in accs.values() for a in v])
    assert harness == pytest.approx(math.sqrt((2 / 3 + 0 + 3 / 4) / (9 - 3) / 9))
    # a subject with one example adds no degree of freedom; all single: no stderr
    one = Example("x/0", requests, gold=0, choices=tuple("ABCD"), group="x")
    with_one = task_metrics(task, [*examples, one], [*rows, {"doc_id": "x/0", "acc": 1.0}])
    assert with_one["acc_stderr"] == pytest.approx(math.sqrt((2 / 3 + 0 + 3 / 4) / (10 - 4) / 10))
    assert task_metrics(task, [one], [{"doc_id": "x/0", "acc": 1.0}])["acc_stderr"] is None


# --- the scorer against the model's own forward pass -------------------------------------------


def test_scorer_matches_full_forward_log_softmax(monkeypatch):
    cfg = resolve_model(
        ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2),
        vocab_size=97,
    )
    model = Transformer(cfg, jax.random.key(3))
    mesh = dist.make_mesh(MeshConfig())
    shardings = dist.param_shardings(model, mesh)
    bias = jnp.zeros((cfg.num_layers, 0))
    scorer = Scorer(model, bias, shardings, mesh, batch_size=3, max_len=40)
    rng = np.random.default_rng(0)
    requests = [
        (rng.integers(4, 97, n).tolist(), rng.integers(4, 97, k).tolist())
        for n, k in [(5, 1), (17, 3), (33, 2), (60, 4), (2, 2)]  # the 4th is truncated to 40
    ]
    meshes = traced_meshes(monkeypatch)
    got = scorer.score(requests)
    assert meshes and set(meshes) == {dist.AXES}  # traced under its mesh (splash on TPU)
    assert [s.truncated for s in got] == [False, False, False, True, False]  # 64 > 41 tokens

    @jax.jit
    def logits_of(tokens):  # (1, 40): padding after the tokens changes nothing before it
        return model(tokens, jnp.zeros((1, 40), jnp.int32), jnp.arange(40)[None])[0][0]

    def forward(ids: list[int]) -> np.ndarray:
        return np.asarray(logits_of(jnp.asarray([[*ids, *[0] * (40 - len(ids))]])))[: len(ids)]

    for (ctx, cont), s in zip(requests, got, strict=True):
        ids = [*ctx, *cont][-41:]
        logits = forward(ids[:-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        n = len(ids) - 1
        span = range(n - len(cont), n)
        want = sum(float(logp[i, ids[i + 1]]) for i in span)
        greedy = all(int(np.argmax(logits[i])) == ids[i + 1] for i in span)
        assert s.loglikelihood == pytest.approx(want, abs=1e-4)
        assert s.is_greedy == greedy and s.tokens == len(cont)

    # the batch a request lands in (its padding, its neighbours) does not change its score
    alone = scorer.score([requests[1]])[0]
    assert alone.loglikelihood == pytest.approx(got[1].loglikelihood, abs=1e-5)
    # a request whose continuation is what the model predicts greedily is greedy
    ctx = requests[0][0]
    nxt: list[int] = []
    for _ in range(3):
        nxt.append(int(np.argmax(forward([*ctx, *nxt])[-1])))
    assert scorer.score([(ctx, nxt)])[0].is_greedy


def test_bfloat16_logits_are_float32_numbers():
    """In bfloat16 the logits are still accumulated (and kept) in float32: rounded to
    bfloat16, tokens whose logits differ by less than its spacing tie (argmax then takes the
    lower id: a true argmax judged not greedy) and log-likelihoods move by 0.01 nats."""
    from trainer.scoring import _token_scores

    cfg = resolve_model(
        ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2),
        vocab_size=97,
    )
    model = Transformer(cfg, jax.random.key(3))
    tokens = jnp.asarray(np.random.default_rng(1).integers(4, 97, (1, 32)), jnp.int32)
    logits = np.asarray(
        model(tokens, jnp.zeros((1, 32), jnp.int32), jnp.arange(32)[None], dtype=jnp.bfloat16)[0]
    )
    rounded = logits.astype(jnp.bfloat16).astype(np.float32)
    assert (rounded != logits).mean() > 0.5  # the forward's logits are no bfloat16 numbers
    # the scorer's: no (rows, positions, vocabulary) array of its program is bfloat16
    program = jax.make_jaxpr(
        lambda t: _token_scores(model, None, t, t, jnp.full((1, 1), 32), dtype=jnp.bfloat16)
    )(tokens)

    def avals(jaxpr):  # every output of every equation, nested programs (lax.map's) too
        for eqn in jaxpr.eqns:
            yield from (v.aval for v in eqn.outvars)
            for inner in jax.core.jaxprs_in_params(eqn.params):
                yield from avals(inner)

    vocab_wide = [a for a in avals(program.jaxpr) if len(a.shape) == 3 and a.shape[-1] == 97]
    assert vocab_wide and all(a.dtype == jnp.float32 for a in vocab_wide), vocab_wide


# --- the entrypoint refuses before any compute ----------------------------------------------------


def _run_dir(tmp_path: Path, vocab: int) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model": {"vocab_size": vocab}}))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"output_dir": str(out), "model": {"preset": "nano"}}))
    return cfg


def _sp_model(tmp_path: Path, vocab: int) -> str:
    from tests.support.trainer_data import stdlib_texts, train_sentencepiece

    return train_sentencepiece(stdlib_texts(200_000), vocab, str(tmp_path / "tok"))


def test_entrypoint_refusals(tmp_path, capsys):
    cfg = _run_dir(tmp_path, 400)
    tok = _sp_model(tmp_path, 400)
    base = ["--config", str(cfg), "--tokenizer", tok, "--task-data", str(tmp_path / "none")]

    assert eval_main([*base, "--tasks", "piqa,nosuchtask"]) == 2
    assert "unknown task(s) nosuchtask" in capsys.readouterr().err
    assert eval_main([*base, "--tasks", "piqa"]) == 2
    assert "no evaluation set at" in capsys.readouterr().err
    assert eval_main(["--config", str(cfg), "--tasks", "piqa"]) == 2
    assert "--tasks needs --tokenizer" in capsys.readouterr().err
    assert (
        eval_main([*base[:2], "--tokenizer", str(tmp_path / "missing.model"), "--tasks", "piqa"])
        == 2
    )
    assert "no sentencepiece model at" in capsys.readouterr().err

    (tmp_path / "b").mkdir()
    other = _run_dir(tmp_path / "b", 512)
    assert (
        eval_main(
            ["--config", str(other), "--tokenizer", tok, "--task-data", "x", "--tasks", "piqa"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "has 400 pieces but the checkpoint's model was trained with a vocabulary of 512" in err
    # The same 512 rows asked for by the config (model.vocab_size: padding over 400 pieces)
    # are the run's own: the tokenizer passes, and the next refusal is the missing data.
    padded = ["--config", str(other), "--set", "model.vocab_size=512", "--tokenizer", tok]
    assert eval_main([*padded, "--task-data", str(tmp_path / "none"), "--tasks", "piqa"]) == 2
    assert "no evaluation set at" in capsys.readouterr().err

    _write_set(
        tmp_path / "sets",
        "piqa",
        [_doc("piqa", 0, "validation", goal="g", choices=["a", "b"], answer=0)],
    )
    args = [
        "--config",
        str(cfg),
        "--tokenizer",
        tok,
        "--task-data",
        str(tmp_path / "sets"),
        "--tasks",
        "piqa",
    ]
    assert eval_main(args) == 2  # everything checks out but there is no checkpoint
    assert "no complete checkpoint" in capsys.readouterr().err
