"""On CUDA the fast paths hand float16 and bfloat16 to the frameworks' fused kernels (torch's flash and
memory-efficient kernels, cuDNN's through jax.nn.dot_product_attention) and keep every rule of the spec.

Every test here needs a CUDA GPU and is skipped without one; `bash scripts/gpu-check.sh` runs them with the
GPU benchmarks. Errors are relative, against float64 on the same rounded inputs, and held to the spec's
low-precision rule: at most twice the error of the framework's own kernel on the same inputs.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

import attention_np
from tests._compare import REORDERED, assert_close, relative_error

B, H, L, E = 2, 4, 128, 64


@pytest.fixture
def torch_cuda() -> ModuleType:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    return torch


@pytest.fixture
def jax_cuda() -> ModuleType:
    jax = pytest.importorskip("jax")
    try:
        jax.devices("cuda")
    except RuntimeError:
        pytest.skip("JAX sees no CUDA GPU")
    return jax


def _inputs(seed: int = 0) -> tuple[np.ndarray, ...]:
    """q, k, v (B, H, L, E) and a mask (B, 1, L, L) that hides every key from query 5 of sequence 0."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, H, L, E)) for _ in range(3))
    mask = rng.random((B, 1, L, L)) > 0.3
    mask[0, 0, 5] = False
    return q, k, v, mask


def _exact(q, k, v, mask=None, **options) -> np.ndarray:
    """The float64 result on the inputs exactly as rounded to the low-precision dtype."""
    as64 = (np.asarray(x, np.float64) for x in (q, k, v))
    return attention_np.scaled_dot_product_attention(*as64, mask, **options)[0]


# --- torch -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_torch_fast_path_on_cuda_has_the_kernels_error_in_half_precision(torch_cuda, dtype, masked):
    torch, F = torch_cuda, torch_cuda.nn.functional
    import attention_torch

    q, k, v, mask = _inputs()
    mask = mask if masked else np.ones_like(mask)
    q, k, v = (torch.tensor(x, device="cuda").to(getattr(torch, dtype)) for x in (q, k, v))
    ours, _ = attention_torch.scaled_dot_product_attention(q, k, v, torch.tensor(mask, device="cuda"),
                                                            need_weights=False)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor(mask, device="cuda"))
    assert ours.dtype == q.dtype and ours.device == q.device
    exact = _exact(*(x.cpu().double() for x in (q, k, v)), mask)
    ours, theirs = (x.cpu().double().numpy() for x in (ours, theirs))
    assert np.all(np.isfinite(ours))
    seen = np.broadcast_to(mask.any(axis=-1, keepdims=True), exact.shape)  # False: a query that sees no key
    assert np.array_equal(ours[~seen], np.zeros(int((~seen).sum())))
    # their kernel gives NaN or the average for a fully masked row: compare the rows that see a key
    ours, theirs, exact = (np.where(seen, x, 0.0) for x in (ours, theirs, exact))
    assert relative_error(ours, exact) <= 2 * relative_error(theirs, exact)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_fast_path_on_cuda_equals_the_explicit_path(torch_cuda, dtype):
    torch = torch_cuda
    import attention_torch

    q, k, v, mask = (torch.tensor(x, device="cuda") for x in _inputs())
    q, k, v = (x.to(getattr(torch, dtype)) for x in (q, k, v))
    bias = torch.randn(L, L, device="cuda", dtype=q.dtype)
    options = {"bias": bias, "is_causal": True}
    explicit, _ = attention_torch.scaled_dot_product_attention(q, k, v, mask, **options)
    fast, _ = attention_torch.scaled_dot_product_attention(q, k, v, mask, need_weights=False, **options)
    assert fast.device.type == "cuda"
    tolerance = 1e-5 if dtype == "float32" else REORDERED
    assert_close(fast.cpu().numpy(), explicit.cpu().numpy(), tolerance, "fast vs explicit")


# --- JAX -------------------------------------------------------------------------------------------------


