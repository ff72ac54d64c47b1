"""A packed-attention author's view: varlen attention (SPEC 2g) as a loop over the packed sequences, each one's
scaled dot-product attention on its own, and variants of it with ONE realistic bug each, which the suite's varlen
operation must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.
Packed inputs: Tq and Tk query and key positions (every sequence's, end to end), Hkv key/value heads, N sequences.

Written apart from attention_np.varlen and from the catalogue's mods.varlen mask it is built on: the boundaries are
read into one slice of queries and one of keys per sequence, each sequence calls attention_np's
scaled_dot_product_attention (and its vjp) on (H, L_n, E) with q_offset = S_n - L_n (bottom-right), and the rows
are written back into the packed layout, zeros past the last boundary. It shares the argument checks of
attention_np.common.validation, so that bad calls raise what the spec requires, and attention_np's array
conversions. block_size is checked and changes nothing (one path). Each variant's docstring says the bug and which
check of the suite's varlen operation rejects it (the measure names of `conformance.check` rows). No variant raises
on ordinary inputs: the bug is a wrong answer.

`VARLEN` is the correct implementation as a module the suite can check; `BROKEN` maps a name to each variant's.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import numpy as np

from attention_np import asarray, scaled_dot_product_attention, scaled_dot_product_attention_vjp, to_numpy
from attention_np.common import validation

Sequence = tuple[slice, slice]  # (its queries along Tq, its keys along Tk)


class Varlen:
    """out[queries of n] = sdpa(q_n, k_n, v_n, q_offset = S_n - L_n) for each sequence n; each step a method, so
    that a variant overrides exactly the step it gets wrong."""

    def sequences(self, cu_q: list[int], cu_k: list[int], Tk: int) -> list[Sequence]:
        """Each sequence's queries cu_q[n] <= i < cu_q[n + 1] and keys cu_k[n] <= j < cu_k[n + 1]."""
        return [(slice(cu_q[n], cu_q[n + 1]), self.keys(cu_k, n, Tk)) for n in range(len(cu_q) - 1)]

    def keys(self, cu_k: list[int], n: int, Tk: int) -> slice:
        """Sequence n's keys."""
        return slice(cu_k[n], cu_k[n + 1])

    def q_offset(self, L: int, S: int) -> int:
        """The position of a sequence's first query among its keys: bottom-right, its last query at its last key."""
        return S - L

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, sequences: list[Sequence],
                options: dict) -> np.ndarray:
        """out (Tq, H, Ev), zeros for the queries of no sequence."""
        out = np.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)  # (Tq, H, Ev)
        for rows, keys in sequences:
            q_n, k_n, v_n = (np.swapaxes(x, 0, 1) for x in (q[rows], k[keys], v[keys]))  # (heads, L_n or S_n, *)
            out_n, _ = scaled_dot_product_attention(q_n, k_n, v_n, need_weights=False, **options,
                                                    q_offset=self.q_offset(q_n.shape[-2], k_n.shape[-2]))
            out[rows] = np.swapaxes(out_n, 0, 1)  # (H, L_n, Ev) -> (L_n, H, Ev)
        return out

    def backward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, sequences: list[Sequence], options: dict,
                 d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """dq (Tq, H, E), dk (Tk, Hkv, E), dv (Tk, Hkv, Ev): each sequence's sdpa vjp, added into its rows."""
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        for rows, keys in sequences:
            q_n, k_n, v_n, d_n = (np.swapaxes(x, 0, 1) for x in (q[rows], k[keys], v[keys], d_out[rows]))
            _, _, pullback = scaled_dot_product_attention_vjp(q_n, k_n, v_n, **options,
                                                              q_offset=self.q_offset(q_n.shape[-2], k_n.shape[-2]))
            dq_n, dk_n, dv_n = pullback(d_n)[:3]
            dq[rows] += np.swapaxes(dq_n, 0, 1)
            dk[keys] += np.swapaxes(dk_n, 0, 1)
            dv[keys] += np.swapaxes(dv_n, 0, 1)
        return dq, dk, dv


