"""The pipeline definition: one table of tasks, in order, with their upstreams.

Marin's executor keeps one graph of steps and walks it; so does Slipway, in two layers:

* this table says which tasks there are, what runs each (its :class:`Role`), and which tasks
  each one reads from. The ``slipway_pipeline`` DAG builds its tasks and edges from it, and
  :func:`operators.pipeline.graph.build_graph` wires each document stage's input from it;
* :func:`operators.pipeline.graph.build_graph` gives each task its content-addressed steps.

``tests/unit/test_pipeline_definition.py`` holds the two together: every edge here is an
upstream of some step of the task (an input it reads), and every step upstream is an edge.
``operators.pipeline.dataplane`` walks the same table without Airflow (``make demo-data``).

Airflow-free and cheap: the DAG file imports it at parse time.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass


class Role(enum.StrEnum):
    """What runs a task (the DAG maps each role to its operator class)."""

    VALIDATE = "validate"  # the run form, before anything is read
    FETCH = "fetch"  # the corpora: fetched if missing, recorded, the graph resolved
    BEAM = "beam"  # a data-plane stage, ``python -m pipelines.<task_id>``
    SPLIT = "split"  # clean documents -> per-source train / held-out files
    TRAIN = "train"  # the trainer, as a JobSet
    EVALUATE = "evaluate"  # held-out loss, perplexity, bits/byte, benchmarks, samples
    EXPORT = "export"  # the trained model as a Hugging Face folder
    GATE = "gate"  # promote the model if it meets the form's criteria (no step: not cached)
    RECORD = "record"  # the run summary, whatever happened (the DAG's only leaf)


@dataclass(frozen=True)
class TaskDef:
    """One task of the pipeline: its id (also its Beam stage's name), role and upstreams."""

    task_id: str
    role: Role
    upstream: tuple[str, ...] = ()
    summary: str = ""


PIPELINE: tuple[TaskDef, ...] = (
    TaskDef("validate", Role.VALIDATE, (), "check the run form: what a JSON schema cannot say"),
    TaskDef("fetch", Role.FETCH, ("validate",), "fetch and record the corpora, resolve the graph"),
    TaskDef("ingest", Role.BEAM, ("fetch",), "raw files -> normalized documents"),
    TaskDef("quality", Role.BEAM, ("ingest",), "Gopher/C4 quality and language filters"),
    TaskDef("exact_dedup", Role.BEAM, ("quality",), "exact duplicates, by normalized text"),
    TaskDef("fuzzy_dedup", Role.BEAM, ("exact_dedup",), "near duplicates, MinHash LSH"),
    TaskDef(
        "decontaminate",
        Role.BEAM,
        ("fetch", "fuzzy_dedup"),
        "drop documents sharing n-grams with the eval sets",
    ),
    TaskDef("split", Role.SPLIT, ("decontaminate",), "per-source train and held-out files"),
    TaskDef("train_tokenizer", Role.BEAM, ("split",), "SentencePiece on the training split"),
    TaskDef(
        "tokenize",
        Role.BEAM,
        ("fetch", "split", "train_tokenizer"),
        "token stores: train and held-out per source, eval prose",
    ),
    TaskDef("train", Role.TRAIN, ("tokenize",), "the model, as a JobSet (local or GKE)"),
    TaskDef(
        "evaluate",
        Role.EVALUATE,
        ("tokenize", "train", "train_tokenizer"),
        "held-out loss, perplexity and bits/byte per store; benchmarks; samples",
    ),
    TaskDef(
        "export",
        Role.EXPORT,
        ("train", "train_tokenizer"),
        "the trained model as a Hugging Face folder (LlamaForCausalLM and its tokenizer)",
    ),
    TaskDef(
        "gate",
        Role.GATE,
        ("evaluate", "export"),
        "promote the model (lineage, Asset slipway://models/<name>) if it meets the criteria",
    ),
    TaskDef(
        "record",
        Role.RECORD,
        ("evaluate", "export", "gate"),
        "the run summary in lineage, whatever happened",
    ),
)

TASKS: dict[str, TaskDef] = {t.task_id: t for t in PIPELINE}
# The document stages (a stage's input is its one document-stage upstream's output).
DOCUMENT_STAGES = ("ingest", "quality", "exact_dedup", "fuzzy_dedup", "decontaminate")
# Every Beam stage, in pipeline order: the keys of the form's ``stage_configs``.
STAGES: tuple[str, ...] = tuple(t.task_id for t in PIPELINE if t.role is Role.BEAM)


def edges() -> Iterator[tuple[str, str]]:
    """Every (upstream, downstream) task pair, in table order."""
    for task in PIPELINE:
        for up in task.upstream:
            yield up, task.task_id


def document_input(task_id: str) -> str | None:
    """The document stage whose output ``task_id`` reads, or None (ingest reads raw files)."""
    found = [u for u in TASKS[task_id].upstream if u in DOCUMENT_STAGES]
    if len(found) > 1:
        raise ValueError(f"{task_id}: more than one document input {found}")
    return found[0] if found else None


def check_table() -> None:
    """The table is a DAG in order: known upstreams, each listed before its task, one root."""
    seen: set[str] = set()
    for task in PIPELINE:
        unknown = [u for u in task.upstream if u not in seen]
        if unknown:
            raise ValueError(f"{task.task_id}: upstream {unknown} not defined before it")
        if task.task_id in seen:
            raise ValueError(f"{task.task_id}: defined twice")
        seen.add(task.task_id)
    roots = [t.task_id for t in PIPELINE if not t.upstream]
    if roots != ["validate"]:
        raise ValueError(f"the pipeline must start at validate alone, not {roots}")


def table_of_contents() -> str:
    """The pipeline as a Markdown list (the DAG's documentation in the UI)."""
    return "\n".join(
        f"1. **{t.task_id}** ({', '.join(t.upstream) or 'first'}): {t.summary}" for t in PIPELINE
    )


check_table()
