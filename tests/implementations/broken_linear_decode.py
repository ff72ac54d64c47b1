"""A serving author's view: decoding with attention="linear" through its recurrent state (a LinearCache, SPEC 3a),
as attention_np's MultiHeadAttention and TransformerBlock do it, and variants of it with ONE realistic bug each,
which the suite's decode operation must reject.

Shape legend: B batch, H heads, L query positions, D = d_model, ... leading batch axes.
LinearCache: S (..., Hkv, d_k, d_k) = sum_j phi(k_j) v_j^T and z (..., Hkv, d_k) = sum_j phi(k_j) over the positions
held; length the positions held.

Each variant subclasses attention_np's MultiHeadAttention and overrides the one step it gets wrong (what the chunk
reads of the state it is given); its block is attention_np's TransformerBlock holding that attention
(broken_paged's `as_module`). Everything else, the argument checks of attention_np.common.validation included, is
attention_np's, so bad calls raise what the spec requires. Each variant's docstring says the bug and which check of
the suite's decode operation rejects it (the measure names of `conformance.check` rows). No variant raises on
ordinary inputs: the bug is a wrong answer, and each is right on a sequence decoded in one chunk (the state it
forgets is zeros there), so the decode operation, which never drew linear heads before, passed them.

`LINEAR` is attention_np's correct linear cache as a module the suite can check; `BROKEN` maps a name to each
variant's.
"""

from __future__ import annotations

import numpy as np

from attention_np import modules
from tests.implementations.broken_paged import as_module


class StateForgotten(modules.MultiHeadAttention):
    """Each chunk starts from zeros: extend reads neither S nor z of the positions before it (RoPE still turns at
    the sequence's positions, and the length advances), so each chunk attends to itself alone, a block of causal
    linear attention per chunk, and the state handed on holds the last chunk only. Caught by: values."""

    def _linear_extended(self, x_q: np.ndarray, x_kv: np.ndarray,
                         cache: modules.LinearCache) -> tuple[np.ndarray, None, modules.LinearCache]:
        return super()._linear_extended(x_q, x_kv, cache._replace(S=np.zeros_like(cache.S),  # the bug
                                                                  z=np.zeros_like(cache.z)))


class NormaliserNotCarried(modules.MultiHeadAttention):
    """The normaliser z is not carried from chunk to chunk: the numerator reads S of every earlier position, the
    denominator phi(q_i) . z sums the chunk's own keys alone (and the state handed on holds the chunk's z), so
    every query after the first chunk is divided by too little. Caught by: values."""

    def _linear_extended(self, x_q: np.ndarray, x_kv: np.ndarray,
                         cache: modules.LinearCache) -> tuple[np.ndarray, None, modules.LinearCache]:
        return super()._linear_extended(x_q, x_kv, cache._replace(z=np.zeros_like(cache.z)))  # the bug


VARIANTS: dict[str, type[modules.MultiHeadAttention]] = {
    "state_forgotten": StateForgotten,
    "normaliser_not_carried": NormaliserNotCarried,
}
LINEAR = as_module(modules.MultiHeadAttention, __name__)
BROKEN = {name: as_module(cls, f"{__name__}.{name}") for name, cls in VARIANTS.items()}
