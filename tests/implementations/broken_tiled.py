"""A tiled kernel's view: an online-softmax attention kernel in NumPy, forward and backward, and variants of it
with ONE realistic bug each, which the suite's flash operation must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The kernel is written apart from attention_np.flash and from the oracle (it shares only the argument checks of
attention_np.common.validation, so that bad calls raise what the spec requires): plain loops over (query tile, key
tile) pairs on (..., L, E) arrays, a running maximum, denominator and output per query tile, and a backward
pass that recomputes each tile's weights from the log-sum-exp. It takes a mask, is_causal, scale and the tile
sizes; its declaration lacks the rest (bias, the keywords of SPEC 2a). Each variant's docstring says the bug and
which check of the suite's flash operation rejects it (the measure names of `conformance.check` rows). No variant
raises on ordinary inputs: the bug is a wrong answer.

`KERNEL` is the correct kernel as a module the suite can check; `BROKEN` maps a name to each variant's module.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import numpy as np

from attention_np.common import validation
from conformance import Declaration, adapters

LACKS = Declaration(lacks=("bias", "q_offset", "window", "key_lengths", "softcap", "enable_gqa", "mods"))


class Tiled:
    """out = softmax(Q K^T * scale over the visible keys) V and lse, tile by tile; each step a method, so that a
    variant overrides exactly the step it gets wrong."""

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, is_causal: bool,
                scale: float | None, block_q: int, block_k: int) -> tuple[np.ndarray, np.ndarray]:
        """out (..., L, Ev) in q's dtype, lse (..., L) in the working dtype."""
        q, k, v, visible, scale = self.prepare(q, k, v, mask, scale)
        batch, (L, S) = visible.shape[:-2], visible.shape[-2:]
        out, lse = np.zeros((*batch, L, v.shape[-1]), q.dtype), np.full((*batch, L), -np.inf, q.dtype)
        for rows in self.tiles(L, block_q):
            m = np.full((*batch, len(rows), 1), -np.inf, q.dtype)  # running maximum
            total = np.zeros_like(m)  # running denominator
            acc = np.zeros((*batch, len(rows), v.shape[-1]), q.dtype)  # running output
            for cols in self.key_tiles(rows, S, block_k, is_causal):
                scores, seen = self.scores(q, k, visible, rows, cols, is_causal, scale)
                m_new = np.maximum(m, scores.max(axis=-1, keepdims=True))
                with np.errstate(invalid="ignore"):  # -inf - -inf: a visible -inf score (infinite inputs) is NaN
                    p = np.where(seen, np.exp(scores - m_new), 0.0)  # (..., block_q, block_k), 0 where hidden
                    alpha = self.rescale(m, m_new)
                total = alpha * total + p.sum(axis=-1, keepdims=True)
                acc = alpha * acc + p @ v[..., cols, :]
                m = m_new
            out[..., rows, :] = acc / np.where(total == 0, 1.0, total)  # a query that sees nothing: zeros
            lse[..., rows] = self.log_sum_exp(m, total)[..., 0]
        return out, lse

    def backward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, is_causal: bool,
                 scale: float | None, block_q: int, block_k: int, out: np.ndarray, lse: np.ndarray,
                 d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """dq, dk, dv for the batch-shaped q, k, v (the adapter sums them back to the inputs' shapes)."""
        q, k, v, visible, scale = self.prepare(q, k, v, mask, scale)
        batch, (L, S) = visible.shape[:-2], visible.shape[-2:]
        dq = np.zeros((*batch, L, q.shape[-1]))
        dk, dv = np.zeros((*batch, S, k.shape[-1])), np.zeros((*batch, S, v.shape[-1]))
        D = np.sum(d_out * out, axis=-1, keepdims=True)  # rowsum(dO * O), (..., L, 1)
        safe_lse = np.where(lse == -np.inf, np.inf, lse)[..., None]  # a query that sees nothing: P = 0
        for rows in self.tiles(L, block_q):
            for cols in self.key_tiles(rows, S, block_k, is_causal):
                scores, _ = self.scores(q, k, visible, rows, cols, is_causal, scale)
                p = self.weights(scores, safe_lse[..., rows, :])
                dv[..., cols, :] += np.swapaxes(p, -1, -2) @ d_out[..., rows, :]
                dp = d_out[..., rows, :] @ np.swapaxes(v[..., cols, :], -1, -2)
                ds = p * (dp - self.row_term(D[..., rows, :], dp, p))
                dq[..., rows, :] += ds @ k[..., cols, :] * scale
                dk[..., cols, :] += np.swapaxes(ds, -1, -2) @ q[..., rows, :] * scale
        return dq, dk, dv

    def prepare(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                scale: float | None) -> tuple:
        """q, k, v broadcast to one batch shape in at least float32, the visibility (..., L, S) of the mask,
        and the scale."""
        batch = validation.attention_batch(q.shape, k.shape, v.shape)
        validation.same_floating_dtype({name: (str(x.dtype), np.issubdtype(x.dtype, np.floating))
                                    for name, x in (("q", q), ("k", k), ("v", v))})
        scale = validation.default_scale(scale, q.shape, k.shape)
        L, S = q.shape[-2], k.shape[-2]
        if mask is not None:
            validation.broadcasts_to("mask", np.shape(mask), (*batch, L, S), "..., L, S")
            mask = np.asarray(mask)
            validation.binary_mask(np.issubdtype(mask.dtype, np.floating), bool(np.all((mask == 0) | (mask == 1))))
        work = np.promote_types(q.dtype, np.float32)
        q, k, v = (np.broadcast_to(x, (*batch, *x.shape[-2:])).astype(work) for x in (q, k, v))
        visible = np.ones((*batch, L, S), bool) if mask is None else np.broadcast_to(mask != 0, (*batch, L, S))
        return q, k, v, visible, scale

    def tiles(self, n: int, block: int) -> list[np.ndarray]:
        return [np.arange(start, min(start + block, n)) for start in range(0, n, block)]

    def key_tiles(self, rows: np.ndarray, S: int, block_k: int, is_causal: bool) -> list[np.ndarray]:
        """The key tiles some query of `rows` may see: with is_causal, those starting at or before its last
        query (query i sees keys j <= i)."""
        return [cols for cols in self.tiles(S, block_k) if not is_causal or cols[0] <= rows[-1]]

    def scores(self, q: np.ndarray, k: np.ndarray, visible: np.ndarray, rows: np.ndarray, cols: np.ndarray,
               is_causal: bool, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """The tile's q k^T * scale, -inf where hidden, and where it is seen (..., block_q, block_k)."""
        scores = q[..., rows, :] * scale @ np.swapaxes(k[..., cols, :], -1, -2)  # the scale first (SPEC 10)
        seen = visible[..., rows[:, None], cols]
        if is_causal:
            seen = seen & (cols <= rows[:, None])
        return np.where(seen, scores, -np.inf), seen

    def rescale(self, m: np.ndarray, m_new: np.ndarray) -> np.ndarray:
        """exp(m_old - m_new): what was summed against the old maximum, moved to the new one (0 where nothing
        was seen yet: the sums are 0, or NaN, which stays NaN)."""
        return np.where(m == -np.inf, 0.0, np.exp(m - m_new))

    def log_sum_exp(self, m: np.ndarray, total: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.where(total == 0, -np.inf, m + np.log(total))

    def weights(self, scores: np.ndarray, lse: np.ndarray) -> np.ndarray:
        """P = exp(S - lse): the normalised weights again."""
        return np.exp(scores - lse)

    def row_term(self, D: np.ndarray, dp: np.ndarray, p: np.ndarray) -> np.ndarray:
        """rowsum(dP * P) over the whole row, which is rowsum(dO * O) = D."""
        return D


def as_module(kernel: Tiled, name: str) -> types.ModuleType:
    """A module object with what the suite needs of a tiled kernel: flash_attention and its vjp, NumPy's array
    conversions and the declaration of what the kernel lacks."""
    module = types.ModuleType(name, f"flash_attention from the tiled kernel {type(kernel).__name__}.")
    module.asarray, module.to_numpy = adapters.arrays("numpy")
    module.CONFORMANCE = LACKS

    def flash_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                        is_causal: bool = False, scale: float | None = None, block_q: int = 128,
                        block_k: int = 128) -> tuple[np.ndarray, np.ndarray]:
        validation.tiles(block_q, block_k)
        out, lse = kernel.forward(q, k, v, mask, is_causal, scale, block_q, block_k)
        return out.astype(q.dtype), lse

    def flash_attention_vjp(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                            is_causal: bool = False, scale: float | None = None, block_q: int = 128,
                            block_k: int = 128) -> tuple[np.ndarray, np.ndarray, Callable]:
        out, lse = flash_attention(q, k, v, mask, is_causal=is_causal, scale=scale, block_q=block_q, block_k=block_k)

        def pullback(d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, None]:
            validation.cotangent("d_out", d_out.shape, out.shape, {name: (str(x.dtype), True) for name, x in
                                                              (("d_out", d_out), ("out", out))})
            grads = kernel.backward(q, k, v, mask, is_causal, scale, block_q, block_k, out, lse, d_out)
            return (*(_sum_to(d, x.shape).astype(x.dtype) for d, x in zip(grads, (q, k, v), strict=True)), None)

        return out, lse, pullback

    module.flash_attention, module.flash_attention_vjp = flash_attention, flash_attention_vjp
    return module


def _sum_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """x summed over the axes along which an array of `shape` was broadcast."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape)))) if x.ndim > len(shape) else x
    return x.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1), keepdims=True)


# --- the forward pass ------------------------------------------------------------------------------------


class NotRescaled(Tiled):
    """The running output and denominator are not rescaled when the running maximum grows: each tile's
    exp(S - m_new) is added to sums taken against older maxima. Right while the first tile holds each row's
    maximum, wrong as soon as a later tile raises it. Caught by: values; lse."""

    def rescale(self, m: np.ndarray, m_new: np.ndarray) -> np.ndarray:
        return np.where(m == -np.inf, 0.0, 1.0)  # the bug: exp(m_old - m_new) taken as 1


class LastPartialTileDropped(Tiled):
    """The key tiles counted as S // block_k, so the keys of a last, shorter tile are never seen (a grid of
    S // block_k programs). Right when block_k divides S. Caught by: values; lse."""

    def key_tiles(self, rows: np.ndarray, S: int, block_k: int, is_causal: bool) -> list[np.ndarray]:
        whole = [cols for cols in super().key_tiles(rows, S, block_k, is_causal) if len(cols) == block_k]
        return whole or super().key_tiles(rows, S, block_k, is_causal)[:1]  # the bug: a partial tile dropped


class PartlyHiddenTileSkipped(Tiled):
    """With is_causal, a key tile is skipped unless it is visible to every query of the query tile (the test
    for "hidden to some" used where "hidden to all" is meant): the tiles the diagonal crosses are lost.
    Caught by: values (is_causal, tiles of more than one key)."""

    def key_tiles(self, rows: np.ndarray, S: int, block_k: int, is_causal: bool) -> list[np.ndarray]:
        tiles = [cols for cols in self.tiles(S, block_k) if not is_causal or cols[-1] <= rows[0]]
        return tiles or self.tiles(S, block_k)[:1]  # the bug: only the tiles wholly below the diagonal


class LseWithoutTheMaximum(Tiled):
    """lse = log(l), the log of the denominator taken against the running maximum, without the maximum added
    back (log sum exp(S) = m + log sum exp(S - m)). out is right. Caught by: lse."""

    def log_sum_exp(self, m: np.ndarray, total: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.where(total == 0, -np.inf, np.log(total))  # the bug: m left out


# --- the backward pass -----------------------------------------------------------------------------------


class BackwardUnnormalisedWeights(Tiled):
    """The backward pass recomputes P as exp(S), the unnormalised weights, without subtracting the
    log-sum-exp. Caught by: gradients."""

    def weights(self, scores: np.ndarray, lse: np.ndarray) -> np.ndarray:
        return np.where(np.isinf(lse), 0.0, np.exp(scores))  # the bug: exp(S), not exp(S - lse)


class RowTermFromTheTile(Tiled):
    """dS = P * (dP - rowsum(dP * P)) with the row sum taken over the current key tile alone, as the untiled
    backward pass does over its whole row: right with one key tile, wrong with several, where FlashAttention-2
    uses D = rowsum(dO * O). Caught by: gradients."""

    def row_term(self, D: np.ndarray, dp: np.ndarray, p: np.ndarray) -> np.ndarray:
        return np.sum(dp * p, axis=-1, keepdims=True)  # the bug: this tile's share of the row sum only


VARIANTS: dict[str, type[Tiled]] = {
    "not_rescaled": NotRescaled,
    "last_partial_tile_dropped": LastPartialTileDropped,
    "partly_hidden_tile_skipped": PartlyHiddenTileSkipped,
    "lse_without_the_maximum": LseWithoutTheMaximum,
    "backward_unnormalised_weights": BackwardUnnormalisedWeights,
    "row_term_from_the_tile": RowTermFromTheTile,
}
KERNEL = as_module(Tiled(), __name__)
BROKEN = {name: as_module(cls(), f"{__name__}.{name}") for name, cls in VARIANTS.items()}
