"""A third-party implementation of the attention contract (SPEC.md section 1): NumPy, einsum throughout.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, K = d_k = D / H, ... leading batch axes.

Written apart from attention_np, attention_jax, attention_torch and the conformance oracle, in another
formulation: every contraction is an einsum, and the projection weights are viewed with the heads as an
explicit axis, W (D, D) -> (H, K, D), so no activation is ever reshaped or transposed into heads.

Each step is one small method of `Implementation`, so that tests/implementations/broken.py can inject a
bug by overriding a single named piece; `as_module(impl, name)` builds a module object exposing exactly
the contract's names, bound to `impl`. Importing this file gives the correct implementation at module
level: `python -m conformance check tests.implementations.einsum_attention`.
"""

from __future__ import annotations

import math
import os
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from attention_np.common import validation
from attention_np.common.block_mask import EMPTY, FULL, PARTIAL, BlockMask

Rng = np.random.Generator | int | None
Pair = tuple[np.ndarray, np.ndarray | None]

FUNCTIONS = ("asarray", "to_numpy", "save_state_dict", "load_state_dict", "causal_mask", "window_mask",
             "padding_mask", "scaled_dot_product_attention", "apply_rope", "flex_attention", "flex_attention_vjp",
             "create_block_mask")
CONTRACT = (*FUNCTIONS, "MultiHeadAttention", "TransformerBlock")
PROJECTIONS = ("w_q", "w_k", "w_v", "w_o")
ACTIVATIONS = ("relu", "gelu", "swiglu")
NORMS = ("layer", "rms")
SWIGLU = ("w_gate", "w_up", "w_down")
ATTENTIONS = ("softmax", "linear")  # MultiHeadAttention's attention in each head
LINEAR_EPS = 1e-6  # linear heads: added to each query's normaliser


