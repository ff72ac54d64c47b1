"""Score and mask functions ("mods"), written once for NumPy, JAX and torch: the catalogue of attention variants
and the ways to combine them (torch's FlexAttention interface).

A mask function `mask_mod(b, h, q_idx, kv_idx)` says which keys a query may see: True where query q_idx of batch
element b and head h sees key kv_idx. A score function `score_mod(score, b, h, q_idx, kv_idx)` returns the score
the softmax uses in place of `score` = (q . k) * scale. Both receive the backend's own integer arrays, which
broadcast against each other and against `score` (a tile of the kernels gets b (B, 1, 1, 1), h (1, H, 1, 1),
q_idx (1, 1, block_q, 1), kv_idx (1, 1, 1, block_k); torch's own flex_attention calls them with scalars under
vmap; JAX's create_block_mask passes NumPy's, which jax.numpy takes), so an entry written with operators and the
namespace `array_namespace(q_idx)` (array-api-compat's: NumPy, JAX and torch alike) runs unchanged in every
backend. A user may write a mod with their own framework's functions for their backend just as well.

Each entry is a maker: `causal(q_offset=0)` returns a MaskMod, `alibi(slopes)` a ScoreMod. The formulas, i the
query's index, j the key's, b and h the batch element and the head:

    causal(q_offset)               j <= i + q_offset
    sliding_window(l, r, q_offset) i + q_offset - l <= j <= i + q_offset + r        (a side None: unbounded)
    key_lengths(n)                 j < n[b]  (n a number, (B,), or (B, H): n[b, h])
    document(qs, ks)               qs[b, i] == ks[b, j]        (segment ids (L,) or (B, L); ks defaults to qs)
    varlen(cq, ck, causal, window) i and j in one packed sequence n, cq[n] <= i < cq[n + 1], ck[n] <= j < ck[n + 1];
                                   causal: j <= i + ck[n + 1] - cq[n + 1]  (bottom-right; window likewise)
    prefix_lm(n)                   j <= i  or  j < n[b]         (n a number or (B,))
    chunked(size)                  j <= i  and  i // size == j // size
    dilated(window, dilation)      0 <= i - j < window * dilation  and  (i - j) % dilation == 0
    alibi(slopes)                  score + slopes[h] * (j - i)
    softcap(cap)                   cap * tanh(score / cap)
    relative_bias(table)           score + table[h, clip(j - i, -R, R) + R],   table (H, 2R + 1)

A ScoreMod also carries its vjp, the hand-derived derivative that attention_np's backward pass uses: the
gradient with respect to the score, and to its own parameters (`parameters`: ALiBi's slopes, the relative-bias
table), so that they can be learned; `replace` gives the same mod with other parameter values, which is how JAX
and torch differentiate them. The vjps are NumPy, since only the NumPy backend derives its gradients by hand.

Imports NumPy and array-api-compat alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
from array_api_compat import array_namespace, device, to_device

from .records import Structure

Vjp = Callable[..., tuple[np.ndarray, dict[str, np.ndarray]]]


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, so a mod can be a static argument under jit
class MaskMod:
    """A mask function of the catalogue: mod(b, h, q_idx, kv_idx) -> True where the query sees the key."""

    text: str  # how it was made, e.g. "causal(q_offset=0)"
    rule: Callable[..., Any]  # (b, h, q_idx, kv_idx) -> bool array broadcasting with the indices

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.rule(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return self.text


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """A score function of the catalogue: mod(score, b, h, q_idx, kv_idx) -> the score the softmax uses, with
    its learnable parameters apart (`parameters`) and its hand-derived vjp."""

    text: str  # how it was made, e.g. "softcap(cap=30.0)"
    rule: Callable[..., Any]  # (score, b, h, q_idx, kv_idx, **parameters) -> the new score
    derivative: Vjp  # (d_new, score, b, h, q_idx, kv_idx, **parameters) -> (d_score, {name: d_parameter}), NumPy
    parameters: Mapping[str, Any] = field(default_factory=dict)  # the arrays a gradient can reach, by name

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.rule(score, b, h, q_idx, kv_idx, **self.parameters)

    def vjp(self, d_new: np.ndarray, score: np.ndarray, b: np.ndarray, h: np.ndarray, q_idx: np.ndarray,
            kv_idx: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The gradient of a loss with respect to the score and to each parameter, given d_new, its gradient
        with respect to the new score (a NumPy tile of the score's shape); the parameters' gradients have their
        shapes (summed over the tile: add a tile's to the next's)."""
        return self.derivative(d_new, score, b, h, q_idx, kv_idx, **self.parameters)

    def replace(self, **parameters: Any) -> ScoreMod:
        """The same score function with other values of (some of) its parameters."""
        return replace(self, parameters={**self.parameters, **parameters})

    def __repr__(self) -> str:
        return self.text


