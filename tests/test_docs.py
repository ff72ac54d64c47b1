"""The documents' generated blocks (conformance/docs.py, `python -m conformance docs --write`) are what their
command generates now, in every document that shows them (README.md, SPEC.md, docs/**/*.md): the tables of the
registries (checks, groups, profiles, features, rules, the adapters' layouts and masks), the frameworks matrix
from docs/frameworks.json, the kernel example's counts from its report, and each built-in's column of
docs/frameworks.json measured afresh, where every built-in also passes the suite or declares what it lacks."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import pathlib
import re
import shutil

import pytest

from conformance import adapters, docs, pytest_plugin
from conformance.builtins import BUILT_INS, module_names
from conformance.contract import fixed_cases
from conformance.contract.features import Feature
from conformance.contract.operations import OPERATIONS
from conformance.frameworks import disagreements, matrix
from conformance.run import suite
from conformance.run.suite import Report, Row

TEXTS = {path.relative_to(docs.ROOT): path.read_text() for path in docs.documents()}
RECORDED = json.loads(docs.FRAMEWORKS_JSON.read_text())

# contradictions of the spec that one fixed case shows stay a FAIL of the suite's row (docs/suite.md): built-in ->
# {(operation, check): the one failing case}. Any other failing row is a feature the built-in neither has nor
# declares lacking (a new feature of the contract fails here until each built-in does one or the other).
CONTRADICTIONS = {"keras_mha": {("mha", "edge_cases"): "visible_scores_below_minus_1e9"}}


def _holding(name: str) -> dict[pathlib.Path, str]:
    """{document: its block `name`} for every document that shows the block."""
    return {path: docs.shown(text, name) for path, text in TEXTS.items() if name in docs.names_in(text)}


def test_every_block_is_one_the_command_generates_and_each_is_shown_somewhere():
    assert {str(path): docs.unknown(text) for path, text in TEXTS.items() if docs.unknown(text)} == {}
    assert [name for name in docs.BLOCKS if not _holding(name)] == []
    assert set(docs.BLOCKS) == {"frameworks", "frameworks-versions", "kernel", "low-precision", *docs.REGISTRY_TABLES}


@pytest.mark.parametrize("name", docs.REGISTRY_TABLES)
def test_each_registry_s_table_is_generated_from_the_code(name: str):
    table = docs.REGISTRY_TABLES[name]()
    assert {path: block for path, block in _holding(name).items() if block != table} == {}, \
        "python -m conformance docs --write"


# a made-up entry for each registry that a generated table shows: the table must change with it
NEW_ENTRIES = {
    "groups": lambda monkeypatch: monkeypatch.setattr(suite, "GROUPS", (*suite.GROUPS, suite.Group(
        "sdpa", suite.checks.against_oracle, dtypes=("float64",), examples=1))),
    "profiles": lambda monkeypatch: monkeypatch.setattr(docs, "PROFILES", {**docs.PROFILES, "quick": 0}),
    "features": lambda monkeypatch: monkeypatch.setattr(docs, "FEATURES", {**docs.FEATURES, "made_up": Feature(
        "made_up", kind="rule", asks="something", without="nothing")}),
    "rules": lambda monkeypatch: monkeypatch.setattr(disagreements, "RULES", (
        *disagreements.RULES, disagreements.RULES[0]._replace(name="made up"))),
    "adapter-layouts": lambda monkeypatch: (monkeypatch.setattr(adapters, "LAYOUTS", (*adapters.LAYOUTS, "LBHE")),
                                            monkeypatch.setitem(docs.LAYOUT_SHAPES, "LBHE", ("a", "b", "c"))),
    "adapter-masks": lambda monkeypatch: monkeypatch.setitem(adapters.MASKS, "inverted", "made up"),
    "error-rows": lambda monkeypatch: monkeypatch.setattr(fixed_cases, "ROWS", [*fixed_cases.ROWS, fixed_cases.error(
        "sdpa", "made_up", lambda: None, ValueError, "made up")]),
    "checks": lambda monkeypatch: monkeypatch.setattr(suite, "GROUPS", (*suite.GROUPS, suite.Group(
        "linear", suite.checks.sdpa_single_key, dtypes=("float64",), examples=1))),  # a check on one more operation
    "serve": lambda monkeypatch: monkeypatch.setattr(docs, "serve_record", functools.partial(_rerun,
                                                                              docs.serve_record())),
    "mla": lambda monkeypatch: monkeypatch.setattr(docs, "mla_record", functools.partial(_slower, docs.mla_record())),
}


def _rerun(record: dict) -> dict:
    """The serving benchmark's record as another run might leave it: continuous batching a second slower."""
    rows = [row | {"seconds": row["seconds"] + 1.0} if row["method"] == "continuous" else row for row in record["rows"]]
    return record | {"rows": rows}


