"""attention_torch.ring_attention on 2 and 4 CPU processes (gloo on the loopback interface): each rank's out, lse
and gradients of its own q, k, v shards equal the matching rows of single-process flash_attention (and out that
of scaled_dot_product_attention), in float64, for every structure the ring must follow in global positions;
ring_attention_vjp's pullback, in one case, against single-process flash_attention_vjp's rows; shards of
different lengths are refused on every rank. Each test starts its processes once
(conformance.bench.ring_torch.launch) and runs all its cases in them: starting them is most of the time; the two
tests on 2 ranks share one launch, with ALiBi's ring (tests/test_alibi.py's cases, against the float64 oracle)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attention_np.common.records import FlashOptions
from conformance.bench.ring_torch import launch
from tests._compare import REORDERED

pytestmark = pytest.mark.slow

RTOL = REORDERED  # float64: the ring against single-process flash_attention
TILES = {"block_q": 3, "block_k": 2}  # neither divides a shard of 4 or 8 queries and keys
# name: (H, Hkv, L, S, options); E = 4, Ev = 3, B = 2
CASES = {
    "plain": (2, 2, 16, 16, {}),
    "causal": (2, 2, 16, 16, {"is_causal": True}),
    "causal_q_offset": (2, 2, 16, 16, {"is_causal": True, "q_offset": -3}),  # queries 0..2 see no key
    "causal_window": (2, 2, 16, 16, {"is_causal": True, "window": (3, 0)}),
    "window": (2, 2, 16, 16, {"window": (2, 2)}),
    "softcap": (2, 2, 16, 16, {"softcap": 0.7, "scale": 2.0}),
    "enable_gqa": (4, 2, 16, 16, {"enable_gqa": True, "is_causal": True}),
    "cross": (2, 2, 8, 16, {}),  # L != S
    "cross_bottom_right": (2, 2, 8, 16, {"is_causal": True, "q_offset": 8}),
    # query i sees keys i - 3 .. i - 1 of 8: queries 0 and 11..15 see none, while rank 0's other queries see
    # two blocks, so its merge meets rows that are -inf in both parts
    "blind_rows": (2, 2, 16, 8, {"window": (1, 1), "q_offset": -2}),
}
VJP_CASE = "enable_gqa"  # ring_attention_vjp in one case: the zig-zag layout and grouped heads


def _inputs(H: int, Hkv: int, L: int, S: int, seed: int) -> list[np.ndarray]:
    """The whole sequence, the same on every rank: q, k, v, and the cotangents of out and lse."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for shape in ((2, H, L, 4), (2, Hkv, S, 4), (2, Hkv, S, 3), (2, H, L, 3),
                                                     (2, H, L))]


def _loss(out, lse, d_out, d_lse):
    """sum(out * d_out) + sum(lse * d_lse) over the rows that see some key (lse -inf elsewhere)."""
    import torch

    return (out * d_out).sum() + torch.where(lse == -math.inf, 0, lse * d_lse).sum()


def _compare(got, expected, what: str) -> str | None:
    """None when equal to RTOL (-inf in the same places), else what differs."""
    got, expected = got.detach().numpy(), expected.detach().numpy()
    if got.shape != expected.shape or not np.array_equal(np.isneginf(got), np.isneginf(expected)):
        return f"{what}: shape {got.shape} vs {expected.shape} or -inf in other places"
    finite = np.isfinite(expected)
    error = np.linalg.norm(got[finite] - expected[finite]) / max(np.linalg.norm(expected[finite]), 1e-300)
    return None if error <= RTOL else f"{what}: relative error {error:.3g} > {RTOL:.3g}"


