"""Error inputs and edge cases: two tables of fixed cases, run on a module without Hypothesis.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

ERROR_CASES: each is a mistake a caller makes (a mask that does not broadcast, a state dict with a
missing entry, ...), the exception every backend raises for it, and the words its message contains. The
same mistake gets the same exception type in every backend: that is the point. `errors(module)` makes
each bad call, on both paths where there are two (need_weights True and False), and reports what it
raised.

EDGE_CASES: inputs at the borders of the spec (no keys, no queries, fully masked rows, logits in the
thousands, NaN and inf), each compared with the float64 oracle on both paths, modules in eval mode.
`edge_cases(module)` reports each case. SPEC.md section 11 lists both tables in words.
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
from .frameworks import framework_of
from .gradient_checks import offers_gradients
from .strategies import BlockCase, MhaCase, SdpaCase, _block_state, _mha_state

OPERATIONS = ("sdpa", "mha", "block")
VALUES = json.loads((Path(__file__).parent / "tolerances.json").read_text())["float64"]["values"]  # every edge case
D, H, F = 4, 2, 8  # the modules' sizes in both tables: d_model, num_heads, d_ff


# --- error inputs ----------------------------------------------------------------------------------------

class ErrorCase(NamedTuple):
    """One mistake: `inputs()` builds the bad call's arguments (NumPy arrays, state dicts and options);
    `stage` says what is called with them; the call must raise `error` with every string of `contains`
    in its message."""

    operation: str  # "sdpa", "mha" or "block"
    name: str
    stage: str  # "call" (the operation), "init" (the constructor), "load" (from_state_dict), "pullback" (vjp's)
    inputs: Callable[[], dict[str, Any]]
    error: type[Exception]
    contains: tuple[str, ...]


def _normal(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape)  # float64


def _qkv(q: tuple, k: tuple, v: tuple, **extra: Any) -> Callable[[], dict[str, Any]]:
    """q, k, v of these shapes (N(0, 1), float64) and `extra` (arrays or options), built when called."""
    return lambda: {"q": _normal(*q), "k": _normal(*k), "v": _normal(*v)} | extra


def _sdpa(**extra: Any) -> Callable[[], dict[str, Any]]:
    """Good q (2, 3, 4), k (2, 5, 4), v (2, 5, 3) and `extra`, the mistake."""
    return _qkv((2, 3, 4), (2, 5, 4), (2, 5, 3), **extra)


def _mha(q: tuple = (2, 3, D), k: tuple = (2, 5, D), v: tuple = (2, 5, D), **extra: Any) -> Callable[[], dict]:
    """A MultiHeadAttention state (D = 4, float64, H = 2) with inputs of these shapes, and `extra`."""
    return lambda: _qkv(q, k, v)() | {"state": _mha_state(np.random.default_rng(0), D)} | extra


def _block(x: tuple = (2, 3, D), **extra: Any) -> Callable[[], dict]:
    """A TransformerBlock state (D = 4, F = 8, float64, H = 2) with x of this shape, and `extra`."""
    return lambda: {"x": _normal(*x), "state": _block_state(np.random.default_rng(0), D, F)} | extra


def _then(make: Callable[[], dict], change: Callable[[dict], dict]) -> Callable[[], dict]:
    """`make`'s inputs with `change` applied to them."""
    return lambda: change(make())


def _state(make: Callable[[], dict], change: Callable[[dict], dict]) -> Callable[[], dict]:
    """`make`'s inputs with `change` applied to the state dict."""
    return _then(make, lambda inputs: inputs | {"state": change(dict(inputs["state"]))})


def _as(dtype: str, *names: str) -> Callable[[dict], dict]:
    """A change: the entries `names` cast to `dtype` (to an integer dtype: 3 x the values, rounded)."""
    def cast(x: np.ndarray) -> np.ndarray:
        return (x if np.issubdtype(np.dtype(dtype), np.floating) else np.round(3 * x)).astype(dtype)
    return lambda arrays: arrays | {name: cast(arrays[name]) for name in names}


def _broken_entries(prefix: str) -> Callable[[dict], dict]:
    """Drop w_k.bias, add an unexpected entry, give w_v.weight the wrong shape: one error names all three."""
    def change(state: dict) -> dict:
        del state[f"{prefix}w_k.bias"]
        state[f"{prefix}w_x.weight"] = np.zeros((D, D))
        state[f"{prefix}w_v.weight"] = np.zeros((D, D - 1))
        return state
    return change


FLOAT_MASK = np.array([[1.0, 0.5, 0.0, 1.0, 1.0]])  # (1, S): 0.5 is neither "hide" nor "keep"

