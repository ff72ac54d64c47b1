"""Backward passes: every backend's `scaled_dot_product_attention_vjp`, `MultiHeadAttention.vjp` and
`TransformerBlock.vjp` against torch's own autograd through F.scaled_dot_product_attention,
nn.MultiheadAttention and nn.TransformerEncoderLayer; the masking rules of the gradients; dtypes and
errors; and the NumPy backend's hand-derived backward passes against central finite differences.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff.

Gradients are compared norm-wise, max|a - b| / max|b| per gradient, to 1e-8 in float64: the same
derivatives summed in another order differ by a few ulps times the conditioning of softmax and LayerNorm
(measured below 1e-13). One gradient is zero in exact arithmetic: w_k's bias adds q_i . b_k to every
score of row i, and the softmax ignores a shift common to a row, so its computed values are rounding
noise around 0; it is measured against the largest of the other gradients instead.

Mask conventions: ours is a keep-mask (True = key visible), as is F.scaled_dot_product_attention's
boolean attn_mask; its float attn_mask is added to the scores (-inf hides). nn.MultiheadAttention's and
nn.TransformerEncoderLayer's boolean masks mean the opposite (True = hidden).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import pytest

from tests._compare import relative_error

torch = pytest.importorskip("torch")

from conformance.bench.baselines import (  # noqa: E402
    random_state,
    torch_encoder_layer,
    torch_multihead,
)
from conformance.builtins import torch_encoder_layer as layer_built_in  # noqa: E402
from conformance.builtins import torch_mha as mha_built_in  # noqa: E402

sdpa = torch.nn.functional.scaled_dot_product_attention
B, H, D, F = 2, 2, 8, 16
EPS = 1e-3  # LayerNorm eps, not the default, so an eps that does not reach the backward pass shows
RTOL = 1e-8  # gradients vs torch's autograd, float64
ZERO_IN_EXACT_ARITHMETIC = ("w_k.bias", "attn.w_k.bias")  # the softmax is shift-invariant along a row
F64 = np.dtype(np.float64)


def _t(x: np.ndarray, requires_grad: bool = False) -> Any:
    """NumPy -> torch tensor (same dtype, a copy: torch wants writable memory)."""
    return torch.tensor(np.array(x), requires_grad=requires_grad)


def _keep_mask(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A random boolean keep-mask with at least one visible key in every row (no fully masked row)."""
    mask = rng.random(shape) < 0.5
    np.put_along_axis(mask, rng.integers(shape[-1], size=(*shape[:-1], 1)), True, axis=-1)
    return mask


def _gradient_errors(ours: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray]) -> dict[str, float]:
    """{name: norm-wise relative error}; a gradient that is 0 in exact arithmetic is measured against the
    largest of the other gradients (its own maximum is rounding noise)."""
    scale = max(np.max(np.abs(g)) for name, g in theirs.items() if name not in ZERO_IN_EXACT_ARITHMETIC)
    errors = {}
    for name, expected in theirs.items():
        actual = ours[name]
        assert actual.shape == expected.shape, f"d{name}: shape {actual.shape} != {expected.shape}"
        assert actual.dtype == expected.dtype, f"d{name}: dtype {actual.dtype} != {expected.dtype}"
        errors[name] = (float(np.max(np.abs(actual - expected)) / scale) if name in ZERO_IN_EXACT_ARITHMETIC
                        else relative_error(actual, expected))
    return errors


def _assert_gradients_close(ours: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray],
                            what: str) -> None:
    assert set(ours) == set(theirs), f"{what}: gradient names {sorted(ours)} != {sorted(theirs)}"
    for name, error in _gradient_errors(ours, theirs).items():
        assert error <= RTOL, f"{what}: d{name} relative error {error:.3g} > {RTOL:.3g}"


