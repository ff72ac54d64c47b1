"""Broken implementations: the einsum implementation with ONE realistic bug each, which the conformance
suite must reject.

Each class overrides one named piece of `Implementation`; its docstring says the bug and which check of
the suite should catch it (the measure names of `conformance.check` rows: values, weights_rows,
permutation, causal_prefix, single_key, reproducible, varies, mean, independent, fast_path, round_trip,
call, helpers, edge_cases). Every variant runs without error on ordinary inputs: the bug is a wrong answer,
never a crash.

`BROKEN` maps a name to the variant as a module object exposing the contract, ready for `check`.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from conformance.contract.features import Declaration

from .einsum_attention import Implementation, Pair, Rng, as_module

# --- projections and heads -------------------------------------------------------------------------------


class TransposedProjection(Implementation):
    """Projects with x W instead of x W^T (the (out, in) layout of nn.Linear misread as (in, out)).
    Caught by: values (mha, block)."""

    def project(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, num_heads: int) -> np.ndarray:
        w, b = self.split_heads(weight.T, num_heads), self.split_heads(bias, num_heads)
        return np.einsum("...ld,hkd->...hlk", x, w) + b[:, None, :]


class HeadsInterleaved(Implementation):
    """Splits D as (K, H) instead of (H, K): head h takes columns h, h + H, ... instead of the contiguous
    slice h*K:(h+1)*K. Self-consistent, so only a comparison with the spec's layout shows it.
    Caught by: values (mha, block; H > 1 and K > 1)."""

    def split_heads(self, w: np.ndarray, num_heads: int) -> np.ndarray:
        return np.swapaxes(w.reshape(w.shape[0] // num_heads, num_heads, *w.shape[1:]), 0, 1)


class MhaScaledByDModel(Implementation):
    """Scales each head's scores by 1/sqrt(d_model) instead of 1/sqrt(d_k).
    Caught by: values (mha, block; H > 1)."""

    def head_scale(self, d_k: int, d_model: int) -> float:
        return 1.0 / math.sqrt(d_model)


class WeightsAveragedOverHeads(Implementation):
    """Returns the weights averaged over the heads, (..., L, S), as nn.MultiheadAttention does by
    default, instead of per head (..., H, L, S). Caught by: values (mha, block: wrong shape)."""

    def head_weights(self, weights: np.ndarray) -> np.ndarray:
        return weights.mean(axis=-3)


# --- scores, scale and bias ------------------------------------------------------------------------------


class ScaleOneOverE(Implementation):
    """Default scale 1/E instead of 1/sqrt(E). Caught by: values (sdpa without scale, E > 1)."""

    def default_scale(self, E: int) -> float:
        return 1.0 / E


class CustomScaleIgnored(Implementation):
    """The `scale` argument is ignored: always 1/sqrt(E). Caught by: values (sdpa with scale)."""

    def resolve_scale(self, scale: float | None, E: int) -> float:
        return self.default_scale(E)


class ZeroScaleTakenForDefault(Implementation):
    """`scale or 1 / sqrt(E)`: a scale of 0 (uniform weights over the visible keys) is taken for "no scale
    given". Caught by: values (sdpa with scale 0)."""

    def resolve_scale(self, scale: float | None, E: int) -> float:
        return scale or self.default_scale(E)


