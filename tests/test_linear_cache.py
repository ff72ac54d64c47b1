"""The cache of attention="linear" (SPEC 3a) on every backend, in float64: init_cache keeps linear attention's
recurrent state (S, z per key/value head, linear_attention_state's) instead of keys and values, and extend carries
it, so that prefilling and decoding chunk by chunk gives the causal full pass over the same positions (the
composition written out with linear_attention(is_causal=True), and the module's own is_causal=True call); the
TransformerBlock's decode as its causal call; NumPy's decode step holds the same memory after 1k and 64k positions;
JAX serves every decode step with one compiled step; the errors, one ValueError on every backend."""

from __future__ import annotations

import tracemalloc
from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close
from tests.conftest import import_backend
from tests.test_linear_module import OPTIONS, B, D, H, _errors, _linear_mha, _state, _written_out, _x

MODULES = 1e-10  # float64: a module's chunks against its own full pass, through the norms and the feed-forward
CHUNKS = (3, 1, 4, 1)  # a prefill, a decode step, a longer chunk, a step: 9 positions in all


def _chunked(M: ModuleType, extend, cache, x: np.ndarray) -> tuple[np.ndarray, object]:
    """extend(x_chunk, cache) over CHUNKS of x (B, sum(CHUNKS), D): the outputs concatenated, and the last cache."""
    outs, start = [], 0
    for n in CHUNKS:
        out, weights, cache = extend(M.asarray(x[:, start:start + n]), cache)
        assert weights is None  # linear attention forms no weights
        outs.append(M.to_numpy(out))
        start += n
    return np.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_linear_extend_by_chunks_is_the_causal_full_pass(backend: ModuleType, case: str) -> None:
    # grouped heads, no bias, RoPE at positions 0 .. 8 across the chunks
    options, x = OPTIONS[case], _x(B, sum(CHUNKS), D)
    state = _state(options)
    mha = _linear_mha(backend, state, options)
    cache = mha.init_cache((B,), 1)  # the capacity is no bound: the state holds any number of positions
    out, cache = _chunked(backend, lambda y, c: mha.extend(y, y, c), cache, x)
    assert int(cache.length) == sum(CHUNKS)
    assert tuple(cache.S.shape) == (B, options.get("num_kv_heads") or H, D // H, D // H)
    expected = _written_out(state, options, x, x, is_causal=True)
    assert_close(out, expected, REORDERED, f"{backend.__name__} {case}: against the composition")
    X = backend.asarray(x)
    assert_close(out, backend.to_numpy(mha(X, X, X, is_causal=True)[0]), MODULES, f"{case}: against the module")


def test_linear_extend_keeps_the_callers_cache(backend: ModuleType) -> None:
    # extend returns a new state; the one it was given still continues from its own positions
    mha, x = _linear_mha(backend, _state({}), {}), backend.asarray(_x(B, 2, D))
    first = mha.extend(x[:, :1], x[:, :1], mha.init_cache((B,), 1))[2]
    S, z = backend.to_numpy(first.S).copy(), backend.to_numpy(first.z).copy()
    second = mha.extend(x[:, 1:], x[:, 1:], first)[2]
    assert np.array_equal(backend.to_numpy(first.S), S) and np.array_equal(backend.to_numpy(first.z), z)
    assert int(first.length) == 1 and int(second.length) == 2


def _block(M: ModuleType, **options) -> object:
    """A linear Llama-like block in float64, eval mode, loaded from NumPy's draw (one state on every backend)."""
    import attention_np

    options = {"norm_first": True, "norm": "rms", "activation": "swiglu", "bias": False, "rope_theta": 10.0,
               "num_kv_heads": 2} | options
    state = attention_np.TransformerBlock(D, H, 16, 0.0, attention="linear", rng=0, dtype=np.float64,
                                          **options).state_dict()
    return M.TransformerBlock.from_state_dict({name: M.asarray(value) for name, value in state.items()},
                                              num_heads=H, dropout=0.0, norm_first=True, rope_theta=10.0,
                                              attention="linear").eval()


def test_linear_block_decode_is_its_causal_call(backend: ModuleType) -> None:
    block, x = _block(backend), _x(B, sum(CHUNKS), D)
    assert block.attn.attention == "linear"
    out, cache = _chunked(backend, block.extend, block.init_cache((B,), 1), x)
    assert int(cache.length) == sum(CHUNKS)
    expected, weights = block(backend.asarray(x), is_causal=True)
    assert weights is None
    assert_close(out, backend.to_numpy(expected), MODULES, f"{backend.__name__} block")


def _decode_peak(mha: object, prefill: int, steps: int = 64) -> tuple[int, int]:
    """Prefill `prefill` positions through extend, 256 at a time (the chunked form), then the largest tracemalloc
    peak of `steps` decode steps, and the cache's bytes."""
    rng = np.random.default_rng(0)
    cache = mha.init_cache((1,), 1)
    for start in range(0, prefill, 256):
        x = rng.standard_normal((1, min(256, prefill - start), D))
        cache = mha.extend(x, x, cache)[2]
    assert cache.length == prefill
    peaks = []
    for _ in range(steps):
        x = rng.standard_normal((1, 1, D))
        tracemalloc.start()
        _, _, cache = mha.extend(x, x, cache)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return max(peaks), cache.S.nbytes + cache.z.nbytes


def test_numpy_linear_decode_memory_is_constant_in_the_positions() -> None:
    # a decode step after 64k positions holds what it holds after 1k: the state's size does not grow (a KVCache's
    # keys and values would be 64 times larger); RoPE on, its angles made for each step's own position
    N = import_backend("attention_np")
    mha = N.MultiHeadAttention(D, H, 0.0, num_kv_heads=2, rope_theta=10_000.0, attention="linear", rng=0,
                               dtype=np.float64)
    (short, short_bytes), (long, long_bytes) = _decode_peak(mha, 1024), _decode_peak(mha, 65536)
    assert short_bytes == long_bytes == 2 * (D // H) * (D // H + 1) * 8  # Hkv = 2 heads of S (2, 2) and z (2,)
    assert long <= short * 1.05 + 256, f"a decode step's peak: {short} bytes after 1k positions, {long} after 64k"


@pytest.mark.slow  # JAX compiles
def test_jax_serves_every_linear_decode_step_with_one_compiled_step() -> None:
    jax = pytest.importorskip("jax")
    J = import_backend("attention_jax")
    block, x, traces = _block(J), _x(B, 6, D), []

    def step(block: object, x: object, cache: object) -> tuple:
        traces.append(1)  # runs when JAX traces, not when the compiled program runs
        return block.extend(x, cache)

    step = jax.jit(step)
    cache = block.extend(J.asarray(x[:, :2]), block.init_cache((B,), 1))[2]  # the prefill, eagerly
    outs = []
    for t in range(2, 6):  # the length is data: one trace serves every position (RoPE's angles from it)
        out, _, cache = step(block, J.asarray(x[:, t:t + 1]), cache)
        outs.append(J.to_numpy(out))
    assert len(traces) == 1 and int(cache.length) == 6
    expected = J.to_numpy(block(J.asarray(x), is_causal=True)[0])[:, 2:]
    assert_close(np.concatenate(outs, axis=1), expected, MODULES, "jit'd decode")


def _linear_cache(M: ModuleType) -> tuple[object, object, object]:
    mha = _linear_mha(M, _state({}), {})
    return mha, mha.init_cache((B,), 4), M.asarray(_x(B, 1, D))


def _extend_with(**options) -> object:
    def make(M: ModuleType) -> object:
        mha, cache, x = _linear_cache(M)
        options_here = {name: value(M) if callable(value) else value for name, value in options.items()}
        return mha.extend(x, x, cache, **options_here)
    return make


def _softmax_extends_a_linear_cache(M: ModuleType) -> object:
    _, cache, x = _linear_cache(M)
    softmax = M.MultiHeadAttention.from_state_dict({n: M.asarray(v) for n, v in _state({}).items()}, num_heads=H)
    return softmax.extend(x, x, cache)


@pytest.mark.parametrize(("make", "words"), [
    (_extend_with(mask=lambda M: M.asarray(np.ones((B, H, 1, 4), bool))), ("mask", "attention='linear'")),
    (_extend_with(new_lengths=lambda M: M.asarray(np.ones(B, np.int32))), ("new_lengths", "attention='linear'")),
    (_extend_with(mask_mod=lambda M: (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)),
     ("mask_mod", "attention='linear'")),
    (lambda M: _linear_cache(M)[0].init_cache((B,), 4, window=2), ("window", "attention='linear'", "2")),
    (_softmax_extends_a_linear_cache, ("extend", "attention='softmax'", "LinearCache")),
    (lambda M: _linear_cache(M)[0].extend(M.asarray(_x(B, 1, D + 1)), M.asarray(_x(B, 1, D + 1)),
                                          _linear_cache(M)[1]), ("x_q", "D = d_model = 8")),
], ids=["mask", "new_lengths", "mask_mod", "window", "softmax_module", "width"])
def test_linear_cache_errors_are_one_value_error_on_every_backend(make, words: tuple[str, ...]) -> None:
    (seen,) = _errors(make)  # one type and message on all three backends
    assert seen[0] == "ValueError" and all(word in seen[1] for word in words), seen


def test_softmax_mha_is_causal_is_its_causal_mask(backend: ModuleType) -> None:
    # the keyword both attentions take: softmax's is scaled_dot_product_attention's is_causal, causal_mask's numbers
    x = backend.asarray(_x(B, 5, D))
    mha = backend.MultiHeadAttention.from_state_dict({n: backend.asarray(v) for n, v in _state({}).items()},
                                                     num_heads=H, dropout=0.0)
    out, weights = mha(x, x, x, is_causal=True)
    expected, expected_weights = mha(x, x, x, backend.causal_mask(5, 5))
    assert_close(backend.to_numpy(out), backend.to_numpy(expected), REORDERED, "out")
    assert_close(backend.to_numpy(weights), backend.to_numpy(expected_weights), REORDERED, "weights")
    assert np.all(np.triu(backend.to_numpy(weights)[0, 0], 1) == 0)  # no weight above the diagonal


def test_causal_vjps_match_central_differences_of_the_causal_call(backend: ModuleType) -> None:
    # MultiHeadAttention.vjp and TransformerBlock.vjp take is_causal as the call does: every backend's gradients
    # against central differences of NumPy's causal call (linear heads, RoPE, grouped; the Llama-like block)
    from tests._compare import central_differences

    N, options = import_backend("attention_np"), OPTIONS["rope_one_kv_head"]
    state, x, d_out = _state(options), _x(1, 3, D), _x(1, 3, D, seed=3)
    mha_np, mha = _linear_mha(N, state, options), _linear_mha(backend, state, options)
    grads = mha.vjp(*(backend.asarray(x),) * 3, is_causal=True)[2](backend.asarray(d_out))[:3]
    for i, (name, grad) in enumerate(zip("qkv", grads, strict=True)):
        def f(y: np.ndarray, i: int = i) -> np.ndarray:
            return mha_np(*(y if j == i else x for j in range(3)), is_causal=True)[0]
        assert_close(backend.to_numpy(grad), central_differences(f, x, d_out, 1e-5), 1e-7, f"mha d{name}")
    block_np, block = _block(N), _block(backend)
    dx = block.vjp(backend.asarray(x), is_causal=True)[2](backend.asarray(d_out))[0]
    expected = central_differences(lambda y: block_np(y, is_causal=True)[0], x, d_out, 1e-5)
    assert_close(backend.to_numpy(dx), expected, 1e-7, "block dx")
