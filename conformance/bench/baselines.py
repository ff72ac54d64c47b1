"""The baselines of `python -m conformance compare`: what our backends are timed against, written plainly.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff.

- `tutorial_attention`: the original tutorial's NumPy formulation (The Annotated Transformer's `attention`).
  It differs from the spec in one place: a fully masked row gets the uniform average of the values
  (every score is -1e9, so the softmax is flat) where the spec gives zeros.
- `jax_plain_attention`: softmax(q k^T * scale) v with jax.nn.softmax, the way one writes it in JAX.
- `jax_builtin_attention`: jax.nn.dot_product_attention, in our (B, H, L, E) layout: it takes (B, T, N, H)
  (heads after the sequence), so the heads axis is swapped in and out around it, inside the jitted code;
  on CUDA in bfloat16 the benchmark also runs it with implementation="cudnn".
- `jax_plain_grouped_attention`, `torch_repeated_attention`: grouped-query attention (k and v with Hkv heads,
  each shared by G = H / Hkv query heads) written plainly: q split into its groups, and k, v repeated per head.
- `multi_head`, `block`: the projections and the feed-forward network around any of these, written once
  for NumPy and jax.numpy (`xp`): self-attention, post-LN, ReLU, as our default block.
- `calls`: each framework's baselines by the label the benchmark prints, ready to time.
- `torch_multihead`, `torch_encoder_layer`: nn.MultiheadAttention and nn.TransformerEncoderLayer holding
  our state dict, in eval mode (torch's built-ins here, and the tests' reference); our parameter names map to
  theirs in one place, the built-ins' conversions (conformance/builtins/torch_mha.py `parameters` and
  `state_of`, torch_encoder_layer.py likewise); `torch_attn_mask` maps our mask to their convention.
- `random_state`: parameters for any of these and for our modules, named as in the state-dict contract.

Frameworks are imported inside the functions that use them, so this module imports with NumPy alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np

Attend = Callable[[Any, Any, Any], Any]  # (q, k, v) in (B, H, L, E) layout -> out (B, H, L, Ev)


def tutorial_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, as the original tutorial computes it:
    masked_fill(mask == 0, -1e9), then softmax as exp(x - max) / sum over the last axis."""
    d_k = q.shape[-1]
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(d_k)  # (..., L, E) x (..., E, S) -> (..., L, S)
    if mask is not None:
        scores = np.where(mask == 0, -1e9, scores)  # masked_fill: a fully masked row becomes flat
    exp = np.exp(scores - np.max(scores, axis=-1, keepdims=True))  # (..., L, S)
    weights = exp / np.sum(exp, axis=-1, keepdims=True)  # (..., L, S)
    return weights @ v  # (..., L, S) x (..., S, Ev) -> (..., L, Ev)


def jax_plain_attention(q: Any, k: Any, v: Any) -> Any:
    """softmax(Q K^T * scale) V with jax.nn.softmax; jit it around the caller."""
    import jax
    import jax.numpy as jnp

    scores = q @ jnp.swapaxes(k, -1, -2) * (1 / math.sqrt(q.shape[-1]))  # (B, H, L, E) x (B, H, E, S) -> (B, H, L, S)
    return jax.nn.softmax(scores, axis=-1) @ v  # (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)


def jax_builtin_attention(q: Any, k: Any, v: Any, *, implementation: str | None = None) -> Any:
    """jax.nn.dot_product_attention on (B, H, L, E) inputs: it wants (B, T, N, H), heads after the sequence.
    implementation: its own option (None: XLA; "cudnn": cuDNN's fused kernel, CUDA and half precision only)."""
    import jax
    import jax.numpy as jnp

    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # (B, H, L, E) -> (B, L, H, E)
    out = jax.nn.dot_product_attention(q, k, v, implementation=implementation)  # (B, L, H, Ev)
    return jnp.swapaxes(out, 1, 2)  # (B, L, H, Ev) -> (B, H, L, Ev)


