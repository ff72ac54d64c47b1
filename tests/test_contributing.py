"""The contributor's guide (docs/contributing.md) keeps its two checklists true.

Each item of a checklist is one line, `- `path`: what to do there.`; the paths live there and nowhere else, so a
moved file is fixed in the guide alone. The keyword checklist: every keyword of the contract (read from the module
the checklist names for `OPTIONAL_KEYWORDS`) is in every file of its section "Every keyword, by name", and every
non-test file that names AT_LEAST of the keywords is on the checklist. The operation checklist: each item names the
place the test looks at (a name of LOOKS in backticks), and every operation of `OPERATIONS` is there. The guide
states how many non-test files each checklist touches, and the test counts them. The table of words names, for
each word, the files it lives in and the names found there.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "contributing.md"
KEYWORDS = "Checklist: add a keyword to attention"
OPERATIONS = "Checklist: add an operation to the suite"
EVERY_KEYWORD = "Every keyword, by name"  # the section whose files name every keyword
NOTHING_TO_WRITE = "Read from the entry: nothing to write"  # places that read OPERATIONS: not counted as touched
AT_LEAST = 2  # a non-test file that names this many keywords is a place of the keyword checklist
TEXT_FILES = (".py", ".md", ".json", ".toml", ".yml", ".yaml", ".sh", ".txt")
NOT_SOURCES = {"tests", "site", "build", "dist", "gpu-results", "__pycache__"}  # test, generated or ignored folders
CHECKS_BLOCK = re.compile(r"<!-- generated: python -m conformance docs --write \(checks\) -->\n(.*?)"
                          r"<!-- end generated \(checks\) -->", re.DOTALL)
# operation -> why no broken implementation in the tests targets it (none today)
BROKEN_EXEMPT: dict[str, str] = {}


class Item(NamedTuple):
    """One line of a checklist: `- `path`: what to do there.`"""

    section: str  # the title of the ### section it is in
    path: str  # the place: the path the item starts with
    paths: tuple[str, ...]  # every path it names, the place first
    names: tuple[str, ...]  # its other words in backticks
    line: str


def _is_path(word: str) -> bool:
    return re.fullmatch(r"[\w./-]+", word) is not None and ("/" in word or word.endswith(TEXT_FILES))


def checklist(title: str) -> tuple[str, list[Item]]:
    """The text of the guide's section `title` and its items."""
    text = GUIDE.read_text()
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.DOTALL | re.MULTILINE)
    assert found, f"{GUIDE.relative_to(ROOT)} has no section '## {title}'"
    items, section = [], ""
    for line in found[1].splitlines():
        if line.startswith("### "):
            section = line[4:].strip()
        elif line.startswith("- "):
            start = re.match(r"- `([^`]+)`: ", line)
            assert start and _is_path(start[1]), f"an item of '{title}' starts with its path in backticks and a " \
                                                 f"colon: {line!r}"
            words = re.findall(r"`([^`]+)`", line)
            items.append(Item(section, start[1], tuple(word for word in words if _is_path(word)),
                              tuple(word for word in words if not _is_path(word)), line))
    assert items, f"'{title}' has no items"
    return found[1], items


def _module(path: str) -> ModuleType:
    """The module at `path` (a .py file of the checkout), imported by its dotted name."""
    return importlib.import_module(path.removesuffix(".py").replace("/", "."))


def _source(items: list[Item], name: str) -> ModuleType:
    """The module of the one item that names `name`."""
    found = [item for item in items if name in item.names and item.section != NOTHING_TO_WRITE]
    assert len(found) == 1, f"one item of the checklist names `{name}` (the test reads it there): {found}"
    return _module(found[0].path)


def _words(text: str, words: Any) -> set[str]:
    """The words of `words` that `text` holds as whole words (`window` is not in `window_mask`)."""
    return {word for word in words if re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text)}


# --- the keyword checklist ---------------------------------------------------------------------------------------

def contract_keywords() -> dict[str, Any]:
    """The keywords of SPEC.md section 2a and their defaults, from the module the checklist names for them."""
    return _source(checklist(KEYWORDS)[1], "OPTIONAL_KEYWORDS").OPTIONAL_KEYWORDS


