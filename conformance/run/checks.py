"""The checks: each runs a module on one drawn case and returns named measures, errors that the suite
compares with the tolerances (conformance/contract/tolerances.py).

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

A measure is a relative error (`relative_error`), or inf with a reason when no number can be fair:
wrong shape, wrong dtype, NaN where the reference has a number (or the reverse). Every check works on any
operation of conformance/contract/operations.py; the metamorphic ones (permutation, causal prefix, single key)
are written for the operations they fit.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
from array_api_compat import array_namespace

from ..contract.cases import BlockCase, Case, LinearCase, MhaCase, SdpaCase, per_query_head
from ..contract.features import declaration_of
from ..contract.operations import Pair, Probe, arrays_and_options, missing, operation_of, per_head_lacks
from ..contract.tolerances import relative_error
from ..frameworks.registry import RngForm, framework_of

DROPOUT_DRAWS = 400  # independent dropout draws for the mean check
INDEPENDENT_P = 0.5  # the independence check's dropout: pairs dropped together at p^2 = 0.25, not p
INDEPENDENT_PAIRS = 2000  # at least this many pairs of decisions in each family it compares
LOW_PRECISION_FACTOR = 10  # a module may lose this many times what the oracle loses in the same dtype


class Measure(NamedTuple):
    error: float  # compared with the tolerance; inf when the result is wrong in kind, not degree
    detail: str = ""  # what was wrong, for the failure message
    tolerance: float = 0.0  # this case's own tolerance, where it is looser than TOLERANCES'
    skipped: str | None = None  # why the module cannot be measured so (its declaration, SPEC 11)


def skipped(why: str | None) -> Measure:
    """A measure the module's declaration rules out: its row is SKIP with `why`."""
    return Measure(0.0, skipped=why)


def compare(name: str, actual: np.ndarray | None, expected: np.ndarray, dtype: str) -> Measure:
    """`actual` against the reference: kind first (present, shape, dtype, NaN places), then the error."""
    if actual is None:
        return Measure(math.inf, f"{name} is None")
    if actual.shape != expected.shape:
        return Measure(math.inf, f"{name} has shape {actual.shape}, expected {expected.shape}")
    if actual.dtype != np.dtype(dtype):
        return Measure(math.inf, f"{name} has dtype {actual.dtype}, expected {dtype}")
    if np.any(np.isnan(actual) != np.isnan(expected)):
        return Measure(math.inf, f"{name} has NaN in other places than the reference")
    error = relative_error(actual, expected)
    return Measure(error, f"{name}: relative error {error:.2e}")


def worst(*measures: Measure) -> Measure:
    return max(measures, key=lambda m: m.error)


# --- running a module ------------------------------------------------------------------------------------

class ResultError(TypeError):
    """A module returned something the contract does not allow: not a pair (out, weights), or arrays that
    its own to_numpy cannot convert."""