_SDPA_ERRORS = [
    ErrorCase("sdpa", "q_k_widths_differ", "call", _qkv((2, 3, 4), (2, 5, 3), (2, 5, 3)), ValueError,
              ("q", "k", "(2, 3, 4)", "(2, 5, 3)")),
    ErrorCase("sdpa", "k_v_lengths_differ", "call", _qkv((2, 3, 4), (2, 5, 4), (2, 4, 3)), ValueError,
              ("k", "v", "(2, 5, 4)", "(2, 4, 3)")),
    ErrorCase("sdpa", "rank_below_2", "call", _qkv((4,), (5, 4), (5, 3)), ValueError, ("q", "(4,)")),
    ErrorCase("sdpa", "leading_axes_do_not_broadcast", "call", _qkv((2, 3, 4), (3, 5, 4), (3, 5, 3)), ValueError,
              ("broadcast", "(2, 3, 4)", "(3, 5, 4)")),
    ErrorCase("sdpa", "mask_does_not_broadcast", "call", _sdpa(mask=np.ones((4, 5), bool)), ValueError,
              ("mask", "(4, 5)", "(2, 3, 5)")),
    ErrorCase("sdpa", "mask_adds_a_batch_axis", "call", _qkv((3, 4), (5, 4), (5, 3), mask=np.ones((2, 3, 5), bool)),
              ValueError, ("mask", "(2, 3, 5)", "(3, 5)")),
    ErrorCase("sdpa", "bias_does_not_broadcast", "call", _sdpa(bias=np.zeros((3, 4))), ValueError,
              ("bias", "(3, 4)", "(2, 3, 5)")),
    ErrorCase("sdpa", "bias_adds_a_batch_axis", "call", _qkv((3, 4), (5, 4), (5, 3), bias=np.zeros((2, 3, 5))),
              ValueError, ("bias", "(2, 3, 5)", "(3, 5)")),
    ErrorCase("sdpa", "float_mask_not_0_or_1", "call", _sdpa(mask=FLOAT_MASK), ValueError, ("mask", "bias")),
    ErrorCase("sdpa", "integer_inputs", "call", _then(_sdpa(), _as("int64", "q", "k", "v")), TypeError,
              ("q", "floating")),
    ErrorCase("sdpa", "dtypes_differ", "call", _then(_sdpa(), _as("float32", "k")), TypeError,
              ("float32", "float64")),
    ErrorCase("sdpa", "dropout_p_one", "call", _sdpa(dropout_p=1.0), ValueError, ("dropout_p",)),
    ErrorCase("sdpa", "dropout_p_negative", "call", _sdpa(dropout_p=-0.1), ValueError, ("dropout_p",)),
    ErrorCase("sdpa", "d_out_shape", "pullback", _sdpa(d_out=np.zeros((2, 3, 4))), ValueError,
              ("d_out", "(2, 3, 4)", "(2, 3, 3)")),
]

_MHA_ERRORS = [
    ErrorCase("mha", "input_width_not_d_model", "call", _mha(k=(2, 5, 3)), ValueError, ("k", "(2, 5, 3)", "4")),
    ErrorCase("mha", "input_rank_below_2", "call", _mha(q=(D,)), ValueError, ("q", "(4,)")),
    ErrorCase("mha", "k_v_lengths_differ", "call", _mha(v=(2, 4, D)), ValueError, ("k", "v", "same length")),
    ErrorCase("mha", "leading_axes_do_not_broadcast", "call", _mha(k=(3, 5, D), v=(3, 5, D)), ValueError,
              ("broadcast",)),
    ErrorCase("mha", "mask_does_not_broadcast", "call", _mha(mask=np.ones((3, 4), bool)), ValueError,
              ("mask", "(3, 4)", "(2, 2, 3, 5)")),
    ErrorCase("mha", "mask_adds_a_batch_axis", "call", _mha(q=(3, D), k=(5, D), v=(5, D),
              mask=np.ones((2, 1, 3, 5), bool)), ValueError, ("mask", "(2, 1, 3, 5)", "(2, 3, 5)")),
    ErrorCase("mha", "float_mask_not_0_or_1", "call", _mha(mask=FLOAT_MASK), ValueError, ("mask", "bias")),
    ErrorCase("mha", "integer_input", "call", _then(_mha(), _as("int64", "q")), TypeError, ("q", "floating")),
    ErrorCase("mha", "input_dtype_not_parameters", "call", _then(_mha(), _as("float32", "v")), TypeError,
              ("float32", "float64")),
    ErrorCase("mha", "d_model_not_divisible", "init", lambda: {"d_model": 6, "num_heads": 4}, ValueError,
              ("d_model", "num_heads")),
    ErrorCase("mha", "d_model_zero", "init", lambda: {"d_model": 0, "num_heads": 1}, ValueError, ("d_model",)),
    ErrorCase("mha", "num_heads_zero", "init", lambda: {"d_model": 4, "num_heads": 0}, ValueError, ("num_heads",)),
    ErrorCase("mha", "dropout_one", "init", lambda: {"d_model": 4, "num_heads": 2, "dropout": 1.0}, ValueError,
              ("dropout",)),
    ErrorCase("mha", "state_not_divisible", "load", _mha(num_heads=3), ValueError, ("d_model", "num_heads")),
    ErrorCase("mha", "state_dropout_negative", "load", _mha(dropout=-0.5), ValueError, ("dropout",)),
    ErrorCase("mha", "state_entries", "load", _state(_mha(), _broken_entries("")), ValueError,
              ("w_k.bias", "w_x.weight", "w_v.weight")),
    ErrorCase("mha", "state_dtypes_differ", "load", _state(_mha(), _as("float32", "w_o.bias")), TypeError,
              ("float32", "float64")),
    ErrorCase("mha", "d_out_shape", "pullback", _mha(d_out=np.zeros((2, 3, D + 1))), ValueError,
              ("d_out", "(2, 3, 5)", "(2, 3, 4)")),
]

