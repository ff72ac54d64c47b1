"""The README's commands and examples stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conformance import docs

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


def test_ci_runs_the_whole_main_job_from_the_wheel() -> None:
    # the tests run two of the main job's operations (test_cli.py); CI runs all of it, as the wheel's user does
    ci = (ROOT / ".ci" / "run").read_text()
    wheel_check = ci[ci.index("wheel_check() {"):ci.index("\n}\n", ci.index("wheel_check() {"))]
    assert re.search(r"venv/bin/python -m conformance\)?$", wheel_check, flags=re.MULTILINE), wheel_check
    assert re.search(r"^wheel_check$", ci, flags=re.MULTILINE)


def test_the_budgets_quoted_are_those_the_performance_page_records() -> None:
    # the README quotes scripts/budget.sh's figures; docs/performance.md holds the dated runs they come from
    quoted = README[README.index("scripts/budget.sh"):README.index("says what each test file guards")]
    page = (ROOT / "docs" / "performance.md").read_text()
    budgets = page[page.index("## Budgets"):]
    figures = re.findall(r"\d+\.\d+", quoted)
    assert len(figures) >= 5 and all(f"{figure} s" in budgets for figure in figures), (figures, quoted)


MODULE_FILE = docs.KERNEL_FILE  # a block that is a module to check


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _blocks("python")[index]
    for framework in ("jax", "torch"):
        if f"import {framework}" in code:
            pytest.importorskip(framework)
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    if module := MODULE_FILE.match(code):  # a file of its own, checked by the suite as its comment says
        (tmp_path / f"{module[1]}.py").write_text(code)
        monkeypatch.syspath_prepend(str(tmp_path))
        from conformance import check

        report = check(module[1], **docs.KERNEL_OPTIONS)
        assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
        assert any(row.skipped for row in report.rows)  # a partial module: what it lacks is SKIP
        # the counts its paragraph gives, generated (python -m conformance docs --write)
        assert docs.shown(README, "kernel") == docs.kernel_counts(report)
        return
    exec(compile(code, f"README.md python block {index}", "exec"), {})


def test_a_kernel_is_wrapped_and_checked_in_under_15_lines() -> None:
    module = next(code for code in _blocks("python") if MODULE_FILE.match(code))
    lines = [line for line in module.splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) < 15, module
