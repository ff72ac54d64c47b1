"""torch's nn.TransformerEncoderLayer on its ordinary path as the contract's TransformerBlock.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The layer is built with batch_first=True, our norm_first, activation ("relu" or "gelu", its exact erf form)
and eps (its layer_norm_eps), and called with its defaults wherever the contract leaves room. Our state maps
onto its parameters by name: attn.* is its self_attn (an nn.MultiheadAttention: in_proj_* stacks w_q, w_k, w_v,
out_proj is w_o, as in torch_mha), norm1 and norm2 are its norm1 and norm2, ffn.0 its linear1 and ffn.3 its
linear2. The leading axes (...) of x fold into its batch B; our mask (an entry equal to 0 / False hides a key,
broadcasting to (..., H, L, L)) becomes its boolean src_mask (B * H, L, L), True where a key is hidden. Its
dropout sites are the spec's (the attention weights, both residual branches, after the activation), drawn from
torch's global RNG: adapters.torch_rng seeds it from the call's generator. It returns no weights.

Its ordinary path (_sa_block, whose attention runs with need_weights=False, then _ff_block) is the one it takes
in training mode or with autograd on: every call here runs with autograd on and x a leaf that requires grad, so
that also in eval mode it never takes the fast path (torch_encoder_layer_fast checks that one). vjp
differentiates it by autograd with our state entries as the leaves. The arguments are checked as the backends
check them (attention_np.common.validation), so bad input raises SPEC 7's errors before the layer sees it. Its
initial values are its own (Xavier-uniform in_proj, zero attention biases).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from attention_np.common import validation
from conformance import adapters
from conformance.builtins import torch_mha
from conformance.contract.features import Declaration

TITLE = "nn.TransformerEncoderLayer"  # the column of `python -m conformance frameworks`

asarray, to_numpy = adapters.arrays("torch")

RENAMED = {"norm1": "norm1", "norm2": "norm2", "ffn.0": "linear1", "ffn.3": "linear2"}  # ours -> the layer's,
# after attn.* (its self_attn), in state-dict order


class EncoderLayer:
    """nn.TransformerEncoderLayer (`layer`) behind the contract's interface, the path it takes left to
    `_forward`: what the ordinary path (TransformerBlock below) and the fast path (torch_encoder_layer_fast)
    share. torch changes the mode in place."""

    def __init__(self, d_model: int = 512, num_heads: int = 8, d_ff: int = 2048, dropout: float = 0.1, *,
                 norm_first: bool = False, activation: str = "relu", norm: str = "layer",
                 num_kv_heads: int | None = None, bias: bool = True, rope_theta: float | None = None,
                 eps: float = 1e-5, rng: torch.Generator | None = None, dtype: torch.dtype | None = None) -> None:
        """A fresh layer, its initial values drawn by torch from `rng` (None: the global RNG)."""
        validation.module_sizes(d_model, num_heads, d_ff)
        validation.probability("dropout", dropout)
        validation.activation(activation)
        validation.norm(norm)
        name = type(self).__name__
        torch_mha.refuse_layout(name, num_heads, validation.kv_heads(num_heads, num_kv_heads), rope_theta)
        refuse_layout(name, norm, activation, bias)
        with adapters.torch_rng(rng):
            self.layer = nn.TransformerEncoderLayer(d_model, num_heads, d_ff, dropout, activation, eps,
                                                    batch_first=True, norm_first=norm_first, dtype=dtype)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, num_heads: int, dropout: float = 0.1,
                        norm_first: bool = False, activation: str | None = None,
                        rope_theta: float | None = None, eps: float = 1e-5) -> Any:
        """The layer holding copies of `state` (NumPy or torch arrays, our names), in training mode."""
        state = torch_mha.owned(state)
        shapes = {name: tuple(x.shape) for name, x in state.items()}
        layout = validation.block_layout(shapes, num_heads, activation)  # sizes, Hkv, bias, norm, activation
        validation.probability("dropout", dropout)
        validation.state(cls.__name__, shapes, validation.block_state_shapes(num_heads=num_heads, **layout._asdict()))
        validation.same_floating_dtype(torch_mha.dtypes(**state), f"{cls.__name__}.from_state_dict: ")
        torch_mha.refuse_layout(cls.__name__, num_heads, layout.num_kv_heads, rope_theta)
        refuse_layout(cls.__name__, layout.norm, layout.activation, layout.bias)
        module = object.__new__(cls)
        with torch.device("meta"):  # torch: no memory or random draws for values about to be replaced
            module.layer = nn.TransformerEncoderLayer(layout.d_model, num_heads, layout.d_ff, dropout,
                                                      layout.activation, eps, batch_first=True,
                                                      norm_first=norm_first)
        module.layer.load_state_dict(parameters(state), assign=True)  # torch: assign takes the state's dtype
        return module

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The layer's parameters under our names (detached views of them)."""
        return state_of(self.layer.state_dict())

    def train(self, mode: bool = True) -> Any:
        self.layer.train(mode)
        return self

    def eval(self) -> Any:
        return self.train(False)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, need_weights: bool = True,
                 rng: torch.Generator | None = None) -> tuple[torch.Tensor, None]:
        """x (..., L, D) and None: the layer returns no weights, whatever need_weights asks."""
        return self._run(x, mask, rng=rng), None

    def _run(self, x: torch.Tensor, mask: torch.Tensor | None, *, rng: torch.Generator | None = None,
             given: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The layer on our shapes; `given` replaces its parameters (torch.func.functional_call)."""
        weight, H = self.layer.norm1.weight, self.layer.self_attn.num_heads
        validation.module_input("x", x.shape, weight.shape[0], "L")
        validation.same_floating_dtype(torch_mha.dtypes(x=x, parameters=weight))
        *batch, L, D = x.shape
        torch_mha.checked_mask(mask, (*batch, H, L, L), "..., H, L, L")

        # 1) fold the leading axes into the batch; the mask per (batch, head), True where a key is hidden
        folded = torch_mha.folded(x, tuple(batch))  # (..., L, D) -> (B, L, D)
        hidden = None if mask is None else torch_mha.hides(mask, (*batch, H, L, L))  # (B * H, L, L)

        # 2) the layer, on the path `_forward` takes
        with adapters.torch_rng(rng):
            out = self._forward(folded, hidden, given)  # (B, L, D)

        # 3) back to the leading axes
        return out.reshape(*batch, L, D)

    def _forward(self, x: torch.Tensor, hidden: torch.Tensor | None,
                 given: dict[str, torch.Tensor] | None) -> torch.Tensor:
        raise NotImplementedError  # the path: TransformerBlock's, or torch_encoder_layer_fast's


class TransformerBlock(EncoderLayer):
    """The layer on its ordinary path, in training and eval mode alike, with the contract's vjp."""

    def vjp(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[Any, None, Callable]:
        """out, weights (None) and pullback(d_out) -> (dx, {state-dict name: gradient}), without dropout."""
        validation.no_dropout(type(self).__name__, self.layer.dropout.p if self.layer.training else 0.0)
        names = tuple(self.state_dict())

        def run(x: torch.Tensor, **state: torch.Tensor) -> tuple[torch.Tensor, None]:
            return self._run(x, mask, given=parameters(state)), None  # the leaves as the layer's parameters

        arrays = {"x": x} | self.state_dict()
        out, _, pullback = adapters.autodiff(run, arrays, tuple(arrays))

        def pullback_of(d_out: torch.Tensor) -> tuple[Any, dict[str, Any]]:
            grads = pullback(d_out)
            return grads["x"], {name: grads[name] for name in names}

        return out, None, pullback_of

    def _forward(self, x: torch.Tensor, hidden: torch.Tensor | None,
                 given: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The ordinary path: autograd on and x requiring grad, which the layer's fast path refuses; the
        result detached, unless `given` (vjp's leaves) is to be differentiated."""
        if given is not None:  # inside adapters.autodiff: autograd on, every leaf requires grad
            return torch.func.functional_call(self.layer, given, (x,), {"src_mask": hidden})
        with torch.inference_mode(False), torch.enable_grad():
            leaf = x.detach().clone().requires_grad_(True)  # torch: a clone of an inference tensor joins autograd
            return self.layer(leaf, src_mask=hidden).detach()


# --- the conversions, shared with torch_encoder_layer_fast ---------------------------------------------------

def parameters(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """nn.TransformerEncoderLayer's parameters from our entries (RENAMED; attn.* as torch_mha.parameters)."""
    found = {f"self_attn.{name}": x for name, x in torch_mha.parameters(state, "attn.").items()}
    return found | {f"{theirs}.{part}": state[f"{ours}.{part}"] for ours, theirs in RENAMED.items()
                    for part in ("weight", "bias")}


def state_of(layer: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our entries, in state-dict order, from nn.TransformerEncoderLayer's parameters."""
    attention = {name.removeprefix("self_attn."): x for name, x in layer.items() if name.startswith("self_attn.")}
    return torch_mha.state_of(attention, "attn.") | {f"{ours}.{part}": layer[f"{theirs}.{part}"]
                                                     for ours, theirs in RENAMED.items() for part in ("weight", "bias")}


def refuse_layout(cls_name: str, norm: str, activation: str, bias: bool) -> None:
    """nn.TransformerEncoderLayer has LayerNorms, a ReLU or GELU feed-forward network and, with bias=False,
    no LayerNorm biases either."""
    if norm != "layer":
        raise ValueError(f"{cls_name}: nn.TransformerEncoderLayer has no RMSNorm (its norms are nn.LayerNorm); got "
                         f"norm={norm!r} (a state without norm1.bias)")
    if activation not in ("relu", "gelu"):
        raise ValueError(f"{cls_name}: nn.TransformerEncoderLayer has no gated feed-forward network; got "
                         f"activation={activation!r}")
    if not bias:
        raise ValueError(f"{cls_name}: nn.TransformerEncoderLayer's bias=False drops the LayerNorms' biases too, "
                         "which the contract keeps (norm1.bias, norm2.bias); got a state without Linear biases")


CONFORMANCE = Declaration({
    "weights": "returns no attention weights",
    "num_kv_heads": "one key/value head per query head (its self_attn is an nn.MultiheadAttention)",
    "rope_theta": "no rotary position embeddings",
    "norm_rms": "LayerNorm only",
    "swiglu": "a ReLU or GELU feed-forward network only",
    "bias_false": "its bias=False drops the LayerNorms' biases too, which the contract's layout keeps",
})
