"""`pytest --pyargs conformance --conformance-module NAME`, as a user's CI runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.contract.operations import OPERATIONS

pytestmark = pytest.mark.slow  # each test starts pytest in a subprocess

# mask polarity inverted in SDPA only: MHA and the block still use attention_np's own attention
INVERTED_MASK = '''
import attention_np as _np
from attention_np import *  # noqa: F403

def scaled_dot_product_attention(q, k, v, mask=None, **options):
    return _np.scaled_dot_product_attention(q, k, v, None if mask is None else mask == 0, **options)
'''


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "conformance",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_plugin_passes_a_correct_module(tmp_path: Path) -> None:
    result = _pytest(tmp_path, "--conformance-module", "attention_np", "--conformance-max-examples", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(OPERATIONS)} passed" in result.stdout  # one test per operation


def test_plugin_fails_the_operation_a_bug_breaks(tmp_path: Path) -> None:
    (tmp_path / "inverted_mask_attention.py").write_text(INVERTED_MASK)
    result = _pytest(tmp_path, "--conformance-module", "inverted_mask_attention", "--conformance-max-examples", "1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"1 failed, {len(OPERATIONS) - 1} passed" in result.stdout
    assert "test_operation_conforms[inverted_mask_attention-sdpa]" in result.stdout
    assert "reproduce:" in result.stdout  # the failure carries a snippet


def test_plugin_without_a_module_skips(tmp_path: Path) -> None:
    result = _pytest(tmp_path)
    assert result.returncode == 0 and f"{len(OPERATIONS)} skipped" in result.stdout, result.stdout + result.stderr


def test_plugin_skips_the_operations_a_partial_module_lacks(tmp_path: Path) -> None:
    (tmp_path / "sdpa_only_attention.py").write_text(
        "from attention_np import asarray, scaled_dot_product_attention, to_numpy  # noqa: F401\n")
    result = _pytest(tmp_path, "--conformance-module", "sdpa_only_attention", "--conformance-max-examples", "1", "-rs")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"1 passed, {len(OPERATIONS) - 1} skipped" in result.stdout
    assert "sdpa_only_attention has no MultiHeadAttention" in result.stdout
