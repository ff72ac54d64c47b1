"""Packed (variable-length) attention in NumPy: a batch of sequences of different lengths laid end to end along
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
tiles that lie across two sequences are EMPTY and never computed. The gradients are theirs, taken back to the
packed layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from attention_np.common import mods, validation

from .arrays import to_numpy
from .flash import flash_attention, flash_attention_vjp
from .flex import create_block_mask
from .functional import scaled_dot_product_attention
from .gradients import scaled_dot_product_attention_vjp


def varlen_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_size: int | None = None,
) -> np.ndarray:
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
    q, k, v, keywords = _batched_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         is_causal, window, softcap, scale, enable_gqa, block_size)
    if block_size is None:
        out, _ = scaled_dot_product_attention(q, k, v, need_weights=False, **keywords)
    else:
        out, _ = flash_attention(q, k, v, **keywords)
    return _packed(out)


def varlen_attention_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_size: int | None = None,
) -> tuple[np.ndarray, Callable]:
    """The vjp of varlen_attention: the pullback of scaled dot-product attention (block_size None) or tiled
    attention (block_size an int) over the packed axes, its gradients laid back out as the packed inputs. A key
    of another sequence has weight 0 for the query, so no gradient crosses from one sequence to another.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as for varlen_attention.
        is_causal, window, softcap, scale, enable_gqa, block_size: as for varlen_attention.

    Returns:
        out (Tq, H, Ev) and pullback(d_out (Tq, H, Ev)) -> (dq (Tq, H, E), dk (Tk, Hkv, E), dv (Tk, Hkv, Ev)).
    """
    q, k, v, keywords = _batched_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         is_causal, window, softcap, scale, enable_gqa, block_size)
    if block_size is None:
        out, _, batched_pullback = scaled_dot_product_attention_vjp(q, k, v, **keywords)
    else:
        out, _, batched_pullback = flash_attention_vjp(q, k, v, **keywords)

    def pullback(d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        validation.cotangent("d_out", np.shape(d_out), _packed(out).shape, {})
        dq, dk, dv = batched_pullback(_batched(d_out))[:3]  # dbias: None, there is no bias
        return _packed(dq), _packed(dk), _packed(dv)

    return _packed(out), pullback


def _batched_problem(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens_q: np.ndarray,
                     cu_seqlens_k: np.ndarray, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, window: object,
                     softcap: float | None, scale: float | None, enable_gqa: bool,
                     block_size: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    """What both passes hand to scaled dot-product attention or tiled attention: q, k, v checked, zeroed past the
    last boundary and laid out as one batch element (1, H, T, E), and the keywords: the mask function of the packed
    sequences (block_size None) or its block mask (tiles of block_size), softcap, scale and enable_gqa."""
    mask_mod = _mask_mod(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, window,
                         enable_gqa, block_size)
    q, k, v = _padding_zeroed(q, cu_seqlens_q), _padding_zeroed(k, cu_seqlens_k), _padding_zeroed(v, cu_seqlens_k)
    q, k, v = (_batched(x) for x in (q, k, v))  # (T, H, E) -> (1, H, T, E)
    keywords: dict[str, Any] = {"softcap": softcap, "scale": scale, "enable_gqa": enable_gqa}
    if block_size is None:
        return q, k, v, {**keywords, "mask_mod": mask_mod}
    block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], BLOCK_SIZE=block_size)
    return q, k, v, {**keywords, "block_mask": block_mask}


def _mask_mod(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray,
              max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, window: object, enable_gqa: bool,
              block_size: object) -> mods.MaskMod:
    """The inputs checked, and the catalogue's mask function of the packed sequences."""
    bounds = {"cu_seqlens_q": to_numpy(cu_seqlens_q), "cu_seqlens_k": to_numpy(cu_seqlens_k)}
    validation.varlen_inputs(q.shape, k.shape, v.shape, {name: b.shape for name, b in bounds.items()}, enable_gqa,
                             block_size)
    validation.varlen_bounds("cu_seqlens_q", bounds["cu_seqlens_q"], q.shape[0], max_seqlen_q)
    validation.varlen_bounds("cu_seqlens_k", bounds["cu_seqlens_k"], k.shape[0], max_seqlen_k)
    return mods.varlen(bounds["cu_seqlens_q"], bounds["cu_seqlens_k"], is_causal=is_causal,
                       window=validation.window(window))


def _padding_zeroed(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """x (T, heads, width) with the rows past the last boundary zeroed: they belong to no sequence, and the product
    of the weights with the values would carry a NaN or inf there (times a weight of 0) into every row (torch's
    kernel route would also take another path for a NaN among q or k)."""
    return np.where((np.arange(len(x)) < to_numpy(bounds)[-1])[:, None, None], x, 0)


def _batched(x: np.ndarray) -> np.ndarray:
    """(T, H, E) -> (1, H, T, E): the packed axis as one batch element's sequence axis."""
    return np.swapaxes(np.asarray(x), 0, 1)[None]


def _packed(x: np.ndarray) -> np.ndarray:
    """(1, H, T, E) -> (T, H, E)."""
    return np.swapaxes(x[0], 0, 1)
