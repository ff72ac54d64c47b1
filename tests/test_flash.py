"""SPEC 2c on every backend: flash_attention against a hand-derived case, torch's F.scaled_dot_product_attention,
jax.nn.dot_product_attention and the backend's own scaled_dot_product_attention, over tiles that do and do not
divide L and S; the log-sum-exp and the merge of partial results it allows; the vjp against the backend's
untiled vjp; jit, grad and vmap in JAX (lax loops, one trace); autograd and gradcheck in torch; the memory
that stays bounded where the scores would not."""

from __future__ import annotations

import math
import tracemalloc
from types import ModuleType

import numpy as np
import pytest

from attention_np.common import validation
from tests._compare import REORDERED, assert_close, converted, one_program
from tests.conftest import import_backend

RTOL = REORDERED  # float64 on every backend: the same math computed another way
TILES = ((1, 1), (2, 3), (4, 7), (128, 128))  # (block_q, block_k): ones, non-divisors, one tile


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def flash(M: ModuleType, q, k, v, mask=None, **options) -> tuple[np.ndarray, np.ndarray]:
    """M's flash_attention on NumPy inputs, array options converted; (out, lse) as NumPy arrays."""
    options = {name: converted(M, value) for name, value in options.items()}
    out, lse = M.flash_attention(*(M.asarray(x) for x in (q, k, v)), converted(M, mask), **options)
    return M.to_numpy(out), M.to_numpy(lse)


def test_two_keys_by_hand(backend):
    # one query, scores 0 and log 3 (q = 1, k = (0, log 3), scale 1): weights (1/4, 3/4), lse = log(1 + 3)
    q, k, v = np.ones((1, 1)), np.array([[0.0], [math.log(3)]]), np.array([[4.0], [8.0]])
    for block_k in (1, 2):  # the second key in its own tile: the running maximum grows, the sum is rescaled
        out, lse = flash(backend, q, k, v, scale=1.0, block_k=block_k)
        np.testing.assert_allclose(out, [[4 / 4 + 8 * 3 / 4]], rtol=1e-14)
        np.testing.assert_allclose(lse, [math.log(4)], rtol=1e-14)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("options", [
    {}, {"is_causal": True}, {"is_causal": True, "q_offset": 4}, {"window": (2, 1), "q_offset": -1},
    {"key_lengths": np.array([9, 0, 4])[:, None]}, {"softcap": 0.7, "scale": 2.0},
    {"is_causal": True, "q_offset": np.array([0, 3, -2])[:, None], "window": (1, None)},
], ids=["plain", "causal", "bottom_right", "window", "key_lengths", "softcap", "offset_per_sequence"])
def test_equals_its_own_attention(backend, tiles, options):
    q, k, v = _random(3, 2, 7, 4), _random(3, 2, 9, 4, seed=1), _random(3, 2, 9, 5, seed=2)
    mask = _random(2, 7, 9, seed=3) > -1  # hides about one key in six
    bias = np.where(_random(7, 9, seed=4) > 1.5, -np.inf, _random(7, 9, seed=5))
    for extra in ({}, {"mask": mask, "bias": bias}):
        kw = {**options, **({"bias": extra["bias"]} if extra else {})}
        expected, _ = one_program(backend, "scaled_dot_product_attention", q, k, v, extra.get("mask"),
                                   need_weights=False, **kw)
        out, lse = flash(backend, q, k, v, extra.get("mask"), block_q=tiles[0], block_k=tiles[1], **kw)
        assert_close(out, backend.to_numpy(expected), RTOL, f"{options} {tiles} {sorted(extra)}")
        assert lse.shape == out.shape[:-1] and lse.dtype == np.float64


def test_grouped_heads_without_copies(backend):
    q, k, v = _random(2, 4, 5, 3), _random(2, 2, 6, 3, seed=1), _random(2, 2, 6, 2, seed=2)
    expected, _ = one_program(backend, "scaled_dot_product_attention", q, k, v, is_causal=True, enable_gqa=True,
                               need_weights=False)
    out, lse = flash(backend, q, k, v, is_causal=True, enable_gqa=True, block_q=2, block_k=4)
    assert_close(out, backend.to_numpy(expected), RTOL, "enable_gqa")
    assert lse.shape == (2, 4, 5)