def _numpy_grads(backend: ModuleType, grads: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {name: backend.to_numpy(g) for name, g in grads.items()}


def _pulled_back(backend: ModuleType, vjp: Callable, d_out: Any, *arguments: Any) -> Any:
    """vjp(*arguments)'s pullback (its last result) at d_out: the gradients. JAX's vjp and pullback run as one
    jax.jit, the arguments (arrays, None, modules: pytrees) traced: eagerly, each primitive compiled apart at
    every new shape, several times the one program's cost. jit returns a dict in sorted order: each dict of
    gradients is given back in the order the pullback built it (read while tracing). The claims on exact zeros
    and dtypes hold for the program as for its primitives; test_key_hidden_from_a_query_gets_no_gradient_through_it
    and the tests of the errors and of dropout call the vjps eagerly, as users do."""
    orders: list = []

    def pulled_back(d_out: Any, *arguments: Any) -> Any:
        grads = vjp(*arguments)[-1](d_out)
        orders[:] = [list(g) if isinstance(g, dict) else None for g in grads]
        return grads

    if backend.__name__ != "attention_jax":
        return pulled_back(d_out, *arguments)
    import jax

    grads = jax.jit(pulled_back)(d_out, *arguments)
    return tuple(g if order is None else {name: g[name] for name in order}
                 for g, order in zip(grads, orders, strict=True))


# ---- 1) scaled dot-product attention vs torch autograd through F.scaled_dot_product_attention -----------


class SdpaCase(NamedTuple):
    """One attention call in NumPy; mask is our keep-mask (or None)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None = None
    bias: np.ndarray | None = None
    is_causal: bool = False
    scale: float | None = None


def _qkv(rng: np.random.Generator, lead: tuple[int, ...] = (B, H), L: int = 5, S: int = 5, E: int = 4,
         Ev: int = 4, lead_kv: tuple[int, ...] | None = None) -> tuple[np.ndarray, ...]:
    """Standard normal float64 q (..., L, E), k (..., S, E), v (..., S, Ev)."""
    lead_kv = lead if lead_kv is None else lead_kv
    return (rng.standard_normal((*lead, L, E)), rng.standard_normal((*lead_kv, S, E)),
            rng.standard_normal((*lead_kv, S, Ev)))


def _fully_masked_row(rng: np.random.Generator) -> SdpaCase:
    mask = _keep_mask(rng, (B, H, 5, 5))
    mask[0, 1, 2] = False  # batch 0, head 1, query 2 sees no key: torch SDPA gives zeros there, so do we
    return SdpaCase(*_qkv(rng), mask=mask)


SDPA_CASES: dict[str, Callable[[np.random.Generator], SdpaCase]] = {
    "no-mask": lambda rng: SdpaCase(*_qkv(rng)),
    "random-mask": lambda rng: SdpaCase(*_qkv(rng), mask=_keep_mask(rng, (B, H, 5, 5))),
    "fully-masked-row": _fully_masked_row,
    "bias": lambda rng: SdpaCase(*_qkv(rng), bias=rng.standard_normal((B, H, 5, 5))),
    # (1, L, S) broadcasts over B and H: dbias is the sum of d_scores over those axes
    "broadcast-bias-(1,L,S)": lambda rng: SdpaCase(*_qkv(rng), bias=rng.standard_normal((1, 5, 5))),
    "broadcast-bias-and-mask": lambda rng: SdpaCase(*_qkv(rng), mask=_keep_mask(rng, (B, 1, 5, 5)),
                                                    bias=rng.standard_normal((1, 5, 5))),
    "bias-with-neg-inf": lambda rng: SdpaCase(*_qkv(rng), bias=np.where(
        _keep_mask(rng, (B, H, 5, 5)), rng.standard_normal((B, H, 5, 5)), -np.inf)),
    "causal-L=S": lambda rng: SdpaCase(*_qkv(rng, L=5, S=5), is_causal=True),
    "causal-L<S": lambda rng: SdpaCase(*_qkv(rng, L=3, S=7), is_causal=True),
    "causal-L>S": lambda rng: SdpaCase(*_qkv(rng, L=7, S=3), is_causal=True),
    "custom-scale": lambda rng: SdpaCase(*_qkv(rng), scale=0.3),
    "L!=S": lambda rng: SdpaCase(*_qkv(rng, L=3, S=7)),
    "E!=Ev": lambda rng: SdpaCase(*_qkv(rng, E=4, Ev=6)),
    # k, v broadcast along B: dk and dv are summed over it
    "broadcast-k-v-(1,H)": lambda rng: SdpaCase(*_qkv(rng, lead_kv=(1, H))),
}


def _torch_attn_mask(case: SdpaCase, bias: Any) -> dict[str, Any]:
    """torch's keyword arguments: our mask and bias as one attn_mask (torch refuses attn_mask together
    with is_causal, so causal is folded into it when a mask is present)."""
    if case.mask is None and bias is None:
        return {"is_causal": case.is_causal, "scale": case.scale}
    keep = torch.ones(case.q.shape[-2], case.k.shape[-2], dtype=torch.bool)  # (L, S), True = visible
    if case.is_causal:
        keep = keep.tril()  # top-left aligned: query i sees keys j <= i, as ours and torch's is_causal
    if case.mask is not None:
        keep = keep & torch.from_numpy(np.asarray(case.mask, bool))  # (L, S) & (..., L, S)
    # a float attn_mask is added to the scores: bias where visible, -inf where hidden
    attn_mask = keep if bias is None else torch.where(keep, bias, -math.inf)
    return {"attn_mask": attn_mask, "scale": case.scale}


def _torch_sdpa_gradients(case: SdpaCase, d_out: np.ndarray) -> dict[str, np.ndarray]:
    """dq, dk, dv (and dbias) from torch's autograd through F.scaled_dot_product_attention."""
    leaves = {"q": _t(case.q, True), "k": _t(case.k, True), "v": _t(case.v, True)}
    if case.bias is not None:
        leaves["bias"] = _t(case.bias, True)
    out = sdpa(leaves["q"], leaves["k"], leaves["v"], **_torch_attn_mask(case, leaves.get("bias")))
    grads = torch.autograd.grad(out, list(leaves.values()), _t(d_out))
    return {name: g.numpy() for name, g in zip(leaves, grads, strict=True)}


