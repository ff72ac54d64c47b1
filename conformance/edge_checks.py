"""Edge cases: a table of fixed cases, run on a module without Hypothesis.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

EDGE_CASES: inputs at the borders of the spec (no keys, no queries, fully masked rows, logits in the
thousands, NaN and inf), each compared with the float64 oracle on both paths (need_weights True and
False), modules in eval mode. `edge_cases(module)` reports each case; `compare` holds the rules for NaN
and inf. SPEC.md section 11 lists the table in words; error_checks.py holds the other table, the error
inputs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from . import checks
from .checks import Case, Runner
from .fixed_cases import OPERATIONS, D, F, H
from .strategies import BlockCase, MhaCase, SdpaCase, _block_state, _mha_state

VALUES = json.loads((Path(__file__).parent / "tolerances.json").read_text())["float64"]["values"]  # every edge case


# --- the cases ------------------------------------------------------------------------------------------------

class EdgeCase(NamedTuple):
    """Inputs at a border of the spec (float64), and the required result in words. The result is the
    oracle's, on both paths, in eval mode, within VALUES; with the rules for NaN and inf of `compare`."""

    operation: str
    name: str
    build: Callable[[], Case]
    requires: str


def _sdpa_case(batch: tuple = (2,), L: int = 3, S: int = 4, E: int = 2, Ev: int = 3, seed: int = 0,
               **fields: Any) -> SdpaCase:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((*batch, n, w)) for n, w in ((L, E), (S, E), (S, Ev)))
    return SdpaCase(q, k, v, None, None, False, None)._replace(**fields)


def _mha_case(L: int = 3, S: int = 5, seed: int = 1, **fields: Any) -> MhaCase:
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, L, D)), rng.standard_normal((2, S, D)), rng.standard_normal((2, S, D))
    return MhaCase(_mha_state(rng, D), H, 0.1, q, k, v, None)._replace(**fields)


def _block_case(L: int = 4, seed: int = 2, **fields: Any) -> BlockCase:
    rng = np.random.default_rng(seed)
    return BlockCase(_block_state(rng, D, F), H, 0.1, False, "gelu", 1e-5, rng.standard_normal((2, L, D)),
                     None)._replace(**fields)


def _with(x: np.ndarray, index: tuple, value: float) -> np.ndarray:
    x = x.copy()
    x[index] = value
    return x


def _hide(mask: np.ndarray, index: tuple) -> np.ndarray:
    return _with(mask, index, False)


def _random_mask(*shape: int, seed: int = 3) -> np.ndarray:
    mask = np.random.default_rng(seed).random(shape) >= 0.3  # about 30% hidden
    mask[..., 0] = True  # every row sees key 0, unless a case hides the row on purpose
    return mask


def _large_sdpa() -> SdpaCase:
    """logits q_i . k_j = +-5000 + O(1): rows 0, 1 near +5000 (exp overflows without the row maximum),
    rows 2, 3 near -5000 (exp underflows to 0 / 0)."""
    rng, a = np.random.default_rng(4), math.sqrt(5000.0)
    sign = np.array([1.0, 1.0, -1.0, -1.0])[:, None]  # (L, 1)
    q = np.concatenate([np.broadcast_to(a * sign, (2, 4, 1)), rng.standard_normal((2, 4, 2))], axis=-1)  # (B, L, E)
    k = np.concatenate([np.full((2, 5, 1), a), rng.standard_normal((2, 5, 2))], axis=-1)  # (B, S, E)
    return SdpaCase(q, k, rng.standard_normal((2, 5, 3)), None, None, False, 1.0)