def as_module(impl: Varlen, name: str) -> types.ModuleType:
    """A module object with the contract's names for packed attention: varlen_attention and its vjp, and
    attention_np's array conversions."""
    module = types.ModuleType(name, f"varlen_attention from {type(impl).__name__}.")
    module.asarray, module.to_numpy = asarray, to_numpy

    def prepared(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray,
                 max_seqlen_q: int, max_seqlen_k: int, enable_gqa: bool, block_size: int | None) -> list[Sequence]:
        """The inputs checked as SPEC 7 says, and the sequences."""
        bounds = {"cu_seqlens_q": np.asarray(cu_seqlens_q), "cu_seqlens_k": np.asarray(cu_seqlens_k)}
        validation.varlen_inputs(q.shape, k.shape, v.shape, {name: b.shape for name, b in bounds.items()},
                                 enable_gqa, block_size)
        validation.varlen_bounds("cu_seqlens_q", bounds["cu_seqlens_q"], q.shape[0], max_seqlen_q)
        validation.varlen_bounds("cu_seqlens_k", bounds["cu_seqlens_k"], k.shape[0], max_seqlen_k)
        return impl.sequences(bounds["cu_seqlens_q"].tolist(), bounds["cu_seqlens_k"].tolist(), k.shape[0])

    def varlen_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens_q: np.ndarray,
                         cu_seqlens_k: np.ndarray, *, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool = False,
                         window: tuple[int | None, int | None] | None = None, softcap: float | None = None,
                         scale: float | None = None, enable_gqa: bool = False,
                         block_size: int | None = None) -> np.ndarray:
        sequences = prepared(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, enable_gqa, block_size)
        options = dict(is_causal=is_causal, window=window, softcap=softcap, scale=scale, enable_gqa=enable_gqa)
        return impl.forward(q, k, v, sequences, options)

    def varlen_attention_vjp(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens_q: np.ndarray,
                             cu_seqlens_k: np.ndarray, *, max_seqlen_q: int, max_seqlen_k: int,
                             is_causal: bool = False, window: tuple[int | None, int | None] | None = None,
                             softcap: float | None = None, scale: float | None = None, enable_gqa: bool = False,
                             block_size: int | None = None) -> tuple[np.ndarray, Callable]:
        sequences = prepared(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, enable_gqa, block_size)
        options = dict(is_causal=is_causal, window=window, softcap=softcap, scale=scale, enable_gqa=enable_gqa)
        out = impl.forward(q, k, v, sequences, options)

        def pullback(d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            validation.cotangent("d_out", d_out.shape, out.shape, {name: (str(x.dtype), True) for name, x in
                                                                   (("d_out", d_out), ("out", out))})
            return impl.backward(q, k, v, sequences, options, d_out)

        return out, pullback

    module.varlen_attention, module.varlen_attention_vjp = varlen_attention, varlen_attention_vjp
    return module


class LastSequenceDropped(Varlen):
    """The loop over the sequences stops one short (range(N - 1), the boundaries' count taken for N): the last
    sequence's queries get zeros, as if they were past the last boundary. Caught by: values."""

    def sequences(self, cu_q: list[int], cu_k: list[int], Tk: int) -> list[Sequence]:
        return super().sequences(cu_q, cu_k, Tk)[:-1]  # the bug: the last sequence left out


class CausalTopLeft(Varlen):
    """Each sequence's causal mask and window are aligned top-left (q_offset 0, sdpa's default) where the spec says
    bottom-right (S_n - L_n): a sequence with fewer queries than keys hides its last keys from every query. Right
    wherever L_n = S_n. Caught by: values."""

    def q_offset(self, L: int, S: int) -> int:
        return 0  # the bug: top-left


class KeysOneTooFar(Varlen):
    """The key boundaries read as lengths off by one at the end (slice(cu_k[n], cu_k[n + 1] + 1)): each sequence's
    queries also see the first key of the next sequence (or one past the last boundary). Caught by: values."""

    def keys(self, cu_k: list[int], n: int, Tk: int) -> slice:
        return slice(cu_k[n], min(cu_k[n + 1] + 1, Tk))  # the bug: one key too many


VARIANTS: dict[str, type[Varlen]] = {
    "last_sequence_dropped": LastSequenceDropped,
    "causal_top_left": CausalTopLeft,
    "keys_one_too_far": KeysOneTooFar,
}
VARLEN = as_module(Varlen(), __name__)
BROKEN = {name: as_module(cls(), f"{__name__}.{name}") for name, cls in VARIANTS.items()}
