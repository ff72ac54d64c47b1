"""ALiBi (SPEC.md section 2i) on every backend: each score gets the bias -slope_h * |p_i - j|, p_i = q_offset + i
the query's position and j the key's, flash-attn's `alibi_slopes` (BLOOM, MPT).

scaled_dot_product_attention (both paths), flash_attention (several tiles, the bias built per tile) and their
vjps against the rule written out here as an additive bias (with q_offset != 0, causal, grouped-query heads,
slopes (H,) and (B, H)), against the float64 oracle, the gradients against central differences (the slopes take
none), and the errors. ring_attention (NumPy on 1, 2 and 4 simulated devices, JAX on meshes of 2 and 4 simulated
devices, torch on 2 gloo ranks: tests/test_ring_torch.py) and flex_attention (the bias after its score function,
before its block mask) and their vjps against the oracle and the oracle's own gradients of the bias written out,
with and without sinks.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from conformance.contract import oracle, oracle_gradients
from tests._compare import REORDERED, assert_close, central_differences, one_program

B, H, HKV, L, S, E = 2, 4, 2, 5, 7, 3  # grouped-query heads: two query heads per key/value head
Q_OFFSET = S - L  # bottom-right alignment: the last query sits at the last key
TILES = ((1, 1), (2, 3), (4, 16))  # flash_attention's (block_q, block_k): single entries, ragged, one key tile
GRADIENT_RTOL = 1e-7  # central differences at h = 1e-5 resolve a float64 derivative to about 1e-10


def _case(seed: int = 0) -> dict[str, np.ndarray]:
    """q (B, H, L, E), k and v (B, Hkv, S, E), slopes (H,) of different sizes."""
    rng = np.random.default_rng(seed)
    return {"q": rng.standard_normal((B, H, L, E)), "k": rng.standard_normal((B, HKV, S, E)),
            "v": rng.standard_normal((B, HKV, S, E)), "slopes": np.array([0.5, 0.25, 1.5, 0.0625])}


def _alibi_bias(slopes: np.ndarray, q_offset: int, L: int, S: int) -> np.ndarray:
    """flash-attn's rule, written out: bias_hij = -slope_h * |i + q_offset - j|; slopes (H,) or (B, H) ->
    (H, L, S) or (B, H, L, S)."""
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    return -np.asarray(slopes)[..., None, None] * np.abs(i + q_offset - j)


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
@pytest.mark.parametrize("shape", ["(H,)", "(B, H)"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sdpa_with_alibi_is_the_bias_written_out(backend: ModuleType, need_weights: bool, shape: str,
                                                 is_causal: bool) -> None:
    case = _case()
    slopes = case["slopes"] if shape == "(H,)" else case["slopes"] * np.array([[1.0], [3.0]])  # (B, H)
    bias = _alibi_bias(slopes, Q_OFFSET, L, S)
    options = {"is_causal": is_causal, "q_offset": Q_OFFSET, "enable_gqa": True}
    expected_out, expected_weights = one_program(backend, "scaled_dot_product_attention", case["q"], case["k"],
                                                 case["v"], bias=bias, **options)
    out, weights = one_program(backend, "scaled_dot_product_attention", case["q"], case["k"], case["v"],
                               alibi_slopes=slopes, need_weights=need_weights, **options)
    assert_close(backend.to_numpy(out), backend.to_numpy(expected_out), REORDERED, "out")
    if need_weights:
        assert_close(backend.to_numpy(weights), backend.to_numpy(expected_weights), REORDERED, "weights")
    oracle_out, _ = oracle.sdpa(case["q"], case["k"], case["v"], alibi_slopes=slopes, **options)
    assert_close(backend.to_numpy(out), oracle_out, REORDERED, "out against the oracle")


@pytest.mark.parametrize("tiles", TILES, ids=str)
@pytest.mark.parametrize("q_offset", [Q_OFFSET, -2], ids=["bottom-right", "negative"])
def test_flash_with_alibi_is_the_bias_written_out(backend: ModuleType, tiles: tuple[int, int], q_offset: int) -> None:
    case = _case()
    slopes = case["slopes"] * np.array([[1.0], [3.0]])  # (B, H)
    options = {"is_causal": True, "q_offset": q_offset, "enable_gqa": True}
    expected_out, expected_lse = oracle.log_sum_exp(case["q"], case["k"], case["v"],
                                                    bias=_alibi_bias(slopes, q_offset, L, S), **options)
    out, lse = one_program(backend, "flash_attention", case["q"], case["k"], case["v"], alibi_slopes=slopes,
                           block_q=tiles[0], block_k=tiles[1], **options)
    assert_close(backend.to_numpy(out), expected_out, REORDERED, "out")
    assert_close(backend.to_numpy(lse), expected_lse, REORDERED, "lse")


def test_the_oracle_with_alibi_is_the_bias_written_out() -> None:
    case = _case()
    for q_offset in (0, Q_OFFSET, -2):
        bias = _alibi_bias(case["slopes"], q_offset, L, S)
        expected = oracle.sdpa(case["q"], case["k"], case["v"], bias=bias, q_offset=q_offset, is_causal=True,
                               enable_gqa=True)
        got = oracle.sdpa(case["q"], case["k"], case["v"], alibi_slopes=case["slopes"], q_offset=q_offset,
                          is_causal=True, enable_gqa=True)
        for name, a, b in zip(("out", "weights"), got, expected, strict=True):
            assert_close(a, b, REORDERED, f"{name}, q_offset={q_offset}")


def test_alibi_adds_to_a_bias_and_follows_a_q_offset_per_sequence(backend: ModuleType) -> None:
    case = _case(3)
    bias = np.random.default_rng(4).standard_normal((L, S))
    offsets = np.array([1, 4])[:, None]  # (B, 1): one position of query 0 per sequence
    expected = np.stack([_alibi_bias(case["slopes"], int(offset), L, S) for offset in offsets[:, 0]]) + bias
    for need_weights in (True, False):
        out, _ = one_program(backend, "scaled_dot_product_attention", case["q"], case["k"], case["v"],
                             bias=bias, alibi_slopes=case["slopes"], q_offset=offsets, is_causal=True,
                             enable_gqa=True, need_weights=need_weights)
        reference, _ = oracle.sdpa(case["q"], case["k"], case["v"], bias=expected, q_offset=offsets,
                                   is_causal=True, enable_gqa=True)
        assert_close(backend.to_numpy(out), reference, REORDERED, f"out, need_weights={need_weights}")


@pytest.fixture(scope="module")
def reference_gradients() -> dict[str, np.ndarray]:
    """d <oracle.sdpa(...), d_out> / d{q, k, v} by central differences, float64, with ALiBi's bias written out."""
    case = _case(1)
    d_out = np.random.default_rng(2).standard_normal((B, H, L, E))
    bias = _alibi_bias(case["slopes"], Q_OFFSET, L, S)

    def out(**changed: np.ndarray) -> np.ndarray:
        arrays = case | changed
        return oracle.sdpa(arrays["q"], arrays["k"], arrays["v"], bias=bias, is_causal=True, q_offset=Q_OFFSET,
                           enable_gqa=True)[0]

    grads = {name: central_differences(lambda x, name=name: out(**{name: x}), case[name], d_out, 1e-5)
             for name in ("q", "k", "v")}
    return grads | {"d_out": d_out}


