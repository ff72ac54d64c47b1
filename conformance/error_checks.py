"""Error inputs: a table of fixed cases, run on a module without Hypothesis.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

ERROR_CASES: each is a mistake a caller makes (a mask that does not broadcast, a state dict with a
missing entry, ...), the exception every backend raises for it, and the words its message contains. The
same mistake gets the same exception type in every backend: that is the point. `errors(module)` makes
each bad call, on both paths where there are two (need_weights True and False), and reports what it
raised. SPEC.md section 11 lists the table in words; edge_checks.py holds the other table, the edge cases.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from .fixed_cases import OPERATIONS, D, F, H
from .frameworks import framework_of
from .gradient_checks import offers_gradients
from .strategies import _block_state, _mha_state

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
    ErrorCase("sdpa", "d_out_dtype", "pullback", _sdpa(d_out=np.zeros((2, 3, 3), np.float32)), TypeError,
              ("d_out", "float32", "float64")),
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
    ErrorCase("mha", "d_out_dtype", "pullback", _mha(d_out=np.zeros((2, 3, D), np.float32)), TypeError,
              ("d_out", "float32", "float64")),
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
    ErrorCase("block", "d_out_dtype", "pullback", _block(d_out=np.zeros((2, 3, D), np.float32)), TypeError,
              ("d_out", "float32", "float64")),
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
    """The module's arrays, made from copies: a module that writes into its inputs cannot change a case."""
    if isinstance(value, Mapping):
        return {name: _native(module, x) for name, x in value.items()}
    return module.asarray(value.copy()) if isinstance(value, np.ndarray) else value