def _slower(record: dict) -> dict:
    """Latent attention's record as another run might leave it: the absorbed steps a millisecond slower."""
    rows = [row | {"ms_per_token": row["ms_per_token"] + 1.0} if row["form"] == "absorbed" else row
            for row in record["rows"]]
    return record | {"rows": rows}


@pytest.mark.parametrize("name", docs.REGISTRY_TABLES)
def test_a_new_entry_in_a_registry_makes_its_table_stale(name: str, monkeypatch: pytest.MonkeyPatch):
    NEW_ENTRIES[name](monkeypatch)
    table = docs.REGISTRY_TABLES[name]()
    assert all(block != table for block in _holding(name).values())


def test_every_measure_the_suite_reports_has_one_row_in_the_table_of_checks():
    assert docs.uncovered() == []


def test_the_adapters_layouts_are_those_the_table_describes():
    assert set(docs.LAYOUT_SHAPES) == set(adapters.LAYOUTS)


def test_the_spec_names_every_operation_a_module_may_have_alone():
    # SPEC 11 "What a module needs": the functions of which a module must have one (suite.contract_gaps)
    spec = TEXTS[pathlib.Path("SPEC.md")]
    needs = spec[spec.index("**What a module needs.**"):spec.index("(`python -m conformance check MODULE` refuses")]
    named = re.findall(r"`(\w+)`", needs.split("at least one of", 1)[1])
    assert named == [operation.function for operation in OPERATIONS.values() if "." not in operation.function]


def test_the_pytest_plugin_s_options_are_those_the_checking_page_names():
    source = pathlib.Path(pytest_plugin.__file__).read_text()
    page = TEXTS[docs.CHECKING]
    plugin_section = page[page.index("## In your own CI"):]
    assert set(re.findall(r"--conformance-[\w-]+", plugin_section)) == set(
        re.findall(r'addoption\("(--conformance-[\w-]+)"', source))


def test_the_frameworks_matrix_is_docs_frameworks_json():
    recorded = matrix.from_json(RECORDED)
    assert set(_holding("frameworks").values()) == {docs.frameworks_table(recorded)}
    assert set(_holding("frameworks-versions").values()) == {docs.frameworks_versions(recorded)}
    assert [column["module"] for column in RECORDED["columns"]] == module_names() and not RECORDED["skipped"]


def test_the_recorded_versions_are_the_installed_ones():
    installed = matrix.versions()
    assert {name: RECORDED["versions"][name] for name in installed} == installed, "python -m conformance docs --write"


def test_a_block_is_replaced_between_its_markers_and_nowhere_else():
    text = (f"a {docs.begin('kernel')}1 rows pass, 2 are SKIP{docs.end('kernel')} b\n{docs.begin('checks')}\n\n"
            f"| x |\n\n{docs.end('checks')}\n")
    assert docs.shown(text, "kernel") == "1 rows pass, 2 are SKIP" and docs.shown(text, "checks") == "| x |"
    changed = docs.replaced(docs.replaced(text, "kernel", "3 rows pass, 0 are SKIP"), "checks", "| y |\n|---|")
    assert changed == text.replace("1 rows pass, 2", "3 rows pass, 0").replace("| x |", "| y |\n|---|")
    assert docs.differences(changed, {"kernel": "3 rows pass, 0 are SKIP", "checks": "| y |"}) == ["checks"]
    assert docs.names_in(changed) == ["kernel", "checks"] and docs.unknown(changed) == []
    with pytest.raises(KeyError, match="holds 0 blocks 'frameworks'"):
        docs.shown(text, "frameworks")
    twice = text + docs.begin("kernel") + docs.end("kernel") + docs.begin("made-up") + docs.end("made-up")
    assert docs.unknown(twice) == ["kernel", "made-up"]


def _copy_of_the_documents(root: pathlib.Path) -> None:
    for path in TEXTS:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(docs.ROOT / path, root / path)


