"""The command line as a user runs it: exit codes, one table column per importable backend, JSON."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

import pytest

from conformance.__main__ import BUILT_IN
from conformance.run import suite
from conformance.run.suite import CONTRACT_RUNS

pytestmark = pytest.mark.slow  # each test starts `python -m conformance` in a subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # the CLI skips such a backend, with a note
        return False
    return True


# the main job in a process of its own, run with runpy so that the modules it imported can be read afterwards: its
# parts need two jobs at least, which the default (one per core) gives on every machine of more than one core
MAIN_JOB = ("import json, runpy, sys\nsys.argv = ['conformance', *json.loads(sys.argv[1])]\n"
            "try:\n    runpy.run_module('conformance', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
            "print('loaded:', [name for name in (*sys.modules, ) if name.split('.')[0] in "
            "('attention_jax', 'attention_torch', 'jax', 'torch')])")


class MainJob(NamedTuple):
    """One run of the main job on two of its operations (sdpa, and ring for its SKIP rows): the process's result,
    its JSON report, and the operations it checked."""

    result: subprocess.CompletedProcess
    reports: dict
    operations: tuple[str, ...]


@pytest.fixture(scope="module")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> MainJob:
    """The main job, run once for the two tests that read it (each run costs seconds of CPU in every worker)."""
    path, operations = tmp_path_factory.mktemp("main") / "report.json", ("sdpa", "ring")
    jobs = ["--jobs", "2"] if (os.cpu_count() or 1) < 2 else []  # one core: the default would check in this process
    args = ["--operations", ",".join(operations), "--max-examples", "1", "--seed", "7", "--json", str(path), *jobs]
    result = subprocess.run([sys.executable, "-c", MAIN_JOB, json.dumps(args)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return MainJob(result, json.loads(path.read_text()), operations)


def test_default_run_passes_and_names_each_importable_backend(main_job: MainJob) -> None:
    # the main job, checked in parts (one process per core); its report is the one a single process makes. Two of
    # its operations here, ring for its SKIP rows; .ci/run runs the whole main job, from the wheel
    result, reports, operations = main_job
    header = next(line for line in result.stdout.splitlines() if line.startswith("operation"))
    for name in BUILT_IN:
        if _importable(name):
            assert name in header.split(), f"{name} imports but is not a column of:\n{result.stdout}"
            assert re.search(rf"^{name}: [0-9.]+ s, CPU [0-9.]+ s", result.stdout, re.MULTILINE), result.stdout
            assert reports[name]["passed"] is True and reports[name]["seed"] == 7 and f"checked {name}" in result.stderr
            rows = reports[name]["rows"]
            assert {row["operation"] for row in rows} == {*CONTRACT_RUNS, *operations}
            assert all(row["examples"] >= 1 for row in rows if not row["skipped"])
            # ring attention needs 4 devices: NumPy simulates them, JAX and torch have one here (no --devices)
            assert {row["operation"] for row in rows if row["skipped"]} == (set() if name == "attention_np"
                                                                             else {"ring"})
        else:
            assert f"skipped {name}:" in result.stdout, result.stdout
    assert "seed 7" in result.stdout and "FAIL" not in result.stdout and "all pass" in result.stdout
    single = suite.check("attention_np", operations=operations, max_examples=1, seed=7)
    assert reports["attention_np"]["rows"] == single.to_json()["rows"]


def test_check_of_a_module_that_does_not_import_fails_also_in_the_json(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "report.json"
    result = _run("check", "no_such_attention_module", "--max-examples", "1", "--json", str(path))
    assert result.returncode == 1
    assert "skipped no_such_attention_module" in result.stdout
    entry = json.loads(path.read_text())["no_such_attention_module"]
    assert entry["passed"] is False and "No module named 'no_such_attention_module'" in entry["skipped"]


def test_check_of_a_module_without_the_contract_names_what_it_lacks() -> None:
    result = _run("check", "math", "--max-examples", "1")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "skipped math: does not implement the attention contract: it has no asarray, to_numpy" in result.stdout
    # a partial module needs one operation at least (SPEC 11); math has none
    with pytest.raises(AttributeError, match=r"no asarray, to_numpy, any of scaled_dot_product_attention, "
                                             r"flash_attention, ring_attention, linear_attention, MultiHeadAttention, "
                                             r"TransformerBlock, flex_attention, varlen_attention, "
                                             r"MultiHeadLatentAttention$"):
        suite.check("math", operations=("sdpa",))


@pytest.mark.parametrize("args", [("check", "attention_np", "--max-examples", "0"),
                                  ("compare", "--repeats", "0"), ("compare", "--repeats", "-1")], ids=" ".join)
def test_counts_below_one_are_usage_errors(args: tuple[str, ...]) -> None:
    result = _run(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "expected a positive integer" in result.stderr
    with pytest.raises(ValueError, match="max_examples must be at least 1, got 0"):
        suite.check("attention_np", max_examples=0)


def test_an_unknown_operation_or_check_is_a_usage_error() -> None:
    for option, value, words in (("--operations", "sdpa,foo", "unknown operations ['foo']"),
                                  ("--checks", "value", "unknown checks ['value']")):
        result = _run("check", "attention_np", option, value)
        assert result.returncode == 2 and "Traceback" not in result.stderr and words in result.stderr


@pytest.mark.parametrize("command", ["compare", "figure"])
def test_compare_and_figure_import_neither_the_suite_nor_hypothesis(command: str) -> None:
    # `python -m conformance COMMAND --help`, run with runpy so that sys.modules can be read afterwards
    code = (f"import runpy, sys\nsys.argv = ['conformance', {command!r}, '--help']\n"
            "try:\n    runpy.run_module('conformance', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
            "print('loaded:', [name for name in ('hypothesis', 'conformance.run.suite') if name in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "loaded: []", result.stdout


def test_the_main_job_imports_jax_and_torch_in_its_workers_only(main_job: MainJob) -> None:
    # the parent of a run in parts starts the workers and joins their reports: it imports neither framework nor its
    # backend (each would cost it a second or more of CPU on top of the workers' own imports). The run of
    # test_default_run_passes_and_names_each_importable_backend, which checked every backend in its workers
    result = main_job.result
    assert "all pass" in result.stdout and result.stdout.splitlines()[-1] == "loaded: []", result.stdout