# --- combining mask functions (torch.nn.attention.flex_attention's names) ----------------------------------

def noop_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Every key visible: True everywhere (broadcasting as q_idx and kv_idx do)."""
    return (q_idx == q_idx) & (kv_idx == kv_idx)


def and_masks(*mask_mods: Callable[..., Any]) -> MaskMod:
    """A key is visible where every one of `mask_mods` shows it (every key, with none)."""
    def rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        visible = noop_mask(b, h, q_idx, kv_idx)
        for mod in mask_mods:
            visible = visible & mod(b, h, q_idx, kv_idx)
        return visible
    return MaskMod(f"and_masks({', '.join(map(_name, mask_mods))})", rule)


def or_masks(*mask_mods: Callable[..., Any]) -> MaskMod:
    """A key is visible where some one of `mask_mods` shows it (none, with none)."""
    def rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        visible = ~noop_mask(b, h, q_idx, kv_idx)
        for mod in mask_mods:
            visible = visible | mod(b, h, q_idx, kv_idx)
        return visible
    return MaskMod(f"or_masks({', '.join(map(_name, mask_mods))})", rule)


def _name(mod: Callable[..., Any]) -> str:
    return repr(mod) if isinstance(mod, MaskMod | ScoreMod) else getattr(mod, "__name__", repr(mod))


# --- the keywords as catalogue entries ----------------------------------------------------------------------

class Aligned(NamedTuple):
    """A per-sequence value laid out against the scores' leading axes already, (..., 1, 1) for scores (..., L, S),
    as a backend holds a keyword's q_offset or key_lengths for arbitrary leading axes: an entry reads it as it
    is, where it would index a (B,) or (B, H) array by b and h."""

    array: Any


def from_keywords(structure: Structure, softcap_: float | None = None) -> tuple[MaskMod | None, ScoreMod | None]:
    """The position keywords (SPEC 2a) as the catalogue's entries, composed: the mask function
    and_masks(causal(q_offset), sliding_window(left, right, q_offset), key_lengths(lengths)) of those that are
    given (None where none is: no key hidden by position), and the score function softcap(cap) (None without a
    cap). Every backend's masks by position and the float64 oracle's are this one function evaluated; q_offset
    and key_lengths are numbers, or Aligned arrays of the caller's layout."""
    rules = [causal(structure.q_offset)] if structure.is_causal else []
    if structure.window is not None:
        rules.append(sliding_window(*structure.window, q_offset=structure.q_offset))
    if structure.key_lengths is not None:
        rules.append(key_lengths(structure.key_lengths))
    mask_mod = None if not rules else rules[0] if len(rules) == 1 else and_masks(*rules)
    return mask_mod, None if softcap_ is None else softcap(softcap_)


def within_tile(structure: Structure, first: int, last: int, cols: slice, shortest: int | None) -> Structure:
    """The position keywords of `structure` that hide some key of a tile, the others left out, so that a tiled
    kernel evaluates only those: its queries' positions run from `first` to `last` and its keys are `cols`;
    `shortest` is key_lengths' least value (None: no key_lengths). is_causal stays where some key follows some
    query, a side of the window where it cuts into the tile, key_lengths where some key is at or past the
    shortest length."""
    left, right = structure.window or (None, None)
    left = left if left is not None and cols.start < last - left else None
    right = right if right is not None and cols.stop - 1 > first + right else None
    return structure._replace(is_causal=structure.is_causal and cols.stop - 1 > first,
                              window=None if left is None and right is None else (left, right),
                              key_lengths=structure.key_lengths if shortest is not None and cols.stop > shortest
                              else None)


