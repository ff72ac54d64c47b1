"""Grouped-query attention (enable_gqa, SPEC 2a) on every backend and both paths: against attention with k
and v repeated per query head, against torch's and jax.nn's own grouped attention, its gradients (dk and dv
summed over each group), its errors (SPEC 7), and the memory it saves: no fast path copies k or v once per
query head, measured."""

from __future__ import annotations

import functools
import tracemalloc
from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close, converted, one_program, sdpa
from tests.conftest import import_backend

RTOL = REORDERED  # float64 on every backend: the same math computed another way
B, H, L, S, E, Ev = 2, 4, 3, 5, 2, 3


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _grouped_qkv(Hkv: int, seed: int = 0) -> list[np.ndarray]:
    """q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev)."""
    return [_random(B, H, L, E, seed=seed), _random(B, Hkv, S, E, seed=seed + 1), _random(B, Hkv, S, Ev, seed=seed + 2)]


def _attention(M: ModuleType, q, k, v, mask=None, *, d_out=None, **options) -> tuple:
    """M's attention on NumPy inputs (out, weights), or with d_out its vjp's gradients at d_out (dq, dk, dv, dbias),
    as NumPy arrays; JAX's as one program (tests._compare.one_program). The claims of the tests that call it are
    values; the tests of the errors and of the exact head each query reads call the backend eagerly."""
    if d_out is None:
        results = one_program(M, "scaled_dot_product_attention", q, k, v, mask, **options)
    else:
        results = one_program(M, "scaled_dot_product_attention_vjp", q, k, v, mask, d_out=d_out, **options)[-1]
    return tuple(None if x is None else M.to_numpy(x) for x in results)


