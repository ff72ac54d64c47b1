"""Records, not bags (STYLE.md): a group of values that travels together is a NamedTuple or a dataclass, built with
its fields named, so that a reader (and a review) sees what each value is, as conformance/frameworks/registry.py's
records do; never a dict posing as an object."""

from __future__ import annotations

import ast
import functools
import pathlib

from conformance.contract import operations

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("attention_np", "attention_jax", "attention_torch", "conformance")
BUILT = (*PACKAGES, "tests/implementations")  # where records are built: the packages and the implementations
POSITIONAL = 2  # at most two fields given by position, where the two are obvious: Measure(value, worst)
NAMED_ONLY = ("Operation",)  # registries of many fields that name every one (an Operation has over twenty)
DICTS = ("dict", "Dict", "UserDict", "OrderedDict", "defaultdict")  # the names a dict subclass's base ends in


def _trees(*folders: str) -> dict[str, ast.Module]:
    """{path relative to the root: parsed source} of every .py file under the folders; each file parsed once for
    all the tests (tests/ holds tests/implementations/, which BUILT names too)."""
    return {str(path.relative_to(ROOT)): _tree(path)
            for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))}


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@functools.cache
def _nodes(tree: ast.Module) -> tuple[ast.AST, ...]:
    """Every node of a tree, walked once for all the tests (ast.walk is most of their time)."""
    return tuple(ast.walk(tree))


def _name(node: ast.expr) -> str | None:
    """The name an expression ends in: NamedTuple for typing.NamedTuple, dataclass for dataclass(frozen=True)."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _is_record(node: ast.ClassDef) -> bool:
    return (any(_name(base) == "NamedTuple" for base in node.bases)
            or any(_name(decorator) == "dataclass" for decorator in node.decorator_list))


def _classes(trees: dict[str, ast.Module]) -> list[tuple[str, ast.ClassDef]]:
    return [(path, node) for path, tree in trees.items() for node in _nodes(tree) if isinstance(node, ast.ClassDef)]


def _record_calls(trees: dict[str, ast.Module]) -> list[tuple[str, ast.Call]]:
    """Every call, in the trees, of a record class defined in them, found by the record's name."""
    records = {node.name for _, node in _classes(trees) if _is_record(node)}
    return sorted(((path, node) for path, tree in trees.items() for node in _nodes(tree)
                   if isinstance(node, ast.Call) and _name(node.func) in records),
                  key=lambda found: (found[0], found[1].lineno, found[1].col_offset))


def _too_positional(call: ast.Call) -> bool:
    """More than POSITIONAL fields by position, or an unpacked sequence beside other positional fields (a record's
    own values unpacked alone, Row(*row), are its fields in order)."""
    starred = [arg for arg in call.args if isinstance(arg, ast.Starred)]
    return len(call.args) - len(starred) > POSITIONAL or (bool(starred) and len(call.args) > 1)


def _sets_getattr(node: ast.ClassDef) -> bool:
    """Whether the class body defines __getattr__ or assigns it (__getattr__ = dict.__getitem__)."""
    return any((isinstance(item, ast.FunctionDef) and item.name == "__getattr__")
               or (isinstance(item, ast.Assign) and any(_name(target) == "__getattr__" for target in item.targets))
               for item in node.body)


def test_records_are_built_with_their_fields_named():
    trees = _trees(*BUILT)
    calls = _record_calls(trees)
    found = {_name(call.func) for _, call in calls}
    assert {"Group", "Requirement", "Target", "Feature", "Row", "SdpaCase", "KVCache", "Operation"} <= found
    too_positional = [f"{path}:{call.lineno} {_name(call.func)} ({len(call.args)} positional)"
                      for path, call in calls if _too_positional(call)]
    assert not too_positional, "build these records with keywords (at most two fields by position):\n" + "\n".join(
        too_positional)


def test_the_registries_name_every_field():
    # an Operation has over twenty fields: each record names them all, so that a reader sees which function is
    # the oracle and which the pullback, as registry.py's records do
    calls = [(path, call) for path, call in _record_calls(_trees(*BUILT)) if _name(call.func) in NAMED_ONLY]
    assert len([call for _, call in calls if _name(call.func) == "Operation"]) == len(operations.OPERATIONS)
    positional = [f"{path}:{call.lineno} {_name(call.func)}" for path, call in calls if call.args]
    assert not positional, positional


def test_no_dict_poses_as_an_object():
    # a dict with __getattr__ = dict.__getitem__ (or a __getattr__ of its own) hides its fields from a reader and
    # a type checker: a NamedTuple or a frozen dataclass names them
    posing = [f"{path}:{node.lineno} {node.name}" for path, node in _classes(_trees(*PACKAGES, "tests"))
              if _sets_getattr(node) and any(_name(base) in DICTS for base in node.bases)]
    assert not posing, posing


def test_no_dict_subclass_is_a_record():
    # a dict made hashable (or given methods) to travel as one value is a record: a NamedTuple is hashable
    subclasses = [f"{path}:{node.lineno} {node.name}" for path, node in _classes(_trees(*PACKAGES, "tests"))
                  if any(_name(base) in DICTS for base in node.bases)]
    assert not subclasses, subclasses
