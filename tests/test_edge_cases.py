"""Every edge case of conformance/contract/fixed_cases.py on every backend, on both paths (need_weights True and False),
modules in eval mode: against the float64 oracle with the rules for NaN and inf of `fixed_checks.compare`,
and against the hand-derived rules each case carries."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from conformance.contract import cases, fixed_cases
from conformance.contract.cases import Requirement
from conformance.run import fixed_checks
from conformance.run.checks import Runner
from tests.conftest import skip_without_devices

_RUNNERS: dict[str, Runner] = {}  # one per backend, so JAX compiles each shape once
EDGES = [row for row in fixed_cases.ROWS if row.use == "edge"]


def test_every_edge_case_carries_a_hand_derived_rule():
    assert all(row.requirements for row in EDGES), [row.name for row in EDGES if not row.requirements]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf - inf and NaN are the point of some cases
@pytest.mark.parametrize("row", EDGES, ids=lambda row: f"{row.operation}-{row.name}")
def test_edge_case(backend: ModuleType, row: fixed_cases.Fixed):
    runner = _RUNNERS.setdefault(backend.__name__, Runner(backend))
    skip_without_devices(runner, row.operation)
    with runner.framework.pinned():
        result = fixed_checks.run_edge(runner, row)
    assert result.passed, result.describe()


# --- the requirements themselves -------------------------------------------------------------------------

OUT = np.array([[0.0, 0.0], [1.0, np.nan]])  # (L, Ev): row 0 zeros, row 1 NaN in column 1
WEIGHTS = np.array([[0.0, 0.0, 0.0], [0.25, 0.75, 0.0]])  # (L, S): row 0 blind, row 1 a distribution


@pytest.mark.parametrize(("requirement", "broken"), [
    (Requirement("out", "zero", index=0), None),
    (Requirement("weights", "sums_to_one", index=1), None),
    (Requirement("out", "only_nan", index=(1, 1)), None),
    (Requirement("weights", "shape", value=(2, 3)), None),
    (Requirement("out", "zero", index=1), "out[1] is not zero"),
    (Requirement("weights", "sums_to_one", index=0), "weights[0] is not sums to one"),
    (Requirement("out", "only_nan", index=1), "out[1] holds a finite number, where nan is required"),
    (Requirement("out", "finite"), "out is not finite"),
    (Requirement("weights", "shape", value=(3, 2)), "weights has shape (2, 3), expected (3, 2)"),
    (Requirement("weights", "one", index=(1, 0)), "weights[1, 0] is not one"),
], ids=str)
def test_a_requirement_names_what_breaks_it(requirement: Requirement, broken: str | None):
    assert requirement.problem(cases.sdpa_case(), OUT, WEIGHTS) == broken


def test_requirements_on_the_weights_are_not_checked_on_the_fast_path():
    assert Requirement("weights", "zero").problem(cases.sdpa_case(), OUT, None) is None


def test_equals_compares_with_a_value_of_the_case():
    case = cases.sdpa_case((), 2, 1, Ev=2)
    first_value = Requirement("out", "equals", value=cases.first_value)
    assert first_value.problem(case, np.broadcast_to(case.v, (2, 2)), None) is None
    assert first_value.problem(case, OUT, None) == "out is not v[..., 0, :]"