@pytest.mark.parametrize("function", ["scaled_dot_product_attention_vjp", "flash_attention_vjp"])
def test_gradients_with_alibi_are_central_differences(backend: ModuleType, function: str,
                                                      reference_gradients: dict[str, np.ndarray]) -> None:
    case = _case(1)
    tiles = {"block_q": 2, "block_k": 3} if function == "flash_attention_vjp" else {}
    *_, grads = one_program(backend, function, case["q"], case["k"], case["v"], d_out=reference_gradients["d_out"],
                            is_causal=True, q_offset=Q_OFFSET, enable_gqa=True, alibi_slopes=case["slopes"], **tiles)
    dq, dk, dv, dbias = grads  # the slopes are constants: no gradient follows dbias
    assert dbias is None
    for name, grad in (("q", dq), ("k", dk), ("v", dv)):
        assert_close(backend.to_numpy(grad), reference_gradients[name], GRADIENT_RTOL, f"d{name}")


@pytest.mark.parametrize("function", ["scaled_dot_product_attention", "flash_attention", "flex_attention"])
def test_slopes_not_one_per_query_head_raise(backend: ModuleType, function: str) -> None:
    case = _case()
    q, k, v = (backend.asarray(case[name]) for name in "qkv")
    for shape in ((HKV,), (3, H), (B, H, 1), ()):
        with pytest.raises(ValueError, match=rf"alibi_slopes of shape {re_shape(shape)} must be \(H,\) or \(B, H\)"):
            getattr(backend, function)(q, k, v, enable_gqa=True, alibi_slopes=backend.asarray(np.ones(shape)))


