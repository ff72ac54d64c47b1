"""The three backends keep in step: same public names, module files, signatures, defaults, docstring
blocks and shape legend; what they share lives in attention_np.common, the one place a backend imports from
another; and the NumPy package imports without JAX or torch."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import BACKENDS, import_backend

LEGEND = ("Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width, "
          "Ev value width, D = d_model, F = d_ff, ... leading batch axes.")
PUBLIC_FILES = {"__init__.py", "arrays.py", "distributed.py", "fast.py", "flash.py", "flex.py", "functional.py",
                "gradients.py", "latent.py", "linear.py", "modules.py", "primitives.py", "py.typed", "varlen.py"}
COMMON_FILES = {"__init__.py", "block_mask.py", "keywords.py", "mods.py", "module.py", "npz.py", "pages.py",
                "records.py", "validation.py"}
SHARED = "attention_np.common"  # the code every backend shares, and the one module a backend imports from another
NUMPY_ONLY = {SHARED.rpartition(".")[2], "figures.py"}  # the shared home; a figure of the textbook, where present
CLASSES = ("MultiHeadAttention", "TransformerBlock", "MultiHeadLatentAttention", "LatentTransformerBlock")
# each class's public methods beyond those of every module (__init__, __call__, from_state_dict, train, eval)
METHODS = {"MultiHeadAttention": ("vjp",), "TransformerBlock": ("vjp",),
           "MultiHeadLatentAttention": ("vjp", "init_cache", "extend"),
           "LatentTransformerBlock": ("init_cache", "extend")}
# the one place where the backends' signatures differ by design: where ring attention's devices are, named as each
# framework names them (NumPy simulates P devices; JAX takes a mesh and its axis; torch a process group)
TOPOLOGY = {name: {"attention_np": ("devices",), "attention_jax": ("mesh", "axis"), "attention_torch": ("group",)}
            for name in ("ring_attention", "ring_attention_vjp")}


def _backends() -> list[ModuleType]:
    return [import_backend(name) for name in BACKENDS]


def _methods(M: ModuleType, cls_name: str) -> dict[str, Callable]:
    """The public methods of a module class; torch's forward stands for the others' __call__."""
    cls = getattr(M, cls_name)
    call = cls.forward if M.__name__ == "attention_torch" else cls.__call__
    return {"__init__": cls.__init__, "__call__": call, "from_state_dict": cls.from_state_dict,
            "train": cls.train, "eval": cls.eval} | {name: getattr(cls, name) for name in METHODS[cls_name]}


def _public_callables(M: ModuleType) -> dict[str, Callable]:
    """Every public function, and every public method of the public classes, by qualified name."""
    found = {name: getattr(M, name) for name in M.__all__
             if name not in CLASSES and not isinstance(getattr(M, name), ModuleType)}  # not the catalogue `mods`
    for cls_name in CLASSES:
        found |= {f"{cls_name}.{name}": method for name, method in _methods(M, cls_name).items()}
    return found


def _parameters(function: Callable) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(function).parameters.values()]


def _block(doc: str, heading: str) -> list[str]:
    """The indented lines of a Google-style `heading:` block ("Args" or "Returns") of a docstring."""
    lines = inspect.cleandoc(doc).splitlines()
    if f"{heading}:" not in [line.strip() for line in lines]:
        return []
    start = [line.strip() for line in lines].index(f"{heading}:") + 1
    block = []
    for line in lines[start:]:
        if not line.startswith(" ") or not line.strip():
            break
        block.append(line.strip())
    return block


def _arg_names(doc: str) -> list[str]:
    """The names the Args block documents, one per line or several to a line ("q, k, v: as for ...")."""
    return [name for line in _block(doc, "Args") if (m := re.match(r"((?:\w+, )*\w+):", line))
            for name in m.group(1).split(", ")]


def _returned_names(doc: str) -> list[str]:
    """Names of the returned values, written as `name (shape)` in the Returns block."""
    return re.findall(r"\b(\w+) \((?:\.\.\.|[A-Z])", " ".join(_block(doc, "Returns")))


def test_backends_export_the_same_public_names():
    exports = {M.__name__: sorted(M.__all__) for M in _backends()}
    assert len({tuple(names) for names in exports.values()}) == 1, exports
    for M in _backends():
        missing = [name for name in M.__all__ if not hasattr(M, name)]
        assert not missing, f"{M.__name__}.__all__ names missing attributes: {missing}"


def _entries(directory: Path) -> set[str]:
    """The names of the files and folders in `directory`, without Python's bytecode cache."""
    return {path.name for path in directory.iterdir() if path.name != "__pycache__"}