class BiasIgnored(Implementation):
    """The `bias` argument is accepted and dropped. Caught by: values (sdpa with bias); single_key
    (a -inf bias no longer hides)."""

    def add_bias(self, scores: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        return scores


class BiasScaled(Implementation):
    """Computes (q k^T + bias) * scale: the bias is scaled along with the logits.
    Caught by: values (sdpa with a finite bias and scale != 1)."""

    def scores(self, q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None,
               softcap: float | None) -> np.ndarray:
        return self.add_bias(self.cap(np.einsum("...le,...se->...ls", q, k), softcap), bias) * scale


class Float64Output(Implementation):
    """Upcasts the scores to float64 "for accuracy" and never casts back: float32 inputs give float64
    outputs. Caught by: values (float32: wrong dtype)."""

    def scores(self, q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None,
               softcap: float | None) -> np.ndarray:
        q, k = q.astype(np.float64), k.astype(np.float64)
        return self.add_bias(self.cap(np.einsum("...le,...se->...ls", q, k) * scale, softcap), bias)


# --- which keys are visible ------------------------------------------------------------------------------


class InvertedMask(Implementation):
    """Mask polarity inverted: True / 1 hides the key (the key_padding_mask convention of PyTorch).
    Caught by: values (sdpa, mha, block with a mask); single_key."""

    def mask_visible(self, mask: np.ndarray) -> np.ndarray:
        return np.asarray(mask) == 0


class MaskTransposed(Implementation):
    """A square mask is read as (S, L) instead of (L, S): mask[j, i] decides whether query i sees key j.
    Caught by: values (a non-symmetric square mask, e.g. causal_mask(L, L)); causal_prefix (block)."""

    def mask_visible(self, mask: np.ndarray) -> np.ndarray:
        mask = np.asarray(mask)
        if mask.ndim >= 2 and mask.shape[-1] == mask.shape[-2]:
            mask = np.swapaxes(mask, -1, -2)
        return mask != 0


class IsCausalIgnored(Implementation):
    """`is_causal=True` is accepted and ignored. Caught by: values (sdpa with is_causal);
    causal_prefix (sdpa)."""

    def visible(self, scores: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
                is_causal: bool, q_offset: object = 0) -> np.ndarray:
        return super().visible(scores, mask, bias, False, q_offset)


class CausalBottomRight(Implementation):
    """Causal mask aligned at the bottom-right corner (query i sees keys 0..i + S - L, the flash-attention
    convention for L != S) instead of the top-left. Identical when L == S.
    Caught by: values (sdpa with is_causal and L != S); causal_prefix (sdpa, L < S)."""

    def causal(self, L: int, S: int, q_offset: object = 0) -> np.ndarray:
        return np.arange(S) <= self.positions(L, q_offset) + (S - L)


class CausalStrict(Implementation):
    """Causal mask off by one, j < i instead of j <= i: a query no longer sees its own key (and query 0
    sees none). Caught by: values (sdpa with is_causal; block with causal_mask); single_key."""

    def causal(self, L: int, S: int, q_offset: object = 0) -> np.ndarray:
        return np.arange(S) < self.positions(L, q_offset)


class NegInfBiasNotHidden(Implementation):
    """A -inf bias is left to the exponential instead of hiding the key: a row whose keys are all -inf
    (through the bias alone) has max = -inf and gives exp(-inf - -inf) = NaN instead of zeros.
    Caught by: values (sdpa with a bias row of all -inf)."""

    def visible(self, scores: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
                is_causal: bool, q_offset: object = 0) -> np.ndarray:
        visible = np.ones(scores.shape, dtype=bool)  # the bias is left out
        if mask is not None:
            visible = visible & self.mask_visible(mask)
        if is_causal:
            visible = visible & self.causal(*scores.shape[-2:], q_offset)
        return visible


class NegInfScoreHidden(Implementation):
    """Any score of -inf is taken for a hidden key, also one that comes from the inputs (an infinite q
    against a key of the opposite sign), so a row whose visible scores are all -inf returns zeros instead
    of NaN. Caught by: edge_cases (sdpa neg_inf_scores_from_the_inputs)."""

    def visible(self, scores: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
                is_causal: bool, q_offset: object = 0) -> np.ndarray:
        return super().visible(scores, mask, bias, is_causal, q_offset) & (scores != -np.inf)


# --- positions, windows, key lengths and soft-capping (SPEC 2a) ---------------------------------------


class WindowOffByOne(Implementation):
    """The window's left edge is exclusive, p_i - left < j instead of <=: a sliding window (left, 0) sees
    left keys, not left + 1. Caught by: values (sdpa with a window whose left side is bounded)."""

    def in_window(self, L: int, S: int, window: tuple, q_offset: object = 0) -> np.ndarray:
        left, right = window
        return super().in_window(L, S, (None if left is None else left - 1, right), q_offset)


class WindowUnboundedRightReadAsZero(Implementation):
    """A None right side of the window is read as 0 (a sliding-window kernel written for causal attention,
    where keys after the query are hidden anyway): without is_causal, `(left, None)` hides every key after
    p_i instead of none. Caught by: values (sdpa with a window (left, None) and no is_causal)."""

    def in_window(self, L: int, S: int, window: tuple, q_offset: object = 0) -> np.ndarray:
        left, right = window
        return super().in_window(L, S, (left, 0 if right is None else right), q_offset)


class SoftcapAfterBias(Implementation):
    """The softcap is applied to the biased scores, softcap tanh((raw + bias) / softcap), and a key counts
    as hidden where its score is -inf (the masks folded into the bias): tanh(-inf) = -1, so a -inf bias
    becomes a score of -softcap and the key it hid is visible. Caught by: values (sdpa with a softcap and a
    bias); edge_cases (softcap_keeps_neg_inf_bias_hidden)."""

    def scores(self, q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None,
               softcap: float | None) -> np.ndarray:
        raw = np.einsum("...le,...se->...ls", q, k) * scale  # (..., L, S)
        return self.cap(self.add_bias(raw, bias), softcap)

    def visible(self, scores: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
                is_causal: bool, q_offset: object = 0) -> np.ndarray:
        return super().visible(scores, mask, None, is_causal, q_offset) & (scores != -np.inf)


class QOffsetIgnoredOnTheFastPath(Implementation):
    """Without the weights (a fused call that takes no offset), q_offset is dropped: the causal rule and the
    window read query i's position as i. Caught by: fast_path (sdpa with q_offset and causal or a window)."""

    def scaled_dot_product_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                                     mask: np.ndarray | None = None, *, need_weights: bool = True,
                                     q_offset: object = 0, **options: object) -> Pair:
        return super().scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights,
                                                    q_offset=q_offset if need_weights else 0, **options)


class KeyLengthsOnQueries(Implementation):
    """key_lengths hides the queries i >= key_lengths (padding of the queries) instead of the keys
    j >= key_lengths. Caught by: values (sdpa with key lengths)."""

    def in_range(self, L: int, S: int, q_offset: object, window: object, key_lengths: object) -> np.ndarray | bool:
        visible = super().in_range(L, S, q_offset, window, None)
        if key_lengths is None:
            return visible
        return visible & (np.arange(L)[:, None] < np.asarray(key_lengths)[..., None, None])  # (..., L, 1)