def _repeated(x: np.ndarray) -> np.ndarray:
    """(B, Hkv, S, *) -> (B, H, S, *): query head h gets key/value head h // (H / Hkv), written out."""
    return np.stack([x[:, h // (H // x.shape[1])] for h in range(H)], axis=1)


# Every keyword that follows q's heads: a mask per head, a bias per head, offsets and lengths per head
KEYWORDS = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "mask_and_bias_per_head": dict(mask=_random(H, L, S, seed=7) > -0.5, bias=_random(B, H, L, S, seed=8)),
    "everything": dict(is_causal=True, q_offset=np.array([[2, 0, -1, 3]]), window=(1, 0),
                       key_lengths=np.array([[5], [3]]), softcap=1.0, bias=_random(H, 1, S, seed=9)),
}


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
@pytest.mark.parametrize("Hkv", [1, 2, 4])
@pytest.mark.parametrize("options", KEYWORDS.values(), ids=KEYWORDS.keys())
def test_grouped_heads_equal_repeated_keys_and_values(backend: ModuleType, options: dict, Hkv: int,
                                                      need_weights: bool):
    q, k, v = _grouped_qkv(Hkv)
    options = dict(options)
    mask = options.pop("mask", None)
    out, weights = _attention(backend, q, k, v, mask, enable_gqa=True, need_weights=need_weights, **options)
    expected, expected_weights = sdpa(import_backend("attention_np"), q, _repeated(k), _repeated(v), mask,
                                       **options)
    assert out.shape == (B, H, L, Ev)
    assert_close(out, expected, RTOL, "out")
    if need_weights:
        assert weights.shape == (B, H, L, S)  # per query head
        assert_close(weights, expected_weights, RTOL, "weights")


def test_query_head_h_reads_key_value_head_h_over_g(backend: ModuleType):
    # one key per head, v holding the head's index: out[:, h] = h // G exactly, G = 2 (not h % Hkv)
    q, k = _random(1, 4, 2, 2), _random(1, 2, 1, 2)
    v = np.arange(2.0).reshape(1, 2, 1, 1)  # kv head 0 holds 0, kv head 1 holds 1
    out, _ = sdpa(backend, q, k, v, enable_gqa=True)
    np.testing.assert_array_equal(out[0, :, :, 0], [[0, 0], [0, 0], [1, 1], [1, 1]])


def test_one_key_value_head_equals_broadcasting_it(backend: ModuleType):
    # multi-query attention: Hkv = 1 with the flag is k (B, 1, S, E) broadcast over the heads without it
    q, k, v = _grouped_qkv(1, seed=3)
    for need_weights in (True, False):
        grouped, _ = _attention(backend, q, k, v, enable_gqa=True, need_weights=need_weights, is_causal=True)
        broadcast, _ = _attention(backend, q, k, v, need_weights=need_weights, is_causal=True)
        assert_close(grouped, broadcast, RTOL, f"need_weights={need_weights}")


def test_grouped_heads_with_more_leading_axes_and_rank_3(backend: ModuleType):
    rng = np.random.default_rng(4)
    for q_shape, kv_lead in (((3, L, E), (1,)), ((2, 3, 4, L, E), (2, 3, 2)), ((2, 3, 4, L, E), (3, 2))):
        q = rng.standard_normal(q_shape)
        k, v = rng.standard_normal((*kv_lead, S, E)), rng.standard_normal((*kv_lead, S, Ev))
        G = q_shape[-3] // kv_lead[-1]
        repeat = [np.repeat(x, G, axis=-3) for x in (k, v)]
        expected, _ = sdpa(import_backend("attention_np"), q, *repeat)
        for need_weights in (True, False):
            out, _ = _attention(backend, q, k, v, enable_gqa=True, need_weights=need_weights)
            assert_close(out, expected, RTOL, f"{q_shape} against {kv_lead}, need_weights={need_weights}")


# ---- against the frameworks' own grouped attention


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Hkv", [1, 2])
def test_against_torch_sdpa_enable_gqa(backend: ModuleType, Hkv: int, is_causal: bool):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    q, k, v = _grouped_qkv(Hkv, seed=5)
    mask = _random(B, 1, L, S, seed=6) > -1.0
    mask[..., 0] = True  # every row sees key 0: torch's kernel gives NaN rows where none is visible
    theirs = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                            attn_mask=None if is_causal else torch.from_numpy(mask),
                                            is_causal=is_causal, enable_gqa=True).numpy()
    for need_weights in (True, False):
        ours, _ = _attention(backend, q, k, v, None if is_causal else mask, is_causal=is_causal, enable_gqa=True,
                             need_weights=need_weights)
        assert_close(ours, theirs, RTOL, "against torch")


@pytest.mark.parametrize("Hkv", [1, 2])
def test_against_jax_nn_with_fewer_key_value_heads(backend: ModuleType, Hkv: int):
    # jax.nn takes (B, T, N, H) with N query heads and K key/value heads, query head n reading n // (N / K)
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    q, k, v = _grouped_qkv(Hkv, seed=7)
    v = _random(B, Hkv, S, E, seed=8)  # jax.nn: Ev = E
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):  # jax: its own code mixes
        theirs = jax.nn.dot_product_attention(*(jnp.asarray(np.swapaxes(x, 1, 2)) for x in (q, k, v)),
                                              is_causal=True, implementation="xla")  # (B, L, H, Ev)
    ours, _ = _attention(backend, q, k, v, is_causal=True, enable_gqa=True, need_weights=False)
    # jax.nn: its softmax runs in float32 even for float64 inputs; a wrong head would be off by far more
    assert_close(ours, np.swapaxes(np.asarray(theirs), 1, 2), 1e-6, "against jax.nn")


# ---- gradients


def _vjp(M: ModuleType, inputs: list, d_out: np.ndarray, options: dict) -> list[np.ndarray | None]:
    keywords = {name: converted(M, value) for name, value in options.items()}
    _, _, pullback = M.scaled_dot_product_attention_vjp(*(M.asarray(x) for x in inputs), **keywords)
    return [None if g is None else M.to_numpy(g) for g in pullback(M.asarray(d_out))]


