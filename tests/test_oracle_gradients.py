"""The oracle's own vector-Jacobian products (conformance/contract/oracle_gradients.py) in float64, against central
differences of the oracle's forward and against attention_np's hand-derived backward: two independent checks."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes  # noqa: F401  (gives NumPy the name bfloat16)
import numpy as np
import pytest

import attention_np
from attention_np.common import mods
from conformance.contract import oracle, oracle_gradients

STEP = 1e-6  # central differences of tiny, well-conditioned cases: truncation ~ STEP^2, rounding ~ 1e-16 / STEP


def _directional(forward: Callable[..., np.ndarray], arrays: dict[str, np.ndarray], d_out: np.ndarray,
                 name: str, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """<d_out, (f(a + h u) - f(a - h u)) / 2h> for argument `name` along a random u (0 where a is -inf)."""
    value = arrays[name]
    u = np.where(np.isfinite(value), rng.standard_normal(value.shape), 0.0)
    plus, minus = (forward(**arrays | {name: value + sign * STEP * u}) for sign in (1, -1))
    return float(np.sum(d_out * (plus - minus)) / (2 * STEP)), u


def _assert_matches_differences(forward: Callable[..., np.ndarray], vjp: Callable[..., dict], arrays: dict,
                                               seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d_out = rng.standard_normal(forward(**arrays).shape)
    grads = vjp(**arrays, d_out=d_out)
    assert set(grads) == set(arrays)
    for name, grad in grads.items():
        assert grad.shape == np.shape(arrays[name]) and grad.dtype == np.float64
        difference, u = _directional(forward, arrays, d_out, name, rng)
        assert abs(np.sum(grad * u) - difference) <= 1e-6 * (1 + abs(difference)), name
    return grads


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


SDPA_CASES = {  # keywords of oracle.sdpa; q (2, 2, 3, 4), k and v (2, 2 or 1, 5, 4 | 3) unless grouped
    "plain": {},
    "causal_with_offset": {"is_causal": True, "q_offset": 1},
    "softcap": {"softcap": 1.5, "scale": 2.0},
    "window": {"window": (1, 2), "q_offset": np.array([[0], [2]])},
    "key_lengths_per_sequence": {"key_lengths": np.array([[2], [5]])},
    "grouped_heads": {"enable_gqa": True, "is_causal": True},
    "mask": {"mask": np.array([[1, 0, 1, 1, 0], [0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], bool)},
}


@pytest.mark.parametrize("name", sorted(SDPA_CASES))
def test_sdpa_vjp_matches_central_differences_and_attention_np(name: str):
    rng = np.random.default_rng(1)
    keywords = dict(SDPA_CASES[name])
    Hkv = 1 if keywords.get("enable_gqa") else 2
    arrays = {"q": _rand(rng, 2, 2, 3, 4), "k": _rand(rng, 2, Hkv, 5, 4), "v": _rand(rng, 2, Hkv, 5, 3)}
    mask = keywords.pop("mask", None)

    def forward(**a: np.ndarray) -> np.ndarray:
        return oracle.sdpa(a["q"], a["k"], a["v"], mask, **keywords)[0]

    def vjp(d_out: np.ndarray, **a: np.ndarray) -> dict:
        return oracle_gradients.sdpa_vjp(a["q"], a["k"], a["v"], d_out, mask, **keywords)

    grads = _assert_matches_differences(forward, vjp, arrays)
    d_out = np.random.default_rng(0).standard_normal(forward(**arrays).shape)
    _, _, pullback = attention_np.scaled_dot_product_attention_vjp(arrays["q"], arrays["k"], arrays["v"], mask,
                                                                   **keywords)
    theirs = dict(zip(("q", "k", "v"), pullback(d_out), strict=False))
    for key in ("q", "k", "v"):
        np.testing.assert_allclose(grads[key], theirs[key], rtol=1e-12, atol=1e-12)


def test_sdpa_vjp_sums_a_broadcast_bias_and_passes_no_gradient_through_a_hidden_key():
    rng = np.random.default_rng(2)
    bias = _rand(rng, 1, 3, 4)  # (1, L, S): broadcast over the batch of 2
    bias[0, 1, 2] = -np.inf  # key 2 hidden from query 1
    arrays = {"q": _rand(rng, 2, 3, 4), "k": _rand(rng, 2, 4, 4), "v": _rand(rng, 2, 4, 2), "bias": bias}

    def forward(**a: np.ndarray) -> np.ndarray:
        return oracle.sdpa(a["q"], a["k"], a["v"], bias=a["bias"])[0]

    def vjp(d_out: np.ndarray, **a: np.ndarray) -> dict:
        return oracle_gradients.sdpa_vjp(a["q"], a["k"], a["v"], d_out, bias=a["bias"])

    grads = _assert_matches_differences(forward, vjp, arrays)
    assert grads["bias"].shape == (1, 3, 4) and grads["bias"][0, 1, 2] == 0


def test_a_query_that_sees_no_key_gets_zero_gradient_and_gives_none():
    rng = np.random.default_rng(3)
    q, k, v = _rand(rng, 3, 4), _rand(rng, 4, 4), _rand(rng, 4, 2)
    mask = np.ones((3, 4), bool)
    mask[1] = False  # query 1 sees nothing: its out is zeros whatever q, k, v are
    grads = oracle_gradients.sdpa_vjp(q, k, v, np.ones((3, 2)), mask)
    assert np.all(grads["q"][1] == 0)
    only_row_1 = oracle_gradients.sdpa_vjp(q, k, v, np.eye(3)[:, [1]] * np.ones((3, 2)), mask)
    assert all(np.all(grad == 0) for grad in only_row_1.values())


def test_sdpa_vjp_refuses_mods():
    q = np.ones((1, 1, 2, 2))
    with pytest.raises(NotImplementedError, match="mask_mod"):
        oracle_gradients.sdpa_vjp(q, q, q, q, mask_mod=mods.causal())


LINEAR_CASES = {  # keywords of oracle.linear_attention; q (2, 3, 2), k and v (2, 3, 2 | 3); eps large enough to
    # keep the central differences resolvable
    "elu": {"eps": 1e-3},
    "relu_causal": {"feature_map": "relu", "is_causal": True, "eps": 1e-3},
    "identity": {"feature_map": "identity", "eps": 1.0},
    "key_lengths": {"key_lengths": np.array([1, 3]), "eps": 1e-3},
}


@pytest.mark.parametrize("name", sorted(LINEAR_CASES))
def test_linear_attention_vjp_matches_central_differences_and_attention_np(name: str):
    rng = np.random.default_rng(4)
    keywords = LINEAR_CASES[name]
    arrays = {"q": _rand(rng, 2, 3, 2) + 0.5, "k": _rand(rng, 2, 3, 2) + 0.5, "v": _rand(rng, 2, 3, 3)}  # relu: off
    # its kink

    def forward(**a: np.ndarray) -> np.ndarray:
        return oracle.linear_attention(a["q"], a["k"], a["v"], **keywords)

    def vjp(d_out: np.ndarray, **a: np.ndarray) -> dict:
        return oracle_gradients.linear_attention_vjp(a["q"], a["k"], a["v"], d_out, **keywords)

    grads = _assert_matches_differences(forward, vjp, arrays)
    d_out = np.random.default_rng(0).standard_normal(forward(**arrays).shape)
    _, pullback = attention_np.linear_attention_vjp(arrays["q"], arrays["k"], arrays["v"], **keywords)
    for key, theirs in zip(("q", "k", "v"), pullback(d_out), strict=True):
        np.testing.assert_allclose(grads[key], theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_plain_low_precision_vjp_loses_a_few_roundings(dtype: str):
    """In `dtype` each stored tensor is rounded: the gradients come back in dtype, within a few units of its
    rounding of the float64 ones (the inputs rounded to dtype first, as the suite's `rounded` does)."""
    rng = np.random.default_rng(5)
    q, k, v, d_out = (np.asarray(x, dtype).astype(np.float64) for x in (
        _rand(rng, 2, 4, 4), _rand(rng, 2, 6, 4), _rand(rng, 2, 6, 3), _rand(rng, 2, 4, 3)))
    unit = float(np.finfo(np.dtype(dtype)).eps) if dtype != "bfloat16" else 2.0**-7
    exact = oracle_gradients.sdpa_vjp(q, k, v, d_out, is_causal=True)
    plain = oracle_gradients.sdpa_vjp(q, k, v, d_out, is_causal=True, dtype=dtype)
    for name in ("q", "k", "v"):
        assert plain[name].dtype == np.dtype(dtype)
        error = np.max(np.abs(plain[name].astype(np.float64) - exact[name])) / np.max(np.abs(exact[name]))
        assert 0 < error <= 20 * unit, name
