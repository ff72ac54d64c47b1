"""Tiled attention with the online softmax (the FlashAttention-2 algorithm), forward and backward, in JAX.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The scores of one tile of queries against one tile of keys, (..., block_q, block_k), are the only
scores that ever exist, so memory grows as L + S, not L * S.

The forward pass: the online softmax. For a query row, after the key tiles 1..t,
    m_t = max(m_{t-1}, rowmax(S_t))                      the running maximum of the visible scores
    l_t = exp(m_{t-1} - m_t) l_{t-1} + rowsum(exp(S_t - m_t))        the running denominator
    O_t = exp(m_{t-1} - m_t) O_{t-1} + exp(S_t - m_t) V_t            the running, unnormalised output
and at the end out = O_T / l_T, lse = m_T + log(l_T). When the maximum grows, everything summed so far
was exponentiated against the old maximum: multiplying by exp(m_{t-1} - m_t) moves it to the new one, so
the result is exactly softmax(S) V, one tile at a time.

The backward pass recomputes each tile's weights from the log-sum-exp, P = exp(S - lse), instead of keeping
them. With D = rowsum(dO * O) (= rowsum(dP * P), since O = P V):
    dV += P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dQ += dS K * scale,  dK += dS^T Q * scale.

Tiles that the structure (is_causal, window, q_offset, key_lengths) hides from every query of a tile are
never computed: causal attention does about half the work. The JAX specifics: the loops are lax loops, so
the traced program does not grow with L and S. The forward pass maps (lax.map) over the query tiles, each a
lax.fori_loop over its key tiles; the backward pass scans over the key tiles, each a fori_loop over the query
tiles that may see it, with dQ carried along. The loops' bounds are computed from q_offset and key_lengths
as arrays (the rule of validation.key_tiles), so those may be traced under jit. L and S are padded up to whole
tiles (a padded key is hidden, a padded query dropped). The tiled passes are one jax.custom_vjp, so that
jax.grad through flash_attention keeps the memory bounded too; flash_attention_vjp is jax.vjp of it.

A mask_mod is evaluated on every tile computed, and-ed with the keyword rules and the mask's tile; a score_mod
on every tile's scores after softcap (its derivative is JAX's, jax.vjp on the tile, and a ScoreMod's
parameters are arguments of the custom_vjp, which the gradient reaches). A block mask (create_block_mask)
tiles the scores as flash does, block_q and block_k its BLOCK_SIZE, each tile empty, partial or full over the
whole batch (BlockMask.batch_kinds()): an empty tile is never computed, a full one is computed without its
mask function (a lax.cond on the tile's kind), a partial one evaluates the mask function on its entries; the
keyword rules still apply. The non-empty tiles are known before tracing: each query tile's (and, for the
backward pass, each key tile's) list of them, in order, is an index array, and the loops run over the part of
that list within the range the structure leaves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from attention_np.common import validation
from attention_np.common.block_mask import PARTIAL, BlockMask
from attention_np.common.records import FlashOptions, Structure

from .flex import _Visits, _visits_of
from .functional import _dtypes, _grouped, _prepare, _ungrouped
from .primitives import (
    _alibi_slopes,
    _alibi_tile,
    _at_least_float32,
    _by_position,
    _integers,
    _mask_modded,
    _mod_indices,
    _Mods,
    _mods,
    _positions,
    _ranked,
    _score_modded,
    _score_rule,
    _sink_logits,
    _sum_to,
    _with_parameters,
)

TILE_SCORES = 1 << 20  # scores in a tile over the batch (4 MiB of float32) where block_q, block_k are None: the
# loops' steps run one after another, each with a fixed cost; 128 x 128 ran twice as long as 256 x 512 at H=8


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    *,
    bias: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | jax.Array = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: jax.Array | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    block_mask: BlockMask | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention(Q, K, V) = softmax(score_mod(softcap(Q K^T * scale)) + bias) V, tile by tile with the online
    softmax; lse = log sum_j exp(scores_ij) over the visible keys j. With sinks, the running maximum starts at the
    sink and the running denominator at exp(sink - sink) = 1: lse = log(exp(sink) + sum_j exp(scores_ij)).

    Args:
        q, k, v, mask, bias, is_causal, scale, q_offset, window, key_lengths, softcap, enable_gqa: as for
            scaled_dot_product_attention (no dropout); mask and bias are read one tile at a time.
        mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
            needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
        score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and before
            bias; needs four axes as mask_mod.
        sinks: one logit per head, broadcasting to (..., H), as for scaled_dot_product_attention.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), as for scaled_dot_product_attention: each tile adds
            -slope_h * |p_i - j| from its positions (no (L, S) bias is formed); constants, no gradient.
        block_mask: from create_block_mask over (B or 1, H or 1, L, S): its tiles are flash's (block_q
            and block_k None), an empty tile is skipped, a full one computed without its mask function.
        block_q: queries per tile (the last tile may be shorter); None: chosen from the shapes
            (validation.default_tiles within the backend's TILE_SCORES).
        block_k: keys per tile (the last tile may be shorter); None: as for block_q.

    Returns:
        out (..., L, Ev), equal to scaled_dot_product_attention's, and lse (..., L) in the dtype the scores
        are computed in (float32 for float16 and bfloat16 inputs): -inf where a query sees no key (with sinks, the
        sink: its out is still zeros).
    """
    return _forward(q, k, v, mask, bias, FlashOptions(
        is_causal=is_causal, scale=scale, q_offset=q_offset, window=window, key_lengths=key_lengths,
        softcap=softcap, enable_gqa=enable_gqa, block_q=block_q, block_k=block_k, sinks=sinks,
        alibi_slopes=alibi_slopes),
        _Given(mask_mod=mask_mod, score_mod=score_mod, block_mask=block_mask))


