"""A serving author's view: decoding through a streaming key/value cache (StreamingLLM, SPEC 3c), as attention_np's
MultiHeadAttention and TransformerBlock do it, and variants of it with ONE realistic bug each, which the suite's
decode operation must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.
Streaming cache: s sink tokens, w the window, s + w slots; p_i the position of query i.

Each variant subclasses attention_np's MultiHeadAttention and overrides the one step it gets wrong (which slot a
position lives in, the order a query reads the slots in); its block is attention_np's TransformerBlock holding that
attention (broken_paged's `as_module`). Everything else, the argument checks of attention_np.common.validation
included, is attention_np's, so bad calls raise what the spec requires. Each variant's docstring says the bug and
which check of the suite's decode operation rejects it (the measure names of `conformance.check` rows). No variant
raises on ordinary inputs: the bug is a wrong answer, and each one is right until the ring turns (while
length <= s + w every position is in the slot, and the column, of its own number), so the decode operation's
caches, which never streamed before, passed them.

`STREAMING` is attention_np's correct streaming cache as a module the suite can check; `BROKEN` maps a name to each
variant's.
"""

from __future__ import annotations

import numpy as np

from attention_np import modules
from attention_np.functional import Rng, _turned, scaled_dot_product_attention
from tests.implementations.broken_paged import as_module


class SinksEvicted(modules.MultiHeadAttention):
    """The ring covers every slot: position p lives in slot p % (s + w), so once the sequence is longer than
    s + w the sinks are overwritten by window positions, and each query sees its last s + w positions (a sliding
    window alone, StreamingLLM's failure case) where it should see the first s and its last w. Caught by: values."""

    def _streaming(self, x_q: np.ndarray, x_kv: np.ndarray, cache: modules.StreamingKVCache, *, need_weights: bool,
                   rng: Rng) -> tuple[np.ndarray, np.ndarray | None, modules.StreamingKVCache]:
        out, weights, extended = super()._streaming(x_q, x_kv, cache._replace(sink_tokens=0),  # the bug: no sinks
                                                    need_weights=need_weights, rng=rng)
        return out, weights, extended._replace(sink_tokens=cache.sink_tokens)


class SlotOrder(modules.MultiHeadAttention):
    """Each query reads the cache in slot order, column c the position now in slot c, where SPEC 3c's order is the
    positions' (the sinks, then the window oldest first): once the ring has turned a part of a lap, a query's
    window columns are rotated. Its output is a sum over the keys it sees, which no order changes, while every key
    is turned at its original position; with rope_positions="cache" each key turns at its column, so the output
    changes too, and the weights' columns are out of order either way. Caught by: values (the weights, and the
    output with RoPE at the places), fast_path (the output alone, need_weights=False, with RoPE at the places)."""

    def _streaming(self, x_q: np.ndarray, x_kv: np.ndarray, cache: modules.StreamingKVCache, *, need_weights: bool,
                   rng: Rng) -> tuple[np.ndarray, np.ndarray | None, modules.StreamingKVCache]:
        """attention_np's _streaming (SPEC 3c) with _slot_order_view for _streaming_view: the one change."""
        start, L, slots = cache.length, x_q.shape[-2], cache.k.shape[-2]
        seen, source, place = _slot_order_view(start, L, cache.sink_tokens, slots)  # the bug
        q = self._split_heads(self.w_q(x_q))  # (..., L, D) -> (..., H, L, d_k)
        k = self._split_heads(self.w_k(x_kv), self.num_kv_heads)  # (..., L, D) -> (..., Hkv, L, d_k)
        v = self._split_heads(self.w_v(x_kv), self.num_kv_heads)
        if cache.rope_positions == "original":
            q, k = self._rotated(q, k, start)
        k_seen = np.concatenate([cache.k, k], axis=-2)[..., source, :]  # (..., Hkv, L, slots, d_k)
        v_seen = np.concatenate([cache.v, v], axis=-2)[..., source, :]
        if cache.rope_positions == "cache" and cache.rope is not None:
            cos, sin = cache.rope  # (slots, d_k) each
            q, k_seen = _turned(q, cos[place], sin[place], False), _turned(k_seen, cos, sin, False)
        q = np.swapaxes(q, -2, -3)[..., None, :]  # (..., H, L, d_k) -> (..., L, H, 1, d_k)
        k_seen, v_seen = np.swapaxes(k_seen, -3, -4), np.swapaxes(v_seen, -3, -4)  # (..., L, Hkv, slots, d_k)
        out, weights = scaled_dot_product_attention(q, k_seen, v_seen, seen[:, None, None, :], enable_gqa=self.grouped,
                                                    dropout_p=self.dropout if self.training else 0.0,
                                                    need_weights=need_weights, rng=rng)
        out = np.swapaxes(out[..., 0, :], -2, -3)  # (..., L, H, 1, d_k) -> (..., H, L, d_k)
        if need_weights:
            weights = np.swapaxes(weights[..., 0, :], -2, -3)  # (..., L, H, 1, slots) -> (..., H, L, slots)
        to = modules._streaming_slot(start + np.arange(L), cache.sink_tokens, slots)  # (L,)
        cache.k[..., to, :], cache.v[..., to, :] = k, v
        return self.w_o(self._merge_heads(out)), weights, cache._replace(length=start + L)


def _slot_order_view(start: int, L: int, sink_tokens: int, slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_streaming_view's (seen, source, place) with column c the slot c: the newest position up to p_i that lives in
    it (p_i - (p_i - c) % w in the ring), and the query's own column its own slot."""
    window, p = slots - sink_tokens, start + np.arange(L)  # (L,)
    column = np.arange(slots)  # (slots,)
    at = np.where(column < sink_tokens, column, p[:, None] - (p[:, None] - column) % window)  # (L, slots)
    seen = (at <= p[:, None]) & ((column < sink_tokens) | (at >= sink_tokens))
    older = modules._streaming_slot(np.maximum(at, 0), sink_tokens, slots)  # where a position before this step lives
    source = np.where(at >= start, slots + np.minimum(at - start, L - 1), older)
    return seen, source, modules._streaming_slot(p, sink_tokens, slots)


VARIANTS: dict[str, type[modules.MultiHeadAttention]] = {
    "sinks_evicted": SinksEvicted,
    "slot_order": SlotOrder,
}
STREAMING = as_module(modules.MultiHeadAttention, __name__)
BROKEN = {name: as_module(cls, f"{__name__}.{name}") for name, cls in VARIANTS.items()}
