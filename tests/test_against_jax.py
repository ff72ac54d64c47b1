"""The JAX backend against jax.nn.dot_product_attention, where the two specs agree.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width.

jax.nn.dot_product_attention lays out q, k, v as (B, T, N, H) = batch, sequence, heads, head width, i.e.
our (B, L, H, E); its mask and bias are (B, N, T, S) = our (B, H, L, S), its boolean mask True = takes
part, as ours. It needs v as wide as k (no E != Ev). Where the specs differ: a query with no visible key
gets zeros from us and the plain mean of v from jax (it fills hidden scores with a large finite negative
number, so the softmax of an all-hidden row is uniform).

Precision: jax.nn.dot_product_attention always computes the softmax in float32 ("Softmax and it is always
carried out in fp32", jax/_src/nn/functions.py), so for float64 inputs its result is only float32-accurate
and the float64 comparisons use the float32 tolerance; test_jax_reference_is_only_float32_accurate_in_float64
pins that, and fails (time to tighten) the day jax computes float64 in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests._compare import TOLERANCE, assert_close, relative_error
from tests.conftest import import_backend

jax = pytest.importorskip("jax")

B, H, L, S, E = 2, 2, 5, 7, 4
REFERENCE_TOLERANCE = TOLERANCE[np.dtype(np.float32)]  # jax's softmax is float32 for every input dtype


@pytest.fixture(params=[np.float32, np.float64], ids=["float32", "float64"])
def dtype(request: pytest.FixtureRequest) -> np.dtype:
    return np.dtype(request.param)


def _qkv(rng: np.random.Generator, dtype: np.dtype, S: int = S) -> tuple[np.ndarray, ...]:
    """Standard normal q (B, H, L, E), k and v (B, H, S, E)."""
    return tuple(rng.standard_normal((B, H, n, E)).astype(dtype) for n in (L, S, S))


def _keep_mask(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A random boolean keep-mask with at least one visible key in every row (no fully masked row)."""
    mask = rng.random(shape) < 0.5
    np.put_along_axis(mask, rng.integers(shape[-1], size=(*shape[:-1], 1)), True, axis=-1)
    return mask


def _both(q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    """Our output and jax's, both (B, H, L, E); mask, bias, is_causal and scale go to both alike."""
    M = import_backend("attention_jax")
    ours, _ = M.scaled_dot_product_attention(*(M.asarray(x) for x in (q, k, v)),
                                             **{name: _native(M, x) for name, x in kwargs.items()})
    to_jax = [M.asarray(np.swapaxes(x, 1, 2)) for x in (q, k, v)]  # (B, H, n, E) -> (B, n, H, E)
    with jax.numpy_dtype_promotion("standard"):  # jax's own function mixes float32 into float64 inputs
        theirs = jax.nn.dot_product_attention(*to_jax, **{name: _native(M, x) for name, x in kwargs.items()})
    return M.to_numpy(ours), np.swapaxes(M.to_numpy(theirs), 1, 2)  # (B, L, H, E) -> (B, H, L, E)


def _native(M: Any, x: Any) -> Any:
    return M.asarray(x) if isinstance(x, np.ndarray) else x


CASES = {
    "no-mask": lambda rng, dtype: {},
    "bool-mask-(B,1,L,S)": lambda rng, dtype: {"mask": _keep_mask(rng, (B, 1, L, S))},
    "bool-mask-(B,H,L,S)": lambda rng, dtype: {"mask": _keep_mask(rng, (B, H, L, S))},
    "bias": lambda rng, dtype: {"bias": rng.standard_normal((B, H, L, S)).astype(dtype)},
    "bias-with-neg-inf": lambda rng, dtype: {"bias": np.where(
        _keep_mask(rng, (B, H, L, S)), rng.standard_normal((B, H, L, S)), -np.inf).astype(dtype)},
    "custom-scale": lambda rng, dtype: {"scale": 0.3},
}


@pytest.mark.parametrize("build", CASES.values(), ids=CASES.keys())
def test_sdpa_matches_jax_dot_product_attention(dtype: np.dtype, build: Any) -> None:
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, dtype)
    ours, theirs = _both(q, k, v, **build(rng, dtype))
    assert_close(ours, theirs, REFERENCE_TOLERANCE, "out")


def test_is_causal_matches_jax_dot_product_attention_when_L_equals_S(dtype: np.dtype) -> None:
    q, k, v = _qkv(np.random.default_rng(0), dtype, S=L)
    ours, theirs = _both(q, k, v, is_causal=True)
    assert_close(ours, theirs, REFERENCE_TOLERANCE, "out")


def test_fully_masked_row_gives_zeros_where_jax_gives_the_mean_of_v(dtype: np.dtype) -> None:
    # the documented difference: softmax over no visible key is zeros for us; jax fills hidden scores
    # with a large finite negative number, so all-hidden scores are equal and the weights are 1 / S each
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, dtype)
    mask = _keep_mask(rng, (B, H, L, S))
    mask[0, 1, 2] = False  # batch 0, head 1, query 2 sees no key
    ours, theirs = _both(q, k, v, mask=mask)
    assert np.all(ours[0, 1, 2] == 0)
    assert_close(theirs[0, 1, 2], v[0, 1].mean(axis=0), REFERENCE_TOLERANCE, "jax's fully masked row")
    others = np.ones(ours.shape[:3], bool)
    others[0, 1, 2] = False
    assert_close(ours[others], theirs[others], REFERENCE_TOLERANCE, "the other rows")


def test_jax_reference_is_only_float32_accurate_in_float64() -> None:
    # why the float64 cases above use the float32 tolerance: jax's softmax is float32, so its float64
    # output misses ours (float64 throughout) by far more than the float64 tolerance
    q, k, v = _qkv(np.random.default_rng(0), np.dtype(np.float64))
    ours, theirs = _both(q, k, v)
    assert theirs.dtype == np.float64
    assert TOLERANCE[np.dtype(np.float64)] < relative_error(ours, theirs) <= REFERENCE_TOLERANCE