class Implementation:
    """The contract, one overridable step per method; the public functions are the unprefixed ones."""

    # --- arrays and files --------------------------------------------------------------------------------

    def asarray(self, x: Any) -> np.ndarray:
        """NumPy array -> native array (here NumPy itself), same dtype."""
        return np.asarray(x)

    def to_numpy(self, x: Any) -> np.ndarray:
        """Native array -> NumPy array."""
        return np.asarray(x)

    def save_state_dict(self, path: str | os.PathLike, state: Mapping[str, Any]) -> None:
        """{name: array} -> uncompressed .npz at exactly `path` (np.savez would append .npz to a name)."""
        with open(path, "wb") as file:
            np.savez(file, **{name: np.asarray(value) for name, value in state.items()})

    def load_state_dict(self, path: str | os.PathLike) -> dict[str, np.ndarray]:
        """.npz file -> {name: array}, without pickle."""
        with np.load(path, allow_pickle=False) as arrays:
            return {name: arrays[name] for name in arrays.files}

    # --- masks -------------------------------------------------------------------------------------------

    def causal_mask(self, L: int, S: int, *, q_offset: Any = 0) -> np.ndarray:
        """bool (..., L, S), True where key j <= q_offset + i; (...) is q_offset's shape."""
        self.check_positions("q_offset", q_offset, np.shape(q_offset))
        return self.causal(L, S, np.asarray(q_offset))

    def window_mask(self, L: int, S: int, window: Any, *, q_offset: Any = 0) -> np.ndarray:
        """bool (..., L, S), True where p_i - left <= j <= p_i + right, p_i = q_offset + i."""
        self.check_window(window)
        self.check_positions("q_offset", q_offset, np.shape(q_offset))
        return self.in_window(L, S, window, np.asarray(q_offset))

    def padding_mask(self, lengths: Any, S: int) -> np.ndarray:
        """bool (B, 1, 1, S) from lengths (B,): True for the first lengths[b] keys."""
        return np.arange(S) < np.asarray(lengths)[:, None, None, None]  # (B,) -> (B, 1, 1, S)

    # --- rotary position embeddings -----------------------------------------------------------------------

    def apply_rope(self, x: Any, positions: Any, *, theta: float = 10000.0, interleaved: bool = False) -> np.ndarray:
        """Each pair of x turned by a 2 x 2 rotation R(p * theta^(-2j / E)), applied by einsum."""
        x, positions = np.asarray(x), np.asarray(positions)
        E = x.shape[-1]
        if x.ndim < 2 or E % 2:
            raise ValueError(f"apply_rope needs x (..., L, E) with E even; got {x.shape}")
        if not np.issubdtype(positions.dtype, np.integer):
            raise TypeError(f"positions must be integers; got dtype {positions.dtype}")
        self.check_broadcast("positions", positions.shape, x.shape[:-1], "..., L")
        if not theta > 0:
            raise ValueError(f"theta must be positive; got {theta!r}")
        work = self.work_dtype(x.dtype)
        rotation = self.rope_rotation(positions, E, theta, x.dtype)  # (..., L, E/2, 2, 2)
        pairs = self.rope_pairs(x.astype(work), interleaved)  # (..., L, E/2, 2)
        turned = np.einsum("...jab,...jb->...ja", rotation, pairs)  # (..., L, E/2, 2)
        return self.rope_unpairs(turned, interleaved).astype(x.dtype)

    def rope_rotation(self, positions: np.ndarray, E: int, theta: float, dtype: np.dtype) -> np.ndarray:
        """R(p * theta^(-2j / E)) for each position and pair: (..., L) -> (..., L, E/2, 2, 2), in float64 (at least
        the float32 that SPEC 2b asks for x of any dtype)."""
        angles = positions[..., None] * theta ** (-np.arange(0, E, 2) / E)  # (..., L, E/2)
        return np.stack([np.stack([np.cos(angles), -np.sin(angles)], -1),
                         np.stack([np.sin(angles), np.cos(angles)], -1)], -2)  # (..., L, E/2, 2, 2)

    def rope_pairs(self, x: np.ndarray, interleaved: bool) -> np.ndarray:
        """(..., E) -> (..., E/2, 2): the pairs (x_2j, x_2j+1) interleaved, else (x_j, x_j+E/2)."""
        E = x.shape[-1]
        return x.reshape(*x.shape[:-1], E // 2, 2) if interleaved else np.stack([x[..., : E // 2], x[..., E // 2:]], -1)

    def rope_unpairs(self, pairs: np.ndarray, interleaved: bool) -> np.ndarray:
        """The inverse of rope_pairs: (..., E/2, 2) -> (..., E)."""
        if interleaved:
            return pairs.reshape(*pairs.shape[:-2], -1)
        return np.concatenate([pairs[..., 0], pairs[..., 1]], -1)

    def positions(self, L: int, q_offset: Any) -> np.ndarray:
        """p_i = q_offset + i: (..., L, 1), (...) the shape of q_offset."""
        offset = np.asarray(q_offset)
        return offset[..., None, None] + np.arange(L)[:, None]  # (..., 1, 1) + (L, 1) -> (..., L, 1)

    def causal(self, L: int, S: int, q_offset: Any = 0) -> np.ndarray:
        """(..., L, S): key j <= p_i."""
        return np.arange(S) <= self.positions(L, q_offset)  # (S,) vs (..., L, 1) -> (..., L, S)

    def in_window(self, L: int, S: int, window: tuple, q_offset: Any = 0) -> np.ndarray:
        """(..., L, S): p_i - left <= j <= p_i + right, a None side unbounded."""
        left, right = window
        p, j = self.positions(L, q_offset), np.arange(S)  # (..., L, 1), (S,)
        after_left = True if left is None else j >= p - left
        before_right = True if right is None else j <= p + right
        return np.broadcast_to(after_left & before_right, (*p.shape[:-1], S))

    def in_lengths(self, S: int, key_lengths: Any) -> np.ndarray:
        """(..., 1, S): key j < key_lengths of its sequence."""
        return np.arange(S) < np.asarray(key_lengths)[..., None, None]

    # --- scaled dot-product attention --------------------------------------------------------------------

    def scaled_dot_product_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                                     mask: np.ndarray | None = None, *, bias: np.ndarray | None = None,
                                     is_causal: bool = False, scale: float | None = None, q_offset: Any = 0,
                                     window: Any = None, key_lengths: Any = None, softcap: float | None = None,
                                     enable_gqa: bool = False, mask_mod: Callable | None = None,
                                     score_mod: Callable | None = None, dropout_p: float = 0.0,
                                     need_weights: bool = True, rng: Rng = None) -> Pair:
        """Attention(Q, K, V) = softmax(score_mod(cap(Q K^T * scale)) + bias) V, the softmax over the visible keys,
        cap(x) = softcap tanh(x / softcap).

        Args:
            q (..., L, E), k (..., S, E), v (..., S, Ev): leading axes broadcast.
            mask: broadcasts to (..., L, S); 0 / False hides key j from query i.
            bias: added to the scores, broadcasts to (..., L, S); -inf hides.
            is_causal: hide keys j > p_i = q_offset + i. scale: defaults to 1 / sqrt(E).
            q_offset: int or integers broadcasting to (...): query i's position is q_offset + i.
            window: (left, right), ints >= 0 or None: keys p_i - left..p_i + right visible.
            key_lengths: integers broadcasting to (...): keys j < key_lengths visible.
            softcap: a positive float capping the raw scores before the bias, or None.
            enable_gqa: q (..., H, L, E) against k, v (..., Hkv, S, *): query head h reads head h // (H / Hkv).
            mask_mod: (b, h, q_idx, kv_idx) -> True where the query sees the key, on the whole grid (B, H, L, S);
                q, k, v of four axes. score_mod: (score, b, h, q_idx, kv_idx) -> the score, after cap, before bias.
            dropout_p: inverted dropout on the weights. rng: Generator, int seed or None (fresh).

        Returns:
            out (..., L, Ev) and weights (..., L, S) before dropout (None unless need_weights).
        """
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        mods = None if mask_mod is None and score_mod is None else \
            self.mods("scaled_dot_product_attention", q, k, v, mask_mod)
        self.check_probability("dropout_p", dropout_p)
        scores, visible, v, dtype = self.prepared(q, k, v, mask, bias, is_causal, scale, q_offset, window,
                                                  key_lengths, softcap, enable_gqa, score_mod, mods)
        weights = self.softmax(scores, visible)  # (..., L, S)

        # 3) the weighted sum of the values
        out, weights = self.attend(weights, v, dropout_p, rng)  # (..., L, Ev), (..., L, S)
        if v.dtype != dtype:  # half precision: the outputs cast back
            out, weights = out.astype(dtype), weights.astype(dtype)
        return out, (weights if need_weights else None)

    def prepared(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                 bias: np.ndarray | None, is_causal: bool, scale: float | None, q_offset: Any, window: Any,
                 key_lengths: Any, softcap: float | None, enable_gqa: bool, score_mod: Callable | None,
                 mods: _Mods | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.dtype]:
        """The arguments checked; the scores the softmax takes and the keys each query sees, (..., L, S) each, v in
        the dtype attention computes in, and the inputs' dtype."""
        if enable_gqa:  # each query head gets its key/value head, indexed out
            k, v = self.per_query_head(q, k, v)
        batch = self.check_attention(q, k, v)
        self.check_dtypes("", q=q, k=k, v=v)
        (L, E), S = q.shape[-2:], k.shape[-2]
        for name, extra in (("mask", mask), ("bias", bias)):
            if extra is not None:
                self.check_broadcast(name, np.shape(extra), (*batch, L, S), "..., L, S")
        if mask is not None:
            self.check_mask_values(np.asarray(mask))
        self.check_window(window)
        self.check_softcap(softcap)
        self.check_positions("q_offset", q_offset, batch)
        if key_lengths is not None:
            self.check_positions("key_lengths", key_lengths, batch)

        # 1) scores, capped, then biased, in at least float32
        if scale is None and E == 0:
            raise ValueError(f"the default scale 1 / sqrt(E) needs E > 0; q {q.shape} and k {k.shape} have E = 0: "
                             "pass scale= explicitly")
        dtype, work = q.dtype, self.work_dtype(q.dtype)
        q, k, v = (x.astype(work, copy=False) for x in (q, k, v))  # float16: computed in float32
        shown: np.ndarray | bool = True  # the keys the mods leave visible
        if mods is None:
            scores = self.scores(q, k, self.resolve_scale(scale, E), bias, softcap)  # (..., L, S)
        else:  # the mods on the whole grid (B, H, L, S)
            scores, shown = self.modded_scores(q, k, self.resolve_scale(scale, E), bias, softcap, score_mod, mods)

        # 2) one boolean of the keys each query sees, then the softmax over them, one per batch element (v and
        # the masks may carry batch axes that q and k lack)
        scores = np.broadcast_to(scores, (*batch, L, S))  # (..., L, S)
        visible = self.visible(scores, mask, bias, is_causal, q_offset)  # (..., L, S)
        visible = visible & self.in_range(L, S, q_offset, window, key_lengths) & shown  # (..., L, S)
        return scores, visible, v, dtype

    def per_query_head(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """enable_gqa: k, v (..., Hkv, S, *) -> (..., H, S, *), head h of them key/value head kv_heads[h]."""
        self.check_groups(q, k, v)
        heads = self.kv_heads(q.shape[-3], k.shape[-3])  # (H,)
        return np.take(k, heads, axis=-3), np.take(v, heads, axis=-3)

    def kv_heads(self, H: int, Hkv: int) -> np.ndarray:
        """The key/value head of each query head: h // G, G = H / Hkv consecutive query heads per group."""
        return np.arange(H) // (H // Hkv)

    def cache_end(self, length: int, new: int) -> int:
        """The end of the positions an extend fills: length + new."""
        return length + new

    def check_cache(self, name: str, x: np.ndarray, held: np.ndarray) -> None:
        """extend's input `name` against the cache's inputs (..., capacity, D): the batch shape, the width and the
        dtype it was made for."""
        if x.shape[:-2] != held.shape[:-2]:
            raise ValueError(f"{name} has shape {x.shape}; the cache holds the batch shape {held.shape[:-2]}")
        self.check_cache_width(name, x, held)
        self.check_dtypes("", **{name: x, "cache": held})

    def check_cache_width(self, name: str, x: np.ndarray, held: np.ndarray) -> None:
        """x (..., L, D) of the cache's width D."""
        if x.shape[-1] != held.shape[-1]:
            raise ValueError(f"{name} has shape {x.shape}; the cache holds inputs of width D = {held.shape[-1]}")

    def cache_mask(self, mask: Any, start: int, end: int, capacity: int) -> np.ndarray | bool:
        """What extend's mask (broadcasting to (..., H, L, capacity)) leaves visible to the new positions
        start .. end - 1 of the keys 0 .. end - 1: (..., [H,] L, end), or True without a mask."""
        if mask is None:
            return True
        shown = np.asarray(mask) != 0
        try:
            shown = np.broadcast_to(shown, np.broadcast_shapes(shown.shape, (end - start, capacity)))  # (..., L, C)
        except ValueError:
            raise ValueError(f"mask has shape {shown.shape}; extend's mask broadcasts to (..., H, {end - start}, "
                             f"{capacity}), (..., H, L, capacity)") from None
        return shown[..., :end]

    def cached_inputs(self, x_q: np.ndarray, x_kv: np.ndarray) -> np.ndarray:
        """MultiHeadAttention.extend: the inputs whose keys and values the cache keeps, x_kv's."""
        return x_kv

    def advanced(self, start: int, end: int) -> int:
        """The length of the cache after an extend of positions start .. end - 1."""
        return end

    def new_positions(self, start: int, end: int) -> np.ndarray:
        """The positions of an extend's new rows, where RoPE turns them: start .. end - 1."""
        return np.arange(start, end)

    def work_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype attention computes in: float32 for float16 (SPEC section 2), else the inputs' own."""
        return np.promote_types(dtype, np.float32)

    def resolve_scale(self, scale: float | None, E: int) -> float:
        return self.default_scale(E) if scale is None else scale

    def default_scale(self, E: int) -> float:
        return 1.0 / math.sqrt(E)

    def scores(self, q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None,
               softcap: float | None) -> np.ndarray:
        """s_ls = cap(scale * sum_e q_le k_se) + bias_ls."""
        scores = np.einsum("...le,...se->...ls", q, k) * scale  # (..., L, E) x (..., S, E) -> (..., L, S)
        return self.add_bias(self.cap(scores, softcap), bias)

    def modded_scores(self, q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None,
                      softcap: float | None, score_mod: Callable | None,
                      mods: _Mods) -> tuple[np.ndarray, np.ndarray]:
        """r = score_mod(cap(scale * sum_e q_le k_se), b, h, q_idx, kv_idx) on the whole grid; returns r + bias and
        the keys the mods leave visible: shown by the mask function, r not -inf (a -inf from the score function
        hides the key, as in flex_attention); (B, H, L, S) each."""
        raw = np.einsum("...le,...se->...ls", q, k) * scale  # (B, H, L, E) x (B, H, S, E) -> (B, H, L, S)
        capped = np.broadcast_to(self.cap(raw, softcap), mods.shape)  # a batch of 1 broadcast
        modded = self.modded(score_mod, capped, mods.grid)
        return self.add_bias(modded, bias), mods.shown & (modded != -np.inf)

    def mods(self, function: str, q: np.ndarray, k: np.ndarray, v: np.ndarray,
             mask_mod: Callable | None) -> _Mods:
        """The index arrays of the scores (B, H, L, S) the mods see, q, k, v of four axes (validation.mods_inputs):
        b over the batch, h over q's heads, q_idx over 0..L-1, kv_idx over 0..S-1; and the keys mask_mod shows."""
        B, H = validation.mods_inputs(function, q.shape, k.shape, v.shape)
        shape = (B, H, q.shape[-2], k.shape[-2])
        grid = self.index_grid(*shape)
        shown = np.ones(shape, bool) if mask_mod is None else self.grid_mask(mask_mod, grid)
        return _Mods(grid=grid, shape=shape, shown=shown)

    def cap(self, raw: np.ndarray, softcap: float | None) -> np.ndarray:
        """softcap * tanh(raw / softcap), in raw's dtype; raw itself without a softcap."""
        return raw if softcap is None else (softcap * np.tanh(raw / softcap)).astype(raw.dtype)

    def add_bias(self, scores: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """The bias in the dtype of the scores (a float64 bias must not promote float32 scores)."""
        return scores if bias is None else scores + np.asarray(bias, dtype=scores.dtype)

    def visible(self, scores: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
                is_causal: bool, q_offset: Any = 0) -> np.ndarray:
        """True where a query may see a key: kept by the mask, causal when asked, bias not -inf. A -inf
        score that comes from infinite q or k hides nothing (SPEC section 2): its row becomes NaN."""
        visible = np.ones(scores.shape, dtype=bool)
        if bias is not None:
            visible = visible & (np.asarray(bias) != -np.inf)  # a NaN bias stays visible, so NaN propagates
        if mask is not None:
            visible = visible & self.mask_visible(mask)
        if is_causal:
            visible = visible & self.causal(*scores.shape[-2:], q_offset)
        return visible

    def in_range(self, L: int, S: int, q_offset: Any, window: Any, key_lengths: Any) -> np.ndarray | bool:
        """The window and the key lengths: True where both let query i see key j; (..., L, S) or True."""
        visible: np.ndarray | bool = True
        if window is not None:
            visible = visible & self.in_window(L, S, tuple(window), q_offset)
        if key_lengths is not None:
            visible = visible & self.in_lengths(S, key_lengths)
        return visible

    def mask_visible(self, mask: np.ndarray) -> np.ndarray:
        return np.asarray(mask) != 0  # bool and 0/1 masks alike: 0 hides

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        """w_ls = exp(s_ls - m_l) / sum_s' exp(s_ls' - m_l) over visible s, m_l the visible row maximum.

        A row with no visible key is all zeros (the spec's rule), never 0 / 0.
        """
        seen = np.any(visible, axis=-1, keepdims=True)  # (..., L, 1)
        kept = np.where(visible, scores, -np.inf)  # hidden keys contribute exp(-inf) = 0
        row_max = np.where(seen, np.max(kept, axis=-1, keepdims=True, initial=-np.inf), 0)  # (..., L, 1)
        exp = np.exp(kept - row_max)  # (..., L, S)
        total = np.einsum("...ls->...l", exp)[..., None]  # (..., L, 1)
        return np.where(visible, exp / np.where(seen, total, 1), 0)  # empty row: 0 / 1; NaN stays visible

    def attend(self, weights: np.ndarray, v: np.ndarray, dropout_p: float, rng: Rng) -> Pair:
        """out_lv = sum_s dropout(w)_ls v_sv; returns the weights from before the dropout."""
        dropped = self.dropout(weights, dropout_p, rng)
        out = np.einsum("...ls,...sv->...lv", dropped, v)  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
        return out, weights

    # --- programmable attention: mods on the whole grid of scores -------------------------------------------
    # The mask and score functions are evaluated once on the whole (B, H, L, S) grid of index arrays, never by
    # tiles: the block mask's tiles are found from that grid too (a BlockMask record of attention_np, filled here,
    # not by attention_np.common.block_mask.create). The argument checks are attention_np.common.validation's, so
    # that a bad call raises what the spec requires.

    def create_block_mask(self, mask_mod: Callable[..., Any], B: int | None, H: int | None, Q_LEN: int,
                          KV_LEN: int, BLOCK_SIZE: int | tuple[int, int] = 128) -> BlockMask:
        """The tiles of mask_mod over (B, H, Q_LEN, KV_LEN), read off the whole grid of its values."""
        B, H, (block_q, block_k) = validation.block_mask_args(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE)
        visible = self.grid_mask(mask_mod, self.index_grid(B, H, Q_LEN, KV_LEN))  # (B, H, L, S)
        return BlockMask(mask_mod=mask_mod, shape=(B, H, Q_LEN, KV_LEN), block_size=(block_q, block_k),
                         tiles=self.tile_kinds(visible, block_q, block_k))

    def index_grid(self, B: int, H: int, L: int, S: int) -> tuple[np.ndarray, ...]:
        """b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, L, 1), kv_idx (1, 1, 1, S)."""
        return tuple(np.arange(n).reshape([n if axis == place else 1 for axis in range(4)])
                     for place, n in enumerate((B, H, L, S)))

    def grid_mask(self, mask_mod: Callable[..., Any], grid: tuple[np.ndarray, ...]) -> np.ndarray:
        """mask_mod(b, h, q_idx, kv_idx) on the grid, checked to be booleans that broadcast to it; (B, H, L, S)."""
        b, h, i, j = grid
        target = (b.shape[0], h.shape[1], i.shape[2], j.shape[3])
        visible = np.asarray(mask_mod(b, h, i, j))
        validation.mask_mod_result("mask_mod", visible.shape, str(visible.dtype), target)
        return np.broadcast_to(visible, target)

    def tile_kinds(self, visible: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
        """(B, H, L, S) -> (B, H, rows, columns) kinds: FULL where every entry of a tile is visible, EMPTY where
        none is, else PARTIAL."""
        B, H, L, S = visible.shape
        rows, columns = -(-L // block_q), -(-S // block_k)
        tiles = np.empty((B, H, rows, columns), np.uint8)
        for row, column in np.ndindex(rows, columns):
            tile = visible[:, :, row * block_q:(row + 1) * block_q, column * block_k:(column + 1) * block_k]
            every, some = np.all(tile, axis=(2, 3)), np.any(tile, axis=(2, 3))  # (B, H)
            tiles[:, :, row, column] = np.where(every, FULL, np.where(some, PARTIAL, EMPTY))
        return tiles

    def flex_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, score_mod: Callable | None = None,
                       block_mask: BlockMask | None = None, scale: float | None = None, enable_gqa: bool = False,
                       return_lse: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """out = softmax(score_mod(Q K^T * scale)) V over the keys the block mask's mask_mod shows (and whose
        score is not -inf); lse the log-sum-exp over them (-inf, and zeros in out, where a query sees none)."""
        forward = self.flex_forward(q, k, v, score_mod, block_mask, scale, enable_gqa)
        out = forward.out.astype(q.dtype)
        return (out, forward.lse) if return_lse else out

    def flex_attention_vjp(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, score_mod: Callable | None = None,
                           block_mask: BlockMask | None = None, scale: float | None = None,
                           enable_gqa: bool = False) -> tuple[np.ndarray, np.ndarray, Callable]:
        """out, lse and pullback(d_out) -> (dq, dk, dv, {score_mod's parameter: gradient})."""
        forward = self.flex_forward(q, k, v, score_mod, block_mask, scale, enable_gqa)
        out = forward.out.astype(q.dtype)

        def pullback(d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
            d_out = np.asarray(d_out)
            validation.cotangent("d_out", d_out.shape, out.shape, {name: (str(x.dtype), True) for name, x in
                                                                   (("d_out", d_out), ("out", out))})
            return self.flex_backward(forward, q, k, v, score_mod, d_out.astype(forward.out.dtype))

        return out, forward.lse, pullback

    def flex_forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, score_mod: Callable | None,
                     block_mask: BlockMask | None, scale: float | None, enable_gqa: bool) -> _FlexForward:
        """The whole grid: scores, the score function's, the visible keys, weights, out and lse, in at least
        float32."""
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        B, H = self.flex_shapes(q, k, v, enable_gqa)
        (L, E), S = q.shape[-2:], k.shape[-2]
        if block_mask is not None:
            validation.block_mask_fits(block_mask, B, H, L, S)
        self.check_dtypes("", q=q, k=k, v=v)
        work = self.work_dtype(q.dtype)
        heads = self.kv_heads(H, k.shape[1])  # (H,): each query head's key/value head
        k_h, v_h = (np.take(x, heads, axis=1).astype(work) for x in (k, v))  # (B, H, S, E), (B, H, S, Ev)
        scale = self.resolve_scale(scale, E)
        grid = self.index_grid(B, H, L, S)
        raw, scores = self.flex_scores(q.astype(work), k_h, scale, score_mod, grid)  # (B, H, L, S) each
        visible = self.flex_visible(block_mask, grid, raw.shape) & (scores != -np.inf)  # (B, H, L, S)
        scores, visible = self.hidden_scores(scores, visible, raw, score_mod, grid)
        weights, lse = self.flex_softmax(scores, visible)  # (B, H, L, S), (B, H, L)
        out = np.einsum("bhls,bhsv->bhlv", weights, v_h)  # (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)
        return _FlexForward(out=out, lse=lse, raw=raw, weights=weights, visible=visible, grid=grid, k_h=k_h,
                            v_h=v_h, scale=scale, heads=heads)

    def flex_shapes(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, enable_gqa: bool) -> tuple[int, int]:
        """(B, H) of q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), by validation.flex_inputs. That check
        reads the heads' axis as a broadcast one, which refuses Hkv between 1 and H, so with grouped heads the
        groups are checked first (validation.grouped_heads) and flex_inputs sees k and v with H heads."""
        if not (enable_gqa and q.ndim == k.ndim == v.ndim == 4):
            return validation.flex_inputs(q.shape, k.shape, v.shape, enable_gqa)
        validation.grouped_heads(q.shape, k.shape, v.shape)
        H = q.shape[1]
        return validation.flex_inputs(q.shape, (k.shape[0], H, *k.shape[2:]), (v.shape[0], H, *v.shape[2:]), False)

    def flex_scores(self, q: np.ndarray, k_h: np.ndarray, scale: float, score_mod: Callable | None,
                    grid: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        """s = Q K^T * scale and r = score_mod(s, b, h, q_idx, kv_idx), (B, H, L, S) each."""
        raw = np.einsum("bhle,bhse->bhls", q, k_h) * q.dtype.type(scale)  # (B, H, L, E) x (B, H, S, E)
        return raw, self.modded(score_mod, raw, grid)

    def hidden_scores(self, scores: np.ndarray, visible: np.ndarray, raw: np.ndarray, score_mod: Callable | None,
                      grid: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The scores and the visible keys the softmax takes: as they are (the score function saw every score,
        the mask then hides keys whatever the score function made of them)."""
        return scores, visible

    def modded(self, score_mod: Callable | None, raw: np.ndarray, grid: tuple[np.ndarray, ...]) -> np.ndarray:
        """score_mod(s, b, h, q_idx, kv_idx) on the whole grid of scaled scores s, checked to keep their shape."""
        if score_mod is None:
            return raw
        scores = np.asarray(score_mod(raw, *grid))
        validation.score_mod_result(scores.shape, raw.shape)
        return np.broadcast_to(scores, raw.shape).astype(raw.dtype)

    def flex_visible(self, block_mask: BlockMask | None, grid: tuple[np.ndarray, ...],
                     shape: tuple[int, ...]) -> np.ndarray:
        """The keys the block mask's mask_mod shows, (B, H, L, S); every key without one. A block mask made for B
        or H of 1 is the same for every batch element or head (b or h 0)."""
        if block_mask is None:
            return np.ones(shape, bool)
        b, h, i, j = grid
        b, h = (x if n > 1 else np.zeros_like(x) for x, n in ((b, block_mask.shape[0]), (h, block_mask.shape[1])))
        return np.broadcast_to(self.grid_mask(block_mask.mask_mod, (b, h, i, j)), shape)

    def flex_softmax(self, scores: np.ndarray, visible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """weights = exp(r - m) / sum exp(r - m) over the visible keys, lse = m + log sum exp(r - m), m the
        visible row maximum; a row with no visible key: zeros and lse -inf."""
        seen = np.any(visible, axis=-1)  # (B, H, L)
        kept = np.where(visible, scores, -np.inf)
        row_max = np.where(seen, np.max(kept, axis=-1, initial=-np.inf), 0)  # (B, H, L)
        exp = np.where(visible, np.exp(kept - row_max[..., None]), 0)  # (B, H, L, S)
        total = np.einsum("bhls->bhl", exp)  # (B, H, L)
        weights = exp / np.where(seen, total, 1)[..., None]
        return weights, np.where(seen, row_max + np.log(np.where(seen, total, 1)), -np.inf)

    def flex_backward(self, forward: _FlexForward, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                      score_mod: Callable | None, d_out: np.ndarray) -> tuple[np.ndarray, ...]:
        """dV = P^T dO, dP = dO V^T, dR = P (dP - D) with D = rowsum(dO O), (dS, dtheta) through score_mod's vjp,
        dQ = dS K scale, dK = dS^T Q scale; a key/value head's gradients summed over its query heads."""
        P, work = forward.weights, forward.out.dtype
        dv_h = np.einsum("bhls,bhlv->bhsv", P, d_out)  # (B, H, S, Ev)
        dP = np.einsum("bhlv,bhsv->bhls", d_out, forward.v_h)  # (B, H, L, S)
        D = np.einsum("bhlv,bhlv->bhl", d_out, forward.out)[..., None]  # (B, H, L, 1)
        dR = np.where(forward.visible, P * (dP - D), 0)  # hidden entries: 0, whatever the derivative is there
        dS, d_params = self.score_vjp(score_mod, dR, forward)
        dS = np.where(forward.visible, dS, 0)
        dq = np.einsum("bhls,bhse->bhle", dS, forward.k_h) * work.type(forward.scale)  # (B, H, L, E)
        dk_h = np.einsum("bhls,bhle->bhse", dS, q.astype(work)) * work.type(forward.scale)  # (B, H, S, E)
        dk, dv = (self.summed_over_groups(d, k.shape[1]) for d in (dk_h, dv_h))  # (B, Hkv, S, *)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_params

    def score_vjp(self, score_mod: Callable | None, dR: np.ndarray,
                  forward: _FlexForward) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(dS, {parameter: gradient}) through the score function's own vjp (a ScoreMod's)."""
        if score_mod is None:
            return dR, {}
        if not hasattr(score_mod, "vjp"):
            raise ValueError("score_mod has no vjp: flex_attention_vjp needs a derivative of the score function "
                             "(a ScoreMod of the catalogue carries one)")
        dS, d_params = score_mod.vjp(dR, forward.raw, *forward.grid)
        parameters = getattr(score_mod, "parameters", {})
        return dS, {name: np.asarray(grad).astype(np.asarray(parameters[name]).dtype)
                    for name, grad in d_params.items()}

    def summed_over_groups(self, d: np.ndarray, Hkv: int) -> np.ndarray:
        """(B, H, S, *) per query head -> (B, Hkv, S, *): each key/value head the sum over its G query heads."""
        B, H = d.shape[:2]
        return np.sum(d.reshape(B, Hkv, H // Hkv, *d.shape[2:]), axis=2)

    # --- randomness --------------------------------------------------------------------------------------

    def generator(self, rng: Rng) -> np.random.Generator:
        """A Generator passes through (its state advances); an int seeds one; None is fresh."""
        return np.random.default_rng(rng)

    def dropout(self, x: np.ndarray, p: float, rng: Rng) -> np.ndarray:
        """Inverted dropout: zero with probability p, scale the kept entries by 1 / (1 - p)."""
        if p == 0.0:
            return x
        keep = self.generator(rng).random(x.shape) >= p
        return np.where(keep, x / (1 - p), 0).astype(x.dtype)

    def active_dropout(self, p: float, training: bool) -> float:
        return p if training else 0.0

    # --- multi-head attention ----------------------------------------------------------------------------

    def multi_head_attention(self, state: Mapping[str, np.ndarray], q: np.ndarray, k: np.ndarray,
                             v: np.ndarray, mask: np.ndarray | None, *, num_heads: int, dropout_p: float,
                             need_weights: bool, rng: Rng, rope_theta: float | None = None,
                             positions: tuple[np.ndarray, np.ndarray] | None = None,
                             attention: str = "softmax") -> Pair:
        """MultiHead(Q, K, V) = Concat_h(Attention(Q W_q,h^T + b_q,h, ...)) W_o^T + b_o, heads as an axis;
        with rope_theta, each head's queries and keys turned at `positions` ((L,), (S,); None: 0.. each);
        attention "linear": linear heads (no mask, no dropout, no weights).

        Returns out (..., L, D) and weights (..., H, L, S) (None for linear heads).
        """
        d_model = state["w_q.weight"].shape[1]
        d_k = d_model // num_heads
        num_kv_heads = state["w_k.weight"].shape[0] // d_k

        # 1) project straight into heads: H query heads, Hkv key/value heads, each copied to its query heads
        def projected(x: np.ndarray, name: str, heads: int) -> np.ndarray:
            return self.project(x, state[f"{name}.weight"], state.get(f"{name}.bias"), heads)

        shared = self.shared_kv_head(num_heads, num_kv_heads)  # (H,): the key/value head of each query head
        q = projected(q, "w_q", num_heads)  # (..., L, D) -> (..., H, L, K)
        k = np.take(projected(k, "w_k", num_kv_heads), shared, axis=-3)  # (..., S, D) -> (..., H, S, K)
        v = np.take(projected(v, "w_v", num_kv_heads), shared, axis=-3)  # (..., S, D) -> (..., H, S, K)
        if rope_theta is not None:
            q, k = self.rope_heads(q, k, rope_theta, positions)

        # 2) attend, every head at once
        if attention == "linear":
            heads, weights = self.linear_heads(q, k, v), None  # (..., H, L, K)
        else:
            heads, weights = self.scaled_dot_product_attention(
                q, k, v, mask, scale=self.head_scale(d_k, d_model), dropout_p=dropout_p,
                need_weights=need_weights, rng=rng)  # (..., H, L, K), (..., H, L, S)

        # 3) mix the heads back into D
        out = self.merge_heads(heads, state["w_o.weight"], state.get("w_o.bias"))  # (..., H, L, K) -> (..., L, D)
        return out, (None if weights is None else self.head_weights(weights))

    def linear_heads(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Linear attention per head, keys summed first: out_hl = phi(q_hl) M_h / (phi(q_hl) . n_h + eps), with
        M_h = sum_s phi(k_hs) v_hs^T (K x K) and n_h = sum_s phi(k_hs); computed in at least float32."""
        work = self.work_dtype(q.dtype)
        phi_q, phi_k = self.linear_features(q.astype(work)), self.linear_features(k.astype(work))
        memory = np.einsum("...hsk,...hsv->...hkv", phi_k, v.astype(work))  # (..., H, S, K) x 2 -> (..., H, K, K)
        norms = np.einsum("...hsk->...hk", phi_k)  # (..., H, S, K) -> (..., H, K)
        num = np.einsum("...hlk,...hkv->...hlv", phi_q, memory)  # (..., H, L, K) x (..., H, K, K) -> (..., H, L, K)
        den = np.einsum("...hlk,...hk->...hl", phi_q, norms) + LINEAR_EPS  # (..., H, L, K) x (..., H, K) -> (..., H, L)
        return (num / den[..., None]).astype(q.dtype)

    def linear_features(self, x: np.ndarray) -> np.ndarray:
        """phi(x) = elu(x) + 1: x + 1 above 0, exp(x) at or below it, so every feature is positive."""
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))

    def rope_heads(self, q: np.ndarray, k: np.ndarray, theta: float,
                   positions: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
        """q (..., H, L, K) and k (..., H, S, K) turned at their positions ((L,), (S,); None: 0.. each)."""
        q_at, k_at = (np.arange(q.shape[-2]), np.arange(k.shape[-2])) if positions is None else positions
        return self.apply_rope(q, q_at, theta=theta), self.apply_rope(k, k_at, theta=theta)

    def shared_kv_head(self, H: int, Hkv: int) -> np.ndarray:
        """Grouped-query attention: query head h reads key/value head h // (H / Hkv)."""
        return np.arange(H) * Hkv // H

    def split_heads(self, w: np.ndarray, num_heads: int) -> np.ndarray:
        """View the first axis, D, as (H, K): head h owns the contiguous rows h*K:(h+1)*K."""
        return w.reshape(num_heads, w.shape[0] // num_heads, *w.shape[1:])  # (D, ...) -> (H, K, ...)

    def project(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, num_heads: int) -> np.ndarray:
        """x W^T + b with W (H K, D) viewed as (H, K, D): y_hlk = sum_d x_ld W_hkd + b_hk (no b without bias)."""
        y = np.einsum("...ld,hkd->...hlk", x, self.split_heads(weight, num_heads))  # (..., L, D) -> (..., H, L, K)
        return y if bias is None else y + self.split_heads(bias, num_heads)[:, None, :]  # + (H, 1, K)

    def merge_heads(self, heads: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """Concat(heads) W_o^T + b_o, W_o^T (D, D) viewed as (H, K, D): y_lo = sum_hk x_hlk W_hko + b_o."""
        w = self.split_heads(weight.T, heads.shape[-3])  # (D_in, D_out) -> (H, K, D)
        y = np.einsum("...hlk,hko->...lo", heads, w)  # (..., H, L, K) -> (..., L, D)
        return y if bias is None else y + bias

    def head_scale(self, d_k: int, d_model: int) -> float:
        return 1.0 / math.sqrt(d_k)

    def head_weights(self, weights: np.ndarray) -> np.ndarray:
        return weights  # per head, (..., H, L, S)

    # --- the transformer block ---------------------------------------------------------------------------

    def transformer_block(self, state: Mapping[str, np.ndarray], x: np.ndarray, mask: np.ndarray | None, *,
                          num_heads: int, norm_first: bool, activation: str, eps: float, dropout_p: float,
                          need_weights: bool, rng: Rng, rope_theta: float | None = None,
                          positions: np.ndarray | None = None) -> Pair:
        """post-LN: x = LN_1(x + Drop(MHA(x))), x = LN_2(x + Drop(FFN(x)));
        pre-LN: x = x + Drop(MHA(LN_1(x))), x = x + Drop(FFN(LN_2(x))). One generator feeds every site."""
        weights_rng, residual_rng, activation_rng = self.site_generators(self.block_generator(rng))
        attn = {name.removeprefix("attn."): x for name, x in state.items() if name.startswith("attn.")}
        ln1, ln2 = self.norms(state, eps)

        def attend(y: np.ndarray) -> Pair:
            return self.multi_head_attention(attn, y, y, y, mask, num_heads=num_heads, dropout_p=dropout_p,
                                             need_weights=need_weights, rng=weights_rng, rope_theta=rope_theta,
                                             positions=None if positions is None else (positions, positions))

        def feed_forward(y: np.ndarray) -> np.ndarray:
            return self.feed_forward(state, y, activation, dropout_p, activation_rng)

        def drop(y: np.ndarray) -> np.ndarray:
            return self.dropout(y, dropout_p, residual_rng)

        return self.wiring(norm_first)(x, attend, feed_forward, drop, ln1, ln2)

    def block_generator(self, rng: Rng) -> Rng:
        """The block's rng as one Generator, made once, whose state every site advances in turn."""
        return self.generator(rng)

    def site_generators(self, rng: Rng) -> tuple[Rng, Rng, Rng]:
        """The rngs of the attention weights, the two residual branches and the activation: the block's one."""
        return rng, rng, rng

    def wiring(self, norm_first: bool) -> Callable[..., Pair]:
        return self.pre_ln if norm_first else self.post_ln

    def post_ln(self, x: np.ndarray, attend: Callable, feed_forward: Callable, drop: Callable,
                ln1: Callable, ln2: Callable) -> Pair:
        h, weights = attend(x)
        x = ln1(x + drop(h))
        return ln2(x + drop(feed_forward(x))), weights

    def pre_ln(self, x: np.ndarray, attend: Callable, feed_forward: Callable, drop: Callable,
               ln1: Callable, ln2: Callable) -> Pair:
        h, weights = attend(ln1(x))
        x = x + drop(h)
        return x + drop(feed_forward(ln2(x))), weights

    def norms(self, state: Mapping[str, np.ndarray], eps: float) -> tuple[Callable, Callable]:
        """LayerNorm where the state holds the norms' biases, else RMSNorm."""
        def norm(name: str) -> Callable:
            if f"{name}.bias" not in state:
                return lambda x: self.rms_norm(x, state[f"{name}.weight"], eps)
            return lambda x: self.layer_norm(x, state[f"{name}.weight"], state[f"{name}.bias"], eps)

        return norm("norm1"), norm("norm2")

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """x / sqrt(mean(x^2) + eps) * weight over D."""
        d_model, dtype = x.shape[-1], x.dtype
        x = x.astype(np.promote_types(dtype, np.float32))  # float16: the statistics in float32 (SPEC section 2)
        mean_square = np.einsum("...d,...d->...", x, x)[..., None] / d_model  # (..., 1)
        return (x / np.sqrt(mean_square + eps) * weight).astype(dtype)

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
        """(x - mean) / sqrt(var + eps) * weight + bias, var = mean((x - mean)^2) over D (biased)."""
        d_model, dtype = x.shape[-1], x.dtype
        x = x.astype(np.promote_types(dtype, np.float32))  # float16: the statistics in float32 (SPEC section 2)
        centred = x - np.einsum("...d->...", x)[..., None] / d_model  # (..., D)
        var = np.einsum("...d,...d->...", centred, centred)[..., None] / d_model  # (..., 1)
        return (centred / np.sqrt(var + eps) * weight + bias).astype(dtype)

    def feed_forward(self, state: Mapping[str, np.ndarray], x: np.ndarray, activation: str, dropout_p: float,
                     rng: Rng) -> np.ndarray:
        """FFN(x) = W_3 Drop(act(W_0 x + b_0)) + b_3; SwiGLU: W_down Drop(silu(W_gate x + b) * (W_up x + b)) + b."""
        def linear(y: np.ndarray, name: str) -> np.ndarray:
            return self.linear(y, state[f"ffn.{name}.weight"], state.get(f"ffn.{name}.bias"))

        if activation == "swiglu":
            h = self.swiglu(linear(x, "w_gate"), linear(x, "w_up"))  # (..., L, D) -> (..., L, F)
            return linear(self.dropout(h, dropout_p, rng), "w_down")  # (..., F) -> (..., D)
        h = self.activation(activation, linear(x, "0"))  # (..., L, D) -> (..., L, F)
        h = self.dropout(h, dropout_p, rng)
        return linear(h, "3")  # (..., F) -> (..., D)

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """silu(gate) * up, silu(x) = x * sigmoid(x) = x / 2 * (1 + tanh(x / 2))."""
        return gate / 2 * (1 + np.tanh(gate / 2)) * up

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """y = x W^T + b, W (out, in); no b without bias."""
        y = np.einsum("...i,oi->...o", x, weight)
        return y if bias is None else y + bias

    def activation(self, name: str, x: np.ndarray) -> np.ndarray:
        """relu(x) = max(x, 0); gelu(x) = x / 2 * (1 + erf(x / sqrt(2))), the exact form."""
        if name == "relu":
            return np.maximum(x, 0)  # NaN propagates
        erf = np.vectorize(math.erf, otypes=[x.dtype])
        return x / 2 * (1 + erf(x / math.sqrt(2)))

    # --- parameters --------------------------------------------------------------------------------------

    def init_linear(self, name: str, d_in: int, d_out: int, rng: np.random.Generator,
                    dtype: Any, bias: bool = True) -> dict[str, np.ndarray]:
        """nn.Linear's initial values: weight (out, in) and bias (out,) uniform in +-1/sqrt(in)."""
        bound = 1 / math.sqrt(d_in)
        state = {f"{name}.weight": rng.uniform(-bound, bound, (d_out, d_in)).astype(dtype)}
        return state | ({f"{name}.bias": rng.uniform(-bound, bound, d_out).astype(dtype)} if bias else {})

    def linear_shapes(self, prefix: str, rows: dict[str, tuple[int, int]], bias: bool) -> dict[str, tuple]:
        return {f"{prefix}{name}.{part}": shape if part == "weight" else shape[:1]
                for name, shape in rows.items() for part in (("weight", "bias") if bias else ("weight",))}

    def mha_shapes(self, d_model: int, num_heads: int = 1, num_kv_heads: int | None = None, bias: bool = True,
                   prefix: str = "") -> dict[str, tuple[int, ...]]:
        d_kv = d_model // num_heads * (num_kv_heads or num_heads)
        rows = {"w_q": (d_model, d_model), "w_k": (d_kv, d_model), "w_v": (d_kv, d_model), "w_o": (d_model, d_model)}
        return self.linear_shapes(prefix, rows, bias)

    def block_shapes(self, d_model: int, d_ff: int, num_heads: int = 1, num_kv_heads: int | None = None,
                     bias: bool = True, norm: str = "layer", activation: str = "relu") -> dict[str, tuple[int, ...]]:
        ffn = ({"w_gate": (d_ff, d_model), "w_up": (d_ff, d_model), "w_down": (d_model, d_ff)}
               if activation == "swiglu" else {"0": (d_ff, d_model), "3": (d_model, d_ff)})
        return (self.mha_shapes(d_model, num_heads, num_kv_heads, bias, "attn.")
                | {f"norm{i}.{part}": (d_model,) for i in (1, 2)
                   for part in (("weight", "bias") if norm == "layer" else ("weight",))}
                | self.linear_shapes("ffn.", ffn, bias))

    def kv_heads_in(self, state: Mapping[str, np.ndarray], prefix: str, d_model: int, num_heads: int) -> int:
        """Hkv from w_k's rows (Hkv * d_k), or H where the rows fit no divisor of H (check_state names them)."""
        rows, d_k = state[f"{prefix}w_k.weight"].shape[0] if f"{prefix}w_k.weight" in state else 0, d_model // num_heads
        fits = rows and rows % d_k == 0 and num_heads % (rows // d_k) == 0
        return rows // d_k if fits else num_heads

    def biased(self, state: Mapping[str, np.ndarray]) -> bool:
        """Whether the state holds any Linear bias (check_state then names those missing from a partial set)."""
        return any(name.endswith(".bias") and not name.startswith("norm") for name in state)

    # --- argument checks ---------------------------------------------------------------------------------

    def check_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, ...]:
        """q (..., L, E), k (..., S, E), v (..., S, Ev) -> the broadcast leading axes."""
        for name, x, letters in (("q", q, "L, E"), ("k", k, "S, E"), ("v", v, "S, Ev")):
            if x.ndim < 2:
                raise ValueError(f"{name} must have shape (..., {letters}); got {x.shape}")
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(f"q {q.shape} and k {k.shape} must have the same width E (last axis)")
        if k.shape[-2] != v.shape[-2]:
            raise ValueError(f"k {k.shape} and v {v.shape} must have the same length S (second to last axis)")
        try:
            return tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
        except ValueError:
            raise ValueError(f"the leading axes of q {q.shape}, k {k.shape} and v {v.shape} "
                             "do not broadcast") from None

    def check_groups(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """enable_gqa: q, k, v of rank 3 or more, k and v with one head count Hkv that divides q's H."""
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim < 3:
                raise ValueError(f"enable_gqa: {name} {x.shape} has no head axis (..., heads, positions, width)")
        H, Hkv = q.shape[-3], k.shape[-3]
        if v.shape[-3] != Hkv or Hkv == 0 or H % Hkv:
            raise ValueError(f"enable_gqa: q {q.shape} has H = {H} heads, k {k.shape} and v {v.shape} must have "
                             "one count Hkv of heads that divides it")

    def check_broadcast(self, name: str, shape: tuple[int, ...], target: tuple[int, ...],
                        letters: str) -> None:
        """`shape` must broadcast to `target` without adding axes or enlarging it."""
        try:
            fits = len(shape) <= len(target) and np.broadcast_shapes(shape, target) == tuple(target)
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"{name} of shape {tuple(shape)} does not broadcast to {tuple(target)} "
                             f"({letters})")

    def check_mask_values(self, mask: np.ndarray) -> None:
        """A floating mask holds 0 and 1 only: other values are an additive mask, which belongs in bias=."""
        if np.issubdtype(mask.dtype, np.floating) and not np.all((mask == 0) | (mask == 1)):
            raise ValueError("mask holds values other than 0 and 1; pass an additive mask as bias= instead")

    def check_dtypes(self, where: str, **arrays: np.ndarray) -> None:
        """One floating dtype for all: TypeError otherwise."""
        for name, x in arrays.items():
            if not np.issubdtype(x.dtype, np.floating):
                raise TypeError(f"{where}{name} must have a floating dtype; got {x.dtype}")
        if len({x.dtype for x in arrays.values()}) > 1:
            listed = ", ".join(f"{name} {x.dtype}" for name, x in arrays.items())
            raise TypeError(f"{where}{', '.join(arrays)} must share one dtype; got {listed}")

    def check_window(self, window: Any) -> None:
        """None, or (left, right), each a non-negative int or None."""
        def side(n: Any) -> bool:
            return n is None or (isinstance(n, int | np.integer) and not isinstance(n, bool) and n >= 0)
        if window is not None and not (isinstance(window, tuple | list) and len(window) == 2
                                       and all(side(n) for n in window)):
            raise ValueError(f"window must be (left, right), each a non-negative int or None; got {window!r}")

    def check_softcap(self, softcap: Any) -> None:
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be a positive float or None; got {softcap!r}")

    def check_positions(self, name: str, value: Any, batch: tuple[int, ...]) -> None:
        """An int, or integers that broadcast to the leading axes `batch` without adding axes."""
        dtype = np.asarray(value).dtype
        if not np.issubdtype(dtype, np.integer):
            raise TypeError(f"{name} must be an int or an integer array; got dtype {dtype}")
        self.check_broadcast(name, np.shape(value), batch, "...")

    def check_probability(self, name: str, p: float) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name} must be a probability in [0, 1); got {p}")

    def check_sizes(self, **sizes: int) -> None:
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int | np.integer) or size <= 0:
                raise ValueError(f"{name} must be a positive integer; got {size!r}")
        if sizes["d_model"] % sizes["num_heads"]:
            raise ValueError(f"d_model={sizes['d_model']} is not divisible by num_heads={sizes['num_heads']}")

    def check_activation(self, activation: str) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")

    def check_norm(self, norm: str) -> None:
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}; got {norm!r}")

    def check_rope_theta(self, rope_theta: Any, d_model: int, num_heads: int) -> float | None:
        if rope_theta is None:
            return None
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, int | float) or not 0 < rope_theta < math.inf:
            raise ValueError(f"rope_theta={rope_theta!r} must be None or a positive finite number")
        if d_model // num_heads % 2:
            raise ValueError(f"rope_theta needs an even head width; d_model={d_model}, num_heads={num_heads}")
        return float(rope_theta)

    def check_head_attention(self, attention: Any, dropout: float) -> str:
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}")
        if attention == "linear" and dropout != 0:
            raise ValueError(f"linear attention forms no weights to drop: dropout={dropout!r} must be 0")
        return attention

    def check_kv_heads(self, num_heads: int, num_kv_heads: Any) -> int:
        if num_kv_heads is None:
            return num_heads
        if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads <= 0 \
                or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads!r} must be a positive divisor of num_heads={num_heads}")
        return num_kv_heads

    def check_feed_forward(self, state: Mapping[str, np.ndarray], activation: str) -> None:
        """activation "swiglu" for a state with ffn.w_gate, ffn.w_up, ffn.w_down; "relu" or "gelu" for ffn.0, ffn.3."""
        gated = any(name.startswith("ffn.w_") for name in state)
        if gated != (activation == "swiglu"):
            entries = "ffn.w_gate, ffn.w_up, ffn.w_down" if gated else "ffn.0, ffn.3"
            raise ValueError(f"activation={activation!r} does not fit a state with {entries}")

    def check_module_input(self, name: str, x: np.ndarray, d_model: int, letter: str) -> None:
        if x.ndim < 2 or x.shape[-1] != d_model:
            raise ValueError(f"{name} must have shape (..., {letter}, D) with D = d_model = {d_model}; "
                             f"got {x.shape}")

    def check_state(self, cls_name: str, state: Mapping[str, np.ndarray],
                    expected: Mapping[str, tuple[int, ...]]) -> None:
        """One ValueError naming every missing, unexpected and mis-shaped entry."""
        problems = [f"missing {name} {shape}" for name, shape in expected.items() if name not in state]
        problems += [f"unexpected {name} {state[name].shape}" for name in state if name not in expected]
        problems += [f"{name} has shape {state[name].shape}, expected {shape}"
                     for name, shape in expected.items() if name in state and state[name].shape != shape]
        if problems:
            raise ValueError(f"{cls_name}.from_state_dict: " + "; ".join(problems))
        self.check_dtypes(f"{cls_name}.from_state_dict: ", **state)

    def size_of(self, cls_name: str, state: Mapping[str, np.ndarray], name: str, axis: int) -> int:
        if name not in state or state[name].ndim <= axis:
            raise ValueError(f"{cls_name}.from_state_dict: needs {name} to read the sizes; "
                             f"got entries {sorted(state)}")
        return int(state[name].shape[axis])


