"""Imports run one way: the first-party modules of each package form no cycle, even through an import inside a
function (so no lazy import dodges a cycle: moved to the top, it would make none); the backends import none of
their own modules inside a function; and each of conformance's modules imports only from its own layer and those
below it (conformance/__init__.py lists the layers). Lazy imports of a framework or of Hypothesis are fine.

The graph is read from the source (AST), every `import` and `from ... import` anywhere in a module, at module
level and inside functions, resolved to first-party module names; a package's __init__ is the package's module
and counts as importing what it imports."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

BACKENDS = ("attention_np", "attention_jax", "attention_torch")
PACKAGES = (*BACKENDS, "conformance")
ROOT = Path(__file__).resolve().parent.parent


def _modules(package: str) -> dict[str, Path]:
    """{dotted module name: source file} of every module of `package`, subpackages included; a package's
    __init__.py is the package's own name."""
    root = ROOT / package
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> list[str]:
    """The dotted names an import statement of module `name` may load: the module named, and for `from M import a`
    also M.a (which is a module when `a` is a submodule); relative imports resolved against the module's package."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # from . import x, from ..y import x
        package = name.split(".") if is_package else name.split(".")[:-1]
        parts = package[:len(package) - node.level + 1]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the first-party modules it imports}, from every import statement anywhere in its source."""
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        graph[name] = {target for node in ast.walk(ast.parse(path.read_text(), str(path)))
                       if isinstance(node, ast.Import | ast.ImportFrom)
                       for target in _imported(node, name, is_package) if target in modules and target != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None: a depth-first search that meets a module
    still on its path."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return [*path[path.index(target):], target]
            if target not in state and (found := visit(target, [*path, target])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def _first_party(node: ast.Import | ast.ImportFrom) -> bool:
    """Whether an import statement loads a module of ours: a relative import, or one of PACKAGES by name."""
    if isinstance(node, ast.ImportFrom) and node.level:
        return True
    names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return any(name.partition(".")[0] in PACKAGES for name in names)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_form_no_cycle(package):
    cycle = _cycle(_graph(_modules(package)))
    assert cycle is None, f"{package}: an import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("package", BACKENDS)
def test_no_function_imports_a_first_party_module(package):
    problems = []
    for path in _modules(package).values():
        for function in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                problems += [f"{path.relative_to(ROOT)}:{node.lineno} in {function.name}()"
                             for node in ast.walk(function)
                             if isinstance(node, ast.Import | ast.ImportFrom) and _first_party(node)]
    assert not problems, "first-party imports inside functions (put them at module top):\n" + "\n".join(problems)


def test_the_graph_resolves_imports_and_finds_a_cycle():
    """The tests above can fail: relative and absolute imports resolve to module names, and a cycle through a
    lazy import is named (a imports b at top, b imports a inside a function)."""
    source = "from . import b\nimport attention_np.common\n\ndef f():\n    from .a import x\n    import jax\n"
    nodes = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert [_imported(node, "p.b", False) for node in nodes] == [["p", "p.b"], ["attention_np.common"],
                                                                 ["p.a", "p.a.x"], ["jax"]]
    assert [_first_party(node) for node in nodes] == [True, True, True, False]
    assert _cycle({"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": set()}) == ["p.a", "p.b", "p.a"]
    assert _cycle({"p.a": {"p.b", "p.c"}, "p.b": {"p.c"}, "p.c": set()}) is None


# conformance's layers, bottom first: module names below conformance ("" is conformance itself), as fnmatch patterns
LAYERS = (
    ("frameworks", "frameworks.registry", "frameworks.peers", "cli"),  # what differs between the frameworks
    ("contract", "contract.*"),  # the contract's description
    ("run", "run.*"),  # the suite that checks a module
    ("frameworks.disagreements", "frameworks.matrix", "builtins", "builtins.*", "adapters", ""),  # built-ins measured
    ("bench", "bench.*"),  # the benchmarks and figures
    ("__main__", "docs", "pytest_plugin", "test_conformance"),  # the command line and the entry points
)
CONFORMANCE = _graph(_modules("conformance"))


def _layer(module: str) -> int:
    name = module.removeprefix("conformance").removeprefix(".")
    for number, patterns in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            return number
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to conformance/__init__.py")


@pytest.mark.parametrize("module", sorted(CONFORMANCE))
def test_a_conformance_module_imports_only_from_its_layer_and_below(module: str) -> None:
    above = sorted(target for target in CONFORMANCE[module] if _layer(target) > _layer(module))
    assert not above, f"{module} (layer {_layer(module)}) imports {above} from a layer above it"


def test_the_graph_sees_conformance_s_lazy_imports() -> None:
    assert "conformance.frameworks.registry" in CONFORMANCE["conformance.pytest_plugin"]  # pytest_configure's
    assert "conformance.run.suite" in CONFORMANCE["conformance"]  # check's: Hypothesis imported when a check runs