def _check_cases(rank: int, world_size: int) -> list[str]:
    """On one rank: every case's out, lse and gradients against the single-process results; what failed."""
    import torch

    import attention_torch

    failures = []
    for seed, (name, (H, Hkv, L, S, options)) in enumerate(CASES.items()):
        whole = [torch.from_numpy(x) for x in _inputs(H, Hkv, L, S, seed)]
        q, k, v = (x.requires_grad_() for x in whole[:3])
        out, lse = attention_torch.flash_attention(q, k, v, **options, **TILES)
        grads = torch.autograd.grad(_loss(out, lse, *whole[3:]), (q, k, v))
        expected_sdpa, _ = attention_torch.scaled_dot_product_attention(q, k, v, need_weights=False, **options)
        rows, keys = slice(rank * L // world_size, (rank + 1) * L // world_size), slice(
            rank * S // world_size, (rank + 1) * S // world_size)
        shards = [x.detach()[..., part, :].clone().requires_grad_() for x, part in zip((q, k, v), (rows, keys, keys),
                                                                                        strict=True)]
        got_out, got_lse = attention_torch.ring_attention(*shards, **options, **TILES)
        got_grads = torch.autograd.grad(_loss(got_out, got_lse, whole[3][..., rows, :], whole[4][..., rows]), shards)
        checks = [(got_out, out[..., rows, :], "out"), (got_lse, lse[..., rows], "lse"),
                  (got_out, expected_sdpa[..., rows, :], "out against scaled_dot_product_attention")]
        checks += [(g, e[..., part, :], f"d{x}") for g, e, part, x in zip(got_grads, grads, (rows, keys, keys), "qkv",
                                                                           strict=True)]
        failures += [f"rank {rank} of {world_size}, {name}: {problem}" for got, expected, what in checks
                     if (problem := _compare(got, expected, what))]
    return failures + _check_vjp(rank, world_size, VJP_CASE)


def _check_vjp(rank: int, world_size: int, name: str) -> list[str]:
    """On one rank: ring_attention_vjp, called under torch.no_grad() (it records all the same), and its pullback
    against the rank's rows of single-process flash_attention_vjp; what failed."""
    import torch

    import attention_torch

    H, Hkv, L, S, options = CASES[name]
    q, k, v, d_out, _ = (torch.from_numpy(x) for x in _inputs(H, Hkv, L, S, seed=len(CASES)))
    out, lse, pullback = attention_torch.flash_attention_vjp(q, k, v, **options, **TILES)
    grads = pullback(d_out)[:3]
    rows, keys = (slice(rank * n // world_size, (rank + 1) * n // world_size) for n in (L, S))
    with torch.no_grad():
        got_out, got_lse, got_pullback = attention_torch.ring_attention_vjp(
            q[..., rows, :], k[..., keys, :], v[..., keys, :], **options, **TILES)
        got_grads = got_pullback(d_out[..., rows, :].contiguous())
    checks = [(got_out, out[..., rows, :], "out"), (got_lse, lse[..., rows], "lse")]
    checks += [(g, e[..., part, :], f"d{x}") for g, e, part, x in zip(got_grads, grads, (rows, keys, keys), "qkv",
                                                                       strict=True)]
    return [f"rank {rank} of {world_size}, ring_attention_vjp {name}: {problem}" for got, expected, what in checks
            if (problem := _compare(got, expected, what))]


def _uneven_shards(rank: int, world_size: int) -> str:
    """Rank 0 holds 5 queries, keys and values, the others 4 (a sequence of 5 + 4 (P - 1) positions): the
    message every rank raises."""
    import torch

    import attention_torch

    x = torch.zeros(2, 2, 5 if rank == 0 else 4, 4)
    try:
        attention_torch.ring_attention(x, x, x)
    except ValueError as error:
        return str(error)
    return "no error"


def _check_cases_then_uneven_shards(rank: int, world_size: int) -> dict[str, list[str] | str]:
    """On one rank: what _check_cases and ALiBi's cases (tests/test_alibi.py) found failing, then the message of
    _uneven_shards; last, as it raises."""
    from tests.test_alibi import _torch_ring_with_alibi

    return {"failures": _check_cases(rank, world_size), "alibi": _torch_ring_with_alibi(rank, world_size),
            "uneven": _uneven_shards(rank, world_size)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, list[str] | str]]:
    """One launch of 2 processes for the two tests that need 2 ranks: starting them (torch imported in each) was
    most of each test's time."""
    return launch(2, _check_cases_then_uneven_shards)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_gets_its_rows_of_single_process_attention(world_size: int, request: pytest.FixtureRequest):
    by_rank = ([result["failures"] for result in request.getfixturevalue("two_ranks")] if world_size == 2
               else launch(world_size, _check_cases))
    failures = [failure for rank_failures in by_rank for failure in rank_failures]
    assert not failures, "\n".join(failures)


def test_ring_with_alibi_is_the_oracles_on_two_ranks(two_ranks: list[dict[str, list[str] | str]]):
    # each rank's rows of the oracle's out and lse, and of the oracle's gradients with ALiBi as a bias
    # (tests/test_alibi.py's DISTRIBUTED_CASES: bottom-right and negative q_offset, causal and not, sinks)
    failures = [failure for result in two_ranks for failure in result["alibi"]]
    assert not failures, "\n".join(failures)


def test_shards_of_different_lengths_raise_on_every_rank(two_ranks: list[dict[str, list[str] | str]]):
    messages = [result["uneven"] for result in two_ranks]
    assert len(messages) == 2
    for message in messages:
        assert "P = 2" in message and "L = 9" in message, message  # the whole length the shards add up to
        assert "rank 0: q (2, 2, 5, 4)" in message and "rank 1: q (2, 2, 4, 4)" in message, message


@pytest.mark.parametrize("world_size", [2, 4])
def test_causal_zig_zag_gives_every_rank_the_same_work(world_size: int):
    """With is_causal every rank computes as many chunk pairs and (query, key) pairs (_schedule, what the ring
    runs); the contiguous layout would give rank r r + 1 blocks. Chunks of c = 4: a pair at offset o (query
    chunk start - key chunk start) holds the pairs i - j + o >= 0 of a 4 x 4 square."""
    from attention_torch import distributed

    c = 4
    options = FlashOptions(is_causal=True, scale=None, q_offset=0, window=None, key_lengths=None, softcap=None,
                           enable_gqa=False, block_q=None, block_k=None)
    layout = distributed._layout(world_size, 2 * c, 2 * c, True)
    i, j = np.arange(c)[:, None], np.arange(c)[None, :]
    calls, pairs = [], []
    for rank in range(world_size):
        scheduled = [step for steps in distributed._schedule(layout, rank, options) for _, _, step in steps]
        calls.append(len(scheduled))
        pairs.append(sum(int((i - j + step.q_offset >= 0).sum()) for step in scheduled))
    assert len(set(calls)) == 1 and len(set(pairs)) == 1, (calls, pairs)
    assert pairs[0] * world_size == (2 * c * world_size) * (2 * c * world_size + 1) // 2  # all L (L + 1) / 2


def test_ring_bench_rows_hold_the_memory_check_and_the_bytes_per_step():
    """`python -m conformance.bench.ring_torch` at a tiny size: P = 2, is_causal (the layout's moves left out of
    the bytes per step). A shard is 16 rows x E = 4 x 4 bytes = 256 bytes: a forward step sends k and v, 512;
    the backward's two steps send k, v once and dk, dv twice, 6 shards, 3 a step."""
    from conformance.bench import ring_torch

    (row,) = ring_torch.measure((2,), length=32, width=4, block=4, causal=(True,))
    assert (row.processes, row.is_causal, row.shard_mib * ring_torch.MIB) == (2, True, 256)
    assert (row.bytes_per_step, row.model_bytes, row.backward_bytes_per_step) == (512, 512, 768)
    assert row.peak_mib >= row.least_peak_mib >= 0
    header, line = ring_torch.format_rows([row], length=32, width=4).splitlines()[1:3]
    assert "x P" in header and "/ shard (L/P) E 4" in header, header
    assert line.split()[:2] == ["2", "True"] and line.split()[-3:] == ["512", "512", "768"], line


def test_ring_overlap_rows_are_finite_for_every_rank():
    """`python -m conformance.bench.ring_torch --overlap` at a tiny size, P = 2, one repeat: a row per rank with
    every time and fraction finite (no value asserted: they are timings) and the table printing them."""
    from conformance.bench import ring_torch

    rows = ring_torch.measure_overlap((2,), length=32, width=4, block=4, repeats=1)
    assert [(row.processes, row.rank) for row in rows] == [(2, 0), (2, 1)]
    for row in rows:
        assert all(math.isfinite(value) for value in row), row
        assert min(row.total_ms, row.compute_ms, row.comm_ms, row.wait_ms, row.check_ms) >= 0, row
    header = ring_torch.format_overlap(rows, length=32, width=4, block=4, repeats=1).splitlines()[1]
    assert "hidden (c + m - t) / m" in header and "t_comm / t_total" in header, header
