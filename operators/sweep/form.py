"""The scaling sweep's run form: the pipeline's data and launch fields, and the sweep's own.

The sweep's cells take their shape, steps, batch and optimizer from the recipe, so the
pipeline's reference-run fields (preset, steps, batch, learning rate, warmup, seed, fault
injection at a step) are not in this form; the tasks the sweep shares with the pipeline see
them at the pipeline's defaults (:func:`operators.pipeline.form.with_defaults`).

Airflow-free: the DAG wraps these fields in Params, the ``validate`` task calls
:func:`check_sweep_config`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

from operators.pipeline.form import (
    PlatformDefaultsError,
    RunConfigError,
    field,
    form_fields,
    full_match,
    schema_problem,
    unknown_fields,
)

# The pipeline's reference-run fields: the recipe decides these for every cell.
REPLACED_BY_RECIPE = (
    "model_preset",
    "steps",
    "batch_size",
    "learning_rate",
    "warmup_steps",
    "seed",
    "fail_at_step",
)
# The pipeline's own evaluation, export and promotion: a sweep's cells are scored on its metric
# alone, export nothing and promote nothing (the shared tasks still see the pipeline's
# defaults: ``with_defaults``).
PIPELINE_ONLY = (
    "eval_tasks",
    "eval_task_limit",
    "export_dtype",
    "model_name",
    "gate_max_bits_per_byte",
    "gate_min_accuracy",
    "gate_max_regression",
)
METRICS = ("loss", "bits_per_byte")
# A JSON object of form values, or the path of a file holding one: the platform's nightly
# sweep. Scheduled nights run the form's defaults, so this is what a night sweeps, and what
# the form shows first.
SWEEP_CONF_ENV = "SLIPWAY_SWEEP_CONF"
MAX_CELLS = 256  # one night's grid; more is a typo in budgets or points
RECIPE_NAMES = ("marin-2025", "chinchilla-deepseek")  # trainer/recipes.py (a test checks)

_BUDGET = {"type": "number", "exclusiveMinimum": 0, "maximum": 1e27}
# The default sweep's tokenizer: at its widths (16 to 192) an LM head over the pipeline's
# 8192 tokens would be most of every run's FLOPs, and the budgets would buy mostly head.
SWEEP_VOCAB_SIZE = 1024


def sweep_form_fields(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The sweep form, field -> {default, schema}: ``make sweep-demo``'s sweep, three budgets
    over a decade and a forecast at 10x, which runs on two cores (docs/scaling.md)."""
    left_out = (*REPLACED_BY_RECIPE, *PIPELINE_ONLY)
    fields = {k: v for k, v in form_fields(environ).items() if k not in left_out}
    stages = copy.deepcopy(fields["stage_configs"]["default"])
    stages["train_tokenizer"]["vocab_size"] = SWEEP_VOCAB_SIZE
    fields["stage_configs"] = {**fields["stage_configs"], "default": stages}
    fields.update(
        {
            "recipe": field(
                "marin-2025",
                type="string",
                enum=list(RECIPE_NAMES),
                title="Scaling recipe",
                description="trainer/recipes.py: how a compute budget becomes a run (shape, "
                "tokens, batch, learning rate, warmup, schedule, beta2).",
            ),
            "budgets": field(
                [3e11, 1e12, 3e12],
                type="array",
                items=_BUDGET,
                minItems=2,
                maxItems=16,
                title="Compute budgets (training FLOPs), increasing",
            ),
            "points": field(
                5,
                type="integer",
                minimum=3,
                maximum=16,
                title="Model sizes per budget",
                description="IsoFLOP points, log-spaced around the recipe's optimum (at least "
                "3: a parabola needs three).",
            ),
            "spread": field(
                6.0,
                type="number",
                minimum=1.5,
                maximum=64,
                title="IsoFLOP spread",
                description="Sizes from N*/spread to N* x spread.",
            ),
            "steps_per_run": field(
                200,
                type="integer",
                minimum=20,
                maximum=1_000_000,
                title="Steps per run (marin-2025)",
                description="The recipe solves each run's batch for this many steps.",
            ),
            "seeds": field(
                [0],
                type="array",
                items={"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
                minItems=1,
                maxItems=8,
                uniqueItems=True,
                title="Seeds (one cell per seed)",
            ),
            "metric": field(
                "loss",
                type="string",
                enum=list(METRICS),
                title="Metric",
                description="What the fits model: held-out loss (nats/token) or bits/byte, "
                "averaged over the metric stores.",
            ),
            "metric_stores": field(
                [],
                type="array",
                items={"type": "string", "pattern": full_match(r"(heldout|eval)-[a-z0-9-]{1,64}")},
                uniqueItems=True,
                title="Held-out stores of the metric",
                description="e.g. heldout-brown; empty = every held-out store of the sources.",
            ),
            "forecast_budgets": field(
                [3e13],
                type="array",
                items=_BUDGET,
                minItems=1,
                maxItems=4,
                uniqueItems=True,
                title="Forecast budgets (FLOPs)",
                description="Each above the largest fitted budget: its compute-optimal run is "
                "forecast (pre-registered), then trained and checked.",
            ),
            "fail_cells": field(
                [],
                type="array",
                items={"type": "integer", "minimum": 0, "maximum": MAX_CELLS - 1},
                uniqueItems=True,
                title="Fault injection: cells to fail",
                description="Grid indexes whose training is pre-empted at its first logged "
                "step (local backend); a backfill or cleared task resumes and completes them.",
            ),
        }
    )
    return _with_platform_sweep(fields, environ)


def _with_platform_sweep(
    fields: dict[str, dict[str, Any]], environ: Mapping[str, str] | None
) -> dict[str, dict[str, Any]]:
    """The form with ``$SLIPWAY_SWEEP_CONF``'s values as its defaults, each checked against its
    field's schema at parse time, then the budgets across fields (:func:`budget_problems`): a
    bad one would refuse every night, far from its cause.

    The variable holds a JSON object (what the Helm chart's ``sweepForm`` sets), or the path
    of a file holding one.
    """
    import json
    import os

    setting = (os.environ if environ is None else environ).get(SWEEP_CONF_ENV, "").strip()
    if not setting:
        return fields
    inline = setting.startswith("{")
    where = SWEEP_CONF_ENV if inline else f"{SWEEP_CONF_ENV} ({setting})"
    try:
        if inline:
            values = json.loads(setting)
        else:
            with open(setting, encoding="utf-8") as handle:
                values = json.load(handle)
    except (OSError, ValueError) as exc:
        raise PlatformDefaultsError(f"{where}: cannot read a JSON object: {exc}") from None
    if not isinstance(values, dict):
        raise PlatformDefaultsError(f"{where}: must be a JSON object of form fields")
    problems = unknown_fields(values, fields, "the sweep form")
    for name, value in values.items():
        if name not in fields:
            continue
        if (reason := schema_problem(fields[name], value)) is not None:
            problems.append(f"{name}: {reason}")
        else:
            fields[name] = {**fields[name], "default": value}
    if not problems:  # and the rules across fields that need no tokenizer: every night's
        problems = budget_problems(  # validate would refuse these defaults
            fields["budgets"]["default"], fields["forecast_budgets"]["default"]
        )
    if problems:
        raise PlatformDefaultsError(f"{where}: invalid sweep defaults:\n  " + "\n  ".join(problems))
    return fields


def budget_problems(budgets: Sequence[float], forecasts: Sequence[float]) -> list[str]:
    """The budgets' rules across fields, each naming its field: the fitted budgets strictly
    increasing, and every forecast above the largest (a forecast extrapolates)."""
    problems: list[str] = []
    budgets = list(budgets)
    if any(not math.isfinite(b) for b in budgets):
        problems.append("budgets: every budget must be a finite number of FLOPs")
    elif budgets != sorted(budgets) or len(set(budgets)) != len(budgets):
        problems.append(f"budgets: must be strictly increasing, got {budgets}")
    if budgets and any(f <= max(budgets) for f in forecasts):
        low = ", ".join(f"{f:.6g}" for f in sorted(f for f in forecasts if f <= max(budgets)))
        problems.append(
            f"forecast_budgets: [{low}] not above the largest fitted budget "
            f"({max(budgets):.6g}): a forecast extrapolates"
        )
    return problems


def check_sweep_config(params: Mapping[str, Any], vocab_size: int) -> None:
    """What the schema cannot say about a sweep, every problem at once, each naming its field.

    ``vocab_size``: the tokenizer's (what the recipe's shapes are counted with).
    """
    from operators.sweep.grid import grid_for

    budgets = list(params["budgets"])
    problems = budget_problems(budgets, params["forecast_budgets"])
    if not problems:
        try:
            cells = grid_for(params, vocab_size)
        except ValueError as exc:  # RecipeError: a budget too small for the smallest shape
            problems.append(f"budgets: {exc}")
        else:
            if len(cells) > MAX_CELLS:
                problems.append(f"budgets/points/seeds: {len(cells)} cells, at most {MAX_CELLS}")
            missing = [i for i in params.get("fail_cells") or [] if i >= len(cells)]
            if missing:
                problems.append(f"fail_cells: {missing} not in the grid's {len(cells)} cells")
            for budget in budgets:
                sizes = {c["plan"]["non_embedding_params"] for c in cells if c["budget"] == budget}
                if len(sizes) < 3:
                    problems.append(
                        f"budgets: {budget:.3g} gives {len(sizes)} distinct model size(s) at "
                        "this spread; a parabola needs 3 (raise points or spread)"
                    )
    if params.get("fail_cells") and params.get("backend") == "gke":
        # the training operator injects the fault into local processes only: a gke night
        # would train the cells normally and show no failure
        problems.append("fail_cells: fault injection is for backend=local only")
    known = known_metric_stores(params)
    unknown = [s for s in params.get("metric_stores") or [] if s not in known]
    if unknown:
        problems.append(f"metric_stores: {unknown} are not held-out stores of this run ({known})")
    if problems:
        raise RunConfigError("invalid sweep configuration:\n  " + "\n  ".join(problems))


def known_metric_stores(params: Mapping[str, Any]) -> list[str]:
    """The held-out stores a run of this form has: one per source, and the eval prose."""
    from operators.pipeline.graph import EVAL_STORE_PREFIX, EVAL_STORES, sources_of

    return [f"heldout-{s.name}" for s in sources_of(params)] + [
        f"{EVAL_STORE_PREFIX}{e}" for e in EVAL_STORES
    ]
