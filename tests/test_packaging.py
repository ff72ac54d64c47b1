"""What a wheel built from pyproject.toml holds: every package of the four top-level ones and every data file
they read, and nothing else. An editable install reads the checkout and hides a missing package; this test reads
the configuration as setuptools does, without building (`.ci/run` builds the wheel and runs the main job from it)."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest
import setuptools

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = ("attention_np", "attention_jax", "attention_torch", "conformance")
DATA = {"attention_np/py.typed", "attention_jax/py.typed", "attention_torch/py.typed",
        "conformance/contract/tolerances.json"}


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _shipped_packages() -> set[str]:
    """The packages a build ships: a hand-written list as given, or those `packages.find` discovers."""
    packages = _setuptools_config()["packages"]
    if isinstance(packages, list):
        return set(packages)
    find = packages["find"]
    finder = setuptools.find_namespace_packages if find.get("namespaces", True) else setuptools.find_packages
    return set(finder(where=str(ROOT / find.get("where", ["."])[0]), include=find.get("include", ["*"]),
                      exclude=find.get("exclude", [])))


def _source_files(suffix: str, *, python: bool) -> list[Path]:
    """Files under the four packages, relative to the root: the .py ones, or the others (caches left out)."""
    files = (path.relative_to(ROOT) for top in TOP_LEVEL for path in (ROOT / top).rglob(suffix) if path.is_file())
    return sorted(path for path in files if "__pycache__" not in path.parts and (path.suffix == ".py") == python)


def test_every_folder_of_python_files_is_a_shipped_package():
    folders = {path.parent.as_posix().replace("/", ".") for path in _source_files("*.py", python=True)}
    missing = sorted(folders - _shipped_packages())
    assert not missing, f"pyproject.toml does not ship {missing} (a wheel would lack them)"
    without_init = sorted(name for name in folders if not (ROOT / name.replace(".", "/") / "__init__.py").exists())
    assert not without_init, f"{without_init} hold .py files but no __init__.py"


def test_only_the_four_packages_ship():
    stray = sorted(name for name in _shipped_packages() if name.split(".")[0] not in TOP_LEVEL)
    assert not stray, f"pyproject.toml ships {stray} (tests, examples, scripts and docs stay out of the wheel)"


@pytest.mark.parametrize("path", _source_files("*", python=False), ids=str)
def test_every_data_file_is_declared(path):
    package = path.parent.as_posix().replace("/", ".")
    declared = _setuptools_config().get("package-data", {})
    patterns = [*declared.get("*", []), *declared.get(package, [])]
    assert any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns), \
        f"{path} is not in [tool.setuptools.package-data] (a wheel would lack it)"


def test_the_data_files_read_at_run_time_exist():
    """The files the packages read (the tolerances) and the typing markers are there for the test above to see."""
    assert {path.as_posix() for path in _source_files("*", python=False)} >= DATA
