"""SPEC 2g on every backend in float64: varlen_attention equals a loop over the packed sequences of the
library's scaled dot-product attention (NumPy's, q_offset = S_n - L_n: bottom-right) and of the float64 oracle
within 1e-12, tiled and untiled, with every keyword, empty sequences and positions past the last boundary; its
vjp, jax.grad and torch's autograd against the per-sequence vjp; xformers' BlockDiagonal* masks and torch's
nested (jagged) tensors as independent references; JAX under jit with traced boundaries (one program for every
partition); int32 boundaries; segment ids; the tiles skipped across sequences; every error row of SPEC 7.

One shape for every test where it can be (Tq = 10, Tk = 13, H = 2, E = 3, Ev = 2): JAX compiles per shape.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import warnings
from types import ModuleType
from typing import NamedTuple

import numpy as np
import pytest

from attention_np.common import mods
from attention_np.common.block_mask import EMPTY
from conformance.contract import oracle
from tests._compare import REORDERED, assert_close

RTOL = REORDERED  # float64: the same math computed another way (1e-12)
TQ, TK, H, HKV, E, EV = 10, 13, 2, 1, 3, 2


class Partition(NamedTuple):
    """Packed sequences by their lengths along Tq and Tk (sequence n: lengths_q[n] queries, lengths_k[n] keys)."""

    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        return np.cumsum((0, *self.lengths_q))  # (N + 1,) int64

    @property
    def cu_seqlens_k(self) -> np.ndarray:
        return np.cumsum((0, *self.lengths_k))

    def sequences(self) -> list[tuple[slice, slice]]:
        """Each sequence's queries and keys, as slices of the packed axes."""
        q, k = self.cu_seqlens_q, self.cu_seqlens_k
        return [(slice(q[n], q[n + 1]), slice(k[n], k[n + 1])) for n in range(len(self.lengths_q))]


# 6 sequences: more queries than keys (3 against 2: causal leaves the first query without keys), keys only, queries
# only, fewer queries than keys, both empty, as many; 8 of 10 queries and 11 of 13 keys: two of each past the end
PACKED = Partition(lengths_q=(3, 0, 2, 1, 0, 2), lengths_k=(2, 3, 0, 4, 0, 2))
# every position in a sequence and keys >= queries in each (xformers' bottom-right masks require both), one with
# no queries
COVERED = Partition(lengths_q=(2, 0, 4, 1, 3), lengths_k=(3, 2, 4, 1, 3))
# block_size 2 divides every sequence: the tiles of one sequence are its own (2 queries and 3 keys past the end)
EVEN = Partition(lengths_q=(2, 4, 0, 2), lengths_k=(4, 2, 2, 2))


class Case(NamedTuple):
    """varlen_attention's keywords (block_size apart)."""

    is_causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    scale: float | None = None
    enable_gqa: bool = False


CASES = {
    "plain": Case(),
    "causal": Case(is_causal=True),
    "causal_window_left": Case(is_causal=True, window=(1, None)),  # a side None: unbounded
    "window_right": Case(window=(None, 1)),
    "softcap_scale_grouped": Case(window=(2, 0), softcap=0.8, scale=0.6, enable_gqa=True),
}
BLOCK_SIZES = (None, 3)  # untiled, and tiles that divide neither Tq nor Tk
GRADIENT_CASES = ("causal_window_left", "softcap_scale_grouped")


