"""A linear-attention author's view of the update rules (SPEC 2e, ONNX's LinearAttention): attention_np's linear
attention, and variants of it with ONE realistic bug each in a rule, which the suite's linear operation (or, for the
module's causal flag, its mha operation) must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Each variant is a private copy of attention_np.linear (its code run afresh into a module object of its own, so
attention_np itself is never changed) with one function replaced by the same function with the bug, or attention_np's
MultiHeadAttention with one method replaced. Everything else, the argument checks of attention_np.common.validation
included, is attention_np's, so bad calls raise what the spec requires. Each bug's docstring says the bug and which
check of the suite rejects it (the measure names of `conformance.check` rows). No variant raises on ordinary inputs:
the bug is a wrong answer, and each one is right under the rule "linear", the only rule the suite drew before it drew
the update rules (and right on the bidirectional heads, the only ones the mha operation drew).

`VARIANTS` maps a name to each bug; `BROKEN` to each variant's module; `RULES` is attention_np's, for contrast.
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import attention_np
from attention_np import asarray, modules, to_numpy

LINEAR_NAMES = ("linear_attention", "linear_attention_vjp", "linear_attention_state", "linear_attention_step")


def decay_after_the_update(S: np.ndarray, phi_q: np.ndarray, phi_k: np.ndarray, v: np.ndarray, g: np.ndarray | None,
                           beta: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """One position of the recurrence with the decay applied after the update, S' = exp(g) (S + phi(k) u^T), where
    ONNX decays the state before it takes the key: the current key is decayed once too often (and the delta rule's
    error read off the undecayed state). Right without decay. Caught by: steps, values."""
    if beta is not None:
        v = beta * (v - (phi_k[..., None, :] @ S)[..., 0, :])  # (..., Ev)
    S = S + phi_k[..., :, None] * v[..., None, :]  # (..., E, Ev)
    if g is not None:
        S = np.exp(g)[..., :, None] * S  # the bug: after the update
    return (phi_q[..., None, :] @ S)[..., 0, :], S


def beta_on_the_key(S: np.ndarray, phi_q: np.ndarray, phi_k: np.ndarray, v: np.ndarray, g: np.ndarray | None,
                    beta: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """One position of the recurrence with the delta rule's beta on the key that reads the state, u = v - S^T (beta
    phi(k)), where ONNX scales the error term, u = beta (v - S^T phi(k)): the value is written whole, only the
    recall shrunk. Right without beta. Caught by: steps, values."""
    if g is not None:
        S = np.exp(g)[..., :, None] * S
    if beta is not None:
        v = v - ((beta * phi_k)[..., None, :] @ S)[..., 0, :]  # the bug: beta on the key, not on the error
    S = S + phi_k[..., :, None] * v[..., None, :]
    return (phi_q[..., None, :] @ S)[..., 0, :], S


def _chunk(S: np.ndarray, phi_q: np.ndarray, phi_k: np.ndarray, v: np.ndarray, b: np.ndarray,
           beta: np.ndarray | None, *, solve: bool, decay_state: bool) -> tuple[np.ndarray, np.ndarray]:
    """attention_np.linear._rule_chunk's chunk (out = (phi(Q) exp(b)) S_0 + W U, S_C = exp(b_C) S_0 + (phi(K)
    exp(b_C - b))^T U), with its triangular solve (solve) and the decay of the state it hands on (decay_state)."""
    C = phi_k.shape[-2]
    gap = b[..., :, None, :] - b[..., None, :, :]  # b_i - b_j: (..., C, C, 1 or E)
    below = np.tril(np.ones((C, C), bool))[..., None]  # j <= i: (C, C, 1)
    decays = np.exp(np.where(below, gap, -np.inf))  # exp(b_i - b_j) where j <= i, else 0
    W = np.sum(phi_q[..., :, None, :] * phi_k[..., None, :, :] * decays, axis=-1)  # (..., C, C)
    U = v  # (..., C, Ev)
    if beta is not None:
        rhs = beta * (v - (phi_k * np.exp(b)) @ S)  # (..., C, Ev)
        U = rhs
        if solve:
            M = np.tril(np.sum(phi_k[..., :, None, :] * phi_k[..., None, :, :] * decays, axis=-1), -1)  # (..., C, C)
            U = np.linalg.solve(np.broadcast_to(np.eye(C) + beta * M, (*rhs.shape[:-1], C)), rhs)
    out = (phi_q * np.exp(b)) @ S + W @ U  # (..., C, Ev)
    last = b[..., -1:, :]  # b_C: (..., 1, 1 or E)
    handed = np.exp(np.swapaxes(last, -1, -2)) * S if decay_state else S
    return out, handed + np.swapaxes(phi_k * np.exp(last - b), -1, -2) @ U  # (..., E, Ev)


def chunks_without_the_ut_transform(S: np.ndarray, phi_q: np.ndarray, phi_k: np.ndarray, v: np.ndarray,
                                    b: np.ndarray, beta: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The delta rules chunk by chunk with each pseudo-value u_i = beta_i (v_i - P^T phi(k_i)) read off the chunk's
    start state alone: the unit lower triangular system (I + diag(beta) M) U = rhs left unsolved, U = rhs, so a key
    never sees the keys before it in its own chunk. Right in chunks of one, and for the gated rule. Caught by:
    values."""
    return _chunk(S, phi_q, phi_k, v, b, beta, solve=False, decay_state=True)


