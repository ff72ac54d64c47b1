"""The key/value cache on every backend: extend chunk by chunk equals one causal pass over the whole
sequence (outputs and weights rows), for multi-head attention and the block; the cache's errors, the same
everywhere; and how each framework keeps it: NumPy and torch write in place (no copy of the cache per
step), JAX compiles one extend per chunk length and turns a full cache into NaN under jit."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close, method_program
from tests.conftest import import_backend

B, L, D, H, F = 2, 7, 8, 2, 16
SPLITS = {"prefill_then_decode": (4, 1, 1, 1), "chunks": (3, 1, 3), "one_by_one": (1,) * L, "whole": (L,)}
# a Llama decoder layer's options (d_k = 4: two RoPE pairs); theta 10 turns both pairs visibly in 7 positions
LLAMA = {"norm_first": True, "norm": "rms", "activation": "swiglu", "bias": False, "num_kv_heads": 1,
         "rope_theta": 10.0}
LAYOUT = ("norm", "bias", "num_kv_heads")  # the options the state's shapes carry (from_state_dict infers them)


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _module(M: ModuleType, kind: str, **options):
    """An MHA or a block with seeded parameters from the NumPy backend's, in eval mode, float64."""
    reference = import_backend("attention_np")
    loaded = {name: value for name, value in options.items() if name not in LAYOUT}
    if kind == "mha":
        state = reference.MultiHeadAttention(D, H, rng=0, dtype=np.float64, **options).state_dict()
        return M.MultiHeadAttention.from_state_dict({n: M.asarray(x) for n, x in state.items()}, num_heads=H,
                                                    **loaded).eval()
    state = reference.TransformerBlock(D, H, F, rng=0, dtype=np.float64, **options).state_dict()
    return M.TransformerBlock.from_state_dict({n: M.asarray(x) for n, x in state.items()}, num_heads=H,
                                              **loaded).eval()


def _chunks(sizes: tuple[int, ...]) -> list[slice]:
    ends = np.cumsum(sizes)
    return [slice(int(end - size), int(end)) for size, end in zip(sizes, ends, strict=True)]


def _extended(M: ModuleType, module, inputs: list[np.ndarray], sizes: tuple[int, ...], capacity: int):
    """extend chunk by chunk; the outputs and weights rows concatenated along the positions. JAX's extend runs
    under one jax.jit per chunk length (method_program): eagerly, each primitive compiled apart."""
    cache, extend = module.init_cache((B,), capacity), method_program(M, "extend")
    outs, weights = [], []
    for chunk in _chunks(sizes):
        args = [M.asarray(x[:, chunk]) for x in inputs]
        out, w, cache = extend(module, *args, cache)
        outs.append(M.to_numpy(out))
        weights.append(M.to_numpy(w))
    return np.concatenate(outs, axis=-2), np.concatenate(weights, axis=-2), cache


@pytest.mark.parametrize("options", [{}, {"num_kv_heads": 1, "rope_theta": 10.0}], ids=["plain", "mqa_rope"])
@pytest.mark.parametrize("sizes", SPLITS.values(), ids=SPLITS.keys())
def test_mha_extend_equals_one_causal_pass(backend: ModuleType, sizes, options):
    mha = _module(backend, "mha", **options)
    x_q, x_kv = _random(B, L, D, seed=1), _random(B, L, D, seed=2)  # the queries' and keys' inputs differ
    full, full_weights = method_program(backend, "__call__")(mha, *(backend.asarray(x) for x in (x_q, x_kv, x_kv)),
                                                             backend.causal_mask(L, L))
    out, weights, cache = _extended(backend, mha, [x_q, x_kv], sizes, capacity=L + 3)
    assert_close(out, backend.to_numpy(full), REORDERED, "out")
    assert weights.shape == (B, H, L, L + 3)
    assert_close(weights[..., :L], backend.to_numpy(full_weights), REORDERED, "weights")
    np.testing.assert_array_equal(weights[..., L:], 0)  # the positions not yet filled
    assert int(cache.length) == L


@pytest.mark.parametrize("options", [{}, {"norm_first": True, "activation": "gelu"}, LLAMA],
                         ids=["post_ln", "pre_ln", "llama"])