def _inputs(case: Case, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q (Tq, H, E), k (Tk, Hkv, E), v (Tk, Hkv, Ev) and d_out (Tq, H, Ev); Hkv = 1 with enable_gqa."""
    rng = np.random.default_rng(seed)
    kv_heads = HKV if case.enable_gqa else H
    return (rng.standard_normal((TQ, H, E)), rng.standard_normal((TK, kv_heads, E)),
            rng.standard_normal((TK, kv_heads, EV)), rng.standard_normal((TQ, H, EV)))


def _batched(x: np.ndarray) -> np.ndarray:
    """(T, H, E) -> (1, H, T, E)."""
    return np.swapaxes(x, 0, 1)[None]


def _packed(x: np.ndarray) -> np.ndarray:
    """(1, H, T, E) -> (T, H, E)."""
    return np.swapaxes(x[0], 0, 1)


def _per_sequence(attention, partition: Partition, q, k, v, case: Case) -> np.ndarray:
    """out (Tq, H, Ev): attention(q_n, k_n, v_n, q_offset=S_n - L_n, **case) of each sequence on its own, (1, H,
    L_n, E); zeros for the queries past the last boundary."""
    out = np.zeros((q.shape[0], H, v.shape[-1]))
    for rows, columns in partition.sequences():
        L_n, S_n = rows.stop - rows.start, columns.stop - columns.start
        out_n, _ = attention(_batched(q[rows]), _batched(k[columns]), _batched(v[columns]), q_offset=S_n - L_n,
                             **case._asdict())
        out[rows] = _packed(out_n)
    return out


def _per_sequence_vjp(partition: Partition, q, k, v, d_out, case: Case) -> tuple[np.ndarray, ...]:
    """dq, dk, dv of NumPy's scaled_dot_product_attention_vjp, sequence by sequence; zeros past the boundaries."""
    import attention_np

    grads = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for rows, columns in partition.sequences():
        L_n, S_n = rows.stop - rows.start, columns.stop - columns.start
        _, _, pullback = attention_np.scaled_dot_product_attention_vjp(
            _batched(q[rows]), _batched(k[columns]), _batched(v[columns]), q_offset=S_n - L_n, **case._asdict())
        for grad, part, where in zip(grads, pullback(_batched(d_out[rows]))[:3], (rows, columns, columns),
                                     strict=True):
            grad[where] = _packed(part)
    return grads


@functools.cache
def _references(name: str, partition: Partition = PACKED) -> tuple[np.ndarray, np.ndarray]:
    """The per-sequence loops of case `name`: NumPy's scaled_dot_product_attention and the float64 oracle."""
    import attention_np

    case, (q, k, v, _) = CASES[name], _inputs(CASES[name])
    return (_per_sequence(attention_np.scaled_dot_product_attention, partition, q, k, v, case),
            _per_sequence(oracle.sdpa, partition, q, k, v, case))


def _bounds(partition: Partition) -> dict[str, object]:
    return {"max_seqlen_q": max(partition.lengths_q), "max_seqlen_k": max(partition.lengths_k)}


def _varlen(M: ModuleType, partition: Partition, case: Case, block_size: int | None, q, k, v,
            d_out=None) -> tuple[np.ndarray, ...]:
    """M's varlen_attention (d_out None) or its vjp's out, dq, dk, dv at d_out, on NumPy inputs, as NumPy arrays.
    JAX's runs under one jax.jit per keywords: the untiled path's boundaries traced (one program for every
    partition of Tq and Tk), the tiled path's concrete (it reads them)."""
    arrays = [M.asarray(x) for x in (q, k, v, partition.cu_seqlens_q, partition.cu_seqlens_k)]
    if M.__name__ == "attention_jax":
        traced = block_size is None
        results = _jax_program(case, block_size, None if traced else partition)(
            *arrays, d_out=None if d_out is None else M.asarray(d_out))
    else:
        results = _run(M, case, block_size, _bounds(partition), *arrays,
                       d_out=None if d_out is None else M.asarray(d_out))
    return tuple(M.to_numpy(x) for x in (results if isinstance(results, tuple) else (results,)))


def _run(M: ModuleType, case: Case, block_size: int | None, bounds: dict, q, k, v, cu_seqlens_q, cu_seqlens_k,
         d_out=None) -> object:
    """varlen_attention, or with d_out its vjp's out and gradients, on M's arrays."""
    options = {**case._asdict(), **bounds, "block_size": block_size}
    if d_out is None:
        return M.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    out, pullback = M.varlen_attention_vjp(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    return (out, *pullback(d_out))


@functools.cache
def _jax_program(case: Case, block_size: int | None, partition: Partition | None):
    """_run of JAX under jax.jit: partition None takes the boundaries as traced arguments, max_seqlen the bounds
    (Tq, Tk) that every partition meets; else the partition's own boundaries, concrete."""
    import jax

    M = sys.modules["attention_jax"]
    if partition is None:
        bounds = {"max_seqlen_q": TQ, "max_seqlen_k": TK}
        return jax.jit(lambda *arrays, d_out: _run(M, case, block_size, bounds, *arrays, d_out=d_out))
    cu_seqlens = partition.cu_seqlens_q, partition.cu_seqlens_k
    return jax.jit(lambda q, k, v, _q, _k, d_out: _run(M, case, block_size, _bounds(partition), q, k, v,
                                                        *cu_seqlens, d_out=d_out))


def _compiled(M: ModuleType, function):
    """function, JAX's under jax.jit (eagerly, each of its primitives compiles apart)."""
    if M.__name__ != "attention_jax":
        return function
    import jax

    return jax.jit(function)


# --- values: against the per-sequence loops ------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=["untiled", "tiled3"])
@pytest.mark.parametrize("name", CASES)
def test_equals_the_loop_over_sequences(backend, name, block_size):
    q, k, v, _ = _inputs(CASES[name])
    (out,) = _varlen(backend, PACKED, CASES[name], block_size, q, k, v)
    library, reference = _references(name)
    assert_close(out, library, RTOL, f"{backend.__name__} varlen {name} against sdpa per sequence")
    assert_close(out, reference, RTOL, f"{backend.__name__} varlen {name} against the oracle per sequence")


def test_tiles_of_two_and_the_zeros(backend):
    # block_size 2, causal: sequence 0 has 3 queries and 2 keys, so its first query sits before its keys
    # (p = 0 + 2 - 3 = -1) and sees none; sequence 2 has no keys; queries 8 and 9 lie past the last boundary
    q, k, v, _ = _inputs(CASES["causal"])
    (out,) = _varlen(backend, PACKED, CASES["causal"], 2, q, k, v)
    assert_close(out, _references("causal")[1], RTOL, f"{backend.__name__} varlen causal, tiles of 2")
    for row in (0, 3, 4, 8, 9):
        np.testing.assert_array_equal(out[row], 0.0, err_msg=f"query {row} sees no key: zeros")
    assert np.all(out[[1, 2, 5, 6, 7]] != 0.0)


def test_int32_boundaries(backend):
    # flash-attn's cu_seqlens are int32; the positions are int64 where 64-bit types are on (JAX's strict promotion
    # has no implicit path between the two)
    q, k, v, _ = _inputs(CASES["causal"])
    bounds = [backend.asarray(x.astype(np.int32)) for x in (PACKED.cu_seqlens_q, PACKED.cu_seqlens_k)]
    out = _compiled(backend, lambda q, k, v, cu_q, cu_k: backend.varlen_attention(
        q, k, v, cu_q, cu_k, max_seqlen_q=TQ, max_seqlen_k=TK, is_causal=True))(
        *(backend.asarray(x) for x in (q, k, v)), *bounds)
    assert_close(backend.to_numpy(out), _references("causal")[1], RTOL, f"{backend.__name__} int32 boundaries")


# --- gradients -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=["untiled", "tiled3"])
@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_vjp_equals_the_per_sequence_vjp(backend, name, block_size):
    case = CASES[name]
    q, k, v, d_out = _inputs(case)
    out, *grads = _varlen(backend, PACKED, case, block_size, q, k, v, d_out=d_out)
    assert_close(out, _references(name)[1], RTOL, f"{backend.__name__} varlen_attention_vjp {name}: out")
    for what, grad, expected in zip("qkv", grads, _per_sequence_vjp(PACKED, q, k, v, d_out, case), strict=True):
        assert_close(grad, expected, RTOL, f"{backend.__name__} varlen_attention_vjp {name}: d{what}")


def test_jax_grad_through_varlen_attention():
    jax = pytest.importorskip("jax")
    import attention_jax as M

    case = CASES["softcap_scale_grouped"]
    q, k, v, d_out = _inputs(case)
    cu_q, cu_k = (M.asarray(x) for x in (PACKED.cu_seqlens_q, PACKED.cu_seqlens_k))

    def loss(q, k, v, cu_q, cu_k):  # <out, d_out>: its gradient is the vjp at d_out
        out = M.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=TQ, max_seqlen_k=TK, **case._asdict())
        return (out * M.asarray(d_out)).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(M.asarray(x) for x in (q, k, v)), cu_q, cu_k)
    for what, grad, expected in zip("qkv", grads, _per_sequence_vjp(PACKED, q, k, v, d_out, case), strict=True):
        assert_close(np.asarray(grad), expected, RTOL, f"jax.grad of varlen_attention: d{what}")