def test_against_torch_sdpa_and_logsumexp(backend):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    q, k, v = _random(2, 3, 33, 8), _random(2, 3, 33, 8, seed=1), _random(2, 3, 33, 4, seed=2)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    for is_causal in (False, True):  # L = S: torch's causal rule is ours
        out, lse = flash(backend, q, k, v, is_causal=is_causal, block_q=5, block_k=7)
        assert_close(out, F.scaled_dot_product_attention(tq, tk, tv, is_causal=is_causal).numpy(), RTOL, "out")
        scores = tq @ tk.transpose(-1, -2) / math.sqrt(8)
        if is_causal:
            scores = scores.masked_fill(~torch.ones(33, 33, dtype=torch.bool).tril(), -math.inf)
        assert_close(lse, torch.logsumexp(scores, dim=-1).numpy(), RTOL, "lse")


def test_against_jax_dot_product_attention(backend):
    jax = pytest.importorskip("jax")
    q, k, v = (_random(2, 17, 3, 8, seed=seed).astype(np.float32) for seed in range(3))  # (B, L, N, H), float32
    expected = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True))
    heads = [np.swapaxes(x, 1, 2) for x in (q, k, v)]  # (B, N, L, H): ours
    out, _ = flash(backend, *heads, is_causal=True, block_q=4, block_k=6)
    assert_close(np.swapaxes(out, 1, 2), expected, 1e-5, "jax.nn.dot_product_attention, float32")


def test_lse_merges_partial_results(backend):
    # attention over keys A and B apart, merged by their lse, is attention over both (what ring attention does)
    q, k, v = _random(2, 6, 4), _random(2, 10, 4, seed=1), _random(2, 10, 3, seed=2)
    whole, lse = flash(backend, q, k, v, block_q=4, block_k=3)
    (out_a, lse_a), (out_b, lse_b) = (flash(backend, q, k[:, part], v[:, part], block_q=4, block_k=3)
                                      for part in (slice(0, 4), slice(4, 10)))
    merged_lse = np.logaddexp(lse_a, lse_b)
    merged = np.exp(lse_a - merged_lse)[..., None] * out_a + np.exp(lse_b - merged_lse)[..., None] * out_b
    assert_close(merged_lse, lse, RTOL, "lse")
    assert_close(merged, whole, RTOL, "out")


def test_fully_masked_rows_zeros_and_minus_inf(backend):
    q, k, v = _random(2, 5, 3), _random(2, 6, 3, seed=1), _random(2, 6, 2, seed=2)
    mask = np.ones((2, 5, 6), bool)
    mask[0, 1], mask[1, 4] = False, False
    for block_q, block_k in TILES:
        out, lse = flash(backend, q, k, v, mask, block_q=block_q, block_k=block_k)
        assert np.all(out[0, 1] == 0) and np.all(out[1, 4] == 0)
        assert lse[0, 1] == -np.inf and lse[1, 4] == -np.inf and np.all(np.isfinite(np.delete(lse[0], 1)))


@pytest.mark.parametrize("tiles", [(2, 3), (4, 4)])
def test_vjp_equals_the_untiled_vjp(backend, tiles):
    q, k, v = _random(2, 2, 6, 3), _random(2, 1, 7, 3, seed=1), _random(2, 1, 7, 4, seed=2)  # k, v broadcast
    bias = np.where(_random(6, 7, seed=3) > 1.2, -np.inf, _random(6, 7, seed=4))
    mask = np.ones((6, 7), bool)
    mask[2] = False  # query 2 sees no key
    d_out = _random(2, 2, 6, 4, seed=5)
    options = {"is_causal": True, "q_offset": 1, "softcap": 1.5, "bias": bias}
    *_, untiled = one_program(backend, "scaled_dot_product_attention_vjp", q, k, v, mask, d_out=d_out, **options)
    *_, tiled = one_program(backend, "flash_attention_vjp", q, k, v, mask, d_out=d_out, block_q=tiles[0],
                             block_k=tiles[1], **options)
    for name, got, expected in zip(("dq", "dk", "dv", "dbias"), tiled, untiled, strict=True):
        got, expected = backend.to_numpy(got), backend.to_numpy(expected)
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        assert_close(got, expected, RTOL, name)
    assert np.all(backend.to_numpy(tiled[0])[:, :, 2] == 0)  # the blind query: exact zeros