def re_shape(shape: tuple[int, ...]) -> str:
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def test_numpy_ring_slopes_not_one_per_query_head_raise() -> None:
    import attention_np

    case = _ring_case()
    with pytest.raises(ValueError, match=rf"alibi_slopes of shape {re_shape((HKV,))} must be \(H,\) or \(B, H\)"):
        attention_np.ring_attention(case["q"], case["k"], case["v"], devices=2, enable_gqa=True,
                                    alibi_slopes=np.ones(HKV))


# ring_attention: each device's chunk pairs at their global positions (q_offset of the pair), so that the bias is
# the whole sequence's; L = 8 queries against S = 16 keys: 2P chunks of 1 and 2 rows on P = 4 devices with is_causal
RING_L, RING_S = 8, 16
RING_OFFSETS = {"top-left": 0, "bottom-right": RING_S - RING_L, "negative": -3}  # -3: queries 0..2 see no key
# with is_causal; slopes (H,) without sinks and (B, H) with them
RING_SLOPES = {"(H,)": False, "(B, H) and sinks": True}


def _ring_case(seed: int = 11) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"q": rng.standard_normal((B, H, RING_L, E)), "k": rng.standard_normal((B, HKV, RING_S, E)),
            "v": rng.standard_normal((B, HKV, RING_S, E)), "d_out": rng.standard_normal((B, H, RING_L, E))}


def _ring_slopes(with_sinks: bool) -> dict[str, np.ndarray | None]:
    slopes = _case()["slopes"]
    if not with_sinks:
        return {"alibi_slopes": slopes, "sinks": None}  # (H,)
    return {"alibi_slopes": slopes * np.array([[1.0], [3.0]]), "sinks": np.array([0.5, -1.0, 2.0, 1.5])}  # (B, H)


def _ring_reference(q_offset: int, is_causal: bool, with_sinks: bool) -> tuple:
    """The oracle's out and lse with the slopes, then the oracle's own gradients (oracle_gradients.sdpa_vjp) with
    ALiBi written out as a bias: dq, dk, dv, and d_sinks with sinks."""
    case, given = _ring_case(), _ring_slopes(with_sinks)
    options = {"is_causal": is_causal, "q_offset": q_offset, "enable_gqa": True, "sinks": given["sinks"]}
    out, lse = oracle.log_sum_exp(case["q"], case["k"], case["v"], alibi_slopes=given["alibi_slopes"], **options)
    bias = _alibi_bias(given["alibi_slopes"], q_offset, RING_L, RING_S)
    grads = oracle_gradients.sdpa_vjp(case["q"], case["k"], case["v"], case["d_out"], bias=bias, **options)
    return out, lse, *(grads[name] for name in ("q", "k", "v", "sinks") if name in grads)


def _ring_errors(got: tuple, expected: tuple) -> list[tuple[str, float]]:
    """(name, relative error) of out, lse, dq, dk, dv (and d_sinks): the largest difference over the largest
    entry (over 1e-300 where every entry is 0), lse's -inf (a query that sees no key, without a sink) compared
    as -inf."""
    assert len(got) == len(expected), f"{len(got)} results, {len(expected)} expected"
    errors = []
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "d_sinks"), got, expected, strict=False):  # no d_sinks
        # without sinks
        a, b = np.asarray(a), np.asarray(b)
        if not np.array_equal(np.isneginf(a), np.isneginf(b)):
            errors.append((f"{name}: -inf elsewhere", math.inf))
            continue
        finite = np.isfinite(b)
        largest = max(np.max(np.abs(b[finite]), initial=0.0), 1e-300)  # zeros: a rank's keys that no query sees
        errors.append((name, float(np.max(np.abs(a[finite] - b[finite]), initial=0.0) / largest)))
    return errors