def _our_sdpa_gradients(backend: ModuleType, case: SdpaCase, d_out: np.ndarray) -> dict[str, np.ndarray]:
    q, k, v = (backend.asarray(np.array(x)) for x in (case.q, case.k, case.v))
    as_backend = {name: None if x is None else backend.asarray(np.array(x))
                  for name, x in (("mask", case.mask), ("bias", case.bias))}
    dq, dk, dv, dbias = _pulled_back(
        backend, lambda q, k, v, mask, bias: backend.scaled_dot_product_attention_vjp(
            q, k, v, mask, bias=bias, is_causal=case.is_causal, scale=case.scale),
        backend.asarray(np.array(d_out)), q, k, v, as_backend["mask"], as_backend["bias"])
    assert (dbias is None) == (case.bias is None), "dbias must be None exactly when bias is None"
    grads = {"q": dq, "k": dk, "v": dv} | ({} if dbias is None else {"bias": dbias})
    return _numpy_grads(backend, grads)


@pytest.mark.parametrize("build", SDPA_CASES.values(), ids=SDPA_CASES.keys())
def test_sdpa_gradients_match_torch_autograd(backend: ModuleType, build: Callable) -> None:
    rng = np.random.default_rng(0)
    case = build(rng)
    d_out = rng.standard_normal((*np.broadcast_shapes(case.q.shape[:-2], case.v.shape[:-2]),
                                 case.q.shape[-2], case.v.shape[-1]))  # (..., L, Ev)
    _assert_gradients_close(_our_sdpa_gradients(backend, case, d_out), _torch_sdpa_gradients(case, d_out),
                            f"{backend.__name__} sdpa")


def test_torch_sdpa_gives_a_fully_masked_row_zero_output_and_zero_gradient() -> None:
    # the assumption behind the "fully-masked-row" case: torch 2.13's SDPA returns zeros for a query with
    # no visible key and passes it no gradient (not NaN), as our rule says
    rng = np.random.default_rng(0)
    case = _fully_masked_row(rng)
    q = _t(case.q, True)
    out = sdpa(q, _t(case.k), _t(case.v), attn_mask=_t(case.mask))
    (dq,) = torch.autograd.grad(out, [q], _t(rng.standard_normal(out.shape)))
    assert torch.all(out[0, 1, 2] == 0) and torch.all(dq[0, 1, 2] == 0)
    assert torch.isfinite(dq).all()


# ---- 2) multi-head attention vs torch autograd through nn.MultiheadAttention --------------------------

def _torch_parameter_gradients(module: Any, ours: Callable[[dict], dict], leaves: list[Any], out: Any,
                               d_out: np.ndarray) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """Gradients of <out, d_out> w.r.t. `leaves` and every parameter of `module`, the latter under our names:
    `ours` (a built-in's state_of) maps the layer's parameters to our state-dict entries."""
    parameters = dict(module.named_parameters())
    grads = torch.autograd.grad(out, [*leaves, *parameters.values()], _t(d_out))
    theirs = dict(zip(parameters, grads[len(leaves):], strict=True))
    return [g.numpy() for g in grads[:len(leaves)]], {name: g.numpy() for name, g in ours(theirs).items()}


@pytest.mark.parametrize("padding", [False, True], ids=["no-mask", "padding-mask"])
@pytest.mark.parametrize("attention", ["self-attention", "cross-attention"])
def test_mha_vjp_gradients_match_torch_autograd(backend: ModuleType, attention: str, padding: bool) -> None:
    rng = np.random.default_rng(0)
    state = random_state("mha", D, F, rng, F64)
    L, S = (5, 5) if attention == "self-attention" else (3, 6)
    q = rng.standard_normal((B, L, D))
    k, v = (q, q) if attention == "self-attention" else (rng.standard_normal((B, S, D)) for _ in range(2))
    lengths = np.array([S, 2])  # >= 1: nn.MultiheadAttention gives NaN for a fully masked row, we zeros
    mask = np.arange(S) < lengths[:, None, None, None] if padding else None  # (B, 1, 1, S), True = visible
    d_out = rng.standard_normal((B, L, D))

    # torch: q, k, v as three leaves, so each gets its own gradient, also in self-attention
    layer, leaves = torch_multihead(state, num_heads=H, dtype=F64), [_t(x, True) for x in (q, k, v)]
    theirs = {} if mask is None else {"key_padding_mask": _t(~mask[:, 0, 0, :])}  # (B, S), True = padding
    out, _ = layer(*leaves, **theirs, need_weights=False)
    (dq_t, dk_t, dv_t), expected = _torch_parameter_gradients(layer, mha_built_in.state_of, leaves, out, d_out)

    mha = backend.MultiHeadAttention.from_state_dict(state, num_heads=H).eval()
    dq, dk, dv, dparams = _pulled_back(backend, lambda mha, *inputs: mha.vjp(*inputs), backend.asarray(d_out), mha,
                                       *(backend.asarray(np.array(x)) for x in (q, k, v)),
                                       None if mask is None else backend.asarray(mask))
    ours = _numpy_grads(backend, dparams | {"q": dq, "k": dk, "v": dv})
    _assert_gradients_close(ours, expected | {"q": dq_t, "k": dk_t, "v": dv_t}, f"{backend.__name__} mha")