_BLOCK_ERRORS = [
    ErrorCase("block", "input_width_not_d_model", "call", _block(x=(2, 3, 5)), ValueError, ("x", "(2, 3, 5)", "4")),
    ErrorCase("block", "input_rank_below_2", "call", _block(x=(D,)), ValueError, ("x", "(4,)")),
    ErrorCase("block", "mask_does_not_broadcast", "call", _block(mask=np.ones((3, 4), bool)), ValueError,
              ("mask", "(3, 4)", "(2, 2, 3, 3)")),
    ErrorCase("block", "mask_adds_a_batch_axis", "call", _block(x=(3, D), mask=np.ones((2, 1, 3, 3), bool)),
              ValueError, ("mask", "(2, 1, 3, 3)", "(2, 3, 3)")),
    ErrorCase("block", "float_mask_not_0_or_1", "call", _block(mask=np.array([[1.0, 0.5, 1.0]])), ValueError,
              ("mask", "bias")),
    ErrorCase("block", "integer_input", "call", _then(_block(), _as("int64", "x")), TypeError, ("x", "floating")),
    ErrorCase("block", "input_dtype_not_parameters", "call", _then(_block(), _as("float32", "x")), TypeError,
              ("float32", "float64")),
    ErrorCase("block", "d_model_not_divisible", "init", lambda: {"d_model": 6, "num_heads": 4, "d_ff": 8},
              ValueError, ("d_model", "num_heads")),
    ErrorCase("block", "d_ff_zero", "init", lambda: {"d_model": 4, "num_heads": 2, "d_ff": 0}, ValueError,
              ("d_ff",)),
    ErrorCase("block", "unknown_activation", "init", lambda: {"d_model": 4, "num_heads": 2, "d_ff": 8,
              "activation": "tanh"}, ValueError, ("activation", "tanh")),
    ErrorCase("block", "dropout_one", "init", lambda: {"d_model": 4, "num_heads": 2, "d_ff": 8, "dropout": 1.0},
              ValueError, ("dropout",)),
    ErrorCase("block", "state_unknown_activation", "load", _block(activation="swish"), ValueError,
              ("activation", "swish")),
    ErrorCase("block", "state_dropout_negative", "load", _block(dropout=-0.5), ValueError, ("dropout",)),
    ErrorCase("block", "state_entries", "load", _state(_block(), _broken_entries("attn.")), ValueError,
              ("attn.w_k.bias", "attn.w_x.weight", "attn.w_v.weight")),
    ErrorCase("block", "state_dtypes_differ", "load", _state(_block(), _as("float32", "norm2.weight")), TypeError,
              ("float32", "float64")),
    ErrorCase("block", "d_out_shape", "pullback", _block(d_out=np.zeros((2, 3, D + 1))), ValueError,
              ("d_out", "(2, 3, 5)", "(2, 3, 4)")),
]

ERROR_CASES: list[ErrorCase] = _SDPA_ERRORS + _MHA_ERRORS + _BLOCK_ERRORS


# --- making the bad calls ------------------------------------------------------------------------------------

