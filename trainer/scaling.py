"""Scaling laws and shapes: the pure functions the recipes (:mod:`trainer.recipes`) are made of.

- Model shape from a parameter target: head_dim 64 (128 from hidden 2048), hidden a multiple of
  128, depth from a fixed aspect ratio (hidden ~ 64-96 x layers, as in Marin/Levanter sweeps),
  SwiGLU width round_up(8/3 x hidden, 128), GQA with 4 query heads per kv head from 16 heads.
- Compute-optimal size (Chinchilla, Hoffmann et al. 2022): N ~ sqrt(C / 120), i.e. D ~ 20 N with
  C ~ 6 N D; tokens are then D = C / flops_per_token (our exact FLOPs, attention included).
- Batch size and learning rate from DeepSeek LLM's fitted laws (2024, their eq. 1):
  B_tokens = 0.292 C^0.3271 and lr = 0.3118 C^-0.125 (C in FLOPs), clamped to sane ranges.
"""

from __future__ import annotations

import math

from trainer.config import ModelConfig
from trainer.shapes import param_count

TOKENS_PER_PARAM = 20.0


def _round_up(x: float, m: int) -> int:
    return int(math.ceil(x / m) * m)


def shape_for_params(target_params: float, vocab_size: int, seq_len: int = 4096) -> ModelConfig:
    """The preset-like shape whose non-embedding parameter count is closest to the target."""
    best = None
    for hidden in range(128, 16384 + 1, 128):
        head_dim = 64 if hidden < 2048 else 128
        heads = hidden // head_dim
        kv = heads // 4 if heads >= 16 and heads % 4 == 0 else heads
        inter = _round_up(8 * hidden / 3, 128)
        per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inter + 2 * hidden
        layers = max(2, round(target_params / per_layer))
        aspect = hidden / layers
        if not 32 <= aspect <= 256 and hidden > 128:
            continue
        cfg = ModelConfig(
            vocab_size=vocab_size,
            hidden_dim=hidden,
            intermediate_dim=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
        )
        n = non_embedding_params(cfg)
        # prefer the target count, then an aspect ratio near 64-96
        score = abs(math.log(n / target_params)) + 0.05 * abs(math.log(aspect / 80))
        if best is None or score < best[0]:
            best = (score, cfg)
    assert best is not None
    return best[1]


def non_embedding_params(cfg: ModelConfig) -> int:
    head = 0 if cfg.tie_embeddings else cfg.hidden_dim * cfg.vocab_size
    return param_count(cfg) - cfg.vocab_size * cfg.hidden_dim - head


def optimal_params(compute: float) -> float:
    return math.sqrt(compute / (6.0 * TOKENS_PER_PARAM))


def batch_tokens(compute: float) -> float:
    return 0.292 * compute**0.3271


def learning_rate(compute: float) -> float:
    return min(1e-2, max(1e-4, 0.3118 * compute**-0.125))