# ---- 3) the block vs torch autograd through nn.TransformerEncoderLayer --------------------------------

BLOCKS = {"post-LN-relu": (False, "relu"), "pre-LN-gelu": (True, "gelu")}


@pytest.mark.parametrize("causal", [False, True], ids=["no-mask", "causal-mask"])
@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_block_vjp_gradients_match_torch_autograd(backend: ModuleType, block: tuple[bool, str],
                                                  causal: bool) -> None:
    norm_first, activation = block
    rng, L = np.random.default_rng(0), 6
    state = random_state("block", D, F, rng, F64)
    x, d_out = rng.standard_normal((B, L, D)), rng.standard_normal((B, L, D))
    mask = np.tril(np.ones((L, L), bool)) if causal else None  # (L, L), True = visible

    layer = torch_encoder_layer(state, num_heads=H, norm_first=norm_first, activation=activation, eps=EPS,
                                dtype=F64)
    x_t = _t(x, True)
    out = layer(x_t, src_mask=None if mask is None else _t(~mask))  # dropout 0, eval; True = hidden
    (dx_t,), expected = _torch_parameter_gradients(layer, layer_built_in.state_of, [x_t], out, d_out)
    assert len(expected) == 16

    ours = backend.TransformerBlock.from_state_dict(state, num_heads=H, norm_first=norm_first,
                                                    activation=activation, eps=EPS).eval()
    dx, dparams = _pulled_back(backend, lambda block, *inputs: block.vjp(*inputs), backend.asarray(d_out), ours,
                               backend.asarray(x), None if mask is None else backend.asarray(mask))
    assert list(dparams) == list(ours.state_dict()), "dparams must be named and ordered as the state dict"
    _assert_gradients_close(_numpy_grads(backend, dparams | {"x": dx}), expected | {"x": dx_t},
                            f"{backend.__name__} block")


# ---- 4) fully masked rows, heads and batch elements get exactly zero gradient, never NaN ---------------


def _masked_sdpa_mask() -> np.ndarray:
    """(3, H, L=5, S=6) keep-mask: batch 0 head 1 query 2 sees no key; key 4 of batch 1 is hidden from
    every query in every head; batch 2 is hidden entirely."""
    mask = np.ones((3, H, 5, 6), bool)
    mask[0, :, :, 0] = False  # some ordinary masking around the special cases
    mask[0, 1, 2] = False
    mask[1, :, :, 4] = False
    mask[2] = False
    return mask


def test_sdpa_fully_masked_rows_keys_and_batch_elements_get_exactly_zero_gradient(backend: ModuleType) -> None:
    # a hidden entry has weight 0, so d_scores = P * (dP - rowsum(dP * P)) is exactly 0 there: a query
    # with no visible key gets dq = 0, a key hidden from every query dk = dv = 0, a hidden bias entry 0
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, lead=(3, H), L=5, S=6)
    bias, mask = rng.standard_normal((3, H, 5, 6)), _masked_sdpa_mask()
    grads = _pulled_back(backend, lambda q, k, v, mask, bias: backend.scaled_dot_product_attention_vjp(
        q, k, v, mask, bias=bias), backend.asarray(rng.standard_normal((3, H, 5, 4))),
        *(backend.asarray(x) for x in (q, k, v, mask, bias)))
    dq, dk, dv, dbias = (backend.to_numpy(g) for g in grads)
    for name, g in {"dq": dq, "dk": dk, "dv": dv, "dbias": dbias}.items():
        assert np.all(np.isfinite(g)), f"{name} is not finite"
    assert np.array_equal(dq[0, 1, 2], np.zeros(4))  # the fully masked query row
    assert np.array_equal(dk[1, :, 4], np.zeros((H, 4))) and np.array_equal(dv[1, :, 4], np.zeros((H, 4)))
    assert all(np.array_equal(g[2], np.zeros_like(g[2])) for g in (dq, dk, dv, dbias))  # the hidden batch
    assert np.array_equal(dbias[~mask], np.zeros(np.count_nonzero(~mask)))
    assert np.all(np.any(dq[0, 0] != 0, axis=-1)) and np.any(dk[1, :, 3] != 0)  # the rest is not zero


