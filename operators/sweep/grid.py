"""The sweep's grid: cells (a recipe's run per budget, size and seed) and each cell's steps.

A cell is plain JSON (it travels through XCom to the mapped tasks):
``{"index", "label", "budget", "seed", "recipe", "plan"}``, ``plan`` being
:meth:`trainer.recipes.RunPlan.to_dict`. Its train step holds what the trainer runs -- the
shape, steps, batch, length, seed, optimizer, and the pipeline's token stores with their
mixture weights -- so a cell trained on an earlier night, or by another sweep with the same
data, is a cache hit; the budget and the recipe that chose the run are not part of what ran
(``unversioned``). Its evaluate step scores the final checkpoint on the metric's stores.

The forecast runs are cells too (``kind: "forecast"``): the compute-optimal run of the recipe
at each forecast budget. The tasks that plan cells add each one's ``estimate`` before launch
(:func:`add_estimates`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from operators.pipeline.graph import with_output_version
from operators.steps import Step, output_of

SHAPE_KEYS = (
    "hidden_dim",
    "intermediate_dim",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_embeddings",
)


def recipe_for(params: Mapping[str, Any]) -> Any:
    """The form's recipe, with its steps per run where it has that knob (marin-2025), and
    every batch a multiple of the launch's data-parallel size (the trainer refuses another:
    on 2 x 4x4 v5e a small budget's batch of 8 would fail its cell at start)."""
    import dataclasses

    from operators.jobset import ManifestError
    from operators.jobset.mesh import MeshError, run_data_parallel_size
    from trainer.recipes import get_recipe

    recipe = get_recipe(params["recipe"])
    if hasattr(recipe, "steps_per_run") and params.get("steps_per_run"):
        recipe = dataclasses.replace(recipe, steps_per_run=int(params["steps_per_run"]))
    try:
        dp = run_data_parallel_size(params)
    except (ManifestError, MeshError):
        dp = 1  # the form's accelerator fields are refused by validate, naming them
    return dataclasses.replace(recipe, batch_multiple=dp)


def grid_for(params: Mapping[str, Any], vocab_size: int) -> list[dict[str, Any]]:
    """Every cell of the night's grid, budgets then sizes then seeds, indexed in that order."""
    recipe = recipe_for(params)
    fail = set(params.get("fail_cells") or [])
    cells: list[dict[str, Any]] = []
    for budget in params["budgets"]:
        plans = recipe.isoflop_grid(
            float(budget),
            int(params["points"]),
            vocab_size=vocab_size,
            seq_len=int(params["seq_len"]),
            spread=float(params["spread"]),
        )
        for plan in plans:
            for seed in params["seeds"]:
                index = len(cells)
                cells.append(
                    {
                        "kind": "grid",
                        "index": index,
                        "label": f"{plan.label} seed={seed}",
                        "budget": float(budget),
                        "seed": int(seed),
                        "recipe": recipe.name,
                        "plan": plan.to_dict(),
                        "fail_at_step": 1 if index in fail else 0,
                    }
                )
    return cells


def forecast_cells(params: Mapping[str, Any], vocab_size: int) -> list[dict[str, Any]]:
    """The compute-optimal run at each forecast budget (seed: the form's first)."""
    recipe = recipe_for(params)
    cells = []
    for i, budget in enumerate(sorted(params["forecast_budgets"])):
        plan = recipe.compute_config(
            float(budget), vocab_size=vocab_size, seq_len=int(params["seq_len"])
        )
        cells.append(
            {
                "kind": "forecast",
                "index": i,
                "label": f"forecast {plan.label}",
                "budget": float(budget),
                "seed": int(params["seeds"][0]),
                "recipe": recipe.name,
                "plan": plan.to_dict(),
                "fail_at_step": 0,
            }
        )
    return cells


