"""Benchmark tasks as lm-evaluation-harness (0.4) defines them: prompts, choices, gold answers.

Each task turns the evaluation set's documents (``{task data}/{set}.jsonl.gz``, as
``pipelines.corpora.evalsets`` writes them: Dolma documents whose ``metadata`` keeps the
task's raw fields) into :class:`Example` s, each a list of loglikelihood requests
``(context, continuation)`` scored by ``trainer/scoring.py``:

- multiple choice (ARC, BoolQ, HellaSwag, PIQA, MMLU): one context, one request per choice
  with the continuation ``" " + choice``; ``acc`` = argmax of the summed log-likelihood,
  ``acc_norm`` = argmax of the log-likelihood per character of the choice;
- Winogrande, partial scoring: the option substituted into the sentence up to the blank is the
  context, the rest of the sentence after the blank the one shared continuation;
- LAMBADA (OpenAI variant): the passage without its last word, and ``" " + last word``;
  accuracy = the word is the greedy continuation, plus its perplexity.

The prompt formats are the harness's task YAMLs' (``lm_eval/tasks/<task>/*.yaml``), quoted
beside each builder. MMLU's five-shot examples are the first five of the subject's dev split,
as the harness's ``first_n`` sampler takes them: fixed, no draw. ``limit`` takes the first
``limit`` examples in the set's order (MMLU: round-robin over the subjects, so that every
subject counts).

JAX-free: the run form lists :data:`TASK_NAMES` at DAG parse time.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

Doc = dict[str, Any]  # a document's metadata, plus its text under "text"


class TaskError(ValueError):
    """An unknown task, or task data that is missing or not what the task reads."""


@dataclass(frozen=True)
class Request:
    """One loglikelihood request: log p(continuation | context)."""

    context: str
    continuation: str


@dataclass(frozen=True)
class Example:
    """One scored example: its requests (one per choice, or one for LAMBADA), the gold index,
    and the choices' texts whose character counts normalize ``acc_norm``."""

    doc_id: str
    requests: tuple[Request, ...]
    gold: int
    choices: tuple[str, ...] = ()
    # The harness's subtask it belongs to (MMLU: its subject). A task whose examples carry one
    # is a group of subtasks to the harness, its mean weighted by size: its stderr is pooled.
    group: str = ""


@dataclass(frozen=True)
class Task:
    """A benchmark: which evaluation set and split it reads, how a document becomes an
    example, and which metrics the harness reports for it."""

    name: str
    eval_set: str  # the file ``{task data}/{eval_set}.jsonl.gz``
    split: str
    build: Callable[[Doc, Sequence[Doc]], Example]
    kind: str = "multiple_choice"  # or "loglikelihood" (LAMBADA)
    acc_norm: bool = True
    shots: int = 0
    fewshot_split: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def _mc(doc: Doc, context: str, choices: Sequence[str], gold: int) -> Example:
    """A multiple-choice example: the harness's target delimiter " " before each choice."""
    requests = tuple(Request(context, " " + c) for c in choices)
    return Example(doc["id"], requests, gold, tuple(choices))


def _gold(doc: Doc) -> int:
    answer = doc.get("answer")
    if not isinstance(answer, int):
        raise TaskError(f"{doc['id']}: no gold answer")
    return answer


# --- the harness's formats, one builder per task --------------------------------------------


def arc(doc: Doc, _shots: Sequence[Doc]) -> Example:
    # arc_easy.yaml: doc_to_text "Question: {{question}}\nAnswer:", choices {{choices.text}}
    return _mc(doc, f"Question: {doc['question']}\nAnswer:", doc["choices"], _gold(doc))


def boolq(doc: Doc, _shots: Sequence[Doc]) -> Example:
    # super_glue/boolq/default.yaml: "{{passage}}\nQuestion: {{question}}?\nAnswer:",
    # doc_to_choice ["no", "yes"], target = label (1 = yes)
    context = f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
    return _mc(doc, context, ["no", "yes"], 1 if doc["choices"][_gold(doc)] == "yes" else 0)


def hellaswag(doc: Doc, _shots: Sequence[Doc]) -> Example:
    # hellaswag.yaml + utils.process_docs: query = preprocess(activity_label + ": " + ctx_a
    # + " " + ctx_b.capitalize()), choices = preprocessed endings (the converter applied it)
    return _mc(doc, doc["query"], doc["choices"], _gold(doc))


def piqa(doc: Doc, _shots: Sequence[Doc]) -> Example:
    # piqa.yaml: "Question: {{goal}}\nAnswer:", choices [sol1, sol2]
    return _mc(doc, f"Question: {doc['goal']}\nAnswer:", doc["choices"], _gold(doc))


def winogrande(doc: Doc, _shots: Sequence[Doc]) -> Example:
    # winogrande/preprocess_winogrande.py: contexts sentence[:blank] + option, one shared
    # target sentence[blank + 1:].strip(), after the delimiter " "
    sentence = doc["sentence"]
    blank = sentence.index("_")
    continuation = " " + sentence[blank + 1 :].strip()
    requests = tuple(Request(sentence[:blank] + opt, continuation) for opt in doc["choices"])
    return Example(doc["id"], requests, _gold(doc), tuple(doc["choices"]))


def lambada(doc: Doc, _shots: Sequence[Doc]) -> Example:
    # lambada_openai.yaml: "{{text.split(' ')[:-1]|join(' ')}}" and "{{' '+text.split(' ')[-1]}}"
    words = doc["text"].split(" ")
    return Example(doc["id"], (Request(" ".join(words[:-1]), " " + words[-1]),), 0)


MMLU_LETTERS = ("A", "B", "C", "D")


def _mmlu_question(doc: Doc) -> str:
    # mmlu/default/_default_template_yaml: "{{question.strip()}}\nA. {{choices[0]}}\n...
    # D. {{choices[3]}}\nAnswer:"
    lines = [doc["question"].strip()]
    lines += [f"{letter}. {c}" for letter, c in zip(MMLU_LETTERS, doc["choices"], strict=True)]
    return "\n".join([*lines, "Answer:"])


def mmlu(doc: Doc, shots: Sequence[Doc]) -> Example:
    # description "The following are multiple choice questions (with answers) about
    # {subject}.\n\n", then each shot "question Answer:" + " " + letter + "\n\n"
    subject = doc["subject"].replace("_", " ")
    context = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    for shot in shots:
        context += f"{_mmlu_question(shot)} {MMLU_LETTERS[_gold(shot)]}\n\n"
    context += _mmlu_question(doc)
    return replace(_mc(doc, context, MMLU_LETTERS, _gold(doc)), group=doc["subject"])


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("arc_easy", "arc_easy", "test", arc),
        Task("arc_challenge", "arc_challenge", "test", arc),
        Task("boolq", "boolq", "validation", boolq, acc_norm=False),
        Task("hellaswag", "hellaswag", "validation", hellaswag),
        Task("piqa", "piqa", "validation", piqa),
        Task("winogrande", "winogrande", "validation", winogrande, acc_norm=False),
        Task("lambada_openai", "lambada", "test", lambada, kind="loglikelihood", acc_norm=False),
        Task("mmlu", "mmlu", "test", mmlu, acc_norm=False),
        Task("mmlu_5shot", "mmlu", "test", mmlu, acc_norm=False, shots=5, fewshot_split="dev"),
    )
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; known: {', '.join(TASK_NAMES)}")
    return TASKS[name]


def parse_tasks(spec: str | Sequence[str]) -> list[Task]:
    """``"piqa,hellaswag"`` (or a list) -> tasks, every name checked before any is loaded."""
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [n for n in names if n]
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise TaskError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASK_NAMES)}")
    if len(set(names)) != len(names):
        raise TaskError(f"a task is named twice in {names}")
    return [TASKS[n] for n in names]


# --- reading the evaluation sets -------------------------------------------------------------


def set_path(task_data: str, task: Task) -> str:
    return f"{task_data.rstrip('/')}/{task.eval_set}.jsonl.gz"


def read_docs(path: str) -> Iterator[Doc]:
    """The documents of one evaluation set: metadata fields, plus ``id`` and ``text``."""
    import fsspec

    with fsspec.open(path, "rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    d = json.loads(line)
                    doc = {**d.get("metadata", {}), "id": d["id"], "text": d["text"]}
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise TaskError(
                        f"{path}:{number}: not an evaluation document ({type(e).__name__}: "
                        f"{e}); run `make corpora` again"
                    ) from e
                yield doc


def _round_robin(docs: list[Doc], key: str, limit: int) -> list[Doc]:
    """The first ``limit`` docs taking one per ``key`` value in turn (sorted keys)."""
    groups: dict[str, list[Doc]] = {}
    for d in docs:
        groups.setdefault(str(d.get(key)), []).append(d)
    order = [groups[k] for k in sorted(groups)]
    out: list[Doc] = []
    for i in range(max((len(g) for g in order), default=0)):
        out += [g[i] for g in order if i < len(g)]
        if len(out) >= limit:
            break
    return out[:limit]


def load_examples(task: Task, task_data: str, limit: int | None = None) -> list[Example]:
    """The task's examples, in the set's order (``limit``: the first that many).

    Raises :class:`TaskError` naming the file when the set is missing or lacks the task's
    fields (task data written before the converter kept them: fetch again)."""
    path = set_path(task_data, task)
    try:
        docs = list(read_docs(path))
    except FileNotFoundError as e:
        raise TaskError(f"{task.name}: no evaluation set at {path}") from e
    except EOFError as e:  # a gzip stream cut short
        raise TaskError(f"{task.name}: {path} is truncated; run `make corpora` again") from e
    # the dataset's order where the files' id order is not it (ARC: ``position``)
    wanted = sorted(
        (d for d in docs if d.get("split") == task.split), key=lambda d: d.get("position", 0)
    )
    if not wanted:
        raise TaskError(f"{task.name}: {path} has no {task.split!r} documents")
    if limit is not None:
        wanted = _round_robin(wanted, "subject", limit) if task.eval_set == "mmlu" else wanted
        wanted = wanted[:limit]
    shots_by_subject: dict[str, list[Doc]] = {}
    if task.shots:
        for d in docs:
            if d.get("split") == task.fewshot_split:
                shots_by_subject.setdefault(d["subject"], []).append(d)
    examples = []
    for d in wanted:
        shots = shots_by_subject.get(d.get("subject", ""), [])[: task.shots]
        if len(shots) < task.shots:
            raise TaskError(f"{task.name}: {d['id']} has {len(shots)} few-shot examples")
        try:
            examples.append(task.build(d, shots))
        except KeyError as e:
            raise TaskError(
                f"{task.name}: {path} lacks the field {e} (written by an older fetch: "
                "run `make corpora` again)"
            ) from e
        except (ValueError, TypeError, IndexError, AttributeError) as e:  # a malformed document
            raise TaskError(
                f"{task.name}: {path}: document {d.get('id')!r} cannot be built into a "
                f"{task.name} example ({type(e).__name__}: {e}); run `make corpora` again"
            ) from e
    return examples


def chance(task: Task, examples: Sequence[Example]) -> float:
    """Expected accuracy of a uniform guess: the mean of 1 / choices (0 for LAMBADA's exact
    greedy word)."""
    if task.kind != "multiple_choice" or not examples:
        return 0.0
    return sum(1.0 / len(e.requests) for e in examples) / len(examples)