class GroupsInterleaved(Implementation):
    """enable_gqa reads key/value head h % Hkv for query head h (the groups interleaved, as after a repeat of
    the whole head axis) instead of h // G (consecutive query heads sharing one, as torch's repeat_interleave
    and ONNX). Caught by: values (sdpa with enable_gqa, 1 < Hkv < H)."""

    def kv_heads(self, H: int, Hkv: int) -> np.ndarray:
        return np.arange(H) % Hkv


class HeadPositionsSplitAsGroupsFirst(Implementation):
    """enable_gqa with q_offset or key_lengths per query head, (..., H): the heads are grouped as (Hkv, G) for
    q, but the positions' head axis is split as (G, Hkv) and transposed, so query head h = kv G + g takes the
    entry g Hkv + kv instead of h. Right for Hkv = 1 and Hkv = H (multi-query, one head each), where the two
    splits agree.
    Caught by: values (sdpa with enable_gqa, 1 < Hkv < H and positions that differ per query head)."""

    def scaled_dot_product_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                                     mask: np.ndarray | None = None, *, q_offset: object = 0,
                                     key_lengths: object = None, enable_gqa: bool = False,
                                     **options: object) -> Pair:
        if enable_gqa and np.ndim(q) >= 3 and np.ndim(k) >= 3:
            H, Hkv = np.shape(q)[-3], np.shape(k)[-3]
            q_offset, key_lengths = self.split(q_offset, H, Hkv), self.split(key_lengths, H, Hkv)
        return super().scaled_dot_product_attention(q, k, v, mask, q_offset=q_offset, key_lengths=key_lengths,
                                                    enable_gqa=enable_gqa, **options)

    def split(self, positions: object, H: int, Hkv: int) -> object:
        """(..., H) -> (..., G, Hkv) -> (..., Hkv, G) -> (..., H); anything without a head axis of H as it is."""
        if positions is None or np.ndim(positions) == 0 or np.shape(positions)[-1] != H or H % Hkv:
            return positions  # no head axis (or a bad one, which the checks report)
        positions = np.asarray(positions)
        grouped = positions.reshape(*positions.shape[:-1], H // Hkv, Hkv)  # the bug: (G, Hkv), not (Hkv, G)
        return np.swapaxes(grouped, -1, -2).reshape(positions.shape)


class RopeInterleavedForHalf(Implementation):
    """apply_rope pairs (x_2j, x_2j+1) where the half layout (x_j, x_j+E/2) is asked for, the mix-up between
    the paper's and GPT-J's layout and Llama's (Hugging Face's rotate_half). Caught by: rope (positions)."""

    def rope_pairs(self, x: np.ndarray, interleaved: bool) -> np.ndarray:
        return super().rope_pairs(x, True)

    def rope_unpairs(self, pairs: np.ndarray, interleaved: bool) -> np.ndarray:
        return super().rope_unpairs(pairs, True)


class CacheLengthNotAdvanced(Implementation):
    """extend returns the cache with its old length: the next chunk is written over this one, as if the
    earlier positions had never been seen. Caught by: values (decode with two chunks or more)."""

    def advanced(self, start: int, end: int) -> int:
        return start


class CacheUnchecked(Implementation):
    """extend writes x into a cache made for another batch shape or dtype without a word: NumPy broadcasts or
    casts on the write, or fails with its own message naming neither the cache nor the shapes. Caught by: errors
    (decode's cache_for_another_batch and cache_of_another_dtype)."""

    def check_cache(self, name: str, x: np.ndarray, held: np.ndarray) -> None:
        pass


class CacheWidthUnchecked(Implementation):
    """extend checks the batch shape and the dtype of its input against the cache, not its width: an input of
    another D reaches the cache's write, where NumPy's broadcast error names neither the input nor d_model.
    Caught by: errors (decode's input_of_another_width)."""

    def check_cache_width(self, name: str, x: np.ndarray, held: np.ndarray) -> None:
        pass


class ExtendMaskIgnored(Implementation):
    """extend takes a mask and drops it: its queries see every key up to their own position, as if the mask
    were causal_mask alone (a decode loop that forgets the padding or the sliding window it was given). Caught
    by: values (decode with a mask)."""

    def cache_mask(self, mask: Any, start: int, end: int, capacity: int) -> np.ndarray | bool:
        return True


class ExtendMaskCropped(Implementation):
    """extend takes the first `end` columns of its mask, those of the keys so far, whatever its width: a mask
    over another number of keys than the cache's capacity (one made for the keys so far, or for another cache)
    is read without a word, its columns at the wrong keys once it is narrower than the sequence. Caught by:
    errors (decode's mask_not_capacity_wide)."""

    def cache_mask(self, mask: Any, start: int, end: int, capacity: int) -> np.ndarray | bool:
        if mask is None:
            return True
        shown = np.asarray(mask) != 0  # (..., [H,] L or 1, any width)
        return np.broadcast_to(shown[..., :end], (*shown.shape[:-2], end - start, end))


class CrossAttentionKeysFromTheQueries(Implementation):
    """MultiHeadAttention.extend caches the keys and values of x_q, not of x_kv: self-attention's path taken
    for cross-attention, which no check told apart while x_q was x_kv (the block's extend). Caught by: values
    (decode with x_kv)."""

    def cached_inputs(self, x_q: np.ndarray, x_kv: np.ndarray) -> np.ndarray:
        return x_q


class RopeAnglesInHalfPrecision(Implementation):
    """apply_rope computes the angles p * theta^(-2j / E) and their cos and sin in x's float16, not in float32 as
    SPEC 2b asks: float16 holds integers exactly only up to 2048 and spaces them 2 to 4 apart beyond, so at
    positions in the thousands the angle is off by whole radians, while at the positions of a short sequence it
    loses a rounding. Caught by: rope (positions; float16, positions in the thousands)."""

    def rope_rotation(self, positions: np.ndarray, E: int, theta: float, dtype: np.dtype) -> np.ndarray:
        inverse = (1.0 / theta ** (np.arange(0, E, 2) / E)).astype(dtype)  # (E/2,)
        angles = positions[..., None].astype(dtype) * inverse  # the bug: (..., L, E/2) in x's dtype, float16 too
        cos, sin = np.cos(angles), np.sin(angles)
        return np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], -2)  # (..., L, E/2, 2, 2)


