"""Scaling recipe invariants: budget respected, monotone in C, valid shapes, IsoFLOP grids."""

from __future__ import annotations

import itertools
import math

import pytest

from trainer.config import validate_model
from trainer.scaling import (
    batch_tokens,
    compute_optimal,
    isoflop_grid,
    learning_rate,
    non_embedding_params,
    optimal_params,
    shape_for_params,
)

BUDGETS = [1e17, 1e18, 1e19, 1e20, 1e21]


@pytest.mark.parametrize("target", [5e6, 3e7, 1.5e8, 1e9, 7e9])
def test_shapes_hit_the_target_and_are_valid(target):
    cfg = shape_for_params(target, vocab_size=32000)
    validate_model(cfg)
    assert cfg.hidden_dim % 128 == 0 and cfg.intermediate_dim % 128 == 0
    assert cfg.num_heads * cfg.head_dim == cfg.hidden_dim
    assert abs(math.log(non_embedding_params(cfg) / target)) < math.log(1.35)


@pytest.mark.parametrize("c", BUDGETS)
def test_compute_optimal_point_spends_the_budget(c):
    p = compute_optimal(c, vocab_size=32000)
    assert p.flops == pytest.approx(c, rel=0.1)
    assert p.tokens == p.steps * p.batch_size * p.seq_len
    assert p.batch_size & (p.batch_size - 1) == 0  # power of two
    assert p.steps >= 50 and 0 <= p.warmup_steps < p.steps


def test_monotone_in_compute():
    pts = [compute_optimal(c, vocab_size=32000) for c in BUDGETS]
    for a, b in itertools.pairwise(pts):
        assert non_embedding_params(b.model) > non_embedding_params(a.model)
        assert b.tokens > a.tokens
        assert b.batch_size >= a.batch_size
        assert b.learning_rate <= a.learning_rate
    assert [optimal_params(c) for c in BUDGETS] == sorted(optimal_params(c) for c in BUDGETS)
    assert batch_tokens(1e21) > batch_tokens(1e18) and learning_rate(1e21) < learning_rate(1e18)


@pytest.mark.parametrize("c", [1e18, 1e20])
def test_isoflop_grid(c):
    grid = isoflop_grid(c, vocab_size=32000, points=5)
    assert len(grid) >= 4
    sizes = [non_embedding_params(p.model) for p in grid]
    tokens = [p.tokens for p in grid]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)  # N increases ...
    assert tokens == sorted(tokens, reverse=True)  # ... and D decreases at fixed C
    for p in grid:
        assert p.flops == pytest.approx(c, rel=0.1)
    opt = non_embedding_params(compute_optimal(c, vocab_size=32000).model)
    assert sizes[0] < opt < sizes[-1]  # the grid brackets the optimum
    assert any("model.num_layers=" in o for o in grid[0].overrides())