@pytest.mark.parametrize("given", RING_SLOPES.values(), ids=RING_SLOPES.keys())
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_offset", RING_OFFSETS.values(), ids=RING_OFFSETS.keys())
def test_numpy_ring_with_alibi_is_the_oracles(q_offset: int, is_causal: bool, given: bool) -> None:
    import attention_np

    case, expected = _ring_case(), _ring_reference(q_offset, is_causal, given)
    for devices in (1, 2, 4):
        out, lse, pullback = attention_np.ring_attention_vjp(
            case["q"], case["k"], case["v"], devices=devices, is_causal=is_causal, q_offset=q_offset,
            enable_gqa=True, block_q=3, block_k=2, **_ring_slopes(given))
        for name, error in _ring_errors((out, lse, *pullback(case["d_out"])), expected):
            assert error <= REORDERED, f"{name} on {devices} devices: relative error {error:.3g}"


# the JAX and torch rings: a few of the cases above, each a compilation (JAX) or in one launch (torch)
DISTRIBUTED_CASES = (("bottom-right", True, True), ("negative", True, False), ("top-left", False, True))

JAX_RING = """
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
from jax.sharding import Mesh
import attention_jax
from tests.test_alibi import RING_OFFSETS, REORDERED, _ring_case, _ring_errors, _ring_reference, _ring_slopes
case = {name: jax.numpy.asarray(x) for name, x in _ring_case().items()}
for devices, (offset, is_causal, with_sinks) in ((2, ("bottom-right", True, True)), (4, ("negative", True, False))):
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    expected = _ring_reference(RING_OFFSETS[offset], is_causal, with_sinks)
    out, lse, pullback = attention_jax.ring_attention_vjp(
        case["q"], case["k"], case["v"], mesh=mesh, axis="x", is_causal=is_causal, q_offset=RING_OFFSETS[offset],
        enable_gqa=True, block_q=2, block_k=2, **_ring_slopes(with_sinks))
    for name, error in _ring_errors((out, lse, *pullback(case["d_out"])), expected):
        assert error <= REORDERED, (devices, offset, name, error)
print("ok")
"""