class RopePositionsFromTheChunk(Implementation):
    """extend turns each chunk's queries and keys at positions 0 .. L - 1 of the chunk instead of
    length .. length + L - 1 in the sequence (the positions of a full pass forgotten once a cache holds the
    earlier ones). Caught by: values (decode with RoPE and two chunks or more)."""

    def new_positions(self, start: int, end: int) -> np.ndarray:
        return np.arange(end - start)


class RopeKeysNotTurned(Implementation):
    """RoPE turns the queries only; the keys keep their projections (half of the rotation forgotten: the
    scores then depend on the query's absolute position, not on the distance). Caught by: values (mha and
    block with rope_theta)."""

    def rope_heads(self, q: np.ndarray, k: np.ndarray, theta: float,
                   positions: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
        return super().rope_heads(q, k, theta, positions)[0], k


class LinearFeaturesWithoutOne(Implementation):
    """Linear heads map with phi = elu where the spec asks for elu + 1 (the shift forgotten): a negative entry's
    feature lies in (-1, 0), so the kernel's weights change sign and the normaliser can cancel. Caught by: values
    (mha with attention="linear")."""

    def linear_features(self, x: np.ndarray) -> np.ndarray:
        return np.where(x > 0, x, np.expm1(np.minimum(x, 0)))


# --- softmax -------------------------------------------------------------------------------------------


class SoftmaxWrongAxis(Implementation):
    """Softmax over the queries (axis -2) instead of the keys. Caught by: values; weights_rows."""

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        seen = np.any(visible, axis=-2, keepdims=True)
        kept = np.where(visible, scores, -np.inf)
        col_max = np.where(seen, np.max(kept, axis=-2, keepdims=True, initial=-np.inf), 0)
        exp = np.exp(kept - col_max)
        return np.where(visible, exp / np.where(seen, exp.sum(axis=-2, keepdims=True), 1), 0)


class RowMaximumBeforeBias(Implementation):
    """The row maximum over the visible keys is taken from q k^T * scale before the bias is added (a fused
    kernel that adds the bias late) and subtracted after: exp(s + b - max s) overflows to inf / inf = NaN
    once a bias reaches the hundreds (float32) or about 700 (float64).
    Caught by: values (biases of large finite magnitude)."""

    def scores(self, q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None,
               softcap: float | None) -> np.ndarray:
        self.unbiased = super().scores(q, k, scale, None, softcap)  # (..., L, S), kept for the softmax
        return self.add_bias(self.unbiased, bias)

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        seen = np.any(visible, axis=-1, keepdims=True)
        row_max = np.max(np.where(visible, self.unbiased, -np.inf), axis=-1, keepdims=True, initial=-np.inf)
        exp = np.exp(np.where(visible, scores, -np.inf) - np.where(seen, row_max, 0))
        return np.where(visible, exp / np.where(seen, exp.sum(axis=-1, keepdims=True), 1), 0)


class SoftmaxWithoutMaxSubtraction(Implementation):
    """exp(scores) without subtracting the row maximum: logits in the hundreds overflow to inf, and
    inf / inf = NaN. Caught by: values (large logits: float32 overflows above 88, float64 above 709)."""

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        seen = np.any(visible, axis=-1, keepdims=True)
        exp = np.exp(np.where(visible, scores, -np.inf))
        return np.where(visible, exp / np.where(seen, exp.sum(axis=-1, keepdims=True), 1), 0)


class MaskedRowUniform(Implementation):
    """Hidden scores filled with -1e9 (The Annotated Transformer's masked_fill): a query with no visible
    key averages all the values uniformly instead of giving zeros.
    Caught by: values (fully masked rows); single_key (a query that sees no key)."""

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        filled = np.where(visible, scores, -1e9)
        exp = np.exp(filled - filled.max(axis=-1, keepdims=True))
        return exp / exp.sum(axis=-1, keepdims=True)


class HiddenFilledWithMinus1e4(Implementation):
    """Hidden scores filled with -1e4 (a masked_fill constant that float16 can hold) instead of left out;
    rows that see no key are still zeroed. Right while every visible score stays far above -1e4.
    Caught by: values (biases that shift a row's scores by tens of thousands; the example
    visible_scores_near_minus_1e5)."""

    FILL = -1e4

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        seen = np.any(visible, axis=-1, keepdims=True)
        filled = np.where(visible, scores, self.FILL)  # a hidden key keeps exp(FILL - max) of the weight
        return np.where(seen, super().softmax(filled, np.ones(filled.shape, bool)), 0)


class HiddenFilledWithMinus1e9(HiddenFilledWithMinus1e4):
    """As HiddenFilledWithMinus1e4 with The Annotated Transformer's -1e9: right while every visible score
    stays far above -1e9. Caught by: edge_cases (visible_scores_below_minus_1e9)."""

    FILL = -1e9


class OnlineSoftmaxWithoutRescale(Implementation):
    """The softmax over tiles of BLOCK keys with a running row maximum (the online softmax of tiled
    kernels), but the running sum is not rescaled by exp(old max - new max) when a later tile raises the
    maximum: exact while S <= BLOCK, rows that sum to more than 1 past it.
    Caught by: values, weights_rows (S > 16: the drawn long sequences, the example long_sequences)."""

    BLOCK = 16

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        seen = np.any(visible, axis=-1, keepdims=True)  # (..., L, 1)
        kept = np.where(visible, scores, -np.inf)
        row_max = np.full(seen.shape, -np.inf)
        total = np.zeros(seen.shape)
        for start in range(0, kept.shape[-1], self.BLOCK):
            tile = kept[..., start:start + self.BLOCK]  # (..., L, BLOCK)
            row_max = np.maximum(row_max, tile.max(axis=-1, keepdims=True, initial=-np.inf))
            total = total + np.exp(tile - self.shift(row_max)).sum(axis=-1, keepdims=True)  # the bug: no rescale
        exp = np.exp(kept - self.shift(row_max))
        return np.where(visible, exp / np.where(seen, total, 1), 0).astype(scores.dtype, copy=False)

    @staticmethod
    def shift(row_max: np.ndarray) -> np.ndarray:
        return np.where(np.isneginf(row_max), 0, row_max)  # no visible key so far: nothing to subtract


class MaskedRowNaN(Implementation):
    """Hidden scores set to -inf and no guard for rows with none visible: max = -inf, then
    exp(-inf - -inf) = NaN and 0 / 0 = NaN. Caught by: values (fully masked rows); single_key."""

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        kept = np.where(visible, scores, -np.inf)
        with np.errstate(invalid="ignore"):
            exp = np.exp(kept - kept.max(axis=-1, keepdims=True))
            return exp / exp.sum(axis=-1, keepdims=True)


class SoftmaxInHalfPrecision(Implementation):
    """float16 inputs get their scores, softmax and value product in float16 instead of float32 (SPEC
    section 2): scores near a hundred are rounded to a few hundredths, so the weights are off by percents.
    Caught by: values (sdpa float16: scores that share a term in the hundreds and differ by about one)."""

    def work_dtype(self, dtype: np.dtype) -> np.dtype:
        return dtype


class MaskAfterSoftmax(Implementation):
    """The mask is applied after the softmax (weights zeroed, not renormalised): rows no longer sum to 1.
    Caught by: values; weights_rows."""

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        return np.where(visible, super().softmax(scores, scores != -np.inf), 0)


# --- dropout and randomness ----------------------------------------------------------------------------


class WeightsAfterDropout(Implementation):
    """Returns the attention weights after dropout instead of before (rows no longer sum to 1 in
    training). Caught by: a training-mode check of the weights (weights_rows or values in training)."""

    def attend(self, weights: np.ndarray, v: np.ndarray, dropout_p: float, rng: Rng) -> Pair:
        dropped = self.dropout(weights, dropout_p, rng)
        return np.einsum("...ls,...sv->...lv", dropped, v), dropped


class DropoutInEval(Implementation):
    """Dropout stays active in eval mode (the training flag is never consulted).
    Caught by: values (mha, block: modules are checked in eval mode with dropout configured)."""

    def active_dropout(self, p: float, training: bool) -> float:
        return p


class DropoutWithoutRescale(Implementation):
    """Dropout zeroes entries but does not scale the kept ones by 1/(1 - p): the expected output shrinks
    by (1 - p). Caught by: mean (sdpa, mha)."""

    def dropout(self, x: np.ndarray, p: float, rng: Rng) -> np.ndarray:
        if p == 0.0:
            return x
        return np.where(self.generator(rng).random(x.shape) >= p, x, 0).astype(x.dtype)


class RngIgnoredFixedSeed(Implementation):
    """The rng argument is ignored in favour of a fixed seed: every rng gives the same dropout.
    Caught by: varies."""

    def generator(self, rng: Rng) -> np.random.Generator:
        return np.random.default_rng(0)


class RngIgnoredFresh(Implementation):
    """The rng argument is ignored in favour of fresh OS randomness: the same rng does not reproduce.
    Caught by: reproducible."""

    def generator(self, rng: Rng) -> np.random.Generator:
        return np.random.default_rng()


class IntSeedTakenForNone(Implementation):
    """Only a Generator is taken as the rng; anything else, an int seed too, falls back to fresh OS
    randomness, so a seed does not reproduce. Caught by: rng_forms (the int seed form)."""

    def generator(self, rng: Rng) -> np.random.Generator:
        return rng if isinstance(rng, np.random.Generator) else np.random.default_rng()


class DropoutSharedByHeads(Implementation):
    """MHA draws its dropout mask with the head axis of size 1, (..., 1, L, S), so every head drops the same
    weights (a mask shaped like padding_mask's, broadcast over the heads). Each head alone is right: the
    mean is the eval output and the mask varies with the rng. Caught by: independent (mha, H > 1)."""

    def multi_head_attention(self, *args: object, **options: object) -> Pair:
        return _OneMaskPerHeadAxis().multi_head_attention(*args, **options)  # its attention sees (..., H, L, S)


class _OneMaskPerHeadAxis(Implementation):
    def dropout(self, x: np.ndarray, p: float, rng: Rng) -> np.ndarray:
        if p == 0.0:
            return x
        keep = self.generator(rng).random((*x.shape[:-3], 1, *x.shape[-2:])) >= p  # one mask for axis -3
        return np.where(keep, x / (1 - p), 0).astype(x.dtype)


class SeedRestartedAtEverySite(Implementation):
    """The block hands its rng on as it came, and each dropout site seeds a Generator from it: a Generator
    passes through and advances, but an int seed restarts one stream at every site, so the two residual
    sites, of one shape, drop the same entries. Caught by: independent (block, with an int seed)."""

    def block_generator(self, rng: Rng) -> Rng:
        return rng


class AttentionAndActivationOneStream(Implementation):
    """The block seeds the attention's generator and the feed-forward network's from one number it draws,
    so the attention weights and the activation replay one stream: their first decisions are the same (the
    residual branches draw from the block's generator, apart). Caught by: independent (block)."""

    def site_generators(self, rng: Rng) -> tuple[Rng, Rng, Rng]:
        seed = int(self.generator(rng).integers(2**63))
        return np.random.default_rng(seed), rng, np.random.default_rng(seed)


class AttentionAndResidualOneStream(Implementation):
    """The block seeds the attention's generator and the residual branches' from one number it draws, so the
    attention weights and the attention branch's residual dropout replay one stream (the activation draws from
    the block's generator, apart). Caught by: independent (block)."""

    def site_generators(self, rng: Rng) -> tuple[Rng, Rng, Rng]:
        seed = int(self.generator(rng).integers(2**63))
        return np.random.default_rng(seed), np.random.default_rng(seed), rng


# --- the block -----------------------------------------------------------------------------------------


class LayerNormUnbiased(Implementation):
    """LayerNorm with the unbiased variance, dividing by D - 1 (torch.var's default).
    Caught by: values (block)."""

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).sum(axis=-1, keepdims=True) / max(x.shape[-1] - 1, 1)
        return (x - mean) / np.sqrt(var + eps) * weight + bias