def test_torch_autograd_through_varlen_attention():
    torch = pytest.importorskip("torch")
    import attention_torch as M

    case = CASES["softcap_scale_grouped"]
    q, k, v, d_out = _inputs(case)
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = M.varlen_attention(*tensors, torch.tensor(PACKED.cu_seqlens_q), torch.tensor(PACKED.cu_seqlens_k),
                             **_bounds(PACKED), **case._asdict())
    out.backward(torch.tensor(d_out))
    for what, x, expected in zip("qkv", tensors, _per_sequence_vjp(PACKED, q, k, v, d_out, case), strict=True):
        assert_close(x.grad.numpy(), expected, RTOL, f"torch autograd of varlen_attention: d{what}")


# --- independent references: xformers' block-diagonal masks, torch's nested tensors -------------------------------

def _attn_bias() -> ModuleType:
    """xformers.ops.fmha.attn_bias, or a skip. Its import warns (a log record) that the C++ and CUDA extensions are
    missing: harmless for the mask classes, which are Python and torch, and silenced here."""
    pytest.importorskip("torch")
    logger = logging.getLogger("xformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pytest.importorskip("xformers.ops.fmha.attn_bias")
    finally:
        logger.setLevel(level)


class XformersCase(NamedTuple):
    """An xformers bias class and the same mask in varlen_attention's keywords."""

    bias: str  # a BlockDiagonal* class of xformers.ops.fmha.attn_bias
    window_size: int | None  # its local attention's window: keys p - window_size < j <= p
    case: Case


XFORMERS = {
    "block_diagonal": XformersCase("BlockDiagonalMask", None, Case()),
    "causal_bottom_right": XformersCase("BlockDiagonalCausalFromBottomRightMask", None, Case(is_causal=True)),
    "local_bottom_right": XformersCase("BlockDiagonalCausalLocalAttentionFromBottomRightMask", 2,
                                       Case(is_causal=True, window=(1, 0))),
}


def _xformers_mask(x: XformersCase, partition: Partition):
    """xformers' additive mask (Tq, Tk) of the partition: 0 where the query sees the key, -inf elsewhere."""
    attn_bias = _attn_bias()
    if x.window_size is None:
        bias = getattr(attn_bias, x.bias).from_seqlens(list(partition.lengths_q), list(partition.lengths_k))
    else:  # the local class is made from a block-diagonal one (its from_seqlens leaves the window 0, refused)
        bias = attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(
            list(partition.lengths_q), list(partition.lengths_k)).make_local_attention_from_bottomright(x.window_size)
    assert type(bias).__name__ == x.bias
    return bias.materialize((sum(partition.lengths_q), sum(partition.lengths_k)), dtype=_torch().float64)


def _torch() -> ModuleType:
    return pytest.importorskip("torch")


def _grid(mask_mod, Tq: int, Tk: int) -> np.ndarray:
    """mask_mod evaluated on every (query, key) of (Tq, Tk), b = h = 0."""
    return np.broadcast_to(mask_mod(np.zeros(()), np.zeros(()), np.arange(Tq)[:, None], np.arange(Tk)), (Tq, Tk))


@pytest.mark.slow  # the first to run imports xformers (2 s)
@pytest.mark.parametrize("name", XFORMERS)
def test_xformers_mask_is_mods_varlen(name):
    x = XFORMERS[name]
    expected = _xformers_mask(x, COVERED).numpy() == 0
    mask_mod = mods.varlen(COVERED.cu_seqlens_q, COVERED.cu_seqlens_k, is_causal=x.case.is_causal,
                           window=x.case.window)
    np.testing.assert_array_equal(_grid(mask_mod, TQ, TK), expected, err_msg=f"{name}: mods.varlen's mask")


@pytest.mark.slow  # the first to run imports xformers (2 s)
@pytest.mark.parametrize("name", XFORMERS)
def test_xformers_mask_through_torch_sdpa_equals_varlen(backend, name):
    torch = _torch()
    x = XFORMERS[name]
    q, k, v, _ = _inputs(x.case)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(_batched(y)) for y in (q, k, v)), attn_mask=_xformers_mask(x, COVERED))
    (out,) = _varlen(backend, COVERED, x.case, None, q, k, v)
    assert_close(out, _packed(expected.numpy()), RTOL, f"{backend.__name__} varlen against xformers' {x.bias}")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_torch_nested_jagged_sdpa_equals_varlen(backend):
    """torch's nested (jagged) tensors of PACKED's sequences through F.scaled_dot_product_attention (non-causal
    on the CPU: causal nested inputs have no kernel there), empty sequences included: a query without keys gets
    zeros there too. The jagged layout ends at the last boundary, so the two queries past it are varlen's alone."""
    torch = _torch()
    case = Case(scale=0.6)
    q, k, v, _ = _inputs(case)

    def nested(x: np.ndarray, bounds: np.ndarray):  # (T, H, E) -> jagged (N, H, j, E), the sequences' positions
        parts = [torch.tensor(x[start:stop]) for start, stop in itertools.pairwise(bounds)]
        return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)

    cu_q, cu_k = PACKED.cu_seqlens_q, PACKED.cu_seqlens_k
    out = torch.nn.functional.scaled_dot_product_attention(nested(q, cu_q), nested(k, cu_k), nested(v, cu_k),
                                                           scale=case.scale)
    expected = out.transpose(1, 2).values().numpy()  # jagged (N, j, H, Ev) -> packed (cu_q[-1], H, Ev)
    (actual,) = _varlen(backend, PACKED, case, None, q, k, v)
    assert_close(actual[:cu_q[-1]], expected, RTOL, f"{backend.__name__} varlen against torch's nested jagged sdpa")
    np.testing.assert_array_equal(actual[cu_q[-1]:], 0.0)