# --- the catalogue: mask functions -------------------------------------------------------------------------

def causal(q_offset: Any = 0) -> MaskMod:
    """j <= i + q_offset: a query sees itself and the keys before it (q_offset: the position of query 0,
    a number, or per sequence (B,) or per head (B, H))."""
    def rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx + _per_sequence(q_offset, b, h, kv_idx)
    return MaskMod(f"causal(q_offset={_text(q_offset)})", rule)


def sliding_window(left: int | None, right: int | None, q_offset: Any = 0) -> MaskMod:
    """p - left <= j <= p + right, p = i + q_offset: the keys within `left` before and `right` after the
    query's position; a side that is None is unbounded (sliding_window(w, 0): causal, the last w + 1 keys)."""
    def rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        position = q_idx + _per_sequence(q_offset, b, h, kv_idx)
        visible = noop_mask(b, h, q_idx, kv_idx)
        if left is not None:
            visible = visible & (kv_idx >= position - left)
        if right is not None:
            visible = visible & (kv_idx <= position + right)
        return visible
    return MaskMod(f"sliding_window(left={left}, right={right}, q_offset={_text(q_offset)})", rule)


def key_lengths(lengths: Any) -> MaskMod:
    """j < lengths[b] (or lengths[b, h]): each sequence's padding keys hidden; lengths a number, (B,) or (B, H)."""
    def rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < _per_sequence(lengths, b, h, kv_idx)
    return MaskMod(f"key_lengths({_text(lengths)})", rule)


def document(q_segments: Any, kv_segments: Any = None) -> MaskMod:
    """q_segments[b, i] == kv_segments[b, j]: packed sequences, each query sees the keys of its own document.
    The segment ids are (L,) and (S,), or (B, L) and (B, S) per batch element; kv_segments defaults to
    q_segments (self-attention)."""
    kv = q_segments if kv_segments is None else kv_segments

    def rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return _along(q_segments, b, q_idx) == _along(kv, b, kv_idx)
    text = _text(q_segments) if kv_segments is None else f"{_text(q_segments)}, {_text(kv_segments)}"
    return MaskMod(f"document({text})", rule)


def varlen(cu_seqlens_q: Any, cu_seqlens_k: Any = None, *, is_causal: bool = False,
           window: tuple[int | None, int | None] | None = None) -> MaskMod:
    """Packed sequences by their boundaries (flash-attn's cu_seqlens): query i of sequence n,
    cu_seqlens_q[n] <= i < cu_seqlens_q[n + 1], sees key j of the same sequence, cu_seqlens_k[n] <= j <
    cu_seqlens_k[n + 1]; with is_causal j <= p, with window (left, right) p - left <= j <= p + right, where
    p = i + cu_seqlens_k[n + 1] - cu_seqlens_q[n + 1]: each sequence's last query sits at its last key
    (bottom-right, flash-attn's alignment where a sequence has fewer queries than keys). A query or key past
    the last boundary belongs to no sequence and is seen by none. cu_seqlens_k defaults to cu_seqlens_q."""
    kv_bounds = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    left, right = window or (None, None)

    def rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_bounds, k_bounds = _indices_like(cu_seqlens_q, q_idx), _indices_like(kv_bounds, kv_idx)
        n, m = _sequence(q_bounds, q_idx), _sequence(k_bounds, kv_idx)  # N: past the last boundary
        visible = (n == m) & (n < q_bounds.shape[0] - 1)
        if not is_causal and window is None:
            return visible
        last = array_namespace(n).clip(n + 1, 0, q_bounds.shape[0] - 1)  # n + 1 <= N where n is a sequence
        position = q_idx + _like(k_bounds[last], q_idx) - q_bounds[last]  # i on the keys' axis, bottom-right
        if is_causal:
            visible = visible & (kv_idx <= position)
        if left is not None:
            visible = visible & (kv_idx >= position - left)
        if right is not None:
            visible = visible & (kv_idx <= position + right)
        return visible
    causal_text = ", is_causal=True" if is_causal else ""
    window_text = f", window={window}" if window is not None else ""
    kv_text = "" if cu_seqlens_k is None else f", {_text(cu_seqlens_k)}"
    return MaskMod(f"varlen({_text(cu_seqlens_q)}{kv_text}{causal_text}{window_text})", rule)


