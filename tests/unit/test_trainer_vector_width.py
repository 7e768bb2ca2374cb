"""trainer.vector_width: 512-bit XLA:CPU vectors on AVX-512 CPUs, and only there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainer import vector_width

WIDE = "--xla_cpu_prefer_vector_width=512"


def _cpuinfo(tmp_path: Path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    core = f"processor\t: {{n}}\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\n"
    path.write_text(core.format(n=0) + core.format(n=1))
    return str(path)


AVX512 = "fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl amx_tile"
AVX2 = "fpu sse2 avx avx2 fma"


def test_avx512_cpu_asks_for_512_bit_vectors_keeping_other_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert vector_width.prefer_host_vector_width(_cpuinfo(tmp_path, AVX512)) is True
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4", WIDE]
    # a second call (train, then evaluate in one process) adds nothing
    assert vector_width.prefer_host_vector_width(_cpuinfo(tmp_path, AVX512)) is True
    assert os.environ["XLA_FLAGS"].split().count(WIDE) == 1


def test_other_cpus_and_unreadable_cpuinfo_keep_xla_default(tmp_path, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert vector_width.prefer_host_vector_width(_cpuinfo(tmp_path, AVX2)) is False
    # "avx512" alone is not a flag of its own: only the foundation, avx512f, counts
    assert vector_width.prefer_host_vector_width(_cpuinfo(tmp_path, "avx512vnni_like")) is False
    assert vector_width.prefer_host_vector_width(str(tmp_path / "missing")) is False
    assert "XLA_FLAGS" not in os.environ


def test_a_width_the_user_set_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_prefer_vector_width=256")
    assert vector_width.prefer_host_vector_width(_cpuinfo(tmp_path, AVX512)) is False
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_prefer_vector_width=256"
    # flags kept in a file may set it too: left to the user
    monkeypatch.setenv("XLA_FLAGS", "--flagfile=/etc/xla.flags")
    assert vector_width.prefer_host_vector_width(_cpuinfo(tmp_path, AVX512)) is False
    assert os.environ["XLA_FLAGS"] == "--flagfile=/etc/xla.flags"


def test_accelerator_hosts_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")  # TPU and GPU hosts' CPUs often have AVX-512
    assert vector_width.prefer_host_vector_width(_cpuinfo(tmp_path, AVX512)) is False
    assert "XLA_FLAGS" not in os.environ


_MAIN_PROBE = r"""
import os, sys
from trainer import train, vector_width
vector_width.has_avx512 = lambda *args: True  # the check below must hold on any CPU
code = train.main(["--config", sys.argv[1]])  # refused at once: the flag is set before that
print(code, os.environ.get("XLA_FLAGS", ""))
"""


def test_the_trainer_sets_it_before_jax_starts_and_xla_accepts_it(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": "."}
    probe = subprocess.run(
        [sys.executable, "-c", _MAIN_PROBE, str(tmp_path / "no-such-config.yaml")],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    code, *flags = probe.stdout.split()
    assert code != "0"  # the config was refused (the probe stops there)
    assert flags == [WIDE]
    # XLA aborts on a flag it does not know: a JAX without this one would stop every CPU run
    run = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.jit(lambda x: x * 2)(21.0))"],
        capture_output=True,
        text=True,
        env={**env, "XLA_FLAGS": WIDE},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "42.0"
