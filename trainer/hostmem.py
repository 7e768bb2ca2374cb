"""Host-memory allocator settings for training on the CPU backend.

XLA:CPU allocates each step's temporaries (activations kept for the backward pass, ~300 MB for
the 30m preset at 4 x 1,024 tokens) with ``malloc`` on its worker threads. glibc serves
allocations that large with a fresh ``mmap`` and returns them with ``munmap``, so every step
touches ~300 MB of new pages: ~70,000 page faults, each zero-filling 4 KiB, 15-20% of a 30m
step. Served from the main heap and never trimmed, the same memory stays mapped and warm from
step to step.

``keep_step_memory_warm`` therefore sets glibc's ``mallopt`` before JAX starts its CPU client
(threads pick their malloc arena at their first allocation, so it must come first): one arena
(non-main arenas ``mmap`` anything above 64 MiB whatever the settings), no ``mmap`` for large
blocks, no trimming of the heap's top. The price is that freed host memory is kept by the
process rather than returned to the OS: resident memory stays at its high-water mark, which a
training process reaches on its first steps anyway.

"No trimming" is a trim threshold of -1 (``mallopt(3)``: -1 disables trimming; glibc stores
it as SIZE_MAX). The largest threshold an ``int`` can give otherwise, 2 GiB, is not enough:
at issue 18's hidden-512 shape (8 x 512 tokens) the step's temporaries are 2.3 GiB, every step
freed them into a top chunk above 2 GiB, and glibc gave it back: 600,000 page faults (2.3 GB
zero-filled) per step, as with no settings at all.

On accelerators the step's temporaries live in device memory and host threads (input,
checkpoint writes) want their own arenas, so nothing is changed when an accelerator plugin is
installed or ``JAX_PLATFORMS`` names something other than the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import sys

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = -1  # as the threshold: trimming off (size_t -1), whatever the heap's size

_ACCELERATOR_PLUGINS = ("libtpu", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
_applied = False


def cpu_only() -> bool:
    """True when JAX can only run on the CPU here: ``JAX_PLATFORMS`` is ``cpu``, or it is
    unset and no accelerator plugin (libtpu, CUDA) is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms == "cpu"
    for name in _ACCELERATOR_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return False
        except ModuleNotFoundError:  # a missing parent package (jax_plugins)
            continue
    return True


def keep_step_memory_warm() -> bool:
    """Apply the allocator settings above when training will run on the CPU with glibc.
    Returns whether they are in effect. Call before anything initializes a JAX backend;
    later calls change nothing for threads that already allocated."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux") or not cpu_only():
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): leave the allocator alone
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = (
        mallopt(_M_ARENA_MAX, 1) == 1
        and mallopt(_M_MMAP_MAX, 0) == 1
        and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    )
    _applied = ok
    return ok