def test_backends_have_the_same_module_files():
    for M in _backends():
        files = _entries(Path(M.__file__).parent)
        if M.__name__ == "attention_np":
            files -= NUMPY_ONLY
        assert files == PUBLIC_FILES, f"{M.__name__}: {sorted(files)}"


def test_shared_code_has_its_own_files():
    common = importlib.import_module(SHARED)
    assert _entries(Path(common.__file__).parent) == COMMON_FILES
    assert common.__doc__ and "share" in common.__doc__


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every module a source file imports and every name it imports from one, relative
    imports resolved against `package`, the file's own package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from ..y import x
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _foreign_import_problems(M: ModuleType) -> list[str]:
    """Imports from another package that reach a private name (one starting with _), or reach into another
    backend anywhere but attention_np.common; and, for the shared code, any import of the NumPy backend."""
    root, problems = Path(M.__file__).parent, []
    for path in sorted(root.rglob("*.py")):
        package = ".".join([M.__name__, *path.relative_to(root).parent.parts])
        for line, name in _imports(path, package):
            where, top = f"{path.relative_to(root.parent)}:{line} imports {name}", name.partition(".")[0]
            if package == SHARED and not (name == SHARED or name.startswith(f"{SHARED}.")) and top == M.__name__:
                problems.append(f"{where}: the shared code depends on no backend")
            if top in (M.__name__, "__future__"):
                continue
            if any(part.startswith("_") for part in name.split(".")):
                problems.append(f"{where}: a private name of another package")
            if top in BACKENDS and not (name == SHARED or name.startswith(f"{SHARED}.")):
                problems.append(f"{where}: another backend's module other than {SHARED}")
    return problems


def test_backends_import_no_private_module_of_another_package():
    problems = [problem for M in _backends() for problem in _foreign_import_problems(M)]
    assert not problems, "\n".join(problems)


def _shared(M: ModuleType, name: str, parameters: list) -> list:
    """The parameters (or their names) without those of TOPOLOGY, which differ between the frameworks."""
    own = TOPOLOGY.get(name, {}).get(M.__name__, ())
    return [p for p in parameters if (p[0] if isinstance(p, tuple) else p) not in own]


def test_topology_parameters_are_where_each_framework_keeps_its_devices():
    for M in _backends():
        for name, own in TOPOLOGY.items():
            parameters = inspect.signature(getattr(M, name)).parameters
            assert all(parameters[p].kind is inspect.Parameter.KEYWORD_ONLY for p in own[M.__name__]), name


def test_public_signatures_have_the_same_names_kinds_and_defaults():
    reference, *others = _backends()
    expected = {name: _shared(reference, name, _parameters(f)) for name, f in _public_callables(reference).items()}
    for M in others:
        actual = {name: _shared(M, name, _parameters(f)) for name, f in _public_callables(M).items()}
        assert actual.keys() == expected.keys(), M.__name__
        for name in expected:
            assert actual[name] == expected[name], (
                f"{M.__name__}.{name}{actual[name]} != {reference.__name__}.{name}{expected[name]}")


# The operations that take the whole keyword set of attention_np.common.keywords
WHOLE_SET = ("scaled_dot_product_attention", "scaled_dot_product_attention_vjp", "flash_attention",
             "flash_attention_vjp")


def test_every_keyword_of_the_set_has_its_tables_default_wherever_it_is_taken():
    """The keyword set's one home is attention_np.common.keywords: each backend's operations take every keyword
    of it, and every public callable that takes one of them as a keyword with a default takes it with the
    table's default (a module's constructor apart: its `bias` is the Linears' option, not the additive bias)."""
    from attention_np.common.keywords import KEYWORDS

    for M in _backends():
        for name in WHOLE_SET:
            missing = set(KEYWORDS) - set(inspect.signature(getattr(M, name)).parameters)
            assert not missing, f"{M.__name__}.{name} lacks {sorted(missing)}"
        for name, function in _public_callables(M).items():
            if name.endswith(".__init__"):
                continue
            for parameter, _, default in _parameters(function):
                if parameter in KEYWORDS and default is not inspect.Parameter.empty:
                    assert default == KEYWORDS[parameter].default, (
                        f"{M.__name__}.{name}: {parameter}={default!r}, the table's is {KEYWORDS[parameter].default!r}")


