"""The decode benchmark of `python -m conformance compare --decode`: one Llama-style block generating tokens
with its key/value cache, against recomputing the whole causal pass for every token, on every backend.

Shape legend: B batch (1), H query heads (8), Hkv key/value heads (2), E = d_k = D / H (64), D = d_model (512),
F = d_ff (1408), P prefill positions (1024), T decode steps (256), p = P + t a position count.

The block: TransformerBlock(D, H, F, dropout=0.0, norm_first=True, norm="rms", activation="swiglu", bias=False,
num_kv_heads=2) in eval mode, float32, its weights drawn once by attention_np and loaded into every backend by
from_state_dict; rope_theta=ROPE_THETA where that is not None. The inputs, (B, P + T, D) float32, are drawn up
front: the first P are the prompt, then one fixed input per step (no sampling).

- decode: an empty cache of capacity P + T, one `extend` of the P prompt positions (the prefill, timed on
  its own), then T calls of `extend` with one position each, need_weights=False. The whole loop of T steps
  is timed, median over the repeats (after one warm-up loop); tokens/s = T / that median, ms/token its
  inverse. JAX: `extend` jitted once; the traces of each input length are counted (jax.jit compiles once per
  trace): one for the prefill, and one for the step must serve all T positions (the cache's length is
  traced).
- recompute: for each new token, the full causal pass `block(x[:, :p], causal_mask(p, p),
  need_weights=False)` over p = P + 1 .. P + T. T full passes take too long to time in NumPy, so every 32nd
  is timed (p = P + 1, P + 33, ..., and P + T), median over the repeats, and the times of the others are
  interpolated linearly between them and summed (the trapezoid rule over p; exact if the time grows linearly).
  The pass at p = P + T checks that its last position equals the last decode step's output (atol 1e-4).
  Speed-up = recompute total / decode total; target >= 20 on every backend.
- torch pieces: the same decode step written from torch.nn pieces (`TorchPieces`): nn.Linear(bias=False) for
  the seven projections, nn.RMSNorm, a preallocated (B, Hkv, P + T, E) cache written by index assignment and
  F.scaled_dot_product_attention(enable_gqa=True) of the one new query over all cached keys (is_causal=False),
  RoPE from precomputed cos/sin tables where ROPE_THETA is set: the simplest correct fast hand-written Llama
  decode step. Its T outputs must equal ours (atol 1e-4) before anything is timed. Then, after our own
  loops, the two decode in turns of TURN = 16 steps each (ours, pieces, pieces, ours, ours, ...; each after
  its own prefill), each turn timed: the machine's speed drifts by a fifth and more over one loop of T steps
  on the README's machine, which loops run one after the other would read as a difference between them.
  Ratio: the median of our T steps' times over the repeats / the pieces'. Target: ours / pieces <= 1.2.

Every timed region runs with Python's garbage collector paused after a full collection (timing.collector_paused,
as timeit does): a full collection takes about 60 ms with torch imported, a sixth of a decode loop, and would
land in whichever loop crosses its threshold. The run holds the objects alive at its start frozen
(timing.older_objects_frozen): those collections then walk only the objects made since.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from ..frameworks.registry import framework_of
from .timing import Target, TargetRow, collector_paused, meets, older_objects_frozen

ROPE_THETA: float | None = 10000.0  # rotary embeddings' base (Llama's); None: the block without RoPE
D_MODEL, NUM_HEADS, NUM_KV_HEADS, D_FF, EPS = 512, 8, 2, 1408, 1e-5
PREFILL, TOKENS, EVERY = 1024, 256, 32  # P, T, and every how many positions the recompute is timed
TURN = 16  # the steps of one turn when ours and the torch pieces decode in turns
ATOL = 1e-4  # float32 outputs of the same block that must agree: ours and the pieces, decode and recompute
TARGETS = {"speed-up": Target("", numerator="recompute", denominators=("decode",), relation=">=", bound=20.0),
           "pieces": Target("torch", numerator="attention_torch decode", denominators=("torch pieces decode",),
                            relation="<=", bound=1.2)}


class DecodeRow(NamedTuple):
    """One backend's decode benchmark; times in ms."""

    backend: str
    framework: str
    prefill_ms: float  # one extend of P positions, median over the repeats
    decode_ms: float  # the loop of T steps, median over the repeats
    tokens_per_s: float  # T / decode seconds
    recompute_ms: float  # T full causal passes, estimated from every EVERY-th (the trapezoid rule)
    sampled: tuple[int, ...]  # the p whose full pass was timed
    speedup: float  # recompute_ms / decode_ms
    prefill_compiles: int | None  # JAX: traces of the jitted extend at L = P; None elsewhere
    step_compiles: int | None  # JAX: traces at L = 1, over all steps and repeats
    turns_ms: float | None  # torch: our T steps, run in turns with the pieces'
    pieces_ms: float | None  # torch: the pieces' T steps, in those turns
    pieces_error: float | None  # torch: max |ours - pieces| over the T outputs, checked <= ATOL before timing