def flash_attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    *,
    bias: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | jax.Array = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: jax.Array | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    block_mask: BlockMask | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[jax.Array, jax.Array, Callable]:
    """P = exp(S - lse) recomputed tile by tile,  D = rowsum(dO * O),  dV += P^T dO,  dP = dO V^T,
    dS = P * (dP - D),  dQ += dS K * scale,  dK += dS^T Q * scale,  dbias = dS (with softcap, dQ and dK take
    dR = dS * (1 - tanh^2(R / c)) in place of dS, as in scaled_dot_product_attention_vjp).

    D replaces scaled_dot_product_attention_vjp's rowsum(dP * P), which needs a whole row of P: since
    O = P V, rowsum(dP * P) = sum_j (dO . v_j) P_ij = dO . O, one number per query from (..., L, Ev) arrays.
    Nothing of size L * S is kept between the passes: the forward keeps out and lse only. The backward pass
    is the custom_vjp's own, so jax.grad through flash_attention takes it as well; lse's cotangent, where
    one is given, enters as D - d_lse (d lse / dS = P).

    Args:
        q, k, v, mask, bias, is_causal, scale, q_offset, window, key_lengths, softcap, enable_gqa: as for
            flash_attention.
        mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
            needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
        score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and before
            bias; needs four axes as mask_mod.
        sinks: one logit per head, broadcasting to (..., H), as for scaled_dot_product_attention.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), as for scaled_dot_product_attention: each tile adds
            -slope_h * |p_i - j| from its positions (no (L, S) bias is formed); constants, no gradient.
        block_mask: from create_block_mask over (B or 1, H or 1, L, S): its tiles are flash's (block_q
            and block_k None), an empty tile is skipped, a full one computed without its mask function.
        block_q, block_k: as for flash_attention.

    Returns:
        out (..., L, Ev), lse (..., L) and pullback(d_out (..., L, Ev)) -> (dq, dk, dv, dbias), dbias None when
        bias is None; each gradient has its input's shape and dtype. With a score_mod, (dq, dk, dv, dbias,
        d_score_mod), d_score_mod a dict {parameter name: gradient} of score_mod.parameters (empty for a plain
        function); with sinks, d_sinks (sinks' shape) follows dbias: (dq, dk, dv, dbias, d_sinks) or
        (dq, dk, dv, dbias, d_sinks, d_score_mod).
    """
    options = FlashOptions(is_causal=is_causal, scale=scale, q_offset=q_offset, window=window,
                           key_lengths=key_lengths, softcap=softcap, enable_gqa=enable_gqa, block_q=block_q,
                           block_k=block_k, alibi_slopes=alibi_slopes)  # the slopes: constants, no gradient
    _, parameters = _score_rule(score_mod)  # jax: a ScoreMod's parameters, differentiated as arguments

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None, sinks: jax.Array | None,
                  parameters: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        given = _Given(mask_mod=mask_mod, score_mod=_with_parameters(score_mod, parameters), block_mask=block_mask)
        return _forward(q, k, v, mask, bias, options._replace(sinks=sinks), given)

    sinks = None if sinks is None else jnp.asarray(sinks)  # jax: differentiated as an argument
    (out, lse), pull = jax.vjp(attention, q, k, v, bias, sinks, parameters)
    # jax: autodiff of the forward, whose tiled core is a custom_vjp carrying the backward pass below

    def pullback(d_out: jax.Array) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        *grads, d_sinks, d_parameters = pull((d_out, jnp.zeros_like(lse)))  # jax: lse is an output too; its
        # cotangent is 0 here
        grads = (*grads, d_sinks) if sinks is not None else tuple(grads)
        return grads if score_mod is None else (*grads, dict(d_parameters))

    return out, lse, pullback


class _Given(NamedTuple):
    """The mods a caller gave flash_attention, as its public functions hand them to the problem."""

    mask_mod: Callable[..., Any] | None = None
    score_mod: Callable[..., Any] | None = None
    block_mask: BlockMask | None = None  # replaces block_q, block_k and mask_mod by its own


_NO_MODS = _Given()


class _Tiling(NamedTuple):
    """What the tiled passes need to know besides the arrays; hashable, as jit's static argument."""

    batch: tuple  # the scores' leading axes (...)
    L: int  # queries and keys before padding
    S: int
    block_q: int  # the tiles, at most L and S
    block_k: int
    scale: float
    softcap: float | None
    is_causal: bool
    window: tuple[int | None, int | None] | None
    mods: _Mods | None = None  # the mask function (a block mask's) and the score function's rule
    block_mask: BlockMask | None = None  # None: every tile the structure leaves is computed