def test_docstrings_have_the_same_args_and_returns_names():
    reference, *others = _backends()
    for name, f in _public_callables(reference).items():
        assert f.__doc__, f"{reference.__name__}.{name} has no docstring"
        names = (_shared(reference, name, _arg_names(f.__doc__)), _returned_names(f.__doc__))
        for M in others:
            doc = _public_callables(M)[name].__doc__
            assert doc, f"{M.__name__}.{name} has no docstring"
            assert (_shared(M, name, _arg_names(doc)), _returned_names(doc)) == names, f"{M.__name__}.{name}"


def test_docstring_args_name_the_signature_parameters():
    for M in _backends():
        for name, f in _public_callables(M).items():
            documented = _arg_names(f.__doc__)
            if documented:  # a one-line "Args: sizes as named" summary has no per-name block
                parameters = [p for p in inspect.signature(f).parameters if p not in ("self", "cls")]
                assert documented == parameters, f"{M.__name__}.{name}: {documented} != {parameters}"


def _state(M: ModuleType, cls_name: str) -> dict:
    """A valid state of d_model 4 (and d_ff 8) as M's arrays, made by the NumPy backend."""
    numpy_backend = import_backend("attention_np")
    module = getattr(numpy_backend, cls_name)(*((4, 2) if cls_name == "MultiHeadAttention" else (4, 2, 8)), rng=0)
    return {name: M.asarray(value) for name, value in module.state_dict().items()}


# several mistakes at once: every backend checks the same things in the same order (sizes, dropout, activation,
# the state's entries, their dtypes), so each reports the same first mistake
SEVERAL_MISTAKES = {
    "mha init": lambda M: M.MultiHeadAttention(6, 4, 1.0),
    "mha load": lambda M: M.MultiHeadAttention.from_state_dict(_state(M, "MultiHeadAttention"), num_heads=3,
                                                               dropout=1.0),
    "block init": lambda M: M.TransformerBlock(4, 2, 8, 1.0, activation="tanh"),
    "block load": lambda M: M.TransformerBlock.from_state_dict(_state(M, "TransformerBlock"), num_heads=2,
                                                               dropout=1.0, activation="tanh"),
    "block load entries": lambda M: M.TransformerBlock.from_state_dict(
        {name: value for name, value in _state(M, "TransformerBlock").items() if name != "norm1.bias"},
        num_heads=2, dropout=-0.5),
}


@pytest.mark.parametrize("call", SEVERAL_MISTAKES.values(), ids=SEVERAL_MISTAKES.keys())
def test_backends_report_the_same_first_of_several_mistakes(call: Callable):
    messages = {}
    for M in _backends():
        with pytest.raises(ValueError) as raised:
            call(M)
        messages[M.__name__] = str(raised.value)
    assert len(set(messages.values())) == 1, messages


@pytest.mark.parametrize("file", ["fast", "functional", "gradients", "modules", "primitives"])
def test_module_docstrings_hold_the_one_shape_legend(file: str):
    for M in _backends():
        doc = importlib.import_module(f"{M.__name__}.{file}").__doc__
        paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
        legends = [p for p in paragraphs if p.startswith("Shape legend:")]
        assert legends == [LEGEND], f"{M.__name__}.{file}: {legends}"


@pytest.mark.slow
def test_numpy_backend_imports_without_jax_or_torch():
    # A meta-path finder that refuses jax, jaxlib and torch makes any import of them fail, so the
    # script succeeds only if attention_np (and a call into it) never imports either framework.
    script = textwrap.dedent("""
        import sys

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in ("jax", "jaxlib", "torch"):
                    raise ImportError(f"blocked: {name}")
                return None

        sys.meta_path.insert(0, Refuse())
        try:
            import jax  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("the blocker did not block jax")

        import numpy as np
        import attention_np

        q = np.ones((2, 3, 4))
        out, weights = attention_np.scaled_dot_product_attention(q, q, q)
        block = attention_np.TransformerBlock(8, 2, 16, rng=0)
        block(np.ones((1, 3, 8), np.float32))
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("jax", "jaxlib", "torch"))
        assert not loaded, loaded
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