def test_numpy_threads_sum_a_broadcast_bias_gradient(monkeypatch):
    # the tile workers at any size: they share dbias where their key tiles write apart, and each sums its own
    # where the bias broadcasts along S, all of them writing its one column
    M = import_backend("attention_np")
    monkeypatch.setattr(M.flash, "PARALLEL_WORK", 0)
    q, k, v = _random(2, 4, 9, 3), _random(2, 2, 11, 3, seed=1), _random(2, 2, 11, 2, seed=2)
    d_out = _random(2, 4, 9, 2, seed=3)
    for shape in ((11,), (4, 1, 11), (9, 1), (2, 1, 1, 1)):
        options = {"bias": _random(*shape, seed=4), "is_causal": True, "enable_gqa": True}
        _, _, untiled = M.scaled_dot_product_attention_vjp(q, k, v, **options)
        _, _, tiled = M.flash_attention_vjp(q, k, v, block_q=2, block_k=3, **options)
        *grads, dbias = tiled(d_out)
        *expected, expected_dbias = untiled(d_out)
        for name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
            assert_close(got, want, RTOL, f"{name}, bias {shape}")
        assert dbias.shape == shape
        if shape[-1] != 1:
            assert_close(dbias, expected_dbias, RTOL, f"dbias, bias {shape}")
        else:  # constant along S: the softmax ignores it, and sum_j dS_ij = sum_j P_ij (dP_ij - D_i) = D_i - D_i = 0
            assert np.max(np.abs(dbias)) < 1e-14, f"dbias, bias {shape}"


def test_block_sizes_are_checked(backend):
    q = backend.asarray(_random(3, 2))
    for name, value in (("block_q", 0), ("block_k", -2), ("block_q", 1.5), ("block_k", True)):
        with pytest.raises(ValueError, match=name):
            backend.flash_attention(q, q, q, **{name: value})


def test_default_tiles_from_the_shapes(backend):
    # block_k = 2 block_q, the largest power of two with batch * block_q * block_k <= 2^20 scores:
    # batch 8: 8 * 256 * 512 = 2^20; batch 1: 512 * 1024 = 2^19 (1024 * 2048 = 2^21 is over); batch 32: 128 * 256
    assert backend.flash.TILE_SCORES == 1 << 20
    assert validation.default_tiles(None, None, (1, 8), 4096, 4096, 1 << 20) == (256, 512)
    assert validation.default_tiles(None, None, (1,), 32768, 32768, 1 << 20) == (512, 1024)
    assert validation.default_tiles(None, None, (4, 8), 1024, 1024, 1 << 20) == (128, 256)
    assert validation.default_tiles(None, None, (2**16,), 9, 7, 1 << 20) == (9, 7)  # at least 16, at most the sequence
    assert validation.default_tiles(3, None, (1, 8), 4096, 4096, 1 << 20) == (3, 512)  # an explicit tile kept
    q, k, v = _random(2, 300, 4), _random(2, 700, 4, seed=1), _random(2, 700, 3, seed=2)
    expected, _ = flash(backend, q, k, v, is_causal=True, block_q=300, block_k=700)  # one tile; the default 256 x 512
    assert_close(flash(backend, q, k, v, is_causal=True)[0], expected, RTOL, "default tiles")