class Runner:
    """Runs one module's operations on NumPy inputs and returns NumPy outputs.

    Each operation is staged once per set of static options (JAX: one jit function, traced once per
    shape), so repeated shapes cost no recompilation.
    """

    def __init__(self, module: ModuleType) -> None:
        self.module, self.framework = module, framework_of(module)
        # what it lacks of the contract (SPEC 11): declared, or read off its signatures (sinks and alibi_slopes off
        # each operation's function that takes them)
        self.declaration = per_head_lacks(module) | declaration_of(module)
        self._staged: dict[tuple, Callable] = {}

    def run(self, case: Case, dtype: str, *, training: bool = False, seed: int | None = None,
            need_weights: bool = True, rng_form: RngForm | None = None) -> Pair:
        """The module's (out, weights) for `case` in `dtype`: in eval mode, or in training mode with the
        case's dropout and the framework's rng for `seed` (in `rng_form`, by default its usual one)."""
        operation = operation_of(case)
        arrays, options = arrays_and_options(case)
        return _pair(operation.function, operation.pair(self.call(
            operation.call, arrays, dtype, seed, training=training, need_weights=need_weights, rng_form=rng_form,
            **options)))

    def run_both_paths(self, case: Case, dtype: str, *, training: bool = False, seed: int | None = None,
                       rng_form: RngForm | None = None) -> tuple[Pair, Pair]:
        """The module's (out, weights) for `case` with need_weights=True and with False, from one staged call
        (JAX: one compile for both paths); eval mode, or training mode as for `run` (one rng for both calls:
        the same key, or a generator that the first call advances)."""
        operation = operation_of(case)
        arrays, options = arrays_and_options(case)
        explicit, fast = self.call(_both_paths, arrays, dtype, seed, call=operation.call, training=training,
                                   rng_form=rng_form, **options)
        return (_pair(operation.function, operation.pair(explicit)),
                _pair(operation.function, operation.pair(fast)))

    def call(self, function: Callable, arrays: dict[str, Any], dtype: str | None, seed: int | None, *,
             eager: bool = False, rng_form: RngForm | None = None, **options: Any) -> Any:
        """`function(module, native arrays, rng, **options)`, staged once per function and options (JAX: one
        jit function); the results as NumPy arrays. `run` goes through it, and a check may pass its own
        function the same way (an operation's pullback, say).

        arrays: NumPy arrays, None or nested state dicts (the floating ones cast to `dtype`; None keeps every
        dtype); seed: the framework's rng for `function`, or None; eager: call it as it is, unstaged (the
        error table: a check on values, such as a float mask's 0 / 1, cannot run inside jit); rng_form: the
        form of that rng (SPEC.md section 6), by default the framework's usual one; options: static and
        hashable.
        """
        native, form = self._native(cast(arrays, dtype)), rng_form or self.framework.rngs[0]
        with contextlib.nullcontext() if seed is None else form.given(seed) as rng:
            if eager:
                results = function(self.module, native, rng, **options)
            else:
                key = (function, tuple(sorted(options.items())))
                if key not in self._staged:
                    self._staged[key] = self.framework.stage(functools.partial(function, self.module, **options))
                results = self._staged[key](native, rng)
        results = self._numpy(results)
        if changed := self._changed(cast(arrays, dtype), native):  # what was sent, cast afresh: the copies
            # sent may share memory with the native arrays
            raise ResultError(f"the call changed its inputs in place: {', '.join(changed)}")
        return results

    def _changed(self, sent: Mapping[str, Any], native: Mapping[str, Any], prefix: str = "") -> list[str]:
        """The inputs (state-dict entries by name) whose native array no longer holds, bit for bit, what was
        sent: a module must not write into the caller's arrays."""
        changed = []
        for name, x in sent.items():
            if isinstance(x, Mapping):
                changed += self._changed(x, native[name], f"{prefix}{name}.")
            elif isinstance(x, np.ndarray):
                after = self._numpy(native[name])
                if after.shape != x.shape or after.dtype != x.dtype or after.tobytes() != x.tobytes():
                    changed.append(f"{prefix}{name}")
        return changed

    def _native(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        return {name: self._native(x) if isinstance(x, Mapping) else None if x is None else self.module.asarray(x)
                for name, x in arrays.items()}

    def _numpy(self, results: Any) -> Any:
        """Tuples, lists and dicts of the module's arrays, as the same structure of NumPy arrays."""
        if isinstance(results, tuple | list):
            return type(results)(self._numpy(x) for x in results)
        if isinstance(results, Mapping):
            return {name: self._numpy(x) for name, x in results.items()}
        if results is None:
            return None
        try:
            converted = self.module.to_numpy(results)
        except Exception as error:
            raise ResultError(f"to_numpy cannot convert the {type(results).__name__} the module returned: "
                              f"{type(error).__name__}: {error}") from error
        if not isinstance(converted, np.ndarray):
            raise ResultError(f"to_numpy gave a {type(converted).__name__}, not a NumPy array")
        return converted


def _both_paths(module: ModuleType, arrays: dict, rng: Any, *, call: Callable, training: bool, **options: Any) -> tuple:
    return (call(module, arrays, rng, training=training, need_weights=True, **options),
            call(module, arrays, rng, training=training, need_weights=False, **options))


def _pair(operation: str, result: Any) -> Pair:
    """The (out, weights) an operation must return, else a ResultError saying what came back."""
    if not isinstance(result, tuple | list) or len(result) != 2:
        got = f"a {len(result)}-{type(result).__name__}" if isinstance(result, tuple | list) else \
            f"a {type(result).__name__}"
        raise ResultError(f"{operation} returned {got}, expected a pair (out, weights)")
    return tuple(result)


def cast(arrays: Mapping[str, Any], dtype: str | None) -> dict[str, Any]:
    """Copies: floating arrays (also inside nested state dicts) in `dtype` (None: their own), masks in their
    own dtype, so a module that writes into its inputs cannot change the case the oracle sees; None and the
    rest as given."""
    def one(x: Any) -> Any:
        if isinstance(x, Mapping):
            return cast(x, dtype)
        if isinstance(x, np.ndarray):
            floating = np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16"  # ml_dtypes': not np.floating
            return x.astype(dtype) if dtype is not None and floating else x.copy()
        return x
    return {name: one(x) for name, x in arrays.items()}


def rounded(case: Case, dtype: str) -> Case:
    """The case with its floating arrays rounded to `dtype` and back to float64: the oracle then sees
    exactly the numbers the module sees, so only the module's arithmetic is measured."""
    return type(case)(**cast(cast(case._asdict(), dtype), "float64"))


# --- against the oracle -------------------------------------------------------------------------------------

def expected(case: Case, precision: str = "float64", *, fused_bias: bool = True) -> Pair:
    """The oracle's (out, weights) for `case` in eval mode, computed in `precision` (conformance/contract/oracle.py
    says how it rounds in half precision, and what fused_bias changes there)."""
    return operation_of(case).oracle(case, precision, fused_bias)


def specified(runner: Runner, case: Case, pair: Pair) -> Pair:
    """(out, weights) with what the module's declaration leaves unspecified taken out (SPEC 11): the rows of
    queries that see no key set to 0 where it lacks masked_rows, the weights None where it lacks weights.
    Applied to the module's result and the reference alike; a result of the wrong shape is left as it is."""
    out, weights = pair
    rows = operation_of(case).blind(case) if "masked_rows" in runner.declaration else None
    if "weights" in runner.declaration:
        weights = None
    return (out, weights) if rows is None else (_zeroed(out, rows[0]), _zeroed(weights, rows[1]))


def _zeroed(x: np.ndarray | None, rows: np.ndarray) -> np.ndarray | None:
    """x (draws..., rows, n) with the rows where `rows` is True set to 0, in x's dtype (leading axes of x beyond
    those of rows, such as dropout's draws, share them)."""
    if x is None or x.shape[:-1][x.ndim - 1 - rows.ndim:] != rows.shape:
        return x
    return np.where(rows[..., None], np.zeros((), x.dtype), x)


def against_oracle(runner: Runner, case: Case, dtype: str) -> dict[str, Measure]:
    """values: out and weights against the oracle (dropout configured but off in eval mode); below float64
    the case may lose LOW_PRECISION_FACTOR times what the oracle itself loses in that dtype, as inputs of
    large logits or small variance are ill-conditioned for any correct low-precision computation;
    fast_path: with need_weights=False (where an implementation may take a fused path) the same out
    against the oracle, and None for the weights;
    weights_rows: each weights row sums to 1 where a key is visible, to 0 where none is; with sinks (SPEC 2h) to
    the oracle's sum, 1 less the sink's share (a module's sinks, whose share rides on the projected logits, held
    to the values' low-precision tolerance where it is looser: the oracle loses as much rounding them).
    A case that forms no weights (the oracle's are None: MultiHeadAttention's linear heads) must return None for
    them on both paths (values), and has no weights_rows measure.
    What the module's declaration leaves unspecified is not compared (`specified`)."""
    case = rounded(case, dtype)
    explicit, fast_pair = runner.run_both_paths(case, dtype)
    reference = expected(case)
    tolerance = _low_precision_tolerance(case, dtype, reference)
    (out, weights), (fast_out, fast_weights), (expected_out, expected_weights) = (
        specified(runner, case, pair) for pair in (explicit, fast_pair, reference))
    values = compare("out", out, expected_out, dtype)
    if expected_weights is not None:
        values = worst(values, compare("weights", weights, expected_weights, dtype))
    elif weights is not None:  # not left out by the declaration: the case forms none
        values = Measure(math.inf, f"weights {weights.shape} returned where the case forms none (None)")
    values = values._replace(tolerance=tolerance)
    fast = compare("out with need_weights=False", fast_out, expected_out, dtype)._replace(tolerance=tolerance)
    if fast_weights is not None:
        fast = Measure(math.inf, "need_weights=False returned weights, not None")
    if expected_weights is None:  # left out by the declaration (SKIP), or formed by no path of this case
        why = runner.declaration.reason("weights")
        return {"values": values, "fast_path": fast} | ({"weights_rows": skipped(why)} if why else {})
    if weights is None or weights.shape != expected_weights.shape:
        return {"values": values, "fast_path": fast, "weights_rows": values}
    row_sums, expected_sums = (w.sum(axis=-1, dtype=np.float64) for w in (weights, expected_weights))
    sunk = getattr(case, "sinks", None) is not None or "sinks" in (getattr(case, "state", None) or {})  # mha's
    if not sunk:  # visible rows sum to exactly 1 in exact arithmetic
        expected_sums = np.where(expected_sums > 0, 1.0, 0.0)
    rows = Measure(float(np.max(np.abs(row_sums - expected_sums), initial=0.0)), "weights rows do not sum to 1",
                   tolerance=tolerance if "sinks" in (getattr(case, "state", None) or {}) else 0.0)
    return {"values": values, "fast_path": fast, "weights_rows": rows}


def tiled_against_oracle(runner: Runner, case: Case, dtype: str) -> dict[str, Measure]:
    """values: flash_attention's out against the oracle's attention, as against_oracle's (below float64 to
    LOW_PRECISION_FACTOR times what the oracle loses);
    lse: its log-sum-exp per query against the oracle's, in the dtype the scores are computed in (float32 for
    float16 and bfloat16 inputs), -inf exactly where a query sees no key.
    What the module's declaration leaves unspecified is not compared (`specified`)."""
    case = rounded(case, dtype)
    reference = expected(case)
    tolerance = _low_precision_tolerance(case, dtype, reference)
    (out, lse), (expected_out, expected_lse) = (specified(runner, case, pair)
                                                for pair in (runner.run(case, dtype), reference))
    work = "float64" if dtype == "float64" else "float32"  # the scores' dtype (SPEC 2)
    return {"values": compare("out", out, expected_out, dtype)._replace(tolerance=tolerance),
            "lse": compare("lse", lse, expected_lse.astype(work), work)}


def out_against_oracle(runner: Runner, case: Case, dtype: str) -> dict[str, Measure]:
    """values: the out of an operation that returns out alone (linear_attention) against the oracle's, as
    against_oracle's (below float64 to LOW_PRECISION_FACTOR times what the oracle loses in that dtype); the call
    has one path, and nothing but out to compare.
    What the module's declaration leaves unspecified is not compared (`specified`)."""
    case = rounded(case, dtype)
    reference = expected(case)
    tolerance = _low_precision_tolerance(case, dtype, reference)
    (out, _), (expected_out, _) = (specified(runner, case, pair) for pair in (runner.run(case, dtype), reference))
    return {"values": compare("out", out, expected_out, dtype)._replace(tolerance=tolerance)}


def linear_roundings(dtype: str) -> tuple[bool, ...]:
    """The oracle's `fused_bias` values a conformant module's Linear may round as in `dtype`: once (torch's addmm)
    or the product and then the sum (NumPy's and XLA's half-precision matmul and add); float32 and float64 round
    both ways alike, so one is enough there."""
    return (True, False) if np.dtype(dtype).itemsize < 4 else (True,)


def _low_precision_tolerance(case: Case, dtype: str, reference: Pair) -> float:
    """LOW_PRECISION_FACTOR times what the oracle itself loses computing `case` in `dtype` (0 in float64); in
    float16 and bfloat16 the larger loss of its two ways to round a Linear, both conformant."""
    if dtype == "float64":
        return 0.0
    return LOW_PRECISION_FACTOR * max(relative_error(a, b) for fused_bias in linear_roundings(dtype)
                                      for a, b in zip(expected(case, dtype, fused_bias=fused_bias), reference,
                                                      strict=True) if b is not None)  # out alone: no second


# --- metamorphic: properties that need no oracle ------------------------------------------------------------

def sdpa_permutation(runner: Runner, case: SdpaCase, dtype: str) -> dict[str, Measure]:
    """Permuting the keys together with their values, mask columns and bias columns leaves the output
    unchanged and permutes the weights' columns alike."""
    S = case.k.shape[-2]
    perm = np.random.default_rng(S).permutation(S)
    permuted = case._replace(k=case.k[..., perm, :], v=case.v[..., perm, :],
                             mask=_permute_last(case.mask, perm), bias=_permute_last(case.bias, perm))
    out, weights = specified(runner, case, runner.run(case, dtype))
    out_p, weights_p = specified(runner, permuted, runner.run(permuted, dtype))
    found = compare("out", out_p, out, dtype)
    if "weights" in runner.declaration:
        return {"permutation": found}
    weights_back = None if weights_p is None else weights_p[..., np.argsort(perm)]
    return {"permutation": worst(found, compare("weights", weights_back, weights, dtype))}


def mha_permutation(runner: Runner, case: MhaCase, dtype: str) -> dict[str, Measure]:
    """Cross-attention: permuting the key/value positions (and the mask's key axis) leaves the output
    unchanged."""
    S = case.k.shape[-2]
    perm = np.random.default_rng(S).permutation(S)
    permuted = case._replace(k=case.k[..., perm, :], v=case.v[..., perm, :], mask=_permute_last(case.mask, perm))
    out, _ = runner.run(case, dtype)
    out_p, _ = runner.run(permuted, dtype)
    return {"permutation": compare("out", out_p, out, dtype)}


def block_permutation(runner: Runner, case: BlockCase, dtype: str) -> dict[str, Measure]:
    """Self-attention is equivariant: permuting the positions of x (and both position axes of the mask)
    permutes the output rows alike."""
    L = case.x.shape[-2]
    perm = np.random.default_rng(L).permutation(L)
    mask = None if case.mask is None else _permute_last(_permute_last(case.mask, perm, axis=-2), perm)
    out, _ = runner.run(case, dtype)
    out_p, _ = runner.run(case._replace(x=case.x[..., perm, :], mask=mask), dtype)
    return {"permutation": compare("out", out_p, out[..., perm, :], dtype)}


def _permute_last(x: np.ndarray | None, perm: np.ndarray, axis: int = -1) -> np.ndarray | None:
    """x with `perm` applied along `axis`, unless that axis is broadcast (size 1) or x is None."""
    if x is None or x.ndim < -axis or x.shape[axis] == 1:
        return x
    return np.take(x, perm, axis=axis)


def sdpa_causal_prefix(runner: Runner, case: SdpaCase, dtype: str) -> dict[str, Measure]:
    """With is_causal, output rows 0..t ignore the queries after t and the keys and values after t."""
    L, S = case.q.shape[-2], case.k.shape[-2]
    t = min(L, S) // 2
    noise = np.random.default_rng(t)
    later = case._replace(q=_perturb_after(case.q, t, noise), k=_perturb_after(case.k, t, noise),
                          v=_perturb_after(case.v, t, noise))
    out, _ = specified(runner, case, runner.run(case, dtype))
    out_later, _ = specified(runner, later, runner.run(later, dtype))
    return {"causal_prefix": compare("out rows 0..t", out_later[..., : t + 1, :], out[..., : t + 1, :], dtype)}


def block_causal_prefix(runner: Runner, case: BlockCase, dtype: str) -> dict[str, Measure]:
    """With a causal mask, output rows 0..t of the block ignore the inputs after t."""
    t = case.x.shape[-2] // 2
    later = case._replace(x=_perturb_after(case.x, t, np.random.default_rng(t)))
    out, _ = specified(runner, case, runner.run(case, dtype))
    out_later, _ = specified(runner, later, runner.run(later, dtype))
    return {"causal_prefix": compare("out rows 0..t", out_later[..., : t + 1, :], out[..., : t + 1, :], dtype)}


def _perturb_after(x: np.ndarray, t: int, rng: np.random.Generator) -> np.ndarray:
    """x with fresh values in the rows after t (axis -2)."""
    x = x.copy()
    x[..., t + 1:, :] = rng.standard_normal(x[..., t + 1:, :].shape)
    return x


def sdpa_single_key(runner: Runner, case: SdpaCase, dtype: str) -> dict[str, Measure]:
    """A query that sees exactly one key returns that key's value; one that sees none returns zeros (unless the
    module lacks masked_rows)."""
    case = rounded(case, dtype)
    out, _ = runner.run(case, dtype)
    visible = operation_of(case).visible(case)  # (..., L, S)
    counts = visible.sum(axis=-1, keepdims=True)  # (..., L, 1)
    picked = np.where(counts == 1, visible, False).astype(np.float64) @ per_query_head(case)[1]  # (..., L, Ev)
    checked = np.broadcast_to((counts == 1) | ((counts == 0) & ("masked_rows" not in runner.declaration)),
                              picked.shape)
    actual = np.where(checked, out, 0.0) if out.shape == picked.shape else out
    return {"single_key": compare("out", actual.astype(dtype, copy=False), np.where(checked, picked, 0.0), dtype)}


STEP_FUNCTIONS = ("linear_attention_state", "linear_attention_step")  # the recurrent form of SPEC 2e


def linear_steps(runner: Runner, case: LinearCase, dtype: str) -> dict[str, Measure]:
    """steps: linear_attention_state, then linear_attention_step at positions 0, 1, .., L - 1 (the state in the
    inputs' dtype), gives the causal forward's outputs: each out_t against the oracle's causal out row t, as
    `values` (below float64 to LOW_PRECISION_FACTOR times what the oracle loses); under the case's update rule,
    each step given its position's decay and beta (the oracle's recurrence, ONNX's). The recurrent form takes no
    key lengths; a module without the two functions is SKIP.
    state_kept: the state each step is given holds after the call, bit for bit, what a copy taken before it holds
    (SPEC 2e: the state passed in never changes; a step that adds key t into it in place gives the right out_t
    and loses the caller's state). JAX's arrays cannot change, so there it holds by construction."""
    if absent := missing(runner.module, STEP_FUNCTIONS):
        why = f"no {absent[0]}"
        return {"steps": skipped(why), "state_kept": skipped(why)}
    case = rounded(case._replace(is_causal=True, key_lengths=None, chunk=None), dtype)
    reference = expected(case)
    tolerance = _low_precision_tolerance(case, dtype, reference)
    # one staged call (JAX: one compile) per case: the outputs, and each step's state as copied before the step and
    # as it is after it
    outs, copies, given = runner.call(_stepped, {"q": case.q, "k": case.k, "v": case.v, "decay": case.decay,
                                                 "beta": case.beta}, dtype, None, feature_map=case.feature_map,
                                      eps=case.eps, update_rule=case.update_rule)
    out = np.stack(outs, axis=-2) if outs else None  # L x (..., Ev) -> (..., L, Ev)
    (out, _), (expected_out, _) = (specified(runner, case, pair) for pair in ((out, None), reference))
    return {"steps": compare("stepped out", out, expected_out, dtype)._replace(tolerance=tolerance),
            "state_kept": _state_kept(copies, given)}


def _stepped(module: ModuleType, arrays: dict, rng: Any, *, feature_map: str, eps: float,
             update_rule: str) -> tuple[list, list, list]:
    """out_t for t = 0 .. L - 1 from the recurrent form, the state starting at zeros in q's dtype; and for each
    step a copy of the state it is given, taken before the call, and that state itself, as it is after the call.
    update_rule, decay_t and beta_t are passed only under a rule other than "linear" (state (S, None))."""
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    gates = {name: arrays[name] for name in ("decay", "beta") if arrays[name] is not None}  # (..., L, 1 or E)
    batch = np.broadcast_shapes(*(tuple(x.shape[:-2]) for x in (q, k, v, *gates.values())))  # (...)
    rule = {} if update_rule == "linear" else {"update_rule": update_rule}
    state = module.linear_attention_state(batch, q.shape[-1], v.shape[-1], dtype=q.dtype, **rule)  # S, z or None
    outs, copies, given = [], [], []
    for t in range(q.shape[-2]):  # a Python loop: the sequences are short, so JAX traces it once, unrolled
        copies.append([None if x is None else array_namespace(x).asarray(x, copy=True)  # the state's framework
                       for x in state])
        given.append(list(state))
        at_t = {name: x[..., t, :] for name, x in gates.items()}  # decay_t (..., 1 or E), beta_t (..., 1)
        out_t, state = module.linear_attention_step(q[..., t, :], k[..., t, :], v[..., t, :], state,
                                                    feature_map=feature_map, eps=eps, **rule, **at_t)  # (..., Ev)
        outs.append(out_t)
    return outs, copies, given


def _state_kept(copies: list[list[np.ndarray]], given: list[list[np.ndarray]]) -> Measure:
    """0 where every state given to a step holds after it the bits its copy holds; inf naming the first step and
    array that changed."""
    for t, (before, after) in enumerate(zip(copies, given, strict=True)):
        for name, x, y in zip(("S", "z"), before, after, strict=True):  # SPEC 2e's pair (S, z), or (S, None)
            if x is None and y is None:
                continue
            if x is None or y is None or y.shape != x.shape or y.dtype != x.dtype or y.tobytes() != x.tobytes():
                return Measure(math.inf, f"linear_attention_step at position {t} changed the state it was given "
                                         f"in place ({name})")
    return Measure(0.0)


# --- dropout in training mode -------------------------------------------------------------------------------

def dropout(runner: Runner, case: Case, dtype: str) -> dict[str, Measure]:
    """Dropout in training mode (every operation with dropout 0.5), on the case repeated DROPOUT_DRAWS times
    along a new leading axis, so one call holds many independent draws; reproducible, varies and mean hold
    on both paths (need_weights True and False), each measure the worse of the two, with the framework's
    usual form of rng (the other forms: dropout_independence):

    weights: the returned weights are the softmax probabilities before dropout (the eval weights);
    reproducible: the same rng (the same seed) gives the same output;
    varies: another seed gives another output (unless dropout has nothing to act on: all-zero output);
    mean (where the output is linear in the dropped weights: the operation declares dropout_sigma): the
    mean over the draws approaches the eval output. Each entry's mean has standard deviation
    sigma = sqrt(p / (1 - p) sum_j (w_j v_j)^2 / N) (for MHA per head, then through |W_o|); the measure is
    max |mean - eval| / (6 sigma + rounding), and above 1 fails, which a correct implementation reaches
    with probability below 1e-8 per entry.
    """
    operation = operation_of(case)
    case = rounded(case._replace(dropout=0.5), dtype)
    draws = _tiled(case, DROPOUT_DRAWS)
    expected_out, expected_weights = expected(case)
    spread = (None if operation.dropout_sigma is None else
              operation.dropout_sigma(case, expected_weights, 0.5, DROPOUT_DRAWS))
    shows = operation.dropout_shows(case) and (spread is None or bool(np.any(spread > 0)))
    runs = [runner.run_both_paths(draws, dtype, training=True, seed=seed) for seed in (1, 1, 2)]
    weights, measures = runs[0][0][1], {}  # returned with need_weights=True
    for path, ((first, _), (again, _), (other, _)) in enumerate(zip(*runs, strict=True)):  # a fused path
        # (need_weights=False) may not skip dropout
        said = "" if path == 0 else " with need_weights=False"
        found = {"reproducible": Measure(0.0) if np.array_equal(first, again, equal_nan=True)
                 else Measure(math.inf, f"the same rng gave different outputs{said}"),
                 "varies": Measure(0.0) if not np.array_equal(first, other) or not shows
                 else Measure(math.inf, f"another seed gave the same output{said}")}
        if spread is not None:  # not the block: LayerNorm and the activation follow dropout
            mean = first.astype(np.float64).mean(axis=0) if first.shape[1:] == expected_out.shape else first
            found["mean"] = _dropout_mean(specified(runner, case, (mean, None))[0],
                                          specified(runner, case, (expected_out, None))[0], spread, dtype, said)
        measures |= {name: worst(measure, measures.get(name, Measure(0.0))) for name, measure in found.items()}
    tolerance = _low_precision_tolerance(case, dtype, (expected_out, expected_weights))
    if "weights" in runner.declaration:
        return {"weights": skipped(runner.declaration.reason("weights"))} | measures
    expected_draws = np.broadcast_to(expected_weights, (DROPOUT_DRAWS, *expected_weights.shape))
    (_, weights), (_, expected_draws) = (specified(runner, case, (None, x)) for x in (weights, expected_draws))
    before = compare("weights in training mode", weights, expected_draws, dtype)
    return {"weights": before._replace(tolerance=tolerance)} | measures


def _dropout_mean(mean: np.ndarray, expected_out: np.ndarray, spread: np.ndarray, dtype: str, path: str) -> Measure:
    """max |mean of the draws - eval| in units of its 6-sigma bound (plus rounding)."""
    rounding = 10 * np.finfo(dtype).eps * np.max(np.abs(expected_out), initial=1.0)
    ratio = (float(np.max(np.abs(mean - expected_out) / (6 * spread + rounding), initial=0.0))
             if mean.shape == expected_out.shape else math.inf)
    return Measure(ratio, f"the mean of {DROPOUT_DRAWS} draws{path} is {ratio:.1f} x its 6-sigma bound off")


def dropout_independence(runner: Runner, case: Case, dtype: str) -> dict[str, Measure]:
    """Every keep / drop decision of dropout is drawn independently of the others, with every form of rng
    the framework allows, on both paths. The operation's probe (Operation.dropout_probe) keeps the case's
    sizes and chooses values whose output shows each site's decisions exactly (the block's shows some of
    its inner sites' decisions: those its residual sites keep); it runs with dropout INDEPENDENT_P, repeated
    along a new leading axis so that every family below holds about INDEPENDENT_PAIRS pairs or more.

    independent: along each axis of a site's decisions (the draws, each batch axis, the heads, queries,
    keys or features), disjoint pairs of entries (0 and 1, 2 and 3, ...) are both dropped at rate p^2, and
    so are the same entries of two sites (the block's four: attention weights, the attention branch, the
    activation, the feed-forward branch); each site drops at rate p. The same entries of two sites are those
    at the same place in the order each draws its decisions in one call (C order of the call's whole array,
    the first min(n_1, n_2)): where two sites replay one stream of randomness, those are the ones that
    coincide. Only decisions the output shows are compared, and a residual decision that shows or hides an
    inner site's (Site.shown_through) is not compared with that site. Over M pairs (or entries) the rate has
    sigma = sqrt(e (1 - e) / M), e its expectation; the measure is max |rate - e| / (6 sigma), and above 1
    fails, which a correct implementation reaches with probability below 3e-9 per family. A mask shared by
    two heads, or two sites that replay one stream, drop together at rate p: at least four times the bound.
    rng_forms: with every form of rng the framework allows (SPEC.md section 6: an int seed besides a
    Generator, a raw key besides a typed one), the same seed reproduces the probe's output bit for bit and
    another seed changes it (each draw shows thousands of decisions, so a correct one repeats them all
    with chance about 2^-3000).
    """
    probe = operation_of(case).dropout_probe(case, runner.declaration)
    per_call = probe.per_call or min(math.prod(site.shape) for site in probe.sites.values())
    n = 2 * math.ceil(1.5 * INDEPENDENT_PAIRS / per_call)  # >= 3 INDEPENDENT_PAIRS decisions per family
    draws = _tiled(probe.case._replace(dropout=INDEPENDENT_P), n)
    found, forms = Measure(0.0), Measure(0.0)
    for form in runner.framework.rngs:
        runs = [runner.run_both_paths(draws, dtype, training=True, seed=seed, rng_form=form) for seed in (1, 1, 2)]
        for path, ((out, _), (again, _), (other, _)) in enumerate(zip(*runs, strict=True)):
            said = f" with {form.name}" + ("" if path == 0 else " and need_weights=False")
            decisions = probe.decisions(out.astype(np.float64), INDEPENDENT_P) if out.shape[:1] == (n,) else None
            if decisions is None or {site: np.shape(x) for site, x in decisions.items()} != \
                    {name: (n, *site.shape) for name, site in probe.sites.items()}:
                wrong = Measure(math.inf, f"the probe's output{said} is not what dropout's keep / drop decisions "
                                          "give (conformance/contract/operations.py)")
                return {"independent": wrong, "rng_forms": wrong}
            decisions = {site: np.asarray(x, dtype=np.float64) for site, x in decisions.items()}
            found = worst(found, *(_rate(*rate, said) for rate in _drop_rates(decisions, probe, INDEPENDENT_P)))
            if not np.array_equal(out, again, equal_nan=True):
                forms = worst(forms, Measure(math.inf, f"the same seed gave different outputs{said}"))
            elif np.array_equal(out, other):
                forms = worst(forms, Measure(math.inf, f"another seed gave the same output{said}"))
    return {"independent": found, "rng_forms": forms}


def _drop_rates(decisions: dict[str, np.ndarray], probe: Probe, p: float) -> list[tuple[str, float, float, int]]:
    """(what, rate, expected rate, count): each site's drop rate, the rate at which the disjoint pairs along
    each of its axes are both dropped, and the rate at which two sites both drop the same entry (the same place
    in the order drawn), over the decisions shown (1 dropped, 0 kept, NaN not shown). A family with no pair
    shown (the block's weights along the queries or keys: only the diagonal shows) is left out."""
    rates = [(f"{site} dropped", float(np.nanmean(dropped)), p, int(np.sum(~np.isnan(dropped))))
             for site, dropped in decisions.items()]
    for site, dropped in decisions.items():
        shape = probe.sites[site].shape
        names = ("draws", *(f"batch axis {i}" for i in range(len(shape) - len(probe.sites[site].axes))),
                 *probe.sites[site].axes)
        for axis, name in enumerate(names):
            m = dropped.shape[axis]
            even, odd = (np.take(dropped, range(start, m - 1 + start, 2), axis=axis) for start in (0, 1))
            rates.append((f"{site}, pairs along the {name}, both dropped", *_both(even, odd, p)))
    for (one, a), (other, b) in itertools.combinations(decisions.items(), 2):
        m = min(a.size, b.size)
        deciding = _deciding(probe, one, other, a.shape).reshape(-1)[:m] | \
            _deciding(probe, other, one, b.shape).reshape(-1)[:m]
        a, b = (np.where(deciding, np.nan, x.reshape(-1)[:m]) for x in (a, b))
        rates.append((f"{one} and {other} both dropped", *_both(a, b, p)))
    return [rate for rate in rates if rate[3] > 0]


def _both(a: np.ndarray, b: np.ndarray, p: float) -> tuple[float, float, int]:
    """(rate, p^2, count): the rate at which a and b are both dropped where both are shown."""
    shown = ~np.isnan(a) & ~np.isnan(b)
    count = int(np.sum(shown))
    return (float(np.mean((a[shown] == 1) & (b[shown] == 1))) if count else 0.0), p * p, count


def _deciding(probe: Probe, site: str, other: str, shape: tuple[int, ...]) -> np.ndarray:
    """True at the decisions of `site` (shape (draws, ...)) that show or hide those of `other`."""
    through = probe.sites[other].shown_through
    if through is None or through[0] != site:
        return np.zeros(shape, dtype=bool)
    return np.broadcast_to(through[1], shape)


def _rate(what: str, rate: float, expected_rate: float, count: int, path: str) -> Measure:
    """|rate - expected| in units of its 6-sigma bound."""
    bound = 6 * math.sqrt(expected_rate * (1 - expected_rate) / count)
    ratio = abs(rate - expected_rate) / bound
    return Measure(ratio, f"{what}{path}: rate {rate:.3f} over {count}, expected {expected_rate:.3f} +- {bound:.3f} "
                          f"(6 sigma)")


def _tiled(case: Case, n: int) -> Case:
    """The case with its inputs repeated n times along a new leading axis (masks broadcast over it); each
    input keeps its own leading axes (k and v their Hkv heads with enable_gqa), at the rank of the largest."""
    inputs = {name: getattr(case, name) for name in operation_of(case).inputs}
    rank = max(x.ndim for x in inputs.values())
    return case._replace(**{name: np.broadcast_to(x, (n, *(1,) * (rank - x.ndim), *x.shape)).copy()
                            for name, x in inputs.items()})
