"""The rules on which the frameworks' built-ins disagree in meaning, each measured on any module of the contract:
the rows of `python -m conformance frameworks` (docs/suite.md).

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

A rule is a probe: a few fixed cases (each operation's in PROBES) of the first operation the module has among
those the rule reads, run as they are (the module's declaration does not excuse anything here: a declared
deviation is measured like any other), and a verdict in a few words: "holds", or what the module does instead,
or why the rule does not apply ("no is_causal": an argument the module lacks). Every cell of the matrix comes
from a probe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..contract.cases import Case, MhaCase, SdpaCase, block_case, changed, mha_case, normal, random_mask, sdpa_case
from ..contract.features import Declaration
from ..contract.operations import OPERATIONS, missing
from ..contract.tolerances import TOLERANCES, relative_error, shown
from ..run import gradient_checks
from ..run.checks import Runner, expected, rounded

HOLDS = "holds"
DROPOUT = 0.5  # the probes' dropout in training mode


class Cell(NamedTuple):
    """One module's verdict on one rule."""

    holds: bool | None  # None: the rule does not apply to the module
    text: str  # "holds", the measured deviation in a few words, or why it does not apply


class Rule(NamedTuple):
    """One row of the matrix."""

    name: str
    spec: str  # what the spec says, in a few words
    operations: tuple[str, ...]  # the operations it can probe, in order of preference
    probe: Callable[[Runner, str], Cell]  # (runner, operation) -> the verdict


NanCase = tuple[str, Case, str, np.ndarray]  # what hides it, the case, what is NaN, the rows the spec leaves open


class Probes(NamedTuple):
    """The cases the rules probe one operation with: a rule can probe an operation that has an entry in PROBES,
    and no probe dispatches on the kind of a case."""

    masked_rows: Callable[[], Case]  # query 1 of batch element 0 sees no key, the other rows see some
    uniform: Callable[[Any], np.ndarray] | None  # the case -> its output where every query weighs every key
    # alike (what a module that ignores a fully masked row's mask gives); None: no such simple form
    weights: Callable[[], Case]  # a mask that hides some keys
    nan: Callable[[Runner], list[NanCase]]  # NaNs that some rows see and some do not
    float16: Callable[[], Case]  # a case whose float16 error shows where the work is done in float16


def measure(module: Any, rules: Sequence[Rule] | None = None) -> dict[str, Cell]:
    """{rule name: cell} of `module` for every rule (default: RULES)."""
    runner = Runner(module)
    lacks = runner.declaration
    runner.declaration = Declaration()  # the probes measure what the module does, declared or not
    cells = {}
    with runner.framework.pinned():
        for rule in RULES if rules is None else rules:
            operation = next((name for name in rule.operations
                              if not missing(module, (OPERATIONS[name].function,))), None)
            if operation is None:
                cells[rule.name] = Cell(None, "-")
                continue
            try:
                cells[rule.name] = _with_lacks(rule.probe, lacks)(runner, operation)
            except Exception as error:  # a probe's call raised: that is the measurement
                cells[rule.name] = Cell(False, f"raises {type(error).__name__}: {_first_line(error)}")
    return cells


class _Lacking(Exception):  # a probe needs a feature the module declares lacking
    pass


def _with_lacks(probe: Callable[[Runner, str], Cell], lacks: Declaration) -> Callable[[Runner, str], Cell]:
    """The probe, told which arguments the module lacks (it cannot be given them)."""
    def run(runner: Runner, operation: str) -> Cell:
        runner.lacks = lacks  # type: ignore[attr-defined]
        try:
            return probe(runner, operation)
        except _Lacking as lacking:
            return Cell(None, f"no {lacking}")
    return run


def _dtype(runner: Runner) -> str:
    """The probes' dtype: float64, or float32 for a module that lacks it (jax.nn, whose softmax runs in
    float32); the cases are rounded to it, and results held to the suite's values tolerance in it."""
    return "float32" if "float64" in runner.lacks else "float64"  # type: ignore[attr-defined]


def _needs(runner: Runner, *features: str) -> None:
    for feature in features:
        if feature in runner.lacks:  # type: ignore[attr-defined]
            raise _Lacking(feature)


def _first_line(error: Exception, width: int = 60) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return text if len(text) <= width else text[: width - 3] + "..."


# --- fully masked rows -----------------------------------------------------------------------------------

# Query 1 of batch element 0 sees no key; the other rows see some (modules: one mask for every head, which a
# module that takes one mask for all heads can be given)
def _masked_rows_sdpa() -> Case:
    return sdpa_case((2,), 3, 4, mask=changed(random_mask(2, 3, 4), (0, 1), False))


