"""Gradient checks: a module's vector-Jacobian products against central finite differences of the float64
oracle, and the spec's zero-gradient rules.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

A module offers gradients through the contract's interface: `scaled_dot_product_attention_vjp` and the
modules' `vjp` methods, each returning (out, weights, pullback), and the other operations' vjps
(`flex_attention_vjp`'s pullback also gives its score function's parameters' gradients, d_score_mod, each held
to the oracle as an input is). A module without them is reported as not checked, never as failing.

Below float64 (`gradients_low_precision`) a module's gradients are held to the oracle's own vjp
(conformance/contract/oracle_gradients.py) in float64, to a multiple of what the same vjp loses computed plainly
in the dtype, as FlashAttention's tests hold dq, dk and dv.
"""

from __future__ import annotations

import math

import numpy as np

from ..contract.cases import Case
from ..contract.operations import arrays_and_options, operation_of
from ..contract.tolerances import TOLERANCES, relative_error
from .checks import Measure, Runner, cast, expected, linear_roundings, rounded, skipped, specified

STEP = 1e-6  # central differences: truncation ~ STEP^2 f''', rounding ~ eps |f| / STEP
RELATIVE = 1e-6  # the directional derivative's accepted relative error
DIFFERENCE_FACTOR = 10  # times the central difference's truncation error, estimated from steps h and 2h
RESOLUTION = 10  # times the rounding of f, divided by the step
EPS = float(np.finfo(np.float64).eps)  # 2.2e-16: float64 rounds each result to within EPS / 2, relative
GRADIENT_FACTOR = 10  # below float64 a gradient may lose this many times what the oracle's plain vjp loses


def gradients(runner: Runner, case: Case, dtype: str) -> dict[str, Measure]:
    """gradients: for each input and parameter a, the directional derivative <grad_a, u> along a random u
    matches the central difference D(h) = <d_out, (f(a + h u) - f(a - h u)) / 2h> of the oracle f. The
    measure is |<grad_a, u> - D(h)| in units of what the comparison can resolve,
        RELATIVE |grad_a| |u|  +  DIFFERENCE_FACTOR |D(h) - D(2h)|
          +  RESOLUTION eps (sum|d_out| |f|  +  sum over every argument b of sum|grad_b| |b|) / h,
    (the gradient's own relative accuracy, the difference's truncation error estimated from a second step,
    the rounding of f's result and the rounding inside f, `_rounding`), for the argument worst off; it passes
    up to 1. NaN, a missing gradient or a wrong shape or dtype is inf.
    masked_rows (where the operation declares which keys a query sees): a query that sees no key gets
    exactly zero gradient, and so does a key no query sees.
    no_autograd (where the framework has a mode without autograd: torch's inference mode): the vjp works
    there too and gives the same gradients."""
    case = rounded(case, dtype)
    out, d_out, rng = _cotangent(runner, case)
    grads = _pullback(runner, case, d_out, dtype)
    for name in _arguments(case):
        if unfit := _unfit(name, grads.get(name), _argument(case, name), dtype):
            return {"gradients": unfit}
    rounding = _rounding(case, grads, d_out, out)
    measures = {"gradients": max((_directional(case, name, grads[name], d_out, rounding, rng)
                                  for name in _arguments(case)), key=lambda m: m.error, default=Measure(0.0))}
    if operation_of(case).visible is not None:
        why = runner.declaration.reason("masked_rows")
        measures["masked_rows"] = skipped(why) if why else _masked_rows(case, grads)
    if runner.framework.no_autograd is not None:
        measures["no_autograd"] = _without_autograd(runner, case, d_out, dtype, grads)
    return measures


def _unfit(name: str, grad: np.ndarray | None, reference: np.ndarray, dtype: str) -> Measure | None:
    """inf where the gradient of argument `name` is missing, of the wrong shape or dtype, or not finite."""
    if grad is None or grad.shape != reference.shape or grad.dtype != np.dtype(dtype):
        found = None if grad is None else (grad.shape, grad.dtype)
        return Measure(math.inf, f"d{name} is {found}, expected {reference.shape} {dtype}")
    if not np.all(np.isfinite(grad)):
        return Measure(math.inf, f"d{name} is not finite")
    return None


