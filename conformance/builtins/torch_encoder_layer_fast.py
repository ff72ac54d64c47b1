"""torch's nn.TransformerEncoderLayer on its fast path (torch._transformer_encoder_layer_fwd, one fused call) as
the contract's TransformerBlock.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The layer, its state and its inputs are converted as in torch_encoder_layer (batch_first=True; attn.* its
self_attn, norm1, norm2, ffn.0 its linear1, ffn.3 its linear2; the leading axes folded into B; our mask as its
boolean src_mask (B * H, L, L), True where a key is hidden). torch 2.13's forward takes the fast path when the
fast path is enabled (torch.backends.mha), the input is batched (3-d), the layer is in eval mode with
batch_first, in_proj biases, equal q, k, v widths, a ReLU or GELU activation and equal LayerNorm eps, H is even,
autocast is off, no hooks are attached, every tensor lies on a CPU or CUDA device, and autograd is off or no
tensor requires grad; it then merges the src_mask into (B, H, L, L) (its mask type 2). Every call here runs
the layer in eval mode under torch.no_grad() on a (B, L, D) batch, so the fast path runs for every layer this
module builds, but one with an odd num_heads, where torch itself takes the ordinary path ("num_head is odd").

The fast path is inference only: every call runs the layer in eval mode; in training mode (the contract's mode,
`training`) the module refuses a dropout above 0 and otherwise computes as in eval mode. It has no vjp (no
autograd through the fast path). It returns no weights.
"""

from __future__ import annotations

import torch

from conformance import adapters
from conformance.builtins import torch_encoder_layer
from conformance.contract.features import Declaration

TITLE = "nn.TransformerEncoderLayer (fast path)"  # the column of `python -m conformance frameworks`

asarray, to_numpy = adapters.arrays("torch")


class TransformerBlock(torch_encoder_layer.EncoderLayer):
    """The layer on its fast path: always in eval mode, `training` the contract's mode alone."""

    training = True  # modules start in training mode, as torch.nn.Modules do

    def train(self, mode: bool = True) -> TransformerBlock:
        self.layer.eval()  # the fast path's first condition
        self.training = mode
        return self

    def _forward(self, x: torch.Tensor, hidden: torch.Tensor | None,
                 given: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """torch._transformer_encoder_layer_fwd, through the layer's forward: eval mode, autograd off."""
        if self.training and self.layer.dropout.p > 0:
            raise ValueError(f"{type(self).__name__}: the fast path has no dropout; got dropout {self.layer.dropout.p} "
                             "in training mode: call .eval() first, or build the module with dropout 0")
        self.layer.eval()
        with torch.no_grad():
            return self.layer(x, src_mask=hidden)  # (B, L, D)


CONFORMANCE = torch_encoder_layer.CONFORMANCE | Declaration({
    "dropout": "the fast path runs in eval mode only (training mode takes the ordinary path, torch_encoder_layer)",
    "masked_rows": "a query that sees no key (in some head) gets a NaN out row; the ordinary path gives the spec's",
})