# --- JAX: the boundaries as data under jit -------------------------------------------------------------------------

OTHER = Partition(lengths_q=(1, 2, 0, 3, 2, 2), lengths_k=(3, 1, 4, 0, 2, 3))  # PACKED's Tq, Tk and N, other cuts


def test_jax_jit_runs_one_program_for_every_partition():
    jax = pytest.importorskip("jax")
    import attention_jax as M

    case = CASES["causal_window_left"]
    traces = []

    def attend(*arrays):
        traces.append(1)  # runs when JAX traces the function, not when its compiled program runs
        return M.varlen_attention(*arrays, max_seqlen_q=TQ, max_seqlen_k=TK, **case._asdict())

    function = jax.jit(attend)
    q, k, v, _ = _inputs(case)
    for partition in (PACKED, OTHER):
        out = function(*(M.asarray(x) for x in (q, k, v, partition.cu_seqlens_q, partition.cu_seqlens_k)))
        expected = _per_sequence(oracle.sdpa, partition, q, k, v, case)
        assert_close(np.asarray(out), expected, RTOL, f"JAX varlen under jit, partition {partition}")
    assert len(traces) == 1, "two partitions of the same Tq, Tk and N: one traced, compiled program"


def test_jax_tiled_path_refuses_traced_boundaries():
    jax = pytest.importorskip("jax")
    import attention_jax as M

    q, k, v, _ = (M.asarray(x) for x in _inputs(Case()))

    def tiled(cu_seqlens_q, cu_seqlens_k):
        return M.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=TQ, max_seqlen_k=TK,
                                  block_size=2)

    with pytest.raises(ValueError, match=r"block_size=2.*cu_seqlens_q must be concrete, not traced"):
        jax.jit(tiled)(M.asarray(PACKED.cu_seqlens_q), M.asarray(PACKED.cu_seqlens_k))
    # the same boundaries as NumPy arrays are constants of the traced function: the tiled path runs under jit
    out = jax.jit(lambda: tiled(PACKED.cu_seqlens_q, PACKED.cu_seqlens_k))()
    assert_close(np.asarray(out), _references("plain")[1], RTOL, "JAX tiled varlen under jit, NumPy boundaries")