# --- the module classes, bound to an Implementation by as_module ------------------------------------------

class _Module:
    """Mutable, like torch.nn.Module: train() and eval() switch in place and return the module."""

    _impl: Implementation  # set on the subclass that as_module builds
    _state: dict[str, np.ndarray]
    training: bool

    def state_dict(self) -> dict[str, np.ndarray]:
        """{name: array}, the names and layouts of the PyTorch classes."""
        return dict(self._state)

    def train(self, mode: bool = True) -> Any:
        """Training mode (dropout active), or inference with mode=False."""
        self.training = bool(mode)
        return self

    def eval(self) -> Any:
        """Inference mode: no dropout."""
        return self.train(False)

    def _a_parameter(self) -> np.ndarray:
        """One parameter, whose dtype the inputs must share."""
        return next(iter(self._state.values()))

    @classmethod
    def _loaded(cls, state: Mapping[str, Any]) -> dict[str, np.ndarray]:
        return {name: np.asarray(value) for name, value in state.items()}


class _MultiHeadAttention(_Module):
    def __init__(self, d_model: int = 512, num_heads: int = 8, dropout: float = 0.1, *,
                 num_kv_heads: int | None = None, bias: bool = True, rope_theta: float | None = None,
                 attention: str = "softmax", rng: Rng = None, dtype: Any = None) -> None:
        impl = self._impl
        impl.check_sizes(d_model=d_model, num_heads=num_heads)
        num_kv_heads = impl.check_kv_heads(num_heads, num_kv_heads)
        self.rope_theta = impl.check_rope_theta(rope_theta, d_model, num_heads)
        impl.check_probability("dropout", dropout)
        self.attention = impl.check_head_attention(attention, dropout)
        rng, dtype = impl.generator(rng), np.float32 if dtype is None else dtype
        state = {}
        for name, (d_out, d_in) in impl.mha_shapes(d_model, num_heads, num_kv_heads, bias=False).items():
            state |= impl.init_linear(name.removesuffix(".weight"), d_in, d_out, rng, dtype, bias)
        self._state, self.num_heads, self.dropout, self.training = state, num_heads, dropout, True

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, num_heads: int, dropout: float = 0.1,
                        rope_theta: float | None = None, attention: str = "softmax") -> Any:
        """A module holding `state`, computing in its dtype, in training mode."""
        impl, state = cls._impl, cls._loaded(state)
        d_model = impl.size_of(cls.__name__, state, "w_q.weight", 1)
        impl.check_sizes(d_model=d_model, num_heads=num_heads)
        rope_theta = impl.check_rope_theta(rope_theta, d_model, num_heads)
        impl.check_probability("dropout", dropout)
        attention = impl.check_head_attention(attention, dropout)
        num_kv_heads = impl.kv_heads_in(state, "", d_model, num_heads)
        impl.check_state(cls.__name__, state, impl.mha_shapes(d_model, num_heads, num_kv_heads, impl.biased(state)))
        module = object.__new__(cls)
        module._state, module.num_heads, module.dropout, module.training = state, num_heads, dropout, True
        module.rope_theta, module.attention = rope_theta, attention
        return module

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                 need_weights: bool = True, rng: Rng = None) -> Pair:
        """q (..., L, D), k and v (..., S, D), mask broadcasting to (..., H, L, S) ->
        out (..., L, D), weights (..., H, L, S) before dropout (or None)."""
        impl, q, k, v = self._impl, np.asarray(q), np.asarray(k), np.asarray(v)
        d_model = self._state["w_q.weight"].shape[1]
        for name, x, letter in (("q", q, "L"), ("k", k, "S"), ("v", v, "S")):
            impl.check_module_input(name, x, d_model, letter)
        impl.check_dtypes("", q=q, k=k, v=v, parameters=self._a_parameter())
        if mask is not None and self.attention == "linear":
            raise ValueError("a mask was given, but attention='linear' takes none")
        return impl.multi_head_attention(self._state, q, k, v, mask, num_heads=self.num_heads,
                                         dropout_p=impl.active_dropout(self.dropout, self.training),
                                         need_weights=need_weights, rng=rng, rope_theta=self.rope_theta,
                                         attention=self.attention)

    # --- decoding: the cache keeps the keys' and values' inputs, and each extend attends over them anew ---------

    def init_cache(self, batch_shape: tuple[int, ...], capacity: int, *, dtype: Any = None) -> _InputCache:
        """The keys' and values' inputs seen so far, (*batch_shape, capacity, D), and their positions, length 0;
        softmax heads only."""
        if self.attention == "linear":
            raise ValueError("attention='linear' has no key/value cache: init_cache and extend are softmax's")
        return _empty_cache(self, batch_shape, capacity, self._state["w_q.weight"].shape[1], dtype)

    def extend(self, x_q: np.ndarray, x_kv: np.ndarray, cache: _InputCache, mask: np.ndarray | None = None, *,
               need_weights: bool = True, rng: Rng = None) -> tuple[np.ndarray, np.ndarray | None, _InputCache]:
        """The new queries of x_q over every key so far, those of x_kv included, at positions start .. end - 1,
        causal; mask (broadcasting to (..., H, L, capacity)) hides keys on top."""
        impl, x_q, x_kv = self._impl, np.asarray(x_q), np.asarray(x_kv)
        impl.check_cache("x_q", x_q, cache.x)
        impl.check_cache("x_kv", x_kv, cache.x)
        if x_q.shape[-2] != x_kv.shape[-2]:
            raise ValueError(f"x_q {x_q.shape} and x_kv {x_kv.shape} stand at the same positions: one L for both")
        start, end, filled = _filled(impl, cache, impl.cached_inputs(x_q, x_kv))
        seen = filled.x[..., :end, :]  # (..., end, D)
        visible = impl.causal(end - start, end, start) & impl.cache_mask(mask, start, end, filled.x.shape[-2])
        out, weights = impl.multi_head_attention(self._state, x_q, seen, seen, visible, num_heads=self.num_heads,
                                                 dropout_p=impl.active_dropout(self.dropout, self.training),
                                                 need_weights=need_weights, rng=rng, rope_theta=self.rope_theta,
                                                 attention=self.attention,
                                                 positions=(filled.positions[start:end], filled.positions[:end]))
        return out, _padded(weights, filled.x.shape[-2]), filled