@pytest.mark.slow  # starts a process with its own JAX, on four simulated devices
def test_jax_ring_with_alibi_is_the_oracles_on_two_and_four_devices() -> None:
    pytest.importorskip("jax")
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"}
    result = subprocess.run([sys.executable, "-c", JAX_RING], env=env, capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0 and "ok" in result.stdout, f"{result.stdout}\n{result.stderr}"


def _torch_ring_with_alibi(rank: int, world_size: int) -> list[str]:
    """On one rank of a gloo group: ring_attention_vjp with ALiBi against the rank's rows of the oracle's; what
    failed."""
    import torch

    import attention_torch

    failures = []
    for offset, is_causal, with_sinks in DISTRIBUTED_CASES:
        case, given = _ring_case(), _ring_slopes(with_sinks)
        out, lse, *grads = _ring_reference(RING_OFFSETS[offset], is_causal, with_sinks)
        rows, keys = (slice(rank * n // world_size, (rank + 1) * n // world_size) for n in (RING_L, RING_S))
        q, d_out = (torch.from_numpy(case[name][..., rows, :].copy()) for name in ("q", "d_out"))
        k, v = (torch.from_numpy(case[name][..., keys, :].copy()) for name in ("k", "v"))
        got_out, got_lse, pullback = attention_torch.ring_attention_vjp(
            q, k, v, is_causal=is_causal, q_offset=RING_OFFSETS[offset], enable_gqa=True, block_q=2, block_k=2,
            **{name: None if x is None else torch.from_numpy(x) for name, x in given.items()})
        expected = (out[..., rows, :], lse[..., rows], grads[0][..., rows, :], grads[1][..., keys, :],
                    grads[2][..., keys, :], *grads[3:])  # d_sinks: the whole sequence's on every rank
        got = (got_out, got_lse, *pullback(d_out))
        for name, error in _ring_errors(tuple(x.numpy() for x in got), expected):
            if not error <= REORDERED:
                failures.append(f"rank {rank}, {offset}, is_causal={is_causal}, {name}: relative error {error:.3g}")
    return failures


# tests/test_ring_torch.py runs _torch_ring_with_alibi in its launch of 2 ranks (starting them is most of the time)


# flex_attention: query i at position i (no q_offset); the bias after the score function, before the block mask,
# where sdpa adds it: flex with mods.softcap(cap) is sdpa with softcap=cap, and the oracle's gradients take that
FLEX_CASES = {"causal, softcap, (B, H), sinks": True, "no block mask, (H,)": False}


@pytest.mark.parametrize("composed", FLEX_CASES.values(), ids=FLEX_CASES.keys())
def test_flex_with_alibi_is_the_oracles(backend: ModuleType, composed: bool) -> None:
    from attention_np.common import mods

    case = _case(12)
    d_out = np.random.default_rng(13).standard_normal((B, H, L, E))
    slopes = case["slopes"] * np.array([[1.0], [3.0]]) if composed else case["slopes"]
    sinks = np.array([0.5, -1.0, 2.0, 1.5]) if composed else None
    softcap = 2.0 if composed else None
    rules = {"mask_mod": mods.causal(), "score_mod": mods.softcap(softcap)} if composed else {}
    out, lse = oracle.log_sum_exp(case["q"], case["k"], case["v"], enable_gqa=True, alibi_slopes=slopes, sinks=sinks,
                                  **rules)
    grads = oracle_gradients.sdpa_vjp(case["q"], case["k"], case["v"], d_out, bias=_alibi_bias(slopes, 0, L, S),
                                      is_causal=composed, softcap=softcap, enable_gqa=True, sinks=sinks)
    options = {"enable_gqa": True, "alibi_slopes": slopes}
    if composed:
        options |= {"score_mod": rules["score_mod"], "sinks": sinks,
                    "block_mask": backend.create_block_mask(rules["mask_mod"], B, H, L, S, BLOCK_SIZE=(2, 3))}
    got_out, got_lse = one_program(backend, "flex_attention", case["q"], case["k"], case["v"], return_lse=True,
                                   **options)
    _, _, got_grads = one_program(backend, "flex_attention_vjp", case["q"], case["k"], case["v"], d_out=d_out,
                                  **options)
    got_grads = got_grads[:-1]  # d_score_mod: softcap has no parameters
    expected = (out, lse, *(grads[name] for name in ("q", "k", "v", "sinks") if name in grads))
    for name, error in _ring_errors((*(backend.to_numpy(x) for x in (got_out, got_lse, *got_grads)),), expected):
        assert error <= REORDERED, f"{name}: relative error {error:.3g}"


def _bloom_slopes(H: int) -> np.ndarray:
    """transformers' build_alibi_tensor's slopes, its steps written out in float64: base = 2^(-(2^-(log2 n - 3)))
    for n the greatest power of two <= H, slopes base^1 .. base^n, then for H > n the extra base of 2n to the odd
    powers 1, 3, .., 2 min(n, H - n) - 1."""
    n = 2 ** math.floor(math.log2(H))
    base = 2 ** (-(2 ** -(math.log2(n) - 3)))
    slopes = base ** np.arange(1, 1 + n)
    if n != H:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * n) - 3)))
        slopes = np.concatenate([slopes, extra_base ** np.arange(1, 1 + 2 * min(n, H - n), 2)])
    return slopes


