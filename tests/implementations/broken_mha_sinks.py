"""A model author's view of MultiHeadAttention's learned sinks (sinks=True, SPEC 2h and section 3) and ALiBi
(position="alibi", SPEC 2i and section 3): attention_np's module, and variants of it with ONE realistic bug each, which
the suite's mha operation must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Each variant subclasses attention_np's MultiHeadAttention and overrides the one step it gets wrong (how the state's
sinks are loaded, which slopes ALiBi takes); its block is attention_np's TransformerBlock holding that attention
(broken_paged's `as_module`). Everything else, the argument checks of attention_np.common.validation included, is
attention_np's, so bad calls raise what the spec requires. Each variant's docstring says the bug and which check of the
suite's mha operation rejects it (the measure names of `conformance.check` rows). No variant raises on ordinary
inputs, and each is right without sinks or ALiBi: the mha operation's cases, which drew neither before, passed them.

`MHA_SINKS` is attention_np's module as the suite checks it; `BROKEN` maps a name to each variant's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_np import modules
from attention_np.primitives import alibi_slopes
from tests.implementations.broken_paged import as_module


class SinksReversed(modules.MultiHeadAttention):
    """from_state_dict loads the state's sinks (H,) in reversed head order, as a checkpoint converter that flips a
    head axis it takes for stored last-first: head h's softmax takes the sink of head H - 1 - h. Right with one head,
    with sinks alike in every head, or without sinks. Caught by: values."""

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], **options: Any) -> modules.MultiHeadAttention:
        if "sinks" in state:
            state = dict(state) | {"sinks": np.asarray(state["sinks"])[::-1].copy()}  # the bug: heads reversed
        return super().from_state_dict(state, **options)


class AlibiNextPowerOfTwo(modules.MultiHeadAttention):
    """ALiBi's slopes of the next power of two's heads, the first H of them: 2^(-8h/n) for n >= H the next power of
    two, where the rule for H not a power of two takes n's slopes below H and then the odd terms of 2n's sequence.
    Right for H a power of two, or without ALiBi. Caught by: values."""

    @property
    def alibi_slopes(self) -> np.ndarray | None:
        if self.position != "alibi":
            return None
        return alibi_slopes(1 << (self.num_heads - 1).bit_length())[:self.num_heads]  # the bug: n >= H


VARIANTS: dict[str, type[modules.MultiHeadAttention]] = {
    "sinks_reversed": SinksReversed,
    "alibi_next_power_of_two": AlibiNextPowerOfTwo,
}
MHA_SINKS = as_module(modules.MultiHeadAttention, __name__)
BROKEN = {name: as_module(cls, f"{__name__}.{name}") for name, cls in VARIANTS.items()}