class _TransformerBlock(_Module):
    def __init__(self, d_model: int = 512, num_heads: int = 8, d_ff: int = 2048, dropout: float = 0.1, *,
                 norm_first: bool = False, activation: str = "relu", norm: str = "layer",
                 num_kv_heads: int | None = None, bias: bool = True, rope_theta: float | None = None,
                 eps: float = 1e-5, rng: Rng = None, dtype: Any = None) -> None:
        impl = self._impl
        impl.check_sizes(d_model=d_model, num_heads=num_heads, d_ff=d_ff)
        impl.check_probability("dropout", dropout)
        impl.check_activation(activation)
        impl.check_norm(norm)
        num_kv_heads = impl.check_kv_heads(num_heads, num_kv_heads)
        rope_theta = impl.check_rope_theta(rope_theta, d_model, num_heads)
        rng, dtype = impl.generator(rng), np.float32 if dtype is None else dtype
        state = {}
        shapes = impl.block_shapes(d_model, d_ff, num_heads, num_kv_heads, bias=False, norm=norm,
                                   activation=activation)
        for name, shape in shapes.items():
            if name.startswith("norm"):  # gains one, biases zero
                state[name] = np.ones(shape, dtype)
                state |= {name.replace("weight", "bias"): np.zeros(shape, dtype)} if norm == "layer" else {}
            else:
                state |= impl.init_linear(name.removesuffix(".weight"), shape[1], shape[0], rng, dtype, bias)
        self._setup(state, num_heads, dropout, norm_first, activation, eps, rope_theta)

    def _setup(self, state: dict[str, np.ndarray], num_heads: int, dropout: float, norm_first: bool,
               activation: str, eps: float, rope_theta: float | None) -> None:
        self._state, self.num_heads, self.dropout, self.training = state, num_heads, dropout, True
        self.norm_first, self.activation, self.eps, self.rope_theta = norm_first, activation, eps, rope_theta

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, num_heads: int, dropout: float = 0.1,
                        norm_first: bool = False, activation: str | None = None, rope_theta: float | None = None,
                        eps: float = 1e-5) -> Any:
        """A block holding `state`, computing in its dtype, in training mode; activation None: SwiGLU where the
        state has its entries, else ReLU."""
        impl, state = cls._impl, cls._loaded(state)
        if activation is None:
            activation = "swiglu" if "ffn.w_gate.weight" in state else "relu"
        impl.check_activation(activation)
        impl.check_feed_forward(state, activation)
        d_model = impl.size_of(cls.__name__, state, "attn.w_q.weight", 1)
        d_ff = impl.size_of(cls.__name__, state, "ffn.w_gate.weight" if activation == "swiglu" else "ffn.0.weight", 0)
        impl.check_sizes(d_model=d_model, num_heads=num_heads, d_ff=d_ff)
        impl.check_probability("dropout", dropout)
        num_kv_heads = impl.kv_heads_in(state, "attn.", d_model, num_heads)
        rope_theta = impl.check_rope_theta(rope_theta, d_model, num_heads)
        norm = "layer" if "norm1.bias" in state else "rms"
        impl.check_state(cls.__name__, state, impl.block_shapes(d_model, d_ff, num_heads, num_kv_heads,
                                                                impl.biased(state), norm, activation))
        module = object.__new__(cls)
        module._setup(state, num_heads, dropout, norm_first, activation, eps, rope_theta)
        return module

    def __call__(self, x: np.ndarray, mask: np.ndarray | None = None, *, need_weights: bool = True,
                 rng: Rng = None) -> Pair:
        """x (..., L, D), mask broadcasting to (..., H, L, L) -> x (..., L, D), weights (..., H, L, L)."""
        return self._forward(np.asarray(x), mask, need_weights=need_weights, rng=rng)

    def _forward(self, x: np.ndarray, mask: np.ndarray | None, *, need_weights: bool, rng: Rng,
                 positions: np.ndarray | None = None) -> Pair:
        """__call__, with RoPE at `positions` (L,) (None: 0 .. L - 1)."""
        impl = self._impl
        impl.check_module_input("x", x, self._state["norm1.weight"].shape[0], "L")
        impl.check_dtypes("", x=x, parameters=self._a_parameter())
        return impl.transformer_block(self._state, x, mask, num_heads=self.num_heads,
                                      norm_first=self.norm_first, activation=self.activation, eps=self.eps,
                                      dropout_p=impl.active_dropout(self.dropout, self.training),
                                      need_weights=need_weights, rng=rng, rope_theta=self.rope_theta,
                                      positions=positions)


    # --- decoding: the cache keeps the inputs, and each extend recomputes the causal pass over them -------------

    def init_cache(self, batch_shape: tuple[int, ...], capacity: int, *, dtype: Any = None) -> _InputCache:
        """The inputs seen so far, (*batch_shape, capacity, D), and their positions (capacity,), length 0."""
        return _empty_cache(self, batch_shape, capacity, self._state["norm1.weight"].shape[0], dtype)

    def extend(self, x: np.ndarray, cache: _InputCache, mask: np.ndarray | None = None, *, need_weights: bool = True,
               rng: Rng = None) -> tuple[np.ndarray, np.ndarray | None, _InputCache]:
        """The rows of the new positions in one causal pass over every input so far; mask (broadcasting to
        (..., H, L, capacity)) hides keys from the new rows on top (the earlier rows, dropped, see every key)."""
        impl, x = self._impl, np.asarray(x)
        impl.check_cache("x", x, cache.x)
        start, end, filled = _filled(impl, cache, x)
        new = impl.cache_mask(mask, start, end, filled.x.shape[-2]) & impl.causal(end - start, end, start)
        earlier = np.broadcast_to(impl.causal(start, end), (*np.shape(new)[:-2], start, end))  # (..., [H,] start, end)
        visible = np.concatenate([earlier, np.broadcast_to(new, (*earlier.shape[:-2], end - start, end))], axis=-2)
        y, weights = self._forward(filled.x[..., :end, :], visible, need_weights=need_weights, rng=rng,
                                   positions=filled.positions[:end])
        weights = None if weights is None else weights[..., start:end, :]  # (..., H, end, end) -> the new rows
        return y[..., start:end, :], _padded(weights, filled.x.shape[-2]), filled


