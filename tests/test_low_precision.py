"""float16 and bfloat16: accepted wherever the framework has them, the output keeps the input dtype, and the
error against float64 is at most twice that of the framework's own implementation on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest

import attention_np
from conformance.bench.baselines import random_state, torch_encoder_layer

B, H, L, E = 2, 4, 48, 16


def _inputs(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, H, L, E)) for _ in range(3))
    mask = rng.random((B, 1, L, L)) > 0.2
    mask[..., 0] = True  # every query sees a key: the frameworks' built-ins differ on fully masked rows
    return q, k, v, mask


def _error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(actual, np.float64) - expected)) / np.max(np.abs(expected)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
def test_torch_sdpa_error_is_at_most_twice_torchs_own(dtype: str, need_weights: bool):
    torch = pytest.importorskip("torch")
    import attention_torch

    q, k, v, mask = (torch.tensor(x) for x in _inputs())
    q, k, v = (x.to(getattr(torch, dtype)) for x in (q, k, v))
    exact = attention_np.scaled_dot_product_attention(*(x.double().numpy() for x in (q, k, v)), mask.numpy())[0]
    ours, weights = attention_torch.scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert ours.dtype == q.dtype and (weights is None or weights.dtype == q.dtype)
    assert _error(ours.double().numpy(), exact) <= 2 * _error(theirs.double().numpy(), exact)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
def test_jax_sdpa_error_is_at_most_twice_jaxs_own(dtype: str, need_weights: bool):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import attention_jax

    q, k, v, mask = _inputs()
    q, k, v = (jnp.asarray(x, getattr(jnp, dtype)) for x in (q, k, v))
    exact = attention_np.scaled_dot_product_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), mask)[0]
    ours, weights = attention_jax.scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
    with jax.numpy_dtype_promotion("standard"):  # jax's own function mixes float32 into low precision itself
        theirs = jax.nn.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), mask=mask)  # (B, L, H, E)
    assert ours.dtype == q.dtype and (weights is None or weights.dtype == q.dtype)
    assert _error(ours, exact) <= 2 * _error(jnp.swapaxes(theirs, 1, 2), exact)


def test_numpy_float16_keeps_its_dtype_and_beats_the_plain_float16_formulation():
    # NumPy has no attention of its own: the reference is the tutorial's formulation computed in float16
    q, k, v, mask = (x.astype(np.float16) if x.dtype != bool else x for x in _inputs())
    exact = attention_np.scaled_dot_product_attention(*(x.astype(np.float64) for x in (q, k, v)), mask)[0]
    scores = q @ np.swapaxes(k, -1, -2) / np.float16(np.sqrt(E))
    scores = np.exp(np.where(mask, scores, np.float16(-6e4)) - scores.max(axis=-1, keepdims=True))
    plain = (scores / scores.sum(axis=-1, keepdims=True)) @ v
    for need_weights in (True, False):
        ours, _ = attention_np.scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
        assert ours.dtype == np.float16
        assert _error(ours, exact) <= 2 * _error(plain, exact)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_block_error_is_at_most_twice_torchs_own(dtype: str):
    torch = pytest.importorskip("torch")
    import attention_torch

    state = random_state("block", 64, 128, np.random.default_rng(1), np.float64)
    x = np.random.default_rng(2).standard_normal((B, L, 64))
    low = {name: torch.tensor(value).to(getattr(torch, dtype)) for name, value in state.items()}
    tx = torch.tensor(x).to(getattr(torch, dtype))
    exact = attention_np.TransformerBlock.from_state_dict({n: t.double().numpy() for n, t in low.items()},
                                                          num_heads=H).eval()(tx.double().numpy())[0]
    ours = attention_torch.TransformerBlock.from_state_dict(low, num_heads=H).eval()(tx)[0]
    layer = torch_encoder_layer({n: t.double().numpy() for n, t in low.items()}, num_heads=H, norm_first=False,
                                activation="relu", eps=1e-5, dtype=np.float64).to(getattr(torch, dtype))
    with torch.no_grad():
        theirs = layer(tx)
    assert ours.dtype == tx.dtype
    assert _error(ours.detach().double().numpy(), exact) <= 2 * _error(theirs.double().numpy(), exact)


def test_bfloat16_arrays_convert_to_numpy_exactly(backend):
    # NumPy has no bfloat16: to_numpy gives ml_dtypes' bfloat16, value for value
    pytest.importorskip("ml_dtypes")
    if backend.__name__ == "attention_np":
        pytest.skip("NumPy has no bfloat16 arithmetic")
    values = np.array([1.0, -2.5, 3.140625, 1e-3], np.float32)
    if backend.__name__ == "attention_torch":
        import torch

        native = torch.tensor(values).to(torch.bfloat16)
    else:
        import jax.numpy as jnp

        native = jnp.asarray(values, jnp.bfloat16)
    converted = backend.to_numpy(native)
    assert converted.dtype.name == "bfloat16"
    assert np.array_equal(converted.astype(np.float32), values.astype(converted.dtype).astype(np.float32))
