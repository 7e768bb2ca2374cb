"""The layout's dependency rules (docs/architecture.md), read from the source with ``ast``.

Every import counts, lazy ones inside functions included (a lazy import is still a dependency);
only imports under ``if TYPE_CHECKING:`` are left out. The rules:

- ``dags/`` imports Airflow and ``operators`` only;
- ``pipelines/`` never imports Airflow, ``operators`` or ``trainer``;
- ``trainer/`` never imports Airflow, Beam, ``operators`` or ``pipelines``;
- ``tokenstore/`` imports TensorStore, NumPy, fsspec and the standard library only;
- ``operators/`` imports of ``pipelines`` and ``trainer`` only their Beam- and JAX-free
  contract: the stage configs, the manifest and corpora fetcher of the data plane, the
  trainer's config, shapes, run directory, scaling recipes and fits;
- the Airflow-free core of ``operators/`` (step model, lineage, launch, naming, policy,
  Dataflow settings, pipeline definition, the sweep's form, grid and fits) imports no Airflow;
- no import cycle among the project's modules.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dags", "operators", "pipelines", "trainer", "tokenstore", "plugins")
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}

OPERATORS_MAY_USE = {
    "pipelines": {
        "pipelines.configs",
        "pipelines.manifest",
        "pipelines.corpora.fetch",
        "pipelines.split",
    },
    "trainer": {
        "trainer.config",
        "trainer.shapes",
        "trainer.rundir",
        "trainer.export_files",  # the names of an export folder's files (constants)
        "trainer.scaling",
        "trainer.recipes",
        "trainer.fitting",
        "trainer.tasks",  # benchmark task names and the sets they read (JAX-free)
        "trainer.mesh_axes",  # the mesh's axis names, which split the batch (constants)
    },
}
AIRFLOW_FREE = (
    "operators.steps",
    "operators.pipeline",
    "operators.sweep",
    "operators.naming",
    "operators.policy",
    "operators.dataflow",
    "operators.lineage",
    "operators.reports",
    "operators.jobset",
    "operators.cli",
    "operators.summary",
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _type_checking_only(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = getattr(test, "id", None) or getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


@cache
def imports_of(module: str) -> frozenset[str]:
    """Every module ``module`` imports (dotted names; ``from a import b`` gives ``a.b`` when
    that is a project module, else ``a``)."""
    path = modules()[module]
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level + (path.name == "__init__.py") or None]
                base = ".".join([*package, *([base] if base else [])])
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules()}
            found |= subs or {base}
            if len(subs) < len(node.names):
                found.add(base)
    return frozenset(found)


def _project(name: str) -> str | None:
    """The project module an imported name is (or is in), None for a third-party one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules():
            return ".".join(parts[:i])
    return None


def _top(name: str) -> str:
    return name.split(".")[0]


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_scan_sees_the_project():
    assert {"operators.params", "trainer.model", "pipelines.stage", "dags.slipway_pipeline"} <= set(
        modules()
    )
    assert "operators.steps" in imports_of("operators.pipeline.graph")
    assert "airflow.sdk" in imports_of("operators.validate")


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("pipelines", ("airflow", "operators", "trainer")),
        ("trainer", ("airflow", "apache_beam", "operators", "pipelines")),
        ("dags", ("trainer", "pipelines", "jax", "apache_beam", "tensorstore")),
    ],
)
def test_packages_keep_to_their_layer(package, forbidden):
    bad = sorted(
        (m, name)
        for m in modules()
        if _top(m) == package
        for name in imports_of(m)
        if _top(name) in forbidden
    )
    assert bad == []


def test_the_token_store_needs_only_tensorstore_and_numpy():
    allowed = STDLIB | {"tensorstore", "numpy", "fsspec", "tokenstore"}
    bad = sorted(
        (m, n)
        for m in modules()
        if _top(m) == "tokenstore"
        for n in imports_of(m)
        if _top(n) not in allowed
    )
    assert bad == []


def test_operators_use_only_the_data_planes_and_trainers_contract():
    bad = []
    for m in modules():
        if _top(m) != "operators":
            continue
        for name in imports_of(m):
            top = _top(name)
            if top in OPERATORS_MAY_USE and name != top:
                if _project(name) not in OPERATORS_MAY_USE[top]:
                    bad.append((m, name))
            elif top in OPERATORS_MAY_USE:  # `from trainer import rundir` resolves above
                bad.append((m, name))
    assert bad == []


def test_the_core_of_operators_imports_no_airflow():
    bad = sorted(
        (m, n)
        for m in modules()
        if _in(m, AIRFLOW_FREE)
        for n in imports_of(m)
        if _top(n) == "airflow"
    )
    assert bad == []


def test_no_import_cycles():
    graph = {m: {p for n in imports_of(m) if (p := _project(n)) and p != m} for m in modules()}
    # Tarjan's strongly connected components: any with two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []
