"""The README's commands stay true (its Python blocks run in tests/test_doc_examples.py)."""

from __future__ import annotations

import re
from pathlib import Path

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


README_MOST_LINES = 250  # what it is, the two commands, a quick start, a tour and links; the manual is docs/


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= README_MOST_LINES


def test_the_readmes_links_reach_files_of_the_repository() -> None:
    # relative links, as GitHub shows them: each names a file of this checkout (anchors aside)
    targets = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", README)
               if not re.match(r"\w+://", target) and not target.startswith("#")]
    assert targets and all((ROOT / target).exists() for target in targets), \
        [target for target in targets if not (ROOT / target).exists()]