def _jax_run(jax: ModuleType, **options) -> object:
    import attention_jax

    return jax.jit(lambda q, k, v: attention_jax.scaled_dot_product_attention(q, k, v, need_weights=False,
                                                                             **options)[0])


def _jax_builtin(jax: ModuleType, q, k, v, *, implementation: str, is_causal: bool = False) -> object:
    """jax.nn.dot_product_attention in our (B, H, L, E) layout."""
    import jax.numpy as jnp

    with jax.numpy_dtype_promotion("standard"):  # it mixes float32 into half precision itself
        out = jax.nn.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), is_causal=is_causal,
                                           implementation=implementation)
    return jnp.swapaxes(out, 1, 2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_jax_half_precision_without_a_mask_runs_cudnn_with_its_error(jax_cuda, dtype, is_causal):
    jax = jax_cuda
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(x, dtype) for x in _inputs()[:3])
    run = _jax_run(jax, is_causal=is_causal)
    assert "cudnn" in run.lower(q, k, v).compile().as_text().lower()  # the fused kernel, not XLA's formulation
    exact = _exact(q, k, v, is_causal=is_causal)
    ours = np.asarray(run(q, k, v), np.float64)
    errors = [relative_error(np.asarray(_jax_builtin(jax, q, k, v, implementation=name, is_causal=is_causal),
                                        np.float64), exact) for name in ("xla", "cudnn")]
    assert relative_error(ours, exact) <= 2 * max(errors)


def test_jax_half_precision_with_a_mask_keeps_the_formulation_on_cuda(jax_cuda):
    jax = jax_cuda
    import jax.numpy as jnp

    q, k, v, mask = _inputs()
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    run = jax.jit(lambda q, k, v, mask: __import__("attention_jax").scaled_dot_product_attention(
        q, k, v, mask, need_weights=False)[0])
    assert "cudnn" not in run.lower(q, k, v, mask).compile().as_text().lower()
    out = np.asarray(run(q, k, v, mask), np.float64)
    assert np.array_equal(out[0, :, 5], np.zeros((H, E)))  # query 5 of sequence 0 sees no key
    # float32 sums rounded once to bfloat16: half an ulp (2**-9) of the largest entry at most; twice that
    assert relative_error(out, _exact(q, k, v, mask)) <= 2**-8


def test_jax_gradient_through_cudnn_has_the_kernels_error(jax_cuda):
    jax = jax_cuda
    import jax.numpy as jnp

    import attention_jax

    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs()[:3])
    d_out = jnp.asarray(np.random.default_rng(4).standard_normal((B, H, L, E)), jnp.bfloat16)

    def grads(attend, *inputs):
        _, pullback = jax.vjp(attend, *inputs)
        return [np.asarray(g, np.float64) for g in pullback(d_out.astype(inputs[0].dtype))]

    exact = grads(lambda q, k, v: attention_jax.scaled_dot_product_attention(q, k, v)[0],
                  *(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    ours = grads(jax.jit(lambda q, k, v: attention_jax.scaled_dot_product_attention(q, k, v, need_weights=False)[0]),
                 q, k, v)
    with jax.numpy_dtype_promotion("standard"):  # their backward pass mixes float32 into half precision too
        theirs = [grads(jax.jit(lambda q, k, v, name=name: _jax_builtin(jax, q, k, v, implementation=name)),
                        q, k, v) for name in ("xla", "cudnn")]
    for mine, exact_grad, *references in zip(ours, exact, *theirs, strict=True):  # dq, dk, dv
        assert relative_error(mine, exact_grad) <= 2 * max(relative_error(g, exact_grad) for g in references)


def test_jax_arrays_on_the_cpu_of_a_gpu_machine_run_the_formulation(jax_cuda):
    jax = jax_cuda
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(jnp.asarray(x, jnp.bfloat16), cpu) for x in _inputs()[:3])
    out = _jax_run(jax)(q, k, v)
    assert out.devices() == {cpu}
    assert relative_error(np.asarray(out, np.float64), _exact(q, k, v)) <= 2**-8  # as with a mask, above