def _masked_rows_mha() -> Case:
    return mha_case((2,), 3, 5, mask=changed(random_mask(2, 1, 3, 5), (0, 0, 1), False))._replace(dropout=0.0)


def _masked_rows_block() -> Case:
    return block_case((2,), 4, mask=changed(random_mask(2, 1, 4, 4), (0, 0, 1), False))._replace(dropout=0.0)


def fully_masked_rows(runner: Runner, operation: str) -> Cell:
    """A query that sees no key: sdpa's out row is zeros, MHA's the output bias (the heads give zeros)."""
    _needs(runner, "mask")
    dtype = _dtype(runner)
    probes = PROBES[operation]
    case = rounded(probes.masked_rows(), dtype)
    want, uniform = expected(case)[0][0, 1], None if probes.uniform is None else probes.uniform(case)

    def verdict(out: np.ndarray) -> str:
        out = out[0, 1]
        if _close(out, want, dtype):
            return HOLDS
        if np.all(np.isnan(out)):
            return "NaN"
        if uniform is not None and _close(out, uniform[0, 1], dtype):
            return "the mean of all values (uniform weights)"
        return "finite, not zeros" if np.all(np.isfinite(out)) else "partly NaN"

    return _on_both_paths(runner, case, verdict)


def _on_both_paths(runner: Runner, case: Case, verdict: Callable[[np.ndarray], str]) -> Cell:
    """The verdict on the output with need_weights=True and False; both said where they differ (a module whose
    two paths are two kernels, nn.MultiheadAttention's)."""
    (out, _), (fast, _) = runner.run_both_paths(case, _dtype(runner))
    explicit, fused = verdict(out), verdict(fast)
    if explicit == fused:
        return Cell(explicit == HOLDS, explicit)
    return Cell(False, f"{explicit} with need_weights=True; {fused} without")


# The output where every query weighs every key alike (the mask ignored)
def _uniform_sdpa(case: SdpaCase) -> np.ndarray:
    """The mean of v, (..., L, Ev)."""
    return np.broadcast_to(case.v.mean(axis=-2, keepdims=True), (*case.v.shape[:-2], case.q.shape[-2],
                                                                   case.v.shape[-1]))


def _uniform_mha(case: MhaCase) -> np.ndarray:
    """The mean of each head's values, mixed by W_o, (..., L, D)."""
    state = case.state
    values = case.v @ state["w_v.weight"].T + state["w_v.bias"]  # (..., S, D): every head's columns
    mean = np.broadcast_to(values.mean(axis=-2, keepdims=True), (*values.shape[:-2], case.q.shape[-2],
                                                                values.shape[-1]))
    return mean @ state["w_o.weight"].T + state["w_o.bias"]  # (..., L, D)


# --- causal with L != S ----------------------------------------------------------------------------------

def causal_corner(runner: Runner, operation: str) -> Cell:
    """is_causal with more keys than queries and more queries than keys: top-left aligned (query i sees keys
    0..i), not bottom-right."""
    _needs(runner, "is_causal")
    found, dtype = [], _dtype(runner)
    for L, S in ((2, 5), (5, 3)):
        case = rounded(sdpa_case((2,), L, S, is_causal=True), dtype)
        out = runner.run(case, dtype, need_weights=False)[0]
        if _close(out, expected(case)[0], dtype):
            continue
        bottom_right = case._replace(q_offset=S - L, is_causal=True)
        found.append("bottom-right aligned" if _close(out, expected(bottom_right)[0], dtype) else
                     f"other values (L={L}, S={S})")
    return Cell(True, HOLDS) if not found else Cell(False, found[0])


def _close(a: np.ndarray, b: np.ndarray, dtype: str = "float64") -> bool:
    """The same shape, NaN in the same places, and the rest within the suite's values tolerance in `dtype`."""
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    return relative_error(np.where(np.isnan(a), 0, a).astype(np.float64), np.where(np.isnan(b), 0, b)) <= \
        TOLERANCES[dtype]["values"]


# --- the weights: before dropout, per head ---------------------------------------------------------------

def weights_before_dropout(runner: Runner, operation: str) -> Cell:
    """In training mode the returned weights are the softmax probabilities before dropout: those of eval mode
    (compared with the module's own eval weights, whatever their layout)."""
    _needs(runner, "dropout")
    dtype = _dtype(runner)
    case = rounded(PROBES[operation].weights()._replace(dropout=DROPOUT), dtype)
    trained = runner.run(case, dtype, training=True, seed=1)[1]
    if trained is None:
        return Cell(None, "no weights returned")
    evaluated = runner.run(case, dtype)[1]
    if evaluated is not None and _close(trained, evaluated, dtype):
        return Cell(True, HOLDS)
    return Cell(False, "after dropout" if evaluated is not None and trained.shape == evaluated.shape else
                "other values")


