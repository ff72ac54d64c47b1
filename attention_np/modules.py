"""Multi-head attention and the transformer block, as immutable NumPy modules.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The classes users read come first, MultiHeadAttention and TransformerBlock; the pieces they are built
from (Linear, LayerNorm, RMSNorm, FeedForward, GatedFeedForward) follow; their activations are in primitives.py.
Parameter names and layouts are those of the PyTorch classes: nn.Linear keeps weight (out, in) and computes
y = x W^T + b (no b with bias=False); LayerNorm keeps weight (D,) and bias (D,), RMSNorm weight (D,).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np

from attention_np.common import pages, validation
from attention_np.common.module import Module

from .arrays import asarray
from .functional import Rng, _dropout, _dtypes, _rngs, _rope_table, _turned, _ungrouped, scaled_dot_product_attention
from .gradients import multi_head_attention_vjp, transformer_block_vjp
from .linear import FEATURE_MAPS, linear_attention, linear_attention_state
from .primitives import _activation, _gated, alibi_slopes, window_mask


class KVCache(NamedTuple):
    """The keys and values of the positions seen so far, each (..., Hkv, capacity, d_k), filled at positions
    0 .. length - 1: `length` an int (every sequence as long) or an integer array (...), one length per sequence.
    NumPy: extend writes the new positions into these arrays in place and returns a cache with the longer
    length; the positions an older cache covers never change. `rope`: RoPE's cos and sin tables (capacity, d_k)
    for the positions 0 .. capacity - 1, which init_cache makes once for a module with rope_theta, so that a step
    reads its angles (None: extend makes the angles of its positions)."""

    k: np.ndarray
    v: np.ndarray
    length: int | np.ndarray
    rope: tuple[np.ndarray, np.ndarray] | None = None


class PagedKVCache(NamedTuple):
    """A paged cache (vLLM's PagedAttention): the keys and values of every sequence in one pool of pages, k and v
    (num_pages, Hkv, page_size, d_k); sequence b's position p in page block_table[b, p // page_size], slot
    p % page_size (an entry -1: no page); length (B,) the positions each sequence holds. A sequence's pages
    need not be consecutive nor in order, and a page freed by one sequence serves another. `reserve` gives the
    sequences the pages their next positions need before extend writes them; `release` frees sequences'
    pages. NumPy: extend writes into the pool in place, as KVCache's arrays. `rope`: the tables of positions
    0 .. max_pages * page_size - 1, as KVCache's."""

    k: np.ndarray
    v: np.ndarray
    block_table: np.ndarray
    length: np.ndarray
    rope: tuple[np.ndarray, np.ndarray] | None = None

    def reserve(self, new_lengths: np.ndarray) -> PagedKVCache:
        """The cache with pages for new_lengths (B,) more positions of each sequence (free pages, lowest first)."""
        table = pages.reserve(self.block_table, self.length, np.asarray(new_lengths), self.k.shape[0],
                              self.k.shape[-2])
        return self._replace(block_table=table)

    def release(self, sequences: np.ndarray) -> PagedKVCache:
        """The cache with the pages of `sequences` (indices or a boolean (B,)) freed and their lengths 0."""
        length = np.array(self.length, copy=True)
        length[np.asarray(sequences)] = 0
        return self._replace(block_table=pages.release(self.block_table, sequences), length=length)


class StreamingKVCache(NamedTuple):
    """A streaming cache (StreamingLLM): the first sink_tokens positions and the last window = slots - sink_tokens
    positions in slots = sink_tokens + window slots, k and v (..., Hkv, slots, d_k). Position p < sink_tokens lives
    in slot p forever; p >= sink_tokens in slot sink_tokens + (p - sink_tokens) % window, a ring over which nothing
    moves. length: an int, the positions seen so far (unbounded). rope_positions "original": the keys are stored
    turned at their positions; "cache": stored unturned and turned when read, at their column in the cache's order,
    `rope` the tables of columns 0 .. slots - 1. NumPy: extend writes in place, so an older cache's slots change."""

    k: np.ndarray
    v: np.ndarray
    length: int
    sink_tokens: int
    rope: tuple[np.ndarray, np.ndarray] | None = None
    rope_positions: str = "original"


class LinearCache(NamedTuple):
    """The cache of attention="linear" (SPEC 3a): the recurrent state of causal linear attention over the positions
    0 .. length - 1, S = sum_j phi(k_j) v_j^T (..., Hkv, d_k, d_k) and z = sum_j phi(k_j) (..., Hkv, d_k), one per
    key/value head (linear_attention_state's), in at least float32; length an int. Its size does not grow with the
    positions: decoding holds constant memory. NumPy: extend returns new arrays; an older cache stays as it was."""

    S: np.ndarray
    z: np.ndarray
    length: int


class MultiHeadAttention(Module):
    """Multi-head attention: H heads of scaled dot-product attention, each on a d_k = D / H slice; with
    num_kv_heads, grouped-query attention: Hkv key/value heads, each shared by H / Hkv query heads; with
    attention="linear", the same projections around linear attention in each head; with sinks=True, a learned
    sink logit per head (gpt-oss's `sinks`) in every softmax's denominator; with position="alibi", ALiBi's bias
    -slope_h * |p_i - j| (alibi_slopes(H)) in every head's scores, BLOOM's and MPT's position encoding."""

    _children = ("sinks", "w_q", "w_k", "w_v", "w_o")  # sinks None without sinks=True; first, as torch's own
    # parameters come before its sub-modules' in a state dict
    _settings = ("num_heads", "num_kv_heads", "rope_theta", "position", "attention", "dropout", "training")

    def __init__(self, d_model: int = 512, num_heads: int = 8, dropout: float = 0.1, *,
                 num_kv_heads: int | None = None, bias: bool = True, rope_theta: float | None = None,
                 position: str | None = None, attention: str = "softmax", sinks: bool = False, rng: Rng = None,
                 dtype: Any = None) -> None:
        """Args: sizes as named; dropout on the attention weights; num_kv_heads Hkv, dividing num_heads
        (None: num_heads), sizes w_k and w_v (Hkv * d_k, D); bias=False drops the four projections' biases;
        rope_theta (None: off) turns each head's queries and keys by their positions (apply_rope, half
        rotation, base rope_theta); position None (rope_theta decides: RoPE where it is given, else none),
        "rope" (needs rope_theta) or "alibi" (ALiBi's bias with alibi_slopes(H); softmax attention, no
        rope_theta); attention "softmax" (scaled dot-product attention) or "linear"
        (linear_attention with its defaults: no mask, no weights, so dropout must be 0); sinks=True adds the
        parameter `sinks` (H,), one sink logit per query head (scaled_dot_product_attention's sinks), initialised
        to zeros (softmax attention only); rng and dtype (float32 by default) for the initial parameters, drawn
        as nn.Linear draws them."""
        validation.module_sizes(d_model, num_heads)
        num_kv_heads = validation.kv_heads(num_heads, num_kv_heads)
        rope_theta = validation.rope_theta(rope_theta, d_model, num_heads)
        validation.probability("dropout", dropout)
        validation.attention(attention, dropout)
        validation.attention_sinks(attention, sinks)
        position = validation.position(position, rope_theta, attention)
        rngs, dtype = _rngs(rng, 4), np.float32 if dtype is None else dtype
        shapes = validation.mha_state_shapes(d_model, num_heads, num_kv_heads)
        projections = {name: Linear.initialized(d_model, shapes[f"{name}.weight"][0], rng, dtype, bias=bias)
                       for name, rng in zip(validation.PROJECTIONS, rngs, strict=True)}
        self._init(**projections, sinks=np.zeros(num_heads, dtype) if sinks else None, num_heads=num_heads,
                   num_kv_heads=num_kv_heads, rope_theta=rope_theta, position=position, attention=attention,
                   dropout=dropout,
                   training=True)

    @property
    def alibi_slopes(self) -> np.ndarray | None:
        """ALiBi's slopes (H,), alibi_slopes(H), with position="alibi"; None otherwise."""
        return alibi_slopes(self.num_heads) if self.position == "alibi" else None

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, num_heads: int, dropout: float = 0.1,
                        rope_theta: float | None = None, position: str | None = None,
                        attention: str = "softmax") -> MultiHeadAttention:
        """A module holding `state` (NumPy or native arrays; computes in their dtype), in training mode; with
        sinks=True's parameters where the state holds `sinks` (H,); position as for the constructor."""
        state = {name: asarray(value) for name, value in state.items()}
        shapes = {name: value.shape for name, value in state.items()}
        layout = validation.mha_layout(shapes, num_heads)  # d_model, num_kv_heads, bias and sinks, from the shapes
        rope_theta = validation.rope_theta(rope_theta, layout.d_model, num_heads)
        validation.probability("dropout", dropout)
        validation.attention(attention, dropout)
        validation.attention_sinks(attention, layout.sinks)
        position = validation.position(position, rope_theta, attention)
        validation.state(cls.__name__, shapes, validation.mha_state_shapes(num_heads=num_heads, **layout._asdict()))
        validation.same_floating_dtype(_dtypes(**state), f"{cls.__name__}.from_state_dict: ")
        projections = {name: Linear(state[f"{name}.weight"], state.get(f"{name}.bias"))
                       for name in validation.PROJECTIONS}
        return cls._build(**projections, sinks=state.get("sinks"), num_heads=num_heads,
                          num_kv_heads=layout.num_kv_heads, rope_theta=rope_theta, position=position,
                          attention=attention,
                          dropout=dropout, training=True)

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                 is_causal: bool = False, need_weights: bool = True, rng: Rng = None,
                 mask_mod: Callable[..., Any] | None = None,
                 score_mod: Callable[..., Any] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o^T + b_o,
        head_h = Attention(Q W_q,h^T + b_q,h, K W_k,g^T + b_k,g, V W_v,g^T + b_v,g), g = h // (H / Hkv),
        Attention: scaled_dot_product_attention, or linear_attention with attention="linear".

        Args:
            q: queries (..., L, D).
            k: keys (..., S, D).
            v: values (..., S, D).
            mask: broadcasts to (..., H, L, S); an entry equal to 0 / False hides that key. attention="linear":
                None (linear attention takes no mask).
            is_causal: query i sees keys j <= i (and-ed with mask); needs L == S with attention="linear", whose
                causal form is the one extend continues.
            need_weights: return the weights; with False the second result is None. attention="linear" forms
                no weights: None always.
            rng: dropout randomness: a NumPy Generator or an int seed (None: fresh randomness).
            mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
                needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
            score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and
                before bias; needs four axes as mask_mod.

        Returns:
            out (..., L, D) and weights (..., H, L, S) per head, before dropout (or None); with sinks, the keys'
            probabilities, which sum to less than 1.
        """
        self._check_inputs(q, k, v, mask, mask_mod, score_mod)

        # 1) project, then split into heads of width d_k: H query heads, Hkv key/value heads
        q = self._split_heads(self.w_q(q), self.num_heads)  # (..., L, D) -> (..., H, L, d_k)
        k = self._split_heads(self.w_k(k), self.num_kv_heads)  # (..., S, D) -> (..., Hkv, S, d_k)
        v = self._split_heads(self.w_v(v), self.num_kv_heads)  # (..., S, D) -> (..., Hkv, S, d_k)
        q, k = self._rotated(q, k, 0)  # RoPE: query i at position i, key j at j

        # 2) attend, every head at once; query head h reads key/value head h // (H / Hkv)
        if self.attention == "linear":  # no mask (checked above), no weights, no dropout (the constructor's check)
            out, weights = self._linear_heads(q, k, v, is_causal), None  # (..., H, L, d_k)
        else:
            dropout_p = self.dropout if self.training else 0.0
            out, weights = scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, dropout_p=dropout_p,
                                                        need_weights=need_weights, rng=rng,
                                                        enable_gqa=self.grouped, mask_mod=mask_mod,
                                                        score_mod=score_mod, sinks=self.sinks,
                                                        alibi_slopes=self.alibi_slopes)  # (..., H, L, d_k)

        # 3) concatenate the heads and mix them
        return self.w_o(self._merge_heads(out)), weights  # (..., H, L, d_k) -> (..., L, D)

    def vjp(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
            is_causal: bool = False, mask_mod: Callable[..., Any] | None = None,
            score_mod: Callable[..., Any] | None = None) -> tuple[np.ndarray, np.ndarray, Callable]:
        """out, weights (None with attention="linear") and pullback(d_out) -> (dq, dk, dv, {state-dict name:
        gradient}), without dropout; is_causal, mask_mod and score_mod as for __call__, the score function's
        parameters' gradients under "score_mod.<name>"."""
        return multi_head_attention_vjp(self, q, k, v, mask, is_causal=is_causal, mask_mod=mask_mod,
                                        score_mod=score_mod)

    def init_cache(self, batch_shape: tuple[int, ...], capacity: int, *, dtype: Any = None, sink_tokens: int = 0,
                   window: int | None = None,
                   rope_positions: str = "original") -> KVCache | StreamingKVCache | LinearCache:
        """An empty cache for inputs with leading axes `batch_shape` and up to `capacity` positions: keys and
        values (*batch_shape, Hkv, capacity, d_k) of zeros, length 0, in `dtype` (the parameters' by default);
        with rope_theta, the cos and sin of every position's angles, (capacity, d_k) in at least float32.
        With window, a streaming cache (StreamingKVCache, SPEC 3c): the first sink_tokens positions and the
        last window ones in sink_tokens + window <= capacity slots, for any number of positions; RoPE at the
        original positions, or at the places in the cache with rope_positions="cache".
        With attention="linear", the recurrent state (LinearCache, SPEC 3a): S and z of zeros in at least float32,
        of the same size for any number of positions (capacity checked, not a bound; no streaming options)."""
        batch_shape = validation.cache_size(batch_shape, capacity)
        if self.attention == "linear":
            return self._linear_cache(batch_shape, dtype, sink_tokens, window, rope_positions)
        streaming = validation.streaming_sizes(capacity, sink_tokens, window, rope_positions)
        slots = sink_tokens + window if streaming else capacity
        d_k = self.w_q.weight.shape[1] // self.num_heads
        shape = (*batch_shape, self.num_kv_heads, slots, d_k)  # (..., Hkv, capacity, d_k)
        dtype = self.w_q.weight.dtype if dtype is None else dtype
        rope = None
        if self.rope_theta is not None and not (streaming and rope_positions == "original"):
            # made once, for positions 0 .. slots - 1 (a streaming cache's columns): a step slices its angles; a
            # streaming cache's original positions are unbounded, so each step makes theirs
            rope = _rope_table(np.arange(slots), d_k, self.rope_theta, np.promote_types(dtype, np.float32), False)
        if streaming:
            return StreamingKVCache(np.zeros(shape, dtype), np.zeros(shape, dtype), length=0, sink_tokens=sink_tokens,
                                    rope=rope, rope_positions=rope_positions)
        return KVCache(np.zeros(shape, dtype), np.zeros(shape, dtype), length=0, rope=rope)

    def _linear_cache(self, batch_shape: tuple[int, ...], dtype: Any, sink_tokens: int, window: int | None,
                      rope_positions: str) -> LinearCache:
        """init_cache with attention="linear": linear_attention_state's zeros per key/value head, in at least float32
        (the dtype the chunks compute in)."""
        validation.linear_cache(sink_tokens, window, rope_positions)
        d_k = self.w_q.weight.shape[1] // self.num_heads
        dtype = np.promote_types(self.w_q.weight.dtype if dtype is None else dtype, np.float32)
        S, z = linear_attention_state((*batch_shape, self.num_kv_heads), d_k, d_k, dtype=dtype)  # (..., Hkv, d_k, d_k)
        return LinearCache(S, z, length=0)

    def init_paged_cache(self, batch_size: int, num_pages: int, page_size: int, max_pages: int, *,
                         dtype: Any = None) -> PagedKVCache:
        """An empty paged cache: a pool of num_pages pages of page_size positions, keys and values (num_pages, Hkv,
        page_size, d_k) of zeros in `dtype` (the parameters' by default), for batch_size sequences of up to
        max_pages pages each (block table (batch_size, max_pages) of -1, lengths 0); with rope_theta, the tables
        of the positions 0 .. max_pages * page_size - 1. Softmax attention's only."""
        validation.cached(self.attention)
        validation.paged_sizes(batch_size, num_pages, page_size, max_pages)
        d_k = self.w_q.weight.shape[1] // self.num_heads
        shape = (num_pages, self.num_kv_heads, page_size, d_k)  # (P, Hkv, page, d_k)
        dtype = self.w_q.weight.dtype if dtype is None else dtype
        rope = None
        if self.rope_theta is not None:
            rope = _rope_table(np.arange(max_pages * page_size), d_k, self.rope_theta,
                               np.promote_types(dtype, np.float32), False)
        return PagedKVCache(k=np.zeros(shape, dtype), v=np.zeros(shape, dtype),
                            block_table=np.full((batch_size, max_pages), pages.NO_PAGE),
                            length=np.zeros(batch_size, np.int64), rope=rope)

    def extend(self, x_q: np.ndarray, x_kv: np.ndarray, cache: KVCache, mask: np.ndarray | None = None, *,
               new_lengths: np.ndarray | None = None, need_weights: bool = True, rng: Rng = None,
               mask_mod: Callable[..., Any] | None = None,
               score_mod: Callable[..., Any] | None = None) -> tuple[np.ndarray, np.ndarray | None, KVCache]:
        """Attention of L new positions over the cache and themselves: the keys and values of x_kv join the
        cache at positions p = length .. length + L - 1, where the queries of x_q stand too, so each query
        sees the keys at positions up to its own (causal, q_offset = length). With rope_theta, the new queries
        and keys are turned at those positions, and the cache holds turned keys. Each sequence has its own
        length: with new_lengths, sequence b takes the first new_lengths[b] rows of its chunk alone, at its
        own positions length[b] .., and its other rows are padding, zeros in every output.

        Args:
            x_q: the new queries' inputs (..., L, D).
            x_kv: the new keys' and values' inputs (..., L, D).
            cache: from init_cache, or the cache the last extend returned; a streaming cache (window) takes
                1 <= L <= window rows and no mask, new_lengths or mods, and its weights' last axis is its view
                in the cache's order (SPEC 3c); attention="linear" takes its LinearCache, the recurrent state, any
                number of rows and no mask, new_lengths or mods, and returns no weights (SPEC 3a).
            mask: broadcasts to (..., H, L, capacity); an entry equal to 0 / False hides that key too.
            new_lengths: integer (...), 0 <= new_lengths <= L: each sequence's new positions (a ragged chunk);
                None: L for every sequence.
            need_weights: return the weights; with False the second result is None.
            rng: dropout randomness, as for __call__.
            mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
                needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
            score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and
                before bias; needs four axes as mask_mod.
                The mods see q_idx 0 .. L - 1 of the new queries and kv_idx 0 .. length + L - 1 of the cache.

        Returns:
            out (..., L, D), weights (..., H, L, capacity) (zero past the new length, or None), and the cache
            holding length + L positions (length + new_lengths); a padding row's out and weights are zeros.
        """
        self._check_extend({"x_q": x_q, "x_kv": x_kv}, cache, mask, new_lengths)
        return self._extended(x_q, x_kv, cache, mask, new_lengths=new_lengths, need_weights=need_weights, rng=rng,
                              mask_mod=mask_mod, score_mod=score_mod)

    def _extended(self, x_q: np.ndarray, x_kv: np.ndarray, cache: KVCache, mask: np.ndarray | None, *,
                  new_lengths: np.ndarray | None = None, need_weights: bool, rng: Rng,
                  mask_mod: Callable[..., Any] | None = None,
                  score_mod: Callable[..., Any] | None = None) -> tuple[np.ndarray, np.ndarray | None, KVCache]:
        """extend once its inputs are checked (TransformerBlock.extend checks its own against the cache)."""
        if isinstance(cache, LinearCache):  # the recurrent state of linear attention
            validation.linear_extend(mask, new_lengths, mask_mod, score_mod)
            return self._linear_extended(x_q, x_kv, cache)
        if self.position == "alibi" and isinstance(cache, PagedKVCache | StreamingKVCache):
            raise ValueError(f"position='alibi' extends a dense KVCache only; got a {type(cache).__name__}")
        if isinstance(cache, PagedKVCache):  # the keys and values in pages
            validation.paged_options(mask_mod, score_mod, self.dropout if self.training else 0.0)
            return self._paged(x_q, x_kv, cache, mask, new_lengths, need_weights=need_weights)
        if isinstance(cache, StreamingKVCache):  # the sinks and a ring of the last window positions
            validation.streaming_step(x_q.shape[-2], cache.k.shape[-2] - cache.sink_tokens, new_lengths,
                                      np.shape(cache.length), mask, mask_mod, score_mod)
            return self._streaming(x_q, x_kv, cache, need_weights=need_weights, rng=rng)
        if new_lengths is not None or np.ndim(cache.length):  # a length per sequence
            return self._ragged(x_q, x_kv, cache, mask, new_lengths, need_weights=need_weights, rng=rng,
                                mask_mod=mask_mod, score_mod=score_mod)
        start, end = cache.length, cache.length + x_q.shape[-2]

        # 1) project the new positions, then write their keys and values into the cache, in place
        q = self._split_heads(self.w_q(x_q))  # (..., L, D) -> (..., H, L, d_k)
        k = self._split_heads(self.w_k(x_kv), self.num_kv_heads)  # (..., L, D) -> (..., Hkv, L, d_k)
        q, k = self._rotated(q, k, start, cache.rope)  # RoPE at positions start .. end - 1
        cache.k[..., start:end, :] = k
        cache.v[..., start:end, :] = self._split_heads(self.w_v(x_kv), self.num_kv_heads)  # at start .. end - 1

        # 2) attend over the filled positions, the new queries at positions start .. end - 1
        if mask is not None and np.shape(mask)[-1] > 1:
            mask = mask[..., :end]  # (..., H, L, capacity) -> (..., H, L, end)
        dropout_p = self.dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, cache.k[..., :end, :], cache.v[..., :end, :], mask,
                                                    is_causal=True, q_offset=start, enable_gqa=self.grouped,
                                                    mask_mod=mask_mod, score_mod=score_mod, sinks=self.sinks,
                                                    alibi_slopes=self.alibi_slopes,
                                                    dropout_p=dropout_p, need_weights=need_weights,
                                                    rng=rng)  # (..., H, L, d_k)
        if need_weights:  # the positions not yet filled get 0
            weights = np.concatenate([weights, np.zeros((*weights.shape[:-1], cache.k.shape[-2] - end),
                                                        weights.dtype)], axis=-1)  # (..., H, L, capacity)

        # 3) concatenate the heads and mix them
        return self.w_o(self._merge_heads(out)), weights, KVCache(cache.k, cache.v, length=end, rope=cache.rope)

    def _linear_extended(self, x_q: np.ndarray, x_kv: np.ndarray,
                         cache: LinearCache) -> tuple[np.ndarray, None, LinearCache]:
        """extend with attention="linear": the L new positions p = length .. length + L - 1 read the state of the
        earlier ones and, causally, each other (linear_attention's chunked form, one chunk):
            num_i = phi(q_i)^T (S + sum_{j <= i} phi(k_j) v_j^T),  den_i = phi(q_i) . (z + sum_{j <= i} phi(k_j)) + eps,
        then the state takes the chunk: S' = S + phi(K)^T V, z' = z + phi(K)^T 1. No weights."""
        start, L, phi = cache.length, x_q.shape[-2], FEATURE_MAPS["elu"][0]  # linear_attention's defaults

        # 1) project, turn by RoPE at positions start .. start + L - 1, group the query heads by key/value head
        q = self._split_heads(self.w_q(x_q))  # (..., L, D) -> (..., H, L, d_k)
        k = self._split_heads(self.w_k(x_kv), self.num_kv_heads)  # (..., L, D) -> (..., Hkv, L, d_k)
        v = self._split_heads(self.w_v(x_kv), self.num_kv_heads)
        q, k = self._rotated(q, k, start)
        q, k, v = self._grouped_heads(*(x.astype(cache.S.dtype, copy=False) for x in (q, k, v)))
        phi_q, phi_k = phi(q), phi(k)  # (..., Hkv, G, L, d_k), (..., Hkv, 1, L, d_k)

        # 2) read: the chunk causally (keys j <= i), the earlier positions through the state
        S, z = cache.S[..., None, :, :], cache.z[..., None, :, None]  # (..., Hkv, 1, d_k, d_k), (..., Hkv, 1, d_k, 1)
        kernel = np.tril(phi_q @ np.swapaxes(phi_k, -1, -2))  # (..., Hkv, G, L, d_k) x (..., Hkv, 1, d_k, L)
        num = kernel @ v + phi_q @ S  # (..., Hkv, G, L, L) x (..., Hkv, 1, L, d_k) + (..., L, d_k) x (..., d_k, d_k)
        den = np.sum(kernel, axis=-1, keepdims=True) + phi_q @ z + _LINEAR_EPS  # (..., Hkv, G, L, 1)
        out = _ungrouped((num / den).astype(x_q.dtype, copy=False))  # (..., Hkv, G, L, d_k) -> (..., H, L, d_k)

        # 3) the state takes the chunk: new arrays, the caller's cache stays as it was
        phi_k, v = phi_k[..., 0, :, :], v[..., 0, :, :]  # (..., Hkv, L, d_k)
        S = cache.S + np.swapaxes(phi_k, -1, -2) @ v  # (..., Hkv, d_k, L) x (..., Hkv, L, d_k)
        z = cache.z + np.sum(phi_k, axis=-2)  # (..., Hkv, d_k)

        # 4) concatenate the heads and mix them
        return self.w_o(self._merge_heads(out)), None, LinearCache(S, z, length=start + L)

    def _ragged(self, x_q: np.ndarray, x_kv: np.ndarray, cache: KVCache, mask: np.ndarray | None,
                new_lengths: np.ndarray | None, *, need_weights: bool, rng: Rng,
                mask_mod: Callable[..., Any] | None = None,
                score_mod: Callable[..., Any] | None = None) -> tuple[np.ndarray, np.ndarray | None, KVCache]:
        """extend with a length per sequence: sequence b's new rows i < new[b] stand at positions start[b] + i,
        its other rows are padding."""
        capacity = cache.k.shape[-2]

        # 1) project, turn each sequence's rows at its own positions, write the kept rows into the cache in place
        q, k, v, start, end, positions, kept = self._new_rows(x_q, x_kv, cache, new_lengths, cache.k.shape[:-3])
        *sequence, row = np.nonzero(kept)  # the kept rows: their sequences' indices and their rows
        to, of = (*sequence, slice(None), positions[kept]), (*sequence, slice(None), row)  # (n, Hkv, d_k) each
        cache.k[to], cache.v[to] = k[of], v[of]

        # 2) attend over the filled positions: each sequence causal from its own start, up to its own end
        span = int(end.max(initial=0))  # the longest sequence's positions: the rest is read by none
        if mask is not None and np.shape(mask)[-1] > 1:
            mask = mask[..., :span]  # (..., H, L, capacity) -> (..., H, L, span)
        dropout_p = self.dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, cache.k[..., :span, :], cache.v[..., :span, :], mask,
                                                    is_causal=True, q_offset=start[..., None],
                                                    key_lengths=end[..., None], enable_gqa=self.grouped,
                                                    mask_mod=mask_mod, score_mod=score_mod, sinks=self.sinks,
                                                    alibi_slopes=self.alibi_slopes,
                                                    dropout_p=dropout_p, need_weights=need_weights,
                                                    rng=rng)  # (..., H, L, d_k)
        rows = kept[..., None, :, None]  # (..., 1, L, 1): padding rows get zeros
        if need_weights:  # the positions past the longest sequence get 0 too
            weights = np.where(rows, weights, 0)
            weights = np.concatenate([weights, np.zeros((*weights.shape[:-1], capacity - span), weights.dtype)],
                                     axis=-1)  # (..., H, L, capacity)

        # 3) concatenate the heads and mix them; a padding row stays 0 (w_o's bias not added to it)
        out = np.where(kept[..., None], self.w_o(self._merge_heads(out)), 0)  # (..., L, D)
        return out.astype(x_q.dtype, copy=False), weights, KVCache(cache.k, cache.v, length=end, rope=cache.rope)

    def _streaming(self, x_q: np.ndarray, x_kv: np.ndarray, cache: StreamingKVCache, *, need_weights: bool,
                   rng: Rng) -> tuple[np.ndarray, np.ndarray | None, StreamingKVCache]:
        """extend over a streaming cache (SPEC 3c): query i at position p_i sees the keys j < sink_tokens and
        p_i - window < j <= p_i, read into its view in the cache's order, column c: position c (c < sink_tokens),
        else c + e_i, e_i = max(0, p_i + 1 - slots) the window positions evicted; the view is gathered from the
        slots before this step writes and the new rows, so a chunk's early queries still read what it overwrites."""
        start, L, slots = cache.length, x_q.shape[-2], cache.k.shape[-2]
        seen, source, place = _streaming_view(start, L, cache.sink_tokens, slots)  # (L, slots) x2, (L,)

        # 1) project; RoPE "original": the new queries and keys turned at their positions, stored turned
        q = self._split_heads(self.w_q(x_q))  # (..., L, D) -> (..., H, L, d_k)
        k = self._split_heads(self.w_k(x_kv), self.num_kv_heads)  # (..., L, D) -> (..., Hkv, L, d_k)
        v = self._split_heads(self.w_v(x_kv), self.num_kv_heads)
        if cache.rope_positions == "original":
            q, k = self._rotated(q, k, start)  # RoPE at positions start .. start + L - 1

        # 2) each query's view in the cache's order, from the slots as they were and the new rows after them
        # (..., Hkv, slots + L, d_k) -> (..., Hkv, L, slots, d_k): query i's column c from row source[i, c]
        k_seen = np.concatenate([cache.k, k], axis=-2)[..., source, :]
        v_seen = np.concatenate([cache.v, v], axis=-2)[..., source, :]
        if cache.rope_positions == "cache" and cache.rope is not None:  # column c at place c, query i at its own
            cos, sin = cache.rope  # (slots, d_k) each
            q, k_seen = _turned(q, cos[place], sin[place], False), _turned(k_seen, cos, sin, False)

        # 3) attend, each query alone over its view: the queries stand on a batch axis
        q = np.swapaxes(q, -2, -3)[..., None, :]  # (..., H, L, d_k) -> (..., L, H, 1, d_k)
        k_seen, v_seen = np.swapaxes(k_seen, -3, -4), np.swapaxes(v_seen, -3, -4)  # (..., L, Hkv, slots, d_k)
        dropout_p = self.dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, k_seen, v_seen, seen[:, None, None, :], enable_gqa=self.grouped,
                                                    dropout_p=dropout_p, need_weights=need_weights,
                                                    rng=rng)  # (..., L, H, 1, d_k), mask (L, 1, 1, slots)
        out = np.swapaxes(out[..., 0, :], -2, -3)  # (..., L, H, 1, d_k) -> (..., H, L, d_k)
        if need_weights:
            weights = np.swapaxes(weights[..., 0, :], -2, -3)  # (..., L, H, 1, slots) -> (..., H, L, slots)

        # 4) write the new rows into their slots, in place (L <= window: distinct slots); the other slots stay
        to = _streaming_slot(start + np.arange(L), cache.sink_tokens, slots)  # (L,)
        cache.k[..., to, :], cache.v[..., to, :] = k, v

        # 5) concatenate the heads and mix them
        return self.w_o(self._merge_heads(out)), weights, cache._replace(length=start + L)

    def _new_rows(self, x_q: np.ndarray, x_kv: np.ndarray, cache: KVCache | PagedKVCache,
                  new_lengths: np.ndarray | None, batch: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """A chunk with a length per sequence (batch (...)): q (..., H, L, d_k), k and v (..., Hkv, L, d_k)
        projected, q and k turned by RoPE at each row's position in its sequence; each sequence's start and end
        (...); the rows' positions (..., L), and which rows are the sequence's own, not padding (..., L)."""
        L = x_q.shape[-2]
        start = np.broadcast_to(np.asarray(cache.length), batch)  # (...)
        end = start + np.broadcast_to(np.asarray(L if new_lengths is None else new_lengths), batch)  # (...)
        positions = start[..., None] + np.arange(L)  # (..., L): each row's position in its sequence
        q = self._split_heads(self.w_q(x_q))  # (..., L, D) -> (..., H, L, d_k)
        k = self._split_heads(self.w_k(x_kv), self.num_kv_heads)  # (..., L, D) -> (..., Hkv, L, d_k)
        v = self._split_heads(self.w_v(x_kv), self.num_kv_heads)
        q, k = self._rotated(q, k, positions[..., None, :], cache.rope)  # RoPE at (..., 1, L) positions
        return q, k, v, start, end, positions, positions < end[..., None]

    def _paged(self, x_q: np.ndarray, x_kv: np.ndarray, cache: PagedKVCache, mask: np.ndarray | None,
               new_lengths: np.ndarray | None, *,
               need_weights: bool) -> tuple[np.ndarray, np.ndarray | None, PagedKVCache]:
        """extend over a paged cache: as _ragged, the keys and values written into their sequences' pages and
        attention read through the block table, one tile of pages of every sequence at a time (the online softmax
        of flash.py over the tiles, pages.TILE positions each): no sequence's keys are ever gathered whole."""
        page = cache.k.shape[-2]

        # 1) project, turn, write the kept rows into their pages in place: position p at (table[b, p // page], p % page)
        q, k, v, _, end, positions, kept = self._new_rows(x_q, x_kv, cache, new_lengths, cache.length.shape)
        sequence, row = np.nonzero(kept)
        at = positions[sequence, row]
        slot = (cache.block_table[sequence, at // page], slice(None), at % page)  # (n, Hkv, d_k) each
        cache.k[slot], cache.v[slot] = k[sequence, :, row], v[sequence, :, row]

        # 2) attend block by block: the online softmax over each sequence's pages (flash.py's m, l, O)
        out, lse = self._through_pages(q, cache, positions, end, mask)  # (B, H, L, d_k), (B, H, L)
        own = kept[:, None, :, None]  # (B, 1, L, 1): padding rows get zeros
        weights = None
        if need_weights:  # exp(s - lse) block by block, at each key's position: (B, H, L, M * page)
            weights = np.where(own, self._page_weights(q, cache, positions, end, mask, lse), 0)

        # 3) concatenate the heads and mix them; a padding row stays 0
        out = np.where(kept[..., None], self.w_o(self._merge_heads(np.where(own, out, 0))), 0)  # (B, L, D)
        return out.astype(x_q.dtype, copy=False), weights, cache._replace(length=end)

    def _page_scores(self, q: np.ndarray, cache: PagedKVCache, tile: int, positions: np.ndarray, end: np.ndarray,
                     mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Tile `tile` of every sequence (its blocks tile * n .. tile * n + n - 1, n = pages.tile_blocks(page), T = n
        * page positions): its scores (B, H, L, T), -inf where hidden, and the values (B, Hkv, T, d_k) with the
        slots no query sees zeroed (a NaN left in an unused slot reaches no output)."""
        (B, M), page = cache.block_table.shape, cache.k.shape[-2]
        n = pages.tile_blocks(page)
        blocks = tile * n + np.arange(n)  # (n,); past the table's M blocks: no page
        index = np.where(blocks < M, cache.block_table[:, np.minimum(blocks, M - 1)], pages.NO_PAGE)  # (B, n)
        k, v = (np.moveaxis(pool[np.maximum(index, 0)], 1, 2).reshape(B, -1, n * page, pool.shape[-1])
                for pool in (cache.k, cache.v))  # (B, n, Hkv, page, d_k) -> (B, Hkv, T, d_k): n pages each
        at = blocks[0] * page + np.arange(n * page)  # (T,): the positions the tile holds
        held = (at < end[:, None]) & np.repeat(index >= 0, page, axis=1)  # (B, T): filled slots of held pages
        seen = held[:, None, None, :] & (at <= positions[:, None, :, None])  # (B, 1, L, T): causal
        if mask is not None:  # (..., H, L, M * page) -> the tile's columns (past the table: not held anyway)
            seen = seen & ((mask[..., np.minimum(at, M * page - 1)] if np.shape(mask)[-1] > 1 else mask) != 0)
        q, k, _ = self._grouped_heads(q / math.sqrt(q.shape[-1]), k, k)  # (B, Hkv, G, L, d_k), (B, Hkv, 1, T, d_k)
        scores = _ungrouped(q @ np.swapaxes(k, -1, -2))  # (B, Hkv, G, L, T) -> (B, H, L, T)
        return np.where(seen, scores, -np.inf), np.where(held[:, None, :, None], v, 0)

    def _through_pages(self, q: np.ndarray, cache: PagedKVCache, positions: np.ndarray, end: np.ndarray,
                       mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """out (B, H, L, d_k) and lse (B, H, L) over the tiles of every sequence, by the online softmax:
        m_t = max(m_{t-1}, rowmax(S_t)), l_t = e^(m_{t-1} - m_t) l_{t-1} + rowsum(e^(S_t - m_t)),
        O_t = e^(m_{t-1} - m_t) O_{t-1} + e^(S_t - m_t) V_t;  out = O / l (0 where no key is seen). With sinks,
        m_0 = sink and l_0 = 1: the sink joins each denominator and lse."""
        work = np.promote_types(q.dtype, np.float32)
        q = q.astype(work, copy=False)
        m = np.full(q.shape[:-1], -np.inf, work)  # (B, H, L)
        total, acc = np.zeros(q.shape[:-1], work), np.zeros(q.shape, work)
        if self.sinks is not None:  # the sink first: m_0 = sink, l_0 = exp(sink - m_0) = 1
            m[...] = self.sinks.astype(work)[:, None]  # (H,) -> (B, H, L)
            total[...] = 1
        for tile in range(pages.tiles(int(end.max(initial=0)), cache.k.shape[-2])):  # the tiles some sequence reaches
            scores, v = self._page_scores(q, cache, tile, positions, end, mask)
            m_new = np.maximum(m, scores.max(axis=-1))
            shift = np.where(np.isfinite(m_new), m_new, 0)  # a row with no key seen yet keeps 0
            weights = np.exp(scores - shift[..., None])  # (B, H, L, T); hidden: exp(-inf) = 0
            decay = np.exp(m - shift)  # exp(-inf) = 0 before the first seen key
            total = decay * total + weights.sum(axis=-1)
            weights, v, _ = self._grouped_heads(weights, v.astype(work, copy=False), v)  # v: (B, Hkv, 1, T, d_k)
            acc = decay[..., None] * acc + _ungrouped(weights @ v)  # (B, Hkv, G, L, d_k) -> (B, H, L, d_k)
            m = m_new
        seen = total > 0
        out = np.where(seen[..., None], acc / np.where(seen, total, 1)[..., None], 0)
        return out, np.where(seen, m + np.log(np.where(seen, total, 1)), -np.inf)

    def _page_weights(self, q: np.ndarray, cache: PagedKVCache, positions: np.ndarray, end: np.ndarray,
                      mask: np.ndarray | None, lse: np.ndarray) -> np.ndarray:
        """The weights exp(s - lse) (B, H, L, max_pages * page) at each key's position in its sequence."""
        work, M, page = lse.dtype, cache.block_table.shape[1], cache.k.shape[-2]
        finite = np.isfinite(lse)[..., None]  # a query that sees no key: a row of zeros
        tiles = [np.where(finite, np.exp(self._page_scores(q.astype(work, copy=False), cache, tile, positions, end,
                                                           mask)[0] - np.where(finite, lse[..., None], 0)), 0)
                 for tile in range(pages.tiles(M * page, page))]
        return np.concatenate(tiles, axis=-1)[..., :M * page].astype(q.dtype, copy=False)

    def _check_paged(self, inputs: dict[str, np.ndarray], cache: PagedKVCache, mask: np.ndarray | None,
                     new_lengths: np.ndarray | None) -> None:
        """The checks of extend over a paged cache: inputs (B, L, D) of the block table's B sequences, a mask of
        (B, H, L, max_pages * page_size) at most, a block table of the pool's pages, and a page reserved for every
        position to be written."""
        weight, (B, M), page = self.w_q.weight, cache.block_table.shape, cache.k.shape[-2]
        L = validation.cache_inputs(tuple(inputs), tuple(x.shape for x in inputs.values()), (B, 1, 1, 1),
                                    weight.shape[1])
        validation.same_floating_dtype(_dtypes(**inputs, cache=cache.k, parameters=weight))
        if mask is not None:
            validation.broadcasts_to("mask", np.shape(mask), (B, self.num_heads, L, M * page),
                                     "B, H, L, max_pages * page_size")
        new = np.broadcast_to(L if new_lengths is None else np.asarray(new_lengths), (B,))
        if new_lengths is not None:
            validation.lengths("new_lengths", (B,), np.shape(new_lengths), new.dtype.name,
                               np.issubdtype(new.dtype, np.integer))
            validation.new_lengths_range(L, new)
        validation.block_table(np.asarray(cache.block_table), cache.k.shape[0])
        validation.cache_room(M * page, np.asarray(cache.length), new)
        validation.pages_reserved(cache.block_table, np.asarray(cache.length), new, page)

    def _check_extend(self, inputs: dict[str, np.ndarray], cache: KVCache, mask: np.ndarray | None,
                      new_lengths: np.ndarray | None = None) -> None:
        """The checks of extend, its inputs {name: (..., L, D)} against the cache and the parameters."""
        validation.cache_kind(self.attention, type(cache).__name__)
        if isinstance(cache, LinearCache):  # no mask: each position reads the state and the chunk up to its own
            validation.cache_inputs(tuple(inputs), tuple(x.shape for x in inputs.values()), cache.S.shape,
                                    self.w_q.weight.shape[1])
            return validation.same_floating_dtype(_dtypes(**inputs, parameters=self.w_q.weight))
        if isinstance(cache, PagedKVCache):
            return self._check_paged(inputs, cache, mask, new_lengths)
        if isinstance(cache, StreamingKVCache):  # its own rules are _extended's (validation.streaming_step)
            validation.cache_inputs(tuple(inputs), tuple(x.shape for x in inputs.values()), cache.k.shape,
                                    self.w_q.weight.shape[1])
            return validation.same_floating_dtype(_dtypes(**inputs, cache=cache.k, parameters=self.w_q.weight))
        weight, capacity = self.w_q.weight, cache.k.shape[-2]
        L = validation.cache_inputs(tuple(inputs), tuple(x.shape for x in inputs.values()), cache.k.shape,
                                weight.shape[1])
        validation.same_floating_dtype(_dtypes(**inputs, cache=cache.k, parameters=weight))
        if mask is not None:
            validation.broadcasts_to("mask", np.shape(mask), (*cache.k.shape[:-3], self.num_heads, L, capacity),
                                 "..., H, L, capacity")
        batch, length = cache.k.shape[:-3], np.asarray(cache.length)
        validation.lengths("the cache's length", batch, length.shape, length.dtype.name,
                           np.issubdtype(length.dtype, np.integer))
        new = None
        if new_lengths is not None:
            new = np.asarray(new_lengths)
            validation.lengths("new_lengths", batch, new.shape, new.dtype.name, np.issubdtype(new.dtype, np.integer))
            validation.new_lengths_range(L, new)
        validation.cache_room(capacity, length, L if new is None else new)

    def _check_inputs(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None,
                      mask_mod: Callable[..., Any] | None = None, score_mod: Callable[..., Any] | None = None) -> None:
        d_model = self.w_q.weight.shape[1]
        for name, x, letter in (("q", q, "L"), ("k", k, "S"), ("v", v, "S")):
            validation.module_input(name, x.shape, d_model, letter)
        validation.same_floating_dtype(_dtypes(q=q, k=k, v=v, parameters=self.w_q.weight))
        if mask is not None and self.attention == "linear":
            raise ValueError("mask must be None with attention='linear': linear attention takes no mask")
        for name, mod in (("mask_mod", mask_mod), ("score_mod", score_mod)):
            if mod is not None and self.attention == "linear":
                raise ValueError(f"{name} must be None with attention='linear': linear attention forms no scores "
                                 "for a mask function or a score function")

    @property
    def grouped(self) -> bool:
        """Whether key/value heads are shared (Hkv < H): attention then runs with enable_gqa."""
        return self.num_kv_heads != self.num_heads

    def _rotated(self, q: np.ndarray, k: np.ndarray, start: int | np.ndarray,
                 tables: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """q (..., H, L, d_k) and k (..., Hkv, S, d_k) turned by RoPE (apply_rope's half rotation), row i of each
        at position start + i, from one table of angles: `tables` (cos, sin) of positions 0, 1, ... (a cache's),
        or made here for positions start ..; q and k themselves without rope_theta. `start` may be the positions
        themselves, an integer array (..., 1, L) of each sequence's rows (L = S: a cache's step)."""
        if self.rope_theta is None:
            return q, k
        if np.ndim(start):  # each row's own position: (..., 1, L, d_k) angles, a cache's rows gathered
            if tables is None:
                cos, sin = _rope_table(start, q.shape[-1], self.rope_theta, np.promote_types(q.dtype, np.float32),
                                       False)
            else:  # a padding row may stand past the capacity: any row will do for it
                rows = np.minimum(start, tables[0].shape[0] - 1)
                cos, sin = tables[0][rows], tables[1][rows]
            return _turned(q, cos, sin, False), _turned(k, cos, sin, False)
        L, S = q.shape[-2], k.shape[-2]
        if tables is None:  # row r of the tables: position start + r
            work, positions = np.promote_types(q.dtype, np.float32), start + np.arange(max(L, S))
            tables, start = _rope_table(positions, q.shape[-1], self.rope_theta, work, False), 0  # (max(L, S), d_k)
        cos, sin = tables  # row start + i: position start + i
        return (_turned(q, cos[start:start + L], sin[start:start + L], False),
                _turned(k, cos[start:start + S], sin[start:start + S], False))

    def _linear_heads(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, is_causal: bool) -> np.ndarray:
        """linear_attention (its defaults: phi = elu + 1, eps 1e-6) in every head, causal or not, q (..., H, L, d_k)
        against k, v (..., Hkv, S, d_k): out (..., H, L, d_k)."""
        out = linear_attention(*self._grouped_heads(q, k, v), is_causal=is_causal)  # (..., Hkv, G, L, d_k)
        return _ungrouped(out)  # (..., Hkv, G, L, d_k) -> (..., H, L, d_k)

    def _grouped_heads(self, q: np.ndarray, k: np.ndarray,
                       v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q (..., H, L, d_k) -> (..., Hkv, G, L, d_k) and k, v (..., Hkv, S, d_k) -> (..., Hkv, 1, S, d_k),
        G = H / Hkv: query head h = (h // G, h % G) meets key/value head h // G by broadcasting, never a copy."""
        G = self.num_heads // self.num_kv_heads
        q = q.reshape(*q.shape[:-3], self.num_kv_heads, G, *q.shape[-2:])  # (..., Hkv, G, L, d_k)
        return q, k[..., None, :, :], v[..., None, :, :]  # (..., Hkv, S, d_k) -> (..., Hkv, 1, S, d_k)

    def _split_heads(self, x: np.ndarray, heads: int | None = None) -> np.ndarray:
        """x (..., L, heads * d_k) -> (..., heads, L, d_k); heads defaults to H (the query heads)."""
        heads = self.num_heads if heads is None else heads
        *lead, length, width = x.shape
        x = x.reshape(*lead, length, heads, width // heads)  # (..., L, H, d_k)
        return np.swapaxes(x, -2, -3)  # (..., L, H, d_k) -> (..., H, L, d_k)

    def _merge_heads(self, x: np.ndarray) -> np.ndarray:
        *lead, heads, length, d_k = x.shape
        return np.swapaxes(x, -2, -3).reshape(*lead, length, heads * d_k)  # (..., H, L, d_k) -> (..., L, D)


class TransformerBlock(Module):
    """A transformer encoder block: self-attention and a feed-forward network, each a residual branch
    with dropout, normalised after the residual sum (post-LN, the default) or before the branch (pre-LN).
    A Llama decoder layer: norm_first=True, norm="rms", activation="swiglu", bias=False, rope_theta; a gpt-oss one:
    norm_first=True, norm="rms", activation="swiglu_oss", rope_theta, sinks=True, window=(W - 1, 0) on alternate
    layers."""

    _children = ("attn", "norm1", "norm2", "ffn")
    _settings = ("dropout", "norm_first", "window", "training")

    def __init__(self, d_model: int = 512, num_heads: int = 8, d_ff: int = 2048, dropout: float = 0.1, *,
                 norm_first: bool = False, activation: str = "relu", norm: str = "layer",
                 num_kv_heads: int | None = None, bias: bool = True, rope_theta: float | None = None,
                 sinks: bool = False, eps: float = 1e-5, attention: str = "softmax",
                 window: tuple[int | None, int | None] | None = None,
                 rng: Rng = None, dtype: Any = None) -> None:
        """Args: sizes as named; dropout on the attention weights, both residual branches and after the
        activation; activation "relu", "gelu" (exact erf form), "swiglu" (gated, hidden size d_ff) or "swiglu_oss"
        (gpt-oss's clamped SwiGLU, one dense expert); norm
        "layer" (LayerNorm) or "rms" (RMSNorm); num_kv_heads and bias (the Linears' biases) for attention and
        the feed-forward network; rope_theta for attention (None: no rotary embeddings); sinks for attention
        (MultiHeadAttention's: attn.sinks (H,), zeros at first); eps inside the norm's square root; attention
        "softmax" or "linear" (MultiHeadAttention's: dropout 0 then); window (left, right): query i sees keys
        p_i - left <= j <= p_i + right only (scaled_dot_product_attention's window, and-ed with the mask, on
        the call, vjp and extend; gpt-oss's sliding_window W is (W - 1, 0) with is_causal); rng and
        dtype (float32 by default) for the initial parameters."""
        validation.module_sizes(d_model, num_heads, d_ff)
        validation.probability("dropout", dropout)
        validation.activation(activation)
        validation.norm(norm)
        rngs, dtype = _rngs(rng, 4 if activation in validation.GATED else 3), np.float32 if dtype is None else dtype
        attn = MultiHeadAttention(d_model, num_heads, dropout, num_kv_heads=num_kv_heads, bias=bias,
                                  rope_theta=rope_theta, sinks=sinks, attention=attention, rng=rngs[0], dtype=dtype)
        norm1, norm2 = (_NORMS[norm].initialized(d_model, eps, dtype) for _ in range(2))
        self._init(attn=attn, norm1=norm1, norm2=norm2,
                   ffn=_feed_forward(d_model, d_ff, activation, dropout, bias, rngs[1:], dtype),
                   dropout=dropout, norm_first=norm_first, window=validation.block_window(window, attention),
                   training=True)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, num_heads: int, dropout: float = 0.1,
                        norm_first: bool = False, activation: str | None = None,
                        rope_theta: float | None = None, eps: float = 1e-5,
                        attention: str = "softmax",
                        window: tuple[int | None, int | None] | None = None) -> TransformerBlock:
        """A block holding `state` (NumPy or native arrays; computes in their dtype), in training mode."""
        state = {name: asarray(value) for name, value in state.items()}
        shapes = {name: value.shape for name, value in state.items()}
        layout = validation.block_layout(shapes, num_heads, activation)  # sizes, Hkv, bias, norm, activation
        validation.probability("dropout", dropout)
        validation.state(cls.__name__, shapes, validation.block_state_shapes(num_heads=num_heads, **layout._asdict()))
        validation.same_floating_dtype(_dtypes(**state), f"{cls.__name__}.from_state_dict: ")
        attn = MultiHeadAttention.from_state_dict(_prefixed(state, "attn"), num_heads=num_heads,
                                                  dropout=dropout, rope_theta=rope_theta, attention=attention)
        norm1, norm2 = (_NORMS[layout.norm].from_state(_prefixed(state, name), eps) for name in ("norm1", "norm2"))
        return cls._build(attn=attn, norm1=norm1, norm2=norm2,
                          ffn=_FEED_FORWARDS[layout.activation].from_state(_prefixed(state, "ffn"),
                                                                             layout.activation, dropout),
                          dropout=dropout, norm_first=norm_first, window=validation.block_window(window, attention),
                          training=True)

    def __call__(self, x: np.ndarray, mask: np.ndarray | None = None, *, is_causal: bool = False,
                 need_weights: bool = True, rng: Rng = None, mask_mod: Callable[..., Any] | None = None,
                 score_mod: Callable[..., Any] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """post-LN: x = LN_1(x + Drop(MHA(x))),   x = LN_2(x + Drop(FFN(x)));
        pre-LN:  x = x + Drop(MHA(LN_1(x))),   x = x + Drop(FFN(LN_2(x))).

        Args:
            x: inputs (..., L, D).
            mask: broadcasts to (..., H, L, L); an entry equal to 0 / False hides that key.
            is_causal: position i sees positions j <= i (and-ed with mask): a decoder block, which extend continues.
            need_weights: return the attention weights; with False the second result is None.
            rng: dropout randomness: a NumPy Generator or an int seed (None: fresh randomness).
            mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
                needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
            score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and
                before bias; needs four axes as mask_mod.

        Returns:
            x (..., L, D) and the attention weights (..., H, L, L) per head, before dropout (or None).
        """
        self._check_input(x)
        rngs = _rngs(rng, 4)

        def attend(h: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, None]:
            return *self.attn(h, h, h, self._windowed(mask, h.shape[-2]), is_causal=is_causal,
                              need_weights=need_weights, rng=rngs[0], mask_mod=mask_mod,
                              score_mod=score_mod), None  # (..., L, D)

        x, weights, _ = self._layers(x, attend, rngs)
        return x, weights

    def init_cache(self, batch_shape: tuple[int, ...], capacity: int, *, dtype: Any = None, sink_tokens: int = 0,
                   window: int | None = None,
                   rope_positions: str = "original") -> KVCache | StreamingKVCache | LinearCache:
        """An empty cache of the block's attention (MultiHeadAttention.init_cache; with window, streaming; with
        attention="linear", the recurrent state)."""
        return self.attn.init_cache(batch_shape, capacity, dtype=dtype, sink_tokens=sink_tokens, window=window,
                                    rope_positions=rope_positions)

    def init_paged_cache(self, batch_size: int, num_pages: int, page_size: int, max_pages: int, *,
                         dtype: Any = None) -> PagedKVCache:
        """An empty paged cache of the block's attention (MultiHeadAttention.init_paged_cache)."""
        return self.attn.init_paged_cache(batch_size, num_pages, page_size, max_pages, dtype=dtype)

    def extend(self, x: np.ndarray, cache: KVCache, mask: np.ndarray | None = None, *,
               new_lengths: np.ndarray | None = None, need_weights: bool = True, rng: Rng = None,
               mask_mod: Callable[..., Any] | None = None,
               score_mod: Callable[..., Any] | None = None) -> tuple[np.ndarray, np.ndarray | None, KVCache]:
        """The block on L new positions after those in the cache: as __call__ with a causal mask over the
        whole sequence, the attention through MultiHeadAttention.extend (a length per sequence as there: a
        padding row's output is zeros).

        Args:
            x: the new positions' inputs (..., L, D).
            cache: from init_cache, or the cache the last extend returned (a streaming cache as for
                MultiHeadAttention.extend).
            mask: broadcasts to (..., H, L, capacity); an entry equal to 0 / False hides that key too.
            new_lengths: integer (...), 0 <= new_lengths <= L: each sequence's new positions; None: L for all.
            need_weights, rng: as for __call__.
            mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
                needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
            score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and
                before bias; needs four axes as mask_mod.
                The mods see q_idx 0 .. L - 1 of the new positions and kv_idx 0 .. length + L - 1 of the cache.

        Returns:
            x (..., L, D), the attention weights (..., H, L, capacity) (or None), and the cache holding the new
            positions too.
        """
        self.attn._check_extend({"x": x}, cache, mask, new_lengths)  # once: the attention's input is alike
        rngs = _rngs(rng, 4)

        def attend(h: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, KVCache]:
            return self.attn._extended(h, h, cache, self._windowed(mask, h.shape[-2], cache),
                                       new_lengths=new_lengths, need_weights=need_weights,
                                       rng=rngs[0], mask_mod=mask_mod, score_mod=score_mod)  # (..., L, D)

        x, weights, cache = self._layers(x, attend, rngs)
        if new_lengths is not None:  # a padding row: zeros, as the attention's
            x = np.where(np.arange(x.shape[-2])[:, None] < np.asarray(new_lengths)[..., None, None], x, 0)
        return x, weights, cache

    def vjp(self, x: np.ndarray, mask: np.ndarray | None = None, *, is_causal: bool = False,
            mask_mod: Callable[..., Any] | None = None,
            score_mod: Callable[..., Any] | None = None) -> tuple[np.ndarray, np.ndarray, Callable]:
        """x, weights and pullback(d_out) -> (dx, {state-dict name: gradient}), without dropout; is_causal, mask_mod
        and score_mod as for __call__, the score function's parameters' gradients under "score_mod.<name>"."""
        return transformer_block_vjp(self, x, self._windowed(mask, x.shape[-2]), is_causal=is_causal,
                                     mask_mod=mask_mod, score_mod=score_mod)

    def _windowed(self, mask: np.ndarray | None, L: int, cache: Any = None) -> np.ndarray | None:
        """mask and-ed with the block's window: L queries at positions q_offset + i over keys 0 .. S - 1, S = L
        and q_offset 0 on the call, the cache's key positions and length on extend; mask itself without one."""
        if self.window is None:
            return mask
        S, q_offset = (L, 0) if cache is None else (_key_positions(cache), cache.length)
        seen = window_mask(L, S, self.window, q_offset=q_offset)[..., None, :, :]  # (..., 1, L, S): every head
        return seen if mask is None else np.logical_and(seen, np.asarray(mask).astype(bool))

    def _check_input(self, x: np.ndarray) -> None:
        validation.module_input("x", x.shape, self.norm1.weight.shape[0], "L")
        validation.same_floating_dtype(_dtypes(x=x, parameters=self.norm1.weight))

    def _layers(self, x: np.ndarray, attend: Callable,
                rngs: list) -> tuple[np.ndarray, np.ndarray | None, Any]:
        """The two residual branches around `attend`, self-attention h -> (out, weights, cache or None),
        post- or pre-LN; returns x, the weights and attend's cache."""
        if self.norm_first:  # pre-LN
            h, weights, cache = self._attention_branch(self.norm1(x), attend, rngs[1])
            x = x + h
            x = x + self._feed_forward_branch(self.norm2(x), rngs[2:])
        else:  # post-LN, as the original
            h, weights, cache = self._attention_branch(x, attend, rngs[1])
            x = self.norm1(x + h)
            x = self.norm2(x + self._feed_forward_branch(x, rngs[2:]))
        return x, weights, cache

    def _attention_branch(self, x: np.ndarray, attend: Callable,
                          rng: Rng) -> tuple[np.ndarray, np.ndarray | None, Any]:
        """Drop(MHA(x, x, x)), the attention weights and attend's cache."""
        h, weights, cache = attend(x)  # (..., L, D)
        return _dropout(h, self.dropout if self.training else 0.0, rng), weights, cache

    def _feed_forward_branch(self, x: np.ndarray, rngs: list) -> np.ndarray:
        """Drop(FFN(x))."""
        h = self.ffn(x, rng=rngs[0])  # (..., L, D) -> (..., L, F) -> (..., L, D)
        return _dropout(h, self.dropout if self.training else 0.0, rngs[1])


class Linear(Module):
    """y = x W^T + b, with weight W (out, in) and bias b (out,); y = x W^T with bias None."""

    _children = ("weight", "bias")

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None) -> None:
        self._init(weight=weight, bias=bias)

    @classmethod
    def initialized(cls, d_in: int, d_out: int, rng: np.random.Generator, dtype: Any, *,
                    bias: bool = True) -> Linear:
        """nn.Linear's default: weight and bias uniform in [-1/sqrt(d_in), 1/sqrt(d_in)]."""
        bound, (rng_weight, rng_bias) = 1 / math.sqrt(d_in), _rngs(rng, 2)
        weight = rng_weight.uniform(-bound, bound, (d_out, d_in)).astype(dtype)  # (out, in)
        return cls(weight, rng_bias.uniform(-bound, bound, d_out).astype(dtype) if bias else None)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight.T  # (..., in) x (in, out) -> (..., out)
        return y if self.bias is None else y + self.bias


class LayerNorm(Module):
    """LayerNorm(x) = (x - mean) / sqrt(var + eps) * weight + bias, over the last axis (biased variance)."""

    _children = ("weight", "bias")
    _settings = ("eps",)

    def __init__(self, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5) -> None:
        self._init(weight=weight, bias=bias, eps=eps)

    @classmethod
    def initialized(cls, d_model: int, eps: float, dtype: Any) -> LayerNorm:
        """nn.LayerNorm's default: weight ones, bias zeros."""
        return cls(np.ones(d_model, dtype), np.zeros(d_model, dtype), eps)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x.astype(np.promote_types(x.dtype, np.float32), copy=False)  # statistics in at least float32
        mean = np.mean(y, axis=-1, keepdims=True)  # (..., D) -> (..., 1)
        var = np.mean((y - mean) ** 2, axis=-1, keepdims=True)  # biased: divide by D, not D - 1
        return ((y - mean) / np.sqrt(var + self.eps) * self.weight + self.bias).astype(x.dtype, copy=False)

    @classmethod
    def from_state(cls, state: Mapping[str, np.ndarray], eps: float) -> LayerNorm:
        return cls(state["weight"], state["bias"], eps)


class RMSNorm(Module):
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight, over the last axis: no mean removed, no bias."""

    _children = ("weight",)
    _settings = ("eps",)

    def __init__(self, weight: np.ndarray, eps: float = 1e-5) -> None:
        self._init(weight=weight, eps=eps)

    @classmethod
    def initialized(cls, d_model: int, eps: float, dtype: Any) -> RMSNorm:
        """nn.RMSNorm's default: weight ones."""
        return cls(np.ones(d_model, dtype), eps)

    @classmethod
    def from_state(cls, state: Mapping[str, np.ndarray], eps: float) -> RMSNorm:
        return cls(state["weight"], eps)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x.astype(np.promote_types(x.dtype, np.float32), copy=False)  # statistics in at least float32
        mean_square = np.mean(y**2, axis=-1, keepdims=True)  # (..., D) -> (..., 1)
        return (y / np.sqrt(mean_square + self.eps) * self.weight).astype(x.dtype, copy=False)


class FeedForward(Module):
    """FFN(x) = W_2 Dropout(activation(W_1 x + b_1)) + b_2, named ffn.0 and ffn.3 as in
    the original nn.Sequential(Linear, activation, Dropout, Linear)."""

    _children = ("linear1", "linear2")
    _settings = ("activation", "dropout", "training")
    _state_names: ClassVar[Mapping[str, str]] = {"linear1": "0", "linear2": "3"}

    def __init__(self, linear1: Linear, linear2: Linear, activation: str = "relu",
                 dropout: float = 0.0) -> None:
        self._init(linear1=linear1, linear2=linear2, activation=activation, dropout=dropout, training=True)

    @classmethod
    def from_state(cls, state: Mapping[str, np.ndarray], activation: str, dropout: float) -> FeedForward:
        linear1, linear2 = (Linear(state[f"{name}.weight"], state.get(f"{name}.bias")) for name in ("0", "3"))
        return cls(linear1, linear2, activation, dropout)

    def __call__(self, x: np.ndarray, *, rng: Rng = None) -> np.ndarray:
        h = _activation(self.activation, self.linear1(x))  # (..., L, D) -> (..., L, F)
        h = _dropout(h, self.dropout if self.training else 0.0, rng)
        return self.linear2(h)  # (..., L, F) -> (..., L, D)


class GatedFeedForward(Module):
    """SwiGLU: FFN(x) = W_down Dropout(silu(W_gate x + b_gate) * (W_up x + b_up)) + b_down, silu(x) =
    x * sigmoid(x); named ffn.w_gate, ffn.w_up and ffn.w_down. activation="swiglu_oss": gpt-oss's clamped form
    in place of silu(g) * u (primitives' _gated)."""

    _children = ("w_gate", "w_up", "w_down")
    _settings = ("activation", "dropout", "training")

    def __init__(self, w_gate: Linear, w_up: Linear, w_down: Linear, dropout: float = 0.0,
                 activation: str = "swiglu") -> None:
        self._init(w_gate=w_gate, w_up=w_up, w_down=w_down, activation=activation, dropout=dropout,
                   training=True)

    @classmethod
    def from_state(cls, state: Mapping[str, np.ndarray], activation: str, dropout: float) -> GatedFeedForward:
        linears = (Linear(state[f"{name}.weight"], state.get(f"{name}.bias")) for name in cls._children)
        return cls(*linears, dropout, activation)

    def __call__(self, x: np.ndarray, *, rng: Rng = None) -> np.ndarray:
        h = _gated(self.activation, self.w_gate(x), self.w_up(x))  # (..., L, D) -> (..., L, F)
        h = _dropout(h, self.dropout if self.training else 0.0, rng)
        return self.w_down(h)  # (..., L, F) -> (..., L, D)


def _feed_forward(d_model: int, d_ff: int, activation: str, dropout: float, bias: bool, rngs: list,
                  dtype: Any) -> FeedForward | GatedFeedForward:
    """The feed-forward network of `activation`, drawn as nn.Linear draws its parameters."""
    if activation in validation.GATED:  # w_gate, w_up (F, D), w_down (D, F)
        return GatedFeedForward(*(Linear.initialized(d_in, d_out, rng, dtype, bias=bias) for (d_in, d_out), rng in
                                  zip(((d_model, d_ff), (d_model, d_ff), (d_ff, d_model)), rngs, strict=True)),
                                dropout, activation)
    return FeedForward(Linear.initialized(d_model, d_ff, rngs[0], dtype, bias=bias),
                       Linear.initialized(d_ff, d_model, rngs[1], dtype, bias=bias), activation, dropout)


def _streaming_slot(positions: np.ndarray, sink_tokens: int, slots: int) -> np.ndarray:
    """The slot of each position in a streaming cache: p < sink_tokens in slot p, else a ring over the rest."""
    window = slots - sink_tokens
    return np.where(positions < sink_tokens, positions, sink_tokens + (positions - sink_tokens) % window)


def _streaming_view(start: int, L: int, sink_tokens: int,
                    slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The views of the L queries at positions p_i = start + i of a streaming cache, in the cache's order, column c
    holding position at = c below sink_tokens, else c + e_i (e_i = max(0, p_i + 1 - slots), the window positions
    evicted): seen (L, slots) where that is a key the query sees (at <= p_i), source (L, slots) its row in [the
    slots before the step, the L new rows], and place (L,) the query's own column, p_i - e_i."""
    p = start + np.arange(L)  # (L,)
    evicted = np.maximum(p + 1 - slots, 0)  # (L,)
    column = np.arange(slots)  # (slots,)
    at = np.where(column < sink_tokens, column, column + evicted[:, None])  # (L, slots)
    seen = at <= p[:, None]  # a sink not yet written, or a column past the query: unseen
    older = _streaming_slot(at, sink_tokens, slots)  # where a position before this step lives
    source = np.where(at >= start, slots + np.minimum(at - start, L - 1), older)  # a new row after the slots
    return seen, source, p - evicted


_LINEAR_EPS = 1e-6  # linear_attention's default eps, which attention="linear" uses
_NORMS: dict[str, Any] = {"layer": LayerNorm, "rms": RMSNorm}
_FEED_FORWARDS: dict[str, Any] = {"relu": FeedForward, "gelu": FeedForward, "swiglu": GatedFeedForward,
                                  "swiglu_oss": GatedFeedForward}


def _key_positions(cache: Any) -> int:
    """The key positions a mask of extend covers: a dense cache's capacity, a paged one's max_pages * page_size."""
    if isinstance(cache, PagedKVCache):
        return cache.block_table.shape[-1] * cache.k.shape[-2]
    if not isinstance(cache, KVCache):
        raise ValueError("TransformerBlock(window=...) extends a KVCache or a PagedKVCache (its window is a mask); "
                         f"got {type(cache).__name__}")
    return cache.k.shape[-2]


def _prefixed(state: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries under `prefix.`, with the prefix removed."""
    return {name.removeprefix(f"{prefix}."): value for name, value in state.items()
            if name.startswith(f"{prefix}.")}
