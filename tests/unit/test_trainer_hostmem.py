"""trainer.hostmem: a CPU step's large temporaries come back as warm memory, not fresh pages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer import hostmem

# A training-shaped loop: a jitted step that donates its state (64 MiB) and makes ~200 MB of
# temporaries on XLA's worker threads; prints the MiB of fresh pages faulted in by each step.
_PROBE = r"""
import functools, json, resource, sys
from trainer import hostmem
warm = hostmem.keep_step_memory_warm() if sys.argv[1] == "tuned" else False
import jax, jax.numpy as jnp

@functools.partial(jax.jit, donate_argnums=0)
def step(x):
    return x + 1e-9 * jnp.cumsum(jnp.sin(x)) * jnp.cumsum(jnp.cos(x)[::-1])

x = jnp.ones((1 << 24,), jnp.float32)
faulted = []
for _ in range(int(sys.argv[2])):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = step(x)
    x.block_until_ready()
    faulted.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 2**20)
print(json.dumps({"warm": warm, "mib_faulted": faulted}))
"""


def _probe(mode: str, steps: int) -> dict:
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": "."}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode, str(steps)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_step_temporaries_stop_faulting_in_fresh_pages():
    plain, tuned = _probe("plain", 20), _probe("tuned", 80)
    # without the settings every step maps its temporaries afresh (the control: what the
    # settings are for, and proof that the probe measures it)
    assert min(plain["mib_faulted"][-10:]) > 64, plain
    # with them the heap settles (within 8-16 steps here; under load it has taken 25+, as
    # threads' allocations interleave differently while it grows: 80 steps leave room), then
    # steps reuse warm memory
    assert tuned["warm"] is True
    settled = [mib < 8 for mib in tuned["mib_faulted"][-10:]]
    assert sum(settled) >= 7 and settled[-1], tuned


def test_only_cpu_runs_are_changed(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert hostmem.cpu_only() is False
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert hostmem.cpu_only() is True
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(hostmem.importlib.util, "find_spec", lambda name: object())
    assert hostmem.cpu_only() is False  # libtpu or a CUDA plugin is installed
    monkeypatch.setattr(hostmem.importlib.util, "find_spec", lambda name: None)
    assert hostmem.cpu_only() is True


# Freeing a block larger than 2 GiB (an int's largest trim threshold) into the heap's top: the
# program break must stay where it is. Nothing is touched, so this costs no memory.
_TRIM_PROBE = r"""
import ctypes, json
from trainer import hostmem
warm = hostmem.keep_step_memory_warm()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes, libc.sbrk.argtypes = [ctypes.c_size_t], [ctypes.c_void_p], [ctypes.c_ssize_t]
p = libc.malloc(2300 << 20)
grown = libc.sbrk(0)
libc.free(p)
print(json.dumps({"warm": warm, "allocated": bool(p), "released_mib": (grown - libc.sbrk(0)) >> 20}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_heap_top_above_2_gib_is_kept():
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": "."}
    out = subprocess.run(
        [sys.executable, "-c", _TRIM_PROBE], capture_output=True, text=True, env=env, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # issue 18's hidden-512 step frees 2.3 GiB of temporaries at once; with the largest int
    # threshold (2 GiB) glibc gave all of it back, and every step faulted it in again
    assert got == {"warm": True, "allocated": True, "released_mib": 0}, got
