"""XLA:CPU's vector width on CPUs with AVX-512.

XLA:CPU emits 256-bit vector code unless told otherwise, also on CPUs with 512-bit vector
units. On the 2-vCPU Intel Xeon VM (AVX-512, AMX) the 30m step was 10% faster with
``--xla_cpu_prefer_vector_width=512`` (8,023 -> 8,865 tokens/s, six paired rounds): in a
profile, attention's ``exp`` fusion took 0.07 s of a step's thunk time instead of 0.12 s, the
matmuls (YNNPACK) 0.54 s instead of 0.51 (docs/benchmarks.md). On an AMD EPYC VM it was within
noise.

``prefer_host_vector_width`` adds the flag to ``XLA_FLAGS`` when JAX runs on the CPU only
(``hostmem.cpu_only``: accelerator hosts are left alone) and the CPU has AVX-512 (Linux's
``/proc/cpuinfo`` lists ``avx512f``), unless the user set a width or passes a ``--flagfile``.
XLA reads ``XLA_FLAGS`` once, when the first backend starts, so it must run before that, as
``hostmem.keep_step_memory_warm`` does. To keep 256-bit code (older Xeons lower their clock
for 512-bit instructions), set ``XLA_FLAGS=--xla_cpu_prefer_vector_width=256``.

Vectorized reductions add in a different order at 512 bits, so a run on such a CPU differs from
a 256-bit run in the last bits of its losses; runs on one machine stay byte-identical.
"""

from __future__ import annotations

import os

from trainer import hostmem

FLAG = "--xla_cpu_prefer_vector_width"
WIDE = 512
CPUINFO = "/proc/cpuinfo"


def has_avx512(cpuinfo: str = CPUINFO) -> bool:
    """Whether the CPU lists ``avx512f`` (AVX-512 Foundation) among its flags (Linux only)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return "avx512f" in line.split(":", 1)[-1].split()
    except OSError:  # not Linux, or no procfs: keep XLA's default
        return False
    return False


def prefer_host_vector_width(cpuinfo: str = CPUINFO) -> bool:
    """Add ``--xla_cpu_prefer_vector_width=512`` to ``XLA_FLAGS`` for a CPU-only run on an
    AVX-512 CPU, unless the user set a width there or keeps flags in a file. Returns whether
    512-bit vectors are asked for. Call before anything starts a JAX backend."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if any(f.startswith((f"{FLAG}=", "--flagfile=")) for f in flags):
        return f"{FLAG}={WIDE}" in flags
    if not hostmem.cpu_only() or not has_avx512(cpuinfo):
        return False
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{FLAG}={WIDE}"])
    return True
