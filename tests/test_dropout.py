"""Dropout: inverted, active only in training, reproducible from the backend's rng, and applied after the
weights are returned."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from tests.conftest import backend_rng, import_backend

D, H, F, B, L = 8, 2, 16, 2, 5  # d_model, heads, d_ff, batch, positions
P = 0.5  # a large dropout probability, so that every output entry is affected
KINDS = ("sdpa", "mha", "block")
Run = Callable[[bool, object], tuple[np.ndarray, np.ndarray]]


def _module(M: ModuleType, kind: str, dropout: float) -> object:
    """MHA or block holding one fixed float64 state, in training mode."""
    if kind == "mha":
        names = [f"w_{p}.{part}" for p in "qkvo" for part in ("weight", "bias")]
        shapes = {name: (D, D) if name.endswith("weight") else (D,) for name in names}
        cls = M.MultiHeadAttention
    else:
        shapes = {f"attn.w_{p}.{part}": (D, D) if part == "weight" else (D,)
                  for p in "qkvo" for part in ("weight", "bias")}
        shapes |= {f"norm{i}.{part}": (D,) for i in (1, 2) for part in ("weight", "bias")}
        shapes |= {"ffn.0.weight": (F, D), "ffn.0.bias": (F,), "ffn.3.weight": (D, F), "ffn.3.bias": (D,)}
        cls = M.TransformerBlock
    rng = np.random.default_rng(0)
    state = {name: 0.5 * rng.standard_normal(shape) for name, shape in shapes.items()}
    return cls.from_state_dict(state, num_heads=H, dropout=dropout)


def _runner(M: ModuleType, kind: str, dropout: float = P) -> Run:
    """run(training, rng) -> (out, weights) as NumPy arrays, for one fixed float64 input of SDPA
    (dropout_p = dropout in training, 0 otherwise), MHA or the block."""
    x = M.asarray(np.random.default_rng(1).standard_normal((B, L, D)))
    if kind == "sdpa":
        def call(training: bool, rng: object) -> tuple:
            return M.scaled_dot_product_attention(x, x, x, dropout_p=dropout if training else 0.0, rng=rng)
    else:
        module = _module(M, kind, dropout)

        def call(training: bool, rng: object) -> tuple:
            m = module.train(training)  # torch switches in place, NumPy and JAX return a new module
            return m(x, x, x, rng=rng) if kind == "mha" else m(x, rng=rng)

    def run(training: bool, rng: object) -> tuple[np.ndarray, np.ndarray]:
        out, weights = call(training, rng)
        return M.to_numpy(out), M.to_numpy(weights)

    return run


@pytest.mark.parametrize("kind", ["mha", "block"])
def test_eval_mode_is_deterministic_and_equals_no_dropout(backend, kind: str):
    run, no_dropout = _runner(backend, kind), _runner(backend, kind, dropout=0.0)
    first, second, reference = run(False, None), run(False, None), no_dropout(True, None)
    for a, b, c in zip(first, second, reference, strict=True):
        assert np.array_equal(a, b)
        assert np.array_equal(a, c)


@pytest.mark.parametrize("kind", KINDS)
def test_training_mode_changes_the_output(backend, kind: str):
    run = _runner(backend, kind)
    trained, evaluated = run(True, backend_rng(backend, 0))[0], run(False, None)[0]
    assert not np.allclose(trained, evaluated)


@pytest.mark.parametrize("kind", KINDS)
def test_same_rng_reproduces_the_output(backend, kind: str):
    run = _runner(backend, kind)
    first, second = run(True, backend_rng(backend, 0)), run(True, backend_rng(backend, 0))
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_different_rngs_give_different_outputs(backend, kind: str):
    run = _runner(backend, kind)
    assert not np.array_equal(run(True, backend_rng(backend, 0))[0], run(True, backend_rng(backend, 1))[0])


@pytest.mark.parametrize("kind", KINDS)
def test_weights_are_returned_before_dropout(backend, kind: str):
    run = _runner(backend, kind)
    trained, evaluated = run(True, backend_rng(backend, 0))[1], run(False, None)[1]
    np.testing.assert_allclose(trained.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
    assert np.array_equal(trained, evaluated)


def test_sdpa_dropout_mean_over_draws_approaches_the_output_without_dropout(backend):
    # N independent draws in one call: q carries a leading axis of N copies, so the weights and their
    # dropout mask are (N, L, S), the mask drawn afresh for each copy while the weights w stay the same.
    N, S, E = 4000, 4, 4
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((L, E)), rng.standard_normal((S, E))
    v = 0.5 + rng.random((S, E))  # entries in [0.5, 1.5]: every output entry is at least 0.5
    out, weights = (backend.to_numpy(a) for a in backend.scaled_dot_product_attention(
        *(backend.asarray(a) for a in (q, k, v))))
    dropped, _ = backend.scaled_dot_product_attention(
        *(backend.asarray(a) for a in (np.tile(q, (N, 1, 1)), k, v)), dropout_p=P, rng=backend_rng(backend, 0))
    dropped = backend.to_numpy(dropped)  # (N, L, E)
    # Inverted dropout: out_ie = sum_j w_ij m_j / (1 - p) v_je with m_j ~ Bernoulli(1 - p), so the mean
    # is w v exactly and the variance of one draw is p / (1 - p) * sum_j w_ij^2 v_je^2. The mean of N
    # draws then lies within 5 standard deviations sqrt(var / N) (two-sided chance 6e-7 per entry for a
    # near-normal mean); forgetting the 1 / (1 - p) scale would be off by p * out >= 0.25, 30 times more.
    std = np.sqrt(P / (1 - P) * (weights**2 @ v**2) / N)  # (L, E)
    assert np.all(np.abs(dropped.mean(axis=0) - out) <= 5 * std)
    assert np.all(dropped.std(axis=0) > 0)  # dropout was active


@pytest.mark.parametrize("kind", KINDS)
def test_jax_dropout_without_rng_raises(kind: str):
    M = import_backend("attention_jax")
    with pytest.raises(ValueError, match="rng"):
        _runner(M, kind)(True, None)


@pytest.mark.parametrize("kind", KINDS)
def test_jax_needs_no_rng_when_dropout_is_off(kind: str):
    M = import_backend("attention_jax")
    run = _runner(M, kind, dropout=0.0)
    assert np.array_equal(run(True, None)[0], run(False, None)[0])