def test_numpy_memory_grows_as_the_length():
    """tracemalloc's peak at L = S = 4096, H = 1, E = 64, float32: a few MiB of tiles and running sums beyond the
    inputs and results, where the scores alone would be 64 MiB, for the forward and for the backward pass, causal
    or not (the benchmark measures L = 32768: python -m conformance compare --variant long). A padding bias of
    shape (S,) keeps the backward's peak at the no-bias one plus its gradient, which has the bias's shape: the
    tiles' dS are summed down to it as they are made, never held at (..., L, S) (64 MiB here)."""
    M = import_backend("attention_np")
    q, k, v = (_random(1, 4096, 64, seed=seed).astype(np.float32) for seed in range(3))
    d_out = _random(1, 4096, 64, seed=4).astype(np.float32)
    padding = np.where(np.arange(4096) < 4000, 0.0, -np.inf).astype(np.float32)  # (S,): the last 96 keys hidden

    def peaks(**options) -> tuple[int, int, tuple]:
        tracemalloc.start()
        try:
            _, _, pullback = M.flash_attention_vjp(q, k, v, block_q=256, block_k=512, **options)
            forward = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            grads = pullback(d_out)
            return forward, tracemalloc.get_traced_memory()[1], grads
        finally:
            tracemalloc.stop()

    unbiased = {}
    for is_causal in (False, True):
        forward, unbiased[is_causal], grads = peaks(is_causal=is_causal)
        results = 2 * q.nbytes + sum(g.nbytes for g in grads[:3])  # out and lse, and the gradients with their
        # float32 copy of d_out; the rest is temporaries
        assert forward < results + 8 * 2**20, f"forward peak {forward / 2**20:.1f} MiB"
        assert unbiased[is_causal] < results + 8 * 2**20, f"backward peak {unbiased[is_causal] / 2**20:.1f} MiB"
    _, biased, grads = peaks(bias=padding)
    assert grads[3].shape == padding.shape
    assert biased < unbiased[False] + padding.nbytes + 2**20, (  # a MiB for the bias's tiles and their visibility
        f"backward peak {biased / 2**20:.1f} MiB with a bias of shape (S,), {unbiased[False] / 2**20:.1f} MiB without")


def test_jax_under_jit_grad_and_vmap_with_lax_loops():
    M = import_backend("attention_jax")
    import jax
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(_random(2, 3, 9, 4, seed=seed)) for seed in range(3))

    def loss(q, k, v, q_offset):
        out, lse = M.flash_attention(q, k, v, is_causal=True, q_offset=q_offset, block_q=2, block_k=3)
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.jit(jax.grad(lambda q, k, v, o: jnp.sum(
        M.flash_attention(q, k, v, is_causal=True, q_offset=o, block_q=2, block_k=3)[0] ** 2), (0, 1, 2)))(
        q, k, v, jnp.asarray([2, -1])[:, None])
    reference = jax.jit(jax.grad(lambda q, k, v: jnp.sum(M.scaled_dot_product_attention(  # one program: eagerly,
        q, k, v, is_causal=True, q_offset=jnp.asarray([2, -1])[:, None], need_weights=False)[0] ** 2),  # each
        (0, 1, 2)))(q, k, v)  # primitive of the untiled grad compiled apart
    for got, expected in zip(grads, reference, strict=True):
        assert_close(np.asarray(got), np.asarray(expected), RTOL, "jit(grad)")
    batched = jax.vmap(lambda q, k, v: M.flash_attention(q, k, v, block_q=4, block_k=2)[0])(q[0], k[0], v[0])
    assert_close(np.asarray(batched), np.asarray(M.flash_attention(q[0], k[0], v[0])[0]), RTOL, "vmap")
    # lax loops: the traced program has the same size whatever the number of tiles
    sizes = [len(jax.make_jaxpr(lambda q: loss(q, q, q, 0))(jnp.zeros((L, 4))).jaxpr.eqns) for L in (8, 64)]
    assert sizes[0] == sizes[1], sizes


def test_torch_autograd_gradcheck_and_the_vjp_agree():
    M = import_backend("attention_torch")
    import torch

    q, k, v = (torch.tensor(_random(2, 5, 3, seed=seed), requires_grad=True) for seed in range(3))
    bias = torch.tensor(_random(5, 5, seed=3), requires_grad=True)

    def out(q, k, v, bias):
        return M.flash_attention(q, k, v, bias=bias, is_causal=True, block_q=2, block_k=3)[0]

    assert torch.autograd.gradcheck(out, (q, k, v, bias))
    d_out = torch.tensor(_random(2, 5, 3, seed=4))
    autograd = torch.autograd.grad(out(q, k, v, bias), (q, k, v, bias), d_out)
    _, _, pullback = M.flash_attention_vjp(q.detach(), k.detach(), v.detach(), bias=bias.detach(), is_causal=True,
                                           block_q=2, block_k=3)
    for got, expected in zip(pullback(d_out), autograd, strict=True):
        assert_close(got.numpy(), expected.numpy(), RTOL, "vjp")
