"""The streaming key/value cache (StreamingLLM, SPEC 3c) on every backend: decoding N = 10 (s + w) positions one
or a few at a time through s + w slots equals one pass with the streaming mask "j < s or p - w < j <= p" (the
window counts the query itself), outputs and weights; the weights' last axis is the cache's order (the sinks, then
the window oldest first); RoPE at the original positions, or at the places in the cache, each against its own
reference; the sinks are never evicted; the memory stays fixed; the errors name their arguments; JAX serves every
decode step with one compiled program."""

from __future__ import annotations

import tracemalloc
from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, method_program, sdpa
from tests.conftest import import_backend
from tests.test_cache import LLAMA, _module, _random

B, D, H = 2, 8, 2
SINK, WINDOW = 2, 3  # s and w: a window of 3 positions, the query's own among them
N = 10 * (SINK + WINDOW)  # positions decoded: the ring turns over 9 times
THETA = 10.0
MODULE_TOL = 1e-10  # float64, the module's outputs against the reference's (the same math in another order)


def _streaming_mask(n: int, sink: int, window: int) -> np.ndarray:
    """(n, n): query i sees key j where j <= i and (j < sink or i - window < j), the window holding i itself."""
    i, j = np.arange(n)[:, None], np.arange(n)
    return (j <= i) & ((j < sink) | (j > i - window))


def _turn(x: np.ndarray, position: float) -> np.ndarray:
    """RoPE's half rotation of one row x (d_k,) at `position`, written out: pairs (x_j, x_{j + d_k/2})."""
    half = x.shape[-1] // 2
    angle = position * THETA ** (-np.arange(half) * 2 / x.shape[-1])  # (d_k/2,)
    x1, x2 = x[:half], x[half:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)])


