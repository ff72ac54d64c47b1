"""The suite's ring operation on each framework's devices (docs/suite.md): NumPy simulates them; JAX and torch run
the ring only with the 4 devices its cases use, else the operation is one SKIP row saying why; `--devices 4`
gives JAX 4 simulated CPU devices and torch 3 peer processes, and every row then runs and passes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from conformance import check
from tests.conftest import import_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["attention_jax", "attention_torch"])
def test_ring_is_one_skip_row_with_fewer_devices_than_its_cases(name: str):
    import_backend(name)  # skips where the framework is not installed
    report = check(name, operations=("ring",), contract=False)  # this process: one device, no peers
    (row,) = report.rows
    assert row.operation == "ring" and row.check == "-" and report.passed
    assert row.skipped.startswith("needs 4 devices; ") and " has 1 here (--devices 4 " in row.skipped, row.skipped


def test_numpy_simulates_the_devices():
    report = check("attention_np", operations=("ring",), contract=False, max_examples=1, measures=["values"])
    assert report.passed and {row.check for row in report.rows} == {"values", "lse"}
    assert all(row.examples >= 1 and not row.skipped for row in report.rows)


@pytest.mark.slow  # JAX with 4 devices or torch with 3 peers, in a process of its own
@pytest.mark.parametrize("name", ["attention_jax", "attention_torch"])
def test_check_runs_the_ring_on_four_simulated_devices(name: str, tmp_path: pathlib.Path):
    # one framework a test, so that the two (20-50 s each on 2 busy cores) can run on two workers at once
    import_backend(name)  # skips where the framework is not installed
    path = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "conformance", "check", name, "--operations", "ring",
                             "--devices", "4", "--max-examples", "1", "--json", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [row for row in json.loads(path.read_text())[name]["rows"] if row["operation"] == "ring"]
    checks = {row["check"] for row in rows}
    assert {"values", "lse", "gradients", "masked_rows", "errors", "edge_cases"} <= checks, (name, checks)
    assert all(row["passed"] and row["examples"] >= 1 and not row["skipped"] for row in rows), rows