class LayerNormEpsOutsideSqrt(Implementation):
    """LayerNorm (x - mean) / (std + eps) instead of / sqrt(var + eps) (The Annotated Transformer's form).
    Caught by: values (block, float64: a relative change of about eps)."""

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
        mean = x.mean(axis=-1, keepdims=True)
        std = np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True))
        return (x - mean) / (std + eps) * weight + bias


class GeluTanh(Implementation):
    """GELU in its tanh approximation instead of the exact erf form. Caught by: values (block, gelu)."""

    def activation(self, name: str, x: np.ndarray) -> np.ndarray:
        if name == "relu":
            return np.maximum(x, 0)
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


class PreLnIgnored(Implementation):
    """`norm_first=True` is accepted and ignored: always post-LN. Caught by: values (block, pre-LN)."""

    def wiring(self, norm_first: bool) -> Callable[..., Pair]:
        return self.post_ln


class FfnResidualMissing(Implementation):
    """The feed-forward branch forgets its residual connection: x = LN_2(Drop(FFN(x))) and
    x = Drop(FFN(LN_2(x))). Caught by: values (block)."""

    def post_ln(self, x: np.ndarray, attend: Callable, feed_forward: Callable, drop: Callable,
                ln1: Callable, ln2: Callable) -> Pair:
        h, weights = attend(x)
        x = ln1(x + drop(h))
        return ln2(drop(feed_forward(x))), weights

    def pre_ln(self, x: np.ndarray, attend: Callable, feed_forward: Callable, drop: Callable,
               ln1: Callable, ln2: Callable) -> Pair:
        h, weights = attend(ln1(x))
        x = x + drop(h)
        return drop(feed_forward(ln2(x))), weights


