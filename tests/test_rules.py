"""The rules of `python -m conformance frameworks` (conformance/frameworks/disagreements.py): every rule holds on
our backends, on each operation it can probe, and each one names the deviation of a module built to have it."""

from __future__ import annotations

import inspect
import json
import pathlib
import re
import subprocess
import sys
import types

import pytest

from conformance.frameworks import disagreements
from tests.conftest import import_backend
from tests.implementations.broken import BROKEN
from tests.implementations.broken_gradients import BROKEN_GRADIENTS

ROOT = pathlib.Path(__file__).resolve().parents[1]

# a module with one deviation -> {rule: the cell its probe must give}
DEVIATIONS = {
    "masked_row_nan": {"fully masked rows": "NaN"},
    "masked_row_uniform": {"fully masked rows": "the mean of all values (uniform weights)"},
    "causal_bottom_right": {"is_causal with L != S": "bottom-right aligned"},
    "weights_averaged_over_heads": {"weights per head": "averaged over the heads"},
    "weights_after_dropout": {"weights in training": "after dropout"},
    "softmax_in_half_precision": {"float16 error": "1.3e-01, above 3.4e-03"},
}


def _only(backend: types.ModuleType, *names: str) -> types.ModuleType:
    """A module with asarray, to_numpy and `names` of `backend` (and their vjps): one operation to probe."""
    module = types.ModuleType(f"{backend.__name__}_{'_'.join(names)}")
    for name in ("asarray", "to_numpy", *names):
        setattr(module, name, getattr(backend, name))
    if "scaled_dot_product_attention" in names:
        module.scaled_dot_product_attention_vjp = backend.scaled_dot_product_attention_vjp
    return module


@pytest.mark.parametrize("function", ["scaled_dot_product_attention", "MultiHeadAttention", "TransformerBlock"])
def test_every_rule_holds_on_our_backends(backend: types.ModuleType, function: str):
    cells = disagreements.measure(_only(backend, function))
    probed = {rule.name for rule in disagreements.RULES if any(
        operation == {"scaled_dot_product_attention": "sdpa", "MultiHeadAttention": "mha",
                      "TransformerBlock": "block"}[function] for operation in rule.operations)}
    assert probed and all(cells[name].holds for name in probed), {name: cells[name] for name in probed}
    assert all(cell.text == "-" for name, cell in cells.items() if name not in probed)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN and overflow the deviations make
@pytest.mark.parametrize("name", sorted(DEVIATIONS))
def test_a_deviation_is_named_by_its_rule_and_no_other(name: str):
    cells = disagreements.measure(BROKEN[name])
    for rule, text in DEVIATIONS[name].items():
        assert cells[rule] == disagreements.Cell(False, text), cells[rule]
    others = {rule: cell for rule, cell in cells.items() if rule not in DEVIATIONS[name] and rule != "gradients"}
    assert all(cell.holds for cell in others.values()), others  # the einsum implementation has no vjp


def test_the_rules_read_their_cases_from_the_table_not_from_the_kind_of_a_case():
    # grow by tables (STYLE.md): an operation the rules probe is one entry of PROBES, and no probe branches on
    # a case's type or an operation's name
    assert {operation for rule in disagreements.RULES for operation in rule.operations} <= set(disagreements.PROBES)
    assert not re.findall(r"isinstance\(case|operation ==", inspect.getsource(disagreements))


def test_a_wrong_backward_pass_fails_the_gradient_rule():
    assert disagreements.measure(BROKEN_GRADIENTS["dk_not_scaled"])["gradients"] == disagreements.Cell(
        False, "dk differs from the oracle's")
    assert disagreements.measure(import_backend("attention_np"))["gradients"] == disagreements.Cell(True, "holds")


def test_a_rule_needing_a_lacking_argument_says_so():
    from conformance.builtins import torch_encoder_layer_fast, torch_sdpa

    assert disagreements.measure(torch_sdpa)["weights in training"] == disagreements.Cell(None, "no weights returned")
    fast = disagreements.measure(torch_encoder_layer_fast)
    assert fast["weights in training"] == disagreements.Cell(None, "no dropout")
    assert fast["gradients"] == disagreements.Cell(None, "no vjp") and fast["is_causal with L != S"].text == "-"


@pytest.mark.slow
def test_the_frameworks_command_prints_the_matrix_and_writes_json(tmp_path: pathlib.Path):
    path = tmp_path / "matrix.json"
    result = subprocess.run([sys.executable, "-m", "conformance", "frameworks", "--only", "torch_mha",
                             "--markdown", "--rules-only", "--jobs", "1", "--json", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert table[0] == "| rule | spec | nn.MultiheadAttention |"
    assert len(table) == 2 + len(disagreements.RULES)  # the header, its rule, the rules (no suite's row: --rules-only)
    assert "| fully masked rows | zeros | NaN with need_weights=True; holds without |" in table
    found = json.loads(path.read_text())
    assert [column["title"] for column in found["columns"]] == ["nn.MultiheadAttention"]
    assert found["columns"][0]["suite"] is None and set(found["versions"]) >= {"torch"}


def test_the_suite_s_cell_counts_the_rows_or_names_the_failing_ones():
    from conformance.frameworks import matrix
    from conformance.run.suite import Report, Row

    def row(operation: str, check: str, passed: bool = True, skipped: str | None = None) -> Row:
        return Row("m",
                   operation=operation,
                   check=check,
                   dtype="float64",
                   examples=1,
                   worst=0.0,
                   tolerance=0.0,
                   passed=passed,
                   failure=None,
                   skipped=skipped)

    passing = Report([row("sdpa", "values"), row("sdpa", "edge_cases"), row("mha", "-", skipped="no MHA")], seed=0,
                     profile="fast", settings=[])
    assert matrix.suite_cell(passing) == disagreements.Cell(True, "2 rows pass, 1 skip")
    failing = passing._replace(rows=[*passing.rows, row("mha", "edge_cases", False), row("sdpa", "values", False),
                                     row("block", "gradients", False), row("sdpa", "errors", False)])
    assert matrix.suite_cell(failing) == disagreements.Cell(False, "fails edge_cases (mha), errors (sdpa), "
                                                                  "gradients (block) and 1 more")