@pytest.mark.parametrize("H", [1, 2, 3, 4, 5, 8, 12, 16])
def test_alibi_slopes_are_blooms(backend: ModuleType, H: int) -> None:
    # H = 8: 2^-1, 2^-2, .., 2^-8; H = 12: those eight, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (the odd terms for 16)
    expected = _bloom_slopes(H)
    got = backend.to_numpy(backend.alibi_slopes(H))
    assert got.shape == (H,)
    assert_close(got, expected, REORDERED if got.dtype == np.float64 else 1e-7, f"alibi_slopes({H})")
    if H == 12:
        np.testing.assert_allclose(got, 2.0 ** -np.array([1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5]), rtol=1e-7)


def test_alibi_slopes_are_transformers_build_alibi_tensor() -> None:
    torch = pytest.importorskip("torch")
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    import attention_np
    for H in (1, 2, 3, 4, 5, 8, 12, 16):
        # the tensor is slope_h * position (B * H, 1, S); position 1 of a mask of ones holds the slopes themselves
        alibi = bloom.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), H, torch.float32)
        assert_close(attention_np.alibi_slopes(H), alibi[:, 0, 1].numpy(), 1e-7, f"H={H}")  # theirs in float32


@pytest.mark.parametrize("H", [0, -1, 2.0, True])
def test_alibi_slopes_of_no_positive_integer_raise(backend: ModuleType, H: object) -> None:
    with pytest.raises(ValueError, match="alibi_slopes needs the number of heads H, a positive integer"):
        backend.alibi_slopes(H)


# MultiHeadAttention(position="alibi") is BLOOM's attention: projections, heads, scores + slope_h * j (BLOOM's
# bias, by key position; with is_causal it differs from -slope_h * |i - j| by -slope_h * i, a shift of each row,
# which the softmax ignores), softmax, merge, output projection
D = 24  # H = 4 heads of d_k = 6; two key/value heads