def add_estimates(cells: list[dict[str, Any]], params: Mapping[str, Any]) -> float | None:
    """Set each cell's ``estimate`` before launch: its FLOPs, the slice's chips and, where the
    chip's peak is known (not on CPU), the accelerator seconds at an assumed MFU
    (:data:`trainer.recipes.DEFAULT_MFU`). Returns the slice's peak FLOP/s, or None."""
    from operators.jobset.catalogue import resolve
    from trainer.recipes import DEFAULT_MFU
    from trainer.shapes import CHIP_PEAK_FLOPS

    shape = resolve(params["accelerator"], params["topology"], int(params["slices"]))
    chip = CHIP_PEAK_FLOPS.get(params["accelerator"])
    peak = chip * shape.total_chips if chip else None
    for cell in cells:
        flops = cell["plan"]["flops"]
        estimate: dict[str, Any] = {"flops": flops, "chips": shape.total_chips}
        if peak:
            estimate.update(
                seconds=flops / (peak * DEFAULT_MFU), mfu_assumed=DEFAULT_MFU, peak_flops=peak
            )
        cell["estimate"] = estimate
    return peak


def budget_text(budget: float) -> str:
    """The budget in as few significant digits as say it exactly: ``3e11``, ``1.5e12`` (one
    digit alone made 1.5e12 and 2e12 one name, and two cells one lineage step)."""
    for digits in range(17):
        text = f"{budget:.{digits}e}"
        if float(text) == budget:
            break
    return text.replace("+", "")  # as the one-digit names always were: 3e11, 1e08


def cell_slug(cell: Mapping[str, Any]) -> str:
    plan = cell["plan"]
    return f"C{budget_text(cell['budget'])}-N{plan['non_embedding_params']}-s{cell['seed']}"


def cell_train_step(cell: Mapping[str, Any], graph: Any) -> Step:
    """The cell's train step, on the run's token stores (``graph``: the pipeline's graph)."""
    plan = cell["plan"]
    model = {k: plan["model"][k] for k in SHAPE_KEYS}
    model["vocab_size"] = 0  # the token store's: what the recipe counted with, exactly
    config = {
        "model": model,
        "steps": int(plan["steps"]),
        "batch_size": int(plan["batch_size"]),
        "seq_len": int(plan["seq_len"]),
        "seed": int(cell["seed"]),
        "optimizer": {
            "learning_rate": float(plan["learning_rate"]),
            "warmup_steps": int(plan["warmup_steps"]),
            "decay": plan["decay"],
            "min_lr_ratio": float(plan["min_lr_ratio"]),
            "beta2": float(plan["beta2"]),
        },
        "sources": graph.train.config["sources"],
    }
    unversioned = {
        **graph.train.unversioned,
        "fail_at_step": int(cell.get("fail_at_step") or 0),
        "budget": cell["budget"],
        "recipe": cell["recipe"],
        "label": cell["label"],
    }
    # the trainer's code and defaults, as the pipeline's train step counts them
    config = with_output_version("train", config)
    return Step(f"sweep/train/{cell_slug(cell)}", config, unversioned=unversioned)


def cell_evaluate_step(
    cell: Mapping[str, Any], graph: Any, stores: list[str], max_tokens: int
) -> Step:
    """The cell's evaluate step: its final checkpoint on the metric's ``stores``."""
    train = cell_train_step(cell, graph)
    pipeline_eval = graph.evaluate.config
    return Step(
        f"sweep/evaluate/{cell_slug(cell)}",
        with_output_version(
            "evaluate",
            {
                "train": output_of(train),
                "stores": {k: pipeline_eval["stores"][k] for k in stores},
                "tokenizer": pipeline_eval["tokenizer"],
                "max_tokens": int(max_tokens),
            },
        ),
        unversioned=dict(graph.evaluate.unversioned),
    )


def metric_stores(params: Mapping[str, Any], known: list[str]) -> list[str]:
    """The stores the metric averages: the form's, else every held-out store of the sources."""
    chosen = list(params.get("metric_stores") or [])
    return chosen or [k for k in known if k.startswith("heldout-")]


def cell_steps(cell: Mapping[str, Any], graph: Any, params: Mapping[str, Any]) -> tuple[Step, Step]:
    """The cell's (train, evaluate) steps for this run's form and graph."""
    stores = metric_stores(params, list(graph.eval_stores))
    return (
        cell_train_step(cell, graph),
        cell_evaluate_step(cell, graph, stores, int(params["eval_max_tokens"])),
    )
