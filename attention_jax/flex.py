"""Programmable attention (torch's FlexAttention interface) in JAX: a score function and a block mask,
tile by tile with the online softmax, forward and backward.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The score functions and mask functions, and the catalogue of them, are in attention_np/common/mods.py; the
block mask, which tiles a mask function leaves empty, partial or full, in attention_np/common/block_mask.py.

The passes are those of flash.py (the online softmax forward; the backward recomputes each tile's weights from the
log-sum-exp, P = exp(R - lse)), with R = score_mod(S) in place of the scores and the tiles chosen by the block mask,
which is known before tracing: its kinds over the whole batch (BlockMask.batch_kinds()) give each row of query tiles
the key tiles it computes, and each column of key tiles the query tiles. The JAX specifics: those lists are index
arrays, padded to the longest, so the traced program does not grow with the number of tiles: the forward pass loops
(lax.fori_loop) over the query tiles, writing each one's rows into out in place, each a fori_loop over its row's key
tiles; the backward pass scans over the key tiles, each a fori_loop over its column's query tiles, with dQ and the
score function's parameters' gradients carried along. q keeps its layout (B, H, L, E) and each tile is grouped (B,
Hkv, G, bq, E) where it is read: a grouped view of the whole of q, and the tiles' outputs stacked, each cost XLA an
array of out's size. On each tile a lax.cond on its kind evaluates the mask function on a partial tile only. The
score function's derivative is JAX's (jax.vjp on the tile). The tiled passes are one jax.custom_vjp, so that
jax.grad through flex_attention keeps memory at L + S too; the block mask and the score and mask functions are
static (a BlockMask, MaskMod and ScoreMod hash by identity), a ScoreMod's parameters are arguments, which the
gradient reaches. L and S are padded up to whole tiles: the mods see the last query's and key's index there, a
padded key is hidden, a padded query dropped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attention_np.common import block_mask as blocks
from attention_np.common import validation
from attention_np.common.block_mask import EMPTY, FULL, PARTIAL, BlockMask

from .arrays import to_numpy
from .functional import _dtypes
from .primitives import _alibi_slopes, _alibi_tile, _at_least_float32, _ranked, _score_rule, _sunk_rows

NO_MASK_TILE = 128  # the tiles' size without a block mask, at most L and S (every tile full: no mask to evaluate)
NO_OFFSET = np.zeros((), np.int64)  # no offset of the queries in flex: ALiBi's p_i is query i's index


def flex_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention(Q, K, V)_bhi = sum_j softmax_j(score_mod(s_bhij, b, h, i, j)) v_bhj, s = (Q K^T) * scale, the
    softmax over the keys j that block_mask's mask_mod shows query i (every key without a block mask);
    lse_bhi = log sum_j exp(score_mod(s_bhij, b, h, i, j)) over the same keys.

    Tile by tile over the block mask's tiles: an empty tile is never computed, a full one is computed without
    evaluating the mask function, a partial one evaluates it on its entries. A key the score function gives
    -inf is hidden as a masked one is; a query with no visible key gets zeros and lse -inf.

    Args:
        q: queries (B, H, L, E).
        k: keys (B, Hkv, S, E); Hkv = H unless enable_gqa.
        v: values (B, Hkv, S, Ev).
        score_mod: (score, b, h, q_idx, kv_idx) -> the new score, elementwise over a tile of scores
            (B, H, block_q, block_k) with integer index arrays broadcasting to it; None: the score itself.
        block_mask: from create_block_mask over (B or 1, H or 1, L, S); None: every key visible, tiles of 128.
        scale: multiplies Q K^T before score_mod; defaults to 1 / sqrt(E).
        enable_gqa: grouped-query attention: query head h uses key/value head h // (H // Hkv); score_mod
            and the mask function see the query head h.
        return_lse: also return lse.
        sinks: one logit per head, broadcasting to (B, H), as for flash_attention: each row's sink joins its
            softmax's denominator once, after the tiles (lse includes it; a query that sees no key keeps zeros).
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), one per query head: each tile adds -slope_h * |i - j| (the
            query's position is i, as flex has no offset) to score_mod's result, before the mask, as
            scaled_dot_product_attention adds it after score_mod; built from the tile's positions; constants.

    Returns:
        out (B, H, L, Ev) in q's dtype, computed in at least float32; with return_lse, (out, lse (B, H, L)) in
        the dtype the scores are computed in.
    """
    plan, parameters = _plan(q, k, v, score_mod, block_mask, scale, enable_gqa)
    out, lse = _sunk_rows(*_attend_jit(plan, q, k, v, parameters, alibi_slopes), sinks)  # the sink joins each
    # row once
    return (out, lse) if return_lse else out