def _bloom_attention(state: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BLOOM's composition written out in float64: the projections, the heads (B, H, L, d_k), the scores
    q k^T / sqrt(d_k) + slope_h * j, causal, through the float64 oracle, then the merge and w_o."""
    def linear(name: str, y: np.ndarray) -> np.ndarray:
        return y @ state[f"{name}.weight"].T + state[f"{name}.bias"]

    def heads(y: np.ndarray, n: int) -> np.ndarray:  # (B, L, n * d_k) -> (B, n, L, d_k)
        return y.reshape(*y.shape[:-1], n, D // H).swapaxes(-2, -3)

    q, k, v = heads(linear("w_q", x), H), heads(linear("w_k", x), HKV), heads(linear("w_v", x), HKV)
    bias = _bloom_slopes(H)[:, None, None] * np.arange(x.shape[-2])  # (H, 1, S): slope_h * j
    out, weights = oracle.sdpa(q, k, v, bias=bias, is_causal=True, enable_gqa=True)  # (B, H, L, d_k)
    merged = out.swapaxes(-2, -3).reshape(*x.shape[:-1], D)  # (B, L, D)
    return linear("w_o", merged), weights


@pytest.fixture(scope="module")
def alibi_state() -> dict[str, np.ndarray]:
    import attention_np
    rng = np.random.default_rng(7)
    shapes = attention_np.MultiHeadAttention(D, H, 0.0, num_kv_heads=HKV).state_dict()
    return {name: rng.uniform(-0.5, 0.5, np.shape(value)) for name, value in shapes.items()}


def test_mha_with_alibi_is_blooms_composition(backend: ModuleType, alibi_state: dict[str, np.ndarray]) -> None:
    x = np.random.default_rng(8).standard_normal((B, L, D))
    mha = backend.MultiHeadAttention.from_state_dict({name: backend.asarray(v) for name, v in alibi_state.items()},
                                                     num_heads=H, dropout=0.0, position="alibi")
    assert mha.position == "alibi"
    out, weights = mha(backend.asarray(x), backend.asarray(x), backend.asarray(x), is_causal=True)
    expected_out, expected_weights = _bloom_attention(alibi_state, x)
    assert_close(backend.to_numpy(out), expected_out, REORDERED, "out")
    assert_close(backend.to_numpy(weights), expected_weights, REORDERED, "weights")


def test_mha_with_alibi_extends_its_cache_as_its_causal_call(backend: ModuleType,
                                                              alibi_state: dict[str, np.ndarray]) -> None:
    # the cache's queries stand at positions length .. length + L - 1: ALiBi's q_offset is the cache's length
    x = np.random.default_rng(9).standard_normal((B, L, D))
    mha = backend.MultiHeadAttention.from_state_dict({name: backend.asarray(v) for name, v in alibi_state.items()},
                                                     num_heads=H, dropout=0.0, position="alibi")
    cache = mha.init_cache((B,), L, dtype=backend.asarray(x).dtype)
    first, _, cache = mha.extend(backend.asarray(x[:, :2]), backend.asarray(x[:, :2]), cache)
    rest, _, cache = mha.extend(backend.asarray(x[:, 2:]), backend.asarray(x[:, 2:]), cache)
    expected, _ = _bloom_attention(alibi_state, x)
    assert_close(np.concatenate([backend.to_numpy(first), backend.to_numpy(rest)], axis=-2), expected, REORDERED, "out")


def test_mha_position_options_and_their_errors(backend: ModuleType) -> None:
    assert backend.MultiHeadAttention(D, H, 0.0).position is None
    assert backend.MultiHeadAttention(D, H, 0.0, rope_theta=10000.0).position == "rope"
    assert backend.MultiHeadAttention(D, H, 0.0).alibi_slopes is None
    with pytest.raises(ValueError, match="position='rope' needs rope_theta"):
        backend.MultiHeadAttention(D, H, 0.0, position="rope")
    with pytest.raises(ValueError, match="position='alibi' takes no rope_theta"):
        backend.MultiHeadAttention(D, H, 0.0, position="alibi", rope_theta=10000.0)
    with pytest.raises(ValueError, match="position='alibi' needs attention='softmax'"):
        backend.MultiHeadAttention(D, H, 0.0, position="alibi", attention="linear")
    with pytest.raises(ValueError, match="position must be None, 'rope' or 'alibi'"):
        backend.MultiHeadAttention(D, H, 0.0, position="absolute")


def test_mha_vjp_with_alibi_is_central_differences(backend: ModuleType, alibi_state: dict[str, np.ndarray]) -> None:
    # d <BLOOM's composition, d_out> / dx by central differences, x the queries (keys and values held)
    rng = np.random.default_rng(10)
    x, d_out = rng.standard_normal((B, L, D)), rng.standard_normal((B, L, D))
    expected = central_differences(lambda y: _bloom_queries(alibi_state, y, x), x, d_out, 1e-5)
    mha = backend.MultiHeadAttention.from_state_dict({name: backend.asarray(v) for name, v in alibi_state.items()},
                                                     num_heads=H, dropout=0.0, position="alibi")
    _, _, pullback = mha.vjp(backend.asarray(x), backend.asarray(x), backend.asarray(x), is_causal=True)
    dq, *_ = pullback(backend.asarray(d_out))
    assert_close(backend.to_numpy(dq), expected, GRADIENT_RTOL, "dq")


def _bloom_queries(state: dict[str, np.ndarray], x_q: np.ndarray, x_kv: np.ndarray) -> np.ndarray:
    """_bloom_attention's out with the queries from x_q and the keys and values from x_kv."""
    def linear(name: str, y: np.ndarray) -> np.ndarray:
        return y @ state[f"{name}.weight"].T + state[f"{name}.bias"]

    def heads(y: np.ndarray, n: int) -> np.ndarray:  # (B, L, n * d_k) -> (B, n, L, d_k)
        return y.reshape(*y.shape[:-1], n, D // H).swapaxes(-2, -3)

    q, k, v = heads(linear("w_q", x_q), H), heads(linear("w_k", x_kv), HKV), heads(linear("w_v", x_kv), HKV)
    bias = _bloom_slopes(H)[:, None, None] * np.arange(x_kv.shape[-2])  # (H, 1, S): slope_h * j
    out, _ = oracle.sdpa(q, k, v, bias=bias, is_causal=True, enable_gqa=True)  # (B, H, L, d_k)
    return linear("w_o", out.swapaxes(-2, -3).reshape(*x_q.shape[:-1], D))
