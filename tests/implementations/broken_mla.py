"""A DeepSeek porter's view: multi-head latent attention (SPEC 3d) as attention_np's MultiHeadLatentAttention does
it, and variants of it with ONE realistic bug each, which the suite's mla operation must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.
MLA's widths: Dc = kv_lora_rank, En = qk_nope_head_dim, Er = qk_rope_head_dim, E = En + Er, Ev = v_head_dim.

Each variant subclasses attention_np's MultiHeadLatentAttention and overrides the one step it gets wrong (which
entries RoPE turns, the absorbed form's scale or its W_UV, what the cache holds, how the heads share k_R); everything
else, the argument checks of attention_np.common.validation included, is attention_np's, so bad calls raise what the
spec requires. Each variant's docstring says the bug, where it shows (one call, or decoding in one form), and which
check of the suite's mla operation rejects it (the measure names of `conformance.check` rows). No variant raises on
ordinary inputs: the bug is a wrong answer.

`MLA` is attention_np's correct MultiHeadLatentAttention as a module the suite can check; `BROKEN` maps a name to
each variant's.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from attention_np import asarray, scaled_dot_product_attention, to_numpy
from attention_np.latent import MultiHeadLatentAttention


class RopeOnTheLatent(MultiHeadLatentAttention):
    """RoPE turns the compressed latent c_KV too (its pairs, an odd last entry left), not k_R alone: the keys' and
    values' position-free parts, k_C and v_C, then depend on the position. Shows in one call and in decoding (the
    cache holds the turned latent) from position 1 on. Caught by: values."""

    def _latents(self, x: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c_kv, k_rope = super()._latents(x, positions)  # (..., L, Dc), (..., L, Er)
        paired = c_kv.shape[-1] // 2 * 2
        c_kv = np.concatenate([self._rope(c_kv[..., :paired], positions), c_kv[..., paired:]], axis=-1)  # the bug
        return c_kv, k_rope


class AbsorbedScaleOfTheLatentWidth(MultiHeadLatentAttention):
    """The absorbed form's attention at the kernel's default scale, 1 / sqrt(Dc + Er) of the absorbed query's width,
    where the heads' scale is 1 / sqrt(En + Er): every softmax sharper or flatter. Shows in absorbed decoding alone
    (one call and the expanded form keep the scale). Caught by: values."""

    def _absorbed(self, q_nope: np.ndarray, q_rope: np.ndarray, c_kv: np.ndarray, k_rope: np.ndarray,
                  mask: np.ndarray | None, **rules: Any) -> tuple[np.ndarray, np.ndarray | None]:
        return _absorbed(self, q_nope, q_rope, c_kv, k_rope, mask, scale=None, **rules)  # the bug: no scale


class CacheWithoutTheNorm(MultiHeadLatentAttention):
    """extend writes c_KV into the cache before kv_a_layernorm, and reads it back as if normalised: the latent's
    RMSNorm (and its gain) skipped on every cached position. One call normalises. Shows in decoding, in either form.
    Caught by: values."""

    def extend(self, x: np.ndarray, cache: Any, mask: np.ndarray | None = None, *, absorbed: bool = False,
               need_weights: bool = True) -> tuple[np.ndarray, np.ndarray | None, Any]:
        unnormed = self._replace(kv_a_layernorm=_Skipped(self.kv_a_layernorm.weight))  # the bug
        return MultiHeadLatentAttention.extend(unnormed, x, cache, mask, absorbed=absorbed, need_weights=need_weights)


class UvOnTheWrongSide(MultiHeadLatentAttention):
    """The absorbed form's output P_h c_KV multiplied by W_UV,h (Ev, Dc) reshaped to (Dc, Ev), not transposed: the
    shapes fit, the numbers are another matrix's (the same one only where Dc or Ev is 1). Shows in absorbed
    decoding alone. Caught by: values."""

    def _absorbed(self, q_nope: np.ndarray, q_rope: np.ndarray, c_kv: np.ndarray, k_rope: np.ndarray,
                  mask: np.ndarray | None, **rules: Any) -> tuple[np.ndarray, np.ndarray | None]:
        return _absorbed(self, q_nope, q_rope, c_kv, k_rope, mask, scale=self.scale, uv_reshaped=True, **rules)


class RopeKeyNotShared(MultiHeadLatentAttention):
    """k_R (..., S, Er) spread over the heads by repeating each position H times and reshaping to (..., H, S, Er):
    head h reads the positions' k_R in another order (head 0 position 0, 0, 1, 1, ...), where every head must read
    the one k_R of each position. Right with one head. Shows in one call and expanded decoding. Caught by: values."""

    def _expanded(self, q_nope: np.ndarray, q_rope: np.ndarray, c_kv: np.ndarray, k_rope: np.ndarray,
                  mask: np.ndarray | None, **rules: Any) -> tuple[np.ndarray, np.ndarray | None]:
        En, H = self.qk_nope_head_dim, self.num_heads
        kv = self._split_heads(self.kv_b_proj(c_kv))  # (..., S, Dc) -> (..., H, S, En + Ev)
        k_nope, v = kv[..., :En], kv[..., En:]
        *lead, S, Er = k_rope.shape
        k_rope = np.repeat(k_rope, H, axis=-2).reshape(*lead, H, S, Er)  # the bug: positions spread over the heads
        q = np.concatenate([q_nope, q_rope], axis=-1)  # (..., H, L, E)
        k = np.concatenate([k_nope, k_rope], axis=-1)  # (..., H, S, E)
        return scaled_dot_product_attention(q, k, v, mask, scale=self.scale, **rules)


class _Skipped:
    """A norm that returns its input (the weight kept, for the sizes read off it)."""

    def __init__(self, weight: np.ndarray) -> None:
        self.weight = weight

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x


def _absorbed(mla: MultiHeadLatentAttention, q_nope: np.ndarray, q_rope: np.ndarray, c_kv: np.ndarray,
              k_rope: np.ndarray, mask: np.ndarray | None, *, scale: float | None, uv_reshaped: bool = False,
              **rules: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """attention_np's absorbed form with the scale given (None: the kernel's default of the query's width) and W_UV
    transposed, or reshaped with uv_reshaped."""
    En, Dc, H = mla.qk_nope_head_dim, c_kv.shape[-1], mla.num_heads
    w_ukv = mla.kv_b_proj.weight.reshape(H, -1, Dc)  # (H, En + Ev, Dc)
    w_uk, w_uv = w_ukv[:, :En, :], w_ukv[:, En:, :]  # (H, En, Dc), (H, Ev, Dc)
    q = np.concatenate([q_nope @ w_uk, q_rope], axis=-1)  # (..., H, L, Dc + Er)
    k = np.concatenate([c_kv, k_rope], axis=-1)[..., None, :, :]  # (..., 1, S, Dc + Er)
    o_joined, weights = scaled_dot_product_attention(q, k, k, mask, scale=scale, enable_gqa=True, **rules)
    uv = w_uv.reshape(H, Dc, -1) if uv_reshaped else np.swapaxes(w_uv, -1, -2)  # (H, Dc, Ev)
    return o_joined[..., :Dc] @ uv, weights  # (..., H, L, Dc) x (H, Dc, Ev) -> (..., H, L, Ev)


def as_module(attention: type[MultiHeadLatentAttention], name: str) -> types.ModuleType:
    """A module object with the contract's name for the mla operation, MultiHeadLatentAttention (an `attention`),
    and attention_np's array conversions."""
    module = types.ModuleType(name, f"multi-head latent attention through {attention.__name__}.")
    module.asarray, module.to_numpy = asarray, to_numpy
    module.MultiHeadLatentAttention = attention
    return module


VARIANTS: dict[str, type[MultiHeadLatentAttention]] = {
    "rope_on_the_latent": RopeOnTheLatent,
    "absorbed_scale_of_the_latent_width": AbsorbedScaleOfTheLatentWidth,
    "cache_without_the_norm": CacheWithoutTheNorm,
    "uv_on_the_wrong_side": UvOnTheWrongSide,
    "rope_key_not_shared": RopeKeyNotShared,
}
MLA = as_module(MultiHeadLatentAttention, __name__)
BROKEN = {name: as_module(cls, f"{__name__}.{name}") for name, cls in VARIANTS.items()}