def test_mha_fully_masked_row_head_and_batch_element_get_exactly_zero_gradient(backend: ModuleType) -> None:
    # head 1 is hidden everywhere as well: its output is 0 whatever its projections, so its rows of
    # w_q, w_k, w_v (weight and bias) and its columns of w_o.weight get exactly zero gradient
    rng = np.random.default_rng(0)
    state = random_state("mha", D, F, rng, F64)
    q, k, v = rng.standard_normal((3, 5, D)), rng.standard_normal((3, 6, D)), rng.standard_normal((3, 6, D))
    mask = _masked_sdpa_mask()
    mask[:, 1] = False  # a fully masked head; batch 0 query 2 now sees no key in any head
    mask[0, 0, 2] = False
    mha = backend.MultiHeadAttention.from_state_dict(state, num_heads=H).eval()
    dq, dk, dv, dparams = _pulled_back(backend, lambda mha, *inputs: mha.vjp(*inputs),
                                       backend.asarray(rng.standard_normal((3, 5, D))), mha,
                                       *(backend.asarray(x) for x in (q, k, v, mask)))
    dq, dk, dv = (backend.to_numpy(g) for g in (dq, dk, dv))
    dparams = _numpy_grads(backend, dparams)
    for name, g in (dparams | {"q": dq, "k": dk, "v": dv}).items():
        assert np.all(np.isfinite(g)), f"d{name} is not finite"
    assert np.array_equal(dq[0, 2], np.zeros(D))  # the fully masked query row
    assert np.array_equal(dk[1, 4], np.zeros(D)) and np.array_equal(dv[1, 4], np.zeros(D))  # a hidden key
    assert all(np.array_equal(g[2], np.zeros((g.shape[1], D))) for g in (dq, dk, dv))  # the hidden batch
    head = slice(D // H, 2 * D // H)  # head 1's d_k rows of the projections
    for projection in ("w_q", "w_k", "w_v"):
        assert np.array_equal(dparams[f"{projection}.weight"][head], np.zeros((D // H, D))), projection
        assert np.array_equal(dparams[f"{projection}.bias"][head], np.zeros(D // H)), projection
    assert np.array_equal(dparams["w_o.weight"][:, head], np.zeros((D, D // H)))
    assert np.any(dparams["w_q.weight"][: D // H] != 0)  # head 0 still learns


def test_block_gradients_are_finite_with_a_fully_masked_row(backend: ModuleType) -> None:
    rng, L = np.random.default_rng(0), 5
    state = random_state("block", D, F, rng, F64)
    mask = np.broadcast_to(np.tril(np.ones((L, L), bool)), (B, 1, L, L)).copy()
    mask[0, 0, 2] = False  # batch 0, query 2 sees no key
    block = backend.TransformerBlock.from_state_dict(state, num_heads=H, norm_first=True,
                                                     activation="gelu").eval()
    x = backend.asarray(rng.standard_normal((B, L, D)))
    dx, dparams = _pulled_back(backend, lambda block, *inputs: block.vjp(*inputs),
                               backend.asarray(rng.standard_normal((B, L, D))), block, x, backend.asarray(mask))
    for name, g in _numpy_grads(backend, dparams | {"x": dx}).items():
        assert np.all(np.isfinite(g)), f"d{name} is not finite"


# ---- 5) a key hidden from query i gets no gradient through query i ------------------------------------


@pytest.mark.parametrize("hide", ["bool-mask", "neg-inf-bias"])
def test_key_hidden_from_a_query_gets_no_gradient_through_it(backend: ModuleType, hide: str) -> None:
    # key j = 3 is hidden only from query i = 1, and d_out is nonzero only in row i: then dP = dO V^T is
    # nonzero only in row i, d_scores[i, j] = P[i, j] * (...) = 0 since P[i, j] = 0, and
    # dk[j] = sum_i' d_scores[i', j] q_i' * scale = 0, dv[j] = sum_i' P[i', j] dO[i'] = 0, exactly
    rng, i, j = np.random.default_rng(0), 1, 3
    q, k, v = _qkv(rng, lead=(), L=4, S=5)
    keep = np.ones((4, 5), bool)
    keep[i, j] = False
    ours = {"mask": keep} if hide == "bool-mask" else {"bias": np.where(keep, 0.0, -np.inf)}
    d_out = np.zeros((4, 4))
    d_out[i] = rng.standard_normal(4)
    args = [backend.asarray(x) for x in (q, k, v)]
    kwargs = {name: backend.asarray(x) for name, x in ours.items()}
    _, _, pullback = backend.scaled_dot_product_attention_vjp(*args, **kwargs)
    _, dk, dv, _ = (None if g is None else backend.to_numpy(g) for g in pullback(backend.asarray(d_out)))
    assert np.array_equal(dk[j], np.zeros(4)) and np.array_equal(dv[j], np.zeros(4))
    assert np.all(np.any(dk[[0, 1, 2, 4]] != 0, axis=-1))  # the keys query i sees do get gradient
    # the control: without hiding key j, the same d_out reaches it
    _, _, pullback = backend.scaled_dot_product_attention_vjp(*args)
    _, dk, dv, _ = pullback(backend.asarray(d_out))
    assert np.any(backend.to_numpy(dk)[j] != 0) and np.any(backend.to_numpy(dv)[j] != 0)


# ---- 6) dtypes -----------------------------------------------------------------------------------------


def _all_gradients(backend: ModuleType, kind: str, dtype: np.dtype) -> dict[str, Any]:
    """Every gradient of one vjp of `kind` ("sdpa" with a bias, "mha" or "block") on `dtype` inputs."""
    rng = np.random.default_rng(0)
    x = backend.asarray(rng.standard_normal((B, 5, D)).astype(dtype))
    d_out = backend.asarray(rng.standard_normal((B, 5, D)).astype(dtype))
    if kind == "sdpa":
        bias = backend.asarray(rng.standard_normal((5, 5)).astype(dtype))
        grads = _pulled_back(backend, lambda x, bias: backend.scaled_dot_product_attention_vjp(x, x, x, bias=bias),
                             d_out, x, bias)
        return dict(zip(("q", "k", "v", "bias"), grads, strict=True))
    state = random_state(kind, D, F, rng, dtype)
    if kind == "mha":
        mha = backend.MultiHeadAttention.from_state_dict(state, num_heads=H).eval()
        dq, dk, dv, dparams = _pulled_back(backend, lambda mha, x: mha.vjp(x, x, x), d_out, mha, x)
        return dparams | {"q": dq, "k": dk, "v": dv}
    block = backend.TransformerBlock.from_state_dict(state, num_heads=H).eval()
    dx, dparams = _pulled_back(backend, lambda block, x: block.vjp(x), d_out, block, x)
    return dparams | {"x": dx}


@pytest.mark.parametrize("kind", ["sdpa", "mha", "block"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_gradients_have_the_dtype_of_the_inputs(backend: ModuleType, kind: str, dtype: type) -> None:
    grads = _all_gradients(backend, kind, np.dtype(dtype))
    assert len(grads) == {"sdpa": 4, "mha": 11, "block": 17}[kind]
    for name, g in _numpy_grads(backend, grads).items():
        assert g.dtype == np.dtype(dtype), f"{kind} d{name}: {g.dtype} from {np.dtype(dtype)} inputs"


@pytest.mark.parametrize("bias_dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_bias_gradient_has_the_bias_dtype(backend: ModuleType, bias_dtype: type) -> None:
    # the bias may differ from q in dtype (it is cast to the scores' dtype); its gradient keeps its own
    q_dtype = np.float64 if bias_dtype == np.float32 else np.float32
    x = backend.asarray(np.random.default_rng(0).standard_normal((B, 3, 4)).astype(q_dtype))
    bias = backend.asarray(np.zeros((3, 3), bias_dtype))
    grads = _pulled_back(backend, lambda x, bias: backend.scaled_dot_product_attention_vjp(x, x, x, bias=bias),
                         backend.asarray(np.ones((B, 3, 4), q_dtype)), x, bias)  # d_out: out's shape and dtype
    dbias = backend.to_numpy(grads[3])
    assert dbias.dtype == np.dtype(bias_dtype) and dbias.shape == (3, 3)


@pytest.mark.parametrize(("L", "S"), [(3, 0), (0, 4)], ids=["S=0", "L=0"])
def test_empty_axes_give_zero_gradients_of_the_inputs_shapes(backend: ModuleType, L: int, S: int) -> None:
    rng = np.random.default_rng(1)
    q, k, v = (backend.asarray(rng.standard_normal(shape)) for shape in ((B, L, 4), (1, S, 4), (S, 2)))
    out, weights, pullback = backend.scaled_dot_product_attention_vjp(q, k, v)
    assert tuple(out.shape) == (B, L, 2) and tuple(weights.shape) == (B, L, S)
    grads = [backend.to_numpy(g) for g in pullback(backend.asarray(np.ones((B, L, 2))))[:3]]
    assert [g.shape for g in grads] == [(B, L, 4), (1, S, 4), (S, 2)]
    assert all(not np.any(g) for g in grads)


def test_torch_vjp_differentiates_frozen_parameters_and_leaves_them_frozen() -> None:
    import attention_torch

    state = random_state("mha", D, F, np.random.default_rng(2), F64)
    mha = attention_torch.MultiHeadAttention.from_state_dict(state, num_heads=H).eval()
    mha.w_q.requires_grad_(False)
    x = torch.tensor(np.random.default_rng(3).standard_normal((B, 5, D)))
    out, _, pullback = mha.vjp(x, x, x)
    frozen = pullback(torch.ones_like(out))[3]
    mha.w_q.requires_grad_(True)
    out, _, pullback = mha.vjp(x, x, x)
    assert not mha.w_q.weight.grad_fn and mha.w_q.weight.grad is None  # the module's own autograd state untouched
    for name, grad in pullback(torch.ones_like(out))[3].items():
        assert torch.equal(frozen[name], grad), name


def test_torch_block_vjp_rejects_dropout_active_in_a_submodule() -> None:
    import attention_torch

    block = attention_torch.TransformerBlock(D, H, F, dropout=0.5).eval()
    block.attn.train()  # torch: a submodule can be put back in training mode on its own
    with pytest.raises(ValueError, match=r"dropout 0\.5 in training mode"):
        block.vjp(torch.zeros(B, 5, D))


def _torch_vjp_run(kind: str, inside: set[str]) -> list[Any]:
    """out, weights and every gradient of a float64 `kind` with a mask (and, for sdpa, a bias), each stage in
    `inside` ("make": the inputs and the module; "vjp"; "pullback") run under torch.inference_mode()."""
    import contextlib

    import attention_torch

    def stage(name: str) -> contextlib.AbstractContextManager:
        return torch.inference_mode() if name in inside else contextlib.nullcontext()

    rng = np.random.default_rng(5)
    with stage("make"):
        x, d_out, bias = (torch.tensor(rng.standard_normal(shape)) for shape in ((B, 5, D), (B, 5, D), (5, 5)))
        if kind == "sdpa":
            mask = torch.tensor(_keep_mask(rng, (B, 5, 5)))
        else:
            mask = torch.tensor(np.arange(5) < np.array([5, 3])[:, None, None, None])  # (B, 1, 1, S)
            cls = attention_torch.MultiHeadAttention if kind == "mha" else attention_torch.TransformerBlock
            module = cls.from_state_dict(random_state(kind, D, F, rng, F64), num_heads=H).eval()
    with stage("vjp"):
        if kind == "sdpa":
            out, weights, pullback = attention_torch.scaled_dot_product_attention_vjp(x, x, x, mask, bias=bias)
        else:
            out, weights, pullback = module.vjp(x, x, x, mask) if kind == "mha" else module.vjp(x, mask)
    with stage("pullback"):
        grads = pullback(d_out)
    flat = [g for grad in grads for g in (grad.values() if isinstance(grad, dict) else [grad])]
    return [out, weights, *flat]


@pytest.mark.parametrize("inside", [{"make", "vjp", "pullback"}, {"vjp", "pullback"}, {"vjp"}, {"pullback"},
                                    {"make"}], ids=["everything", "vjp-and-pullback", "vjp", "pullback", "inputs"])
@pytest.mark.parametrize("kind", ["sdpa", "mha", "block"])
def test_torch_vjp_works_under_inference_mode(kind: str, inside: set[str]) -> None:
    # inference mode records no graph and makes inference tensors, which cannot join one; the vjp leaves the
    # mode for its own forward pass and pullback, so every result equals the one computed outside it
    expected, actual = _torch_vjp_run(kind, set()), _torch_vjp_run(kind, inside)
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a, e), f"result {i} differs under inference mode"
        assert not a.is_inference(), f"result {i} is an inference tensor, which autograd cannot take later"


# ---- 7) errors -----------------------------------------------------------------------------------------


def _pullback(backend: ModuleType, kind: str) -> tuple[Callable, tuple[int, ...]]:
    """A pullback of `kind` and its output's shape (B, 5, D)."""
    rng = np.random.default_rng(0)
    x = backend.asarray(rng.standard_normal((B, 5, D)))
    if kind == "sdpa":
        out, _, pullback = backend.scaled_dot_product_attention_vjp(x, x, x)
    elif kind == "mha":
        mha = backend.MultiHeadAttention.from_state_dict(random_state("mha", D, F, rng, F64), num_heads=H)
        out, _, pullback = mha.eval().vjp(x, x, x)
    else:
        block = backend.TransformerBlock.from_state_dict(random_state("block", D, F, rng, F64), num_heads=H)
        out, _, pullback = block.eval().vjp(x)
    return pullback, tuple(out.shape)


@pytest.mark.parametrize("shape", [(B, 5, D + 1), (B, 4, D), (5, D), (1, B, 5, D)],
                         ids=["width", "length", "rank-lower", "rank-higher"])
@pytest.mark.parametrize("kind", ["sdpa", "mha", "block"])
def test_pullback_rejects_d_out_of_the_wrong_shape(backend: ModuleType, kind: str,
                                                   shape: tuple[int, ...]) -> None:
    pullback, out_shape = _pullback(backend, kind)
    assert out_shape == (B, 5, D)
    with pytest.raises(ValueError, match=r"d_out .*\(2, 5, 8\)"):
        pullback(backend.asarray(np.zeros(shape)))


@pytest.mark.parametrize("kind", ["mha", "block"])
def test_vjp_rejects_active_dropout_and_works_after_eval(backend: ModuleType, kind: str) -> None:
    rng = np.random.default_rng(0)
    state = random_state(kind, D, F, rng, F64)
    x = backend.asarray(rng.standard_normal((B, 5, D)))
    cls = backend.MultiHeadAttention if kind == "mha" else backend.TransformerBlock
    inputs = (x, x, x) if kind == "mha" else (x,)
    module = cls.from_state_dict(state, num_heads=H, dropout=0.1)  # training mode, as constructed
    with pytest.raises(ValueError, match="dropout"):
        module.vjp(*inputs)
    out, _, pullback = module.eval().vjp(*inputs)
    assert all(np.all(np.isfinite(backend.to_numpy(g))) for g in _flat(pullback(backend.asarray(np.ones(out.shape)))))
    # dropout 0 in training mode is deterministic too
    out, _, pullback = cls.from_state_dict(state, num_heads=H, dropout=0.0).vjp(*inputs)
    assert all(np.all(np.isfinite(backend.to_numpy(g))) for g in _flat(pullback(backend.asarray(np.ones(out.shape)))))


def _flat(grads: tuple) -> list[Any]:
    """A pullback's results, the gradient dicts opened up."""
    return [g for item in grads for g in (item.values() if isinstance(item, dict) else [item])]


# ---- 8) the NumPy backend's hand-derived backward passes vs central finite differences -----------------

FD_STEP, FD_RTOL = 1e-6, 1e-6  # truncation O(h^2) ~ 1e-12 and rounding ~ 1e-16 / h ~ 1e-10, relative


def _directional_errors(loss: Callable[[str, np.ndarray], float], point: Mapping[str, np.ndarray],
                        grads: Mapping[str, np.ndarray]) -> dict[str, float]:
    """For each input `name`, along a random direction u: <grad, u> vs
    (loss(name, x + h u) - loss(name, x - h u)) / 2h; relative to |<grad, u>|, or, for a gradient that is
    0 in exact arithmetic, to the largest of the other directional derivatives."""
    rng = np.random.default_rng(7)
    numeric, analytic = {}, {}
    for name, x in point.items():
        u = rng.standard_normal(x.shape)
        numeric[name] = (loss(name, x + FD_STEP * u) - loss(name, x - FD_STEP * u)) / (2 * FD_STEP)
        analytic[name] = float(np.sum(grads[name] * u))
    scale = max(abs(a) for name, a in analytic.items() if name not in ZERO_IN_EXACT_ARITHMETIC)
    return {name: abs(numeric[name] - a) / (scale if name in ZERO_IN_EXACT_ARITHMETIC else abs(a))
            for name, a in analytic.items()}


def _assert_directional_derivatives(loss: Callable, point: Mapping[str, np.ndarray],
                                    grads: Mapping[str, np.ndarray], what: str) -> None:
    for name, error in _directional_errors(loss, point, grads).items():
        assert error <= FD_RTOL, f"{what}: d{name} directional derivative off by {error:.3g} > {FD_RTOL}"


def test_numpy_sdpa_backward_matches_central_differences() -> None:
    import attention_np as M

    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, L=5, S=6, E=4, Ev=3)
    point = {"q": q, "k": k, "v": v, "bias": rng.standard_normal((1, 5, 6))}  # bias broadcast over B, H
    mask, d_out = _masked_sdpa_mask()[:B], rng.standard_normal((B, H, 5, 3))  # with a fully masked row

    def loss(name: str, value: np.ndarray) -> float:
        args = point | {name: value}
        out, _ = M.scaled_dot_product_attention(args["q"], args["k"], args["v"], mask, bias=args["bias"],
                                                scale=0.7)
        return float(np.sum(out * d_out))

    _, _, pullback = M.scaled_dot_product_attention_vjp(q, k, v, mask, bias=point["bias"], scale=0.7)
    grads = dict(zip(point, pullback(d_out), strict=True))
    _assert_directional_derivatives(loss, point, grads, "numpy sdpa")


def test_numpy_mha_backward_matches_central_differences() -> None:
    import attention_np as M

    rng = np.random.default_rng(0)
    state = random_state("mha", D, F, rng, F64)
    inputs = {"q": rng.standard_normal((B, 5, D)), "k": rng.standard_normal((B, 6, D)),
              "v": rng.standard_normal((B, 6, D))}
    mask, d_out = _keep_mask(rng, (B, H, 5, 6)), rng.standard_normal((B, 5, D))

    def loss(name: str, value: np.ndarray) -> float:
        args = (state | inputs) | {name: value}
        mha = M.MultiHeadAttention.from_state_dict({n: args[n] for n in state}, num_heads=H).eval()
        return float(np.sum(mha(args["q"], args["k"], args["v"], mask)[0] * d_out))

    mha = M.MultiHeadAttention.from_state_dict(state, num_heads=H).eval()
    _, _, pullback = mha.vjp(inputs["q"], inputs["k"], inputs["v"], mask)
    dq, dk, dv, dparams = pullback(d_out)
    _assert_directional_derivatives(loss, state | inputs, dparams | {"q": dq, "k": dk, "v": dv}, "numpy mha")


@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_numpy_block_backward_matches_central_differences(block: tuple[bool, str]) -> None:
    import attention_np as M

    norm_first, activation = block
    rng, L = np.random.default_rng(0), 5
    state = random_state("block", D, F, rng, F64)
    x, d_out, mask = rng.standard_normal((B, L, D)), rng.standard_normal((B, L, D)), np.tril(np.ones((L, L)))
    options = {"num_heads": H, "norm_first": norm_first, "activation": activation, "eps": EPS}

    def loss(name: str, value: np.ndarray) -> float:
        args = (state | {"x": x}) | {name: value}
        ours = M.TransformerBlock.from_state_dict({n: args[n] for n in state}, **options).eval()
        return float(np.sum(ours(args["x"], mask)[0] * d_out))

    _, _, pullback = M.TransformerBlock.from_state_dict(state, **options).eval().vjp(x, mask)
    dx, dparams = pullback(d_out)
    _assert_directional_derivatives(loss, state | {"x": x}, dparams | {"x": dx}, f"numpy block {activation}")
