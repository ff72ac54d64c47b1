"""PyTorch's own attention modules, built from our state dicts, as references for the tests.

Shape legend: B batch, H heads, L query positions, S key/value positions, D = d_model, F = d_ff.

Our state dict keeps one nn.Linear per projection (w_q, w_k, w_v, w_o); nn.MultiheadAttention keeps the
three input projections stacked in one `in_proj_weight` (3D, D) and `in_proj_bias` (3D,), q then k then v.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

# our block's state name -> nn.TransformerEncoderLayer's, for everything but the attention
_LAYER_NAMES = {"ffn.0": "linear1", "ffn.3": "linear2", "norm1": "norm1", "norm2": "norm2"}


def torch_mha(state: Mapping[str, np.ndarray], num_heads: int, dtype: np.dtype) -> nn.MultiheadAttention:
    """nn.MultiheadAttention(batch_first=True, dropout=0) in eval mode, holding our MHA `state`."""
    d_model = state["w_q.weight"].shape[1]
    mha = nn.MultiheadAttention(d_model, num_heads, dropout=0.0, batch_first=True, dtype=_torch_dtype(dtype))
    mha.load_state_dict(_tensors(_mha_names(state), dtype))  # strict: every parameter set, none left over
    return mha.eval()


def torch_encoder_layer(state: Mapping[str, np.ndarray], num_heads: int, *, norm_first: bool,
                        activation: str, eps: float, dtype: np.dtype) -> nn.TransformerEncoderLayer:
    """nn.TransformerEncoderLayer(batch_first=True, dropout=0) in eval mode, holding our block `state`."""
    d_ff, d_model = state["ffn.0.weight"].shape  # (F, D)
    layer = nn.TransformerEncoderLayer(d_model, num_heads, d_ff, dropout=0.0, activation=activation,
                                       layer_norm_eps=eps, batch_first=True, norm_first=norm_first,
                                       dtype=_torch_dtype(dtype))
    attn = {name.removeprefix("attn."): value for name, value in state.items() if name.startswith("attn.")}
    names = {f"self_attn.{name}": value for name, value in _mha_names(attn).items()}
    for ours, theirs in _LAYER_NAMES.items():
        names |= {f"{theirs}.{part}": state[f"{ours}.{part}"] for part in ("weight", "bias")}
    layer.load_state_dict(_tensors(names, dtype))  # strict: every parameter set, none left over
    return layer.eval()


def torch_attn_mask(mask: np.ndarray, num_heads: int) -> torch.Tensor:
    """Our keep-mask (B, 1|H, L, S), True = visible, -> nn.MultiheadAttention's 3-D attn_mask
    (B*H, L, S), True = NOT allowed to attend."""
    B, _, L, S = mask.shape
    mask = np.broadcast_to(np.asarray(mask) != 0, (B, num_heads, L, S))  # (B, 1|H, L, S) -> (B, H, L, S)
    return torch.from_numpy(~mask.reshape(B * num_heads, L, S))  # (B, H, L, S) -> (B*H, L, S)


def random_state(kind: str, d_model: int, d_ff: int, rng: np.random.Generator,
                 dtype: np.dtype) -> dict[str, np.ndarray]:
    """Random parameters for kind "mha" (d_ff unused) or "block": weights of nn.Linear's scale,
    biases not 0 and LayerNorm gains not 1, so a mixed-up or ignored parameter shows in the output."""
    state = {}
    for name in ("w_q", "w_k", "w_v", "w_o"):
        state |= _linear(name, d_model, d_model, rng)
    if kind == "block":
        state = {f"attn.{name}": value for name, value in state.items()}
        state |= _linear("ffn.0", d_model, d_ff, rng) | _linear("ffn.3", d_ff, d_model, rng)
        for name in ("norm1", "norm2"):
            state |= {f"{name}.weight": rng.uniform(0.5, 1.5, d_model),
                      f"{name}.bias": rng.uniform(-0.5, 0.5, d_model)}
    elif kind != "mha":
        raise ValueError(f"random_state: kind must be 'mha' or 'block', got {kind!r}")
    return {name: value.astype(dtype) for name, value in state.items()}


def _linear(name: str, d_in: int, d_out: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """nn.Linear's range, uniform in [-1/sqrt(d_in), 1/sqrt(d_in)], for the weight (out, in) and bias."""
    bound = 1 / np.sqrt(d_in)
    return {f"{name}.weight": rng.uniform(-bound, bound, (d_out, d_in)),
            f"{name}.bias": rng.uniform(-bound, bound, d_out)}


def _mha_names(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our MHA state -> nn.MultiheadAttention's names, w_q/w_k/w_v stacked in that order."""
    stacked = {part: np.concatenate([state[f"w_{x}.{part}"] for x in "qkv"]) for part in ("weight", "bias")}
    return {"in_proj_weight": stacked["weight"],  # 3 x (D, D) -> (3D, D)
            "in_proj_bias": stacked["bias"],  # 3 x (D,) -> (3D,)
            "out_proj.weight": state["w_o.weight"], "out_proj.bias": state["w_o.bias"]}


def _tensors(state: Mapping[str, np.ndarray], dtype: np.dtype) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.asarray(value, dtype)) for name, value in state.items()}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype)).dtype