class _Problem(NamedTuple):
    """One call's tiling and its arrays in the working dtype, all at the scores' rank and padded to whole tiles
    (grouped with enable_gqa: q (..., Hkv, G, Lp, E), k and v (..., Hkv, 1, Sp, *)): what both passes read."""

    # the tiling (_Tiling's fields)
    batch: tuple  # the scores' leading axes (...)
    L: int  # queries and keys before padding
    S: int
    block_q: int
    block_k: int
    scale: float
    softcap: float | None
    is_causal: bool
    window: tuple[int | None, int | None] | None
    mods: _Mods | None
    block_mask: BlockMask | None
    # the arrays, padded to Lp queries and Sp keys
    q: jax.Array  # (..., Lp, E)
    k: jax.Array  # (..., Sp, E)
    v: jax.Array  # (..., Sp, Ev)
    bias: jax.Array | None  # (..., Lp | 1, Sp | 1)
    mask: jax.Array | None  # (..., Lp | 1, Sp | 1)
    q_offset: jax.Array  # (...)
    key_lengths: jax.Array | None  # (...)
    Lp: int
    Sp: int
    work: Any  # the working dtype: at least float32
    offsets: tuple[jax.Array, jax.Array]  # q_offset's least and greatest value, which choose the tiles
    longest: jax.Array | None  # key_lengths' greatest value (None: no key_lengths)
    parameters: dict[str, jax.Array]  # the score function's (a ScoreMod's; none for a plain function)
    sinks: jax.Array | None  # the sink logits (..., 1, 1) at the scores' rank (None: no sinks)
    slopes: jax.Array | None  # ALiBi's slopes (..., 1, 1) at the scores' rank (None: no ALiBi)
    visits: tuple[_Visits, _Visits] | None  # the block mask's non-empty tiles: query tiles -> key tiles, and back


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, bias: jax.Array | None,
             options: FlashOptions, given: _Given = _NO_MODS) -> tuple[jax.Array, jax.Array]:
    """out and lse in the caller's shapes (heads ungrouped): the checks of scaled_dot_product_attention, the
    inputs as the tiles read them, then the tiled core. Differentiable in q, k, v, bias, the sinks and the score
    function's parameters: the padding, the casts and the reshapes around the core are differentiated by JAX,
    the core by its own backward pass."""
    validation.tiles(options.block_q, options.block_k)
    mods, parameters, block_mask = None, {}, None
    if given != _NO_MODS:
        mods, parameters, options = _checked_mods(q, k, v, given, options)
        block_mask = given.block_mask
    dtype = q.dtype
    q_offset, key_lengths = options.q_offset, options.key_lengths
    if options.enable_gqa:  # grouped-query attention as broadcasting: reshapes only (functional._grouped)
        q, k, v, mask, bias, q_offset, key_lengths = _grouped(q, k, v, mask, bias, q_offset, key_lengths)
    structure = Structure(is_causal=options.is_causal, q_offset=q_offset,
                          window=validation.window(options.window), key_lengths=key_lengths)
    batch, scale, empty = _prepare(q, k, v, None, None, structure, scale=options.scale,
                                   softcap=options.softcap, dropout_p=0.0, need_weights=False, rng=None)
    L, S = q.shape[-2], k.shape[-2]
    _check_masks(mask, bias, (*batch, L, S))
    q_offset = _integers(q_offset, "q_offset", batch)
    key_lengths = None if key_lengths is None else _integers(key_lengths, "key_lengths", batch)
    work = _at_least_float32(dtype)  # float16, bfloat16: in float32
    sinks = _sink_logits(options.sinks, batch, options.enable_gqa, work)  # (..., 1, 1), or None
    sinks = None if sinks is None else _ranked(sinks, len(batch) + 2)  # jax: no rank promotion
    slopes = _alibi_slopes(options.alibi_slopes, batch, options.enable_gqa, work)  # (..., 1, 1), or None
    if empty is not None:  # L = 0 or S = 0: zeros, and no key seen (lse the sink, if any); zero gradients
        out, lse = empty[0], jnp.full((*batch, L), -jnp.inf, work)
        lse = lse if sinks is None else jnp.broadcast_to(sinks[..., 0], lse.shape)
    else:
        tiling = _tiling(batch, L, S, scale, options, mods, block_mask)
        arrays = _tiled_inputs(tiling, work, q, k, v, bias, mask, q_offset, key_lengths)
        out, lse = _tiled_jit(tiling, *arrays, sinks, parameters, slopes)  # (..., Lp, Ev), (..., Lp)
        out, lse = out[..., :L, :], lse[..., :L]  # the padded queries dropped
    if options.enable_gqa:  # (..., Hkv, G, L, *) -> (..., H, L, *)
        out, lse = _ungrouped(out), _ungrouped(lse[..., None])[..., 0]
    return out.astype(dtype), lse


def _checked_mods(q: jax.Array, k: jax.Array, v: jax.Array, given: _Given,
                  options: FlashOptions) -> tuple[_Mods, dict[str, jax.Array], FlashOptions]:
    """The checked mods, the score function split into its rule (static) and its parameters (arrays), and with
    a block mask the options with its tiles (validation.flash_block_mask)."""
    rule, parameters = _score_rule(given.score_mod)  # jax: the parameters as arguments, which gradients
    # reach, and the rule static: new parameter values compile nothing new
    mask_mod = given.mask_mod
    if given.block_mask is not None:
        B, H = validation.mods_inputs("flash_attention", q.shape, k.shape, v.shape)
        block_q, block_k = validation.flash_block_mask(given.block_mask, mask_mod, options.block_q,
                                                       options.block_k, (B, H, q.shape[-2], k.shape[-2]))
        options, mask_mod = options._replace(block_q=block_q, block_k=block_k), given.block_mask.mask_mod
    mods = _mods("flash_attention", q, k, v, mask_mod, rule)
    return mods, parameters, options


