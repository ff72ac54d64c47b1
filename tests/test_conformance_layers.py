"""conformance/'s imports run one way: each module imports only from its own layer and those below it
(conformance/__init__.py lists the layers), and no two modules import each other, also through an import inside
a function, so that no cycle hides behind a lazy import."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "conformance"

# the layers, bottom first: module names below conformance ("" is conformance itself), as fnmatch patterns
LAYERS = (
    ("frameworks", "frameworks.registry", "frameworks.peers", "cli"),  # what differs between the frameworks
    ("contract", "contract.*"),  # the contract's description
    ("run", "run.*"),  # the suite that checks a module
    ("frameworks.disagreements", "frameworks.matrix", "builtins", "builtins.*", "adapters", ""),  # built-ins measured
    ("bench", "bench.*"),  # the benchmarks and figures
    ("__main__", "docs", "pytest_plugin", "test_conformance"),  # the command line and the entry points
)


def _name(path: Path) -> str:
    """conformance/run/suite.py -> "run.suite"; a package's __init__.py -> the package ("" for conformance)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> int:
    for number, patterns in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            return number
    raise AssertionError(f"conformance.{name} is in no layer: add it to LAYERS and to conformance/__init__.py")


def imports(name: str) -> set[str]:
    """The conformance modules `name` imports anywhere in its file, top level or inside a function."""
    path = MODULES[name]
    parts = name.split(".") if name else []
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            elif node.module == "conformance" or (node.module or "").startswith("conformance."):
                base = node.module.removeprefix("conformance").removeprefix(".")
            else:
                continue
            for alias in node.names:  # a submodule where the name is one, else the module named
                found.add(f"{base}.{alias.name}".strip(".") if f"{base}.{alias.name}".strip(".") in MODULES else base)
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("conformance").removeprefix(".") for alias in node.names
                      if alias.name.partition(".")[0] == "conformance"}
    return found - {name}


@pytest.mark.parametrize("name", list(MODULES))
def test_a_module_imports_only_from_its_layer_and_below(name: str) -> None:
    above = sorted(target for target in imports(name) if layer(target) > layer(name))
    assert not above, f"conformance.{name} (layer {layer(name)}) imports {above} from a layer above it"


def test_no_two_modules_import_each_other_even_inside_a_function() -> None:
    graph = {name: imports(name) & set(MODULES) for name in MODULES}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "an import cycle: " + " -> ".join((*path[path.index(name):], name))
        if name not in done:
            for target in graph[name]:
                visit(target, (*path, name))
            done.add(name)

    for name in graph:
        visit(name, ())


def test_the_check_sees_an_import_inside_a_function() -> None:
    # bench/report.py imported complexity inside a function while complexity imported report's _columns
    assert "frameworks.registry" in imports("pytest_plugin")  # pytest_configure's lazy import
    assert "run.suite" in imports("")  # conformance.check's: Hypothesis is imported only when a check runs
