"""Every edge case of conformance/edge_checks.py on every backend and both paths: the explicit path
(need_weights=True) and the fast path (need_weights=False), modules in eval mode.

Each test checks the spec's rule for its case by hand (zeros, shapes, which rows are NaN), then the
numbers against the float64 oracle with the rules for NaN and inf of `edge_checks.compare`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import pytest

from conformance import checks
from conformance.checks import Runner
from conformance.edge_checks import EDGE_CASES, EdgeCase, compare

_RUNNERS: dict[str, Runner] = {}  # one per backend, so JAX compiles each shape once
ALL = slice(None)


class Rule(NamedTuple):
    """A hand-derived requirement on `out` or `weights` (skipped on the fast path, which returns None) at
    `index` (NumPy indexing; () is the whole array): `kind` is "zero" or "one" (exactly), "finite", "nan",
    "sums_to_one" (each row), "only_nan" / "only_nan_or_inf" (there NaN, or NaN or inf, and finite
    everywhere else), "equals" (`value(case)` broadcast, to 1e-15) or "shape" (`value` the shape)."""

    name: str  # "out" or "weights"
    kind: str
    index: tuple = ()
    value: Any = None

    def __call__(self, case: checks.Case, out: np.ndarray, weights: np.ndarray | None) -> None:
        x = out if self.name == "out" else weights
        if x is None:
            return
        where = f"{self.name}[{self.index}]"
        if self.kind == "shape":
            assert x.shape == self.value, f"{self.name} has shape {x.shape}, expected {self.value}"
        elif self.kind == "equals":
            np.testing.assert_allclose(x[self.index], np.broadcast_to(self.value(case), x[self.index].shape),
                                       rtol=1e-15, atol=0, err_msg=where)
        elif self.kind.startswith("only_"):
            poisoned = np.zeros(x.shape, bool)
            poisoned[self.index] = True
            bad = np.isnan(x) if self.kind == "only_nan" else ~np.isfinite(x)
            assert np.all(bad[poisoned]), f"{where} holds a finite number"
            assert np.all(np.isfinite(x[~poisoned])), f"{self.name} is not finite outside {self.index}"
        else:
            test = {"zero": lambda y: y == 0, "one": lambda y: y == 1, "finite": np.isfinite, "nan": np.isnan,
                    "sums_to_one": lambda y: np.abs(y.sum(axis=-1) - 1) <= 1e-12}[self.kind]
            assert np.all(test(x[self.index])), f"{where} is not {self.kind}"


def _w_o_bias(case: checks.Case) -> np.ndarray:
    return case.state["w_o.bias"]  # every head sees no key: zero heads, then W_o 0 + b_o


def _first_value(case: checks.Case) -> np.ndarray:
    return case.v  # (..., 1, Ev): one key, whose weight is exp(s - s) / exp(s - s) = 1 whatever s is


# The rules each case pins, derived by hand from the spec.
HAND: dict[tuple[str, str], list[Rule]] = {
    # sdpa: q (2, 3, 2), k (2, 4, 2), v (2, 4, 3); the "heads" cases q, k, v (2, 2, 3 or 4, 2)
    ("sdpa", "fully_masked_rows"): [Rule(name, "zero", row) for name in ("out", "weights")
                                    for row in ((0, 0), (1, 2))] + [Rule("weights", "sums_to_one", (0, slice(1, 3)))],
    ("sdpa", "fully_masked_head"): [Rule("out", "zero", (ALL, 1)), Rule("weights", "zero", (ALL, 1))],
    ("sdpa", "fully_masked_batch_element"): [Rule("out", "zero", (1,)), Rule("weights", "zero", (1,))],
    ("sdpa", "no_keys"): [Rule("out", "zero"), Rule("out", "shape", value=(2, 3, 3)),
                          Rule("weights", "shape", value=(2, 3, 0))],
    ("sdpa", "no_queries"): [Rule("out", "shape", value=(2, 0, 3)), Rule("weights", "shape", value=(2, 0, 4))],
    ("sdpa", "single_key"): [Rule("out", "equals", value=_first_value), Rule("weights", "one")],
    ("sdpa", "logits_in_the_thousands"): [Rule("out", "finite"), Rule("weights", "sums_to_one")],
    ("sdpa", "nan_in_query"): [Rule("out", "only_nan", (0, 1, 1)), Rule("weights", "only_nan", (0, 1, 1))],
    # causal: query i sees keys 0..i, so key 2 reaches query 2 alone (whose hidden key 3 may read NaN)
    ("sdpa", "nan_in_key"): [Rule("out", "only_nan", (0, 2)), Rule("weights", "nan", (0, 2, slice(0, 3))),
                             Rule("weights", "finite", (0, slice(0, 2))), Rule("weights", "finite", (1,))],
    ("sdpa", "nan_in_value"): [Rule("out", "only_nan", (0, ALL, 2)), Rule("weights", "finite")],
    # bias[0, 2, 0] is NaN too, but the mask hides key 0 from query (0, 2): that row stays finite
    ("sdpa", "nan_in_bias"): [Rule("out", "only_nan", (0, 1)), Rule("weights", "only_nan", (0, 1))],
    # +inf - max = inf - inf = NaN: never the finite one-hot limit
    ("sdpa", "inf_score"): [Rule("out", "only_nan_or_inf", (ALL, ALL, 1))],
    # mha: D = 4, H = 2, q (2, 3, 4), k and v (2, 5, 4)
    ("mha", "fully_masked_rows"): [Rule("out", "equals", (0, 1), _w_o_bias), Rule("out", "equals", (1, 0), _w_o_bias),
                                   Rule("weights", "zero", (0, ALL, 1)), Rule("weights", "zero", (1, ALL, 0))],
    ("mha", "fully_masked_head"): [Rule("weights", "zero", (ALL, 1)), Rule("weights", "sums_to_one", (ALL, 0))],
    ("mha", "fully_masked_batch_element"): [Rule("out", "equals", (1,), _w_o_bias), Rule("weights", "zero", (1,))],
    ("mha", "no_keys"): [Rule("out", "equals", value=_w_o_bias), Rule("weights", "shape", value=(2, 2, 3, 0))],
    ("mha", "no_queries"): [Rule("out", "shape", value=(2, 0, 4)), Rule("weights", "shape", value=(2, 2, 0, 5))],
    ("mha", "single_key"): [Rule("weights", "one")],
    ("mha", "logits_in_the_thousands"): [Rule("out", "finite"), Rule("weights", "sums_to_one")],
    ("mha", "nan_in_query"): [Rule("out", "only_nan", (0, 1)), Rule("weights", "only_nan", (0, ALL, 1))],
    # causal mask (3, 5): key 1 reaches queries 1 and 2 of sequence 0
    ("mha", "nan_in_key"): [Rule("out", "only_nan", (0, slice(1, 3)))],
    ("mha", "inf_in_query"): [Rule("out", "only_nan_or_inf", (1, 2))],
    # block: D = 4, H = 2, x (2, 4, 4)
    ("block", "fully_masked_rows"): [Rule("out", "finite"), Rule("weights", "zero", (0, ALL, 2))],
    ("block", "fully_masked_head"): [Rule("out", "finite"), Rule("weights", "zero", (ALL, 0))],
    ("block", "fully_masked_batch_element"): [Rule("out", "finite"), Rule("weights", "zero", (1,))],
    ("block", "empty_sequence"): [Rule("out", "shape", value=(2, 0, 4)), Rule("weights", "shape", value=(2, 2, 0, 0))],
    ("block", "single_position"): [Rule("out", "finite"), Rule("weights", "one")],
    ("block", "logits_in_the_thousands"): [Rule("out", "finite"), Rule("weights", "sums_to_one")],
    # self-attention without a mask: every query of sequence 0 sees key 1; LayerNorm spreads NaN along D
    ("block", "nan_in_input"): [Rule("out", "only_nan", (0,)), Rule("weights", "only_nan", (0,))],
    ("block", "inf_in_input"): [Rule("out", "only_nan_or_inf", (1,))],
}


def test_every_edge_case_has_a_hand_derived_rule():
    assert set(HAND) == {(edge.operation, edge.name) for edge in EDGE_CASES}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf - inf and NaN are the point of some cases
@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
@pytest.mark.parametrize("edge", EDGE_CASES, ids=lambda edge: f"{edge.operation}-{edge.name}")
def test_edge_case(backend: ModuleType, edge: EdgeCase, need_weights: bool):
    case = edge.build()
    runner = _RUNNERS.setdefault(backend.__name__, Runner(backend))
    with runner.framework.pinned():
        out, weights = checks.run(runner, case, "float64", need_weights=need_weights)
    assert need_weights or weights is None
    for rule in HAND[edge.operation, edge.name]:
        rule(case, out, weights)
    expected_out, expected_weights = checks.expected(case)
    blind = np.all(expected_weights == 0, axis=-1)  # queries that see no key
    problem = compare("out", out, expected_out, blind_rows=blind if edge.operation == "sdpa" else None)
    assert problem is None, f"{edge.requires}: {problem}"
    if need_weights:
        problem = compare("weights", weights, expected_weights, blind_rows=blind, nan_rows_may_fill=True)
        assert problem is None, f"{edge.requires}: {problem}"
