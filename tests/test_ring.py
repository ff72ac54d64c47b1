"""Ring attention's schedule (SPEC 2d), in NumPy on simulated devices: every layout and keyword against
flash_attention on one device, the backward ring's gradients against flash_attention_vjp's; the zig-zag
layout's balance of causal work; the clear error for a length the devices do not divide. The JAX and torch
rings on real (simulated) devices: tests/test_ring_jax.py and tests/test_ring_torch.py."""

from __future__ import annotations

import numpy as np
import pytest

from attention_np.common import validation
from tests._compare import REORDERED, assert_close
from tests.conftest import import_backend

M = import_backend("attention_np")


def _qkv(L: int = 16, S: int = 16, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, 4, L, 4)), rng.standard_normal((2, 2, S, 4)), rng.standard_normal((2, 2, S, 3))]


OPTIONS = {"full": {}, "causal": {"is_causal": True}, "causal_offset": {"is_causal": True, "q_offset": 3},
           "sliding": {"is_causal": True, "window": (3, 0)}, "window": {"window": (2, 2)}, "softcap": {"softcap": 0.7}}


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_ring_equals_flash_attention_on_one_device(devices, options):
    q, k, v = _qkv()
    if options.get("is_causal") and 16 % (2 * devices):
        pytest.skip("the zig-zag layout needs 2P chunks")
    out, lse = M.ring_attention(q, k, v, devices=devices, enable_gqa=True, block_q=3, block_k=2, **options)
    expected, expected_lse = M.flash_attention(q, k, v, enable_gqa=True, **options)
    assert_close(out, expected, REORDERED, f"{options} P={devices}")
    assert_close(np.where(np.isinf(expected_lse), 0, lse), np.where(np.isinf(expected_lse), 0, expected_lse), REORDERED,
                 "lse")
    assert np.array_equal(np.isneginf(lse), np.isneginf(expected_lse))


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_backward_ring_gradients_equal_flash_attention_vjp(options):
    q, k, v = _qkv()
    d_out = np.random.default_rng(1).standard_normal((2, 4, 16, 3))
    expected_out, _, flash_pullback = M.flash_attention_vjp(q, k, v, enable_gqa=True, **options)
    expected = flash_pullback(d_out)[:3]
    for devices in (1, 2, 4):  # with is_causal, 16 rows in 2P chunks of 8, 4 and 2
        out, _, pullback = M.ring_attention_vjp(q, k, v, devices=devices, enable_gqa=True, block_q=3, block_k=2,
                                                **options)
        assert_close(out, expected_out, REORDERED, f"out {options} P={devices}")
        for name, got, want, x in zip(("dq", "dk", "dv"), pullback(d_out), expected, (q, k, v), strict=True):
            assert got.shape == x.shape and got.dtype == x.dtype, f"{name}: {got.shape} {got.dtype}"
            assert_close(got, want, REORDERED, f"{name} {options} P={devices}")


def test_backward_ring_gives_queries_that_see_no_key_zero_gradients():
    # is_causal with q_offset -5: query i sees keys j <= i - 5, so queries 0..4 see none (on devices 0, 1
    # and 2 of the zig-zag layout: chunks of 2 rows); out 0, lse -inf, dq 0 there, and their d_out reaches no
    # key: the gradients are flash_attention_vjp's with those rows of d_out zeroed
    q, k, v = _qkv()
    d_out = np.random.default_rng(1).standard_normal((2, 4, 16, 3))
    out, lse, pullback = M.ring_attention_vjp(q, k, v, devices=4, is_causal=True, q_offset=-5, enable_gqa=True,
                                              block_q=3, block_k=2)
    grads = pullback(d_out)
    assert np.all(out[..., :5, :] == 0) and np.all(lse[..., :5] == -np.inf) and np.all(grads[0][..., :5, :] == 0)
    d_out[..., :5, :] = 0
    expected = M.flash_attention_vjp(q, k, v, is_causal=True, q_offset=-5, enable_gqa=True)[2](d_out)[:3]
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        assert_close(got, want, REORDERED, name)


def test_cross_attention_with_other_lengths():
    q, k, v = _qkv(L=8, S=12)
    out, _ = M.ring_attention(q, k, v, devices=4, enable_gqa=True)
    assert_close(out, M.flash_attention(q, k, v, enable_gqa=True)[0], REORDERED, "L != S")


def test_zig_zag_gives_every_device_the_same_causal_work():
    # causal work of a device: the (query, key) pairs it computes that causality keeps, over all its ring steps
    P, L = 4, 64

    def work(chunks: list[tuple[int, int]]) -> int:  # query i sees keys 0..i: i + 1 pairs
        return sum(stop * (stop + 1) // 2 - start * (start + 1) // 2 for start, stop in chunks)

    zig_zag = [work(chunks) for chunks in validation.ring_chunks(P, L, L, is_causal=True)["q"]]
    contiguous = [work(chunks) for chunks in validation.ring_chunks(P, L, L, is_causal=False)["q"]]
    assert len(set(zig_zag)) == 1 and sum(zig_zag) == L * (L + 1) // 2
    assert contiguous == [136, 392, 648, 904]  # 16 queries each: 1 + .. + 16 pairs on device 0, 49 + .. + 64 on 3


def test_lengths_the_devices_do_not_divide_are_a_clear_error():
    q, k, v = _qkv(L=12)
    with pytest.raises(ValueError, match=r"L = 12 is not a multiple of 8 \(P = 4 devices; the zig-zag"):
        M.ring_attention(q, k, v, devices=4, is_causal=True, enable_gqa=True)
    with pytest.raises(ValueError, match=r"S = 16 is not a multiple of 3"):
        M.ring_attention(*_qkv(L=12), devices=3, enable_gqa=True)
    with pytest.raises(ValueError, match="devices must be a positive integer"):
        M.ring_attention(q, k, v, devices=0)
