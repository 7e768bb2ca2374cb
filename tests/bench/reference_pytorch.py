"""PyTorch reference for the trainer's MFU target: our JAX step and PyTorch steps of the same
model, timed in one process, alternating, each against both frameworks' matmul peaks sampled
right before it.

The trainer issue sets its MFU target (55% of the ``jnp.dot`` peak) on the claim that a
well-tuned PyTorch model of similar size reaches about two thirds of "it" on this machine. This
checks the claim on the machine at hand: the same Llama-style decoder (RMSNorm, rotary, SwiGLU,
causal attention, cross-entropy, AdamW; head tied to the embedding where the shape ties it) at
``bench_trainer.SHAPES``: the 30m / 75m / 150m presets and issue 18's hidden-512 and -768
shapes, each at its own batch and context, in PyTorch eager and ``torch.compile`` (inductor,
fused AdamW), with the FLOPs counted by ``trainer.model.flops_per_token``. Each round samples
the ``jnp.dot`` peak, samples the ``torch.mm`` peak (each for as long as the last step took, at
most ``PEAK_SAMPLE_MAX_S``), then runs our step and each PyTorch step. Reported: tokens/s, MFU
against both peaks, and our tokens/s over each PyTorch step's, paired by round (issue 18's
target: at least 1.3x compiled PyTorch at every shape). Rounds: ``--rounds``, fewer (at least
``MIN_ROUNDS``) for a shape whose rounds would take more than ``--budget-s``.

The PyTorch model is the generous side of the comparison: plain causal attention
(``scaled_dot_product_attention(is_causal=True)``, no document masking) and the logits
materialized once (no chunking). Compiled PyTorch runs twice: with ATen's float32 multiply
(MKL's sgemm in the PyPI wheel) and with every linear layer on oneDNN (``OneDNNLinear``). On an
AMD CPU MKL's sgemm runs at about half of oneDNN's and of ``jnp.dot``'s, so ATen alone would
make a slow baseline; on an Intel CPU MKL may be the faster one. The target is against the
faster of the two, per round.

Needs PyTorch beside the project's environment: ``.venv-pytorch`` (the project's ``.venv`` plus
``torch``; PyTorch is no dependency of Slipway), which ``make bench`` and ``make bench-pytorch``
create and run this with. Results: ``docs/benchmarks.md`` (trainer).
"""

# ruff: noqa: E402  (the allocator settings below must precede torch's and jax's imports)
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

# PyTorch's OpenMP workers otherwise spin after each PyTorch op and take a core from the JAX
# step that follows (and vice versa for XLA's pool); must be set before torch is imported
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from trainer import hostmem

# Before torch's import starts threads: a thread that allocated before it has its own malloc
# arena, XLA's workers then share those arenas, and a non-main arena maps the step's 2.4 GB of
# temporaries afresh every few steps (600,000 page faults, up to 2x a hidden-512 step)
hostmem.keep_step_memory_warm()

import jax
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_trainer import SHAPES, VOCAB, MatmulPeak, Peak, preset_config

from tests.support.trainer_data import write_random_store
from trainer import vector_width
from trainer.shapes import flops_per_token, param_count
from trainer.train import BatchFeeder, setup

# A compiled step that dynamo gives up on runs eager: an error (reported, the row left out), not
# an eager step timed under a "compiled" name
torch._dynamo.config.fail_on_recompile_limit_hit = True

# (name, torch.compile, linears on oneDNN); the target is against the faster compiled one
VARIANTS = (
    ("pytorch eager", False, False),
    ("pytorch compiled", True, False),
    ("pytorch compiled, oneDNN linears", True, True),
)
PEAK_SAMPLE_MAX_S = 2.0  # a peak sample lasts as long as the last step, up to this
MIN_ROUNDS = 7


