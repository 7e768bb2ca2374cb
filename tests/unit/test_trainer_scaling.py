"""Scaling recipes' invariants: budgets spent, monotone in C, valid shapes, IsoFLOP grids."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from trainer.config import ConfigError, validate, validate_model
from trainer.recipes import (
    FLOP_TOLERANCE,
    RECIPES,
    ChinchillaDeepSeek,
    Marin2025,
    RecipeError,
    get_recipe,
)
from trainer.scaling import (
    batch_tokens,
    learning_rate,
    non_embedding_params,
    optimal_params,
    shape_for_params,
)

# Budgets from a laptop-sized sweep to Delphi's largest fitted run, per recipe.
BUDGETS = {
    "chinchilla-deepseek": [1e17, 1e18, 1e19, 1e20, 1e21],
    "marin-2025": [3e14, 3e15, 3e16, 3e18, 3e20],
}
VOCAB = 32000


@pytest.mark.parametrize("target", [5e6, 3e7, 1.5e8, 1e9, 7e9])
def test_shapes_hit_the_target_and_are_valid(target):
    cfg = shape_for_params(target, vocab_size=VOCAB)
    validate_model(cfg)
    assert cfg.hidden_dim % 128 == 0 and cfg.intermediate_dim % 128 == 0
    assert cfg.num_heads * cfg.head_dim == cfg.hidden_dim
    assert abs(math.log(non_embedding_params(cfg) / target)) < math.log(1.35)


def _runs(name: str):
    recipe = get_recipe(name)
    for c in BUDGETS[name]:
        yield c, recipe.compute_config(c, vocab_size=VOCAB, seq_len=1024)
        yield from ((c, p) for p in recipe.isoflop_grid(c, 5, vocab_size=VOCAB, seq_len=1024))


@pytest.mark.parametrize("name", RECIPES)
def test_every_run_spends_its_budget_and_is_a_valid_trainer_config(name):
    for c, p in _runs(name):
        assert p.flops == pytest.approx(c, rel=FLOP_TOLERANCE), p.label
        assert p.tokens == p.steps * p.batch_size * p.seq_len
        assert p.batch_size & (p.batch_size - 1) == 0  # a power of two
        assert 0 <= p.warmup_steps < p.steps and 0 < p.learning_rate <= 0.01
        assert 0.5 < p.beta2 < 1
        config = p.train_config()
        validate(dataclasses.replace(config, output_dir="/tmp/run"), require_data=False)
        assert config.model.num_layers == p.model.num_layers and config.steps == p.steps
        assert config.optimizer.beta2 == p.beta2 and config.optimizer.decay == p.decay


@pytest.mark.parametrize("name", RECIPES)
def test_compute_optimal_runs_grow_with_the_budget(name):
    recipe = get_recipe(name)
    runs = [recipe.compute_config(c, vocab_size=VOCAB) for c in BUDGETS[name]]
    for a, b in itertools.pairwise(runs):
        assert b.non_embedding_params > a.non_embedding_params
        assert b.tokens > a.tokens
        assert b.batch_size >= a.batch_size


@pytest.mark.parametrize("name", RECIPES)
def test_isoflop_grid_brackets_the_optimum_at_fixed_compute(name):
    recipe = get_recipe(name)
    for c in BUDGETS[name][1:3]:
        grid = recipe.isoflop_grid(c, 5, vocab_size=VOCAB)
        assert len(grid) >= 4
        sizes = [p.non_embedding_params for p in grid]
        tokens = [p.tokens for p in grid]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)  # N increases ...
        assert tokens == sorted(tokens, reverse=True)  # ... and D decreases at fixed C
        assert sizes[0] < recipe.optimal_params(c) < sizes[-1]
        assert len({p.label for p in grid}) == len(grid)  # map indexes tell cells apart


def test_the_laws_the_chinchilla_recipe_is_made_of():
    assert optimal_params(1e21) > optimal_params(1e18)
    assert optimal_params(6 * 20 * 1e8**2) == pytest.approx(1e8)  # D = 20 N at C = 6 N D
    assert batch_tokens(1e21) > batch_tokens(1e18) and learning_rate(1e21) < learning_rate(1e18)
    p = ChinchillaDeepSeek().compute_config(1e20, vocab_size=VOCAB)
    assert p.decay == "cosine" and p.beta2 == 0.95 and p.learning_rate == learning_rate(1e20)
    assert p.warmup_steps == min(p.steps // 10, 2000)


def test_marins_heuristics():
    marin = Marin2025()
    assert [marin.num_layers(h) for h in (512, 1024, 2048, 4096)] == [6, 11, 21, 40]
    p = marin.compute_config(3e18, vocab_size=VOCAB, seq_len=4096)
    assert p.decay == "linear" and p.min_lr_ratio == 0.0
    assert p.warmup_steps == int(0.1 * p.steps)
    assert p.model.intermediate_dim == 4 * p.model.hidden_dim and p.model.head_dim == 128
    assert p.learning_rate == pytest.approx(0.33 * math.sqrt(p.batch_size) / p.model.hidden_dim)
    assert p.beta2 == pytest.approx(0.98 ** (p.batch_size / 128))
    # 3e15 FLOPs in 2000 steps of 128 tokens is a batch of ~117 -> 128, whose learning rate
    # (0.33 sqrt(128) / 320 = 0.0117) is over the cap: halved to 64.
    small = marin.compute_config(3e15, vocab_size=VOCAB, seq_len=128)
    assert small.model.hidden_dim == 320 and small.batch_size == 64
    assert small.learning_rate <= 0.01 < marin.learning_rate(128, 320)


def test_estimate_before_launch():
    p = get_recipe("marin-2025").compute_config(3e16, vocab_size=VOCAB)
    est = p.estimate(peak_flops=8 * 459e12, mfu=0.5)
    assert est["flops"] == p.flops
    assert est["seconds"] == pytest.approx(p.flops / (8 * 459e12 * 0.5))
    with pytest.raises(RecipeError, match="mfu"):
        p.estimate(peak_flops=1e12, mfu=0)


@pytest.mark.parametrize(
    ("budget", "message"),
    [(0, "positive"), (-1e18, "positive"), (float("nan"), "positive"), ("1e18", "positive")],
)
def test_bad_budgets_are_refused(budget, message):
    for recipe in RECIPES.values():
        with pytest.raises(RecipeError, match=message):
            recipe.compute_config(budget, vocab_size=VOCAB)


def test_a_budget_too_small_for_a_run_names_the_cell():
    with pytest.raises(RecipeError, match=r"gives 1 steps of .* \(at least 20\)"):
        get_recipe("chinchilla-deepseek").compute_config(1e9, vocab_size=VOCAB)


def test_unknown_recipe():
    with pytest.raises(RecipeError, match=r"unknown recipe 'gpt'.*chinchilla-deepseek"):
        get_recipe("gpt")


def test_the_trainer_refuses_what_no_recipe_makes():
    good = get_recipe("marin-2025").compute_config(3e16, vocab_size=VOCAB).train_config()
    good = dataclasses.replace(good, output_dir="/tmp/run")
    validate(good, require_data=False)
    with pytest.raises(ConfigError, match="steps"):
        validate(dataclasses.replace(good, steps=0), require_data=False)
