"""The original tutorial's smoke test, on every backend: default-sized modules on a (2, 10, 512) batch."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the original's default sizes: d_model 512, d_ff 2048

B, L, D, H = 2, 10, 512, 8  # the tutorial's batch, sequence length, d_model and heads


def _dropout_rng(M: ModuleType) -> object:
    """The rng a module in training mode needs: JAX has no global randomness, the others may use None."""
    if M.__name__ == "attention_jax":
        import jax

        return jax.random.key(0)
    return None


def _x() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((B, L, D)).astype(np.float32)


def test_transformer_block_keeps_the_input_shape_and_returns_per_head_weights(backend):
    block = backend.TransformerBlock()
    out, weights = block(backend.asarray(_x()), rng=_dropout_rng(backend))
    out, weights = backend.to_numpy(out), backend.to_numpy(weights)
    assert out.shape == (B, L, D)
    assert weights.shape == (B, H, L, L)
    assert out.dtype == weights.dtype == np.float32
    assert np.all(np.isfinite(out))


def test_multi_head_attention_keeps_the_input_shape_and_returns_per_head_weights(backend):
    mha = backend.MultiHeadAttention()
    x = backend.asarray(_x())
    out, weights = mha(x, x, x, rng=_dropout_rng(backend))
    out, weights = backend.to_numpy(out), backend.to_numpy(weights)
    assert out.shape == (B, L, D)
    assert weights.shape == (B, H, L, L)
    assert out.dtype == weights.dtype == np.float32
    assert np.all(np.isfinite(out))