def _large_inputs(state: Mapping[str, np.ndarray], x: np.ndarray, prefix: str = "") -> np.ndarray:
    """x scaled so that the largest attention logit |q_h . k_h| / sqrt(d_k) of self-attention is 5000."""
    def project(name: str) -> np.ndarray:
        y = x @ state[f"{prefix}{name}.weight"].T  # (..., L, D)
        return y.reshape(*y.shape[:-1], H, D // H)  # (..., L, H, d_k)
    logits = np.einsum("...ihd,...jhd->...hij", project("w_q"), project("w_k")) / math.sqrt(D // H)
    return x * math.sqrt(5000.0 / np.max(np.abs(logits)))  # biases are O(1): logits scale as the square


def _large_mha() -> MhaCase:
    case = _mha_case(L=4, S=4)
    x = _large_inputs(case.state, case.q)
    return case._replace(q=x, k=x, v=x)


def _large_block() -> BlockCase:
    case = _block_case()
    return case._replace(x=_large_inputs(case.state, case.x, "attn."))  # post-LN: attention sees x itself


def _sdpa_edges() -> list[EdgeCase]:
    base = _sdpa_case()  # q (B, L, E), k (B, S, E), v (B, S, Ev): B = 2, L = 3, S = 4, E = 2, Ev = 3
    heads = _sdpa_case(batch=(2, 2), Ev=2)  # (B, H, L, E) with Ev = E, as heads are: torch's fused kernels
    bias = np.random.default_rng(5).standard_normal((2, 3, 4))  # (B, L, S)
    return [
        EdgeCase("sdpa", "fully_masked_rows", lambda: base._replace(
            mask=_hide(_hide(_random_mask(2, 3, 4), (0, 0)), (1, 2))),
            "rows (0, 0) and (1, 2) see no key: out and weights rows exactly 0; the others as the oracle"),
        EdgeCase("sdpa", "fully_masked_head", lambda: heads._replace(mask=np.array([True, False])[:, None, None]),
                 "q (B, H, L, E), mask (H, 1, 1) hides head 1: out[:, 1] and weights[:, 1] exactly 0"),
        EdgeCase("sdpa", "fully_masked_batch_element", lambda: base._replace(
            mask=_hide(_random_mask(2, 3, 4), (1,))),
            "batch element 1 sees no key: out[1] and weights[1] exactly 0; element 0 as the oracle"),
        EdgeCase("sdpa", "no_keys", lambda: _sdpa_case(S=0, mask=np.ones((1, 0), bool)),
                 "S = 0: out zeros (B, L, Ev), weights (B, L, 0)"),
        EdgeCase("sdpa", "no_queries", lambda: _sdpa_case(L=0, is_causal=True),
                 "L = 0: out (B, 0, Ev), weights (B, 0, S)"),
        EdgeCase("sdpa", "single_key", lambda: _sdpa_case(S=1, bias=np.full((3, 1), 0.7)),
                 "S = 1: weights 1, out = v[..., 0, :] on every row"),
        EdgeCase("sdpa", "logits_in_the_thousands", _large_sdpa,
                 "logits +-5000 (+ O(1)): finite, as the oracle (no overflow, no 0 / 0)"),
        EdgeCase("sdpa", "nan_in_query", lambda: heads._replace(q=_with(heads.q, (0, 1, 1), np.nan)),
                 "q (B, H, L, E), q[0, 1, 1] NaN: out and weights row (0, 1, 1) NaN; every other row as the oracle"),
        EdgeCase("sdpa", "nan_in_key", lambda: base._replace(k=_with(base.k, (0, 2), np.nan), is_causal=True),
                 "k[0, 2] NaN, causal: rows (0, 2) NaN; rows (0, 0), (0, 1), which do not see key 2, and "
                 "batch element 1 as the oracle"),
        EdgeCase("sdpa", "nan_in_value", lambda: base._replace(v=_with(base.v, (0, 1, 2), np.nan)),
                 "v[0, 1, 2] NaN, every key visible: out[0, :, 2] NaN; every other entry and the weights as "
                 "the oracle"),
        EdgeCase("sdpa", "nan_in_bias", lambda: base._replace(
            bias=_with(_with(bias, (0, 1, 3), np.nan), (0, 2, 0), np.nan), mask=_hide(np.ones((2, 3, 4), bool),
                                                                                      (0, 2, 0))),
            "bias[0, 1, 3] NaN (visible): row (0, 1) NaN; bias[0, 2, 0] NaN but hidden by the mask: row (0, 2) "
            "finite; every other row as the oracle"),
        EdgeCase("sdpa", "inf_score", lambda: heads._replace(bias=_with(np.zeros((3, 4)), (1, 0), np.inf)),
                 "q (B, H, L, E), bias (L, S), bias[1, 0] = +inf (visible): out rows (:, :, 1) NaN or inf, never "
                 "finite; weights rows (:, :, 1) hold NaN or inf; every other row as the oracle"),
    ]


def _mha_edges() -> list[EdgeCase]:
    base = _mha_case()
    return [
        EdgeCase("mha", "fully_masked_rows", lambda: _mha_case(
            mask=_hide(_hide(_random_mask(2, 1, 3, 5), (0, 0, 1)), (1, 0, 0))),
            "queries (0, 1) and (1, 0) see no key in any head: their weights rows exactly 0, out rows w_o.bias"),
        EdgeCase("mha", "fully_masked_head", lambda: _mha_case(mask=np.array([True, False])[:, None, None]),
                 "mask (H, 1, 1) hides head 1: weights[:, 1] exactly 0, out as the oracle"),
        EdgeCase("mha", "fully_masked_batch_element", lambda: _mha_case(
            mask=np.arange(5) < np.reshape([3, 0], (2, 1, 1, 1))),
            "padding lengths [3, 0]: weights[1] exactly 0, out[1] = w_o.bias on every row"),
        EdgeCase("mha", "no_keys", lambda: _mha_case(S=0),
                 "S = 0: weights (B, H, L, 0), out = w_o.bias on every row"),
        EdgeCase("mha", "no_queries", lambda: _mha_case(L=0), "L = 0: out (B, 0, D), weights (B, H, 0, S)"),
        EdgeCase("mha", "single_key", lambda: _mha_case(S=1),
                 "S = 1: weights 1, out the projected value mixed by w_o, as the oracle"),
        EdgeCase("mha", "logits_in_the_thousands", _large_mha,
                 "self-attention logits up to +-5000: finite, as the oracle"),
        EdgeCase("mha", "nan_in_query", lambda: base._replace(q=_with(base.q, (0, 1), np.nan)),
                 "q[0, 1] NaN: out row (0, 1) and its weights rows NaN; every other row as the oracle"),
        EdgeCase("mha", "nan_in_key", lambda: base._replace(k=_with(base.k, (0, 1), np.nan),
                                                            mask=np.tri(3, 5, dtype=bool)),
                 "k[0, 1] NaN, causal mask: rows (0, 1), (0, 2) NaN; row (0, 0), which does not see key 1, "
                 "and batch element 1 as the oracle"),
        EdgeCase("mha", "inf_in_query", lambda: base._replace(q=_with(base.q, (1, 2), np.inf)),
                 "q[1, 2] = +inf: out row (1, 2) NaN or inf, never finite; every other row as the oracle"),
    ]


def _block_edges() -> list[EdgeCase]:
    base = _block_case()
    return [
        EdgeCase("block", "fully_masked_rows", lambda: _block_case(
            mask=_hide(np.tri(4, 4, dtype=bool)[None, None].repeat(2, 0), (0, 0, 2))),
            "causal, and query (0, 2) sees no key: its weights rows exactly 0; out as the oracle"),
        EdgeCase("block", "fully_masked_head", lambda: _block_case(mask=np.array([False, True])[:, None, None],
                                                                   norm_first=True, activation="relu"),
                 "pre-LN, mask (H, 1, 1) hides head 0: weights[:, 0] exactly 0; out as the oracle"),
        EdgeCase("block", "fully_masked_batch_element", lambda: _block_case(
            mask=np.arange(4) < np.reshape([4, 0], (2, 1, 1, 1))),
            "padding lengths [4, 0]: weights[1] exactly 0; out as the oracle"),
        EdgeCase("block", "empty_sequence", lambda: _block_case(L=0), "L = S = 0: out (B, 0, D), weights (B, H, 0, 0)"),
        EdgeCase("block", "single_position", lambda: _block_case(L=1, norm_first=True),
                 "L = 1: weights 1; out as the oracle"),
        EdgeCase("block", "logits_in_the_thousands", _large_block,
                 "post-LN, attention logits up to +-5000: finite, as the oracle"),
        EdgeCase("block", "nan_in_input", lambda: base._replace(x=_with(base.x, (0, 1), np.nan)),
                 "x[0, 1] NaN: every row of batch element 0 NaN (each query sees key 1); element 1 as the oracle"),
        EdgeCase("block", "inf_in_input", lambda: base._replace(x=_with(base.x, (1, 0), np.inf)),
                 "x[1, 0] = +inf: every row of batch element 1 NaN or inf, never finite; element 0 as the oracle"),
    ]


EDGE_CASES: list[EdgeCase] = _sdpa_edges() + _mha_edges() + _block_edges()


# --- running the cases ----------------------------------------------------------------------------------------

class EdgeResult(NamedTuple):
    case: EdgeCase
    problems: list[str]  # one line per path that went wrong; empty when the case passed

    @property
    def passed(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        return (f"{self.case.operation} {self.case.name}: requires {self.case.requires}; got "
                + "; ".join(self.problems))


def edge_cases(module: ModuleType, operations: Sequence[str] = OPERATIONS, *,
               runner: Runner | None = None) -> list[EdgeResult]:
    """Run every EDGE_CASES case of `operations` on `module` in float64, on both paths (need_weights
    True and False; modules in eval mode), and compare with the oracle."""
    runner = runner or Runner(module)
    with runner.framework.pinned():
        return [_edge(runner, case) for case in EDGE_CASES if case.operation in operations]


def _edge(runner: Runner, edge: EdgeCase) -> EdgeResult:
    case = edge.build()
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf are the point of some cases
        expected_out, expected_weights = checks.expected(case)
    blind = np.all(expected_weights == 0, axis=-1)  # (..., rows): queries that see no key (the oracle's zeros)
    problems = []
    for need_weights in (True, False):
        path = f"need_weights={need_weights}"
        try:
            with np.errstate(invalid="ignore", over="ignore"):
                out, weights = checks.run(runner, case, "float64", need_weights=need_weights)
        except Exception as error:  # the module raised: a failure of this case
            problems.append(f"{path} raised {type(error).__name__}: {error}")
            continue
        found = [compare("out", out, expected_out, blind_rows=blind if edge.operation == "sdpa" else None)]
        if need_weights:
            found.append(compare("weights", weights, expected_weights, blind_rows=blind, nan_rows_may_fill=True))
        elif weights is not None:
            found.append("weights is not None")
        problems += [f"{path}: {problem}" for problem in found if problem]
    return EdgeResult(edge, problems)


def compare(name: str, actual: np.ndarray | None, expected: np.ndarray, *, blind_rows: np.ndarray | None = None,
            nan_rows_may_fill: bool = False) -> str | None:
    """What is wrong with `actual` against the oracle's `expected` (float64), or None:
    the shape and dtype; NaN or inf exactly where the oracle has NaN or inf (either kind counts, as the
    oracle may give NaN where inf - inf arises); the finite entries within VALUES (relative, as the suite's
    `values`); rows in `blind_rows` (queries that see no key) exactly 0. With nan_rows_may_fill (weights):
    in a row holding NaN or inf, a hidden key's 0 may be NaN too, as exp(-inf - NaN) is NaN."""
    if actual is None:
        return f"{name} is None"
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"{name} is {actual.shape} {actual.dtype}, expected {expected.shape} {expected.dtype}"
    poisoned = ~np.isfinite(expected)
    free = np.zeros_like(poisoned)
    if nan_rows_may_fill:
        free = np.any(poisoned, axis=-1, keepdims=True) & (expected == 0)  # (..., rows, 1) & (..., rows, S)
    if np.any(np.isfinite(actual[poisoned])):
        return f"{name} is finite at {_where(poisoned & np.isfinite(actual))}, where NaN or inf is required"
    stray = ~np.isfinite(actual) & ~poisoned & ~free
    if np.any(stray):
        return f"{name} is NaN or inf at {_where(stray)}, where the oracle is finite"
    if blind_rows is not None and np.any(actual[blind_rows] != 0):
        return f"{name} is not exactly 0 in rows that see no key: {_where(blind_rows[..., None] & (actual != 0))}"
    settled = poisoned | free
    error = checks.relative_error(np.where(settled, 0.0, actual), np.where(settled, 0.0, expected))
    return None if error <= VALUES else f"{name}: relative error {error:.2e} > {VALUES:.0e}"


def _where(entries: np.ndarray, limit: int = 3) -> str:
    """The first few indices where `entries` is True, as text."""
    found = [tuple(int(i) for i in index) for index in np.argwhere(entries)[:limit]]
    more = int(np.sum(entries)) - len(found)
    return ", ".join(map(str, found)) + (f" and {more} more" if more > 0 else "")