class NormsSwapped(Implementation):
    """norm1 and norm2 swapped (a state-dict mapping mix-up): the attention branch is normalised with
    norm2's weight and bias. Caught by: values (block; the suite's LayerNorm parameters differ)."""

    def norms(self, state: dict, eps: float) -> tuple[Callable, Callable]:
        ln1, ln2 = super().norms(state, eps)
        return ln2, ln1


class RmsNormCentred(Implementation):
    """RMSNorm subtracting the mean first, (x - mean) / sqrt(var + eps) * weight: LayerNorm without its bias
    where the spec's RMSNorm keeps the mean. Caught by: values (block, norm "rms")."""

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        centred = x - x.mean(axis=-1, keepdims=True)
        return centred / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + eps) * weight


class SwigluGateAndUpSwapped(Implementation):
    """SwiGLU with w_gate and w_up swapped: silu(W_up x) * (W_gate x), a state-dict mapping mix-up.
    Caught by: values (block, activation "swiglu")."""

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return super().swiglu(up, gate)


class KvHeadsInterleaved(Implementation):
    """MultiHeadAttention with num_kv_heads: query head h reads key/value head h % Hkv instead of h // (H / Hkv).
    Caught by: values (mha, block; 1 < Hkv < H)."""

    def shared_kv_head(self, H: int, Hkv: int) -> np.ndarray:
        return np.arange(H) % Hkv


