"""A kernel author's view of learned sinks (SPEC 2h) and ALiBi (SPEC 2i): attention_np's sdpa, flash, ring and flex
attention as a module the suite can check, and variants with ONE realistic bug each in how the sink joins the softmax
or where ALiBi measures its distance, which the suite's sdpa, flash and ring operations must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Each variant wraps ONE of attention_np's forward functions and gives the result that bug gives, derived from the
correct result in a few lines (the docstring says how), so the wrong numbers are the bug's exactly; its vjps and
everything else are attention_np's, the argument checks of attention_np.common.validation included, so bad calls
raise what the spec requires. Each variant's docstring says the bug and which check of the suite rejects it (the
measure names of `conformance.check` rows). No variant raises on ordinary inputs, and each is right on every call
without sinks or alibi_slopes: the suite's cases before it drew them never told them from attention_np.

`SINKS` is attention_np's module as the suite checks it; `BROKEN` maps a name to each variant's module, `OPERATIONS`
to the operation whose checks reject it.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from typing import Any

import numpy as np

import attention_np

NAMES = ("asarray", "to_numpy", "scaled_dot_product_attention", "scaled_dot_product_attention_vjp", "flash_attention",
         "flash_attention_vjp", "ring_attention", "ring_attention_vjp", "flex_attention", "flex_attention_vjp",
         "create_block_mask")  # the contract's names of the four operations


def _scores_batch(q: np.ndarray, v: np.ndarray, enable_gqa: bool) -> tuple[int, ...]:
    """The scores' leading axes (..., H): q's heads with enable_gqa."""
    return np.broadcast_shapes(q.shape[:-2], (*v.shape[:-3], q.shape[-3]) if enable_gqa else v.shape[:-2])


def _repeated(v: np.ndarray, q: np.ndarray, enable_gqa: bool) -> np.ndarray:
    """v per query head: (..., Hkv, S, Ev) -> (..., H, S, Ev) with enable_gqa."""
    return np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3) if enable_gqa else v


def _sink_counted(out: np.ndarray, lse: np.ndarray, sinks: np.ndarray, times: int) -> tuple[np.ndarray, np.ndarray]:
    """out and lse had the sink joined `times` times, not once: the denominator exp(lse) grows by (times - 1)
    exp(sink), lse' = logaddexp(lse, log(times - 1) + sink), and out shrinks by exp(lse - lse')."""
    if times == 1:
        return out, lse
    sink = np.broadcast_to(sinks, lse.shape[:-1])[..., None]  # (..., 1)
    grown = np.logaddexp(lse, math.log(times - 1) + sink)  # (..., L)
    with np.errstate(invalid="ignore"):  # -inf - -inf where no key and no sink: nothing to shrink there
        shrink = np.where(np.isneginf(grown), 1.0, np.exp(lse - grown))
    return (out * shrink[..., None]).astype(out.dtype), grown.astype(lse.dtype)


class SinkCarriesFirstValue:
    """The sink taken as one more key whose value is the first key's, v_0, where it carries none: each row's out gains
    p_sink v_0, p_sink = 1 - rowsum(weights) the sink's share (gpt-oss's sink stored as a key of the cache, its value
    slot not zeroed). Right without sinks. Caught by: values."""

    name, operation, wraps = "sink_carries_first_value", "sdpa", "scaled_dot_product_attention"

    def __call__(self, function: Callable, q: Any, k: Any, v: Any, *args: Any, need_weights: bool = True,
                 **keywords: Any) -> Any:
        out, weights = function(q, k, v, *args, need_weights=True, **keywords)
        if keywords.get("sinks") is None:
            return out, weights if need_weights else None
        p_sink = 1 - weights.sum(axis=-1, keepdims=True)  # (..., L, 1)
        first = _repeated(v, q, keywords.get("enable_gqa", False))[..., :1, :]  # (..., 1, Ev)
        return (out + p_sink * first).astype(out.dtype), weights if need_weights else None


class SinkPerTile:
    """flash_attention's online softmax adds exp(sink - m) to its running denominator at every key tile, not once
    when it starts: the sink counted ceil(S / block_k) times. Right with one key tile, or without sinks. Caught by:
    values."""

    name, operation, wraps = "sink_per_tile", "flash", "flash_attention"

    def __call__(self, function: Callable, q: Any, k: Any, v: Any, *args: Any, **keywords: Any) -> Any:
        out, lse = function(q, k, v, *args, **keywords)
        if keywords.get("sinks") is None:
            return out, lse
        tiles = max(1, -(-k.shape[-2] // keywords.get("block_k", 128)))
        return _sink_counted(out, lse, keywords["sinks"], tiles)


class SinkPerDevice:
    """ring_attention merges each device's partial result with the sink in it, so the merged denominator holds the
    sink once per device, P times. Right on one device, or without sinks. Caught by: values."""

    name, operation, wraps = "sink_per_device", "ring", "ring_attention"

    def __call__(self, function: Callable, q: Any, k: Any, v: Any, **keywords: Any) -> Any:
        out, lse = function(q, k, v, **keywords)
        if keywords.get("sinks") is None:
            return out, lse
        return _sink_counted(out, lse, keywords["sinks"], keywords["devices"])


class _AlibiAsBias:
    """ALiBi passed on as an additive bias built from `distance(p, j)` (p_i = q_offset + i, j the keys), in place of
    alibi_slopes: the bug is the distance."""

    def distance(self, p: np.ndarray, j: np.ndarray, i: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, function: Callable, q: Any, k: Any, v: Any, *args: Any, **keywords: Any) -> Any:
        slopes = keywords.pop("alibi_slopes", None)
        if slopes is None:
            return function(q, k, v, *args, **keywords)
        batch, (L, S) = _scores_batch(q, v, keywords.get("enable_gqa", False)), (q.shape[-2], k.shape[-2])
        offset = np.reshape(keywords.get("q_offset", 0), (*np.shape(keywords.get("q_offset", 0)), 1, 1))
        i, j = np.arange(L)[:, None], np.arange(S)  # (L, 1), (S,)
        alibi = -np.broadcast_to(slopes, batch)[..., None, None] * self.distance(offset + i, j, i)  # (..., L, S)
        bias = alibi if keywords.get("bias") is None else keywords["bias"] + alibi
        return function(q, k, v, *args, **keywords | {"bias": bias.astype(q.dtype)})


class AlibiSignedDistance(_AlibiAsBias):
    """ALiBi's penalty slope_h (p_i - j), the signed distance, where the rule is slope_h |p_i - j|: right on every key
    a causal query sees (j <= p_i), a reward growing with the distance on the keys after it. Caught by: values."""

    name, operation, wraps = "alibi_signed_distance", "sdpa", "scaled_dot_product_attention"

    def distance(self, p: np.ndarray, j: np.ndarray, i: np.ndarray) -> np.ndarray:
        return p - j  # the bug: no absolute value


class AlibiIgnoresQueryOffset(_AlibiAsBias):
    """ALiBi's distance |i - j| from the query's row i, where the rule takes its position p_i = q_offset + i: right at
    q_offset 0 (top-left), wrong bottom-right and in a cache's decoding steps. Caught by: values."""

    name, operation, wraps = "alibi_ignores_q_offset", "flash", "flash_attention"

    def distance(self, p: np.ndarray, j: np.ndarray, i: np.ndarray) -> np.ndarray:
        return np.abs(i - j)  # the bug: the row, not the position


def as_module(name: str, variant: Any = None) -> types.ModuleType:
    """attention_np's sdpa, flash, ring and flex attention under `name`, with `variant` wrapping the function it names
    (its signature kept, so the suite reads the same keywords from it)."""
    module = types.ModuleType(name, "attention_np's sdpa, flash, ring and flex attention" +
                              ("" if variant is None else f", {variant.wraps} with the bug {variant.name}"))
    for attribute in NAMES:
        setattr(module, attribute, getattr(attention_np, attribute))
    if variant is not None:
        function = getattr(attention_np, variant.wraps)
        setattr(module, variant.wraps, functools.wraps(function)(functools.partial(variant, function)))
    return module


VARIANTS: dict[str, Any] = {variant.name: variant for variant in (
    SinkCarriesFirstValue(), SinkPerTile(), SinkPerDevice(), AlibiSignedDistance(), AlibiIgnoresQueryOffset())}
SINKS = as_module(__name__)
BROKEN = {name: as_module(f"{__name__}.{name}", variant) for name, variant in VARIANTS.items()}
OPERATIONS = {name: variant.operation for name, variant in VARIANTS.items()}