@pytest.mark.parametrize("sizes", SPLITS.values(), ids=SPLITS.keys())
def test_block_extend_equals_one_causal_pass(backend: ModuleType, sizes, options):
    block = _module(backend, "block", **options)
    x = _random(B, L, D, seed=3)
    full, full_weights = method_program(backend, "__call__")(block, backend.asarray(x), backend.causal_mask(L, L))
    out, weights, _ = _extended(backend, block, [x], sizes, capacity=L)
    assert_close(out, backend.to_numpy(full), REORDERED, "out")
    assert_close(weights, backend.to_numpy(full_weights), REORDERED, "weights")


def test_a_mask_hides_cached_keys_too(backend: ModuleType):
    mha = _module(backend, "mha")
    x = _random(B, L, D, seed=4)
    mask = _random(B, 1, 1, L, seed=5) > -0.5  # a padding mask over the capacity's keys
    mask[..., 0] = True
    full, _ = method_program(backend, "__call__")(mha, *(backend.asarray(x),) * 3,
                                                  backend.asarray(mask & np.tril(np.ones((L, L), bool))))
    cache, outs, extend = mha.init_cache((B,), L), [], method_program(backend, "extend")
    for chunk in _chunks((3, 2, 2)):
        out, _, cache = extend(mha, backend.asarray(x[:, chunk]), backend.asarray(x[:, chunk]), cache,
                               backend.asarray(mask))
        outs.append(backend.to_numpy(out))
    assert_close(np.concatenate(outs, axis=-2), backend.to_numpy(full), REORDERED, "masked")


def test_without_weights(backend: ModuleType):
    block = _module(backend, "block")
    x = backend.asarray(_random(B, 3, D, seed=6))
    out, weights, cache = method_program(backend, "extend", need_weights=False)(block, x, block.init_cache((B,), 5))
    assert weights is None and int(cache.length) == 3
    expected, _ = method_program(backend, "__call__")(block, x, backend.causal_mask(3, 3))
    assert_close(backend.to_numpy(out), backend.to_numpy(expected), REORDERED, "fast path")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's invalid-value warnings on the NaN it spreads
@pytest.mark.parametrize("position", [2, 5], ids=["in_the_prefill", "in_a_step"])
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_a_non_finite_position_spreads_alike_with_and_without_weights(backend: ModuleType, bad: float,
                                                                      position: int):
    # a position of batch row 0 is not finite: every later query of that row sees its key (a cached one in
    # the later steps); the fast path without weights (torch: its fused kernel) must spread it exactly as the
    # explicit path does. The chunks before the one that takes it in never see it (within that chunk, the
    # earlier queries may: the value of a key they hide is multiplied by a weight of 0, SPEC 10)
    x = _random(B, L, D, seed=9)
    x[0, position, 1] = bad
    chunks = _chunks(SPLITS["prefill_then_decode"])
    first = max(chunk.start for chunk in chunks if chunk.start <= position)  # the chunk holding the position
    results = {}
    for need_weights in (True, False):
        module, outs = _module(backend, "block", **LLAMA), []
        cache = module.init_cache((B,), L)
        for chunk in chunks:
            out, _, cache = module.extend(backend.asarray(x[:, chunk]), cache, need_weights=need_weights)
            outs.append(backend.to_numpy(out))
        results[need_weights] = np.concatenate(outs, axis=-2)
    assert np.isnan(results[True][0, position:]).all() and not np.isnan(results[True][0, :first]).any()
    assert not np.isnan(results[True][1]).any()
    assert_close(results[False], results[True], REORDERED, "without weights")


