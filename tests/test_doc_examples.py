"""Every Python block of README.md, SPEC.md (shown on the site) and docs/ runs, and the site's API reference
shows every public name.

The blocks are found by glob, so a new page is covered without a list. A block that cannot run here says so on its
first line (`# needs: gpu`, `# needs: several processes`) and is skipped with that reason; a block whose first
line names a module file (`conformance.docs.KERNEL_FILE`) is that module, written to a file and checked by the
suite as its comment says.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from conformance import docs

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "SPEC.md", *sorted((ROOT / "docs").glob("**/*.md"))]
NEEDS = re.compile(r"# needs: (gpu|several processes)\n")  # the first line of a block not runnable here
MOST_NOT_RUN = 4  # fewer than a handful of blocks may be skipped for what they need
PACKAGES = ("attention_np", "attention_jax", "attention_torch", "conformance")


class Block(NamedTuple):
    page: Path
    index: int  # the block's place among the page's python blocks
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.index}"


def _blocks() -> list[Block]:
    return [Block(page, index, code) for page in PAGES
            for index, code in enumerate(docs.PYTHON_BLOCK.findall(page.read_text()))]


def _imports(block: Block, framework: str) -> bool:
    """Whether the block imports `framework`, itself or through its backend (`import attention_jax`)."""
    return re.search(rf"^(import|from) .*\b(attention_)?{framework}\b", block.code, flags=re.MULTILINE) is not None


def _param(block: Block) -> pytest.ParameterSet:
    # JAX's compiles and the suite's run take seconds (tests/conftest.py's rule); NumPy and torch take milliseconds
    slow = _imports(block, "jax") or docs.KERNEL_FILE.match(block.code) is not None
    return pytest.param(block, id=block.name, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("block", [_param(block) for block in _blocks()])
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if needs := NEEDS.match(block.code):
        pytest.skip(f"{block.name} needs {needs[1]}")
    for framework in ("jax", "torch"):
        if _imports(block, framework):
            pytest.importorskip(framework)
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    if docs.KERNEL_FILE.match(block.code):  # a file of its own, checked by the suite as its comment says
        page = block.page.read_text()
        assert docs.kernel_source(page)[1] == block.code, f"{block.name}: a page holds one kernel module"
        report = docs.check_kernel(page)
        assert report.passed, "\n\n".join(row.failure for row in report.rows if row.failure)
        assert any(row.skipped for row in report.rows)  # a partial module: what it lacks is SKIP
        # the counts its paragraph gives, generated (python -m conformance docs --write) in the page it is in
        assert docs.shown(page, "kernel") == docs.kernel_counts(report)
        return
    exec(compile(block.code, block.name, "exec"), {"__name__": "__doc_example__"})


def test_blocks_are_found_in_the_readme_and_the_pages() -> None:
    pages = {block.page.name for block in _blocks()}
    assert {"README.md", "tutorial.md", "variants.md"} <= pages, pages


def test_fewer_than_a_handful_of_blocks_are_not_run() -> None:
    not_run = [block.name for block in _blocks() if NEEDS.match(block.code)]
    assert len(not_run) <= MOST_NOT_RUN, not_run


def test_a_block_not_run_says_why_on_its_first_line() -> None:
    # "# needs: ..." anywhere but the first line would run a block its author meant to skip
    misplaced = [block.name for block in _blocks() if "# needs:" in block.code and not NEEDS.match(block.code)]
    assert not misplaced, misplaced


@pytest.mark.parametrize("block", [block for block in _blocks() if docs.KERNEL_FILE.match(block.code)],
                         ids=lambda block: block.name)
def test_a_kernel_is_wrapped_and_checked_in_under_15_lines(block: Block) -> None:
    lines = [line for line in block.code.splitlines() if line.strip() and not line.startswith("#")]
    assert len(lines) < 15, block.code


def test_the_frameworks_page_shows_the_readmes_generated_blocks() -> None:
    readme, page = (ROOT / "README.md").read_text(), (ROOT / "docs" / "frameworks.md").read_text()
    for name in ("frameworks", "frameworks-versions"):
        assert docs.shown(page, name) == docs.shown(readme, name), name


def test_the_figures_shown_are_drawn_by_a_command_on_their_page() -> None:
    # each figure of the site appears on a page that also gives the command writing it (`--plot docs/x.png`,
    # `--output docs/x.png`)
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for figure in re.findall(r"!\[[^\]]*\]\(([\w-]+\.png)\)", text):
            assert re.search(rf"--(plot|output) docs/{re.escape(figure)}", text), (page.name, figure)


@pytest.mark.slow
def test_the_api_reference_renders_every_public_name(tmp_path: Path) -> None:
    # builds the site (a few seconds) and reads each package's page for an entry of every name in its __all__
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    for package in PACKAGES:
        html = (site / "api" / package / "index.html").read_text()
        shown = set(re.findall(rf'id="{package}\.(\w+)"', html))
        missing = sorted(set(importlib.import_module(package).__all__) - shown)
        assert not missing, (package, missing)
