"""Packed (variable-length) attention in JAX: a batch of sequences of different lengths laid end to end along
one axis, no padding, each sequence attending to itself alone (flash-attn's flash_attn_varlen_func).

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.
Packed inputs: Tq and Tk query and key positions (every sequence's, end to end), Hkv key/value heads, N sequences.

Sequence n holds queries cu_seqlens_q[n] <= i < cu_seqlens_q[n + 1] and keys cu_seqlens_k[n] <= j <
cu_seqlens_k[n + 1]. Packed attention is attention over the whole packed axis with a mask that shows each query
the keys of its own sequence: the catalogue's entry mods.varlen(cu_seqlens_q, cu_seqlens_k, is_causal, window),
which also aligns causality and the window bottom-right inside each sequence (its last query at its last key).
So this file only lays the packed inputs out as one batch element, (Tq, H, E) -> (1, H, Tq, E), and hands the
mask function to scaled dot-product attention (the untiled path) or, as a block mask, to tiled attention, whose
tiles that lie across two sequences are EMPTY and never computed. jax.vjp differentiates it.

The JAX specifics: the untiled path takes the boundaries as data, so one compiled program serves every partition
of a fixed Tq and Tk (jax.jit with max_seqlen_q and max_seqlen_k static); their values are checked where they are
concrete, not under a trace. The tiled path builds its block mask from the boundaries' values before tracing,
so they must be concrete there (the tiles skipped are the program's shape).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from attention_np.common import mods, validation

from .arrays import to_numpy
from .flash import flash_attention
from .flex import create_block_mask
from .functional import _dtypes, scaled_dot_product_attention


def varlen_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_size: int | None = None,
) -> jax.Array:
    """out_i = sum_j softmax_j(s_ij) v_j over the keys j of query i's own sequence that is_causal and window leave
    visible, s_ij = softcap(q_i . k_j * scale), each sequence aligned bottom-right: its last query sits at its
    last key (j <= i + cu_seqlens_k[n + 1] - cu_seqlens_q[n + 1] with is_causal).

    Args:
        q: packed queries (Tq, H, E).
        k: packed keys (Tk, Hkv, E); Hkv = H unless enable_gqa.
        v: packed values (Tk, Hkv, Ev).
        cu_seqlens_q: integer (N + 1,), the sequences' boundaries along Tq: 0, then each sequence's end;
            never decreasing (a sequence may be empty), at most Tq (queries past the end get zeros).
        cu_seqlens_k: integer (N + 1,), the same sequences' boundaries along Tk.
        max_seqlen_q: an upper bound on the sequences' query lengths (checked).
        max_seqlen_k: an upper bound on their key lengths (checked).
        is_causal: hide keys after the query's position within its sequence (bottom-right aligned).
        window: (left, right), ints or None: hide keys outside p - left <= j <= p + right, p the query's
            position within its sequence (bottom-right aligned).
        softcap: a positive number: scores become softcap * tanh(score / softcap).
        scale: multiplies q . k; defaults to 1 / sqrt(E).
        enable_gqa: grouped-query attention: query head h uses key/value head h // (H // Hkv).
        block_size: None: one product over the packed axes (scaled dot-product attention); an int: tiled
            attention in tiles of block_size x block_size, a tile that lies across two sequences skipped.

    Returns:
        out (Tq, H, Ev) in q's dtype; a query that sees no key (an empty key sequence, a query past the last
        boundary, a window that leaves nothing) gets zeros.
    """
    mask_mod = _mask_mod(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, window,
                         enable_gqa, block_size)
    q, k, v = (_batched(x) for x in (q, k, v))  # (T, H, E) -> (1, H, T, E)
    options = {"softcap": softcap, "scale": scale, "enable_gqa": enable_gqa}
    if block_size is None:
        out, _ = scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, need_weights=False, **options)
    else:
        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], BLOCK_SIZE=block_size)
        out, _ = flash_attention(q, k, v, block_mask=block_mask, **options)
    return _packed(out)


def varlen_attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_size: int | None = None,
) -> tuple[jax.Array, Callable]:
    """The vjp of varlen_attention (jax.vjp of it): a key of another sequence has weight 0 for the query, so no
    gradient crosses from one sequence to another.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k: as for varlen_attention, and each keyword as there.

    Returns:
        out (Tq, H, Ev) and pullback(d_out (Tq, H, Ev)) -> (dq (Tq, H, E), dk (Tk, Hkv, E), dv (Tk, Hkv, Ev)).
    """
    def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k, is_causal=is_causal, window=window, softcap=softcap,
                                scale=scale, enable_gqa=enable_gqa, block_size=block_size)

    out, pull = jax.vjp(attention, q, k, v)  # jax: autodiff of the forward

    def pullback(d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        return pull(d_out)

    return out, pullback


def _mask_mod(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array,
              max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, window: object, enable_gqa: bool,
              block_size: object) -> mods.MaskMod:
    """The inputs checked, and the catalogue's mask function of the packed sequences (traced boundaries as they
    are: jax, their values are checked where concrete)."""
    bounds = {"cu_seqlens_q": _bounds(cu_seqlens_q), "cu_seqlens_k": _bounds(cu_seqlens_k)}
    validation.varlen_inputs(q.shape, k.shape, v.shape, {name: b.shape for name, b in bounds.items()}, enable_gqa,
                             block_size)
    for (name, b), total, longest in zip(bounds.items(), (q.shape[0], k.shape[0]), (max_seqlen_q, max_seqlen_k),
                                         strict=True):
        if not isinstance(b, jax.core.Tracer):
            validation.varlen_bounds(name, to_numpy(b), total, longest)
        elif block_size is not None:
            raise ValueError(f"varlen_attention: the tiled path (block_size={block_size}) skips tiles by the "
                             f"boundaries' values, so {name} must be concrete, not traced: pass it as a static "
                             "argument of jax.jit, or block_size=None")
    return mods.varlen(bounds["cu_seqlens_q"], bounds["cu_seqlens_k"], is_causal=is_causal,
                       window=validation.window(window))


def _bounds(cu_seqlens: jax.Array) -> jax.Array | np.ndarray:
    """A boundary array as given: a JAX array (traced under jit, or concrete), or NumPy's for anything else (a NumPy
    array, a list), which stays concrete under jit (jax: jnp.asarray there makes a tracer, which the tiled path
    cannot read)."""
    return cu_seqlens if isinstance(cu_seqlens, jax.Array) else np.asarray(cu_seqlens)


def _batched(x: jax.Array) -> jax.Array:
    """(T, H, E) -> (1, H, T, E): the packed axis as one batch element's sequence axis."""
    return jnp.swapaxes(x, 0, 1)[None]


def _packed(x: jax.Array) -> jax.Array:
    """(1, H, T, E) -> (T, H, E)."""
    return jnp.swapaxes(x[0], 0, 1)