def flex_attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, Callable]:
    """P = exp(R - lse) recomputed tile by tile, R = score_mod(S), S = (Q K^T) * scale;  D = rowsum(dO * O),
    dV += P^T dO,  dP = dO V^T,  dR = P * (dP - D),  (dS, dtheta) = score_mod's vjp at dR,
    dQ += dS K * scale,  dK += dS^T Q * scale; dtheta, the score function's parameters' gradients, summed over
    the tiles.

    JAX differentiates through score_mod (any function of jax.numpy operations), one tile at a time (jax.vjp);
    a ScoreMod's parameters are differentiated through ScoreMod.replace. The backward pass is the custom_vjp's
    own, so jax.grad through flex_attention takes it as well; lse's cotangent, where one is given, enters as
    D - d_lse (d lse / dR = P).

    Args:
        q, k, v, score_mod, block_mask, scale, enable_gqa, sinks, alibi_slopes: as for flex_attention; the
            slopes are constants (their bias joins R after score_mod, dR unchanged).

    Returns:
        out (B, H, L, Ev), lse (B, H, L) and pullback(d_out (B, H, L, Ev)) -> (dq, dk, dv, d_score_mod), each of
        dq, dk, dv with its input's shape and dtype, and d_score_mod a dict {parameter name: gradient} of the
        score function's parameters (ScoreMod.parameters; empty without); with sinks (dq, dk, dv, d_sinks,
        d_score_mod), d_sinks = -sum_i exp(sink - lse_i) rowsum(dO * O)_i in the sinks' shape.
    """
    plan, parameters = _plan(q, k, v, score_mod, block_mask, scale, enable_gqa)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, parameters: dict[str, jax.Array],
               sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        return _sunk_rows(*_attend_jit(plan, q, k, v, parameters, alibi_slopes), sinks)  # the sink joins each row
        # once; jax: the slopes closed over, constants

    sinks = None if sinks is None else jnp.asarray(sinks)  # jax: differentiated as an argument
    (out, lse), pull = jax.vjp(attend, q, k, v, parameters, sinks)
    # jax: autodiff of the forward, whose tiled core is a custom_vjp carrying the backward pass below

    def pullback(d_out: jax.Array) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        dq, dk, dv, d_parameters, d_sinks = pull((d_out, jnp.zeros_like(lse)))  # jax: lse is an output too;
        # its cotangent is 0 here
        return (dq, dk, dv, dict(d_parameters)) if sinks is None else (dq, dk, dv, d_sinks, dict(d_parameters))

    return out, lse, pullback


def create_block_mask(
    mask_mod: Callable[..., Any],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    BLOCK_SIZE: int | tuple[int, int] = 128,
) -> BlockMask:
    """The tiles of mask_mod(b, h, q_idx, kv_idx) over scores (B, H, Q_LEN, KV_LEN), each (query tile, key tile)
    pair empty, partial or full; mask_mod is evaluated one row of tiles at a time, never on the whole grid.

    Args:
        mask_mod: (b, h, q_idx, kv_idx) -> True where query q_idx sees key kv_idx, elementwise over integer
            index arrays that broadcast to (B, H, block_q, block_k).
        B: the batch size, or None: the mask is the same for every batch element (b is 0).
        H: the number of (query) heads, or None: the same for every head (h is 0).
        Q_LEN: L, the number of queries.
        KV_LEN: S, the number of keys.
        BLOCK_SIZE: the tiles' size, an int or (block_q, block_k).

    Returns:
        A BlockMask: shape (B or 1, H or 1, L, S), block_size, tiles (B, H, ceil(L / block_q),
        ceil(S / block_k)) of kinds; counts() and sparsity() say how much is skipped.
    """
    # jax: a block mask is data known before the program runs, so its mask function gets NumPy's index arrays
    # (eager JAX would compile each of its operations anew for every shape: seconds for a few block masks); a mask
    # function written with jax.numpy takes them all the same, and runs on concrete arrays even inside a traced
    # function (under jit), so that its tiles can be read
    with jax.ensure_compile_time_eval():
        return blocks.create(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE, arange=np.arange, to_numpy=to_numpy)