def jax_plain_grouped_attention(q: Any, k: Any, v: Any) -> Any:
    """Grouped-query softmax(Q K^T * scale) V with jax.nn.softmax: q split into Hkv groups of G heads, each group
    against its key/value head; jit it around the caller."""
    import jax
    import jax.numpy as jnp

    B, H, L, E = q.shape
    Hkv = k.shape[1]
    q = q.reshape(B, Hkv, H // Hkv, L, E)  # (B, H, L, E) -> (B, Hkv, G, L, E)
    scores = jnp.einsum("bkgle,bkse->bkgls", q, k) * (1 / math.sqrt(E))  # x (B, Hkv, S, E) -> (B, Hkv, G, L, S)
    out = jnp.einsum("bkgls,bksd->bkgld", jax.nn.softmax(scores, axis=-1), v)  # x (B, Hkv, S, Ev) -> (B, Hkv, G, L, Ev)
    return out.reshape(B, H, L, v.shape[-1])  # (B, Hkv, G, L, Ev) -> (B, H, L, Ev)


def torch_repeated_attention(q: Any, k: Any, v: Any) -> Any:
    """Grouped-query attention as F.scaled_dot_product_attention without enable_gqa: k and v repeated to the H
    query heads first (repeat_interleave: head h gets key/value head h // G)."""
    import torch.nn.functional as F

    G = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(G, dim=1) for x in (k, v))  # (B, Hkv, S, E) -> (B, H, S, E)
    return F.scaled_dot_product_attention(q, k, v)  # (B, H, L, Ev)