def gradients_low_precision(runner: Runner, case: Case, dtype: str) -> dict[str, Measure]:
    """gradient_values: each gradient g_a of the module's vjp in `dtype` (float32, float16, bfloat16) against the
    oracle's own vjp in float64 on the same (rounded) inputs and cotangent, ref_a, in units of the case's largest
    gradient (a gradient that is zero by symmetry, such as a key projection's bias under softmax, is rounding
    noise alone, of no size of its own): error_a = max|g_a - ref_a| / max_b max|ref_b|, held to GRADIENT_FACTOR
    times the error of the oracle's vjp computed plainly in `dtype` (plain_a: float32 arithmetic, every stored
    tensor rounded to dtype; in float16 and bfloat16 the larger loss of its two ways to round a Linear, both
    conformant, as `values` takes: a ReLU's derivative flips where one of them rounds its input across 0),
    argument by argument, or to the dtype's floor in TOLERANCES where that is larger:
        max|g_a - ref_a| <= max(GRADIENT_FACTOR max|plain_a - ref_a|, floor max_b max|ref_b|).
    The measure is the argument worst off (largest error / allowance). NaN, a missing gradient or a wrong shape
    or dtype is inf.
    deterministic: the same pullback called twice gives the same gradients, bit for bit."""
    case = rounded(case, dtype)
    d_out = _cotangent(runner, case)[1]
    d_out = cast({"d_out": d_out}, dtype)["d_out"].astype(np.float64)  # the cotangent the module sees
    grads = _pullback(runner, case, d_out, dtype)
    oracle_vjp = operation_of(case).oracle_vjp
    reference = oracle_vjp(case, d_out, "float64", True)
    plains = [oracle_vjp(case, d_out, dtype, fused_bias) for fused_bias in linear_roundings(dtype)]
    scale = max((float(np.max(np.abs(ref), where=np.isfinite(ref), initial=0.0)) for ref in reference.values()),
                default=0.0) or 1.0
    floor, worst, excess = TOLERANCES[dtype]["gradient_values"], Measure(0.0), 0.0
    for name in _arguments(case):
        grad = grads.get(name)
        if unfit := _unfit(name, grad, reference[name], dtype):
            return {"gradient_values": unfit}
        error = _scaled_error(grad, reference[name], scale)
        lost = max(_scaled_error(plain[name], reference[name], scale) for plain in plains)
        if not error / max(GRADIENT_FACTOR * lost, floor) <= excess:  # NaN too
            excess = error / max(GRADIENT_FACTOR * lost, floor)
            worst = Measure(error, f"d{name}: error {error:.2e} of the largest gradient, the plain {dtype} vjp's "
                                   f"{lost:.2e}", tolerance=GRADIENT_FACTOR * lost)
    same = _same(case, _pullback(runner, case, d_out, dtype), grads)
    return {"gradient_values": worst,
            "deterministic": Measure(0.0) if same else Measure(math.inf, "the same vjp call twice gave other "
                                                                          "gradients")}


def _scaled_error(grad: np.ndarray, reference: np.ndarray, scale: float) -> float:
    """max|grad - reference| / scale: `relative_error` (max|grad - reference| / max|reference|, or max|grad -
    reference| where the reference is all zeros) brought to the case's scale."""
    largest = float(np.max(np.abs(reference), where=np.isfinite(reference), initial=0.0))
    return relative_error(grad, reference) * (largest if largest > 0 else 1.0) / scale