def _empty_cache(module: _Module, batch_shape: tuple[int, ...], capacity: int, D: int, dtype: Any) -> _InputCache:
    """No inputs yet, (*batch_shape, capacity, D) zeros in `dtype` (the parameters' by default), length 0."""
    if not (isinstance(capacity, int) and capacity >= 0):
        raise ValueError(f"capacity must be a non-negative int; got {capacity!r}")
    inputs = np.zeros((*batch_shape, capacity, D), dtype or module._a_parameter().dtype)
    return _InputCache(x=inputs, positions=np.zeros(capacity, np.int64), length=0)


def _filled(impl: Implementation, cache: _InputCache, x: np.ndarray) -> tuple[int, int, _InputCache]:
    """start, end and a copy of the cache with the inputs x (..., L, D) at positions start .. end - 1."""
    capacity, L = cache.x.shape[-2], x.shape[-2]
    start, end = cache.length, impl.cache_end(cache.length, L)
    if end > capacity:
        raise ValueError(f"the cache's capacity is {capacity}: {start} positions held, {L} more asked")
    seen, positions = cache.x.copy(), cache.positions.copy()
    seen[..., start:end, :], positions[start:end] = x, impl.new_positions(start, end)
    return start, end, _InputCache(x=seen, positions=positions, length=impl.advanced(start, end))