def multi_head(xp: ModuleType, state: Mapping[str, Any], x: Any, *, num_heads: int, attend: Attend) -> Any:
    """MultiHead(x) = Concat(head_1, ..., head_H) W_o^T + b_o, head_h = attend(x W_q,h^T + b_q,h, ...):
    self-attention with our state dict (w_q, w_k, w_v, w_o), in NumPy or jax.numpy (`xp`)."""
    B, L, D = x.shape

    def split(y: Any) -> Any:
        return xp.swapaxes(y.reshape(B, L, num_heads, D // num_heads), 1, 2)  # (B, L, D) -> (B, H, L, d_k)

    # 1) project, then split D into H heads of width d_k
    q, k, v = (split(_linear(state, f"w_{name}", x)) for name in "qkv")  # (B, H, L, d_k) each
    # 2) attend, every head at once
    out = attend(q, k, v)  # (B, H, L, d_k)
    # 3) concatenate the heads and mix them
    return _linear(state, "w_o", xp.swapaxes(out, 1, 2).reshape(B, L, D))  # (B, H, L, d_k) -> (B, L, D)


def block(xp: ModuleType, state: Mapping[str, Any], x: Any, *, num_heads: int, attend: Attend,
          eps: float = 1e-5) -> Any:
    """Post-LN encoder block: x = LN_1(x + MHA(x)), x = LN_2(x + W_2 relu(W_1 x + b_1) + b_2)."""
    attn = {name.removeprefix("attn."): value for name, value in state.items() if name.startswith("attn.")}
    x = _layer_norm(xp, state, "norm1", x + multi_head(xp, attn, x, num_heads=num_heads, attend=attend), eps)
    h = xp.maximum(_linear(state, "ffn.0", x), 0)  # (B, L, D) -> (B, L, F)
    return _layer_norm(xp, state, "norm2", x + _linear(state, "ffn.3", h), eps)  # (B, L, F) -> (B, L, D)


def _linear(state: Mapping[str, Any], name: str, x: Any) -> Any:
    return x @ state[f"{name}.weight"].T + state[f"{name}.bias"]  # (..., in) x (in, out) -> (..., out)


def _layer_norm(xp: ModuleType, state: Mapping[str, Any], name: str, x: Any, eps: float) -> Any:
    mean = xp.mean(x, axis=-1, keepdims=True)  # (B, L, D) -> (B, L, 1)
    var = xp.mean((x - mean) ** 2, axis=-1, keepdims=True)  # biased, as nn.LayerNorm
    return (x - mean) / xp.sqrt(var + eps) * state[f"{name}.weight"] + state[f"{name}.bias"]


# --- each framework's baselines, ready to time ----------------------------------------------------------

Call = tuple[Callable, Any]  # (call, params): call(params, *inputs) runs the operation, sdpa: q, k, v; else x


def calls(framework: str, operation: str, state: Mapping[str, Any], *, num_heads: int,
          fused: bool = False) -> dict[str, Call]:
    """{label: (call, params)}: the baselines of `framework` ("numpy", "jax" or "torch") for `operation`,
    `state` given in that framework's arrays. fused (bfloat16 on CUDA): JAX's built-in also with
    implementation="cudnn", the kernel our JAX fast path uses there."""
    return _CALLS[framework](operation, state, num_heads, fused)


def _numpy_calls(operation: str, state: Mapping[str, Any], num_heads: int, fused: bool) -> dict[str, Call]:
    return {"numpy tutorial": (_plain(np, tutorial_attention, operation, num_heads), state)}


def _jax_calls(operation: str, state: Mapping[str, Any], num_heads: int, fused: bool) -> dict[str, Call]:
    import jax.numpy as jnp

    found = {"jax plain": (_plain(jnp, jax_plain_attention, operation, num_heads), state),
             "jax.nn.dot_product_attention": (_plain(jnp, jax_builtin_attention, operation, num_heads), state)}
    if fused:
        cudnn = functools.partial(jax_builtin_attention, implementation="cudnn")
        found["jax.nn.dot_product_attention cudnn"] = (_plain(jnp, cudnn, operation, num_heads), state)
    return found


def _torch_calls(operation: str, state: Mapping[str, Any], num_heads: int, fused: bool) -> dict[str, Call]:
    import torch.nn.functional as F

    if operation == "sdpa":
        return {"torch built-in": (lambda _, q, k, v: F.scaled_dot_product_attention(q, k, v), None)}
    if operation == "mha":
        return {"torch built-in": (lambda mha, x: mha(x, x, x, need_weights=False),
                                   torch_multihead(state, num_heads=num_heads))}
    return {"torch built-in": (lambda layer, x: layer(x), torch_encoder_layer(state, num_heads=num_heads))}


_CALLS = {"numpy": _numpy_calls, "jax": _jax_calls, "torch": _torch_calls}


def _plain(xp: ModuleType, attend: Attend, operation: str, num_heads: int) -> Callable:
    """call(state, *inputs): `attend` alone (sdpa), or with the projections and FFN above around it."""
    if operation == "sdpa":
        return lambda _, q, k, v: attend(q, k, v)
    if operation == "mha":
        return lambda state, x: multi_head(xp, state, x, num_heads=num_heads, attend=attend)
    return lambda state, x: block(xp, state, x, num_heads=num_heads, attend=attend)


# --- our state dicts in torch's built-in layers ---------------------------------------------------------

def torch_multihead(state: Mapping[str, Any], *, num_heads: int, dtype: Any = None, device: Any = None) -> Any:
    """nn.MultiheadAttention(batch_first=True, dropout=0) in eval mode, holding our MHA `state` (NumPy arrays
    or torch tensors) in `dtype` (a NumPy dtype) on `device`; None keeps the state's own."""
    from torch import nn

    from conformance.builtins import torch_mha  # imports torch: only where torch is used, as everywhere here

    theirs = torch_mha.parameters(_tensors(state, dtype, device))
    weight = theirs["in_proj_weight"]  # (3D, D)
    mha = nn.MultiheadAttention(weight.shape[1], num_heads, dropout=0.0, batch_first=True, dtype=weight.dtype,
                                device=weight.device)
    mha.load_state_dict(theirs)  # strict: every parameter set, none left over
    return mha.eval()


def torch_encoder_layer(state: Mapping[str, Any], *, num_heads: int, norm_first: bool = False,
                        activation: str = "relu", eps: float = 1e-5, dtype: Any = None, device: Any = None) -> Any:
    """nn.TransformerEncoderLayer(batch_first=True, dropout=0) in eval mode, holding our block `state` (NumPy
    arrays or torch tensors) in `dtype` (a NumPy dtype) on `device`; None keeps the state's own. The defaults
    are our block's: post-LN, ReLU, eps 1e-5."""
    from torch import nn

    from conformance.builtins import torch_encoder_layer as built_in  # imports torch: only where torch is used

    theirs = built_in.parameters(_tensors(state, dtype, device))
    weight = theirs["linear1.weight"]  # (F, D)
    layer = nn.TransformerEncoderLayer(weight.shape[1], num_heads, weight.shape[0], dropout=0.0,
                                       activation=activation, layer_norm_eps=eps, batch_first=True,
                                       norm_first=norm_first, dtype=weight.dtype, device=weight.device)
    layer.load_state_dict(theirs)  # strict: every parameter set, none left over
    return layer.eval()


def torch_attn_mask(mask: np.ndarray, num_heads: int) -> Any:
    """Our keep-mask (B, 1|H, L, S), True = visible, -> nn.MultiheadAttention's 3-D attn_mask
    (B*H, L, S), True = NOT allowed to attend."""
    import torch

    B, _, L, S = mask.shape
    mask = np.broadcast_to(np.asarray(mask) != 0, (B, num_heads, L, S))  # (B, 1|H, L, S) -> (B, H, L, S)
    return torch.from_numpy(~mask.reshape(B * num_heads, L, S))  # (B, H, L, S) -> (B*H, L, S)


def _tensors(state: Mapping[str, Any], dtype: Any, device: Any) -> dict[str, Any]:
    """NumPy arrays or torch tensors -> torch tensors in `dtype` (a NumPy dtype) on `device`; None: as they are."""
    import torch

    to = None if dtype is None else torch.from_numpy(np.zeros(0, dtype)).dtype
    # a NumPy array is copied: torch wants writable memory, and ours may be read-only
    return {name: (value if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))).to(
        device=device, dtype=to) for name, value in state.items()}


