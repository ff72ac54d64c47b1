"""need_weights=False takes each backend's fast path: the same numbers as the explicit path, and the
same rules (fully masked rows give zeros, and zero gradient through autodiff)."""

from __future__ import annotations

import numpy as np
import pytest

from tests._compare import assert_close


def _case(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 2))
    mask = rng.random((2, 4, 5)) > 0.3
    mask[0, 1] = False  # query 1 of sequence 0 sees no key
    bias = rng.standard_normal((4, 5))
    bias[2, 3] = -np.inf
    return q, k, v, mask, bias


@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"mask": True}, {"mask": True, "bias": True},
                                     {"bias": True, "is_causal": True}], ids=str)
def test_fast_path_equals_the_explicit_path(backend, options):
    q, k, v, mask, bias = (backend.asarray(x) for x in _case())
    kwargs = {"mask": mask if options.get("mask") else None, "bias": bias if options.get("bias") else None,
              "is_causal": options.get("is_causal", False)}
    explicit, weights = backend.scaled_dot_product_attention(q, k, v, **kwargs)
    fast, none = backend.scaled_dot_product_attention(q, k, v, need_weights=False, **kwargs)
    assert weights is not None and none is None
    assert_close(backend.to_numpy(fast), backend.to_numpy(explicit), 1e-12, "fast vs explicit")


def test_fast_path_gives_zeros_for_a_fully_masked_row(backend):
    q, k, v, mask, _ = (backend.asarray(x) for x in _case())
    out, _ = backend.scaled_dot_product_attention(q, k, v, mask, need_weights=False)
    assert np.array_equal(backend.to_numpy(out)[0, 1], np.zeros(2))


def test_fast_path_gradient_is_zero_and_finite_for_a_fully_masked_row_jax():
    jax = pytest.importorskip("jax")
    import attention_jax

    q, k, v, mask, bias = _case()
    # d/dq of sum(out): row 1 of sequence 0 sees no key, so its output is 0 whatever q is
    dq = jax.grad(lambda q: attention_jax.scaled_dot_product_attention(
        q, k, v, mask, bias=bias, need_weights=False)[0].sum())(q)
    assert np.all(np.isfinite(dq)) and np.array_equal(np.asarray(dq)[0, 1], np.zeros(3))


def test_fast_path_gradient_is_zero_and_finite_for_a_fully_masked_row_torch():
    torch = pytest.importorskip("torch")
    import attention_torch

    q, k, v, mask, bias = (torch.tensor(x) for x in _case())
    q.requires_grad_()
    out, _ = attention_torch.scaled_dot_product_attention(q, k, v, mask, bias=bias, need_weights=False)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[0, 1], torch.zeros(3, dtype=q.dtype))


def test_active_dropout_keeps_the_explicit_path_and_its_rng(backend):
    # dropout needs the caller's rng, which fused kernels do not take: the same rng reproduces the output
    q, k, v, mask, _ = (backend.asarray(x) for x in _case())
    rng = {"attention_jax": lambda: __import__("jax").random.key(3),
           "attention_torch": lambda: __import__("torch").Generator().manual_seed(3)}.get(backend.__name__, lambda: 3)
    first, none = backend.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.5, need_weights=False, rng=rng())
    again, _ = backend.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.5, need_weights=False, rng=rng())
    assert none is None and np.array_equal(backend.to_numpy(first), backend.to_numpy(again))