def non_test_files() -> list[str]:
    """The checkout's text files outside tests/ and the generated or ignored folders, as paths from the root."""
    found = []
    for folder, folders, files in os.walk(ROOT):  # the ignored folders (.venv, site) pruned, not walked
        folders[:] = [name for name in folders
                      if name not in NOT_SOURCES and not name.startswith(".") and not name.endswith(".egg-info")]
        found += [(Path(folder) / name).relative_to(ROOT).as_posix() for name in files if name.endswith(TEXT_FILES)]
    return sorted(found)


def test_every_path_of_the_checklists_exists() -> None:
    missing = [(path, item.line) for title in (KEYWORDS, OPERATIONS) for item in checklist(title)[1]
               for path in item.paths if not (ROOT / path).exists()]
    assert not missing, "the checklists name paths that do not exist:\n" + "\n".join(
        f"{path} in {line}" for path, line in missing)


def test_every_keyword_is_in_every_file_that_names_them_all() -> None:
    keywords = contract_keywords()
    places = [item.path for item in checklist(KEYWORDS)[1] if item.section == EVERY_KEYWORD]
    assert len(places) > 10 and keywords
    missing = [f"keyword {keyword!r} is not in {path}" for path in places
               for keyword in sorted(set(keywords) - _words((ROOT / path).read_text(), keywords))]
    assert not missing, f"the keyword checklist's '{EVERY_KEYWORD}' lists these files:\n" + "\n".join(missing)


def test_every_file_that_names_keywords_is_on_the_keyword_checklist() -> None:
    keywords = contract_keywords()
    named = {item.path for item in checklist(KEYWORDS)[1]}
    left_out = {}
    for path in non_test_files():
        found = _words((ROOT / path).read_text(errors="replace"), keywords)
        if len(found) >= AT_LEAST and path not in named and ROOT / path != GUIDE:  # the guide names them too
            left_out[path] = sorted(found)
    assert not left_out, f"non-test files that name {AT_LEAST} or more keywords, not on the keyword checklist of " \
                         f"{GUIDE.relative_to(ROOT)}:\n" + "\n".join(f"{path}: {found}" for path, found in
                                                                     left_out.items())


@pytest.mark.parametrize("title", [KEYWORDS, OPERATIONS])
def test_the_guide_states_how_many_non_test_files_each_checklist_touches(title: str) -> None:
    text, items = checklist(title)
    stated = re.findall(r"touches (\d+) non-test files", text)
    assert len(stated) == 1, f"'{title}' states once how many non-test files it touches"
    touched = {item.path for item in items if item.section != NOTHING_TO_WRITE and not item.path.startswith("tests/")}
    assert int(stated[0]) == len(touched), f"'{title}' says {stated[0]} non-test files; its items name " \
                                           f"{len(touched)}: {sorted(touched)}"


# --- the operation checklist ---------------------------------------------------------------------------------------

class Place(NamedTuple):
    """What the test reads at an item of the operation checklist."""

    found: Callable[[Item, dict[str, Any], list[Item]], set[str]]  # (item, OPERATIONS, items) -> the names there
    exempt: Callable[[dict[str, Any]], dict[str, str]] = lambda operations: {}  # operation -> why it needs none
    every: bool = True  # every operation must be there; False: only operations may be there


def _functions(module: ModuleType) -> set[str]:
    return {name for name, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == module.__name__}


def _checked_by(item: Item, operations: dict[str, Any], items: list[Item], *, gradient: bool = False) -> set[str]:
    """The operations with a group whose check is a function of the item's module (a gradient group, if asked)."""
    module = _module(item.path)
    return {group.operation for group in _source(items, "GROUPS").GROUPS
            if group.check.__module__ == module.__name__ and (group.gradient or not gradient)}


def _toleranced(item: Item, operations: dict[str, Any], items: list[Item]) -> set[str]:
    """The operations whose every group's measures have a tolerance in each of the group's dtypes."""
    tolerances, suite = json.loads((ROOT / item.path).read_text()), _source(items, "GROUPS")
    lacking = {group.operation for group in suite.GROUPS for dtype in group.dtypes
               for measure in suite.MEASURES[group.check] if measure not in tolerances.get(dtype, {})}
    return set(operations) - lacking


