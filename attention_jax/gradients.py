"""Backward passes: the vector-Jacobian products of attention, multi-head attention and the transformer
block, in JAX.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The same functions as the NumPy backend's, whose backward passes are derived by hand; here jax.vjp
differentiates the forward code itself, so nothing is written twice. Modules are differentiated
without dropout: in eval mode, or with dropout 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from attention_np.common import validation

from .functional import _dtypes, scaled_dot_product_attention
from .primitives import _score_rule, _with_parameters

Grads = dict[str, jax.Array]


def scaled_dot_product_attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    *,
    bias: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | jax.Array = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: jax.Array | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, Callable]:
    """dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dP * P)),  dQ = dS K * scale,  dK = dS^T Q * scale,
    dbias = dS, for O = P V and P = softmax(S) over the visible keys, S = Q K^T * scale + bias.
    With softcap, S = c tanh(R / c) + bias, R = Q K^T * scale: dR = dS * (1 - tanh^2(R / c)), and dQ, dK
    take dR in place of dS (dbias is still dS). q_offset, window and key_lengths take no gradient. With
    enable_gqa, k and v are broadcast over each group of query heads, so dK and dV are summed over the group.
    With score_mod, S = score_mod(R') + bias, R' the (soft-capped) scaled scores: dR' = score_mod's vjp at dS,
    which also gives its parameters' gradients; mask_mod takes no gradient. With sinks, d sink =
    -sum_i p_i rowsum(dP * P)_i, p_i the sink's share of row i's denominator.

    Args:
        q, k, v, mask, bias, is_causal, scale, q_offset, window, key_lengths, softcap, enable_gqa: as for
            scaled_dot_product_attention (no dropout).
        mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
            needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
        score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and before
            bias; needs four axes as mask_mod.
        sinks: one logit per head, broadcasting to (..., H), as for scaled_dot_product_attention.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), as for scaled_dot_product_attention; constants: they take
            no gradient (their bias -slope_h * |p_i - j| joins S as bias does, dS unchanged).

    Returns:
        out (..., L, Ev), weights (..., L, S) and pullback(d_out (..., L, Ev)) -> (dq, dk, dv, dbias),
        dbias None when bias is None; with a score_mod, (dq, dk, dv, dbias, d_score_mod), d_score_mod a dict
        {parameter name: gradient} of score_mod.parameters (empty for a plain function); with sinks, d_sinks
        (sinks' shape) follows dbias: (dq, dk, dv, dbias, d_sinks) or (dq, dk, dv, dbias, d_sinks, d_score_mod).
    """
    _, parameters = _score_rule(score_mod)  # jax: a ScoreMod's parameters, differentiated as arguments

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None, sinks: jax.Array | None,
                  parameters: dict[str, jax.Array]) -> tuple:
        return scaled_dot_product_attention(q, k, v, mask, bias=bias, is_causal=is_causal, scale=scale,
                                            q_offset=q_offset, window=window, key_lengths=key_lengths,
                                            softcap=softcap, enable_gqa=enable_gqa, mask_mod=mask_mod,
                                            score_mod=_with_parameters(score_mod, parameters), sinks=sinks,
                                            alibi_slopes=alibi_slopes)  # a constant

    sinks = None if sinks is None else jnp.asarray(sinks)  # jax: differentiated as an argument
    out, pull, weights = jax.vjp(attention, q, k, v, bias, sinks, parameters, has_aux=True)  # jax: autodiff of
    # the forward

    def pullback(d_out: jax.Array) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        *grads, d_sinks, d_parameters = pull(d_out)
        grads = (*grads, d_sinks) if sinks is not None else tuple(grads)
        return grads if score_mod is None else (*grads, dict(d_parameters))

    return out, weights, pullback


def multi_head_attention_vjp(mha: Any, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None, *,
                             is_causal: bool = False, mask_mod: Callable[..., Any] | None = None,
                             score_mod: Callable[..., Any] | None = None) -> tuple[jax.Array, jax.Array, Callable]:
    """Backward through MultiHead(Q, K, V): the output projection, the heads' merge, attention per head,
    the input projections, in reverse. is_causal, mask_mod and score_mod go to attention on the heads
    (B, H, L, d_k), as in MultiHeadAttention.__call__.

    Returns:
        out (..., L, D), weights (..., H, L, S) and pullback(d_out (..., L, D)) -> (dq, dk, dv, dparams),
        dparams {state-dict name: gradient}, and with a score_mod its parameters' gradients under
        "score_mod.<name>".
    """
    validation.no_dropout(type(mha).__name__, mha.dropout if mha.training else 0.0)
    _, parameters = _score_rule(score_mod)  # jax: a ScoreMod's parameters, differentiated as arguments

    def attention(m: Any, q: jax.Array, k: jax.Array, v: jax.Array, parameters: Grads) -> tuple:
        return m(q, k, v, mask, is_causal=is_causal, mask_mod=mask_mod,
                 score_mod=_with_parameters(score_mod, parameters))

    out, pull, weights = jax.vjp(attention, mha, q, k, v, parameters, has_aux=True)

    def pullback(d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, Grads]:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        d_mha, dq, dk, dv, d_parameters = pull(d_out)
        # jax: the gradient of a module is a module
        return dq, dk, dv, d_mha.state_dict() | _score_mod_grads(d_parameters)

    return out, weights, pullback


def transformer_block_vjp(block: Any, x: jax.Array, mask: jax.Array | None = None, *, is_causal: bool = False,
                          mask_mod: Callable[..., Any] | None = None,
                          score_mod: Callable[..., Any] | None = None) -> tuple[jax.Array, jax.Array, Callable]:
    """Backward through the block (post-LN or pre-LN); self-attention's three input gradients add up.
    is_causal, mask_mod and score_mod go to the attention, as in TransformerBlock.__call__.

    Returns:
        y (..., L, D), weights (..., H, L, L) and pullback(d_out (..., L, D)) -> (dx, dparams), and with a
        score_mod its parameters' gradients under "score_mod.<name>" (the caller's function, not the block's).
    """
    validation.no_dropout(type(block).__name__, block.dropout if block.training else 0.0)
    _, parameters = _score_rule(score_mod)  # jax: a ScoreMod's parameters, differentiated as arguments

    def layers(b: Any, x: jax.Array, parameters: Grads) -> tuple:
        return b(x, mask, is_causal=is_causal, mask_mod=mask_mod, score_mod=_with_parameters(score_mod, parameters))

    y, pull, weights = jax.vjp(layers, block, x, parameters, has_aux=True)

    def pullback(d_out: jax.Array) -> tuple[jax.Array, Grads]:
        validation.cotangent("d_out", d_out.shape, y.shape, _dtypes(d_out=d_out, out=y))
        d_block, dx, d_parameters = pull(d_out)
        return dx, d_block.state_dict() | _score_mod_grads(d_parameters)

    return y, weights, pullback


def _score_mod_grads(grads: Grads) -> Grads:
    """{"score_mod.<name>": gradient}: the score function's parameters' gradients beside the state dict's."""
    return {f"score_mod.{name}": grad for name, grad in grads.items()}


