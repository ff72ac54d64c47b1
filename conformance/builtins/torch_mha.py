"""torch's nn.MultiheadAttention as the contract's MultiHeadAttention.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The layer is built with batch_first=True and called with its defaults wherever the contract leaves room. Our
state's w_q, w_k, w_v are its in_proj_weight (3D, D) and in_proj_bias (3D,), stacked in that order, and w_o is
its out_proj; bias=False is its own bias=False. The leading axes (...) of q, k and v broadcast and fold into its
batch B; our mask (an entry equal to 0 / False hides a key, broadcasting to (..., H, L, S)) becomes its boolean
attn_mask (B * H, L, S), True where a key is hidden. q, k and v reach it as three tensors, so its self-attention
fast path (q is k is v) is never taken. Dropout draws from torch's global RNG: adapters.torch_rng seeds it from
the call's generator. It returns the weights averaged over the heads (average_attn_weights=True), (..., L, S).
vjp differentiates its need_weights=False path (F.scaled_dot_product_attention inside) by autograd, with our
state entries as the leaves; the weights it returns come from a second call with need_weights=True. The
arguments are checked as the backends check them (attention_np.common.validation), so bad input raises SPEC 7's
errors before the layer sees it. Its initial values are its own (Xavier-uniform in_proj, zero biases).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from attention_np.common import validation
from conformance import adapters
from conformance.contract.features import Declaration

TITLE = "nn.MultiheadAttention"  # the column of `python -m conformance frameworks`

asarray, to_numpy = adapters.arrays("torch")


class MultiHeadAttention:
    """nn.MultiheadAttention (`layer`) behind the contract's interface; torch changes the mode in place."""

    def __init__(self, d_model: int = 512, num_heads: int = 8, dropout: float = 0.1, *,
                 num_kv_heads: int | None = None, bias: bool = True, rope_theta: float | None = None,
                 rng: torch.Generator | None = None, dtype: torch.dtype | None = None) -> None:
        """A fresh layer, its initial values drawn by torch from `rng` (None: the global RNG)."""
        validation.module_sizes(d_model, num_heads)
        refuse_layout(type(self).__name__, num_heads, validation.kv_heads(num_heads, num_kv_heads), rope_theta)
        validation.probability("dropout", dropout)
        with adapters.torch_rng(rng):
            self.layer = nn.MultiheadAttention(d_model, num_heads, dropout, bias=bias, batch_first=True, dtype=dtype)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, num_heads: int, dropout: float = 0.1,
                        rope_theta: float | None = None) -> MultiHeadAttention:
        """The layer holding copies of `state` (NumPy or torch arrays, our names), in training mode."""
        state = owned(state)
        shapes = {name: tuple(x.shape) for name, x in state.items()}
        layout = validation.mha_layout(shapes, num_heads)  # d_model, num_kv_heads and bias, from the shapes
        validation.probability("dropout", dropout)
        validation.state(cls.__name__, shapes, validation.mha_state_shapes(num_heads=num_heads, **layout._asdict()))
        validation.same_floating_dtype(dtypes(**state), f"{cls.__name__}.from_state_dict: ")
        refuse_layout(cls.__name__, num_heads, layout.num_kv_heads, rope_theta)
        module = object.__new__(cls)
        with torch.device("meta"):  # torch: no memory or random draws for values about to be replaced
            module.layer = nn.MultiheadAttention(layout.d_model, num_heads, dropout, bias=layout.bias,
                                                 batch_first=True)
        module.layer.load_state_dict(parameters(state), assign=True)  # torch: assign takes the state's dtype
        return module

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The layer's parameters under our names (detached views of them)."""
        return state_of(self.layer.state_dict())

    def train(self, mode: bool = True) -> MultiHeadAttention:
        self.layer.train(mode)
        return self

    def eval(self) -> MultiHeadAttention:
        return self.train(False)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                 need_weights: bool = True, rng: torch.Generator | None = None) -> tuple[Any, Any]:
        """out (..., L, D) and the weights averaged over the heads (..., L, S), or None with need_weights=False."""
        return self._attend(q, k, v, mask, need_weights=need_weights, rng=rng)

    def vjp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor | None = None) -> tuple[Any, Any, Callable]:
        """out, weights and pullback(d_out) -> (dq, dk, dv, {state-dict name: gradient}), without dropout."""
        validation.no_dropout(type(self).__name__, self.layer.dropout if self.layer.training else 0.0)
        names = tuple(self.state_dict())

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **state: torch.Tensor) -> tuple[Any, Any]:
            given = parameters(state)  # the layer's parameters made of the leaves, so gradients reach them
            out, _ = self._attend(q, k, v, mask, need_weights=False, given=given)
            return out, self._attend(q, k, v, mask, need_weights=True, given=given)[1]

        arrays = {"q": q, "k": k, "v": v} | self.state_dict()
        out, weights, pullback = adapters.autodiff(attend, arrays, tuple(arrays))

        def pullback_of(d_out: torch.Tensor) -> tuple[Any, Any, Any, dict[str, Any]]:
            grads = pullback(d_out)
            return grads["q"], grads["k"], grads["v"], {name: grads[name] for name in names}

        return out, weights, pullback_of

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                need_weights: bool, rng: torch.Generator | None = None,
                given: dict[str, torch.Tensor] | None = None) -> tuple[Any, Any]:
        """The layer on our shapes; `given` replaces its parameters (torch.func.functional_call)."""
        weight = self.layer.out_proj.weight
        batch = checked(q, k, v, mask, d_model=weight.shape[1], num_heads=self.layer.num_heads, parameters=weight)
        (L, D), S = q.shape[-2:], k.shape[-2]

        # 1) fold the leading axes into the batch; the mask per (batch, head), True where a key is hidden
        q, k, v = (folded(x, batch) for x in (q, k, v))  # (..., L, D) -> (B, L, D); k, v (B, S, D)
        hidden = None if mask is None else hides(mask, (*batch, self.layer.num_heads, L, S))  # (B * H, L, S)

        # 2) attend
        keywords = {"attn_mask": hidden, "need_weights": need_weights}
        with adapters.torch_rng(rng):
            out, weights = (self.layer(q, k, v, **keywords) if given is None else
                            torch.func.functional_call(self.layer, given, (q, k, v), keywords))

        # 3) back to the leading axes
        return out.reshape(*batch, L, D), None if weights is None else weights.reshape(*batch, L, S)


