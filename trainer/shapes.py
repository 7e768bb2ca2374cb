"""Model shapes: the preset table and the exact parameter and FLOP counts of a model config.

JAX-free, so that what needs a model's size without building it imports this and nothing
heavier: the config validator, the run form's preset list (parsed with every DAG), the launch's
device mesh, the scaling recipes. ``trainer/model.py`` builds the model these count (a test
checks every count against the real pytree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import ModelConfig

# Presets: shapes mirroring Marin's experiments/llama.py. The vocabulary comes from the token
# store at run time; the "30m"-style names count Llama-3's 128,256-token vocabulary as Marin does.


@dataclass(frozen=True)
class Shape:
    hidden_dim: int
    intermediate_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    seq_len: int = 1024  # Marin's default context for the preset (informative)


PRESETS: dict[str, Shape] = {
    "nano": Shape(32, 128, 2, 2, 2, seq_len=512),
    "30m": Shape(128, 448, 4, 4, 4),
    "75m": Shape(256, 896, 8, 4, 4),
    "150m": Shape(512, 1792, 6, 8, 8, seq_len=4096),
    "300m": Shape(768, 2688, 12, 12, 12, seq_len=4096),
    "600m": Shape(1024, 3584, 24, 16, 8, seq_len=4096),
    "1.4b": Shape(2048, 7168, 16, 16, 8, seq_len=4096),
    "8b": Shape(4096, 14336, 32, 32, 8, seq_len=4096),
}


# Dense bf16 peak FLOP/s per chip (public TPU specs), by the launch catalogue's accelerator
# name: MFU where the config does not say, and a sweep's time estimate before launch.
CHIP_PEAK_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of ``Transformer(cfg)`` (tested against the real pytree)."""
    d, hd, L = cfg.hidden_dim, cfg.head_dim, cfg.num_layers
    attn = d * hd * (cfg.num_heads * 2 + cfg.num_kv_heads * 2)
    if cfg.moe is None:
        mlp = 3 * d * cfg.intermediate_dim
    else:
        m = cfg.moe
        mlp = d * m.num_experts + 3 * d * m.shared_expert_dim + m.num_experts * 3 * d * m.expert_dim
    layer = attn + mlp + 2 * d
    head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
    return cfg.vocab_size * d + L * layer + d + head


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights touched by matmuls per token (routed experts: only top_k of them; no embedding
    lookup, but the output projection counts even when tied)."""
    d, hd, L = cfg.hidden_dim, cfg.head_dim, cfg.num_layers
    attn = d * hd * (cfg.num_heads * 2 + cfg.num_kv_heads * 2)
    if cfg.moe is None:
        mlp = 3 * d * cfg.intermediate_dim
    else:
        m = cfg.moe
        mlp = d * m.num_experts + 3 * d * m.shared_expert_dim + m.top_k * 3 * d * m.expert_dim
    return L * (attn + mlp) + d * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 3 x forward (backward = 2 x forward).

    Forward = 2 x active matmul params + attention scores and values, 2 x 2 x L x seq x H x hd
    (full, not causal-halved: the PaLM/Marin MFU convention, and what the dense kernel computes).
    """
    attn = 2 * 2 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
    return 3.0 * (2.0 * active_matmul_params(cfg) + attn)