def weights_per_head(runner: Runner, operation: str) -> Cell:
    """A module returns one weights matrix per head, (..., H, L, S)."""
    dtype = _dtype(runner)
    case = rounded(PROBES[operation].weights(), dtype)
    weights, want = runner.run(case, dtype)[1], expected(case)[1]
    if weights is None:
        return Cell(None, "no weights returned")
    if _close(weights, want, dtype):
        return Cell(True, HOLDS)
    if weights.shape == want.shape[:-3] + want.shape[-2:] and _close(weights, want.mean(axis=-3), dtype):
        return Cell(False, "averaged over the heads")
    return Cell(False, f"other weights {weights.shape}")


# A mask that hides some keys; the modules return weights per head
def _weights_sdpa() -> Case:
    return sdpa_case((2,), 3, 4, mask=random_mask(2, 3, 4))


def _weights_mha() -> Case:
    return mha_case((2,), 3, 5, mask=random_mask(2, 1, 3, 5))


def _weights_block() -> Case:
    return block_case((2,), 4, mask=random_mask(2, 1, 4, 4))


# --- NaN propagation -------------------------------------------------------------------------------------

def nan_propagation(runner: Runner, operation: str) -> Cell:
    """A NaN reaches exactly the rows that see it: a NaN key makes the rows that see it NaN and leaves the rows
    that hide it (by the mask, by is_causal) finite; a NaN query makes its row NaN. Both paths."""
    _needs(runner, "mask")
    found: dict[str, list[str]] = {"need_weights=True": [], "need_weights=False": []}
    dtype = _dtype(runner)
    for what, case, rows, free in PROBES[operation].nan(runner):
        case = rounded(case, dtype)
        want = expected(case)[0]
        nan_rows = np.any(np.isnan(want), axis=-1)
        for path, (out, _) in zip(found, runner.run_both_paths(case, dtype), strict=True):
            out = np.where(free[..., None], want, out)  # rows the spec leaves open read as the oracle's
            got = np.any(np.isnan(out), axis=-1)
            if np.array_equal(got, nan_rows) and _close(np.where(nan_rows[..., None], 0, out),
                                                        np.where(nan_rows[..., None], 0, want), dtype):
                continue
            found[path].append(f"a NaN {what} reaches rows that hide it" if np.any(got & ~nan_rows) else
                               f"a NaN {rows} gives finite rows" if np.any(nan_rows & ~got) else
                               f"other values beside a NaN {what}")
    explicit, fused = ("; ".join(problems) for problems in found.values())
    if explicit == fused:
        return Cell(True, HOLDS) if not explicit else Cell(False, explicit)
    return Cell(False, f"{explicit or HOLDS} with need_weights=True; {fused or HOLDS} without")


def _nan_cases_sdpa(runner: Runner) -> list[NanCase]:
    """A NaN key hidden from query 0 by the mask, a NaN key hidden by is_causal (where the module has it), a NaN
    query; the values stay finite, so every row is specified."""
    mask = changed(np.ones((2, 3, 4), bool), (0, 0, 2), False)  # key 2 hidden from query 0 of sequence 0
    base, every = sdpa_case((2,), 3, 4, mask=mask), np.zeros((2, 3), bool)
    cases = [("key hidden by the mask", base._replace(k=changed(base.k, (0, 2), np.nan)), "key", every),
             ("query", base._replace(q=changed(base.q, (1, 0), np.nan)), "query", every)]
    if "is_causal" not in runner.lacks:  # type: ignore[attr-defined]
        causal = sdpa_case((2,), 4, 4, is_causal=True)  # key 3 seen by query 3 alone
        cases.insert(1, ("key hidden by is_causal", causal._replace(k=changed(causal.k, (0, 3), np.nan)), "key",
                         np.zeros((2, 4), bool)))
    return cases


def _nan_cases_mha(runner: Runner) -> list[NanCase]:
    """Cross-attention: a NaN in the keys' input at position 2, hidden from query 0 (the values' input stays
    finite); a NaN query input."""
    mask = changed(np.ones((2, 1, 3, 5), bool), (0, 0, 0, 2), False)  # key 2 hidden from query 0
    base, every = mha_case((2,), 3, 5, mask=mask)._replace(dropout=0.0), np.zeros((2, 3), bool)
    return [("key hidden by the mask", base._replace(k=changed(base.k, (0, 2), np.nan)), "key", every),
            ("query", base._replace(q=changed(base.q, (1, 0), np.nan)), "query", every)]