def _tiling(batch: tuple, L: int, S: int, scale: float, options: FlashOptions, mods: _Mods | None = None,
            block_mask: BlockMask | None = None) -> _Tiling:
    """The static description of a problem of L queries and S keys (tiles no larger than the sequence)."""
    block_q, block_k = validation.default_tiles(options.block_q, options.block_k, batch, L, S, TILE_SCORES)
    return _Tiling(batch=batch, L=L, S=S, block_q=min(block_q, L), block_k=min(block_k, S),
                   scale=scale, softcap=options.softcap, is_causal=options.is_causal,
                   window=validation.window(options.window), mods=mods, block_mask=block_mask)


def _tiled_inputs(tiling: _Tiling, work: Any, q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
                  mask: jax.Array | None, q_offset: jax.Array, key_lengths: jax.Array | None) -> tuple:
    """The arrays as the tiles read them: at the scores' rank (jax: no rank promotion), q, k, v and bias in the
    working dtype, and padded to whole tiles, Lp queries and Sp keys; mask and bias only along the axes they
    do not broadcast along."""
    n = len(tiling.batch) + 2
    Lp, Sp = _padded(tiling.L, tiling.block_q), _padded(tiling.S, tiling.block_k)
    q, k, v = (_pad(_ranked(x, n).astype(work), size) for x, size in ((q, Lp), (k, Sp), (v, Sp)))
    mask = None if mask is None else _pad_tiled(_ranked(jnp.asarray(mask), n), Lp, Sp)
    bias = None if bias is None else _pad_tiled(_ranked(jnp.asarray(bias).astype(work), n), Lp, Sp)
    key_lengths = None if key_lengths is None else _ranked(key_lengths, n - 2)
    return q, k, v, bias, mask, _ranked(q_offset, n - 2), key_lengths


def _check_masks(mask: jax.Array | None, bias: jax.Array | None, shape: tuple) -> None:
    """mask and bias broadcast to the scores' shape (..., L, S); a floating mask holds 0 and 1 only."""
    for name, x in (("mask", mask), ("bias", bias)):
        if x is not None:
            validation.broadcasts_to(name, jnp.shape(x), shape, "..., L, S")
    if mask is not None and jnp.issubdtype(jnp.asarray(mask).dtype, jnp.floating):
        binary = jnp.all((mask == 0.0) | (mask == 1.0))
        # jax: under jit the values cannot be seen, of an argument nor of a mask the jitted function captures
        validation.binary_mask(True, None if isinstance(binary, jax.core.Tracer) else bool(binary))


