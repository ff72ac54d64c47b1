"""The records the backends pass from their public functions down to the loops: named, typed fields instead
of dicts, so that a reader and a type checker can follow `q_offset` or `block_q` through the calls. Each holds
plain values or the backend's own arrays, so it is written once here for all three.
"""

from __future__ import annotations

from typing import Any, NamedTuple

Window = tuple[int | None, int | None]


class Structure(NamedTuple):
    """Which keys each query may see by position (SPEC 2a), apart from the mask and the bias: the rules that
    scaled_dot_product_attention, its fast path and the tiled kernels build from positions p_i = q_offset + i
    and j."""

    is_causal: bool  # hide keys j > p_i
    q_offset: Any  # the position of query 0: an int, or an integer array broadcasting to (...)
    window: Window | None  # (left, right), checked (validation.window): hide keys outside p_i - left .. p_i + right
    key_lengths: Any  # None, or an integer array broadcasting to (...): hide keys j >= key_lengths


class LinearOptions(NamedTuple):
    """linear_attention's keywords, as its public functions pass them down to the problem they build."""

    feature_map: str  # the name of phi in FEATURE_MAPS
    is_causal: bool  # prefix sums (or chunks) instead of global sums
    key_lengths: Any  # None, or an integer array broadcasting to (...): hide keys j >= key_lengths
    eps: float  # added to the normaliser
    chunk: int | None  # causal: positions per chunk (None: prefix sums)
    update_rule: str  # the recurrence of the state: "linear", "gated", "delta" or "gated_delta"
    decay: Any  # None, or the log-space decay g (..., S, 1) or (..., S, E) of "gated" and "gated_delta"
    beta: Any  # None, or the update rate (..., S, 1) of "delta" and "gated_delta"


class FlashOptions(NamedTuple):
    """flash_attention's keywords, as its public functions (and ring attention's passes) hand them to the tiled
    passes; `window` as given, checked where it is read."""

    is_causal: bool
    scale: float | None
    q_offset: Any  # an int, or an integer array broadcasting to (...)
    window: Window | None
    key_lengths: Any  # None, or an integer array broadcasting to (...)
    softcap: float | None
    enable_gqa: bool
    block_q: int | None  # queries per tile (None: chosen from the shapes)
    block_k: int | None  # keys per tile (None: chosen from the shapes)
    sinks: Any = None  # one logit per head, broadcasting to (..., H), or None (ring attention takes none)
    alibi_slopes: Any = None  # ALiBi's slopes, (H,) or (B, H), or None


class MhaLayout(NamedTuple):
    """A MultiHeadAttention state's sizes and options, read off its entries' shapes (validation.mha_layout)."""

    d_model: int  # w_q.weight's columns
    num_kv_heads: int  # w_k.weight's rows / d_k
    bias: bool  # whether the projections have biases
    sinks: bool = False  # whether the state holds the sink logits `sinks` (H,)


class LatentSizes(NamedTuple):
    """MultiHeadLatentAttention's sizes (validation.latent_sizes), read off a state's shapes by latent_layout."""

    d_model: int  # D
    num_heads: int  # H
    q_lora_rank: int | None  # Dq, the queries' latent; None: the queries projected directly (q_proj)
    kv_lora_rank: int  # Dc, the keys' and values' latent, what the cache holds per position
    qk_nope_head_dim: int  # En, each head's query/key entries without position
    qk_rope_head_dim: int  # Er, each head's query entries turned by RoPE; one key of Er shared by the heads
    v_head_dim: int  # Ev, each head's value width


class BlockLayout(NamedTuple):
    """A TransformerBlock state's sizes and options, read off its entries' shapes (validation.block_layout)."""

    d_model: int
    num_kv_heads: int
    bias: bool  # whether the projections or the feed-forward have biases
    d_ff: int  # the feed-forward's hidden width
    norm: str  # "layer", or "rms" (no norm1.bias)
    activation: str  # "relu", "gelu" or "swiglu"
    sinks: bool = False  # whether attention holds the sink logits attn.sinks (H,)