def _reference(state: dict, x: np.ndarray, *, kv_heads: int, rope: str | None) -> tuple[np.ndarray, np.ndarray]:
    """MultiHeadAttention over the streaming mask, one query and one head at a time: the keys query p sees, in
    position order (the sinks, then its window), turned at their positions (rope "original") or at their index in
    that order, the query at its own (rope "cache"). out (B, N, D) and weights (B, H, N, s + w), column c the c-th
    key seen."""
    def project(name: str, x: np.ndarray) -> np.ndarray:
        y = x @ state[f"{name}.weight"].T + state.get(f"{name}.bias", 0)
        return y.reshape(*x.shape[:-1], -1, D // H)  # (B, N, heads, d_k)

    q, k, v = project("w_q", x), project("w_k", x), project("w_v", x)
    heads, weights = np.zeros((B, N, H, D // H)), np.zeros((B, H, N, SINK + WINDOW))
    for b in range(B):
        for p in range(N):
            seen = [j for j in range(p + 1) if j < SINK or j > p - WINDOW]  # position order
            at = {None: None, "original": seen, "cache": list(range(len(seen)))}[rope]
            for h in range(H):
                g = h // (H // kv_heads)
                q_row = q[b, p, h] if at is None else _turn(q[b, p, h], at[-1])  # the query: the last key seen
                keys = np.stack([k[b, j, g] if at is None else _turn(k[b, j, g], a) for j, a in
                                 zip(seen, at or seen, strict=True)])
                scores = keys @ q_row / np.sqrt(D // H)
                w = np.exp(scores - scores.max())
                w /= w.sum()
                heads[b, p, h] = w @ v[b, seen, g]
                weights[b, h, p, :len(seen)] = w
    out = heads.reshape(B, N, D) @ state["w_o.weight"].T + state.get("w_o.bias", 0)
    return out, weights


def _decode(M: ModuleType, module, cache, x: np.ndarray, chunk: int, twice: bool):
    """extend `chunk` positions at a time (the last chunk what is left; twice: x as x_q and x_kv, for MHA); outputs
    and weights rows concatenated, the last cache, and the shapes of the cache's keys after every step. JAX: one
    jax.jit per chunk length."""
    extend, outs, weights, shapes = method_program(M, "extend"), [], [], []
    for start in range(0, N, chunk):
        rows = M.asarray(x[:, start:start + chunk])
        out, w, cache = extend(module, *((rows, rows) if twice else (rows,)), cache)
        outs.append(M.to_numpy(out))
        weights.append(M.to_numpy(w))
        shapes.append(tuple(cache.k.shape))
    return np.concatenate(outs, axis=-2), np.concatenate(weights, axis=-2), cache, shapes


def _mha(M: ModuleType, **options):
    return _module(M, "mha", **options)


def _state(**options) -> dict:
    reference = import_backend("attention_np")
    return reference.MultiHeadAttention(D, H, rng=0, dtype=np.float64, **options).state_dict()


@pytest.mark.parametrize("chunk", [1, 2, WINDOW], ids=["one_by_one", "pairs", "window_chunks"])
@pytest.mark.parametrize(("options", "rope_positions"),
                         [({}, "original"), ({"num_kv_heads": 1, "rope_theta": THETA}, "original"),
                          ({"num_kv_heads": 1, "rope_theta": THETA}, "cache")],
                         ids=["plain", "mqa_rope_original", "mqa_rope_cache"])
def test_decoding_equals_the_reference_over_the_streaming_mask(backend: ModuleType, options, rope_positions, chunk):
    mha = _mha(backend, **options)
    x = _random(B, N, D, seed=1)
    cache = mha.init_cache((B,), SINK + WINDOW, sink_tokens=SINK, window=WINDOW, rope_positions=rope_positions)
    out, weights, cache, shapes = _decode(backend, mha, cache, x, chunk, True)
    expected, expected_weights = _reference(_state(**options), x, kv_heads=options.get("num_kv_heads", H),
                                            rope=rope_positions if "rope_theta" in options else None)
    np.testing.assert_allclose(out, expected, rtol=0, atol=MODULE_TOL)
    np.testing.assert_allclose(weights, expected_weights, rtol=0, atol=MODULE_TOL)  # the cache's order
    assert set(shapes) == {(B, options.get("num_kv_heads", H), SINK + WINDOW, D // H)}  # fixed, every step
    assert int(cache.length) == N


@pytest.mark.parametrize("options", [{}, {"num_kv_heads": 1, "rope_theta": THETA}], ids=["plain", "mqa_rope"])
def test_original_positions_equal_the_module_over_the_streaming_mask(backend: ModuleType, options):
    """rope_positions="original" is the module's own full pass with the mask (keys turned at their positions)."""
    mha = _mha(backend, **options)
    x = _random(B, N, D, seed=2)
    full, full_weights = method_program(backend, "__call__")(mha, *(backend.asarray(x),) * 3,
                                                             backend.asarray(_streaming_mask(N, SINK, WINDOW)))
    cache = mha.init_cache((B,), SINK + WINDOW, sink_tokens=SINK, window=WINDOW)
    out, weights, _, _ = _decode(backend, mha, cache, x, 1, True)
    np.testing.assert_allclose(out, backend.to_numpy(full), rtol=0, atol=MODULE_TOL)
    # the weights' column c: position c (a sink), else the window's position c + e, e = max(0, p + 1 - (s + w))
    p = np.arange(N)[:, None]
    at = np.where(np.arange(SINK + WINDOW) < SINK, np.arange(SINK + WINDOW), np.arange(SINK + WINDOW)
                  + np.maximum(p + 1 - SINK - WINDOW, 0))  # (N, s + w)
    gathered = np.take_along_axis(backend.to_numpy(full_weights), np.minimum(at, N - 1)[None, None], axis=-1)
    np.testing.assert_allclose(weights, np.where(at <= p, gathered, 0), rtol=0, atol=MODULE_TOL)


def test_the_two_rope_positions_differ_once_the_ring_turns(backend: ModuleType):
    """Until a position is evicted a key's place in the cache is its position, so the two agree; after, they do not
    (the option is not ignored)."""
    mha = _mha(backend, num_kv_heads=1, rope_theta=THETA)
    x = _random(B, N, D, seed=3)
    outs = {rope: _decode(backend, mha, mha.init_cache((B,), SINK + WINDOW, sink_tokens=SINK, window=WINDOW,
                                                       rope_positions=rope), x, 1, True)[0]
            for rope in ("original", "cache")}
    full = SINK + WINDOW  # positions 0 .. s + w - 1 see nothing evicted
    np.testing.assert_allclose(outs["cache"][:, :full], outs["original"][:, :full], rtol=0, atol=MODULE_TOL)
    assert np.abs(outs["cache"][:, full:] - outs["original"][:, full:]).min(axis=-1).max() > 1e-3


@pytest.mark.parametrize("rope_positions", ["original", "cache"])
def test_block_decoding_equals_the_block_over_the_streaming_mask(backend: ModuleType, rope_positions):
    """A Llama block: "original" against the block's full pass with the mask; "cache" against the NumPy block fed
    the reference attention (the block's residual branches around it)."""
    block = _module(backend, "block", **LLAMA)
    x = _random(B, N, D, seed=4)
    cache = block.init_cache((B,), SINK + WINDOW, sink_tokens=SINK, window=WINDOW, rope_positions=rope_positions)
    out, _, cache, shapes = _decode(backend, block, cache, x, 2, False)
    if rope_positions == "original":
        expected = backend.to_numpy(method_program(backend, "__call__")(
            block, backend.asarray(x), backend.asarray(_streaming_mask(N, SINK, WINDOW)))[0])
    else:  # pre-LN: x + MHA(norm1(x)), then x + FFN(norm2(x)), MHA the reference's
        reference = _module(import_backend("attention_np"), "block", **LLAMA)
        attention, _ = _reference(reference.attn.state_dict(), reference.norm1(x), kv_heads=1, rope="cache")
        h = x + attention
        expected = h + reference.ffn(reference.norm2(h))
    np.testing.assert_allclose(out, expected, rtol=0, atol=MODULE_TOL)
    assert set(shapes) == {(B, 1, SINK + WINDOW, D // H)}


@pytest.mark.parametrize("rope_positions", ["original", "cache"])
def test_the_sink_slots_hold_the_first_positions_forever(backend: ModuleType, rope_positions):
    """After N steps, slots 0 .. s - 1 hold the keys and values of positions 0 .. s - 1 (turned at their positions
    with "original", unturned with "cache"), and slot s + (p - s) % w the last w positions'."""
    mha = _mha(backend, num_kv_heads=1, rope_theta=THETA)
    x = _random(B, N, D, seed=5)
    cache = mha.init_cache((B,), SINK + WINDOW, sink_tokens=SINK, window=WINDOW, rope_positions=rope_positions)
    _, _, cache, _ = _decode(backend, mha, cache, x, 1, True)
    state = _state(num_kv_heads=1, rope_theta=THETA)
    k = x @ state["w_k.weight"].T + state["w_k.bias"]  # (B, N, d_k): one key/value head
    v = x @ state["w_v.weight"].T + state["w_v.bias"]
    turn = (lambda row, p: _turn(row, p)) if rope_positions == "original" else (lambda row, p: row)
    slot = {p: p if p < SINK else SINK + (p - SINK) % WINDOW for p in [*range(SINK), *range(N - WINDOW, N)]}
    got_k, got_v = backend.to_numpy(cache.k)[:, 0], backend.to_numpy(cache.v)[:, 0]  # (B, s + w, d_k)
    for p, s in slot.items():
        for b in range(B):
            np.testing.assert_allclose(got_k[b, s], turn(k[b, p], p), rtol=0, atol=REORDERED, err_msg=f"key {p}")
            np.testing.assert_allclose(got_v[b, s], v[b, p], rtol=0, atol=REORDERED, err_msg=f"value {p}")


def test_each_query_reads_its_sinks_and_window_in_position_order(backend: ModuleType):
    """The view (modules._streaming_view), exactly, for every chunk of 1 .. w rows from every start through two
    turns of the ring: query i at p = start + i reads, column by column, the positions of its sinks then its window,
    oldest first; each from the slot that holds it before the step writes (the slot's last position before
    `start`) or from the new rows; its own column is the number of keys it sees less one."""
    M, slots = backend, SINK + WINDOW
    for start in range(2 * slots + 2):
        held = {}  # slot -> the last position written there before `start`
        for p in range(start):
            held[p if p < SINK else SINK + (p - SINK) % WINDOW] = p
        for L in range(1, WINDOW + 1):
            length = M.asarray(np.int32(start)) if M.__name__ == "attention_jax" else start  # jax: an array
            seen, source, place = (M.to_numpy(a) for a in M.modules._streaming_view(length, L, SINK, slots))
            for i in range(L):
                p = start + i
                expected = [j for j in range(p + 1) if j < SINK or j > p - WINDOW]
                read = [held[int(r)] if r < slots else start + int(r) - slots for r in source[i][seen[i]]]
                assert read == expected, f"query {p} (start {start}, L {L}): read {read}, sees {expected}"
                assert list(np.flatnonzero(seen[i])) == list(range(len(expected)))  # the columns seen come first
                assert int(place[i]) == len(expected) - 1


@pytest.mark.parametrize("chunk", [1, WINDOW], ids=["one_by_one", "window_chunks"])
def test_attention_over_the_views_equals_sdpa_with_the_streaming_mask(backend: ModuleType, chunk: int):
    """The function level, at float64's reordering tolerance: raw q, k, v (B, H, N, E) decoded through a ring of s + w
    slots written as SPEC 3c says, each query attending to its view (modules._streaming_view), give the rows of
    scaled_dot_product_attention with the streaming mask over the whole sequence."""
    M, slots, E = backend, SINK + WINDOW, 4
    q, k, v = (_random(B, H, N, E, seed=seed) for seed in (7, 8, 9))
    full, _ = sdpa(M, q, k, v, _streaming_mask(N, SINK, WINDOW))
    ring_k, ring_v, outs = np.zeros((B, H, slots, E)), np.zeros((B, H, slots, E)), []
    for start in range(0, N, chunk):
        L = min(chunk, N - start)
        new = slice(start, start + L)
        length = M.asarray(np.int32(start)) if M.__name__ == "attention_jax" else start  # jax: an array
        seen, source, _ = (M.to_numpy(a) for a in M.modules._streaming_view(length, L, SINK, slots))
        view_k = np.concatenate([ring_k, k[:, :, new]], axis=-2)[:, :, source]  # (B, H, L, slots, E)
        view_v = np.concatenate([ring_v, v[:, :, new]], axis=-2)[:, :, source]
        out, _ = sdpa(M, q[:, :, new, None], view_k, view_v, seen[None, None, :, None])  # each query alone
        outs.append(out[:, :, :, 0])  # (B, H, L, 1, E) -> (B, H, L, E)
        for p in range(start, start + L):  # the writes: a sink's slot, else the ring's
            ring_k[:, :, p if p < SINK else SINK + (p - SINK) % WINDOW] = k[:, :, p]
            ring_v[:, :, p if p < SINK else SINK + (p - SINK) % WINDOW] = v[:, :, p]
    np.testing.assert_allclose(np.concatenate(outs, axis=-2), full, rtol=0, atol=REORDERED)


def test_numpy_memory_per_step_is_flat():
    """NumPy's step allocates the same whatever the positions seen: the peak (tracemalloc) of a step after N and
    after 4N positions agree within 5 percent, and the cache's arrays stay the same arrays."""
    M = import_backend("attention_np")
    mha = _mha(M, num_kv_heads=1, rope_theta=THETA)
    cache = mha.init_cache((B,), SINK + WINDOW, sink_tokens=SINK, window=WINDOW)
    keys, rows, peaks = cache.k, _random(B, 1, D, seed=6), {}
    for t in range(4 * N):
        if t + 1 in (N, 4 * N):
            tracemalloc.start()
        _, _, cache = mha.extend(rows, rows, cache)
        if t + 1 in (N, 4 * N):
            peaks[t + 1] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    assert cache.k is keys and int(cache.length) == 4 * N
    assert abs(peaks[4 * N] - peaks[N]) <= 0.05 * peaks[N], f"a step's peak: {peaks} bytes"


@pytest.mark.parametrize("name", ["attention_torch", "attention_jax"])
def test_torch_and_jax_caches_hold_the_same_bytes_after_n_and_4n_positions(name: str):
    """The cache a step hands on holds the same arrays' bytes after N and after 4N positions (s + w slots of keys
    and values, the RoPE tables, whatever the positions seen); torch writes into the same storage every step (no
    array reallocated), JAX's step is one compiled program whose cache has one shape."""
    M = import_backend(name)
    mha = _mha(M, num_kv_heads=1, rope_theta=THETA)
    if name == "attention_jax":
        import jax

        step = jax.jit(lambda x, cache: mha.extend(x, x, cache))
    else:
        step = lambda x, cache: mha.extend(x, x, cache)  # noqa: E731
    cache = mha.init_cache((B,), SINK + WINDOW, sink_tokens=SINK, window=WINDOW, rope_positions="cache")
    storage, rows, held = _storage(cache), M.asarray(_random(B, 1, D, seed=7)), {}
    for t in range(4 * N):
        _, _, cache = step(rows, cache)
        if t + 1 in (N, 4 * N):
            held[t + 1] = _bytes(cache)
    assert int(cache.length) == 4 * N and held[N] == held[4 * N] == _bytes(mha.init_cache(
        (B,), SINK + WINDOW, sink_tokens=SINK, window=WINDOW, rope_positions="cache")), held
    if name == "attention_torch":
        assert _storage(cache) == storage  # the same storage: written in place


def _arrays(cache) -> list:
    """The cache's arrays: its fields' and those of its tuples (the RoPE tables)."""
    found = []
    for field in cache:
        for x in field if isinstance(field, tuple) else (field,):
            if hasattr(x, "shape") and len(x.shape):
                found.append(x)
    return found


def _bytes(cache) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in _arrays(cache))


def _storage(cache) -> list[int]:
    return [x.data_ptr() for x in _arrays(cache) if hasattr(x, "data_ptr")]


@pytest.mark.parametrize(("arguments", "message"), [
    ({"sink_tokens": 3, "window": 3}, "sink_tokens \\+ window must fit the capacity: sink_tokens=3 \\+ window=3"),
    ({"sink_tokens": 1, "window": 0}, "window must be a positive int"),
    ({"sink_tokens": 1, "window": -2}, "window must be a positive int"),
    ({"sink_tokens": -1, "window": 2}, "sink_tokens must be a non-negative int"),
    ({"sink_tokens": 1}, "sink_tokens=1 needs window"),
    ({"window": 2, "rope_positions": "slots"}, "rope_positions must be one of"),
], ids=["past_capacity", "zero_window", "negative_window", "negative_sinks", "sinks_without_window", "bad_rope"])
def test_init_cache_errors_name_the_arguments(backend: ModuleType, arguments, message):
    with pytest.raises(ValueError, match=message):
        _mha(backend).init_cache((B,), 5, **arguments)


def test_extend_errors_name_the_arguments(backend: ModuleType):
    M = backend
    mha = _mha(M)
    cache = mha.init_cache((B,), SINK + WINDOW, sink_tokens=SINK, window=WINDOW)
    x = M.asarray(_random(B, WINDOW + 1, D))
    with pytest.raises(ValueError, match="at most window=3 new positions at once; got L=4"):
        mha.extend(x, x, cache)
    x = M.asarray(_random(B, 1, D))
    with pytest.raises(ValueError, match="takes no new_lengths"):
        mha.extend(x, x, cache, new_lengths=M.asarray(np.ones(B, np.int32)))
    with pytest.raises(ValueError, match="takes no mask"):
        mha.extend(x, x, cache, M.asarray(np.ones((B, H, 1, SINK + WINDOW), bool)))
    with pytest.raises(TypeError, match="sink_tokens"):  # the paged cache does not stream
        mha.init_paged_cache(B, 4, 2, 2, sink_tokens=SINK, window=WINDOW)


@pytest.mark.slow  # JAX compiles
@pytest.mark.parametrize("rope_positions", ["original", "cache"])
def test_jax_serves_every_decode_step_with_one_compiled_step(rope_positions):
    jax = pytest.importorskip("jax")
    M = import_backend("attention_jax")
    block = _module(M, "block", **LLAMA)
    traces = []

    def step(block, x, cache):
        traces.append(1)  # runs when JAX traces, not when the compiled program runs
        return block.extend(x, cache)

    step = jax.jit(step)
    cache = block.init_cache((B,), SINK + WINDOW, sink_tokens=SINK, window=WINDOW, rope_positions=rope_positions)
    for t in range(3 * (SINK + WINDOW)):  # the sinks filled, the ring turned twice: the slot index is data
        _, _, cache = step(block, M.asarray(_random(B, 1, D, seed=t)), cache)
    assert len(traces) == 1 and int(cache.length) == 3 * (SINK + WINDOW)
