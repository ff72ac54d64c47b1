"""The fast path of scaled dot-product attention in JAX: the same result as the explicit path, without
the weights, in the formulation XLA compiles best under jit, or cuDNN's fused kernel on an NVIDIA GPU.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Under jit the explicit formulation is already the fast one on the CPU: XLA fuses the mask, the shift, the
exponential and the normalisation into one pass, and without the weights among the outputs it never
writes the (..., L, S) probabilities to memory. Normalising after the value product, as the NumPy fast
path does, is slower here (measured 99 ms against 78 ms at B=2, H=8, L=S=1024, E=64), and
jax.nn.dot_product_attention is slower still on the CPU, computes its softmax in float32 even for float64
inputs, and averages the values of a fully masked row.

On CUDA, float16 and bfloat16 go to jax.nn.dot_product_attention(implementation="cudnn"), the fused flash
kernel, where it needs no mask of ours: no mask, no bias, and is_causal only with L = S (the one shape
where its causal rule and ours agree; no row is then fully masked). It also needs E = Ev, a multiple of 8
from 8 to 128. The choice is made when the function is lowered (jax.lax.platform_dependent), so the
same jitted function still runs the formulation below when its inputs live on the CPU. Everything else,
float32 and float64 included, takes the formulation, float16 and bfloat16 in float32 as on the explicit
path. So do q_offset, window, key_lengths and softcap: jax.nn.dot_product_attention's local_window_size and
key_value_seq_lengths are not used, as the row it leaves with no visible key averages the values where ours
gives zeros, and it has no offset for the queries. Grouped-query attention (k and v with one head that
several query heads share) takes the formulation too, where jnp.matmul broadcasts the shared head: no copy of
k or v per query head (XLA's temporary memory measured the same as with one head each). A mask_mod or a
score_mod takes the formulation as well, evaluated on the scores in full as on the explicit path, and so do sinks
(the cuDNN call has no sink logit).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from attention_np.common import validation
from attention_np.common.records import Structure

from .primitives import _at_least_float32, _masked_softmax, _modded_whole, _Mods, _ranked, _visible

FUSED = "cudnn"  # jax.nn.dot_product_attention's implementation on CUDA ("xla" runs the same code on the CPU)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, *,
              bias: jax.Array | None, structure: Structure, scale: float, softcap: float | None,
              batch: tuple, mods: _Mods | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """softmax(score_mod(softcap(Q K^T * scale)) + bias) V over the visible keys, as
    scaled_dot_product_attention's out; `sinks` (None: none) laid out against the scores (..., 1, 1), each row's
    sink logit in its denominator."""
    formulated = functools.partial(_formulated, mask=mask, bias=bias, structure=structure, scale=scale,
                                   softcap=softcap, batch=batch, mods=mods, sinks=sinks)
    if not (mods is None and sinks is None  # mask_mod, score_mod and sinks: the formulation's
            and _fused_applies(q, k, v, mask=mask, bias=bias, structure=structure, softcap=softcap, batch=batch)
            and _cuda_present()):
        return formulated(q, k, v)
    fused = functools.partial(_fused, is_causal=structure.is_causal, scale=scale, batch=batch)
    return jax.lax.platform_dependent(q, k, v, cuda=fused, default=formulated)  # chosen where it is lowered


def _formulated(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None, bias: jax.Array | None,
                structure: Structure, scale: float, softcap: float | None, batch: tuple,
                mods: _Mods | None, sinks: jax.Array | None) -> jax.Array:
    """The explicit formulation without the weights, in at least float32; out in the inputs' dtype."""
    dtype, work = q.dtype, _at_least_float32(q.dtype)  # float16, bfloat16: sums, softmax in float32
    q, k, v = (x.astype(work) for x in (q, k, v))
    visible = _visible(mask, bias, structure, (*batch, q.shape[-2], k.shape[-2]))  # None: every key
    scores = (q * scale) @ jnp.swapaxes(k, -1, -2)  # (..., L, E) x (..., E, S) -> (..., L, S)
    # the scale first, as on the explicit path: q k^T may overflow where (q * scale) k^T does not. Scaling
    # after the product lets XLA fuse it into the softmax's pass, 3% faster alone, not worth that difference
    if softcap is not None:  # soft-capping, before the bias and the masks
        scores = softcap * jnp.tanh(scores / softcap)
    scores, visible = _modded_whole(mods, scores, visible, batch, q.shape[1:-2])  # score_mod, mask_mod (if any)
    if bias is not None:
        scores = scores + _ranked(jnp.asarray(bias, dtype=scores.dtype), scores.ndim)
    out = _masked_softmax(scores, visible, sinks) @ v  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)
    return out.astype(dtype)


def _fused(q: jax.Array, k: jax.Array, v: jax.Array, *, is_causal: bool, scale: float, batch: tuple) -> jax.Array:
    """jax.nn.dot_product_attention on our layout: it takes (B, T, N, H), heads after the sequence, so the
    leading axes become its batch with one head each, a reshape rather than a transpose."""
    L, Ev = q.shape[-2], v.shape[-1]
    q, k, v = (jnp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v))
    q, k, v = (x.reshape(math.prod(batch), x.shape[-2], 1, x.shape[-1]) for x in (q, k, v))  # -> (B, L or S, 1, E)
    with jax.numpy_dtype_promotion("standard"):  # jax: its own function mixes float32 into half precision
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal,
                                           implementation=FUSED)  # (B, L, 1, Ev)
    return out.reshape(*batch, L, Ev)


def _fused_applies(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None,
                   bias: jax.Array | None, structure: Structure, softcap: float | None, batch: tuple) -> bool:
    """Whether cuDNN's kernel computes exactly our result for these inputs (see the module docstring)."""
    L, S, E, Ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    half = q.dtype in (jnp.float16, jnp.bfloat16)
    plain = (isinstance(structure.q_offset, int) and structure.q_offset == 0 and structure.window is None
             and structure.key_lengths is None and softcap is None)  # positions, windows, lengths: ours
    unmasked = plain and mask is None and bias is None and (L == S or not structure.is_causal)
    widths = Ev == E and E % 8 == 0 and 0 < E <= 128  # E = 0 (with an explicit scale): the formulation
    shared = validation.shared_kv_head(q.shape, k.shape, v.shape)  # GQA's groups: _fused would copy k, v per head
    return half and unmasked and widths and not shared and math.prod(batch) > 0


@functools.cache
def _cuda_present() -> bool:
    """Whether JAX sees an NVIDIA GPU; the cuDNN branch can only be traced where one is installed."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:  # jax: no CUDA backend in this jaxlib
        return False
