"""ring_attention and the head-parallel modules on simulated 8-device CPU meshes: JAX fixes its device count
when it starts, so the checks (tests/distributed/jax_ring_checks.py) run in a fresh process with
XLA_FLAGS=--xla_force_host_platform_device_count=8 added to this process's flags (conftest's quick compiles)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

CHECKS = Path(__file__).parent / "distributed" / "jax_ring_checks.py"
DEVICES = "--xla_force_host_platform_device_count=8"


@pytest.mark.slow  # starts a process with its own JAX
def test_ring_attention_and_head_parallel_modules_on_8_devices():
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {DEVICES}".strip()}
    result = subprocess.run([sys.executable, str(CHECKS)], env=env, capture_output=True, text=True, timeout=300,
                            cwd=CHECKS.parent.parent.parent)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "time:" in result.stdout, result.stdout