# --- segment ids: the other fixed-shape spelling -------------------------------------------------------------------

@pytest.mark.parametrize("is_causal", [False, True], ids=["global", "causal"])
def test_segment_ids_equal_varlen_for_self_attention(backend, is_causal):
    # self-attention, each sequence as many queries as keys, every position in one: document(segment_ids)
    # over (1, H, T, E) shows query i the keys of its segment, and top-left causality inside a segment is
    # bottom-right causality there (L_n = S_n)
    partition = Partition(lengths_q=(3, 2, 5), lengths_k=(3, 2, 5))
    segment_ids = np.repeat(np.arange(3), partition.lengths_q)  # (T,) = [0 0 0 1 1 2 2 2 2 2]
    case = Case(is_causal=is_causal)
    q, k, v, _ = _inputs(case)
    k, v = k[:TQ], v[:TQ]

    def attention(q, k, v):
        return backend.scaled_dot_product_attention(q, k, v, mask_mod=mods.document(segment_ids),
                                                    is_causal=is_causal, need_weights=False)[0]

    out = _compiled(backend, attention)(*(backend.asarray(_batched(x)) for x in (q, k, v)))
    (expected,) = _varlen(backend, partition, case, None, q, k, v)
    assert_close(_packed(backend.to_numpy(out)), expected, RTOL, f"{backend.__name__} document(segment_ids)")


