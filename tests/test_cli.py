"""`python -m conformance` as a user runs it: exit code 0 and one table column per importable backend."""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

from conformance.report import BACKENDS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # the CLI skips such a backend, with a note
        return False
    return True


def test_cli_passes_and_names_each_importable_backend() -> None:
    result = subprocess.run([sys.executable, "-m", "conformance"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("operation"))
    for name in BACKENDS:
        if _importable(name):
            assert name in header.split(), f"{name} imports but is not a column of:\n{result.stdout}"
        else:
            assert f"skipped {name}:" in result.stdout, result.stdout
    assert "seed 0" in result.stdout and "FAIL" not in result.stdout


def test_cli_seed_option_is_printed() -> None:
    result = subprocess.run([sys.executable, "-m", "conformance", "--seed", "7"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "seed 7:" in result.stdout