class TorchPeak(MatmulPeak):
    """The ``torch.mm`` peak: a 1024 x 1024 float32 product (synchronous)."""

    def __init__(self, n: int = 1024, batch: int = 5) -> None:
        super().__init__(n, batch)
        g = torch.Generator().manual_seed(0)
        self.a, self.b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)

    def _products(self) -> None:
        for _ in range(self.batch):
            torch.mm(self.a, self.b)


# An opaque op, so inductor calls it as it is (its own lowering of ``_linear_pointwise``
# expects a weight packed ahead of time, which training's changing weights are not)
@torch.library.custom_op("slipway_bench::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` by oneDNN's float32 inner product; x (..., in), w (out, in)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


@_onednn_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


class _OneDNNLinearFn(torch.autograd.Function):
    """A bias-free linear whose forward and both backward products run on oneDNN.

    ATen sends float32 ``mm`` to the wheel's BLAS (MKL) whatever the CPU. oneDNN reads a
    strided weight operand, so the input gradient copies nothing; ``_linear_pointwise`` makes
    its first operand contiguous, so the weight gradient copies one activation (transposed):
    the narrower of the input and the output gradient.
    """

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, w)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        grad_x = _onednn_linear(grad, w.t())  # (..., out) @ (out, in)
        g2, x2 = grad.flatten(0, -2), x.flatten(0, -2)
        if x2.shape[1] < g2.shape[1]:  # (in, out), transposed: x is the one copied
            grad_w = _onednn_linear(x2.t(), g2.t()).t().contiguous()
        else:
            grad_w = _onednn_linear(g2.t(), x2.t())  # (out, in): the gradient is copied
        return grad_x, grad_w


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` (no bias) on oneDNN; swapped in by ``use_onednn_linears``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OneDNNLinearFn.apply(x, self.weight)


def check_onednn_linear() -> None:
    """Refuse to time ``OneDNNLinear`` unless its output and both gradients match ATen's."""
    g = torch.Generator().manual_seed(0)
    for d_in, d_out in ((64, 96), (96, 64)):  # both weight-gradient branches
        x = torch.randn(2, 48, d_in, generator=g, requires_grad=True)
        w = torch.randn(d_out, d_in, generator=g, requires_grad=True)
        grad = torch.randn(2, 48, d_out, generator=g)
        got = [
            _OneDNNLinearFn.apply(x, w),
            *torch.autograd.grad(_OneDNNLinearFn.apply(x, w), (x, w), grad),
        ]
        want = [F.linear(x, w), *torch.autograd.grad(F.linear(x, w), (x, w), grad)]
        for what, a, b in zip(("output", "input grad", "weight grad"), got, want, strict=True):
            msg = f"OneDNNLinear {what} ({d_in} -> {d_out})"
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=msg)


def use_onednn_linears(model: nn.Module) -> None:
    """Run every linear layer of ``model`` on oneDNN, parameters (and ties) unchanged."""
    for module in model.modules():
        if type(module) is nn.Linear:
            assert module.bias is None, "OneDNNLinear has no bias"
            module.__class__ = OneDNNLinear


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama layout: pairs (i, i + hd/2). x (B, H, S, hd); cos, sin (S, hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, d: int, f: int, heads: int, kv_heads: int, hd: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hd
        self.attn_norm, self.mlp_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * hd, bias=False)
        self.out = nn.Linear(heads * hd, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, self.heads + 2 * self.kv_heads, self.hd)
        q, k, v = qkv.transpose(1, 2).split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads
        )
        x = x + self.out(a.transpose(1, 2).reshape(b, s, -1))
        g, u = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Llama(nn.Module):
    def __init__(self, mcfg, seq: int) -> None:
        super().__init__()
        d, hd = mcfg.hidden_dim, mcfg.head_dim
        self.embed = nn.Embedding(mcfg.vocab_size, d)
        self.blocks = nn.ModuleList(
            Block(d, mcfg.intermediate_dim, mcfg.num_heads, mcfg.num_kv_heads, hd, mcfg.norm_eps)
            for _ in range(mcfg.num_layers)
        )
        self.norm = RMSNorm(d, mcfg.norm_eps)
        self.head = nn.Linear(d, mcfg.vocab_size, bias=False)
        if mcfg.tie_embeddings:  # one (V, D) parameter for both, as ours (head = embed^T)
            self.head.weight = self.embed.weight
        # Initialised as ours (trainer/model.py): N(0, init_std), the residual outputs scaled
        # by 1/sqrt(2 layers). PyTorch's own defaults (N(0, 1) embeddings, which a tied head
        # reuses) start at a loss near 500 and fill the gradients with denormals, which cost
        # PyTorch 4x on some CPUs: a comparison of speed, not of initialisations.
        out_std = mcfg.init_std / math.sqrt(2 * mcfg.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = out_std if name.endswith(("out.weight", "down.weight")) else mcfg.init_std
            nn.init.normal_(param, 0.0, std)
        inv = 1.0 / mcfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.arange(seq).float()[:, None] * inv[None]
        self.register_buffer("cos", ang.cos())
        self.register_buffer("sin", ang.sin())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def torch_step(mcfg, seq: int, compiled: bool, onednn: bool = False):
    # XLA:CPU flushes denormals to zero; PyTorch computes with them (slowly, on many CPUs)
    # unless told: the same arithmetic on both sides.
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    model = Llama(mcfg, seq)
    if onednn:
        use_onednn_linears(model)
    n = sum(p.numel() for p in model.parameters())
    # same shapes as ours, or the shared FLOPs count would flatter one side
    assert n == param_count(mcfg), f"PyTorch model has {n:,} parameters, ours {param_count(mcfg):,}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=True)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return torch.compile(step) if compiled else step


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_preset(preset: str, store: str, out: str, rounds: int, budget_s: float) -> dict:
    run = setup(preset_config(preset, store, out))
    seq, batch_size = run.cfg.seq_len, run.cfg.batch_size
    feeder = BatchFeeder(run.loader, run.mesh, seq, batch_size)
    batch = feeder.get(0)
    host = torch.from_numpy(np.asarray(batch.tokens).astype(np.int64))
    tokens, targets = host[:, :-1].contiguous(), host[:, 1:].contiguous()
    jax_step = run.step_fn.lower(run.state, batch).compile()
    box = [run.state]

    def ours() -> None:
        box[0], m = jax_step(box[0], batch)
        jax.block_until_ready(m)

    steps = {"jax (ours)": ours}
    # Every shape compiles the same `step` code again (two variants each): without a reset,
    # the fifth shape passed dynamo's recompile limit (8) and its "compiled" rows ran eager.
    torch._dynamo.reset()
    for name, compiled, onednn in VARIANTS:
        fn = torch_step(run.mcfg, seq, compiled, onednn)
        steps[name] = lambda fn=fn: fn(tokens, targets)
    warm: dict[str, float] = {}
    for name, fn in list(steps.items()):  # compile and warm up
        try:
            for _ in range(3):
                warm[name] = _timed(fn)
        except Exception as e:  # inductor needs a C++ compiler: report, keep the rest
            if not name.startswith("pytorch compiled"):
                raise
            print(f"{name}: skipped, torch.compile failed: {type(e).__name__}: {e}"[:500])
            del steps[name]

    jpeak, tpeak = Peak(), TorchPeak()
    flops = batch_size * seq * flops_per_token(run.mcfg, seq)
    per_round = sum(warm[n] for n in steps) + 2 * min(max(warm.values()), PEAK_SAMPLE_MAX_S)
    rounds = min(rounds, max(MIN_ROUNDS, int(budget_s / per_round)))
    times: dict[str, list[float]] = {n: [] for n in steps}
    vs_jax: dict[str, list[float]] = {n: [] for n in steps}
    vs_torch: dict[str, list[float]] = {n: [] for n in steps}
    dt = 0.3
    for _ in range(rounds):
        jp = jpeak.sample(min(dt, PEAK_SAMPLE_MAX_S))
        tp = tpeak.sample(min(dt, PEAK_SAMPLE_MAX_S))
        for name, fn in steps.items():
            dt = _timed(fn)
            times[name].append(dt)
            vs_jax[name].append(flops / dt / jp)
            vs_torch[name].append(flops / dt / tp)
    feeder.close()
    ours_t = statistics.median(times["jax (ours)"])
    tokens = batch_size * seq
    compiled = [ts for name, ts in times.items() if name.startswith("pytorch compiled")]
    return {
        "preset": preset,
        "seq_len": seq,
        "batch": batch_size,
        "params": param_count(run.mcfg),
        "rounds": rounds,
        "flops_per_token": flops / tokens,
        "jnp_dot_peak_gflops": float(np.median(jpeak.samples)) / 1e9,
        "torch_mm_peak_gflops": float(np.median(tpeak.samples)) / 1e9,
        "steps": {
            name: {
                "tokens_per_s": tokens / statistics.median(ts),
                "mfu_vs_jnp_dot": statistics.median(vs_jax[name]),
                "mfu_vs_torch_mm": statistics.median(vs_torch[name]),
                "speed_vs_ours": ours_t / statistics.median(ts),
                # ours over this step in tokens/s (issue 18: >= 1.3 against compiled): the
                # median over rounds of this step's time over ours in the same round, which
                # other tenants' bursts blur less than a ratio of two medians
                "ours_speedup": statistics.median(
                    t / o for t, o in zip(ts, times["jax (ours)"], strict=True)
                ),
                "ours_speedup_of_medians": statistics.median(ts) / ours_t,
                "step_s": ts,
            }
            for name, ts in times.items()
        },
        # issue 18's ratio: ours over the faster compiled PyTorch of each round (None when
        # torch.compile failed)
        "ours_vs_best_compiled": statistics.median(
            min(ts) / o for *ts, o in zip(*compiled, times["jax (ours)"], strict=True)
        )
        if compiled
        else None,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| shape (seq x batch, params) | step | tokens/s | MFU vs jnp.dot peak "
        "| MFU vs torch.mm peak | ours / this (tokens/s, paired) | peaks jnp.dot / torch.mm GFLOP/s "
        "| rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = f"{r['preset']} ({r['seq_len']} x {r['batch']}, {r['params'] / 1e6:.1f}M)"
        for name, s in r["steps"].items():
            lines.append(
                f"| {shape} | {name} | {s['tokens_per_s']:,.0f} | "
                f"{100 * s['mfu_vs_jnp_dot']:.1f}% | {100 * s['mfu_vs_torch_mm']:.1f}% | "
                f"{s['ours_speedup']:.2f}x | {r['jnp_dot_peak_gflops']:.0f} / "
                f"{r['torch_mm_peak_gflops']:.0f} | {r['rounds']} |"
            )
    best = [
        f"{r['preset']} {r['ours_vs_best_compiled']:.2f}x"
        for r in rows
        if r["ours_vs_best_compiled"] is not None
    ]
    if best:
        lines.append("")
        lines.append("ours / the faster compiled PyTorch (paired): " + ", ".join(best))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed steps of each kind")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help=f"timed seconds per shape: fewer rounds past it, at least {MIN_ROUNDS}",
    )
    parser.add_argument(
        "--presets", default=",".join(SHAPES), help="comma-separated shapes of bench_trainer"
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    check_onednn_linear()
    wide = vector_width.prefer_host_vector_width()
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), jax {jax.__version__}, "
        f"XLA:CPU 512-bit vectors (trainer/vector_width.py): {wide}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        store = f"{tmp}/store"
        write_random_store(store, vocab_size=VOCAB, num_docs=3000)
        rows = []
        for p in args.presets.split(","):
            rows.append(bench_preset(p, store, f"{tmp}/{p}", args.rounds, args.budget_s))
            print(table(rows[-1:]), flush=True)  # each shape as it is done
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