def _nan_cases_block(runner: Runner) -> list[NanCase]:
    """Self-attention: a NaN at position 2 of sequence 0, whose key the mask hides from query 0. Its value is NaN
    too, and a hidden key's value times its weight 0 is NaN: query 0's row is left open (SPEC 10); the rows that
    see position 2 must be NaN, the other sequence finite."""
    mask = changed(np.ones((2, 1, 4, 4), bool), (0, 0, 0, 2), False)
    base = block_case((2,), 4, mask=mask)._replace(dropout=0.0)
    return [("position", base._replace(x=changed(base.x, (0, 2), np.nan)), "position",
             changed(np.zeros((2, 4), bool), (0, 0), True))]


# --- float16 -----------------------------------------------------------------------------------------------

def float16_error(runner: Runner, operation: str) -> Cell:
    """The relative error in float16 against float64 on the same (rounded) inputs, within the suite's tolerance:
    the larger of TOLERANCES' and ten times what the oracle itself loses in float16."""
    _needs(runner, "float16")
    case = rounded(PROBES[operation].float16()._replace(dropout=0.0), "float16")
    out = runner.run(case, "float16", need_weights=False)[0]
    reference = expected(case)[0]
    error = relative_error(out.astype(np.float64), reference)
    allowed = max(TOLERANCES["float16"]["values"], 10 * relative_error(expected(case, "float16")[0], reference))
    if not error <= allowed:
        return Cell(False, "{}, above {}".format(*shown(error, allowed)))
    return Cell(True, f"{HOLDS}: {error:.1e}")


def _keys_sharing_a_vector() -> Case:
    """Every key adds one vector of entries about 300, so each query's scores share a term in the hundreds and
    differ by about one: float32 work keeps the differences, scores in float16 lose them (SPEC 2)."""
    case = sdpa_case((2, 2), 16, 16, E=8, Ev=8)
    return case._replace(k=case.k + 300 * normal(1, 1, 1, 8, seed=7))


# --- gradients ---------------------------------------------------------------------------------------------

def gradients(runner: Runner, operation: str) -> Cell:
    """The vjp's gradients against central differences of the oracle where every query sees a key, then exact
    zeros where no attention reaches (a query that sees no key, a key no query sees); float64."""
    if missing(runner.module, (OPERATIONS[operation].vjp,)):
        return Cell(None, "no vjp")
    _needs(runner, "mask", "float64")  # central differences in float64
    probes = PROBES[operation]
    for blind, case in enumerate((probes.weights(), probes.masked_rows())):
        measures = gradient_checks.gradients(runner, case, "float64")
        bad = [value.detail for name, value in measures.items() if not value.error <= TOLERANCES["float64"][name]]
        if bad and blind:  # right where every query sees a key: the query that sees none gives a gradient
            return Cell(False, "NaN from a query that sees no key" if "not finite" in bad[0] else
                        "a query that sees no key contributes gradient")
        if bad:
            return Cell(False, _briefly(bad[0]))
    return Cell(True, HOLDS)


def _briefly(detail: str) -> str:
    """A gradient check's failure in a few words: "dq is not finite", "dk differs from the oracle's", ..."""
    if ": <grad, u>" in detail:  # the directional derivative against the central difference
        return f"{detail.split(':')[0]} differs from the oracle's"
    return detail.split(", expected")[0]


PROBES: dict[str, Probes] = {
    "sdpa": Probes(masked_rows=_masked_rows_sdpa, uniform=_uniform_sdpa, weights=_weights_sdpa,
                   nan=_nan_cases_sdpa, float16=_keys_sharing_a_vector),
    "mha": Probes(masked_rows=_masked_rows_mha, uniform=_uniform_mha, weights=_weights_mha, nan=_nan_cases_mha,
                  float16=lambda: mha_case((2,), 16, 16, D=8, H=2)),
    "block": Probes(masked_rows=_masked_rows_block, uniform=None, weights=_weights_block, nan=_nan_cases_block,
                    float16=lambda: block_case((2,), 16, D=8, H=2, F=16)),
}
EVERY = tuple(PROBES)
RULES: tuple[Rule, ...] = (
    Rule("fully masked rows", spec="zeros", operations=EVERY, probe=fully_masked_rows),
    Rule("is_causal with L != S", spec="top-left aligned", operations=("sdpa",), probe=causal_corner),
    Rule("weights in training", spec="before dropout", operations=("mha", "block", "sdpa"),
         probe=weights_before_dropout),
    Rule("weights per head", spec="(..., H, L, S)", operations=("mha", "block"), probe=weights_per_head),
    Rule("NaN propagation", spec="to the rows that see it", operations=EVERY, probe=nan_propagation),
    Rule("float16 error", spec="float32 work", operations=EVERY, probe=float16_error),
    Rule("gradients", spec="= the oracle's; zeros where unseen", operations=EVERY, probe=gradients),
)