# --- the tiled path skips the tiles across sequences ---------------------------------------------------------------

@pytest.mark.parametrize("is_causal", [False, True], ids=["global", "causal"])
def test_empty_tiles_are_those_off_the_sequences(backend, is_causal):
    # EVEN's sequences start and end on tiles of 2: the tiles of sequence n are its queries' rows by its keys'
    # columns, all others (across two sequences, or past the last boundary) are EMPTY; causality empties some of
    # a sequence's own tiles too
    bounds = [backend.asarray(x) for x in (EVEN.cu_seqlens_q, EVEN.cu_seqlens_k)]
    block_mask = backend.create_block_mask(mods.varlen(*bounds, is_causal=is_causal), None, None, TQ, TK,
                                           BLOCK_SIZE=2)
    own = np.zeros(block_mask.tiles.shape[2:], bool)  # (ceil(Tq / 2), ceil(Tk / 2))
    for rows, columns in EVEN.sequences():
        own[rows.start // 2:rows.stop // 2, columns.start // 2:columns.stop // 2] = True
    empty = block_mask.tiles[0, 0] == EMPTY
    if is_causal:
        assert np.all(empty[~own]), f"a tile across sequences not EMPTY:\n{block_mask}"
        assert not np.all(empty[own]), f"every tile of the sequences EMPTY:\n{block_mask}"
    else:
        np.testing.assert_array_equal(empty, ~own, err_msg=f"EMPTY tiles:\n{block_mask}")


@pytest.mark.parametrize("block_size", [None, 2])
def test_nan_past_the_last_boundary_changes_no_output_bit(backend, block_size):
    # EVEN ends at query 8 and key 10: in tiles of 2 the last tile of queries and the last two of keys lie past
    # the boundaries, EMPTY, never computed; untiled, the values there are zeroed before the product over the
    # packed axis (where a weight of 0 times NaN would be NaN in every row); NaN there reaches no output
    case = CASES["causal"]
    q, k, v, _ = _inputs(case)
    (clean,) = _varlen(backend, EVEN, case, block_size, q, k, v)
    q, k, v = q.copy(), k.copy(), v.copy()
    q[EVEN.cu_seqlens_q[-1]:], k[EVEN.cu_seqlens_k[-1]:], v[EVEN.cu_seqlens_k[-1]:] = np.nan, np.nan, np.nan
    (dirty,) = _varlen(backend, EVEN, case, block_size, q, k, v)
    np.testing.assert_array_equal(dirty, clean, err_msg="NaN past the last boundary reached the output")
    assert not np.any(np.isnan(clean)) and np.all(clean[EVEN.cu_seqlens_q[-1]:] == 0.0)


# --- SPEC 7's error rows -------------------------------------------------------------------------------------------

class Mistake(NamedTuple):
    """One wrong call: the arguments replaced, the exception, and the words its message must hold."""

    arguments: dict[str, object]
    error: type[Exception]
    words: tuple[str, ...]


def _mistakes() -> dict[str, Mistake]:
    q, k, v, _ = _inputs(Case())
    cu_q, cu_k = PACKED.cu_seqlens_q, PACKED.cu_seqlens_k
    return {
        "q_two_axes": Mistake({"q": q[:, 0]}, ValueError, ("varlen_attention", "q", "(Tq, H, E)", "(10, 3)")),
        "widths_differ": Mistake({"k": k[..., :2]}, ValueError, ("varlen_attention", "(10, 2, 3)", "(13, 2, 2)")),
        "lengths_differ": Mistake({"v": v[:12]}, ValueError, ("varlen_attention", "(13, 2, 3)", "(12, 2, 2)")),
        "heads_differ": Mistake({"k": k[:, :1], "v": v[:, :1]}, ValueError,
                                ("varlen_attention", "(10, 2, 3)", "(13, 1, 3)", "enable_gqa")),
        "heads_not_a_multiple": Mistake({"q": np.concatenate([q, q[:, :1]], axis=1), "enable_gqa": True},
                                        ValueError, ("varlen_attention", "H = 3", "Hkv = 2", "(10, 3, 3)")),
        "bounds_two_axes": Mistake({"cu_seqlens_q": cu_q[None]}, ValueError,
                                   ("cu_seqlens_q", "cu_seqlens_k", "(1, 7)", "(7,)")),
        "bounds_lengths_differ": Mistake({"cu_seqlens_k": cu_k[:-1]}, ValueError,
                                         ("cu_seqlens_q", "cu_seqlens_k", "(7,)", "(6,)")),
        "bounds_not_integer": Mistake({"cu_seqlens_q": cu_q.astype(np.float64)}, TypeError,
                                      ("cu_seqlens_q", "float64")),
        "bounds_not_from_zero": Mistake({"cu_seqlens_k": cu_k + 1}, ValueError, ("cu_seqlens_k", "start at 0", "1")),
        "bounds_decrease": Mistake({"cu_seqlens_q": np.array([0, 3, 3, 2, 6, 6, 8])}, ValueError,
                                   ("cu_seqlens_q[2] = 3", "cu_seqlens_q[3] = 2")),
        "bounds_past_the_end": Mistake({"cu_seqlens_q": np.array([0, 3, 3, 5, 6, 6, 11])}, ValueError,
                                       ("cu_seqlens_q", "11", "Tq = 10")),
        "sequence_too_long": Mistake({"max_seqlen_q": 2}, ValueError,
                                     ("max_seqlen_q = 2", "sequence 0", "3 positions", "cu_seqlens_q")),
        "bound_not_an_int": Mistake({"max_seqlen_k": 4.0}, ValueError, ("max_seqlen_k", "non-negative int", "4.0")),
        "bound_negative": Mistake({"max_seqlen_k": -1}, ValueError, ("max_seqlen_k", "-1")),
        "block_size_zero": Mistake({"block_size": 0}, ValueError, ("block_size", "0")),
        "block_size_float": Mistake({"block_size": 2.0}, ValueError, ("block_size", "2.0")),
    }


MISTAKES = _mistakes()


@pytest.mark.parametrize("function", ["varlen_attention", "varlen_attention_vjp"])
@pytest.mark.parametrize("name", MISTAKES)
def test_errors_name_the_argument_and_the_values(backend, name, function):
    q, k, v, _ = _inputs(Case())
    arguments = {"q": q, "k": k, "v": v, "cu_seqlens_q": PACKED.cu_seqlens_q, "cu_seqlens_k": PACKED.cu_seqlens_k,
                 **_bounds(PACKED), **MISTAKES[name].arguments}
    arguments = {key: backend.asarray(x) if isinstance(x, np.ndarray) else x for key, x in arguments.items()}
    with pytest.raises(MISTAKES[name].error) as raised:
        getattr(backend, function)(**arguments)
    for word in MISTAKES[name].words:
        assert word in str(raised.value), f"{function} {name}: {word!r} not in {str(raised.value)!r}"
