"""A linear-attention author's view: kernelised linear attention in NumPy (the forward pass in its three forms, the
recurrent step and a hand-derived backward pass), and variants of it with ONE realistic bug each, which the
suite's linear operation must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Written apart from attention_np.linear and from the oracle (it shares only the argument checks of
attention_np.common.validation, so that bad calls raise what the spec requires, and the array conversions of
attention_np): non-causal attention from the sums A = phi(K)^T V and z = phi(K)^T 1; causal attention from
cumulative sums indexed by each query's last key (chunk None), or chunk by chunk, a masked kernel inside the chunk
and the state of the earlier chunks carried across; the step from a running state; and a backward pass through
the quadratic form, W = (phi(Q) phi(K)^T) * visible, whatever form the forward pass took. Each variant's docstring
says the bug and which check of the suite's linear operation rejects it (the measure names of
`conformance.check` rows). No variant raises on ordinary inputs: the bug is a wrong answer.

`LINEAR` is the correct implementation as a module the suite can check; `BROKEN` maps a name to each variant's.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import numpy as np

from attention_np import asarray, to_numpy
from attention_np.common import validation

State = tuple[np.ndarray, np.ndarray]


class Linear:
    """out_i = phi(q_i)^T A_i / (phi(q_i) . z_i + eps) over the keys query i sees; each step a method, so that a
    variant overrides exactly the step it gets wrong."""

    # --- the forward pass --------------------------------------------------------------------------------

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict) -> tuple[np.ndarray, ...]:
        """num (..., L, Ev) and den (..., L, 1), eps not yet added, in the working dtype."""
        fq, fk, v, _ = self.prepare(q, k, v, options)
        if not options["is_causal"]:
            A, z = np.swapaxes(fk, -1, -2) @ v, np.sum(fk, axis=-2)  # (..., E, Ev), (..., E)
            return fq @ A, np.sum(fq * z[..., None, :], axis=-1, keepdims=True)
        if options["chunk"] is None:
            return self.prefix(fq, fk, v)
        return self.chunked(fq, fk, v, options["chunk"])

    def prepare(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict) -> tuple[np.ndarray, ...]:
        """phi(Q), phi(K) and V broadcast to one batch shape in at least float32, the hidden keys' rows of phi(K)
        and V zeroed, and the keys each query sees (..., L, S)."""
        batch = validation.attention_batch(q.shape, k.shape, v.shape)
        validation.same_floating_dtype({name: (str(x.dtype), np.issubdtype(x.dtype, np.floating))
                                    for name, x in (("q", q), ("k", k), ("v", v))})
        validation.linear_options(options["feature_map"], options["eps"], options["chunk"])
        L, S = q.shape[-2], k.shape[-2]
        if options["is_causal"]:
            validation.linear_causal(L, S)
        work = self.work_dtype(q.dtype)
        q, k, v = (np.broadcast_to(x, (*batch, *x.shape[-2:])).astype(work) for x in (q, k, v))
        seen = np.ones((*batch, L, S), bool)
        if options["is_causal"]:
            seen = seen & np.tri(L, S, dtype=bool)
        fk = self.features(k, options["feature_map"])
        if options["key_lengths"] is not None:
            lengths = np.asarray(options["key_lengths"])
            validation.positions("key_lengths", lengths.shape, str(lengths.dtype),
                             np.issubdtype(lengths.dtype, np.integer), batch)
            keep = np.arange(S) < lengths[..., None]  # (..., S)
            fk, v = np.where(keep[..., None], fk, 0.0), np.where(keep[..., None], v, 0.0)
            seen = seen & keep[..., None, :]
        return self.features(q, options["feature_map"]), fk, v, seen

    def work_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype the features and sums are computed in: float32 for float16 and bfloat16 (SPEC 2e)."""
        return np.promote_types(dtype, np.float32)

    def features(self, x: np.ndarray, feature_map: str) -> np.ndarray:
        """phi(x): elu(x) + 1 (x + 1 above 0, e^x at or below), max(x, 0), or x."""
        if feature_map == "elu":
            return np.where(x > 0, x + 1, np.exp(np.where(x > 0, 0, x)))  # e^x of the branch taken alone
        if feature_map == "relu":
            return np.maximum(x, 0)
        return x

    def prefix(self, fq: np.ndarray, fk: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Causal, all at once: cumulative sums over the keys, row i read at query i's last key."""
        L = fq.shape[-2]
        A = np.cumsum(fk[..., :, :, None] * v[..., :, None, :], axis=-3)  # (..., L, E, Ev): A after key j
        z = np.cumsum(fk, axis=-2)  # (..., L, E)
        last = [min(self.last_key(i), L - 1) for i in range(L)]
        A, z = A[..., last, :, :], z[..., last, :]
        num = np.einsum("...le,...lef->...lf", fq, A)  # (..., L, Ev)
        return num, np.sum(fq * z, axis=-1, keepdims=True)

    def last_key(self, i: int) -> int:
        """The last key query i sees."""
        return i

    def chunked(self, fq: np.ndarray, fk: np.ndarray, v: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """Causal, chunk by chunk: the masked kernel inside the chunk, plus the state of the earlier chunks."""
        L, E, Ev = fq.shape[-2], fq.shape[-1], v.shape[-1]
        num, den = np.zeros((*fq.shape[:-1], Ev), fq.dtype), np.zeros((*fq.shape[:-1], 1), fq.dtype)
        A, z = np.zeros((*fq.shape[:-2], E, Ev), fq.dtype), np.zeros((*fq.shape[:-2], E), fq.dtype)
        for start in range(0, L, chunk):
            rows = slice(start, min(start + chunk, L))
            Qc, Kc, Vc = fq[..., rows, :], fk[..., rows, :], v[..., rows, :]
            W = np.tril(Qc @ np.swapaxes(Kc, -1, -2))  # (..., C, C): keys j <= i of the chunk
            A_read, z_read = self.carried(A, z, Kc, Vc)
            num[..., rows, :] = W @ Vc + Qc @ A_read
            den[..., rows, :] = np.sum(W, axis=-1, keepdims=True) + Qc @ z_read[..., None]
            A, z = A + np.swapaxes(Kc, -1, -2) @ Vc, z + np.sum(Kc, axis=-2)
        return num, den

    def carried(self, A: np.ndarray, z: np.ndarray, Kc: np.ndarray, Vc: np.ndarray) -> State:
        """The state a chunk's queries read besides their masked kernel: the earlier chunks' sums."""
        return A, z

    def normalise(self, num: np.ndarray, den: np.ndarray, eps: float) -> np.ndarray:
        """out = num / (den + eps)."""
        return num / (den + eps)

    # --- the recurrent form --------------------------------------------------------------------------------

    def step(self, q_t: np.ndarray, k_t: np.ndarray, v_t: np.ndarray, state: State, feature_map: str,
             eps: float) -> tuple[np.ndarray, State]:
        """The state takes the current position, then the query reads it (j <= t)."""
        S, _ = state
        fq, fk = self.features(q_t.astype(S.dtype), feature_map), self.features(k_t.astype(S.dtype), feature_map)
        after = self.updated(state, fk, v_t.astype(S.dtype))
        S_read, z_read = self.read(state, after)
        num = np.einsum("...e,...ef->...f", fq, S_read)  # (..., Ev)
        return self.normalise(num, np.sum(fq * z_read, axis=-1, keepdims=True), eps), after

    def updated(self, state: State, fk: np.ndarray, v_t: np.ndarray) -> State:
        """S' = S + phi(k_t) v_t^T, z' = z + phi(k_t): a new state, the one given left as it was."""
        S, z = state
        return S + fk[..., :, None] * v_t[..., None, :], z + fk  # (..., E, Ev), (..., E)

    def read(self, before: State, after: State) -> State:
        """The state the query at position t reads: the one that holds key t."""
        return after

    # --- the backward pass ---------------------------------------------------------------------------------

    def backward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict,
                 d_out: np.ndarray) -> tuple[np.ndarray, ...]:
        """Through the quadratic form: W = (phi(Q) phi(K)^T) * visible, out = W V / (W 1 + eps), so
        d_num = d_out / den, d_den = -sum(d_out * out) / den, dW = (d_num V^T + d_den 1^T) * visible,
        dV = W^T d_num, d phi(Q) = dW phi(K), d phi(K) = dW^T phi(Q), then phi'."""
        fq, fk, v_, seen = self.prepare(q, k, v, options)
        seen = self.backward_visible(seen, options)
        W = (fq @ np.swapaxes(fk, -1, -2)) * seen  # (..., L, S)
        den = np.sum(W, axis=-1, keepdims=True) + options["eps"]  # (..., L, 1)
        out = (W @ v_) / den  # (..., L, Ev)
        d_num = d_out / den
        d_den = -np.sum(d_num * out, axis=-1, keepdims=True)  # (..., L, 1)
        dW = (d_num @ np.swapaxes(v_, -1, -2) + d_den) * seen  # (..., L, S)
        dv = np.swapaxes(W, -1, -2) @ d_num  # (..., S, Ev)
        work = fq.dtype
        qb, kb = (np.broadcast_to(x, (*seen.shape[:-2], *x.shape[-2:])).astype(work) for x in (q, k))
        dq = (dW @ fk) * self.derivative(qb, options["feature_map"])
        dk = (np.swapaxes(dW, -1, -2) @ fq) * self.derivative(kb, options["feature_map"])
        return dq, dk, dv

    def backward_visible(self, seen: np.ndarray, options: dict) -> np.ndarray:
        """The keys each query sees, as the forward pass had them (causal and key lengths)."""
        return seen

    def derivative(self, x: np.ndarray, feature_map: str) -> np.ndarray:
        """phi'(x): 1 above 0 and e^x at or below (elu + 1), 1 above 0 and 0 at or below (relu), 1 (identity)."""
        if feature_map == "elu":
            return np.where(x > 0, 1.0, np.exp(np.where(x > 0, 0, x)))
        if feature_map == "relu":
            return np.where(x > 0, 1.0, 0.0)
        return np.ones_like(x)


def as_module(impl: Linear, name: str) -> types.ModuleType:
    """A module object with the contract's names for linear attention: linear_attention and its vjp, the
    recurrent form's state and step, and attention_np's array conversions."""
    module = types.ModuleType(name, f"linear_attention from {type(impl).__name__}.")
    module.asarray, module.to_numpy = asarray, to_numpy

    def linear_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, feature_map: str = "elu",
                         is_causal: bool = False, key_lengths: np.ndarray | None = None, eps: float = 1e-6,
                         chunk: int | None = None) -> np.ndarray:
        options = dict(feature_map=feature_map, is_causal=is_causal, key_lengths=key_lengths, eps=eps, chunk=chunk)
        num, den = impl.forward(q, k, v, options)
        return impl.normalise(num, den, float(eps)).astype(q.dtype)

    def linear_attention_vjp(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, feature_map: str = "elu",
                             is_causal: bool = False, key_lengths: np.ndarray | None = None, eps: float = 1e-6,
                             chunk: int | None = None) -> tuple[np.ndarray, Callable]:
        options = dict(feature_map=feature_map, is_causal=is_causal, key_lengths=key_lengths, eps=float(eps),
                       chunk=chunk)
        out = linear_attention(q, k, v, **options)

        def pullback(d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            validation.cotangent("d_out", d_out.shape, out.shape, {name: (str(x.dtype), True) for name, x in
                                                              (("d_out", d_out), ("out", out))})
            grads = impl.backward(q, k, v, options, d_out)
            return tuple(_summed_to(d, x.shape).astype(x.dtype) for d, x in zip(grads, (q, k, v), strict=True))

        return out, pullback

    def linear_attention_state(batch_shape: tuple[int, ...], E: int, Ev: int, *,
                               dtype: np.dtype | None = None) -> State:
        batch = validation.linear_state_size(batch_shape, E, Ev)
        dtype = np.dtype(np.float32 if dtype is None else dtype)
        return np.zeros((*batch, E, Ev), dtype), np.zeros((*batch, E), dtype)

    def linear_attention_step(q_t: np.ndarray, k_t: np.ndarray, v_t: np.ndarray, state: State, *,
                              feature_map: str = "elu", eps: float = 1e-6) -> tuple[np.ndarray, State]:
        validation.linear_state_pair(state)
        validation.linear_step(q_t.shape, k_t.shape, v_t.shape, state[0].shape, state[1].shape)
        validation.linear_options(feature_map, eps)
        out_t, after = impl.step(q_t, k_t, v_t, tuple(state), feature_map, float(eps))
        return out_t.astype(q_t.dtype), after

    module.linear_attention, module.linear_attention_vjp = linear_attention, linear_attention_vjp
    module.linear_attention_state, module.linear_attention_step = linear_attention_state, linear_attention_step
    return module


def _summed_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A gradient of the batch-shaped input, summed over the axes the input of `shape` was broadcast along."""
    extra = x.ndim - len(shape)
    x = np.sum(x, axis=tuple(range(extra))) if extra > 0 else x
    stretched = tuple(axis for axis, n in enumerate(shape) if n == 1 and x.shape[axis] != 1)
    return np.sum(x, axis=stretched, keepdims=True)


# --- the forward pass ------------------------------------------------------------------------------------


class PrefixIncludesTheNextPosition(Linear):
    """The causal prefix sums read one row too far (an off-by-one in the index of query i's last key): query i
    also sees key i + 1. Right for the last query and with chunks. Caught by: values (causal, no chunk)."""

    def last_key(self, i: int) -> int:
        return i + 1  # the bug: key i + 1 counted too


class NormaliserForgotten(Linear):
    """out = phi(q_i)^T A_i alone, the division by phi(q_i) . z_i + eps left out (the numerator of the paper's
    equation, read as the whole). Caught by: values; steps."""

    def normalise(self, num: np.ndarray, den: np.ndarray, eps: float) -> np.ndarray:
        return num  # the bug: no normaliser


class ChunkStateIncludesTheChunk(Linear):
    """The carried state is updated with the current chunk before its queries read it, so every key of the chunk
    is counted twice for the queries that see it (the masked kernel and the state) and the later keys of the chunk
    reach the earlier queries. Caught by: values (causal, with a chunk)."""

    def carried(self, A: np.ndarray, z: np.ndarray, Kc: np.ndarray, Vc: np.ndarray) -> State:
        return A + np.swapaxes(Kc, -1, -2) @ Vc, z + np.sum(Kc, axis=-2)  # the bug: this chunk included


class EpsInTheNumerator(Linear):
    """eps added to the numerator as well as to the normaliser, (num + eps) / (den + eps), as if it were a
    smoothing term of the mean: off by eps / den, visible with eps 1 and in float64 with any eps. Caught by:
    values."""

    def normalise(self, num: np.ndarray, den: np.ndarray, eps: float) -> np.ndarray:
        return (num + eps) / (den + eps)  # the bug: eps in the numerator too


class SumsInHalfPrecision(Linear):
    """The features and the sums A = sum phi(k_j) v_j^T, z = sum phi(k_j) are computed in the inputs' float16,
    not in float32 as SPEC 2e asks: with q and k of ordinary size and a few keys every sum fits and loses a
    rounding or two, but with q and k in the tens and tens of keys phi(q_i) . z_i passes 65504 and overflows, and
    the sums of many terms lose their last digits. Caught by: values (float16, large q and k, a long S)."""

    def work_dtype(self, dtype: np.dtype) -> np.dtype:
        return np.dtype(dtype)  # the bug: float16 stays float16


# --- the recurrent form ----------------------------------------------------------------------------------


class StepReadsBeforeTheUpdate(Linear):
    """The step computes out_t from the state before adding position t (the current key left out: j < t, not
    j <= t), then updates it; out_0 is 0. The forward pass is right. Caught by: steps."""

    def read(self, before: State, after: State) -> State:
        return before  # the bug: the state without key t


class StepUpdatesTheStateInPlace(Linear):
    """The step adds position t into the arrays of the state it was given (`np.add(S, ..., out=S)`, torch's
    `S += ...`) and returns them as the new state: every out_t is right, but the caller's state has changed under
    it, so a state kept to rerun or branch from position t is lost. Caught by: state_kept."""

    def updated(self, state: State, fk: np.ndarray, v_t: np.ndarray) -> State:
        S, z = state
        np.add(S, fk[..., :, None] * v_t[..., None, :], out=S)  # the bug: written into the state given
        np.add(z, fk, out=z)
        return S, z


# --- the backward pass -----------------------------------------------------------------------------------


class BackwardWithoutPhiPrime(Linear):
    """The backward pass stops at d phi(Q) and d phi(K): phi' is taken as 1 (right for the identity map alone;
    elu + 1 has e^x below 0, relu 0). Caught by: gradients."""

    def derivative(self, x: np.ndarray, feature_map: str) -> np.ndarray:
        return np.ones_like(x)  # the bug: phi' forgotten


class BackwardIgnoresKeyLengths(Linear):
    """The backward pass masks the kernel's gradient with the causal rule alone, forgetting the key lengths the
    forward pass applied: a hidden key gets the gradient d phi(k_j) = dW^T phi(Q) of a key that was seen.
    Caught by: gradients; masked_rows."""

    def backward_visible(self, seen: np.ndarray, options: dict) -> np.ndarray:
        L, S = seen.shape[-2:]
        causal = np.tri(L, S, dtype=bool) if options["is_causal"] else np.ones((L, S), bool)
        return np.broadcast_to(causal, seen.shape)  # the bug: key_lengths left out


VARIANTS: dict[str, type[Linear]] = {
    "prefix_includes_the_next_position": PrefixIncludesTheNextPosition,
    "normaliser_forgotten": NormaliserForgotten,
    "chunk_state_includes_the_chunk": ChunkStateIncludesTheChunk,
    "eps_in_the_numerator": EpsInTheNumerator,
    "sums_in_half_precision": SumsInHalfPrecision,
    "step_reads_before_the_update": StepReadsBeforeTheUpdate,
    "step_updates_the_state_in_place": StepUpdatesTheStateInPlace,
    "backward_without_phi_prime": BackwardWithoutPhiPrime,
    "backward_ignores_key_lengths": BackwardIgnoresKeyLengths,
}
LINEAR = as_module(Linear(), __name__)
BROKEN = {name: as_module(cls(), f"{__name__}.{name}") for name, cls in VARIANTS.items()}