class Backend(NamedTuple):
    """How one framework runs the benchmark: PREPARE[framework](module, block, capacity) -> the calls below."""

    init: Callable[[], Any]  # () -> an empty cache of capacity P + T
    extend: Callable[[Any, Any], tuple[Any, Any]]  # (x, cache) -> (out, cache), need_weights=False
    full: Callable[[Any, Any], Any]  # (x, mask) -> out of the full pass, need_weights=False
    finish: Callable[[Any], Any]  # waits until an output is computed (JAX: block_until_ready)
    compiles: Callable[[], dict[int, int]] | None  # JAX: {L: traces of the jitted extend}


class Config(NamedTuple):
    """The sizes (the defaults: the command's), the repeats, and EVERY for the sampled recompute."""

    prefill: int = PREFILL
    tokens: int = TOKENS
    repeats: int = 5
    d_model: int = D_MODEL
    num_heads: int = NUM_HEADS
    num_kv_heads: int = NUM_KV_HEADS
    d_ff: int = D_FF
    every: int = EVERY
    seed: int = 0


def describe(config: Config) -> str:
    """The configuration, one line."""
    rope = "no RoPE" if ROPE_THETA is None else f"rope_theta={ROPE_THETA}"
    return (f"decode: float32, B=1, one TransformerBlock(D={config.d_model}, H={config.num_heads}, "
            f"Hkv={config.num_kv_heads}, F={config.d_ff}, pre-LN RMSNorm, SwiGLU, no biases, {rope}) in eval mode; "
            f"prefill P={config.prefill}, then T={config.tokens} steps of one token; {config.repeats} repeats, medians")


def run(config: Config, backends: dict[str, ModuleType]) -> tuple[list[DecodeRow], list[TargetRow]]:
    """The benchmark on every backend: one row each, and the targets' rows (speed-up; torch: ours / pieces)."""
    state, x = make_problem(config)
    rows, targets = [], []
    with older_objects_frozen():
        for name, module in backends.items():
            framework = framework_of(module)
            converted = {key: framework.converter("float32", "cpu")(value) for key, value in state.items()}
            inputs = framework.converter("float32", "cpu")(x)
            with framework.no_autograd() if framework.no_autograd else contextlib.nullcontext():
                row = benchmark(name, module, converted, inputs, config)
            rows.append(row)
            targets.append(_target_row(TARGETS["speed-up"]._replace(framework=row.framework), config,
                                       (f"{name} recompute", row.recompute_ms), (f"{name} decode", row.decode_ms)))
            if row.pieces_ms is not None:
                targets.append(_target_row(TARGETS["pieces"], config, (f"{name} decode", row.turns_ms),
                                           ("torch pieces decode", row.pieces_ms)))
    return rows, targets