def prefix_lm(prefix_lengths: Any) -> MaskMod:
    """j <= i or j < prefix_lengths[b]: the prefix is seen by every query (bidirectional), the rest causally;
    prefix_lengths a number or (B,)."""
    def rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) | (kv_idx < _per_sequence(prefix_lengths, b, h, kv_idx))
    return MaskMod(f"prefix_lm({_text(prefix_lengths)})", rule)


def chunked(size: int) -> MaskMod:
    """j <= i and i // size == j // size: causal attention within chunks of `size` positions (Llama 4's local
    layers; splash attention's ChunkedCausalMask)."""
    def rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (q_idx // size == kv_idx // size)
    return MaskMod(f"chunked({size})", rule)


def dilated(window: int, dilation: int) -> MaskMod:
    """0 <= i - j < window * dilation and (i - j) % dilation == 0: `window` keys, every dilation-th one back
    from the query itself (a causal dilated window)."""
    def rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        distance = q_idx - kv_idx
        return (distance >= 0) & (distance < window * dilation) & (distance % dilation == 0)
    return MaskMod(f"dilated(window={window}, dilation={dilation})", rule)


# --- the catalogue: score functions ------------------------------------------------------------------------

def alibi(slopes: Any) -> ScoreMod:
    """score + slopes[h] * (j - i): ALiBi's linear bias per head (slopes (H,), positive: earlier keys weigh
    less); the slopes are a parameter."""
    def rule(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, *, slopes: Any) -> Any:
        distance = array_namespace(score).astype(_like(kv_idx - q_idx, score), score.dtype)  # int * float32
        return score + _like(slopes, score)[h] * distance  # would be float64 in NumPy, an error in strict JAX

    def derivative(d_new: np.ndarray, score: np.ndarray, b: np.ndarray, h: np.ndarray, q_idx: np.ndarray,
                   kv_idx: np.ndarray, *, slopes: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        # d score = d_new; d slopes[n] = sum of d_new * (j - i) over the entries of head n
        d_slopes = _scatter(d_new * (kv_idx - q_idx), (h,), np.shape(slopes))
        return d_new, {"slopes": d_slopes}

    return ScoreMod(f"alibi({_text(slopes)})", rule, derivative=derivative, parameters={"slopes": slopes})


def softcap(cap: float) -> ScoreMod:
    """cap * tanh(score / cap): scores squashed into (-cap, cap) (Gemma 2, Grok), cap > 0."""
    def rule(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * array_namespace(score).tanh(score / cap)

    def derivative(d_new: np.ndarray, score: np.ndarray, b: np.ndarray, h: np.ndarray, q_idx: np.ndarray,
                   kv_idx: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return d_new * (1 - np.tanh(score / cap) ** 2), {}  # d/dx cap tanh(x / cap) = 1 - tanh^2(x / cap)

    return ScoreMod(f"softcap({cap})", rule, derivative=derivative)


def relative_bias(table: Any) -> ScoreMod:
    """score + table[h, clip(j - i, -R, R) + R]: a learned bias per head and relative position, the distances
    beyond R sharing the last entry (table (H, 2R + 1)); the table is a parameter."""
    def index(q_idx: Any, kv_idx: Any, reach: int) -> Any:
        return array_namespace(kv_idx).clip(kv_idx - q_idx, -reach, reach) + reach

    def rule(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, *, table: Any) -> Any:
        table = _like(table, score)
        return score + table[h, index(q_idx, kv_idx, table.shape[-1] // 2)]

    def derivative(d_new: np.ndarray, score: np.ndarray, b: np.ndarray, h: np.ndarray, q_idx: np.ndarray,
                   kv_idx: np.ndarray, *, table: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        # d score = d_new; d table[n, r] = sum of d_new over the entries of head n at clipped distance r
        shape = np.shape(table)
        return d_new, {"table": _scatter(d_new, (h, index(q_idx, kv_idx, shape[-1] // 2)), shape)}

    return ScoreMod(f"relative_bias({_text(table)})", rule, derivative=derivative, parameters={"table": table})


# --- helpers -----------------------------------------------------------------------------------------------

def _like(x: Any, reference: Any) -> Any:
    """x as an array of `reference`'s namespace and device (in its dtype when x is floating, so that a float64
    parameter does not promote a float32 score)."""
    xp = array_namespace(reference)
    if not isinstance(x, type(reference)):  # a number, a NumPy parameter: converted (type(), not array_namespace(x),
        x = xp.asarray(x, device=device(reference))  # which torch's compiler cannot trace on a NumPy array)
    elif device(x) != device(reference):  # the framework's own array, kept in its autograd graph
        x = to_device(x, device(reference))
    floating = xp.isdtype(x.dtype, "real floating") and xp.isdtype(reference.dtype, "real floating")
    return xp.astype(x, reference.dtype) if floating and x.dtype != reference.dtype else x


def _indices_like(x: Any, idx: Any) -> Any:
    """Integer boundaries as `idx`'s: its namespace, device and integer dtype (flash-attn's int32 boundaries beside
    int64 indices would otherwise mix dtypes, which JAX's strict promotion refuses)."""
    xp = array_namespace(idx)
    x = _like(x, idx)
    return xp.astype(x, idx.dtype) if x.dtype != idx.dtype else x


def _per_sequence(x: Any, b: Any, h: Any, reference: Any) -> Any:
    """A number, or an array (B,) indexed by b, or (B, H) indexed by b and h, in reference's namespace; an
    Aligned array as it is."""
    if isinstance(x, int | np.integer):
        return x
    if isinstance(x, Aligned):  # the caller's own array, in the namespace and on the device of its scores
        return x.array
    x = _like(x, reference)
    return x if x.ndim == 0 else x[b] if x.ndim == 1 else x[b, h]


def _along(x: Any, b: Any, idx: Any) -> Any:
    """x[idx] of ids (N,), or x[b, idx] of ids (B, N), in idx's namespace."""
    x = _like(x, idx)
    return x[idx] if x.ndim == 1 else x[b, idx]


def _sequence(bounds: Any, idx: Any) -> Any:
    """The sequence each index lies in, given the boundaries (N + 1,) of N packed sequences: how many
    sequences end at or before it (a zero-length sequence ends where it starts), N past the last boundary."""
    xp = array_namespace(idx)
    ends = xp.reshape(bounds[1:], (1,) * idx.ndim + (-1,))  # (1, ..., 1, N): ranks spelled out (JAX's strict rank
    # promotion refuses (N,) against idx's axes)
    return xp.sum(xp.astype(ends <= idx[..., None], idx.dtype), axis=-1)


def _scatter(values: np.ndarray, index: tuple[np.ndarray, ...], shape: tuple[int, ...]) -> np.ndarray:
    """out[index[0][e], index[1][e], ...] += values[e] over every entry e of values (the index arrays
    broadcast to values' shape): the gradient of a table read at `index`."""
    out = np.zeros(shape, dtype=values.dtype)
    np.add.at(out, tuple(np.broadcast_to(i, values.shape) for i in index), values)
    return out


def _text(x: Any) -> str:
    """A parameter as a mod's text shows it: a number as itself, an array by its values when short."""
    if isinstance(x, Aligned):  # its values are not read: they may be traced (jax.jit, torch.compile)
        return "<aligned array>"
    if isinstance(x, int | float | np.integer | np.floating):
        return repr(x)
    if isinstance(x, np.ndarray | list | tuple) and np.size(x) <= 8:
        return str(np.asarray(x).tolist())
    return f"<{'x'.join(map(str, np.shape(x) if isinstance(x, list | tuple) else x.shape))} array>"
