"""Our benchmark scorer against lm-evaluation-harness itself, example by example.

The tiny run is exported to Hugging Face format (``trainer.export``) and the harness
(``lm_eval.simple_evaluate``, its ``hf`` backend, float32 on the CPU) scores the very documents
our scorer scores. The harness runs its *own* task definitions: each task here is a YAML that
``include`` s the harness's file (``lm_eval/tasks/piqa/piqa.yaml``, ...) and replaces only the
dataset with a local JSONL of the evaluation set's raw fields, so its prompt templates,
``process_docs``, Winogrande's partial scoring, MMLU's description and first-n few-shot
sampler and its metrics are the harness's, not copies. Compared per example: the request
strings, the log-likelihood of every request, and the predictions behind ``acc`` and
``acc_norm``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lm_eval  # a dev dependency (requirements-parity.txt, installed by make install-parity)
import pytest

from trainer.evaluate import main as eval_main
from trainer.tasks import TASKS, load_examples, read_docs, set_path

LIMIT = 120  # examples per task: a few hundred requests each, seconds on the tiny model
TASK_NAMES = ("arc_easy", "boolq", "hellaswag", "piqa", "winogrande", "lambada_openai", "mmlu")
LETTERS = "ABCDEFGHIJ"
LL_TOLERANCE = 2e-3  # nats, summed over a continuation: float32 JAX against float32 PyTorch


# --- the harness's raw schema for each evaluation set ----------------------------------------


def harness_doc(task: str, d: dict) -> dict:
    """One of our evaluation documents in the field names of the harness's dataset, and our
    id (an extra column the harness carries along into its logged samples)."""
    return {"slipway_id": d["id"], **_harness_fields(task, d)}


def _harness_fields(task: str, d: dict) -> dict:
    if task == "arc_easy":
        labels = list(LETTERS[: len(d["choices"])])
        return {
            "id": d["id"],
            "question": d["question"],
            "choices": {"text": d["choices"], "label": labels},
            "answerKey": labels[d["answer"]],
        }
    if task == "boolq":
        return {
            "passage": d["passage"],
            "question": d["question"],
            "label": int(d["choices"][d["answer"]] == "yes"),
        }
    if task == "hellaswag":
        return {
            "activity_label": d["activity_label"],
            "ctx_a": d["ctx_a"],
            "ctx_b": d["ctx_b"],
            "endings": d["endings"],
            "label": str(d["answer"]),
        }
    if task == "piqa":
        return {
            "goal": d["goal"],
            "sol1": d["choices"][0],
            "sol2": d["choices"][1],
            "label": d["answer"],
        }
    if task == "winogrande":
        return {
            "sentence": d["sentence"],
            "option1": d["choices"][0],
            "option2": d["choices"][1],
            "answer": str(d["answer"] + 1),
        }
    if task == "lambada_openai":
        return {"text": d["text"]}
    if task == "mmlu":
        return {k: d[k] for k in ("question", "subject", "choices", "answer")}
    raise AssertionError(task)


HARNESS_YAML = {
    "arc_easy": "arc/arc_easy.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "lambada_openai": "lambada/lambada_openai.yaml",
}


def _write_jsonl(path: Path, docs: list[dict]) -> None:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")


def _task_yaml(
    include: Path, name: str, split: str, files: dict[str, Path], extra: str = ""
) -> str:
    data_files = "".join(f"    {k}: {v}\n" for k, v in files.items())
    splits = {"training_split": "null", "validation_split": "null", "test_split": "null"}
    splits[f"{'validation' if split == 'validation' else 'test'}_split"] = split
    return (
        f"include: {include}\ntask: {name}\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n{data_files}"
        + "".join(f"{k}: {v}\n" for k, v in splits.items())
        + extra
    )


def harness_tasks(root: Path, eval_dir: str, tasks: tuple[str, ...]) -> dict[str, list[str]]:
    """Write the YAMLs and data: ``{our task: [harness task names]}`` (MMLU: one per subject,
    as the harness's own MMLU group is one task per subject)."""
    harness_root = Path(lm_eval.__file__).parent / "tasks"
    names: dict[str, list[str]] = {}
    for task in tasks:
        t = TASKS[task]
        examples = load_examples(t, eval_dir, LIMIT)
        wanted = {e.doc_id for e in examples}
        docs = [d for d in read_docs(set_path(eval_dir, t)) if d["id"] in wanted]
        docs.sort(key=lambda d: [e.doc_id for e in examples].index(d["id"]))
        if task != "mmlu":
            data = root / f"{task}.jsonl"
            _write_jsonl(data, [harness_doc(task, d) for d in docs])
            yaml = _task_yaml(
                harness_root / HARNESS_YAML[task], f"slipway_{task}", t.split, {t.split: data}
            )
            (root / f"slipway_{task}.yaml").write_text(yaml, encoding="utf-8")
            names[task] = [f"slipway_{task}"]
            continue
        all_docs = list(read_docs(set_path(eval_dir, t)))
        names[task] = []
        for subject in dict.fromkeys(d["subject"] for d in docs):
            test = root / f"mmlu_{subject}_test.jsonl"
            dev = root / f"mmlu_{subject}_dev.jsonl"
            _write_jsonl(test, [harness_doc(task, d) for d in docs if d["subject"] == subject])
            _write_jsonl(
                dev,
                [
                    harness_doc(task, d)
                    for d in all_docs
                    if d["subject"] == subject and d["split"] == "dev"
                ],
            )
            include = harness_root / "mmlu" / "default" / f"mmlu_{subject}.yaml"
            name = f"slipway_mmlu_{subject}"
            extra = "tag: null\n"
            yaml = _task_yaml(include, name, "test", {"test": test, "dev": dev}, extra)
            (root / f"{name}.yaml").write_text(yaml, encoding="utf-8")
            names[task].append(name)
    return names


# --- running both ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory) -> Path:
    from trainer.export import main as export_main

    out = tmp_path_factory.mktemp("hf") / "model"
    args = ["--config", tiny_run.config, "--tokenizer", tiny_run.tokenizer, "--out", str(out)]
    assert export_main(args) == 0
    return out


def ours(tiny_run, tmp_path: Path, tasks: str, shots_task: bool = False) -> dict[str, list[dict]]:
    details = tmp_path / "details"
    args = ["--config", tiny_run.config, "--tokenizer", tiny_run.tokenizer, "--tasks", tasks]
    args += ["--task-data", tiny_run.eval_dir, "--limit", str(LIMIT), "--details", str(details)]
    args += ["--output", str(tmp_path / "eval.json")]
    assert eval_main(args) == 0
    return {
        t: [json.loads(x) for x in (details / f"{t}.jsonl").read_text().splitlines()]
        for t in tasks.split(",")
    }


def harness(exported: Path, root: Path, names: list[str], shots: int) -> dict[str, list[dict]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model="hf",
        model_args=f"pretrained={exported},dtype=float32",
        tasks=names,
        num_fewshot=shots,
        task_manager=TaskManager(include_path=str(root)),
        batch_size=8,
        device="cpu",
        log_samples=True,
        # The comparison is per sample; the harness's bootstrapped stderr (perplexity's) runs
        # in a forked multiprocessing pool, which deadlocks beside JAX's and torch's threads
        # (seen: a fresh-clone `make test` hung here until the 900 s timeout).
        bootstrap_iters=0,
    )
    return {n: out["samples"][n] for n in names}


def compare(task: str, our_rows: list[dict], samples: list[dict], examples) -> list[str]:
    """Asserts request strings and log-likelihoods; returns the examples whose prediction
    differs (each must be a near-tie)."""
    by_id = {s["doc"]["slipway_id"]: s for s in samples}
    assert len(our_rows) == len(by_id) == len(examples)
    samples = [by_id[e.doc_id] for e in examples]
    differing = []
    for row, sample, example in zip(our_rows, samples, examples, strict=True):
        requests = [(r.context, r.continuation) for r in example.requests]
        assert [tuple(a) for a in sample["arguments"]] == requests, (task, example.doc_id)
        theirs = [float(r[0][0]) for r in sample["resps"]]
        diffs = [abs(a - b) for a, b in zip(row["loglikelihoods"], theirs, strict=True)]
        assert max(diffs) < LL_TOLERANCE, (task, example.doc_id, row["loglikelihoods"], theirs)
        for metric in ("acc", "acc_norm"):
            if metric in sample and metric in row and sample[metric] != row[metric]:
                differing.append(f"{task} {example.doc_id} {metric}")
    return differing


def test_our_scores_match_the_harness(tiny_run, exported, tmp_path):
    root = tmp_path / "harness_tasks"
    root.mkdir()
    names = harness_tasks(root, tiny_run.eval_dir, TASK_NAMES)
    our = ours(tiny_run, tmp_path, ",".join(TASK_NAMES))
    theirs = harness(exported, root, [n for t in TASK_NAMES for n in names[t]], shots=0)
    differing: list[str] = []
    for task in TASK_NAMES:
        examples = load_examples(TASKS[task], tiny_run.eval_dir, LIMIT)
        samples = [s for n in names[task] for s in theirs[n]]
        differing += compare(task, our[task], samples, examples)
    # a prediction may differ only where two choices' scores tie within the tolerance
    assert not differing, differing
    # MMLU is the harness's group of subject tasks: its stderr pools theirs, by the harness's
    # own functions on its own per-subject results
    from lm_eval.api.metrics import mean_stderr, pooled_sample_stderr

    subjects = [[s["acc"] for s in theirs[n]] for n in names["mmlu"]]
    assert min(len(a) for a in subjects) >= 2  # else the harness reports no stderr
    pooled = pooled_sample_stderr([mean_stderr(a) for a in subjects], [len(a) for a in subjects])
    body = json.loads((tmp_path / "eval.json").read_text())
    assert body["benchmarks"]["mmlu"]["acc_stderr"] == pytest.approx(pooled, rel=1e-9)


def test_mmlu_five_shot_matches_the_harness(tiny_run, exported, tmp_path):
    root = tmp_path / "harness_tasks"
    root.mkdir()
    names = harness_tasks(root, tiny_run.eval_dir, ("mmlu",))
    our = ours(tiny_run, tmp_path, "mmlu_5shot")["mmlu_5shot"]
    theirs = harness(exported, root, names["mmlu"], shots=5)
    examples = load_examples(TASKS["mmlu_5shot"], tiny_run.eval_dir, LIMIT)
    samples = [s for n in names["mmlu"] for s in theirs[n]]
    assert not compare("mmlu_5shot", our, samples, examples)
    assert math.isclose(
        sum(r["acc"] for r in our) / len(our), sum(s["acc"] for s in samples) / len(samples)
    )