def test_init_cache_shapes_and_dtype(backend: ModuleType):
    mha = _module(backend, "mha")
    cache = mha.init_cache((2, 3), 11)
    assert tuple(cache.k.shape) == tuple(cache.v.shape) == (2, 3, H, 11, D // H)
    assert backend.to_numpy(cache.k).dtype == np.float64 and int(cache.length) == 0
    assert backend.to_numpy(mha.init_cache((), 4, dtype=backend.asarray(np.zeros(1, np.float32)).dtype).k).dtype \
        == np.float32


def test_the_cache_holds_the_key_value_heads_as_spec_3a_says(backend: ModuleType):
    # grouped heads: k and v keep the Hkv = num_kv_heads = 1 heads the queries' groups read, not H copies
    cache = _module(backend, "mha", num_kv_heads=1).init_cache((2,), 5)
    assert tuple(cache.k.shape) == tuple(cache.v.shape) == (2, 1, 5, D // H)
    spec = (Path(__file__).parents[1] / "SPEC.md").read_text()
    assert "mha.init_cache(batch_shape, capacity, *, dtype=None)    k, v (*batch_shape, Hkv, capacity, d_k)" in spec


def test_init_cache_makes_rope_tables_of_every_position(backend: ModuleType):
    # d_k = 4: pairs (x_0, x_2) and (x_1, x_3), angles p * theta^(-2j / 4), j = 0, 1, written out by hand
    cache = _module(backend, "mha", rope_theta=10.0).init_cache((B,), 5)
    cos, sin = (backend.to_numpy(table) for table in cache.rope)
    angles = np.arange(5)[:, None] * np.array([1.0, 10.0 ** -0.5])  # (capacity, 2)
    assert_close(cos, np.cos(angles)[:, [0, 1, 0, 1]], REORDERED, "cos")
    assert_close(sin, np.sin(angles)[:, [0, 1, 0, 1]] * [-1, -1, 1, 1], REORDERED, "sin: each pair's first negated")
    assert _module(backend, "mha").init_cache((B,), 5).rope is None


def test_a_cache_built_by_hand_has_no_tables_and_gives_the_same_outputs(backend: ModuleType):
    block = _module(backend, "block", **LLAMA)
    x = _random(B, L, D, seed=8)
    made, _, _ = _extended(backend, block, [x], SPLITS["chunks"], capacity=9)
    empty = block.init_cache((B,), 9)
    cache, outs = type(empty)(empty.k, empty.v, empty.length), []  # rope=None: extend computes the angles
    assert cache.rope is None
    extend = method_program(backend, "extend")
    for chunk in _chunks(SPLITS["chunks"]):
        out, _, cache = extend(block, backend.asarray(x[:, chunk]), cache)
        outs.append(backend.to_numpy(out))
    assert cache.rope is None
    assert_close(np.concatenate(outs, axis=-2), made, REORDERED, "hand-built cache")


# ---- errors, the same on every backend

ERRORS = {
    "full": (lambda M, mha: mha.extend(*_inputs(M, 4), _filled(M, mha, 3, capacity=6)), ValueError,
             ["capacity is 6", "3 are filled", "4 more"]),
    "batch shape": (lambda M, mha: mha.extend(*_inputs(M, 2, batch=3), mha.init_cache((B,), 5)), ValueError,
                    ["x_q", "(3, 2, 8)", "(2,)"]),
    "width": (lambda M, mha: mha.extend(M.asarray(_random(B, 2, 4)), M.asarray(_random(B, 2, 4)),
                                        mha.init_cache((B,), 5)), ValueError, ["x_q", "D = d_model = 8"]),
    "lengths differ": (lambda M, mha: mha.extend(M.asarray(_random(B, 2, D)), M.asarray(_random(B, 3, D)),
                                                 mha.init_cache((B,), 5)), ValueError, ["one length L", "x_kv"]),
    "dtype": (lambda M, mha: mha.extend(*_inputs(M, 2), mha.init_cache(
        (B,), 5, dtype=M.asarray(np.zeros(1, np.float32)).dtype)), TypeError, ["cache", "float32", "float64"]),
    "mask": (lambda M, mha: mha.extend(*_inputs(M, 2), mha.init_cache((B,), 5), M.asarray(np.ones((2, 3), bool))),
             ValueError, ["mask", "(2, 3)", "capacity"]),
    "capacity": (lambda M, mha: mha.init_cache((B,), -1), ValueError, ["capacity", "-1"]),
    "batch_shape": (lambda M, mha: mha.init_cache(B, 4), ValueError, ["batch_shape", "2"]),
}


def _inputs(M: ModuleType, n: int, batch: int = B) -> tuple:
    x = M.asarray(_random(batch, n, D, seed=n))
    return x, x


def _filled(M: ModuleType, mha, n: int, capacity: int):
    return mha.extend(*_inputs(M, n), mha.init_cache((B,), capacity))[2]


@pytest.mark.parametrize(("call", "error", "words"), ERRORS.values(), ids=ERRORS.keys())
def test_each_cache_mistake_raises_the_same_error(backend: ModuleType, call, error, words):
    with pytest.raises(error) as raised:
        call(backend, _module(backend, "mha"))
    assert all(word in str(raised.value) for word in words), str(raised.value)


# ---- how each framework keeps the cache


def test_numpy_writes_in_place_and_copies_no_cache_per_step():
    M = import_backend("attention_np")
    mha = _module(M, "mha")
    cache = mha.init_cache((B,), 4096)
    _, _, cache = mha.extend(*_inputs(M, 64), cache, need_weights=False)  # the prefill (imports the fast path)
    before = cache.k
    tracemalloc.start()
    _, _, cache = mha.extend(*_inputs(M, 1), cache, need_weights=False)  # a decode step
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert cache.k is before and int(cache.length) == 65
    assert peak < before.nbytes / 8, f"a decode step allocated {peak} bytes; the cache's keys are {before.nbytes}"


@pytest.mark.slow  # inductor compiles the step (seconds)
@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
def test_torch_cache_is_preallocated_and_a_decode_step_compiles_whole(need_weights: bool):
    torch = pytest.importorskip("torch")
    M = import_backend("attention_torch")
    block = _module(M, "block", **LLAMA)  # RoPE's positions follow the cache's length inside the graph
    step = torch.compile(block.extend, fullgraph=True, dynamic=True)  # inductor; fullgraph: no graph break
    x = [_random(B, 5, D)] + [_random(B, 1, D, seed=t) for t in range(5, 8)]
    nan = _random(B, 1, D, seed=8)
    nan[0, 0, 0] = np.nan  # sequence 0's new query and key: NaN reaches its row (SPEC 10), not sequence 1's
    with torch.no_grad():  # decoding
        _, _, cache = block.extend(M.asarray(x[0]), block.init_cache((B,), 16))
        eager = cache._replace(k=cache.k.clone(), v=cache.v.clone())
        pointer, outs = cache.k.data_ptr(), []
        for t, chunk in enumerate([*x[1:], nan]):
            with torch.compiler.set_stance("fail_on_recompile" if t else "default"):  # one graph for every step
                out, weights, cache = step(M.asarray(chunk), cache, need_weights=need_weights)
            expected, expected_weights, eager = block.extend(M.asarray(chunk), eager, need_weights=need_weights)
            assert_close(out.numpy(), expected.numpy(), REORDERED, f"the compiled step at {cache.length}")
            if need_weights:
                assert_close(weights.numpy(), expected_weights.numpy(), REORDERED, "the compiled step's weights")
            outs.append(out)
    assert cache.k.data_ptr() == pointer and cache.length == 9  # written in place: no torch.cat
    assert np.isnan(outs[-1][0].numpy()).all() and np.isfinite(outs[-1][1].numpy()).all()
    full, _ = block(M.asarray(np.concatenate(x, axis=1)), M.causal_mask(8, 8))
    assert_close(torch.cat(outs[:-1], dim=1).numpy(), full[:, 5:].detach().numpy(), REORDERED, "compiled steps")


@pytest.mark.slow  # inductor compiles the step (seconds)
def test_torch_compiled_decode_step_keeps_the_nan_rule():
    # a NaN query among finite keys and values: the fused kernel returns a finite row for it, so the compiled
    # step must choose the explicit path in its graph, as the eager step does in Python (SPEC 10)
    torch = pytest.importorskip("torch")
    M = import_backend("attention_torch")
    mha = _module(M, "mha", num_kv_heads=1)  # grouped: the kernel route of a decode step
    step = torch.compile(mha.extend, fullgraph=True, dynamic=True)
    x_q = _random(B, 1, D, seed=1)
    x_q[0, 0, 0] = np.nan  # sequence 0's query, in every head after the projection
    with torch.no_grad():
        _, _, cache = mha.extend(*_inputs(M, 3), mha.init_cache((B,), 8))
        out, _, cache = step(M.asarray(x_q), M.asarray(_random(B, 1, D, seed=2)), cache, need_weights=False)
    assert np.isnan(out[0].numpy()).all() and np.isfinite(out[1].numpy()).all() and cache.length == 4


def test_jax_compiles_one_extend_per_chunk_length_and_a_full_cache_is_nan():
    jax = pytest.importorskip("jax")
    M = import_backend("attention_jax")
    block = _module(M, "block", **LLAMA)  # RoPE's positions follow the traced length
    traces = []

    def step(block, x, cache):
        traces.append(x.shape)  # runs once per trace, so once per compile
        return block.extend(x, cache)

    step = jax.jit(step)
    cache = block.init_cache((B,), 6)
    _, _, cache = step(block, M.asarray(_random(B, 3, D)), cache)
    for t in range(3):
        out, _, cache = step(block, M.asarray(_random(B, 1, D, seed=t)), cache)
    assert traces == [(B, 3, D), (B, 1, D)] and int(cache.length) == 6
    assert np.isfinite(np.asarray(out)).all()
    out, _, _ = step(block, M.asarray(_random(B, 1, D, seed=9)), cache)  # a seventh position in six
    assert np.isnan(np.asarray(out)).all()