def _without_autograd(runner: Runner, case: Case, d_out: np.ndarray, dtype: str,
                      grads: dict[str, np.ndarray | None]) -> Measure:
    """The vjp called where the framework's autograd is off (torch: inference mode) gives the same
    gradients, bit for bit."""
    try:
        with runner.framework.no_autograd():
            again = _pullback(runner, case, d_out, dtype)
    except Exception as error:  # it must work there too
        return Measure(math.inf, f"the vjp raised where autograd is off: {type(error).__name__}: {error}")
    same = _same(case, again, grads)
    return Measure(0.0) if same else Measure(math.inf, "where autograd is off the vjp gives other gradients")


def _same(case: Case, again: dict[str, np.ndarray | None], grads: dict[str, np.ndarray | None]) -> bool:
    """Whether two pullbacks gave every argument's gradient bit for bit alike."""
    return all(np.array_equal(again.get(name), grads[name], equal_nan=True) for name in _arguments(case))


def _cotangent(runner: Runner, case: Case) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    """The oracle's out, a random cotangent d_out of its shape (none on the rows the module's declaration leaves
    unspecified, SPEC 11), and the generator that drew it, seeded by the case's shapes (`_seed`), so a replayed case
    draws the same cotangent and directions."""
    rng = np.random.default_rng(_seed(case))
    out = expected(case)[0]
    return out, specified(runner, case, (rng.standard_normal(out.shape), None))[0], rng


def _pullback(runner: Runner, case: Case, d_out: np.ndarray, dtype: str) -> dict[str, np.ndarray | None]:
    """{argument name: gradient} from the module's own vjp: the inputs, bias and the state-dict names."""
    arrays, options = arrays_and_options(case)
    return runner.call(operation_of(case).pullback, arrays | {"d_out": d_out}, dtype, None, **options)


def _arguments(case: Case) -> list[str]:
    """The arguments the operation differentiates that the case has: inputs, a bias, every parameter (of the
    state dict, and of a score function: "score_mod.slopes")."""
    names = []
    for name in operation_of(case).differentiable:
        value = getattr(case, name)
        if name == "state":
            names += list(value)
        elif isinstance(value, np.ndarray):
            names.append(name)
        elif value is not None:  # a score function: its parameters (ScoreMod.parameters), none for a plain one
            names += [f"{name}.{parameter}" for parameter in getattr(value, "parameters", {})]
    return names


def _argument(case: Case, name: str) -> np.ndarray:
    if name in getattr(case, "state", {}):
        return case.state[name]
    owner, _, parameter = name.partition(".")
    return np.asarray(getattr(case, owner).parameters[parameter]) if parameter else getattr(case, name)


def _with(case: Case, name: str, value: np.ndarray) -> Case:
    """`case` with argument `name` (an input, a state-dict entry, or a score function's parameter) replaced by
    `value`."""
    if name in getattr(case, "state", {}):
        return case._replace(state=case.state | {name: value})
    owner, _, parameter = name.partition(".")
    if parameter:  # the same score function with this parameter's value (ScoreMod.replace)
        return case._replace(**{owner: getattr(case, owner).replace(**{parameter: value})})
    return case._replace(**{name: value})


def _rounding(case: Case, grads: dict[str, np.ndarray], d_out: np.ndarray, out: np.ndarray) -> float:
    """How far rounding moves the oracle's loss <d_out, f(a)> in float64, to first order:
        eps (sum|d_out| |f|  +  sum over every argument b of sum|grad_b| |b|).
    The first term is the rounding of f's result. The second is the rounding inside f: every step of the oracle
    (the products and sums of q k^T, adding a bias or a mask shift, the softcap, softmax, the weighted sum of v,
    a projection, a norm) rounds its result by a relative eps, and such a rounding is what a relative change of
    eps in its inputs would make (backward error analysis: a dot product rounded in floating point is the exact
    dot product of inputs each changed by a few eps), so it moves the loss by about eps sum_i |dL/db_i| |b_i|.
    That is small where the arguments are of order 1, but a score near 1e4 (a bias shift of -1.15e4, or q and k
    of 15 at scale 10) carries eps 1e4 ~ 2e-12 of rounding, which the central difference divides by h = 1e-6:
    a relative 2e-6 of the gradient, beyond RELATIVE. It also covers the rounding of a + h u itself (eps |a|
    / 2 per entry, the perturbed argument's share of the sum). The gradients are the module's (the oracle has
    none): a gradient wrong by delta moves the allowance by RESOLUTION eps sum|delta| |b| / h ~ 2e-9 sum|delta| |b|,
    which hides a delta only where the arguments near 1e8. Arguments' infinite entries (a -inf bias) are not
    perturbed and take no gradient: left out."""
    conditioning = sum(float(np.sum(np.abs(grads[name] * np.where(np.isfinite(value), value, 0.0))))
                       for name, value in ((name, _argument(case, name)) for name in _arguments(case)))
    return EPS * (float(np.sum(np.abs(d_out * out))) + conditioning)