def _padded(weights: np.ndarray | None, capacity: int) -> np.ndarray | None:
    """The new rows' weights (..., H, L, end) padded with zeros to (..., H, L, capacity)."""
    if weights is None:
        return None
    return np.pad(weights, [(0, 0)] * (weights.ndim - 1) + [(0, capacity - weights.shape[-1])])


class _FlexForward(NamedTuple):
    """What flex_attention's forward pass keeps for its backward pass, in the working dtype."""

    out: np.ndarray  # (B, H, L, Ev), before the cast to q's dtype
    lse: np.ndarray  # (B, H, L)
    raw: np.ndarray  # (B, H, L, S): Q K^T * scale, before score_mod
    weights: np.ndarray  # (B, H, L, S): P
    visible: np.ndarray  # (B, H, L, S)
    grid: tuple[np.ndarray, ...]  # b, h, q_idx, kv_idx
    k_h: np.ndarray  # (B, H, S, E): each query head's key/value head
    v_h: np.ndarray  # (B, H, S, Ev)
    scale: float
    heads: np.ndarray  # (H,): each query head's key/value head


class _Mods(NamedTuple):
    """The mods' view of the scores (B, H, L, S): their index arrays and the keys the mask function shows."""

    grid: tuple[np.ndarray, ...]  # b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, L, 1), kv_idx (1, 1, 1, S)
    shape: tuple[int, int, int, int]  # (B, H, L, S)
    shown: np.ndarray  # (B, H, L, S): True where the mask function (or a block mask) shows the key