@pytest.mark.parametrize("options", KEYWORDS.values(), ids=KEYWORDS.keys())
def test_vjp_sums_dk_and_dv_over_each_group(backend: ModuleType, options: dict):
    Hkv = 2
    q, k, v = _grouped_qkv(Hkv, seed=10)
    d_out = _random(B, H, L, Ev, seed=11)
    dq, dk, dv, dbias = _attention(backend, q, k, v, d_out=d_out, **options, enable_gqa=True)
    r_dq, r_dk, r_dv, r_dbias = _vjp(import_backend("attention_np"), [q, _repeated(k), _repeated(v)], d_out, options)
    assert dk.shape == k.shape and dv.shape == v.shape
    assert_close(dq, r_dq, RTOL, "dq")
    assert_close(dk, r_dk.reshape(B, Hkv, H // Hkv, S, E).sum(axis=2), RTOL, "dk: the group's sum")
    assert_close(dv, r_dv.reshape(B, Hkv, H // Hkv, S, Ev).sum(axis=2), RTOL, "dv: the group's sum")
    assert (dbias is None) == (r_dbias is None)
    if dbias is not None:
        assert_close(dbias, r_dbias, RTOL, "dbias")


def test_numpy_vjp_matches_central_differences_of_k():
    M = import_backend("attention_np")
    q, k, v = _grouped_qkv(2, seed=12)
    d_out, u = _random(B, H, L, Ev, seed=13), _random(*k.shape, seed=14)
    options = dict(enable_gqa=True, is_causal=True, softcap=2.0)
    _, dk, _, _ = _vjp(M, [q, k, v], d_out, options)
    h = 1e-6
    plus, minus = (M.scaled_dot_product_attention(q, k + sign * h * u, v, **options)[0] for sign in (1, -1))
    assert np.sum(dk * u) == pytest.approx(np.sum(d_out * (plus - minus)) / (2 * h), rel=1e-7)


# ---- dropout: each query head draws its own decisions, also within a group


def test_the_suites_dropout_checks_hold_on_grouped_heads(backend: ModuleType):
    from conformance.contract import cases
    from conformance.run import checks

    case = cases.sdpa_case((2, 4), 3, 5)
    case = case._replace(k=case.k[:, :2], v=case.v[:, :2], enable_gqa=True, dropout=0.5)
    runner = checks.Runner(backend)
    measures = checks.dropout(runner, case, "float32") | checks.dropout_independence(runner, case, "float32")
    assert all(measure.error <= 1 for measure in measures.values()), measures


# ---- errors (SPEC 7)

ERRORS = {
    "heads not a multiple": ((B, 3, L, E), (B, 2, S, E), (B, 2, S, Ev), {}, ["H = 3", "Hkv = 2", "(2, 3, 3, 2)"]),
    "q without a head axis": ((L, E), (1, S, E), (1, S, Ev), {}, ["enable_gqa", "q", "(3, 2)"]),
    "k without a head axis": ((2, L, E), (S, E), (S, Ev), {}, ["enable_gqa", "k", "(5, 2)"]),
    "k and v heads differ": ((B, 4, L, E), (B, 2, S, E), (B, 1, S, Ev), {}, ["k", "v", "Hkv"]),
    "no key/value head": ((B, 4, L, E), (B, 0, S, E), (B, 0, S, Ev), {}, ["H = 4", "Hkv = 0"]),
    "mask per key/value head": ((B, 4, L, E), (B, 2, S, E), (B, 2, S, Ev), {"mask": np.ones((2, L, S), bool)},
                                ["mask", "(2, 3, 5)", "(2, 4, 3, 5)"]),
    "q_offset per key/value head": ((B, 4, L, E), (B, 2, S, E), (B, 2, S, Ev), {"q_offset": np.zeros(2, int)},
                                    ["q_offset", "(2,)", "(2, 4)"]),
}


@pytest.mark.parametrize("vjp", [False, True], ids=["forward", "vjp"])
@pytest.mark.parametrize(("q_shape", "k_shape", "v_shape", "options", "words"), ERRORS.values(), ids=ERRORS.keys())
def test_each_grouping_mistake_raises_the_same_error(backend: ModuleType, q_shape, k_shape, v_shape, options: dict,
                                                     words: list, vjp: bool):
    q, k, v = (backend.asarray(np.zeros(shape)) for shape in (q_shape, k_shape, v_shape))
    options = {name: converted(backend, value) for name, value in options.items()}
    function = backend.scaled_dot_product_attention_vjp if vjp else backend.scaled_dot_product_attention
    with pytest.raises(ValueError) as raised:
        function(q, k, v, enable_gqa=True, **options)
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_without_the_flag_unequal_head_counts_do_not_broadcast(backend: ModuleType):
    q, k, v = (backend.asarray(x) for x in _grouped_qkv(2))
    with pytest.raises(ValueError, match="broadcast"):
        backend.scaled_dot_product_attention(q, k, v)


# ---- memory: no copy of k and v per query head

# Hkv = 1 of H = 32 heads, a long S and few queries: k and v repeated per head would take 32 times their
# size, far above everything else a call allocates (the scores are H L S, a sixteenth of the copies)
MEMORY = dict(B=1, H=32, L=4, S=4096, E=32)


def _copies_mib(B: int, H: int, L: int, S: int, E: int) -> float:
    """The repeated k and v, float32: 2 B H S E * 4 bytes."""
    return 2 * B * H * S * E * 4 / 2**20


def _memory_inputs(B: int, H: int, L: int, S: int, E: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape, np.float32) for shape in ((B, H, L, E), (B, 1, S, E), (B, 1, S, E))]


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
def test_numpy_allocates_no_copy_per_head(need_weights: bool):
    M = import_backend("attention_np")
    q, k, v = _memory_inputs(**MEMORY)
    tracemalloc.start()
    M.scaled_dot_product_attention(q, k, v, enable_gqa=True, need_weights=need_weights)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    assert peak < _copies_mib(**MEMORY) / 4, f"peak {peak:.1f} MiB, copies {_copies_mib(**MEMORY):.1f} MiB"


def test_jax_compiles_no_copy_per_head():
    # XLA's plan of temporaries for the jitted call, against the same call on k and v repeated per head
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    M = import_backend("attention_jax")
    q, k, v = (jnp.asarray(x) for x in _memory_inputs(**MEMORY))

    def temporaries(function, *args) -> float:
        return jax.jit(function).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20

    def grouped_call(q, k, v, need_weights):
        return M.scaled_dot_product_attention(q, k, v, enable_gqa=True, need_weights=need_weights)

    def repeated_call(q, k, v, need_weights):
        k, v = (jnp.repeat(x, MEMORY["H"], axis=1) for x in (k, v))
        return M.scaled_dot_product_attention(q, k, v, need_weights=need_weights)

    for need_weights in (True, False):
        grouped = temporaries(functools.partial(grouped_call, need_weights=need_weights), q, k, v)
        repeated = temporaries(functools.partial(repeated_call, need_weights=need_weights), q, k, v)
        assert repeated - grouped > _copies_mib(**MEMORY) / 2, (grouped, repeated)
        assert grouped < _copies_mib(**MEMORY) / 2, grouped


# torch: 1 < Hkv < H, where matmul would broadcast k and v over each group by copying them once per query head
# (Hkv = 1 is one matrix to it, never copied); few queries and a long S, so that the copies (16 MiB) stand far
# above the scores (1 MiB)
TORCH_MEMORY = dict(B=1, H=16, Hkv=4, L=8, S=2048, E=64)


def _torch_peak_mib(call) -> float:
    """The peak of torch's CPU allocator over call(), in MiB above what was allocated before it: the running sum
    of the allocations and frees that torch's profiler records, which starts from zero (the peak resident
    memory of a process starts from what it held before, and a child's from its parent's)."""
    import torch

    # torch: autograd's profiler, which torch.profiler.profile wraps; that one imports torch._inductor (seconds)
    with torch.autograd.profiler.profile(profile_memory=True) as profile:
        call()
    events = sorted((e.start_ns(), e.nbytes()) for e in profile.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    held = peak = 0
    for _, nbytes in events:  # + an allocation, - a free
        held += nbytes
        peak = max(peak, held)
    return peak / 2**20


@pytest.mark.parametrize("path", ["explicit", "fast", "vjp", "flash"])
def test_torch_allocates_no_copy_per_head(path: str):
    # the grouped call against the same call on k and v repeated per head beforehand: it may allocate no more
    # than that call does, give or take far less than the copies (the vjp less, as dk and dv are Hkv heads)
    torch = pytest.importorskip("torch")
    M = import_backend("attention_torch")
    B, H, Hkv, L, S, E = TORCH_MEMORY.values()
    rng = torch.Generator().manual_seed(0)
    q, d_out = torch.randn(B, H, L, E, generator=rng), torch.randn(B, H, L, E, generator=rng)
    k, v = torch.randn(B, Hkv, S, E, generator=rng), torch.randn(B, Hkv, S, E, generator=rng)
    repeated = [x.repeat_interleave(H // Hkv, dim=1) for x in (k, v)]  # (B, H, S, E): head h gets h // G

    calls = {  # flash with one key tile: a copy of a tile per query head would be one of all of k and v
        "explicit": lambda k, v, **options: M.scaled_dot_product_attention(q, k, v, **options),
        "fast": lambda k, v, **options: M.scaled_dot_product_attention(q, k, v, need_weights=False, **options),
        "vjp": lambda k, v, **options: M.scaled_dot_product_attention_vjp(q, k, v, **options)[2](d_out),
        "flash": lambda k, v, **options: M.flash_attention(q, k, v, block_k=S, **options),
    }
    call = calls[path]

    grouped = _torch_peak_mib(lambda: call(k, v, enable_gqa=True))
    plain = _torch_peak_mib(lambda: call(*repeated))
    copies = 2 * B * H * S * E * 4 / 2**20  # the repeated k and v, float32
    assert grouped < plain + copies / 4, f"{path}: peak {grouped:.1f} MiB against {plain:.1f} MiB on k and v " \
                                         f"repeated beforehand; the copies are {copies:.1f} MiB"