def make_problem(config: Config) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The block's float32 state dict (attention_np's initial values, seeded) and the inputs (1, P + T, D)."""
    import attention_np

    block = attention_np.TransformerBlock(config.d_model, config.num_heads, config.d_ff, 0.0, **_options(config),
                                          rng=config.seed, dtype=np.float32)
    rng = np.random.default_rng(config.seed + 1)
    x = rng.standard_normal((1, config.prefill + config.tokens, config.d_model)).astype(np.float32)  # (B, P+T, D)
    return {name: np.array(value) for name, value in block.state_dict().items()}, x  # writable copies (torch)


def benchmark(name: str, module: ModuleType, state: dict[str, Any], x: Any, config: Config) -> DecodeRow:
    """One backend: decode (checked against the last full pass), the sampled recompute, and on torch the
    pieces (checked against ours first)."""
    P, T = config.prefill, config.tokens
    block = module.TransformerBlock.from_state_dict(state, num_heads=config.num_heads, dropout=0.0, norm_first=True,
                                                    activation="swiglu", **_rope()).eval()
    kind = framework_of(module).name
    calls = PREPARE[kind](module, block, P + T)
    prompt, steps = x[:, :P], [x[:, p:p + 1] for p in range(P, P + T)]  # (B, P, D), T of (B, 1, D)
    pieces = PIECES[kind](state, config, P + T) if kind in PIECES else None

    # 1) a warm-up loop of each, which also checks them: ours against the pieces on every step
    ours = _decode(calls, prompt, steps)
    error = None
    if pieces is not None:
        theirs = _decode(pieces.calls(), prompt, steps)
        error = max(float((a - b).abs().max()) for a, b in zip(ours.outputs, theirs.outputs, strict=True))
        if error > ATOL:
            raise AssertionError(f"torch pieces differ from {name}'s extend by {error:.2e} > {ATOL}")

    # 2) our decode loops; on torch then ours and the pieces in turns, for their ratio
    loops = [_decode(calls, prompt, steps) for _ in range(config.repeats)]
    prefill_s = statistics.median(loop.prefill_s for loop in loops)
    decode_s = statistics.median(loop.decode_s for loop in loops)
    paired = None
    if pieces is not None:
        turns = [_in_turns((calls, pieces.calls()), prompt, steps) for _ in range(config.repeats)]
        paired = tuple(1e3 * statistics.median(seconds[i] for seconds in turns) for i in (0, 1))

    # 3) the recompute at every EVERY-th p, the last checked against the decode's last output
    sampled, seconds = recompute(calls, module, x, config, last=ours.outputs[-1])
    compiles = calls.compiles() if calls.compiles else {}
    turns_ms, pieces_ms = (None, None) if paired is None else paired
    return DecodeRow(name,
                     framework=kind,
                     prefill_ms=1e3 * prefill_s,
                     decode_ms=1e3 * decode_s,
                     tokens_per_s=T / decode_s,
                     recompute_ms=1e3 * seconds,
                     sampled=sampled,
                     speedup=seconds / decode_s,
                     prefill_compiles=compiles.get(P) if compiles else None,
                     step_compiles=compiles.get(1) if compiles else None,
                     turns_ms=turns_ms,
                     pieces_ms=pieces_ms,
                     pieces_error=error)


class Decoded(NamedTuple):
    prefill_s: float
    decode_s: float
    outputs: list[Any]  # the T steps' outputs (B, 1, D)


def _decode(calls: Backend, prompt: Any, steps: Sequence[Any]) -> Decoded:
    """An empty cache, the prefill, then the T steps; the prefill and the loop timed apart."""
    cache = calls.init()
    with collector_paused():
        start = time.perf_counter()
        out, cache = calls.extend(prompt, cache)
        calls.finish(out)
        middle, outputs = time.perf_counter(), []
        for x in steps:
            out, cache = calls.extend(x, cache)
            outputs.append(out)
        calls.finish(out)
        end = time.perf_counter()
    return Decoded(prefill_s=middle - start, decode_s=end - middle, outputs=outputs)


def _in_turns(pair: tuple[Backend, Backend], prompt: Any, steps: Sequence[Any]) -> tuple[float, float]:
    """Seconds of the T steps of two decoders, each after its own prefill, run in turns of TURN steps in the
    order A B, B A, A B, ... (each goes first equally often): the machine's drift over a loop of T steps then
    hits both alike."""
    caches = []
    for calls in pair:
        out, cache = calls.extend(prompt, calls.init())
        calls.finish(out)
        caches.append(cache)
    seconds = [0.0, 0.0]
    with collector_paused():
        for turn, begin in enumerate(range(0, len(steps), TURN)):
            for who in (0, 1) if turn % 2 == 0 else (1, 0):
                calls, start = pair[who], time.perf_counter()
                for x in steps[begin:begin + TURN]:
                    out, caches[who] = calls.extend(x, caches[who])
                calls.finish(out)
                seconds[who] += time.perf_counter() - start
    return seconds[0], seconds[1]


def recompute(calls: Backend, module: ModuleType, x: Any, config: Config, *,
              last: Any) -> tuple[tuple[int, ...], float]:
    """(the timed p, the estimated seconds of all T full passes): each sampled pass timed `repeats` times after
    a warm-up call, the medians interpolated linearly over p = P + 1 .. P + T and summed (the trapezoid rule)."""
    P, T = config.prefill, config.tokens
    sampled, medians = sampled_positions(P, T, config.every), []
    for p in sampled:
        xp, mask = x[:, :p], module.causal_mask(p, p)  # (B, p, D), (p, p): __call__ takes a boolean mask
        out = calls.finish(calls.full(xp, mask))  # the warm-up (JAX: the compile of this p)
        if p == P + T:
            error = float(np.max(np.abs(module.to_numpy(out)[:, -1:] - module.to_numpy(last))))
            if error > ATOL:
                raise AssertionError(f"the full pass at p={p} differs from the last decode step by {error:.2e}")
        times = []
        with collector_paused():
            for _ in range(config.repeats):
                start = time.perf_counter()
                calls.finish(calls.full(xp, mask))
                times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return sampled, summed(sampled, medians, P, T)


def sampled_positions(P: int, T: int, every: int) -> tuple[int, ...]:
    """The p whose full pass is timed: P + 1, P + 1 + every, ..., and P + T."""
    return tuple(sorted({*range(P + 1, P + T + 1, every), P + T}))


def summed(sampled: Sequence[int], seconds: Sequence[float], P: int, T: int) -> float:
    """The total over p = P + 1 .. P + T of the times measured at `sampled`, interpolated linearly between them
    (the trapezoid rule over p; exact where the time grows linearly)."""
    return float(np.interp(np.arange(P + 1, P + T + 1), sampled, seconds).sum())


def _target_row(target: Target, config: Config, numerator: tuple[str, float],
                denominator: tuple[str, float]) -> TargetRow:
    """A time-ratio row as `compare --targets` prints it (the operation "block", L = P + T)."""
    measured = numerator[1] / denominator[1]
    met = meets(measured, target.relation, target.bound)
    return TargetRow(framework=target.framework,
                     operation="block",
                     variant="decode",
                     L=config.prefill + config.tokens,
                     compared="time ratio",
                     numerator=numerator[0],
                     denominator=denominator[0],
                     numerator_value=numerator[1],
                     denominator_value=denominator[1],
                     measured=measured,
                     relation=target.relation,
                     bound=target.bound,
                     met=met)


def _options(config: Config) -> dict[str, Any]:
    return {"norm_first": True, "norm": "rms", "activation": "swiglu", "bias": False,
            "num_kv_heads": config.num_kv_heads, **_rope()}


def _rope() -> dict[str, float]:
    """rope_theta=ROPE_THETA, only where it is set."""
    return {} if ROPE_THETA is None else {"rope_theta": ROPE_THETA}


# --- each framework's calls ----------------------------------------------------------------------------


def _numpy(module: ModuleType, block: Any, capacity: int) -> Backend:
    return Backend(init=lambda: block.init_cache((1,), capacity),
                   extend=lambda x, cache: _drop_weights(block.extend(x, cache, need_weights=False)),
                   full=lambda x, mask: block(x, mask, need_weights=False)[0], finish=lambda out: out, compiles=None)


def _jax(module: ModuleType, block: Any, capacity: int) -> Backend:
    import jax

    traces: dict[int, int] = {}

    def extend(block: Any, x: Any, cache: Any) -> tuple[Any, Any]:
        traces[x.shape[-2]] = traces.get(x.shape[-2], 0) + 1  # runs once per trace, so once per compile
        return _drop_weights(block.extend(x, cache, need_weights=False))

    extend_jit = jax.jit(extend)  # jax: the block is a pytree argument; one compile per input length
    full_jit = jax.jit(lambda block, x, mask: block(x, mask, need_weights=False)[0])
    return Backend(init=lambda: block.init_cache((1,), capacity), extend=lambda x, cache: extend_jit(block, x, cache),
                   full=lambda x, mask: full_jit(block, x, mask), finish=jax.block_until_ready,
                   compiles=lambda: dict(traces))


def _torch(module: ModuleType, block: Any, capacity: int) -> Backend:
    return Backend(init=lambda: block.init_cache((1,), capacity),
                   extend=lambda x, cache: _drop_weights(block.extend(x, cache, need_weights=False)),
                   full=lambda x, mask: block(x, mask, need_weights=False)[0], finish=lambda out: out, compiles=None)


def _drop_weights(result: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    out, _, cache = result  # need_weights=False: no weights
    return out, cache


PREPARE = {"numpy": _numpy, "jax": _jax, "torch": _torch}


# --- the hand-written torch decode step ----------------------------------------------------------------


class TorchPieces:
    """A Llama decoder layer's decode step from torch.nn pieces, holding our block's state:
    h = RMSNorm_1(x), x = x + W_o SDPA(RoPE(W_q h), cache(RoPE(W_k h)), cache(W_v h)),
    h = RMSNorm_2(x), x = x + W_down (silu(W_gate h) * W_up h)."""

    def __init__(self, state: dict[str, Any], config: Config, capacity: int) -> None:
        import torch
        from torch import nn

        H, Hkv, D, E = config.num_heads, config.num_kv_heads, config.d_model, config.d_model // config.num_heads
        self.H, self.Hkv, self.E = H, Hkv, E
        self.linears = {}
        for name in ("attn.w_q", "attn.w_k", "attn.w_v", "attn.w_o", "ffn.w_gate", "ffn.w_up", "ffn.w_down"):
            weight = state[f"{name}.weight"]  # (out, in)
            self.linears[name] = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            self.linears[name].weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.norms = [nn.RMSNorm(D, eps=EPS) for _ in range(2)]
        for norm, name in zip(self.norms, ("norm1", "norm2"), strict=True):
            norm.weight = nn.Parameter(state[f"{name}.weight"].clone(), requires_grad=False)
        self.k = torch.zeros(1, Hkv, capacity, E)  # (B, Hkv, capacity, E)
        self.v = torch.zeros(1, Hkv, capacity, E)  # (B, Hkv, capacity, E)
        self.cos = self.sin = None
        if ROPE_THETA is not None:  # angle p * theta^(-2j / E) for pair j = (x_j, x_{j + E/2})
            inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, E, 2, dtype=torch.float32) / E)  # (E/2,)
            angles = torch.arange(capacity, dtype=torch.float32)[:, None] * inv_freq  # (capacity, E/2)
            self.cos = torch.cat((angles.cos(), angles.cos()), dim=-1)  # (capacity, E)
            self.sin = torch.cat((angles.sin(), angles.sin()), dim=-1)  # (capacity, E)

    def calls(self) -> Backend:
        """A fresh decode (the cache's positions are overwritten from 0) in the benchmark's calls."""
        return Backend(init=lambda: 0, extend=self.step, full=lambda x, mask: None, finish=lambda out: out,
                       compiles=None)

    def step(self, x: Any, start: int) -> tuple[Any, int]:
        """x (B, L, D) at positions start .. start + L - 1 -> (out (B, L, D), the new length). One new token
        (L = 1) sees every cached key: is_causal=False; L > 1 only for the prefill at start 0, where
        is_causal=True (top-left aligned) is the causal mask."""
        import torch.nn.functional as F

        B, L, D = x.shape
        end, lin = start + L, self.linears

        # 1) attention: project, turn, cache, attend, mix
        h = self.norms[0](x)
        q = lin["attn.w_q"](h).view(B, L, self.H, self.E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        k = lin["attn.w_k"](h).view(B, L, self.Hkv, self.E).transpose(1, 2)  # (B, L, D) -> (B, Hkv, L, E)
        v = lin["attn.w_v"](h).view(B, L, self.Hkv, self.E).transpose(1, 2)  # (B, L, D) -> (B, Hkv, L, E)
        if self.cos is not None:
            cos, sin = self.cos[start:end], self.sin[start:end]  # (L, E)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v  # into the preallocated cache
        out = F.scaled_dot_product_attention(q, self.k[:, :, :end], self.v[:, :, :end], is_causal=L > 1,
                                             enable_gqa=True)  # (B, H, L, E)
        x = x + lin["attn.w_o"](out.transpose(1, 2).reshape(B, L, D))  # (B, H, L, E) -> (B, L, D)

        # 2) the gated feed-forward network
        h = self.norms[1](x)
        return x + lin["ffn.w_down"](F.silu(lin["ffn.w_gate"](h)) * lin["ffn.w_up"](h)), end  # (B, L, D)


def _rotate_half(x: Any) -> Any:
    """(x1, x2) -> (-x2, x1), the halves of the last axis (Llama's rotate_half)."""
    import torch

    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


PIECES = {"torch": TorchPieces}  # framework -> its hand-written decode step, timed beside ours


def compiles_met(rows: Sequence[DecodeRow]) -> bool | None:
    """Whether every JAX row compiled its step once (None: no JAX row)."""
    counts = [row.step_compiles for row in rows if row.step_compiles is not None]
    return None if not counts else all(count == 1 for count in counts)

