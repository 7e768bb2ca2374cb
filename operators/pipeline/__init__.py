"""The pipeline, without Airflow: its task table (:mod:`.definition`), its step graph
(:mod:`.graph`), its run form (:mod:`.form`) and a walker of its data plane (:mod:`.dataplane`,
``make demo-data``). The DAG file and the operators build on these; nothing here imports
Airflow."""

from operators.pipeline.definition import (
    DOCUMENT_STAGES,
    PIPELINE,
    STAGES,
    TASKS,
    Role,
    TaskDef,
    check_table,
    document_input,
    edges,
    table_of_contents,
)

__all__ = [
    "DOCUMENT_STAGES",
    "PIPELINE",
    "STAGES",
    "TASKS",
    "Role",
    "TaskDef",
    "check_table",
    "document_input",
    "edges",
    "table_of_contents",
]