class _Plan(NamedTuple):
    """What the tiled passes need to know besides the arrays; hashable (the block mask and the functions by
    identity), as jit's static argument."""

    B: int  # the scores (B, H, L, S); Hkv key/value heads, G = H // Hkv query heads to each
    H: int
    Hkv: int
    L: int
    S: int
    block_q: int  # the tiles
    block_k: int
    scale: float
    score_rule: Callable[..., Any] | None  # (score, b, h, q_idx, kv_idx, **parameters) -> the new score
    block_mask: BlockMask | None  # None: every tile full


class _Visits(NamedTuple):
    """The tiles one pass computes: for each query tile (forward) or key tile (backward), the non-empty tiles
    across from it, in order, padded to the longest list; int32 arrays, which the loops index."""

    index: np.ndarray  # (n, most): the tiles across
    kind: np.ndarray  # (n, most): PARTIAL or FULL (EMPTY in the padding, never visited)
    count: np.ndarray  # (n,): how many of them


def _plan(q: jax.Array, k: jax.Array, v: jax.Array, score_mod: Callable[..., Any] | None,
          block_mask: BlockMask | None, scale: float | None, enable_gqa: bool) -> tuple[_Plan, dict[str, Any]]:
    """The checked arguments: the static plan, and the score function's parameters (a ScoreMod's; none for a
    plain function), the arrays its gradient reaches."""
    B, H = validation.flex_inputs(q.shape, k.shape, v.shape, enable_gqa)
    validation.same_floating_dtype(_dtypes(q=q, k=k, v=v))
    L, S = q.shape[-2], k.shape[-2]
    if block_mask is None:
        block_q, block_k = max(1, min(NO_MASK_TILE, L)), max(1, min(NO_MASK_TILE, S))
    else:
        validation.block_mask_fits(block_mask, B, H, L, S)
        block_q, block_k = block_mask.block_size
    rule, parameters = _score_rule(score_mod)  # jax: a ScoreMod's parameters apart, as arguments, so that
    # gradients reach them
    return _Plan(B=B, H=H, Hkv=k.shape[1], L=L, S=S, block_q=block_q, block_k=block_k,
                 scale=validation.default_scale(scale, q.shape, k.shape), score_rule=rule,
                 block_mask=block_mask), parameters