def _call(module: ModuleType, case: ErrorCase, inputs: dict[str, Any], need_weights: bool) -> Any:
    """Make `case`'s call with `inputs` (native arrays). Modules are built with H = 2 and dropout 0 and
    called in eval mode, unless the inputs say otherwise; `vjp(...)[2]` is the pullback."""
    d_out = inputs.pop("d_out", None)
    if case.operation == "sdpa":
        q, k, v, mask = inputs.pop("q"), inputs.pop("k"), inputs.pop("v"), inputs.pop("mask", None)
        if case.stage == "pullback":
            return module.scaled_dot_product_attention_vjp(q, k, v, mask, **inputs)[2](d_out)
        return module.scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights, **inputs)
    cls = module.MultiHeadAttention if case.operation == "mha" else module.TransformerBlock
    if case.stage == "init":
        return cls(**inputs)
    options = {"num_heads": H, "dropout": 0.0} | {name: inputs.pop(name) for name in ("num_heads", "dropout",
                                                                                    "activation") if name in inputs}
    loaded = cls.from_state_dict(inputs.pop("state"), **options)
    if case.stage == "load":
        return loaded
    arguments = [inputs.pop(name) for name in (("q", "k", "v") if case.operation == "mha" else ("x",))]
    mask = inputs.pop("mask", None)
    if case.stage == "pullback":
        return loaded.eval().vjp(*arguments, mask)[2](d_out)
    return loaded.eval()(*arguments, mask, need_weights=need_weights)


class ErrorResult(NamedTuple):
    """What a bad call did: `raised` is "Type: message" or None (it returned); on a failure, `path` is
    the path that failed ("need_weights=False", say)."""

    case: ErrorCase
    raised: str | None
    type_ok: bool
    message_ok: bool
    path: str = ""
    skipped: str | None = None  # why the case does not apply to the module (it offers no vjp, say)

    @property
    def passed(self) -> bool:
        return self.skipped is not None or (self.type_ok and self.message_ok)

    def describe(self) -> str:
        case = self.case
        expected = f"{case.error.__name__} mentioning {', '.join(map(repr, case.contains))}"
        got = "no exception" if self.raised is None else self.raised
        where = f" ({self.path})" if self.path else ""
        return f"{case.operation} {case.name}{where}: expected {expected}; got {got}"


def errors(module: ModuleType, operations: Sequence[str] = OPERATIONS) -> list[ErrorResult]:
    """Make every bad call of ERROR_CASES for `operations` on `module` (arrays through module.asarray;
    JAX with 64-bit types enabled) and report what each raised. Calls of the operation itself run on both
    paths, need_weights True and False; a case passes when both raise the expected type and message."""
    with framework_of(module).pinned():
        return [check_error(module, case) for case in ERROR_CASES if case.operation in operations]


def check_error(module: ModuleType, case: ErrorCase) -> ErrorResult:
    """One case of ERROR_CASES on `module` (run it where JAX has 64-bit types enabled, as `errors` does)."""
    if case.stage == "pullback" and (why := offers_gradients(module, case.operation)):
        return ErrorResult(case, None, False, False, skipped=why)
    for need_weights in (True, False) if case.stage == "call" else (True,):
        exception = _attempt(module, case, need_weights)
        raised = None if exception is None else f"{type(exception).__name__}: {exception}"
        type_ok = isinstance(exception, case.error)
        message_ok = exception is not None and all(text in str(exception) for text in case.contains)
        if not (type_ok and message_ok):
            return ErrorResult(case, raised, type_ok, message_ok, "" if need_weights else "need_weights=False")
    return ErrorResult(case, raised, True, True)


def _attempt(module: ModuleType, case: ErrorCase, need_weights: bool) -> Exception | None:
    """The exception the bad call raises, or None when it returns."""
    try:
        inputs = {name: _native(module, value) for name, value in case.inputs().items()}
        _call(module, case, inputs, need_weights)
    except Exception as error:  # any exception is reported; its type is then compared
        return error
    return None


def _native(module: ModuleType, value: Any) -> Any:
    if isinstance(value, Mapping):
        return {name: _native(module, x) for name, x in value.items()}
    return module.asarray(value) if isinstance(value, np.ndarray) else value


# --- edge cases ----------------------------------------------------------------------------------------------

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


# --- as the suite's rows ---------------------------------------------------------------------------------

class Summary(NamedTuple):
    """One operation's results of one table, in the shape of a suite row."""

    examples: int  # the cases run (skipped ones not counted)
    failing: int
    failure: str | None  # each failing case: what was expected and what happened


def summarize(results: Sequence[ErrorResult | EdgeResult]) -> Summary:
    run = [result for result in results if getattr(result, "skipped", None) is None]
    failing = [result for result in run if not result.passed]
    failure = "\n".join(f"  {result.describe()}" for result in failing) or None
    return Summary(len(run), len(failing), failure)

