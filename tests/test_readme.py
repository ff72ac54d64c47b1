"""The README's commands and examples stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_ci_runs_the_readme_test_command() -> None:
    # the second bash block is the test command; CI must run exactly that line
    test_command = _blocks("bash")[1].strip()
    assert test_command.endswith("python -m pytest")
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_main_job_runs_the_conformance_report() -> None:
    assert _blocks("bash")[0].strip().endswith("python -m conformance")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _blocks("python")[index]
    for framework in ("jax", "torch"):
        if f"import {framework}" in code:
            pytest.importorskip(framework)
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    exec(compile(code, f"README.md python block {index}", "exec"), {})