def _attend(plan: _Plan, q: jax.Array, k: jax.Array, v: jax.Array, parameters: dict[str, jax.Array],
            alibi_slopes: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """out (B, H, L, Ev) in q's dtype and lse (B, H, L) in the working dtype: the inputs in the working dtype and
    padded to whole tiles, then the tiled core. Differentiable in q, k, v and the parameters (not the slopes)."""
    B, H, L, S = plan.B, plan.H, plan.L, plan.S
    dtype, work, Ev = q.dtype, _at_least_float32(q.dtype), v.shape[-1]
    # ALiBi's slopes, checked and laid out against the grouped tiles: (B | 1, Hkv, G, 1, 1), or None
    slopes = _alibi_slopes(alibi_slopes, (B, plan.Hkv, H // plan.Hkv), True, work)
    if L == 0 or S == 0:  # no query, or no key seen: zeros, lse -inf; the gradients are zeros
        return jnp.zeros((B, H, L, Ev), dtype), jnp.full((B, H, L), -jnp.inf, work)
    Lp, Sp = _padded(L, plan.block_q), _padded(S, plan.block_k)
    # q keeps its layout (B, H, Lp, E): the loops group one tile at a time, (B, Hkv, G, bq, E), query head
    # h = (h // G, h % G); a grouped view of the whole of q is copied by XLA into the loops' state
    q = _pad(q.astype(work), Lp)
    k, v = _pad(k.astype(work), Sp), _pad(v.astype(work), Sp)  # (B, Hkv, Sp, E), (B, Hkv, Sp, Ev)
    out, lse = _tiled(plan, q, k, v, parameters, slopes)  # (B, H, Lp, Ev), (B, H, Lp)
    out, lse = out[..., :L, :], lse[..., :L]  # padded queries dropped
    return out.astype(dtype), lse


_attend_jit = jax.jit(_attend, static_argnums=0)  # jax: compiled once per plan and shapes, also when called eagerly


def _padded(n: int, block: int) -> int:
    return -(-n // block) * block  # n rounded up to whole tiles


def _pad(x: jax.Array, size: int) -> jax.Array:
    """x with zeros after its entries along axis -2, up to `size` (jax: tiles have one static size)."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, size - x.shape[-2]), (0, 0)])


def _visits(plan: _Plan) -> tuple[_Visits, _Visits]:
    """The forward pass's visits (query tiles -> key tiles) and the backward's (key tiles -> query tiles), from
    the tiles' kinds over the whole batch (every tile full without a block mask)."""
    if plan.block_mask is None:
        kinds = np.full((-(-plan.L // plan.block_q), -(-plan.S // plan.block_k)), FULL, np.uint8)
    else:
        kinds = plan.block_mask.batch_kinds()  # (rows, columns)
    return _visits_of(kinds), _visits_of(kinds.T)


def _visits_of(kinds: np.ndarray) -> _Visits:
    """Each row's non-empty columns of kinds (rows, columns), in order, padded to the longest row."""
    count = np.sum(kinds != EMPTY, axis=1).astype(np.int32)
    most = max(1, int(count.max(initial=0)))  # jax: a loop indexes the lists, so they hold one entry at least
    index, kind = np.zeros((len(kinds), most), np.int32), np.full((len(kinds), most), EMPTY, np.int32)
    for row, kinds_of_row in enumerate(kinds):
        columns = np.flatnonzero(kinds_of_row != EMPTY)
        index[row, :len(columns)], kind[row, :len(columns)] = columns, kinds_of_row[columns]
    return _Visits(index=index, kind=kind, count=count)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled(plan: _Plan, q: jax.Array, k: jax.Array, v: jax.Array, parameters: dict[str, jax.Array],
           slopes: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """out (B, H, Lp, Ev) and lse (B, H, Lp) of the padded problem, in the working dtype."""
    return _forward_tiles(plan, q, k, v, parameters, slopes)


def _tiled_forward(plan: _Plan, q: jax.Array, k: jax.Array, v: jax.Array, parameters: dict[str, jax.Array],
                   slopes: jax.Array | None) -> tuple:
    out, lse = _forward_tiles(plan, q, k, v, parameters, slopes)
    return (out, lse), (q, k, v, parameters, slopes, out, lse)  # kept for the backward pass: the inputs, out, lse


def _tiled_backward(plan: _Plan, kept: tuple, cotangents: tuple) -> tuple:
    return (*_backward_tiles(plan, *kept, *cotangents), None)  # (dq, dk, dv, d_parameters); ALiBi's slopes:
    # constants, no gradient


_tiled.defvjp(_tiled_forward, _tiled_backward)


class _Tile(NamedTuple):
    """One tile's place, traced: the first query and key it holds (JAX's default int), and its kind."""

    rows: jax.Array
    cols: jax.Array
    kind: jax.Array  # PARTIAL or FULL


def _modded(plan: _Plan, scores: jax.Array, parameters: dict[str, jax.Array], indices: tuple) -> jax.Array:
    """R = score_mod(S, b, h, q_idx, kv_idx) of a tile of scores (B, Hkv, G, bq, bk), which the score function
    sees as (B, H, bq, bk); S itself without one. The hidden entries are hidden afterwards (_hidden): the
    backward pass needs score_mod's derivative at S itself."""
    if plan.score_rule is None:
        return scores
    tile_shape = (plan.B, plan.H, plan.block_q, plan.block_k)
    modded = plan.score_rule(scores.reshape(tile_shape), *indices, **parameters)
    validation.score_mod_result(modded.shape, tile_shape)
    return jnp.broadcast_to(modded, tile_shape).astype(scores.dtype).reshape(scores.shape)


def _indices(plan: _Plan, tile: _Tile) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The index arrays the mods see: b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, bq, 1), kv_idx (1, 1, 1, bk),
    in JAX's default int (create_block_mask's); a padded query or key sees the last one's index."""
    q_idx = jnp.minimum(tile.rows + jnp.arange(plan.block_q), plan.L - 1)
    kv_idx = jnp.minimum(tile.cols + jnp.arange(plan.block_k), plan.S - 1)
    return (jnp.arange(plan.B).reshape(plan.B, 1, 1, 1), jnp.arange(plan.H).reshape(1, plan.H, 1, 1),
            q_idx.reshape(1, 1, -1, 1), kv_idx.reshape(1, 1, 1, -1))


def _visible(plan: _Plan, tile: _Tile, indices: tuple) -> jax.Array | None:
    """Where the tile's queries see its keys, (B, Hkv, G, bq, bk): the mask function on a partial tile (a full
    one never calls it), and the padded keys hidden; None where nothing is hidden."""
    visible = None
    if plan.block_mask is not None:
        tile_shape = (plan.B, plan.H, plan.block_q, plan.block_k)

        def evaluated() -> jax.Array:
            shown = plan.block_mask.mask_mod(*indices)
            validation.mask_mod_result("mask_mod", shown.shape, str(shown.dtype), tile_shape)
            return jnp.broadcast_to(shown, tile_shape)

        visible = lax.cond(tile.kind == PARTIAL, evaluated, lambda: jnp.ones(tile_shape, bool))
        visible = visible.reshape(plan.B, plan.Hkv, plan.H // plan.Hkv, plan.block_q, plan.block_k)
    if plan.S % plan.block_k:  # the padding: keys j >= S
        real = _ranked(tile.cols + jnp.arange(plan.block_k) < plan.S, 5)  # (1, 1, 1, 1, bk)
        visible = real if visible is None else visible & real
    return visible


def _hidden(scores: jax.Array, visible: jax.Array | None) -> jax.Array:
    return scores if visible is None else jnp.where(visible, scores, -jnp.inf)


def _with_alibi(plan: _Plan, scores: jax.Array, slopes: jax.Array | None, tile: _Tile) -> jax.Array:
    """R plus ALiBi's -slope_h * |i - j| over the tile (B, Hkv, G, bq, bk), where sdpa adds it: after the score
    function, before the mask; query i's position is i (flex has no offset). R itself without slopes."""
    if slopes is None:
        return scores
    return scores + _alibi_tile(slopes, NO_OFFSET, tile.rows, tile.cols, plan.block_q, plan.block_k)


def _forward_tiles(plan: _Plan, q: jax.Array, k: jax.Array, v: jax.Array, parameters: dict[str, jax.Array],
                   slopes: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """out (B, H, Lp, Ev) and lse (B, H, Lp): the query tiles in turn, each the online softmax over its row's key
    tiles, written into out and lse in place (a fori_loop: stacking the tiles' results would hold a second array
    of out's size)."""
    visits, _ = _visits(plan)

    def query_tile(row: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        out, lse = carry
        out_tile, lse_tile = _query_tile(plan, q, k, v, (parameters, slopes), row, visits)  # (B, Hkv, G, bq, Ev),
        # (B, Hkv, G, bq)
        rows = row.astype(int) * plan.block_q
        return (lax.dynamic_update_slice_in_dim(out, out_tile.reshape(plan.B, plan.H, plan.block_q, -1), rows, -2),
                lax.dynamic_update_slice_in_dim(lse, lse_tile.reshape(plan.B, plan.H, plan.block_q), rows, -1))

    out, lse = jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype), jnp.zeros(q.shape[:-1], q.dtype)
    return lax.fori_loop(0, len(visits.count), query_tile, (out, lse))


def _query_tile(plan: _Plan, q: jax.Array, k: jax.Array, v: jax.Array, constants: tuple, row: jax.Array,
                visits: _Visits) -> tuple[jax.Array, jax.Array]:
    """out (B, Hkv, G, bq, Ev) and lse (B, Hkv, G, bq) of the query tile `row`: the online softmax (flash.py).
    constants: the score function's parameters and ALiBi's laid-out slopes (or None)."""
    parameters, slopes = constants
    rows = row.astype(int) * plan.block_q  # jax: the tables are int32, the indices the default int
    q = lax.dynamic_slice_in_dim(q, rows, plan.block_q, axis=-2) * plan.scale  # the scale folded in: (B, H, bq, E)
    q = q.reshape(plan.B, plan.Hkv, plan.H // plan.Hkv, plan.block_q, -1)  # grouped: (B, Hkv, G, bq, E)
    m = jnp.full((*q.shape[:-1], 1), -jnp.inf, q.dtype)  # running maximum (B, Hkv, G, bq, 1)
    l = jnp.zeros_like(m)  # running denominator  # noqa: E741 (the paper's name)
    acc = jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)  # running output (B, Hkv, G, bq, Ev)
    index, kind = jnp.asarray(visits.index)[row], jnp.asarray(visits.kind)[row]

    def key_tile(n: jax.Array, carry: tuple) -> tuple:
        m, l, acc = carry  # noqa: E741
        tile = _Tile(rows=rows, cols=index[n].astype(int) * plan.block_k, kind=kind[n])
        k_tile = lax.dynamic_slice_in_dim(k, tile.cols, plan.block_k, axis=-2)  # (B, Hkv, bk, E)
        raw = jnp.einsum("bhgle,bhse->bhgls", q, k_tile)  # S = (Q * scale) K^T: (.., bq, E) x (.., bk, E)
        indices = _indices(plan, tile)
        # R = score_mod(S) (plus ALiBi's bias), -inf where hidden: (B, Hkv, G, bq, bk)
        modded = _with_alibi(plan, _modded(plan, raw, parameters, indices), slopes, tile)
        scores = _hidden(modded, _visible(plan, tile, indices))
        # 1) the new running maximum; where nothing is seen yet (the maximum -inf) the shift is 0
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        # 2) what was summed against the old maximum, moved to the new one: exp(m - m_new)
        rescale = jnp.exp(m - shift)  # 0 on the first tile a row sees
        weights = jnp.exp(scores - shift)  # unnormalised; hidden: exp(-inf) = 0
        l = l * rescale + jnp.sum(weights, axis=-1, keepdims=True)  # noqa: E741
        v_tile = lax.dynamic_slice_in_dim(v, tile.cols, plan.block_k, axis=-2)  # (B, Hkv, bk, Ev)
        acc = acc * rescale + jnp.einsum("bhgls,bhsv->bhglv", weights, v_tile)  # (.., bq, bk) x (.., bk, Ev)
        return m_new, l, acc

    m, l, acc = lax.fori_loop(0, jnp.asarray(visits.count)[row], key_tile, (m, l, acc))  # noqa: E741
    # 3) normalise once, at the end; a query with no visible key has l = 0: zeros, and lse -inf
    seen = l != 0
    out = acc / jnp.where(seen, l, 1.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out, lse[..., 0]


def _backward_tiles(plan: _Plan, q: jax.Array, k: jax.Array, v: jax.Array, parameters: dict[str, jax.Array],
                    slopes: jax.Array | None, out: jax.Array, lse: jax.Array, d_out: jax.Array,
                    d_lse: jax.Array) -> tuple:
    """The pullback of the padded, grouped problem: the key tiles in turn (lax.scan), each its dK and dV tiles
    from its column's query tiles, which add their share to dQ and to the parameters' gradients, carried
    along. dK and dV sum over each group's G query heads (the products contract g)."""
    _, visits = _visits(plan)
    # q, out, lse and their cotangents grouped as the tiles read them: (B, H, Lp, *) -> (B, Hkv, G, Lp, *)
    q, out, lse, d_out, d_lse = (x.reshape(plan.B, plan.Hkv, plan.H // plan.Hkv, *x.shape[2:])
                                 for x in (q, out, lse, d_out, d_lse))
    # (B, Hkv, G, Lp): False for the padded queries and for those that see no key
    seen = (_ranked(jnp.arange(q.shape[-2]), lse.ndim) < plan.L) & (lse != -jnp.inf)
    D = jnp.where(seen, jnp.sum(d_out * out, axis=-1) - d_lse, 0.0)  # rowsum(dO * O); lse's cotangent: P d_lse
    lse = jnp.where(seen, lse, jnp.inf)  # a query that sees nothing, or a padded one: P = exp(-inf) = 0
    q = q * plan.scale  # the scale folded in, as in the forward pass

    def key_tile(carry: tuple, col: jax.Array) -> tuple:
        cols = col.astype(int) * plan.block_k  # jax: the tables are int32, the indices the default int
        k_tile = lax.dynamic_slice_in_dim(k, cols, plan.block_k, axis=-2)  # (B, Hkv, bk, E)
        v_tile = lax.dynamic_slice_in_dim(v, cols, plan.block_k, axis=-2)  # (B, Hkv, bk, Ev)
        index, kind = jnp.asarray(visits.index)[col], jnp.asarray(visits.kind)[col]

        def query_tile(n: jax.Array, carry: tuple) -> tuple:
            tile = _Tile(rows=index[n].astype(int) * plan.block_q, cols=cols, kind=kind[n])
            return _tile_gradients(plan, tile, (q, k_tile, v_tile, d_out, lse, D), (parameters, slopes), carry)

        zeros = (jnp.zeros_like(k_tile), jnp.zeros_like(v_tile))
        dk, dv, dq, d_parameters = lax.fori_loop(0, jnp.asarray(visits.count)[col], query_tile, (*zeros, *carry))
        return (dq, d_parameters), (dk, dv)

    cols = jnp.arange(len(visits.count), dtype=jnp.int32)
    d_parameters = jax.tree_util.tree_map(jnp.zeros_like, parameters)
    (dq, d_parameters), (dks, dvs) = lax.scan(key_tile, (jnp.zeros_like(q), d_parameters), cols)
    dk = jnp.moveaxis(dks, 0, -3).reshape(k.shape)  # (nk, B, Hkv, bk, E) -> (B, Hkv, Sp, E)
    dv = jnp.moveaxis(dvs, 0, -3).reshape(v.shape)  # (nk, B, Hkv, bk, Ev) -> (B, Hkv, Sp, Ev)
    return dq.reshape(plan.B, plan.H, *dq.shape[3:]), dk, dv, d_parameters  # dq as q: (B, H, Lp, E)


def _tile_gradients(plan: _Plan, tile: _Tile, arrays: tuple, constants: tuple, carry: tuple) -> tuple:
    """One tile's share of the gradients, added to carry's: dk and dv of its key tile, dq, and the parameters'.
    arrays: q (B, Hkv, G, Lp, E) with the scale folded in, the key tile's k and v, d_out, lse and D; constants:
    the score function's parameters and ALiBi's laid-out slopes (or None), whose bias leaves dR as it is."""
    q, k, v, d_out, lse, D = arrays
    parameters, slopes = constants
    dk, dv, dq, d_parameters = carry
    q_tile = lax.dynamic_slice_in_dim(q, tile.rows, plan.block_q, axis=-2)  # (B, Hkv, G, bq, E)
    scores = jnp.einsum("bhgle,bhse->bhgls", q_tile, k)  # S = (Q * scale) K^T: (.., bq, E) x (.., bk, E)
    indices = _indices(plan, tile)
    modded, score_mod_vjp = jax.vjp(lambda scores, parameters: _modded(plan, scores, parameters, indices),
                                    scores, parameters)
    visible = _visible(plan, tile, indices)
    # 1) the weights again, from the log-sum-exp: P = exp(R - lse), 0 where hidden
    weights = jnp.exp(_hidden(_with_alibi(plan, modded, slopes, tile), visible)
                      - _rows(lse, tile, plan)[..., None])  # (B, Hkv, G, bq, bk)
    d_o = _rows(d_out, tile, plan)  # (B, Hkv, G, bq, Ev)
    # 2) through the value product and the softmax: dV += P^T dO, dP = dO V^T, dR = P * (dP - D)
    dv = dv + jnp.einsum("bhgls,bhglv->bhsv", weights, d_o)  # (.., bq, bk) x (.., bq, Ev), summed over g
    d_weights = jnp.einsum("bhglv,bhsv->bhgls", d_o, v)  # (.., bq, Ev) x (.., bk, Ev)
    d_modded = weights * (d_weights - _rows(D, tile, plan)[..., None])
    # 3) through the score function (JAX's derivative of it on the tile), then S = (Q * scale) K^T
    d_scores, d_tile_parameters = score_mod_vjp(d_modded)
    if visible is not None:  # a hidden entry's derivative never leaks (its dR is 0, but 0 * inf is NaN)
        d_scores = jnp.where(visible, d_scores, 0.0)
    d_q = jnp.einsum("bhgls,bhse->bhgle", d_scores, k) * plan.scale  # dS K * scale: (B, Hkv, G, bq, E)
    dq = lax.dynamic_update_slice_in_dim(dq, _rows(dq, tile, plan) + d_q, tile.rows, axis=-2)
    dk = dk + jnp.einsum("bhgls,bhgle->bhse", d_scores, q_tile)  # dS^T Q * scale, summed over g
    d_parameters = jax.tree_util.tree_map(jnp.add, d_parameters, d_tile_parameters)
    return dk, dv, dq, d_parameters


def _rows(x: jax.Array, tile: _Tile, plan: _Plan) -> jax.Array:
    """The tile's queries of x (B, Hkv, G, Lp, *) or (B, Hkv, G, Lp): (B, Hkv, G, bq, *) or (B, Hkv, G, bq)."""
    axis = -2 if x.ndim == 5 else -1
    return lax.dynamic_slice_in_dim(x, tile.rows, plan.block_q, axis=axis)
