"""A kernel author's view: a NumPy attention kernel in the (B, L, H, E) layout, wrapped for the suite by
`conformance.adapters`, and variants of it with ONE realistic bug each, which the suite must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The kernel is written independently of our backends and of the oracle: one einsum over "blhe,bshe->bhls"
for the scores, a softmax over the visible keys, one einsum back to (B, L, H, Ev). It takes the mask as the
adapter hands it over (boolean, True keeps, (B, H, L, S)), `is_causal` and `scale`; its declaration lacks the
rest (bias, the keywords of SPEC 2a, dropout, weights). Each variant's docstring says the bug and which check
of the suite's sdpa operation rejects it (the measure names of `conformance.check` rows). No kernel raises on
ordinary inputs: the bug is a wrong answer (one variant's a wrong shape, which the adapter cannot put back).

This module exposes the correct kernel as the suite needs it (asarray, to_numpy, scaled_dot_product_attention,
CONFORMANCE), so `python -m conformance check tests.implementations.broken_kernels` checks it; `KERNEL` is that
module, and `BROKEN` maps a name to each variant as a module object of its own.
"""

from __future__ import annotations

import math
import sys
import types

import numpy as np

from conformance import adapters


class Kernel:
    """Attention(Q, K, V) = softmax(Q K^T * scale over the visible keys) V, on (B, L, H, E) arrays.

    Each step is a method, so that a variant overrides exactly the step it gets wrong."""

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray | None = None,
                 is_causal: bool = False, scale: float | None = None) -> np.ndarray:
        """Args: q (B, L, H, E), k (B, S, H, E), v (B, S, H, Ev); mask bool (B, H, L, S), True where query i
        sees key j; is_causal: query i sees keys j <= i (top-left); scale: 1 / sqrt(E) when None.
        Returns: out (B, L, H, Ev) in q's dtype (float16 computed in float32)."""
        dtype, work = q.dtype, self.work_dtype(q.dtype)
        q, k, v = q.astype(work), k.astype(work), v.astype(work)
        # 1) scores, with the scale folded into q first (SPEC 10: the scale comes first)
        scores = self.scores(q * np.asarray(self.scale(q.shape, scale), work), k)  # -> (B, H, L, S)
        # 2) which keys each query sees
        visible = self.visible(mask, is_causal, scores.shape)  # (B, H, L, S)
        # 3) softmax over the visible keys; a query that sees none gets zeros
        weights = self.softmax(scores, visible)  # (B, H, L, S)
        # 4) the values, back in the kernel's layout
        return self.attend(weights, v).astype(dtype, copy=False)  # (B, L, H, Ev)

    def work_dtype(self, dtype: np.dtype) -> np.dtype:
        return np.promote_types(dtype, np.float32)  # float16 is computed in float32 (SPEC 2)

    def scale(self, shape: tuple[int, ...], scale: float | None) -> float:
        E = shape[-1]  # (B, L, H, E)
        return 1.0 / math.sqrt(E) if scale is None else scale

    def scores(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        return np.einsum("blhe,bshe->bhls", q, k)  # (B, L, H, E) x (B, S, H, E) -> (B, H, L, S)

    def visible(self, mask: np.ndarray | None, is_causal: bool, shape: tuple[int, ...]) -> np.ndarray:
        L, S = shape[-2:]  # (B, H, L, S)
        visible = np.ones(shape, bool) if mask is None else mask  # (B, H, L, S)
        return visible & self.causal(L, S) if is_causal else visible  # (B, H, L, S) & (L, S)

    def causal(self, L: int, S: int) -> np.ndarray:
        return np.arange(S) <= np.arange(L)[:, None]  # (L, S): key j <= query i, top-left aligned

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        """weights = exp(s - max) / sum exp(s - max) over the visible keys of each row, zeros elsewhere."""
        seen = visible.any(axis=-1, keepdims=True)  # (B, H, L, 1): the query sees some key
        kept = np.where(visible, scores, -np.inf)  # hidden keys left out, never filled with a constant
        row_max = np.max(kept, axis=-1, keepdims=True, initial=-np.inf)  # (B, H, L, 1)
        exp = np.exp(kept - np.where(seen, row_max, 0))  # no visible key: nothing to subtract
        total = exp.sum(axis=-1, keepdims=True)  # (B, H, L, 1)
        return np.where(visible, exp / np.where(seen, total, 1), 0)  # the fully masked row: zeros, not 0 / 0

    def attend(self, weights: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.einsum("bhls,bshv->blhv", weights, v)  # (B, H, L, S) x (B, S, H, Ev) -> (B, L, H, Ev)


def as_module(kernel: Kernel, name: str) -> types.ModuleType:
    """A module object with what the suite needs of a kernel's module: the kernel adapted from (B, L, H, E) and
    a mask that keeps, NumPy's array conversions, and the declaration of what the kernel's signature lacks."""
    module = types.ModuleType(name, f"scaled_dot_product_attention from the (B, L, H, E) kernel "
                                    f"{type(kernel).__name__}, through conformance.adapters.")
    module.asarray, module.to_numpy = adapters.arrays("numpy")
    module.scaled_dot_product_attention = adapters.sdpa(kernel, layout="BLHE", mask="keep")
    module.CONFORMANCE = module.scaled_dot_product_attention.declaration  # NumPy can do the rest: nothing to add
    return module


# --- the layout ------------------------------------------------------------------------------------------


class OutputInBhleLayout(Kernel):
    """The value product is returned as the einsum gives it, (B, H, L, Ev), where the layout asks for
    (B, L, H, Ev): a kernel first written for (B, H, L, E) and ported by changing its inputs only. Where L != H
    the adapter cannot put the output back (a reshape of the wrong size raises); where L == H the shape is
    right and queries and heads are swapped. Caught by: call (L != H); values (L == H)."""

    def attend(self, weights: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.einsum("bhls,bshv->bhlv", weights, v)  # the bug: (B, H, L, Ev), not (B, L, H, Ev)


class OutputReshapedNotTransposed(Kernel):
    """The value product comes out as (B, H, L, Ev) and is put into the layout with reshape(B, L, H, Ev)
    instead of a transpose (nanoGPT's `y.transpose(1, 2).contiguous().view(B, T, C)` without the transpose):
    the shape is right, the rows are those of other heads and queries. Caught by: values (H > 1, L > 1)."""

    def attend(self, weights: np.ndarray, v: np.ndarray) -> np.ndarray:
        out = np.einsum("bhls,bshv->bhlv", weights, v)  # (B, H, L, S) x (B, S, H, Ev) -> (B, H, L, Ev)
        B, H, L, Ev = out.shape
        return out.reshape(B, L, H, Ev)  # the bug: the entries stay in (B, H, L, Ev) order


class MaskReshapedNotTransposed(Kernel):
    """The scores are kept in the kernel's own (B, L, H, S) layout, and the mask, which comes as (B, H, L, S),
    is put into it with reshape(B, L, H, S) instead of a transpose: head h of query i reads the mask of another
    (head, query) pair. Right for masks shared by the heads and queries (padding, one key); wrong for a causal
    or per-head mask. Caught by: values (a mask that differs between queries or heads, H > 1)."""

    def scores(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        return np.einsum("blhe,bshe->blhs", q, k)  # (B, L, H, E) x (B, S, H, E) -> (B, L, H, S)

    def visible(self, mask: np.ndarray | None, is_causal: bool, shape: tuple[int, ...]) -> np.ndarray:
        B, L, H, S = shape
        visible = np.ones(shape, bool) if mask is None else mask.reshape(B, L, H, S)  # the bug: no transpose
        return visible & self.causal(L, S)[:, None, :] if is_causal else visible  # (B, L, H, S) & (L, 1, S)

    def attend(self, weights: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.einsum("blhs,bshv->blhv", weights, v)  # (B, L, H, S) x (B, S, H, Ev) -> (B, L, H, Ev)


class SoftmaxOverTheSequenceAxis(Kernel):
    """The softmax taken over axis 1, "the sequence axis of BLHE", of scores laid out (B, L, H, S): that axis
    holds the queries, so each key's column sums to 1 instead of each query's row.
    Caught by: values (L > 1; the weights are not returned, so weights_rows cannot see it)."""

    def scores(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        return np.einsum("blhe,bshe->blhs", q, k)  # (B, L, H, E) x (B, S, H, E) -> (B, L, H, S)

    def visible(self, mask: np.ndarray | None, is_causal: bool, shape: tuple[int, ...]) -> np.ndarray:
        L, S = shape[1], shape[3]  # (B, L, H, S)
        visible = np.ones(shape, bool) if mask is None else np.swapaxes(mask, 1, 2)  # (B, H, L, S) -> (B, L, H, S)
        return visible & self.causal(L, S)[:, None, :] if is_causal else visible  # (B, L, H, S) & (L, 1, S)

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        axis = 1  # the bug: the sequence axis of q's layout is the query axis of the scores'
        seen = visible.any(axis=axis, keepdims=True)
        kept = np.where(visible, scores, -np.inf)
        row_max = np.max(kept, axis=axis, keepdims=True, initial=-np.inf)
        exp = np.exp(kept - np.where(seen, row_max, 0))
        return np.where(visible, exp / np.where(seen, exp.sum(axis=axis, keepdims=True), 1), 0)

    def attend(self, weights: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.einsum("blhs,bshv->blhv", weights, v)  # (B, L, H, S) x (B, S, H, Ev) -> (B, L, H, Ev)


# --- scale and causal rule -------------------------------------------------------------------------------


class ScaleFromDModel(Kernel):
    """The default scale 1 / sqrt(H * E), the model width D read off the (B, L, H, E) input, instead of
    1 / sqrt(E), each head's width. Caught by: values (no scale given, H > 1)."""

    def scale(self, shape: tuple[int, ...], scale: float | None) -> float:
        H, E = shape[-2:]  # (B, L, H, E)
        return 1.0 / math.sqrt(H * E) if scale is None else scale


class CausalBottomRight(Kernel):
    """The causal triangle aligned at the bottom-right corner, np.tril(ones((L, S)), k=S - L) (FlashAttention-2's
    rule for L != S), where the contract's is_causal is top-left: query i sees keys 0..i + S - L. The same
    triangle when L == S. Caught by: values (is_causal, L != S: the examples causal_more_keys, causal_more_queries);
    causal_prefix."""

    def causal(self, L: int, S: int) -> np.ndarray:
        return np.tril(np.ones((L, S), bool), k=S - L)  # (L, S): key j <= i + S - L


class CausalReplacesMask(Kernel):
    """With is_causal the mask is dropped for the causal triangle (the kernel takes one or the other, as
    F.scaled_dot_product_attention refuses attn_mask with is_causal): padded keys are seen again.
    Caught by: values (is_causal with a mask)."""

    def visible(self, mask: np.ndarray | None, is_causal: bool, shape: tuple[int, ...]) -> np.ndarray:
        L, S = shape[-2:]  # (B, H, L, S)
        if is_causal:  # the bug: the caller's mask is forgotten
            return np.broadcast_to(self.causal(L, S), shape)  # (L, S) -> (B, H, L, S)
        return np.ones(shape, bool) if mask is None else mask


# --- the softmax ---------------------------------------------------------------------------------------


class MaskedRowNaN(Kernel):
    """Hidden scores set to -inf and no guard for a query that sees no key: its row maximum is -inf, then
    exp(-inf - -inf) = NaN and 0 / 0 = NaN, where the contract asks for a row of zeros.
    Caught by: values (fully masked rows); single_key (a query that sees no key)."""

    def softmax(self, scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
        kept = np.where(visible, scores, -np.inf)
        with np.errstate(invalid="ignore"):
            exp = np.exp(kept - kept.max(axis=-1, keepdims=True))  # (B, H, L, S) - (B, H, L, 1)
            return exp / exp.sum(axis=-1, keepdims=True)


class SoftmaxInInputPrecision(Kernel):
    """The scores, softmax and value product in the input's dtype: float16 inputs are not computed in float32
    (SPEC 2), so scores in the hundreds are rounded to a few hundredths before the softmax.
    Caught by: values (float16: keys sharing a vector of size 300, scores that differ by about one)."""

    def work_dtype(self, dtype: np.dtype) -> np.dtype:
        return dtype


_correct = as_module(Kernel(), __name__)  # the correct kernel as this module's own names
asarray, to_numpy = _correct.asarray, _correct.to_numpy
scaled_dot_product_attention, CONFORMANCE = _correct.scaled_dot_product_attention, _correct.CONFORMANCE
KERNEL = sys.modules[__name__]

VARIANTS: dict[str, type[Kernel]] = {
    "output_in_bhle_layout": OutputInBhleLayout,
    "output_reshaped_not_transposed": OutputReshapedNotTransposed,
    "mask_reshaped_not_transposed": MaskReshapedNotTransposed,
    "softmax_over_the_sequence_axis": SoftmaxOverTheSequenceAxis,
    "scale_from_d_model": ScaleFromDModel,
    "causal_bottom_right": CausalBottomRight,
    "causal_replaces_mask": CausalReplacesMask,
    "masked_row_nan": MaskedRowNaN,
    "softmax_in_input_precision": SoftmaxInInputPrecision,
}

BROKEN: dict[str, types.ModuleType] = {
    name: as_module(cls(), f"{__name__}.{name}") for name, cls in VARIANTS.items()
}