def _in_checks_table(item: Item, operations: dict[str, Any], items: list[Item]) -> set[str]:
    """The operations in the generated table of checks, looked up in each file the item names."""
    blocks = [found[1] for path in item.paths if (found := CHECKS_BLOCK.search((ROOT / path).read_text()))]
    assert len(blocks) == 1, f"the generated checks table is in exactly one of {item.paths}: found {len(blocks)}"
    rows = [line.split("|")[2] for line in blocks[0].splitlines() if line.startswith("| `")]
    return _words(" ".join(rows), operations)


def _has_function(item: Item, operations: dict[str, Any], items: list[Item]) -> set[str]:
    """The operations whose function (`TransformerBlock.extend`) the item's module has, or its text calls."""
    if item.path.endswith(".md"):
        text = (ROOT / item.path).read_text()
        return {name for name, operation in operations.items()
                if re.search(rf"(?<!\w){re.escape(operation.function.split('.')[-1])}\(", text)}
    module = _module(item.path)

    def has(dotted: str) -> bool:
        owner: Any = module
        for part in dotted.split("."):
            owner = getattr(owner, part, None)
        return owner is not None

    return {name for name, operation in operations.items() if has(operation.function)}


def _broken_targets(item: Item, operations: dict[str, Any], items: list[Item]) -> set[str]:
    """The operations a file of broken implementations runs them on: the string literals of its `operations=`
    arguments, and of its EXPECTED or REACHES table (variant -> (operation, checks) or [operations])."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / item.path).read_text())):
        if isinstance(node, ast.keyword) and node.arg == "operations" and isinstance(node.value, ast.Tuple | ast.List):
            found |= {element.value for element in node.value.elts if isinstance(element, ast.Constant)}
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict) and \
                isinstance(target, ast.Name) and target.id in ("EXPECTED", "REACHES"):
            for value in node.value.values:
                if isinstance(value, ast.Tuple) and isinstance(value.elts[0], ast.Constant):
                    found.add(value.elts[0].value)
                elif isinstance(value, ast.List):
                    found |= {element.value for element in value.elts if isinstance(element, ast.Constant)}
    return found & set(operations)


def _built_ins(item: Item, operations: dict[str, Any], items: list[Item]) -> set[str]:
    return {name for framework in _module(item.path).FRAMEWORKS.values() for name in framework.built_ins}


# the name in backticks that says where an item of the operation checklist is looked at -> how
LOOKS: dict[str, Place] = {
    "OPERATIONS": Place(lambda item, operations, items: set(_module(item.path).OPERATIONS)),
    "Operation.case": Place(lambda item, operations, items: {
        name for name, operation in operations.items() if operation.case.__module__ == _module(item.path).__name__}),
    "Operation.oracle": Place(lambda item, operations, items: {  # the entry's oracle calls a function of the module
        name for name, operation in operations.items()
        if set(operation.oracle.__code__.co_names) & _functions(_module(item.path))}),
    "Operation.strategy": Place(lambda item, operations, items: {
        name for name, operation in operations.items() if callable(getattr(_module(item.path), operation.strategy,
                                                                           None))}),
    "ROWS": Place(lambda item, operations, items: {  # examples, edge cases and errors, each
        name for name in operations
        if {row.use for row in _module(item.path).ROWS if row.operation == name} >= {"example", "edge", "error"}}),
    "GROUPS": Place(lambda item, operations, items: {group.operation for group in _module(item.path).GROUPS}),
    "Group.check": Place(_checked_by),
    "Operation.vjp": Place(lambda item, operations, items: _checked_by(item, operations, items, gradient=True),
                           exempt=lambda operations: {name: "it has no vjp" for name, operation in operations.items()
                                                      if not operation.vjp}),
    "TOLERANCES": Place(_toleranced),
    "GUARDS": Place(lambda item, operations, items: {
        name for _, names, _ in _module(item.path).guard_rows() for name in names}),
    "checks": Place(_in_checks_table),
    "built_ins": Place(_built_ins, every=False),
    "Operation.function": Place(_has_function),
    "CONTRACTS": Place(lambda item, operations, items: set(_module(item.path).CONTRACTS)),
    "EXPECTED": Place(_broken_targets, exempt=lambda operations: BROKEN_EXEMPT),
    "REACHES": Place(_broken_targets, exempt=lambda operations: BROKEN_EXEMPT),
}


def _look(item: Item) -> str:
    """The one name of LOOKS that the item holds."""
    looks = [name for name in item.names if name in LOOKS]
    assert len(looks) == 1, f"an item of the operation checklist names one place the test looks at (one of " \
                            f"{sorted(LOOKS)}); this names {looks}: {item.line!r}"
    return looks[0]


def _to_write() -> list[Item]:
    return [item for item in checklist(OPERATIONS)[1] if item.section != NOTHING_TO_WRITE]


def test_each_item_of_the_operation_checklist_is_a_place_the_test_looks_at() -> None:
    looks = [_look(item) for item in _to_write()]
    assert "OPERATIONS" in looks and len(looks) >= 15


def test_every_operation_is_in_every_place_of_the_operation_checklist() -> None:
    items = _to_write()
    operations = _source(items, "OPERATIONS").OPERATIONS
    assert len(operations) >= 7
    by_place: dict[Callable, tuple[Place, list[Item], set[str]]] = {}  # items of one kind: their names together
    for item in items:
        place = LOOKS[_look(item)]
        _, where, found = by_place.setdefault(place.found, (place, [], set()))
        where.append(item)
        found |= place.found(item, operations, items)
    missing = []
    for place, where, found in by_place.values():
        paths = ", ".join(f"{item.path} ({_look(item)})" for item in where)
        if place.every:
            missing += [f"operation {name!r} is not in {paths}" for name in operations
                        if name not in found and name not in place.exempt(operations)]
        else:
            missing += [f"{name!r} in {paths} is not an operation" for name in sorted(found - set(operations))]
    assert not missing, f"the operation checklist of {GUIDE.relative_to(ROOT)}:\n" + "\n".join(missing)


def test_the_command_line_offers_every_operation_without_a_line_of_its_own() -> None:
    items = checklist(OPERATIONS)[1]
    (item,) = (item for item in items if item.section == NOTHING_TO_WRITE and "--operations" in item.names)
    operations = _source(items, "OPERATIONS").OPERATIONS
    assert _module(item.path).build_parser().parse_args(["check", "some_module"]).operations == tuple(operations)


# --- the set-up commands -------------------------------------------------------------------------------------------

def _bash_lines(text: str) -> list[str]:
    return [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL) for line in block.splitlines()]


@pytest.mark.parametrize("path", [GUIDE, ROOT / "CONTRIBUTING.md"], ids=lambda path: path.name)
def test_the_set_up_commands_are_the_readmes_two(path: Path) -> None:
    commands = _bash_lines(path.read_text())
    readme = _bash_lines((ROOT / "README.md").read_text())
    assert len(commands) == 2 and all(command in readme for command in commands), \
        f"{path.relative_to(ROOT)}'s set-up commands {commands} are not the README's {readme}"


# --- the words -----------------------------------------------------------------------------------------------------

def test_every_name_the_words_table_gives_is_where_it_says():
    # each row: | word | means | where it lives |, the last cell naming paths and the names found in them
    text = GUIDE.read_text()
    section = re.search(r"^## Words\n(.*?)(?=^## )", text, flags=re.DOTALL | re.MULTILINE)
    assert section, "the guide has a section '## Words'"
    rows = [line for line in section[1].splitlines() if line.startswith("| ") and not line.startswith("| word")]
    assert len(rows) >= 8, rows
    wrong = []
    for row in rows:
        where = row.rstrip(" |").rsplit(" | ", 1)[1]
        words = re.findall(r"`([^`]+)`", where)
        paths = [word for word in words if _is_path(word)]
        folder = Path(paths[0]).parent if paths else None  # a bare file name after a path is in its folder
        files = [ROOT / word if "/" in word else ROOT / folder / word for word in paths]
        wrong += [f"{row}: no {file.relative_to(ROOT)}" for file in files if not file.exists()]
        sources = "".join(file.read_text() for file in files if file.exists())
        wrong += [f"{row}: `{name}` is not in {paths}" for name in words if not _is_path(name)
                  and not re.search(rf"\b{re.escape(name.rpartition('.')[2])}\b", sources)]
    assert not wrong, "the Words table of the guide names places that do not hold what it says:\n" + "\n".join(wrong)