# --- arrays and broadcasting ------------------------------------------------------------------------------

class AsarrayWidensFloat16(Implementation):
    """asarray turns float16 into float32 on the way in (an upcast for safety), so to_numpy(asarray(x)) is
    not x. Caught by: round_trip."""

    def asarray(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        return x.astype(np.float32) if x.dtype == np.float16 else x


class MaskRowsReadAsBatchWhenLEqualsB(Implementation):
    """On three-dimensional inputs q (B, L, E), a two-dimensional mask whose first axis equals B is read as a
    (B, S) key-padding mask (torch's key_padding_mask) instead of (L, S): sequence b sees the keys of row b
    from every query. Right whenever L != B (an (L, S) mask then has no such axis) or the rows agree.
    Caught by: values (sdpa, 3-D q with L == B and a 2-D mask whose rows differ)."""

    def visible(self, scores: np.ndarray, mask: np.ndarray | None, bias: np.ndarray | None,
                is_causal: bool, q_offset: object = 0) -> np.ndarray:
        if mask is not None and np.ndim(mask) == 2 and scores.ndim == 3 and np.shape(mask)[0] == scores.shape[0]:
            mask = np.asarray(mask)[:, None, :]  # the bug: (B, S) -> (B, 1, S), where (L, S) was meant
        return super().visible(scores, mask, bias, is_causal, q_offset)


class RankOneMaskDroppedOnTheFastPath(Implementation):
    """Without the weights, on (B, H, L, E) inputs, a mask of rank 1, (S,), is taken for "no mask" (a fused
    call for four-dimensional inputs that reads only masks of rank 2 and more, as torch's kernel once
    tripped). Caught by: fast_path (the table's example rank_one_mask)."""

    def scaled_dot_product_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                                     mask: np.ndarray | None = None, *, need_weights: bool = True,
                                     **options: object) -> Pair:
        if not need_weights and mask is not None and np.ndim(mask) == 1 and np.ndim(q) == 4:
            mask = None
        return super().scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights, **options)


class DropoutSkippedWithoutWeights(Implementation):
    """The path without the weights (a fused call) silently leaves dropout out in training mode. Caught
    by: varies, mean (the dropout checks run on both paths)."""

    def scaled_dot_product_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                                     mask: np.ndarray | None = None, *, need_weights: bool = True,
                                     dropout_p: float = 0.0, **options: object) -> Pair:
        self.check_probability("dropout_p", dropout_p)  # still checked, then dropped
        return super().scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights,
                                                    dropout_p=dropout_p if need_weights else 0.0, **options)


class PaddingMaskOffByOne(Implementation):
    """padding_mask keeps lengths[b] + 1 keys (`<=` for `<`): every attention call is right, the helper
    that builds its mask is not. Caught by: helpers."""

    def padding_mask(self, lengths: object, S: int) -> np.ndarray:
        return np.arange(S) <= np.asarray(lengths)[:, None, None, None]  # (B,) -> (B, 1, 1, S)


class QueriesScaledInPlace(Implementation):
    """The scale is folded into q in place (q *= scale, to save a copy of q): the numbers are right, but
    the caller's q has changed. Caught by: call (every input must hold the same bits after the call)."""

    def scores(self, q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None,
               softcap: float | None) -> np.ndarray:
        q *= scale  # writes into the caller's array
        return super().scores(q, k, 1.0, bias, softcap)


class FlexLseWithoutTheMaximum(Implementation):
    """flex_attention's lse as log sum_j exp(r_j - m), the row maximum m subtracted for the softmax and not added
    back: out is right, the lse is off by m. Caught by: lse (flex)."""

    def flex_softmax(self, scores: np.ndarray, visible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        weights, lse = super().flex_softmax(scores, visible)
        row_max = np.max(np.where(visible, scores, -np.inf), axis=-1, initial=-np.inf)  # (B, H, L)
        return weights, np.where(np.isfinite(row_max), lse - row_max, lse)  # the bug: m left out


VARIANTS: dict[str, type[Implementation]] = {
    "transposed_projection": TransposedProjection,
    "heads_interleaved": HeadsInterleaved,
    "mha_scaled_by_d_model": MhaScaledByDModel,
    "weights_averaged_over_heads": WeightsAveragedOverHeads,
    "scale_one_over_e": ScaleOneOverE,
    "custom_scale_ignored": CustomScaleIgnored,
    "zero_scale_taken_for_default": ZeroScaleTakenForDefault,
    "bias_ignored": BiasIgnored,
    "bias_scaled": BiasScaled,
    "float64_output": Float64Output,
    "inverted_mask": InvertedMask,
    "mask_transposed": MaskTransposed,
    "is_causal_ignored": IsCausalIgnored,
    "causal_bottom_right": CausalBottomRight,
    "causal_strict": CausalStrict,
    "neg_inf_bias_not_hidden": NegInfBiasNotHidden,
    "neg_inf_score_hidden": NegInfScoreHidden,
    "window_off_by_one": WindowOffByOne,
    "window_unbounded_right_read_as_zero": WindowUnboundedRightReadAsZero,
    "softcap_after_bias": SoftcapAfterBias,
    "q_offset_ignored_on_the_fast_path": QOffsetIgnoredOnTheFastPath,
    "key_lengths_on_queries": KeyLengthsOnQueries,
    "groups_interleaved": GroupsInterleaved,
    "head_positions_split_as_groups_first": HeadPositionsSplitAsGroupsFirst,
    "rope_interleaved_for_half": RopeInterleavedForHalf,
    "rope_angles_in_half_precision": RopeAnglesInHalfPrecision,
    "cache_length_not_advanced": CacheLengthNotAdvanced,
    "cache_unchecked": CacheUnchecked,
    "cache_width_unchecked": CacheWidthUnchecked,
    "extend_mask_ignored": ExtendMaskIgnored,
    "extend_mask_cropped": ExtendMaskCropped,
    "cross_attention_keys_from_the_queries": CrossAttentionKeysFromTheQueries,
    "rope_positions_from_the_chunk": RopePositionsFromTheChunk,
    "rope_keys_not_turned": RopeKeysNotTurned,
    "linear_features_without_one": LinearFeaturesWithoutOne,
    "softmax_wrong_axis": SoftmaxWrongAxis,
    "softmax_without_max_subtraction": SoftmaxWithoutMaxSubtraction,
    "row_maximum_before_bias": RowMaximumBeforeBias,
    "masked_row_uniform": MaskedRowUniform,
    "masked_row_nan": MaskedRowNaN,
    "hidden_filled_with_minus_1e4": HiddenFilledWithMinus1e4,
    "hidden_filled_with_minus_1e9": HiddenFilledWithMinus1e9,
    "online_softmax_without_rescale": OnlineSoftmaxWithoutRescale,
    "mask_after_softmax": MaskAfterSoftmax,
    "softmax_in_half_precision": SoftmaxInHalfPrecision,
    "weights_after_dropout": WeightsAfterDropout,
    "dropout_in_eval": DropoutInEval,
    "dropout_without_rescale": DropoutWithoutRescale,
    "rng_ignored_fixed_seed": RngIgnoredFixedSeed,
    "rng_ignored_fresh": RngIgnoredFresh,
    "int_seed_taken_for_none": IntSeedTakenForNone,
    "dropout_shared_by_heads": DropoutSharedByHeads,
    "seed_restarted_at_every_site": SeedRestartedAtEverySite,
    "attention_and_activation_one_stream": AttentionAndActivationOneStream,
    "attention_and_residual_one_stream": AttentionAndResidualOneStream,
    "layernorm_unbiased": LayerNormUnbiased,
    "layernorm_eps_outside_sqrt": LayerNormEpsOutsideSqrt,
    "gelu_tanh": GeluTanh,
    "pre_ln_ignored": PreLnIgnored,
    "ffn_residual_missing": FfnResidualMissing,
    "norms_swapped": NormsSwapped,
    "rms_norm_centred": RmsNormCentred,
    "swiglu_gate_and_up_swapped": SwigluGateAndUpSwapped,
    "kv_heads_interleaved": KvHeadsInterleaved,
    "asarray_widens_float16": AsarrayWidensFloat16,
    "mask_rows_read_as_batch_when_l_equals_b": MaskRowsReadAsBatchWhenLEqualsB,
    "rank_one_mask_dropped_on_the_fast_path": RankOneMaskDroppedOnTheFastPath,
    "queries_scaled_in_place": QueriesScaledInPlace,
    "padding_mask_off_by_one": PaddingMaskOffByOne,
    "dropout_skipped_without_weights": DropoutSkippedWithoutWeights,
    "flex_lse_without_the_maximum": FlexLseWithoutTheMaximum,
}

BROKEN: dict[str, types.ModuleType] = {
    name: as_module(cls(), f"{__name__}.{name}") for name, cls in VARIANTS.items()
}
for _module in BROKEN.values():  # a variant's sdpa takes **options on to einsum_attention's, which names neither, so
    # its signature cannot say so: declared (features of conformance.contract.features)
    _module.CONFORMANCE = Declaration(dict.fromkeys(("sinks", "alibi_slopes"), "einsum_attention takes neither"))
