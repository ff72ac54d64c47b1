"""The README's generated blocks (conformance/docs.py, `python -m conformance docs --write`) are what their command
generates now: the table of checks from the suite's registries, the frameworks matrix from docs/frameworks.json,
and each built-in's column of docs/frameworks.json measured afresh, where every built-in also passes the suite or
declares what it lacks. The kernel example's counts are compared in test_readme.py, where its report is made."""

from __future__ import annotations

import contextlib
import importlib
import json
import pathlib
import re

import pytest

from conformance import docs
from conformance.builtins import BUILT_INS, module_names
from conformance.frameworks import matrix
from conformance.run.suite import Report, Row

README = docs.README.read_text()
RECORDED = json.loads(docs.FRAMEWORKS_JSON.read_text())

# contradictions of the spec that one fixed case shows stay a FAIL of the suite's row (SPEC 12): built-in ->
# {(operation, check): the one failing case}. Any other failing row is a feature the built-in neither has nor
# declares lacking (a new feature of the contract fails here until each built-in does one or the other).
CONTRADICTIONS = {"keras_mha": {("mha", "edge_cases"): "visible_scores_below_minus_1e9"}}


def test_the_table_of_checks_is_generated_from_the_suite_s_registries():
    assert docs.shown(README, "checks") == docs.checks_table(), "python -m conformance docs --write"


def test_every_measure_the_suite_reports_has_one_row_in_the_table_of_checks():
    assert docs.uncovered() == []


def test_the_frameworks_matrix_is_docs_frameworks_json():
    recorded = matrix.from_json(RECORDED)
    assert docs.shown(README, "frameworks") == docs.frameworks_table(recorded)
    assert docs.shown(README, "frameworks-versions") == docs.frameworks_versions(recorded)
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
    with pytest.raises(KeyError, match="holds 0 blocks 'frameworks'"):
        docs.shown(text, "frameworks")


def test_docs_write_rewrites_every_block_and_the_record_and_check_then_finds_none_stale(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    # the command's own logic, on a made-up measurement (the real one: the tests below, one built-in each)
    report = Report([Row("m", "sdpa", "values", "float64", 1, 0.0, 1e-9, True),
                     Row("m", "flash", "-", "-", 0, 0.0, 0.0, True, skipped="no flash_attention")], 0, "fast", [])
    found = matrix.Matrix([matrix.Column("m", "M", {matrix.SUITE: matrix.suite_cell(report)}, 1.0, report)], {},
                          {"torch": "0.1"})
    monkeypatch.setattr(docs, "measure_frameworks", lambda **_: found)
    monkeypatch.setattr(docs, "check_kernel", lambda text: report)
    readme, record = tmp_path / "README.md", tmp_path / "frameworks.json"
    readme.write_text(README)
    assert docs.run(write=False, jobs=1, readme=readme, record=record) == [
        "frameworks", "frameworks-versions", "kernel", str(record)]
    assert readme.read_text() == README and not record.exists()  # --check writes nothing
    docs.run(write=True, jobs=1, readme=readme, record=record)
    assert docs.run(write=False, jobs=1, readme=readme, record=record) == []
    text = readme.read_text()
    assert docs.shown(text, "kernel") == "1 rows pass, 1 are SKIP" and docs.shown(text, "frameworks-versions") == \
        "torch 0.1"
    assert "| the suite | what it declares it has | 1 rows pass, 1 skip |" in docs.shown(text, "frameworks")
    assert text.replace(docs.shown(text, "frameworks"), "") == README.replace(docs.shown(README, "frameworks"), "") \
        .replace(docs.shown(README, "kernel"), "1 rows pass, 1 are SKIP").replace(
        docs.shown(README, "frameworks-versions"), "torch 0.1")  # nothing outside the blocks changed


def test_the_docs_command_exits_1_where_check_finds_a_stale_block(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]):
    from conformance.__main__ import main

    monkeypatch.setattr(docs, "run", lambda **options: ["checks"] if not options["write"] else [])
    assert main(["docs", "--check"]) == 1 and "differs: checks" in capsys.readouterr().out
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
    fresh = docs.recorded_column(matrix.to_json(matrix.Matrix([column], {}, {}))["columns"][0])
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
