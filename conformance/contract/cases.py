"""The cases: what one call of each operation takes, the builders every fixed case is made with, and the
requirements a fixed case can add to the oracle.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

A case holds NumPy arrays (floating ones in float64; the suite casts them) and the operation's options.
Hypothesis draws cases (conformance/contract/strategies.py); the fixed ones, pinned examples, edge cases and error
inputs, are declared once in conformance/contract/fixed_cases.py with the builders below. Imports NumPy alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

Batch = tuple[int, ...]
State = dict[str, np.ndarray]

RING_DEVICES = (1, 2, 3, 4)  # P of a ring case: a ring operation needs the framework to offer 4 devices
LARGE = 15.0  # q and k of this size give logits in the hundreds
SMALL = 1e-3  # x = c + SMALL * noise per row: variance ~1e-6, about or below every eps


class SdpaCase(NamedTuple):
    """Inputs of scaled_dot_product_attention (and oracle.sdpa)."""

    q: np.ndarray  # (..., L, E)
    k: np.ndarray  # (..., S, E)
    v: np.ndarray  # (..., S, Ev)
    mask: np.ndarray | None  # broadcasts to (..., L, S) without adding axes; 0 / False hides a key
    bias: np.ndarray | None  # broadcasts to (..., L, S); a -inf entry hides that key
    is_causal: bool
    scale: float | None
    dropout: float = 0.0  # dropout_p when the check runs it in training mode; eval runs pass 0
    q_offset: int | np.ndarray = 0  # query i's position is q_offset + i; integers broadcasting to (...)
    window: tuple[int | None, int | None] | None = None  # (left, right): keys p_i - left..p_i + right
    key_lengths: np.ndarray | None = None  # integers broadcasting to (...): keys j < key_lengths visible
    softcap: float | None = None  # raw scores -> softcap * tanh(raw / softcap), before the bias
    enable_gqa: bool = False  # q (..., H, L, E), k and v (..., Hkv, S, *): query head h uses head h // (H / Hkv)
    mask_mod: Callable[..., Any] | None = None  # (b, h, q_idx, kv_idx) -> True where the query sees the key, and-ed
    # with the rest; q, k, v of four axes (B, H, L, E) (attention_np.common.mods, parameters as NumPy arrays)
    score_mod: Callable[..., Any] | None = None  # (score, b, h, q_idx, kv_idx) -> the score, after softcap, before bias
    sinks: np.ndarray | None = None  # broadcasts to (..., H): one logit per head in each row's softmax (SPEC 2h)
    alibi_slopes: np.ndarray | None = None  # (H,) or (B, H): -slope_h * |p_i - j| added to the scores (SPEC 2i)


class FlashCase(NamedTuple):
    """Inputs of flash_attention: an SdpaCase's (never dropout) and the tile sizes; with `block_size` the call
    makes a block mask, create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=block_size), and passes it for mask_mod
    (its tiles are flash's: block_q and block_k are passed only where they differ from it, as an error row does)."""

    q: np.ndarray  # (..., L, E)
    k: np.ndarray  # (..., S, E)
    v: np.ndarray  # (..., S, Ev)
    mask: np.ndarray | None  # as SdpaCase
    bias: np.ndarray | None
    is_causal: bool
    scale: float | None
    dropout: float = 0.0  # always 0: flash_attention has no dropout (the field keeps SdpaCase's layout)
    q_offset: int | np.ndarray = 0
    window: tuple[int | None, int | None] | None = None
    key_lengths: np.ndarray | None = None
    softcap: float | None = None
    enable_gqa: bool = False
    mask_mod: Callable[..., Any] | None = None  # as SdpaCase
    score_mod: Callable[..., Any] | None = None
    sinks: np.ndarray | None = None  # as SdpaCase
    alibi_slopes: np.ndarray | None = None
    block_q: int = 128  # queries per tile
    block_k: int = 128  # keys per tile
    block_size: tuple[int, int] | None = None  # the block mask's tiles (block_q, block_k); None: mask_mod itself
    with_mask_mod: bool = False  # with a block mask, mask_mod passed too (an error row: one of them, not both)


def tiled(case: SdpaCase, block_q: int, block_k: int) -> FlashCase:
    """An sdpa case as a flash_attention case with these tiles (without its dropout)."""
    return FlashCase(**case._replace(dropout=0.0)._asdict(), block_q=block_q, block_k=block_k)


class RingCase(NamedTuple):
    """Inputs of ring_attention: the whole sequence, the flash_attention keywords ring attention takes, and the
    P devices it is sharded over (SPEC 2d). Ring attention takes no mask, bias or key lengths: those fields
    are always None (they keep FlashCase's layout, which the sdpa helpers read)."""

    q: np.ndarray  # (..., L, E), L a multiple of P (of 2P with is_causal)
    k: np.ndarray  # (..., S, E), S likewise
    v: np.ndarray  # (..., S, Ev)
    mask: None
    bias: None
    is_causal: bool
    scale: float | None
    dropout: float = 0.0  # always 0: ring_attention has no dropout
    q_offset: int = 0  # a Python int (the devices' chunks are placed by it)
    window: tuple[int | None, int | None] | None = None
    key_lengths: None = None
    softcap: float | None = None
    enable_gqa: bool = False
    sinks: np.ndarray | None = None  # as SdpaCase: joins each row once, whatever the devices
    alibi_slopes: np.ndarray | None = None  # as SdpaCase: each chunk pair's bias at the global positions
    block_q: int = 128  # queries per tile, within each step
    block_k: int = 128  # keys per tile
    devices: int = 1  # P: the framework's devices (NumPy: simulated; JAX: a mesh axis; torch: ranks of a group)


def sharded(case: FlashCase, devices: int) -> RingCase:
    """A flash_attention case (without mask, bias, key lengths and mods) as ring attention over P devices."""
    fields = case._asdict()
    return RingCase(**{name: fields[name] for name in RingCase._fields if name in fields}, devices=devices)


class LinearCase(NamedTuple):
    """Inputs of linear_attention (SPEC 2e): q, k, v and its keywords. The step check runs the same case through
    linear_attention_state and linear_attention_step (causal, no key lengths: the recurrent form has none), with
    the same update rule, decay and beta."""

    q: np.ndarray  # (..., L, E)
    k: np.ndarray  # (..., S, E)
    v: np.ndarray  # (..., S, Ev)
    feature_map: str = "elu"  # phi: "elu" (elu(x) + 1), "relu" (max(x, 0)) or "identity" (x)
    is_causal: bool = False  # query i sees keys j <= i; L == S
    key_lengths: np.ndarray | None = None  # integers broadcasting to (...): keys j < key_lengths seen
    eps: float = 1e-6  # added to every normaliser
    chunk: int | None = None  # the causal form chunk by chunk (None: the prefix sums); ignored when not causal
    dropout: float = 0.0  # always 0: linear attention has no dropout (the field the generic machinery reads)
    update_rule: str = "linear"  # how the state takes key i: "linear", or (causal only, no normaliser) "gated",
    # "delta" or "gated_delta" (ONNX LinearAttention's rules)
    decay: np.ndarray | None = None  # g <= 0, the log-space decay of the gated rules: (..., S, 1) or (..., S, E)
    beta: np.ndarray | None = None  # the update rate of the delta rules: (..., S, 1), in (0, 1)


class MhaCase(NamedTuple):
    """A MultiHeadAttention (from_state_dict) and its inputs; value checks run it in eval mode."""

    state: State  # w_q, w_o .weight (D, D), w_k, w_v .weight (Hkv * d_k, D), each .bias (out,) with bias; sinks
    # (H,) with sinks=True's learned sink logits (SPEC 2h)
    num_heads: int
    dropout: float
    q: np.ndarray  # (..., L, D)
    k: np.ndarray  # (..., S, D)
    v: np.ndarray  # (..., S, D)
    mask: np.ndarray | None  # broadcasts to (..., H, L, S)
    num_kv_heads: int | None = None  # Hkv, dividing H (None: H); the state's w_k, w_v have Hkv * d_k rows
    bias: bool = True  # whether the state holds the projections' biases
    rope_theta: float | None = None  # RoPE on each head's queries and keys (None: none); d_k even
    attention: str = "softmax"  # each head's attention: "softmax", or "linear" (linear_attention with its
    # defaults, SPEC 3: no mask, no weights, dropout 0)
    is_causal: bool = False  # query i sees keys j <= i (and-ed with the mask); L == S with linear heads
    position: str | None = None  # "alibi": alibi_slopes(H) on each head's scores (SPEC 2i; softmax heads, no
    # rope_theta); None: rope_theta decides


class BlockCase(NamedTuple):
    """A TransformerBlock (from_state_dict) and its input; value checks run it in eval mode."""

    state: State  # attn.<MhaCase names>, norm1/norm2 .weight (and .bias with norm "layer") (D,), ffn.0 (F, D),
    # ffn.3 (D, F), or with "swiglu" ffn.w_gate, ffn.w_up (F, D), ffn.w_down (D, F); Linear biases with bias
    num_heads: int
    dropout: float
    norm_first: bool
    activation: str  # "relu", "gelu" or "swiglu"
    eps: float
    x: np.ndarray  # (..., L, D)
    mask: np.ndarray | None  # broadcasts to (..., H, L, L)
    norm: str = "layer"  # "layer" or "rms"
    num_kv_heads: int | None = None  # attention's Hkv, as in MhaCase
    bias: bool = True  # whether the state holds the Linears' biases (LayerNorm keeps its own regardless)
    rope_theta: float | None = None  # attention's, as in MhaCase


class DecodeCase(NamedTuple):
    """A TransformerBlock (from_state_dict, eval mode) fed x chunk by chunk through a key/value cache of
    `capacity` positions (init_cache, then extend once per chunk): the block's fields, the chunks' sizes, and
    optionally a mask of the whole sequence, of which each extend gets its chunk's rows (extend is causal, the
    mask hides keys on top). With x_kv, the block's attention alone (its attn.* entries) decodes cross-attention:
    MultiHeadAttention.extend(x, x_kv, cache), the queries of x, the keys and values of x_kv. With new_lengths each
    extend takes a length per sequence (a ragged chunk, SPEC 3a), and with paging the cache is a paged one (SPEC 3b)
    whose unused slots hold NaN: each sequence's outputs are those of its own rows alone. With streaming the cache
    keeps the sinks and a ring of the last window positions (SPEC 3c): the outputs are one pass with the streaming
    mask, the weights in the cache's order. With attention "linear" the cache is linear attention's recurrent state
    (SPEC 3a): the outputs are one causal pass of the linear heads, and there are no weights."""

    state: State  # as BlockCase
    num_heads: int
    dropout: float
    norm_first: bool
    activation: str
    eps: float
    x: np.ndarray  # (..., L, D)
    chunks: tuple[int, ...]  # sizes >= 1 summing to L: a prefill, then decode steps of 1, or any split
    capacity: int  # >= L: the cache's positions (a streaming cache's: >= its slots, s + w)
    norm: str = "layer"  # as BlockCase
    num_kv_heads: int | None = None
    bias: bool = True
    rope_theta: float | None = None  # the queries and keys turned at their positions in the whole sequence
    cache_batch: tuple[int, ...] | None = None  # init_cache's batch shape where it is not x's (an error row)
    cache_dtype: str | None = None  # init_cache's dtype where it is not the block's (an error row)
    mask: np.ndarray | None = None  # broadcasts to (..., H, L, capacity): the rows of the whole sequence (None: none)
    x_kv: np.ndarray | None = None  # (..., L, D): the keys' and values' inputs of cross-attention (None: the block)
    new_lengths: tuple[tuple[int, ...], ...] | None = None  # per chunk, each sequence's new positions (the batch
    # flattened, 0 .. the chunk's size): extend(..., new_lengths=), the chunk's other rows padding (SPEC 3a); None:
    # every row. With it the case has no mask
    paging: Paging | None = None  # a paged cache (SPEC 3b) in place of init_cache's; x (B, L, D)
    streaming: Streaming | None = None  # a streaming cache (SPEC 3c): init_cache(..., sink_tokens=, window=); every
    # chunk at most the window, no mask, no new_lengths
    attention: str = "softmax"  # the block's (or with x_kv its attention's) heads; "linear" decodes through the
    # recurrent state (LinearCache, SPEC 3a): no mask, no new_lengths, no paging or streaming, dropout 0, no weights


class Streaming(NamedTuple):
    """A decode case's streaming cache (SPEC 3c): init_cache(batch, capacity, sink_tokens=, window=, rope_positions=),
    the first sink_tokens positions and a ring of the last window in sink_tokens + window <= capacity slots; query i
    at position p_i sees key j where j < sink_tokens or p_i - window < j <= p_i. rope_positions "cache": RoPE at the
    places in the cache's order, not the positions."""

    sink_tokens: int  # s >= 0
    window: int  # w >= 1: the last w positions, the query's own among them
    rope_positions: str = "original"  # or "cache"


class Paging(NamedTuple):
    """A decode case's paged cache (SPEC 3b): init_paged_cache(B, num_pages, page_size, max_pages), every slot of
    the pool NaN before the first extend (no output may show it), pages given in `order` (a permutation of the
    pool, so a sequence's pages are neither consecutive nor in order); a sequence that takes no more positions is
    released (its length 0, its pages first in the free list, so the next sequence to grow reuses them with the
    old keys in their slots). `page_tables` gives each extend's block table."""

    page_size: int
    num_pages: int  # the pool: more pages than the sequences hold at once
    max_pages: int  # each sequence's blocks; the case's capacity is max_pages * page_size
    order: tuple[int, ...]  # the free pages, the first given first (an entry past the pool: an error row)


def page_tables(paging: Paging, new_lengths: tuple[tuple[int, ...], ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each chunk's block table (B, max_pages) int32 and which sequences are released before it (B,) bool: the
    released ones (those that held positions and take none from this chunk on) give their pages back first, then
    each sequence takes, from the front of the free list, a page for every block it needs and lacks (up to
    max_pages: past it, extend raises the full cache's error)."""
    B, M, page = len(new_lengths[0]), paging.max_pages, paging.page_size
    table, length, free = np.full((B, M), -1, np.int32), np.zeros(B, int), list(paging.order)
    steps = []
    for c, new in enumerate(new_lengths):
        released = (length > 0) & np.all(np.asarray(new_lengths[c:]).reshape(-1, B) == 0, axis=0)  # (B,)
        for b in np.flatnonzero(released):
            free[:0] = [int(p) for p in table[b] if p >= 0]  # the freed pages serve next
            table[b], length[b] = -1, 0
        for b, n in enumerate(new):
            for block in range(min(-(-(length[b] + n) // page), M)):
                if table[b, block] < 0:
                    table[b, block] = free.pop(0)
        length += np.asarray(new)
        steps.append((table.copy(), released))
    return steps


class FlexCase(NamedTuple):
    """Inputs of flex_attention: q, k, v, the mods of the catalogue (attention_np.common.mods, parameters as NumPy
    arrays) and the block mask's tiles. The call makes the block mask with create_block_mask(mask_mod, B, H, L, S,
    BLOCK_SIZE=block_size) (none where mask_mod is None) and asks for the lse."""

    q: np.ndarray  # (B, H, L, E)
    k: np.ndarray  # (B, Hkv, S, E)
    v: np.ndarray  # (B, Hkv, S, Ev)
    mask_mod: Callable[..., Any] | None  # (b, h, q_idx, kv_idx) -> True where the query sees the key; None: every key
    score_mod: Callable[..., Any] | None  # (score, b, h, q_idx, kv_idx) -> the new score; None: the score itself
    block_size: tuple[int, int] = (128, 128)  # (block_q, block_k) of the block mask's tiles
    scale: float | None = None  # multiplies Q K^T before score_mod; None: 1 / sqrt(E)
    enable_gqa: bool = False  # Hkv divides H: query head h uses key/value head h // (H / Hkv)
    dropout: float = 0.0  # always 0: flex_attention has no dropout (the field the generic machinery reads)
    mask_for: tuple[int, int, int, int] | None = None  # the scores (B, H, L, S) the block mask is made for;
    # None: the case's own (an error row makes it for others)
    sinks: np.ndarray | None = None  # broadcasts to (B, H): one logit per head, joined once after the tiles
    alibi_slopes: np.ndarray | None = None  # (H,) or (B, H): -slope * |i - j| after score_mod, per tile


class VarlenCase(NamedTuple):
    """Inputs of varlen_attention (SPEC 2g): packed sequences laid end to end, and their boundaries. The
    boundaries are integer arrays (N + 1,), data the call passes as arrays (JAX traces them); with block_size
    they are tuples, static options, as the tiled path chooses its tiles by their values (JAX refuses traced
    boundaries there)."""

    q: np.ndarray  # (Tq, H, E)
    k: np.ndarray  # (Tk, Hkv, E)
    v: np.ndarray  # (Tk, Hkv, Ev)
    cu_seqlens_q: np.ndarray | tuple[int, ...]  # (N + 1,): sequence n's queries cu_seqlens_q[n] <= i < [n + 1]
    cu_seqlens_k: np.ndarray | tuple[int, ...]  # (N + 1,): its keys cu_seqlens_k[n] <= j < [n + 1]
    max_seqlen_q: int  # at least every sequence's query length
    max_seqlen_k: int  # at least every sequence's key length
    is_causal: bool = False  # bottom-right inside each sequence: p_i = i + cu_seqlens_k[n + 1] - cu_seqlens_q[n + 1]
    window: tuple[int | None, int | None] | None = None  # (left, right) around p_i
    softcap: float | None = None  # raw scores -> softcap * tanh(raw / softcap)
    scale: float | None = None  # None: 1 / sqrt(E)
    enable_gqa: bool = False  # Hkv divides H: query head h uses key/value head h // (H / Hkv)
    block_size: int | None = None  # None: one product over the packed axes; an int: tiles of block_size
    dropout: float = 0.0  # always 0: varlen attention has no dropout (the field the generic machinery reads)


def boundaries(case: VarlenCase) -> tuple[np.ndarray, np.ndarray]:
    """The case's cu_seqlens_q and cu_seqlens_k as integer NumPy arrays (N + 1,), whether arrays or tuples."""
    return tuple(np.asarray(bounds, np.int64) if isinstance(bounds, tuple) else np.asarray(bounds)
                 for bounds in (case.cu_seqlens_q, case.cu_seqlens_k))


class MlaCase(NamedTuple):
    """A MultiHeadLatentAttention (from_state_dict, SPEC 3d) and its input: one call (chunks None), or with chunks
    init_cache(capacity) and extend once per chunk in the form `absorbed` asks for, each extend given its chunk's
    rows of the mask (extend is causal, the mask hides keys on top): the whole sequence's causal pass."""

    state: State  # DeepSeek-V3's names (mla_state): q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa,
    # kv_a_layernorm, kv_b_proj, o_proj .weight, no biases
    num_heads: int
    x: np.ndarray  # (..., L, D)
    mask: np.ndarray | None  # one call: broadcasts to (..., H, L, L); with chunks to (..., H, L, capacity)
    rope_theta: float = 10000.0  # RoPE's base (interleaved pairs), on the Er parts of the queries and the shared key
    chunks: tuple[int, ...] | None = None  # sizes >= 1 summing to L: decoding through the latent cache; None: one call
    capacity: int | None = None  # with chunks: the cache's positions (>= L but in an error row)
    absorbed: bool = False  # with chunks: extend's absorbed form (W_UK in the query, W_UV on the output)
    dropout: float = 0.0  # always 0: MLA has no dropout (the field the generic machinery reads)


Case = (SdpaCase | FlashCase | RingCase | LinearCase | MhaCase | BlockCase | DecodeCase | FlexCase | VarlenCase
        | MlaCase)


# --- parameters --------------------------------------------------------------------------------------------

def linear_state(rng: np.random.Generator, name: str, d_in: int, d_out: int, bias: bool = True) -> State:
    """nn.Linear's initialisation: weight (out, in) and bias (out,), both uniform in +-1/sqrt(in); no bias
    entry (none drawn) with bias=False."""
    bound = 1.0 / math.sqrt(d_in)
    weight = {f"{name}.weight": rng.uniform(-bound, bound, (d_out, d_in))}
    return weight | ({f"{name}.bias": rng.uniform(-bound, bound, d_out)} if bias else {})


def layer_norm_state(rng: np.random.Generator, name: str, d_model: int) -> State:
    """Gain uniform in 0.5..1.5 and bias in -0.5..0.5 (not nn.LayerNorm's 1 and 0), so a lost affine shows."""
    return {f"{name}.weight": rng.uniform(0.5, 1.5, d_model), f"{name}.bias": rng.uniform(-0.5, 0.5, d_model)}


def rms_norm_state(rng: np.random.Generator, name: str, d_model: int) -> State:
    """Gain uniform in 0.5..1.5 (not nn.RMSNorm's 1), so a lost gain shows; no bias."""
    return {f"{name}.weight": rng.uniform(0.5, 1.5, d_model)}


def mha_state(rng: np.random.Generator, d_model: int, num_heads: int = 1, num_kv_heads: int | None = None,
              bias: bool = True) -> State:
    """w_q, w_o: .weight (D, D); w_k, w_v: .weight (Hkv * d_k, D), d_k = D / H (Hkv None: H); each .bias (out,)
    unless bias is False. The defaults draw the seed layout (and the same numbers)."""
    d_kv = d_model // num_heads * (num_heads if num_kv_heads is None else num_kv_heads)
    state: State = {}
    for name, d_out in (("w_q", d_model), ("w_k", d_kv), ("w_v", d_kv), ("w_o", d_model)):
        state |= linear_state(rng, name, d_model, d_out, bias)
    return state


def block_state(rng: np.random.Generator, d_model: int, d_ff: int, *, num_heads: int = 1,
                num_kv_heads: int | None = None, bias: bool = True, norm: str = "layer",
                activation: str = "relu") -> State:
    """attn.* (mha_state), norm1.*, norm2.* (D,), ffn.0 weight (F, D) bias (F,), ffn.3 weight (D, F) bias (D,);
    or RMSNorm gains alone with norm "rms", ffn.w_gate, ffn.w_up (F, D) and ffn.w_down (D, F) with activation
    "swiglu", no Linear biases with bias=False. The defaults draw the seed layout (and the same numbers)."""
    attn = mha_state(rng, d_model, num_heads, num_kv_heads, bias)
    state = {f"attn.{name}": value for name, value in attn.items()}
    norm_state = layer_norm_state if norm == "layer" else rms_norm_state
    state |= norm_state(rng, "norm1", d_model) | norm_state(rng, "norm2", d_model)
    linears = ((("w_gate", d_model, d_ff), ("w_up", d_model, d_ff), ("w_down", d_ff, d_model))
               if activation == "swiglu" else (("0", d_model, d_ff), ("3", d_ff, d_model)))
    for name, d_in, d_out in linears:
        state |= linear_state(rng, f"ffn.{name}", d_in, d_out, bias)
    return state


def mla_state(rng: np.random.Generator, d_model: int, num_heads: int, *, q_lora_rank: int | None,
              kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int) -> State:
    """MultiHeadLatentAttention's state by DeepSeek-V3's names (SPEC 3d): q_a_proj (Dq, D), q_a_layernorm (Dq,),
    q_b_proj (H (En + Er), Dq), or q_proj (H (En + Er), D) with q_lora_rank None; kv_a_proj_with_mqa (Dc + Er, D),
    kv_a_layernorm (Dc,), kv_b_proj (H (En + Ev), Dc), o_proj (D, H Ev). Linears as nn.Linear draws them, no
    biases; the RMSNorm gains uniform in 0.5..1.5 (rms_norm_state), so a lost gain shows."""
    H, E = num_heads, qk_nope_head_dim + qk_rope_head_dim
    if q_lora_rank is None:
        state = linear_state(rng, "q_proj", d_model, H * E, bias=False)
    else:
        state = (linear_state(rng, "q_a_proj", d_model, q_lora_rank, bias=False)
                 | rms_norm_state(rng, "q_a_layernorm", q_lora_rank)
                 | linear_state(rng, "q_b_proj", q_lora_rank, H * E, bias=False))
    return (state | linear_state(rng, "kv_a_proj_with_mqa", d_model, kv_lora_rank + qk_rope_head_dim, bias=False)
            | rms_norm_state(rng, "kv_a_layernorm", kv_lora_rank)
            | linear_state(rng, "kv_b_proj", kv_lora_rank, H * (qk_nope_head_dim + v_head_dim), bias=False)
            | linear_state(rng, "o_proj", H * v_head_dim, d_model, bias=False))


# --- fixed cases -------------------------------------------------------------------------------------------
# Every fixed case is one of these three calls with a few fields changed: the sizes are the defaults unless
# the case says otherwise, the numbers N(0, 1) from the seed.

def sdpa_case(batch: Batch = (2,), L: int = 3, S: int = 4, E: int = 2, Ev: int = 3, *, seed: int = 0,
              **fields: Any) -> SdpaCase:
    """q (..., L, E), k (..., S, E), v (..., S, Ev), no mask, no bias, not causal, default scale."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((*batch, n, width)) for n, width in ((L, E), (S, E), (S, Ev)))
    return SdpaCase(q=q, k=k, v=v, mask=None, bias=None, is_causal=False, scale=None)._replace(**fields)


def linear_case(batch: Batch = (2,), L: int = 3, S: int = 4, E: int = 2, Ev: int = 3, *, seed: int = 0,
                **fields: Any) -> LinearCase:
    """sdpa_case's q (..., L, E), k (..., S, E), v (..., S, Ev) as linear attention's, elu + 1, not causal."""
    case = sdpa_case(batch, L, S, E, Ev, seed=seed)
    return LinearCase(q=case.q, k=case.k, v=case.v)._replace(**fields)


def rule_case(update_rule: str, batch: Batch = (2,), L: int = 5, E: int = 2, Ev: int = 3, *, seed: int = 0,
              decay_width: int = 1, **fields: Any) -> LinearCase:
    """linear_case's q (..., L, E), v (..., L, Ev) under an update rule, causal (L = S): identity features on unit
    keys k / |k| (the delta rules' state stays bounded), the gated rules' decay g = -U(0.05, 0.5) (..., L,
    decay_width), 1 or E, the delta rules' beta U(0.2, 0.9) (..., L, 1); the others None."""
    case = linear_case(batch, L, L, E, Ev, seed=seed)
    rng = np.random.default_rng(seed + 1)
    decay = -rng.uniform(0.05, 0.5, (*batch, L, decay_width)) if update_rule in ("gated", "gated_delta") else None
    beta = rng.uniform(0.2, 0.9, (*batch, L, 1)) if update_rule in ("delta", "gated_delta") else None
    k = case.k / np.linalg.norm(case.k, axis=-1, keepdims=True)  # unit rows (..., L, E)
    return case._replace(k=k, feature_map="identity", is_causal=True, update_rule=update_rule, decay=decay,
                         beta=beta)._replace(**fields)


def flex_case(B: int = 2, H: int = 2, L: int = 4, S: int = 5, E: int = 2, Ev: int = 3, *, Hkv: int | None = None,
              seed: int = 0, **fields: Any) -> FlexCase:
    """q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) (Hkv None: H; else grouped heads), no mods, tiles of
    (2, 3), default scale."""
    rng = np.random.default_rng(seed)
    Hkv = H if Hkv is None else Hkv
    q, k, v = (rng.standard_normal((B, heads, n, width)) for heads, n, width in ((H, L, E), (Hkv, S, E), (Hkv, S, Ev)))
    return FlexCase(q=q, k=k, v=v, mask_mod=None, score_mod=None, block_size=(2, 3),
                    enable_gqa=Hkv != H)._replace(**fields)


def varlen_case(lengths_q: tuple[int, ...] = (2, 0, 3), lengths_k: tuple[int, ...] = (3, 2, 3), *, H: int = 2,
                Hkv: int | None = None, E: int = 2, Ev: int = 3, past: tuple[int, int] = (0, 0), seed: int = 0,
                **fields: Any) -> VarlenCase:
    """Packed q (Tq, H, E), k (Tk, Hkv, E), v (Tk, Hkv, Ev) of sequences with these query and key lengths (Hkv None:
    H; else grouped heads), `past` positions (queries, keys) after the last boundary, int32 boundaries (tuples with
    block_size), max_seqlen the longest sequence's; not causal, default scale."""
    rng = np.random.default_rng(seed)
    Hkv = H if Hkv is None else Hkv
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n, dtype=np.int64)]).astype(np.int32) for n in (lengths_q, lengths_k))
    Tq, Tk = int(cu_q[-1]) + past[0], int(cu_k[-1]) + past[1]
    q, k, v = (rng.standard_normal((T, heads, width)) for T, heads, width in ((Tq, H, E), (Tk, Hkv, E), (Tk, Hkv, Ev)))
    case = VarlenCase(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q, default=0),
                      max_seqlen_k=max(lengths_k, default=0), enable_gqa=Hkv != H)._replace(**fields)
    if case.block_size is not None and isinstance(case.cu_seqlens_q, np.ndarray):  # static where tiled
        case = case._replace(**{name: tuple(np.asarray(getattr(case, name)).tolist())
                                for name in ("cu_seqlens_q", "cu_seqlens_k")})
    return case


def mha_case(batch: Batch = (2,), L: int = 3, S: int = 5, D: int = 4, H: int = 2, *, seed: int = 1,
             num_kv_heads: int | None = None, bias: bool = True, **fields: Any) -> MhaCase:
    """Cross-attention: q (..., L, D), k and v (..., S, D) all different; dropout 0.1 configured; the state in
    the layout of num_kv_heads and bias."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((*batch, n, D)) for n in (L, S, S))
    state = mha_state(rng, D, H, num_kv_heads, bias)
    return MhaCase(state=state,
                   num_heads=H,
                   dropout=0.1,
                   q=q,
                   k=k,
                   v=v,
                   mask=None,
                   num_kv_heads=num_kv_heads,
                   bias=bias)._replace(**fields)


def block_case(batch: Batch = (2,), L: int = 4, D: int = 4, H: int = 2, F: int = 8, *, seed: int = 2,
               activation: str = "gelu", norm: str = "layer", num_kv_heads: int | None = None, bias: bool = True,
               **fields: Any) -> BlockCase:
    """Post-LN, GELU, eps 1e-5, dropout 0.1 configured; x (..., L, D); the state in the layout of activation,
    norm, num_kv_heads and bias."""
    rng = np.random.default_rng(seed)
    state = block_state(rng, D, F, num_heads=H, num_kv_heads=num_kv_heads, bias=bias, norm=norm,
                        activation=activation)
    return BlockCase(state=state,
                     num_heads=H,
                     dropout=0.1,
                     norm_first=False,
                     activation=activation,
                     eps=1e-5,
                     x=rng.standard_normal((*batch, L, D)),
                     mask=None,
                     norm=norm,
                     num_kv_heads=num_kv_heads,
                     bias=bias)._replace(**fields)


def decode_case(batch: Batch = (2,), chunks: tuple[int, ...] = (3, 1, 1), capacity: int | None = None, *,
                D: int = 4, H: int = 2, F: int = 8, seed: int = 2, **fields: Any) -> DecodeCase:
    """The block of block_case (post-LN, GELU; the layout of the fields activation, norm, num_kv_heads and
    bias) fed chunks of these sizes; capacity L by default."""
    L = sum(chunks)
    layout = {name: fields.pop(name) for name in ("activation", "norm", "num_kv_heads", "bias") if name in fields}
    block = block_case(batch, L, D, H, F, seed=seed, **layout)
    return DecodeCase(state=block.state,
                      num_heads=H,
                      dropout=block.dropout,
                      norm_first=block.norm_first,
                      activation=block.activation,
                      eps=block.eps,
                      x=block.x,
                      chunks=chunks,
                      capacity=L if capacity is None else capacity,
                      norm=block.norm,
                      num_kv_heads=block.num_kv_heads,
                      bias=block.bias)._replace(**fields)


def mla_case(batch: Batch = (2,), L: int = 4, D: int = 4, H: int = 2, *, seed: int = 4, q_lora_rank: int | None = 3,
             kv_lora_rank: int = 3, qk_nope_head_dim: int = 2, qk_rope_head_dim: int = 2, v_head_dim: int = 3,
             **fields: Any) -> MlaCase:
    """x (..., L, D) and a MultiHeadLatentAttention state of these sizes (mla_state; the defaults: D = 4, H = 2, Dq = 3,
    Dc = 3, En = 2, Er = 2, Ev = 3, a value narrower than E = 4 and wider than En), no mask, rope_theta 10000, one
    call."""
    rng = np.random.default_rng(seed)
    state = mla_state(rng, D, H, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                      qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim)
    return MlaCase(state=state, num_heads=H, x=rng.standard_normal((*batch, L, D)), mask=None)._replace(**fields)


def normal(*shape: int, seed: int = 0) -> np.ndarray:
    """N(0, 1) in float64."""
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape)


def changed(x: np.ndarray, index: Any, value: Any) -> np.ndarray:
    """A copy of x with x[index] = value."""
    x = x.copy()
    x[index] = value
    return x


def random_mask(*shape: int, seed: int = 3) -> np.ndarray:
    """About 30% of the keys hidden, but every row sees key 0 (a case hides whole rows on purpose)."""
    mask = np.random.default_rng(seed).random(shape) >= 0.3
    mask[..., 0] = True
    return mask


# --- what a fixed case requires besides the oracle -----------------------------------------------------------

class Requirement(NamedTuple):
    """A hand-derived requirement on `out` or `weights` (not checked on the fast path's None weights) at
    `index` (NumPy indexing; () is the whole array): `kind` is "zero", "one" or "minus_inf" (exactly),
    "finite", "nan", "sums_to_one" (each row, to 1e-12), "only_nan" / "only_nan_or_inf" (there NaN, or NaN or
    inf, and finite everywhere else), "equals" (`value(case)` broadcast, to 1e-15) or "shape" (`value` the shape)."""

    name: str  # "out", or the second result: "weights" (flash_attention: "lse")
    kind: str
    index: Any = ()
    value: Any = None

    def problem(self, case: Case, out: np.ndarray, weights: np.ndarray | None) -> str | None:
        """What breaks the requirement, or None."""
        x = out if self.name == "out" else weights
        if x is None:
            return None
        where = self.name if self.index == () else f"{self.name}[{_index_text(self.index)}]"
        if self.kind == "shape":
            return None if x.shape == self.value else f"{self.name} has shape {x.shape}, expected {self.value}"
        try:
            part = x[self.index]
        except IndexError:
            return f"{self.name} of shape {x.shape} has no {where}"
        if self.kind == "equals":
            expected = np.broadcast_to(self.value(case), part.shape)
            ok = np.allclose(part, expected, rtol=1e-15, atol=0)
            return None if ok else f"{where} is not {_VALUE_NAMES.get(self.value, 'the required value')}"
        if self.kind.startswith("only_"):
            poisoned = np.zeros(x.shape, bool)
            poisoned[self.index] = True
            bad = np.isnan(x) if self.kind == "only_nan" else ~np.isfinite(x)
            if not np.all(bad[poisoned]):
                return f"{where} holds a finite number, where {self.kind[5:].replace('_', ' ')} is required"
            return None if np.all(np.isfinite(x[~poisoned])) else f"{self.name} is not finite outside {where}"
        holds = _KINDS[self.kind](part)
        return None if np.all(holds) else f"{where} is not {self.kind.replace('_', ' ')}"


_KINDS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "zero": lambda y: y == 0,
    "one": lambda y: y == 1,
    "finite": np.isfinite,
    "minus_inf": lambda y: y == -np.inf,
    "nan": np.isnan,
    "sums_to_one": lambda y: np.abs(y.sum(axis=-1) - 1) <= 1e-12,
}


def per_query_head(case: SdpaCase | FlashCase | RingCase) -> tuple[np.ndarray, np.ndarray]:
    """k and v as each query head sees them: with enable_gqa, key/value head h // G for query head h,
    (..., Hkv, S, *) -> (..., H, S, *), G = H / Hkv; else k and v as they are."""
    if not case.enable_gqa:
        return case.k, case.v
    H, Hkv = case.q.shape[-3], case.k.shape[-3]
    heads = np.arange(H) // (H // Hkv)  # query head h -> its key/value head
    return np.take(case.k, heads, axis=-3), np.take(case.v, heads, axis=-3)


def w_o_bias(case: MhaCase) -> np.ndarray:
    """MHA's output where every head sees no key: zero heads, then W_o 0 + b_o (0 without biases)."""
    return case.state.get("w_o.bias", np.zeros(case.q.shape[-1]))


def first_value(case: SdpaCase) -> np.ndarray:
    """v (..., 1, Ev): the one key, whose weight is exp(s - s) / exp(s - s) = 1 whatever s is."""
    return case.v


_VALUE_NAMES = {w_o_bias: "w_o.bias", first_value: "v[..., 0, :]"}


def _index_text(index: Any) -> str:
    parts = index if isinstance(index, tuple) else (index,)
    return ", ".join(":" if part == slice(None) else
                     f"{part.start or ''}:{part.stop}" if isinstance(part, slice) else str(part) for part in parts)
