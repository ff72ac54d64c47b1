"""`pytest --pyargs conformance --conformance-module NAME`, as a user's CI runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

import pytest

from conformance.contract.operations import OPERATIONS

pytestmark = pytest.mark.slow  # each test starts pytest in a subprocess, or reads the one run they share

# mask polarity inverted in SDPA only: MHA and the block still use attention_np's own attention
INVERTED_MASK = '''
import attention_np as _np
from attention_np import *  # noqa: F403

def scaled_dot_product_attention(q, k, v, mask=None, **options):
    return _np.scaled_dot_product_attention(q, k, v, None if mask is None else mask == 0, **options)
'''
SDPA_ONLY = "from attention_np import asarray, scaled_dot_product_attention, to_numpy  # noqa: F401\n"
MODULES = ("attention_np", "inverted_mask_attention", "sdpa_only_attention")  # --conformance-module is repeatable


class Outcome(NamedTuple):
    """One test of the run: passed, failed, skipped (or error), and the failure's or the skip's text."""

    result: str
    text: str


class Run(NamedTuple):
    """The shared run: its exit status, its output, and each test's outcome by id (test_operation_conforms[...])."""

    returncode: int
    output: str
    outcomes: dict[str, Outcome]


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "conformance",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)


def _outcome(case: ET.Element) -> Outcome:
    for result in ("failure", "error", "skipped"):
        if (found := case.find(result)) is not None:
            return Outcome({"failure": "failed", "error": "error", "skipped": "skipped"}[result],
                           f"{found.get('message', '')}\n{found.text or ''}")
    return Outcome("passed", "")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One pytest process checks the three modules, each test's outcome read from its JUnit XML: starting pytest
    and importing the suite three times was most of the three tests' time."""
    tmp_path = tmp_path_factory.mktemp("plugin")
    (tmp_path / "inverted_mask_attention.py").write_text(INVERTED_MASK)
    (tmp_path / "sdpa_only_attention.py").write_text(SDPA_ONLY)
    modules = [arg for name in MODULES for arg in ("--conformance-module", name)]
    result = _pytest(tmp_path, *modules, "--conformance-max-examples", "1", "--junitxml", str(tmp_path / "run.xml"))
    cases = ET.parse(tmp_path / "run.xml").getroot().iter("testcase") if (tmp_path / "run.xml").exists() else ()
    return Run(returncode=result.returncode, output=result.stdout + result.stderr,
               outcomes={case.get("name"): _outcome(case) for case in cases})


def _results(run: Run, module: str) -> dict[str, str]:
    """{operation: passed, failed, skipped or error} of the module's tests in the shared run."""
    prefix = f"test_operation_conforms[{module}-"
    return {name[len(prefix):-1]: outcome.result for name, outcome in run.outcomes.items() if name.startswith(prefix)}


def test_plugin_passes_a_correct_module(run: Run) -> None:
    assert run.returncode in (0, 1), run.output  # 1: the inverted module's failure; not an error of pytest's
    assert _results(run, "attention_np") == dict.fromkeys(OPERATIONS, "passed"), run.output  # one per operation


def test_plugin_fails_the_operation_a_bug_breaks(run: Run) -> None:
    assert run.returncode == 1, run.output
    assert _results(run, "inverted_mask_attention") == {**dict.fromkeys(OPERATIONS, "passed"), "sdpa": "failed"}
    assert "reproduce:" in run.outcomes["test_operation_conforms[inverted_mask_attention-sdpa]"].text  # a snippet


def test_plugin_without_a_module_skips(tmp_path: Path) -> None:
    result = _pytest(tmp_path)
    assert result.returncode == 0 and f"{len(OPERATIONS)} skipped" in result.stdout, result.stdout + result.stderr


def test_plugin_skips_the_operations_a_partial_module_lacks(run: Run) -> None:
    assert run.returncode in (0, 1), run.output
    assert _results(run, "sdpa_only_attention") == {**dict.fromkeys(OPERATIONS, "skipped"), "sdpa": "passed"}
    skip = run.outcomes["test_operation_conforms[sdpa_only_attention-mha]"].text
    assert "sdpa_only_attention has no MultiHeadAttention" in skip, skip