class _InputCache(NamedTuple):
    x: np.ndarray  # (..., capacity, D)
    positions: np.ndarray  # (capacity,): where RoPE turns each input
    length: int


def as_module(impl: Implementation, name: str) -> types.ModuleType:
    """A module object exposing exactly the contract's names, every one bound to `impl`."""
    module = types.ModuleType(name, f"The attention contract, computed by {type(impl).__name__}.")
    for function in FUNCTIONS:
        setattr(module, function, getattr(impl, function))
    for base in (_MultiHeadAttention, _TransformerBlock):
        cls_name = base.__name__.lstrip("_")
        setattr(module, cls_name, type(cls_name, (base,), {"_impl": impl, "__module__": name}))
    module.__all__ = list(CONTRACT)
    return module


_default = as_module(Implementation(), __name__)
asarray = _default.asarray
to_numpy = _default.to_numpy
save_state_dict = _default.save_state_dict
load_state_dict = _default.load_state_dict
causal_mask = _default.causal_mask
window_mask = _default.window_mask
padding_mask = _default.padding_mask
scaled_dot_product_attention = _default.scaled_dot_product_attention
apply_rope = _default.apply_rope
flex_attention = _default.flex_attention
flex_attention_vjp = _default.flex_attention_vjp
create_block_mask = _default.create_block_mask
MultiHeadAttention = _default.MultiHeadAttention
TransformerBlock = _default.TransformerBlock

__all__ = list(CONTRACT)