def _padded(n: int, block: int) -> int:
    return -(-n // block) * block  # n rounded up to whole tiles


def _pad(x: jax.Array, size: int, axis: int = -2) -> jax.Array:
    """x with zeros after its entries along `axis`, up to `size` (jax: tiles have one static size)."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _pad_tiled(x: jax.Array, Lp: int, Sp: int) -> jax.Array:
    """A mask or bias (..., L | 1, S | 1) padded to (..., Lp | 1, Sp | 1): a broadcast axis stays 1."""
    x = x if x.shape[-2] == 1 else _pad(x, Lp, -2)
    return x if x.shape[-1] == 1 else _pad(x, Sp, -1)


def _problem(tiling: _Tiling, q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
             mask: jax.Array | None, q_offset: jax.Array, key_lengths: jax.Array | None,
             sinks: jax.Array | None = None, parameters: dict[str, jax.Array] | None = None,
             slopes: jax.Array | None = None) -> _Problem:
    """The tiling and the arrays; q_offset's least and greatest and key_lengths' greatest value, which choose
    the tiles, as arrays (jax: they may be traced); the block mask's visits, known before tracing."""
    def extreme(x: jax.Array, reduce: Callable) -> jax.Array:
        return reduce(x) if x.size else jnp.zeros((), int)  # no sequence at all: nothing to choose
    visits = None
    if tiling.block_mask is not None:
        kinds = tiling.block_mask.batch_kinds()  # (query tiles, key tiles), each EMPTY, PARTIAL or FULL
        visits = _visits_of(kinds), _visits_of(kinds.T)
    return _Problem(**tiling._asdict(), q=q, k=k, v=v, bias=bias, mask=mask, q_offset=q_offset,
                    key_lengths=key_lengths, Lp=q.shape[-2], Sp=k.shape[-2], work=q.dtype,
                    offsets=(extreme(q_offset, jnp.min), extreme(q_offset, jnp.max)),
                    longest=None if key_lengths is None else extreme(key_lengths, jnp.max),
                    parameters=parameters or {}, sinks=sinks, slopes=slopes, visits=visits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled(tiling: _Tiling, q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
           mask: jax.Array | None, q_offset: jax.Array, key_lengths: jax.Array | None, sinks: jax.Array | None,
           parameters: dict[str, jax.Array], slopes: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """out (..., Lp, Ev) and lse (..., Lp) of the padded problem, in the working dtype."""
    p = _problem(tiling, q, k, v, bias, mask, q_offset, key_lengths, sinks, parameters, slopes)
    return _forward_tiles(p)


def _tiled_forward(tiling: _Tiling, *arrays: Any) -> tuple[tuple[jax.Array, jax.Array], tuple]:
    out, lse = _forward_tiles(_problem(tiling, *arrays))
    return (out, lse), (*arrays, out, lse)  # kept for the backward pass: the inputs, out and lse


def _tiled_backward(tiling: _Tiling, kept: tuple, cotangents: tuple) -> tuple:
    *arrays, out, lse = kept
    dq, dk, dv, dbias, d_sinks, d_parameters = _backward_tiles(_problem(tiling, *arrays), out, lse, *cotangents)
    return dq, dk, dv, dbias, None, None, None, d_sinks, d_parameters, None  # mask, q_offset, key_lengths and
    # ALiBi's slopes: no gradient


_tiled.defvjp(_tiled_forward, _tiled_backward)
_tiled_jit = jax.jit(_tiled, static_argnums=0)  # jax: compiled once per tiling and shapes, also when called eagerly


def _forward_tiles(p: _Problem) -> tuple[jax.Array, jax.Array]:
    """out (..., Lp, Ev) and lse (..., Lp): the query tiles in turn (lax.map), each its own online softmax."""
    nq, Ev = p.Lp // p.block_q, p.v.shape[-1]
    outs, lses = lax.map(lambda r: _query_tile(p, r * p.block_q), jnp.arange(nq))  # (nq, ..., bq, Ev), (nq, ..., bq)
    out = jnp.moveaxis(outs, 0, -3).reshape(*p.batch, p.Lp, Ev)  # (..., nq, bq, Ev) -> (..., Lp, Ev)
    return out, jnp.moveaxis(lses, 0, -2).reshape(*p.batch, p.Lp)  # (..., nq, bq) -> (..., Lp)


def _key_tiles(p: _Problem, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The key tiles lo .. hi - 1 that some query of the tile starting at `rows` may see: validation.key_tiles's
    rule on arrays (jax: q_offset and key_lengths may be traced, so the bounds are too)."""
    (least, greatest), left, right = p.offsets, *(p.window or (None, None))
    first, last = least + rows, greatest + jnp.minimum(rows + p.block_q, p.L) - 1  # least, greatest position
    lo, hi = jnp.zeros_like(first), jnp.full_like(first, p.S)  # keys lo .. hi - 1
    if p.longest is not None:
        hi = jnp.clip(p.longest, 0, p.S)
    if p.is_causal:
        hi = jnp.minimum(hi, last + 1)
    if right is not None:
        hi = jnp.minimum(hi, last + right + 1)
    if left is not None:
        lo = jnp.maximum(lo, first - left)
    return _tile_range(lo, hi, p.block_k)


def _query_tiles(p: _Problem, cols: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The query tiles lo .. hi - 1 that may see some key of the tile starting at `cols`, the same rule turned
    around: query i sees key j at most when j <= greatest + i (causal; + right with the window) and
    j >= least + i - left."""
    (least, greatest), left, right = p.offsets, *(p.window or (None, None))
    lo, hi = jnp.zeros_like(cols), jnp.full_like(cols, p.L)  # queries lo .. hi - 1
    if p.is_causal:
        lo = jnp.maximum(lo, cols - greatest)
    if right is not None:
        lo = jnp.maximum(lo, cols - right - greatest)
    if left is not None:
        hi = jnp.minimum(hi, jnp.minimum(cols + p.block_k, p.S) + left - least)
    if p.longest is not None:  # keys from the longest sequence's length on: no query sees them
        hi = jnp.where(cols < p.longest, hi, lo)
    return _tile_range(lo, hi, p.block_q)


def _tile_range(lo: jax.Array, hi: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """The tiles of `block` entries that hold entries lo .. hi - 1 (none when hi <= lo)."""
    first = lo // block
    return first, jnp.where(hi > lo, (hi - 1) // block + 1, first)


def _across(p: _Problem, which: int, first: jax.Array, lo: jax.Array, hi: jax.Array) -> tuple:
    """The loop over the tiles lo .. hi - 1 across from the tile whose first entry is `first` (which 0: a query
    tile's key tiles, 1: a key tile's query tiles): (start, stop, at), at(n) the n-th tile's number and kind.
    Without a block mask every tile of the range, kind None; with one, its non-empty tiles of the range only:
    its visits are in order, so those are a run of them, found by binary search (jax: lo and hi may be
    traced)."""
    if p.visits is None:
        return lo, hi, lambda n: (n, None)
    visits, line = p.visits[which], first // (p.block_k if which else p.block_q)
    index, kind = jnp.asarray(visits.index)[line], jnp.asarray(visits.kind)[line]  # (most,): the tiles across
    listed = jnp.where(jnp.arange(index.shape[0], dtype=index.dtype) < jnp.asarray(visits.count)[line], index,
                       jnp.iinfo(index.dtype).max)  # the padding after the listed ones, so that the list is sorted
    start, stop = (jnp.searchsorted(listed, x.astype(index.dtype)) for x in (lo, hi))
    return start, stop, lambda n: (index[n].astype(lo.dtype), kind[n])


def _query_tile(p: _Problem, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """out (..., block_q, Ev) and lse (..., block_q) of the queries from `rows` on: the online softmax over the
    key tiles the structure (and a block mask) leaves visible to them."""
    q = lax.dynamic_slice_in_dim(p.q, rows, p.block_q, axis=-2) * p.scale  # the scale folded into q: (..., bq, E)
    m = jnp.full((*p.batch, p.block_q, 1), -jnp.inf, p.work)  # running maximum (..., block_q, 1)
    l = jnp.zeros_like(m)  # running denominator  # noqa: E741 (the paper's name)
    if p.sinks is not None:  # the sink first: m_0 = sink, l_0 = exp(sink - m_0) = 1 (0 for a sink of -inf)
        m = jnp.broadcast_to(p.sinks, m.shape)
        l = jnp.where(m == -jnp.inf, 0.0, 1.0).astype(p.work)  # noqa: E741
    acc = jnp.zeros((*p.batch, p.block_q, p.v.shape[-1]), p.work)  # running output (..., block_q, Ev)

    start, stop, at = _across(p, 0, rows, *_key_tiles(p, rows))

    def key_tile(n: jax.Array, carry: tuple) -> tuple:
        m, l, acc = carry  # noqa: E741
        t, kind = at(n)
        cols = t * p.block_k
        k = lax.dynamic_slice_in_dim(p.k, cols, p.block_k, axis=-2)  # (..., block_k, E)
        raw = _product("...le,...se->...ls", q, k)  # R = (Q * scale) K^T: (..., bq, E) x (..., bk, E)
        scores, visible, _, _ = _scores(p, raw, rows, cols, kind)  # (..., block_q, block_k), -inf where hidden
        # 1) the new running maximum; where nothing is seen yet (the maximum -inf) the shift is 0
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
        shift = m_new if visible is None else jnp.where(m_new == -jnp.inf, 0.0, m_new)
        # 2) what was summed against the old maximum, moved to the new one: exp(m - m_new)
        rescale = jnp.exp(m - shift)  # (..., block_q, 1); 0 on the first tile a row sees
        weights = jnp.exp(scores - shift)  # unnormalised; hidden: exp(-inf) = 0
        l = l * rescale + jnp.sum(weights, axis=-1, keepdims=True)  # noqa: E741
        v = lax.dynamic_slice_in_dim(p.v, cols, p.block_k, axis=-2)  # (..., block_k, Ev)
        acc = acc * rescale + _product("...ls,...sv->...lv", weights, v)  # (..., bq, bk) x (..., bk, Ev)
        return m_new, l, acc

    m, l, acc = lax.fori_loop(start, stop, key_tile, (m, l, acc))  # noqa: E741
    # 3) normalise once, at the end; a query with no visible key has l = 0: zeros, and lse -inf (with a sink,
    # l = 1 and acc = 0: zeros, and lse = sink)
    seen = l != 0
    out = acc / jnp.where(seen, l, 1.0)  # (..., block_q, Ev)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)  # (..., block_q, 1)
    return out, lse[..., 0]


def _scores(p: _Problem, raw: jax.Array, rows: jax.Array, cols: jax.Array, kind: jax.Array | None,
            transposed: bool = False, with_vjp: bool = False) -> tuple:
    """The tile's scores score_mod(softcap(raw)) + bias from its raw scores q k^T, q already scaled,
    (..., block_q, block_k), -inf where hidden; where they are visible (None: everywhere); with softcap,
    tanh(raw / softcap); and with_vjp, score_mod's vjp on the tile (the last two for the backward, else None).
    kind: the tile's kind in the block mask (None: no block mask). `transposed`: raw, and so the results, are
    (..., block_k, block_q) (jax: see _backward_tiles)."""
    def oriented(x: jax.Array) -> jax.Array:  # a (..., block_q | 1, block_k | 1) tile as raw is laid out
        return jnp.swapaxes(x, -1, -2) if transposed else x

    scores, tanh, shown, mod_vjp = raw, None, None, None
    if p.softcap is not None:  # softcap * tanh(raw / softcap), before the score function, the bias and the masks
        tanh = jnp.tanh(raw / p.softcap)
        scores = tanh * p.softcap
    if p.mods is not None:  # then score_mod, and where mask_mod shows the keys
        scores, shown, mod_vjp = _tile_mods(p, scores, rows, cols, kind, transposed, with_vjp)
    bias = None if p.bias is None else _tile(p, p.bias, rows, cols)
    if bias is not None:
        scores = scores + oriented(bias)
    if p.slopes is not None:  # ALiBi, as a bias built from the tile's positions
        scores = scores + oriented(_alibi_tile(p.slopes, p.q_offset, rows, cols, p.block_q, p.block_k))
    visible = _tile_visible(p, rows, cols, bias)
    if visible is not None:
        visible = oriented(visible)
    if shown is not None:
        visible = _and(visible, shown)
    if visible is not None:
        scores = jnp.where(visible, scores, -jnp.inf)
    return scores, visible, tanh, mod_vjp


def _tile_mods(p: _Problem, scores: jax.Array, rows: jax.Array, cols: jax.Array, kind: jax.Array | None,
               transposed: bool, with_vjp: bool) -> tuple:
    """A tile's scores (..., block_q, block_k), or transposed, through score_mod, over the whole batch; where the
    mods show the keys (mask_mod on every tile, or with a block mask on a partial tile only: a full one never
    calls it; a -inf modded score hidden), None where they hide none; with_vjp, score_mod's vjp (d_modded ->
    (d_scores, d_parameters)), else None. A padded query or key sees the last one's index."""
    mods = p.mods
    scores = jnp.broadcast_to(scores, (*p.batch, *scores.shape[-2:]))  # b runs over the whole batch
    q_idx = jnp.minimum(rows + jnp.arange(p.block_q), p.L - 1)  # (block_q,), not shifted by q_offset
    kv_idx = jnp.minimum(cols + jnp.arange(p.block_k), p.S - 1)  # (block_k,)
    indices = _mod_indices(mods, p.q.shape[1:-2], q_idx, kv_idx, transposed)
    shown, mod_vjp = None, None
    if mods.score_mod is not None:
        def modded(scores: jax.Array, parameters: dict[str, jax.Array]) -> jax.Array:
            return _score_modded(mods, scores, indices, parameters)

        if with_vjp:  # jax: JAX's derivative of the score function on the tile
            scores, mod_vjp = jax.vjp(modded, scores, p.parameters)
        else:
            scores = modded(scores, p.parameters)
        shown = scores != -jnp.inf
    if mods.mask_mod is not None:
        def evaluated() -> jax.Array:
            return jnp.broadcast_to(_mask_modded(mods, indices, scores.shape), scores.shape)

        if kind is None:  # no block mask: every tile computed evaluates the mask function
            shown = _and(shown, evaluated())
        else:  # jax: a cond, so that a full tile runs no mask function (both branches are traced)
            shown = _and(shown, lax.cond(kind == PARTIAL, evaluated, lambda: jnp.ones(scores.shape, bool)))
    return scores, shown, mod_vjp


def _tile(p: _Problem, x: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
    """The tile of a mask or bias (..., Lp | 1, Sp | 1) that meets the queries from `rows` and the keys from
    `cols` on: (..., block_q | 1, block_k | 1), a broadcast axis left as it is."""
    x = x if x.shape[-2] == 1 else lax.dynamic_slice_in_dim(x, rows, p.block_q, axis=-2)
    return x if x.shape[-1] == 1 else lax.dynamic_slice_in_dim(x, cols, p.block_k, axis=-1)


def _tile_visible(p: _Problem, rows: jax.Array, cols: jax.Array, bias: jax.Array | None) -> jax.Array | None:
    """Where the tile's queries see its keys, broadcasting to (..., block_q, block_k): the mask and bias
    tiles, and the structure's rules from the positions p_i = q_offset + i and j, the padded keys j >= S
    hidden; None where nothing hides a key (no array is built then)."""
    visible, n = None, len(p.batch) + 2
    if p.mask is not None:
        visible = _tile(p, p.mask, rows, cols).astype(bool)  # nonzero: visible (jax: a cast, as strict
        # promotion forbids mask != 0)
    if bias is not None:
        visible = _and(visible, bias != -jnp.inf)
    structure = Structure(is_causal=p.is_causal, q_offset=p.q_offset, window=p.window, key_lengths=p.key_lengths)
    q_idx, j = _positions(p.block_q, p.block_k, n, rows, cols)  # (1, .., block_q, 1), (1, .., 1, block_k)
    by_position = _by_position(structure, n)  # the catalogue's rules, q_offset and key_lengths (...) of the batch
    if by_position is not None:
        visible = _and(visible, by_position(None, None, q_idx, j))
    if p.Sp > p.S:  # the padding
        visible = _and(visible, j < p.S)
    return visible


def _and(visible: jax.Array | None, rule: jax.Array) -> jax.Array:
    return rule if visible is None else visible & rule


def _backward_tiles(p: _Problem, out: jax.Array, lse: jax.Array, d_out: jax.Array, d_lse: jax.Array) -> tuple:
    """The pullback of the padded problem, (dq, dk, dv, dbias, d_sinks, d_parameters): the key tiles in turn (lax.scan),
    each its dK and dV tiles from the query tiles that may see it, which add their share to dQ (and dbias, and
    the score function's parameters'), carried along; every gradient at its input's shape, summed over the
    axes that input was broadcast along.

    jax: the tiles are transposed, keys by queries (..., block_k, block_q), and q, dO and dQ held as
    (..., E | Ev, Lp), so that every product contracts the axes XLA's CPU dot reads fastest: P^T dO and
    dS^T Q straight from (..., bk, bq) tiles ran 3.5 times slower than the others (B=1, H=8, bq=256,
    bk=512, E=64)."""
    # (..., Lp): False for the padded queries and for those that see no key
    seen = (_ranked(jnp.arange(p.Lp), lse.ndim) < p.L) & (lse != -jnp.inf)
    D = jnp.sum(d_out * out, axis=-1) - d_lse  # rowsum(dO * O) = rowsum(dP * P); lse's cotangent adds P d_lse
    D = jnp.where(seen, D, 0.0)[..., None, :]  # (..., 1, Lp): one per query, a row as the tiles are transposed
    lse = jnp.where(seen, lse, jnp.inf)[..., None, :]  # a query that sees nothing: P = exp(-inf) = 0
    d_sinks = None  # d sink = -sum_i p_i D_i, p_i = exp(sink - lse_i) the sink's share of row i
    if p.sinks is not None:
        d_sinks = _sum_to(-jnp.sum(jnp.exp(p.sinks - lse) * D, axis=-1, keepdims=True), p.sinks.shape)
    q_t = jnp.swapaxes(p.q, -1, -2) * p.scale  # (..., E, Lp), the scale folded in
    d_out_t = jnp.swapaxes(d_out, -1, -2)  # (..., Ev, Lp)

    def key_tile(carry: tuple, t: jax.Array) -> tuple:
        cols = t * p.block_k
        k = lax.dynamic_slice_in_dim(p.k, cols, p.block_k, axis=-2)  # (..., block_k, E)
        v = lax.dynamic_slice_in_dim(p.v, cols, p.block_k, axis=-2)  # (..., block_k, Ev)
        k_t = jnp.swapaxes(k, -1, -2)  # (..., E, block_k)

        def query_tile(n: jax.Array, carry: tuple) -> tuple:
            dk, dv, dq_t, dbias, d_parameters = carry
            r, kind = at(n)
            rows = r * p.block_q
            q = lax.dynamic_slice_in_dim(q_t, rows, p.block_q, axis=-1)  # (..., E, block_q)
            raw = _product("...se,...el->...sl", k, q)  # R^T = K (Q * scale)^T: (..., bk, E) x (..., E, bq)
            scores, visible, tanh, mod_vjp = _scores(p, raw, rows, cols, kind, transposed=True,
                                                     with_vjp=True)  # (..., block_k, block_q)
            # 1) the weights again, from the log-sum-exp: P = exp(S - lse), 0 where hidden
            weights = jnp.exp(scores - lax.dynamic_slice_in_dim(lse, rows, p.block_q, axis=-1))  # (..., bk, bq)
            d_o = lax.dynamic_slice_in_dim(d_out_t, rows, p.block_q, axis=-1)  # (..., Ev, block_q)
            # 2) through the value product and the softmax
            dv = dv + _sum_to(_product("...sl,...vl->...sv", weights, d_o), dv.shape)  # P^T dO: (..., bk, Ev)
            d_weights = _product("...sv,...vl->...sl", v, d_o)  # (dO V^T)^T: (..., bk, Ev) x (..., Ev, bq)
            d_scores = weights * (d_weights - lax.dynamic_slice_in_dim(D, rows, p.block_q, axis=-1))  # dS^T
            if dbias is not None:
                dbias = _add_tile(p, dbias, jnp.swapaxes(d_scores, -1, -2), rows, cols)
            # 3) through the score function (JAX's derivative of it), the soft-capping, then the raw scores
            # R = (Q * scale) K^T
            if mod_vjp is not None:
                d_scores, d_tile_parameters = mod_vjp(d_scores)
                d_scores = jnp.where(visible, d_scores, 0.0)  # a hidden entry's derivative never leaks (0 * inf)
                d_parameters = jax.tree_util.tree_map(jnp.add, d_parameters, d_tile_parameters)
            if tanh is not None:
                d_scores = d_scores * (1 - tanh**2)
            d_q = _product("...sl,...es->...el", d_scores, k_t) * p.scale  # (dS K)^T: (..., E, block_q)
            d_q = _sum_to(d_q, (*dq_t.shape[:-1], p.block_q))
            dq_t = lax.dynamic_update_slice_in_dim(dq_t, lax.dynamic_slice_in_dim(dq_t, rows, p.block_q, -1) + d_q,
                                                   rows, axis=-1)
            dk = dk + _sum_to(_product("...sl,...el->...se", d_scores, q), dk.shape)  # dS^T Q, q holds the scale
            return dk, dv, dq_t, dbias, d_parameters

        dk = jnp.zeros((*p.k.shape[:-2], p.block_k, p.k.shape[-1]), p.work)  # (..., block_k, E)
        dv = jnp.zeros((*p.v.shape[:-2], p.block_k, p.v.shape[-1]), p.work)  # (..., block_k, Ev)
        start, stop, at = _across(p, 1, cols, *_query_tiles(p, cols))  # the query tiles, read by query_tile
        dk, dv, *carry = lax.fori_loop(start, stop, query_tile, (dk, dv, *carry))
        return tuple(carry), (dk, dv)

    nk = p.Sp // p.block_k
    dbias = None if p.bias is None else jnp.zeros_like(p.bias)
    d_parameters = jax.tree_util.tree_map(jnp.zeros_like, p.parameters)  # the score function's, summed
    (dq_t, dbias, d_parameters), (dks, dvs) = lax.scan(
        key_tile, (jnp.zeros_like(jnp.swapaxes(p.q, -1, -2)), dbias, d_parameters), jnp.arange(nk))
    dk = jnp.moveaxis(dks, 0, -3).reshape(p.k.shape)  # (nk, ..., bk, E) -> (..., Sp, E)
    dv = jnp.moveaxis(dvs, 0, -3).reshape(p.v.shape)  # (nk, ..., bk, Ev) -> (..., Sp, Ev)
    return jnp.swapaxes(dq_t, -1, -2), dk, dv, dbias, d_sinks, d_parameters


def _add_tile(p: _Problem, dbias: jax.Array, d_scores: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
    """dbias (..., Lp | 1, Sp | 1) with the tile's dS added where the tile reads the bias (_tile)."""
    tile = _tile(p, dbias, rows, cols)
    start = [0] * (dbias.ndim - 2) + [rows if dbias.shape[-2] != 1 else 0, cols if dbias.shape[-1] != 1 else 0]
    return lax.dynamic_update_slice(dbias, tile + _sum_to(d_scores, tile.shape), start)


def _product(subscripts: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """A tile's matrix product as jnp.einsum, l and s a tile's queries and keys, e and v the widths E and Ev
    (jax: einsum contracts the axes it names, where swapaxes(x) @ y copies a transposed tile first,
    measured 30% of the backward pass at B=1, H=8, L=S=4096, E=64)."""
    return jnp.einsum(subscripts, x, y)