# --- the conversions, shared with the encoder layer's modules ------------------------------------------------

STACKED = ("w_q", "w_k", "w_v")  # in_proj_weight's rows 0..D-1, D..2D-1, 2D..3D-1; in_proj_bias likewise


def parameters(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """nn.MultiheadAttention's parameters from our entries under `prefix`: in_proj_* stacks w_q, w_k, w_v and
    out_proj is w_o; a state without biases (bias=False) gives none, as its bias=False has none."""
    found = {}
    for part in ("weight", "bias"):
        if f"{prefix}w_q.{part}" in state:  # checks.state: every projection has its bias, or none has
            stacked = [state[f"{prefix}{name}.{part}"] for name in STACKED]
            found[f"in_proj_{part}"] = torch.cat(stacked)  # 3 x (D, D) -> (3D, D); 3 x (D,) -> (3D,)
            found[f"out_proj.{part}"] = state[f"{prefix}w_o.{part}"]
    return found


def state_of(layer: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Our entries (under `prefix`, in state-dict order) from nn.MultiheadAttention's parameters."""
    parts = [part for part in ("weight", "bias") if f"in_proj_{part}" in layer]
    split = {part: layer[f"in_proj_{part}"].chunk(len(STACKED)) for part in parts}  # (3D, D) -> 3 x (D, D)
    state = {f"{prefix}{name}.{part}": split[part][index] for index, name in enumerate(STACKED) for part in parts}
    return state | {f"{prefix}w_o.{part}": layer[f"out_proj.{part}"] for part in parts}


def refuse_layout(cls_name: str, num_heads: int, num_kv_heads: int, rope_theta: float | None) -> None:
    """nn.MultiheadAttention has one key/value head per query head and no rotary embeddings."""
    if num_kv_heads != num_heads:
        raise ValueError(f"{cls_name}: nn.MultiheadAttention has no grouped key/value heads; got num_kv_heads="
                         f"{num_kv_heads} for num_heads={num_heads} (w_k.weight and w_v.weight of {num_kv_heads} "
                         "* d_k rows, not d_model)")
    if rope_theta is not None:
        raise ValueError(f"{cls_name}: nn.MultiheadAttention has no rotary embeddings; got rope_theta={rope_theta!r}")


def owned(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Copies of the state's arrays as ordinary torch tensors (made outside inference mode, so that autograd
    may use them), never the caller's."""
    with torch.inference_mode(False):
        return {name: asarray(x).detach().clone() for name, x in state.items()}


def dtypes(**arrays: torch.Tensor) -> dict[str, tuple[str, bool]]:
    """{argument name: (dtype name, is floating)}, for the dtype checks shared by the backends."""
    return {name: (str(x.dtype).removeprefix("torch."), x.is_floating_point()) for name, x in arrays.items()}


def checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, d_model: int,
            num_heads: int, parameters: torch.Tensor) -> tuple[int, ...]:
    """The backends' checks of a module's inputs and mask (SPEC 7); returns the leading axes (...)."""
    for name, x, letter in (("q", q, "L"), ("k", k, "S"), ("v", v, "S")):
        validation.module_input(name, x.shape, d_model, letter)
    validation.same_floating_dtype(dtypes(q=q, k=k, v=v, parameters=parameters))
    batch = validation.attention_batch(q.shape, k.shape, v.shape)
    checked_mask(mask, (*batch, num_heads, q.shape[-2], k.shape[-2]), "..., H, L, S")
    return batch


def checked_mask(mask: torch.Tensor | None, target: tuple[int, ...], letters: str) -> None:
    """A mask (or None) broadcasts to `target` without enlarging it; a floating one holds 0 and 1 only."""
    if mask is None:
        return
    validation.broadcasts_to("mask", mask.shape, target, letters)
    binary = bool(((mask == 0) | (mask == 1)).all()) if mask.is_floating_point() else None
    validation.binary_mask(mask.is_floating_point(), binary)


def folded(x: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """x (..., n, D) broadcast to the leading axes `batch` and folded into one batch axis: (B, n, D)."""
    return torch.broadcast_to(x, (*batch, *x.shape[-2:])).reshape(math.prod(batch), *x.shape[-2:])


def hides(mask: torch.Tensor, target: tuple[int, ...]) -> torch.Tensor:
    """Our mask (0 / False hides) as torch's boolean attn_mask: True where hidden, (..., H, L, S) -> (B * H, L, S)."""
    return torch.broadcast_to(mask == 0, target).reshape(math.prod(target[:-2]), *target[-2:])


CONFORMANCE = Declaration({
    "masked_rows": "with need_weights=True a query that sees no key in some head gets a NaN out row (and weights "
                   "row); need_weights=False (its scaled_dot_product_attention) gives the spec's w_o.bias",
    "non_finite": "a NaN key reaches the rows whose mask hides it too (the mask is added to the scores as -inf)",
    "weights": "averaged over the heads (its average_attn_weights=True default), (..., L, S), and in training "
               "mode taken after dropout",
    "num_kv_heads": "one key/value head per query head (its kdim, vdim are input widths, not heads)",
    "rope_theta": "no rotary position embeddings",
    "attention_linear": "softmax attention only: nn.MultiheadAttention has no other kind of head (no option of its "
                        "constructor chooses one)",
})