# --- random parameters ----------------------------------------------------------------------------------


def random_state(kind: str, d_model: int, d_ff: int, rng: np.random.Generator,
                 dtype: Any = np.float64) -> dict[str, np.ndarray]:
    """Random parameters for kind "mha" (d_ff unused) or "block": weights of nn.Linear's scale,
    biases not 0 and LayerNorm gains not 1, so a mixed-up or ignored parameter shows in the output."""
    state = {}
    for name in ("w_q", "w_k", "w_v", "w_o"):
        state |= _random_linear(name, d_model, d_model, rng)
    if kind == "block":
        state = {f"attn.{name}": value for name, value in state.items()}
        state |= _random_linear("ffn.0", d_model, d_ff, rng) | _random_linear("ffn.3", d_ff, d_model, rng)
        for name in ("norm1", "norm2"):
            state |= {f"{name}.weight": rng.uniform(0.5, 1.5, d_model),
                      f"{name}.bias": rng.uniform(-0.5, 0.5, d_model)}
    elif kind != "mha":
        raise ValueError(f"random_state: kind must be 'mha' or 'block', got {kind!r}")
    return {name: value.astype(dtype) for name, value in state.items()}


def _random_linear(name: str, d_in: int, d_out: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """nn.Linear's range, uniform in [-1/sqrt(d_in), 1/sqrt(d_in)], for the weight (out, in) and bias."""
    bound = 1 / math.sqrt(d_in)
    return {f"{name}.weight": rng.uniform(-bound, bound, (d_out, d_in)),
            f"{name}.bias": rng.uniform(-bound, bound, d_out)}