def chunk_state_not_decayed(S: np.ndarray, phi_q: np.ndarray, phi_k: np.ndarray, v: np.ndarray, b: np.ndarray,
                            beta: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The gated rules chunk by chunk with the state handed to the next chunk undecayed, S_C = S_0 + (phi(K)
    exp(b_C - b))^T U where the chunk's decays exp(b_C) scale S_0: the earlier chunks' keys keep their weight
    across every boundary. Right in one chunk, and without decay. Caught by: values."""
    return _chunk(S, phi_q, phi_k, v, b, beta, solve=True, decay_state=False)


class CausalFlagIgnored(modules.MultiHeadAttention):
    """MultiHeadAttention(attention="linear") that drops the call's is_causal: each linear head computes the
    bidirectional form, query i reading every key of the sequence. Right without is_causal. Caught by: values."""

    def _linear_heads(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, is_causal: bool) -> np.ndarray:
        return super()._linear_heads(q, k, v, False)  # the bug: the flag ignored


class Variant(NamedTuple):
    """One bug: the function or class with it, what of attention_np's it replaces, and the operation that checks it."""

    bug: Callable  # its docstring says the bug and "Caught by:" the checks
    replaces: str  # a function of attention_np.linear, or "MultiHeadAttention"
    operation: str  # the suite's operation whose checks reject it


VARIANTS: dict[str, Variant] = {
    "decay_after_the_update": Variant(decay_after_the_update, replaces="_rule_step", operation="linear"),
    "beta_on_the_key": Variant(beta_on_the_key, replaces="_rule_step", operation="linear"),
    "chunks_without_the_ut_transform": Variant(chunks_without_the_ut_transform, replaces="_rule_chunk",
                                               operation="linear"),
    "chunk_state_not_decayed": Variant(chunk_state_not_decayed, replaces="_rule_chunk", operation="linear"),
    "causal_flag_ignored": Variant(CausalFlagIgnored, replaces="MultiHeadAttention", operation="mha"),
}


def _linear_copy(replaces: str, bug: Callable) -> types.ModuleType:
    """attention_np.linear's code run afresh into a module object of its own, `replaces` bound to `bug` there (its
    functions read each other by name from their module, so the copy's use the bug)."""
    spec = importlib.util.find_spec("attention_np.linear")
    copy = importlib.util.module_from_spec(spec)  # not in sys.modules: attention_np.linear stays as it is
    spec.loader.exec_module(copy)
    setattr(copy, replaces, bug)
    return copy


def as_module(name: str, variant: Variant | None = None) -> types.ModuleType:
    """A module object with attention_np's array conversions and either the linear attention of the contract (a copy
    of attention_np.linear with the variant's bug) or MultiHeadAttention (the variant's class); None: attention_np's
    own linear attention and MultiHeadAttention."""
    module = types.ModuleType(name, "linear attention's update rules" + (f" with {variant.bug.__name__}"
                                                                           if variant else ""))
    module.asarray, module.to_numpy = asarray, to_numpy
    if variant is None:
        module.MultiHeadAttention = attention_np.MultiHeadAttention
        for function in LINEAR_NAMES:
            setattr(module, function, getattr(attention_np, function))
    elif variant.replaces == "MultiHeadAttention":
        module.MultiHeadAttention = variant.bug
    else:
        copy = _linear_copy(variant.replaces, variant.bug)
        for function in LINEAR_NAMES:
            setattr(module, function, getattr(copy, function))
    return module


RULES = as_module(__name__)
BROKEN = {name: as_module(f"{__name__}.{name}", variant) for name, variant in VARIANTS.items()}