def _directional(case: Case, name: str, grad: np.ndarray, d_out: np.ndarray, rounding: float,
                 rng: np.random.Generator) -> Measure:
    """The directional derivative of argument `name` against central differences of the oracle, `rounding` the
    oracle's own (`_rounding`): the difference of two losses that each carry it, over 2h, is off by up to
    rounding / h."""
    value = _argument(case, name)
    u = np.where(np.isfinite(value), rng.standard_normal(value.shape), 0.0)  # a -inf bias stays -inf

    def difference(step: float) -> float:
        plus, minus = (expected(_with(case, name, value + sign * step * u))[0] for sign in (1, -1))
        return float(np.sum(d_out * (plus - minus)) / (2 * step))

    fine, coarse = difference(STEP), difference(2 * STEP)
    analytic = float(np.sum(grad * u))
    resolvable = (RELATIVE * np.linalg.norm(grad) * np.linalg.norm(u) + DIFFERENCE_FACTOR * abs(fine - coarse)
                  + RESOLUTION * rounding / STEP)
    error = abs(analytic - fine) / max(resolvable, np.finfo(np.float64).tiny)
    return Measure(error, f"d{name}: <grad, u> = {analytic:.6e} but the central difference gives {fine:.6e}")


def _masked_rows(case: Case, grads: dict[str, np.ndarray]) -> Measure:
    """Queries that see no key get exactly zero dq; keys that no query sees get exactly zero dk and dv.
    (For MHA, a query or key counts only when that holds in every head.)"""
    operation = operation_of(case)
    visible = operation.visible(case)  # (..., L, S)
    blind = ~np.any(visible, axis=-1)  # (..., L): queries that see nothing
    unseen = ~np.any(visible, axis=-2)  # (..., S): keys nobody sees
    if operation.packed:  # (H, T) -> (T, H): the packed layout's rows, positions first
        blind, unseen = np.swapaxes(blind, -1, -2), np.swapaxes(unseen, -1, -2)
    for name, grad, rows in (("q", grads["q"], blind), ("k", grads["k"], unseen), ("v", grads["v"], unseen)):
        rows = _reduce_to(rows, grad.shape[:-1])
        if np.any(grad[rows] != 0):
            return Measure(math.inf, f"d{name} is not exactly zero in a row that no attention reaches")
    return Measure(0.0)


def _reduce_to(rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A row is blind in an input shared by several copies only if it is blind in every copy: an input
    broadcast over an axis is shared by all of it, a key/value head (enable_gqa) by its group of query heads."""
    extra = rows.ndim - len(shape)
    rows = np.all(rows, axis=tuple(range(extra))) if extra > 0 else rows
    for axis, n in enumerate(shape):
        if rows.shape[axis] not in (1, n):  # n groups of rows.shape[axis] / n copies (n = 1: one group of all)
            split = (*rows.shape[:axis], n, rows.shape[axis] // n, *rows.shape[axis + 1:])
            rows = np.all(rows.reshape(split), axis=axis + 1)
    return np.broadcast_to(rows, shape)


def _seed(case: Case) -> int:
    """A seed that depends on the case's shapes only, so a replayed case draws the same directions."""
    return sum(x.size * (i + 1) for i, x in enumerate(case) if isinstance(x, np.ndarray))
