"""A ring's view: ring attention over P simulated devices in NumPy, forward and backward, and variants of it with
ONE realistic bug each, which the suite's ring operation must reject.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The ring is written apart from attention_np.distributed and from the oracle: its own layout (contiguous shards,
or with is_causal the zig-zag layout, device d holding chunks d and 2P - 1 - d of 2P), its own merge, and a dense
backward pass per chunk pair. Inside each step it calls attention_np.flash_attention for the partial attention (the
tiled kernel is not what this checks), and it shares the argument checks of attention_np.common.validation, so that
bad calls raise what the spec requires. Each variant's docstring says the bug and which check of the suite's ring
operation rejects it (the measure names of `conformance.check` rows). No variant raises on ordinary inputs: the
bug is a wrong answer.

`RING` is the correct ring as a module the suite can check; `BROKEN` maps a name to each variant's module.
"""

from __future__ import annotations

import types

import numpy as np

import attention_np
from attention_np.common import validation

Chunk = tuple[int, int]  # (start, stop) rows of the whole sequence


class Ring:
    """Ring attention simulated device by device; each step of the schedule a method, so that a variant overrides
    exactly the step it gets wrong."""

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, devices: int,
                options: dict) -> tuple[np.ndarray, np.ndarray]:
        """out (..., L, Ev) in q's dtype and lse (..., L), flash_attention's on the whole sequence."""
        layout = self.layout(devices, q.shape[-2], k.shape[-2], options["is_causal"])
        parts = []  # per device, per query chunk: (out, lse) merged over the blocks it has seen
        for d in range(devices):
            seen = [None] * len(layout["q"][d])
            for t in self.steps(devices):
                for a, rows in enumerate(layout["q"][d]):
                    for cols in layout["k"][(d - t) % devices]:  # the block of device d - t visits
                        part = attention_np.flash_attention(
                            q[..., slice(*rows), :], k[..., slice(*cols), :], v[..., slice(*cols), :],
                            **options | {"q_offset": self.offset(options["q_offset"], rows, cols)})
                        part = (part[0].astype(part[1].dtype), part[1])  # merged in lse's (the working) dtype
                        seen[a] = part if seen[a] is None else self.merge(seen[a], part)
            parts.append(seen)
        out, lse = self.assemble(parts, layout["q"], q.shape[-2])
        return out.astype(q.dtype), lse

    def backward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, devices: int, options: dict, out: np.ndarray,
                 lse: np.ndarray, d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """dq, dk, dv (k and v per query head with enable_gqa): the ring again, each chunk pair's share from the
        global out and lse; dq stays on its device, the dk, dv accumulators travel with their block."""
        layout = self.layout(devices, q.shape[-2], k.shape[-2], options["is_causal"])
        dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
        sums = [(np.zeros(k.shape), np.zeros(v.shape)) for _ in range(devices)]  # per block: its dk, dv so far
        D = np.sum(d_out * out, axis=-1, keepdims=True)  # rowsum(dO * O), (..., L, 1)
        for d in range(devices):
            for t in range(devices):
                block = (d - t) % devices
                for rows in layout["q"][d]:
                    for cols in layout["k"][block]:
                        r, c = slice(*rows), slice(*cols)
                        g = self.pair_gradients(q[..., r, :], k[..., c, :], v[..., c, :], lse[..., r], d_out[..., r, :],
                                                D[..., r, :], options, rows, cols)
                        dq[..., r, :] += g[0]
                        sums[block][0][..., c, :] += g[1]
                        sums[block][1][..., c, :] += g[2]
        for d in range(devices):  # each device's own block's gradients: the accumulators it holds at the end
            held = sums[self.home(devices, d)]
            for cols in layout["k"][d]:
                dk[..., slice(*cols), :], dv[..., slice(*cols), :] = (x[..., slice(*cols), :] for x in held)
        return dq, dk, dv

    def pair_gradients(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, lse: np.ndarray, d_out: np.ndarray,
                       D: np.ndarray, options: dict, rows: Chunk, cols: Chunk) -> tuple[np.ndarray, ...]:
        """One query chunk against one key chunk: P = exp(S - lse) from the global lse, dV = P^T dO,
        dP = dO V^T, dS = P (dP - D), dQ = dS K scale, dK = dS^T Q scale (through the softcap's tanh)."""
        scale = validation.default_scale(options["scale"], q.shape, k.shape)
        raw = q @ np.swapaxes(k, -1, -2) * scale  # (..., Lc, Sc)
        capped = raw if options["softcap"] is None else options["softcap"] * np.tanh(raw / options["softcap"])
        visible = self.visible(options, rows, cols)  # (Lc, Sc)
        weights = self.weights(capped, lse, visible, q, k, v, options, rows, cols)
        dv = np.swapaxes(weights, -1, -2) @ d_out
        d_scores = weights * (d_out @ np.swapaxes(v, -1, -2) - D)
        if options["softcap"] is not None:
            d_scores = d_scores * (1 - np.tanh(raw / options["softcap"]) ** 2)
        return d_scores @ k * scale, np.swapaxes(d_scores, -1, -2) @ q * scale, dv

    def weights(self, scores: np.ndarray, lse: np.ndarray, visible: np.ndarray, q: np.ndarray, k: np.ndarray,
                v: np.ndarray, options: dict, rows: Chunk, cols: Chunk) -> np.ndarray:
        """P = exp(scores - lse) where visible; 0 where hidden or where a query sees no key (lse -inf)."""
        safe = np.where(lse == -np.inf, np.inf, lse)[..., None]  # (..., Lc, 1)
        return np.where(visible, np.exp(np.where(visible, scores, 0.0) - safe), 0.0)

    def visible(self, options: dict, rows: Chunk, cols: Chunk) -> np.ndarray:
        """Query i (global row) at position q_offset + i sees key j by is_causal and the window."""
        position = options["q_offset"] + np.arange(*rows)[:, None]  # (Lc, 1)
        j = np.arange(*cols)  # (Sc,)
        seen = np.ones((rows[1] - rows[0], cols[1] - cols[0]), bool)
        if options["is_causal"]:
            seen &= j <= position
        left, right = options["window"] or (None, None)
        if left is not None:
            seen &= j >= position - left
        if right is not None:
            seen &= j <= position + right
        return seen

    def layout(self, devices: int, L: int, S: int, is_causal: bool) -> dict[str, list[list[Chunk]]]:
        """Per device its query chunks and its key chunks: one contiguous shard, or with is_causal chunks d and
        2P - 1 - d of 2P (validation.ring_chunks raises for lengths the devices do not divide)."""
        validation.ring_chunks(devices, L, S, is_causal)
        pieces = 2 * devices if is_causal else devices

        def chunks(n: int, d: int) -> list[Chunk]:
            size = n // pieces
            ids = (d, pieces - 1 - d) if is_causal else (d,)
            return [(i * size, (i + 1) * size) for i in ids]

        return {"q": [chunks(L, d) for d in range(devices)], "k": [chunks(S, d) for d in range(devices)]}

    def steps(self, devices: int) -> range:
        """The ring's steps: the device's own block, then the P - 1 visitors."""
        return range(devices)

    def offset(self, q_offset: int, rows: Chunk, cols: Chunk) -> int:
        """The q_offset of a chunk pair: query chunk start - key chunk start + q_offset (global positions)."""
        return q_offset + rows[0] - cols[0]

    def merge(self, a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
        """lse = logaddexp(lse_a, lse_b), out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b; zeros and -inf
        where neither part sees a key."""
        (out_a, lse_a), (out_b, lse_b) = a, b
        lse = np.logaddexp(lse_a, lse_b)
        shift = np.where(lse == -np.inf, 0.0, lse)[..., None]
        return np.exp(lse_a[..., None] - shift) * out_a + np.exp(lse_b[..., None] - shift) * out_b, lse

    def assemble(self, parts: list[list[tuple[np.ndarray, np.ndarray]]], q_chunks: list[list[Chunk]],
                 L: int) -> tuple[np.ndarray, np.ndarray]:
        """The devices' chunks put back at their rows of the whole sequence."""
        out_0, lse_0 = parts[0][0]
        out = np.zeros((*out_0.shape[:-2], L, out_0.shape[-1]), out_0.dtype)
        lse = np.full((*lse_0.shape[:-1], L), -np.inf, lse_0.dtype)
        for device, chunks in zip(parts, q_chunks, strict=True):
            for (part_out, part_lse), rows in zip(device, chunks, strict=True):
                out[..., slice(*rows), :], lse[..., slice(*rows)] = part_out, part_lse
        return out, lse

    def home(self, devices: int, d: int) -> int:
        """The block whose accumulators device d holds after the backward ring's last hop: its own."""
        return d


class LocalPositions(Ring):
    """Each chunk pair attends at the caller's q_offset, as if every device's queries and keys started at
    position 0: is_causal and windows compare local rows, so a device's queries see (or miss) the wrong keys.
    Caught by: values, lse."""

    def offset(self, q_offset: int, rows: Chunk, cols: Chunk) -> int:
        return q_offset


class OneStepShort(Ring):
    """The loop runs P - 1 steps, the count of the hops, not of the blocks: the last visiting block is never
    attended. Caught by: values, lse."""

    def steps(self, devices: int) -> range:
        return range(max(devices - 1, 1))


class MergedWithoutRescaling(Ring):
    """The partial outputs are added as they are, each normalised over its own keys: out = out_a + out_b.
    Caught by: values."""

    def merge(self, a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
        return a[0] + b[0], np.logaddexp(a[1], b[1])


class LseOfTheLargerPart(Ring):
    """The merged log-sum-exp is the larger of the two parts' (the running maximum's habit), not their logaddexp;
    out is merged correctly. Caught by: lse."""

    def merge(self, a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
        out, _ = super().merge(a, b)
        return out, np.maximum(a[1], b[1])


class ZigZagNotUndone(Ring):
    """The devices' outputs are concatenated in device order, the zig-zag chunks never moved back to their rows:
    with is_causal on two or more devices the rows come back permuted. Caught by: values."""

    def assemble(self, parts: list[list[tuple[np.ndarray, np.ndarray]]], q_chunks: list[list[Chunk]],
                 L: int) -> tuple[np.ndarray, np.ndarray]:
        pieces = [piece for device in parts for piece in device]
        return (np.concatenate([out for out, _ in pieces], axis=-2),
                np.concatenate([lse for _, lse in pieces], axis=-1))


class AccumulatorsOneHopShort(Ring):
    """The backward ring stops after P steps without the last hop that brings each block's dk, dv accumulators
    home: device d keeps those of the block it received last, d + 1's. Caught by: gradients."""

    def home(self, devices: int, d: int) -> int:
        return (d + 1) % devices


class WeightsFromThePartialLse(Ring):
    """The backward pass recomputes each chunk pair's weights against that pair's own log-sum-exp (a softmax over
    the visiting block alone) instead of the global one. Caught by: gradients."""

    def weights(self, scores: np.ndarray, lse: np.ndarray, visible: np.ndarray, q: np.ndarray, k: np.ndarray,
                v: np.ndarray, options: dict, rows: Chunk, cols: Chunk) -> np.ndarray:
        _, own = attention_np.flash_attention(q, k, v, **options | {"q_offset": self.offset(options["q_offset"], rows,
                                                                                                 cols)})
        return super().weights(scores, own, visible, q, k, v, options, rows, cols)


def _module(name: str, ring: Ring) -> types.ModuleType:
    """The ring as a module of the contract: ring_attention and ring_attention_vjp (NumPy's devices=P)."""

    def ring_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, devices: int, is_causal: bool = False,
                       scale: float | None = None, q_offset: int = 0,
                       window: tuple[int | None, int | None] | None = None, softcap: float | None = None,
                       enable_gqa: bool = False, block_q: int = 128,
                       block_k: int = 128) -> tuple[np.ndarray, np.ndarray]:
        out, lse, _ = ring_attention_vjp(q, k, v, devices=devices, is_causal=is_causal, scale=scale,
                                         q_offset=q_offset, window=window, softcap=softcap, enable_gqa=enable_gqa,
                                         block_q=block_q, block_k=block_k)
        return out, lse

    def ring_attention_vjp(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, devices: int, is_causal: bool = False,
                           scale: float | None = None, q_offset: int = 0,
                           window: tuple[int | None, int | None] | None = None, softcap: float | None = None,
                           enable_gqa: bool = False, block_q: int = 128, block_k: int = 128) -> tuple:
        validation.ring_offset(q_offset)
        options = dict(is_causal=is_causal, scale=scale, window=window, softcap=softcap, block_q=block_q,
                       block_k=block_k, q_offset=q_offset)
        H, Hkv = validation.grouped_heads(q.shape, k.shape, v.shape) if enable_gqa else (1, 1)
        group = H // Hkv
        kv = [np.repeat(x, group, axis=-3) for x in (k, v)] if enable_gqa else [k, v]  # per query head
        out, lse = ring.forward(q, *kv, devices, options)

        def pullback(d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            dtypes = {name: (x.dtype.name, np.issubdtype(x.dtype, np.floating))
                      for name, x in (("d_out", d_out), ("out", out))}
            validation.cotangent("d_out", d_out.shape, out.shape, dtypes)
            dq, dk, dv = ring.backward(q, *kv, devices, options, out, lse, d_out)
            if enable_gqa:  # each key/value head's gradient summed over its group of query heads
                dk, dv = (x.reshape(*x.shape[:-3], -1, group, *x.shape[-2:]).sum(axis=-3) for x in (dk, dv))
            return tuple(np.sum(g, axis=tuple(range(g.ndim - x.ndim))).reshape(x.shape).astype(x.dtype)
                         for g, x in zip((dq, dk, dv), (q, k, v), strict=True))

        return out, lse, pullback

    module = types.ModuleType(name, (ring.__doc__ or "").split("\n")[0])
    module.asarray, module.to_numpy = attention_np.asarray, attention_np.to_numpy
    module.ring_attention, module.ring_attention_vjp = ring_attention, ring_attention_vjp
    return module


VARIANTS: dict[str, type[Ring]] = {
    "local_positions": LocalPositions,
    "one_step_short": OneStepShort,
    "merged_without_rescaling": MergedWithoutRescaling,
    "lse_of_the_larger_part": LseOfTheLargerPart,
    "zig_zag_not_undone": ZigZagNotUndone,
    "accumulators_one_hop_short": AccumulatorsOneHopShort,
    "weights_from_the_partial_lse": WeightsFromThePartialLse,
}
RING = _module("ring", Ring())
BROKEN: dict[str, types.ModuleType] = {name: _module(f"broken_ring_{name}", cls()) for name, cls in VARIANTS.items()}