def test_docs_write_rewrites_every_block_of_every_document_and_check_then_finds_none_stale(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    # the command's own logic, on a made-up measurement (the real one: the tests below, one built-in each)
    report = Report([Row("m", operation="sdpa", check="values", dtype="float64", examples=1, worst=0.0,
                         tolerance=1e-9, passed=True),
                     Row("m", operation="flash", check="-", dtype="-", examples=0, worst=0.0, tolerance=0.0,
                         passed=True, skipped="no flash_attention")], seed=0, profile="fast", settings=[])
    found = matrix.Matrix(
        columns=[matrix.Column("m", title="M", cells={matrix.SUITE: matrix.suite_cell(report)}, seconds=1.0,
                               report=report)],
        skipped={},
        versions={"torch": "0.1"})
    monkeypatch.setattr(docs, "measure_frameworks", lambda **_: found)
    monkeypatch.setattr(docs, "check_kernel", lambda text: report)
    monkeypatch.setattr(docs.precision, "table", lambda: "| made up |")
    _copy_of_the_documents(tmp_path)
    record = tmp_path / "frameworks.json"
    fresh = {"frameworks": docs.frameworks_table(found), "frameworks-versions": "torch 0.1",
             "kernel": "1 rows pass, 1 are SKIP", "low-precision": "| made up |"}
    stale = [f"{path}: {name}" for path, text in TEXTS.items() for name in docs.names_in(text) if name in fresh]
    assert len(stale) >= 4
    assert docs.run(write=False, jobs=1, root=tmp_path, record=record) == [*stale, "frameworks.json"]
    assert {path: (tmp_path / path).read_text() for path in TEXTS} == TEXTS and not record.exists()  # --check
    docs.run(write=True, jobs=1, root=tmp_path, record=record)
    assert docs.run(write=False, jobs=1, root=tmp_path, record=record) == []
    for path, old in TEXTS.items():
        text = (tmp_path / path).read_text()
        for name in (name for name in docs.names_in(old) if name in fresh):
            assert docs.shown(text, name) == fresh[name]
            text, old = docs.replaced(text, name, ""), docs.replaced(old, name, "")
        assert text == old, path  # nothing outside the blocks changed


def test_docs_refuses_a_block_it_does_not_generate(tmp_path: pathlib.Path):
    _copy_of_the_documents(tmp_path)
    page = tmp_path / docs.CHECKING
    page.write_text(page.read_text() + docs.begin("made-up") + docs.end("made-up"))
    with pytest.raises(ValueError, match="made-up"):
        docs.run(write=False, jobs=1, root=tmp_path)


def test_the_docs_command_exits_1_where_check_finds_a_stale_block(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]):
    from conformance.__main__ import main

    monkeypatch.setattr(docs, "run", lambda **options: ["docs/checking.md: checks"] if not options["write"] else [])
    assert main(["docs", "--check"]) == 1 and "differs: docs/checking.md: checks" in capsys.readouterr().out
    assert main(["docs", "--write"]) == 0 and "up to date" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["docs"])  # --write or --check


@pytest.mark.slow  # the rules and the suite (docs.SUITE_OPTIONS) on one built-in: 2-9 s of CPU each
@pytest.mark.parametrize("name", BUILT_INS)
def test_each_built_in_s_recorded_column_is_measured_afresh(name: str):
    try:
        importlib.import_module(f"conformance.builtins.{name}")
    except ImportError as error:  # its framework is not installed here
        pytest.skip(f"{name}: {error}")
    with _their_promotion():
        column = matrix.column(f"conformance.builtins.{name}", **docs.SUITE_OPTIONS)
    # 1) the built-in passes, or declares what it lacks (a contradiction of the spec aside)
    failing = {(row.operation, row.check): row.failure for row in column.report.rows if not row.passed}
    expected = CONTRADICTIONS.get(name, {})
    assert set(failing) == set(expected), "\n\n".join(failing.values())
    for key, case in expected.items():  # that one case, and no other of the row
        assert re.search(r": 1 of \d+ cases fail\n", failing[key]) and f" {case}: " in failing[key], failing[key]

    # 2) its column in docs/frameworks.json (the README's matrix) is this measurement, timing aside
    fresh = docs.recorded_column(matrix.to_json(matrix.Matrix(columns=[column], skipped={}, versions={}))["columns"][0])
    recorded = {found["module"]: docs.recorded_column(found) for found in RECORDED["columns"]}
    assert json.loads(json.dumps(fresh)) == recorded[column.name], "python -m conformance docs --write"


@contextlib.contextmanager
def _their_promotion():
    """JAX's default promotion, which the JAX built-ins' own code needs (tests/conftest.py makes it strict)."""
    try:
        import jax
    except ImportError:
        yield
        return
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield
