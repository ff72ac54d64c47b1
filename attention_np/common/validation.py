"""The argument validation of the three backends: what each public function checks before the math.

Everything here works on plain Python values (shapes as tuples, dtypes as names), so NumPy, JAX and
torch raise the same exception with the same message for the same mistake.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .records import BlockLayout, LatentSizes, MhaLayout

Shape = tuple[int, ...]
ACTIVATIONS = ("relu", "gelu", "swiglu", "swiglu_oss")
GATED = ("swiglu", "swiglu_oss")  # the activations of the gated feed-forward network (SWIGLU's Linears)
SWIGLU_OSS_ALPHA, SWIGLU_OSS_LIMIT = 1.702, 7.0  # gpt-oss's swiglu_alpha and swiglu_limit (GptOssConfig's)
NORMS = ("layer", "rms")
PROJECTIONS = ("w_q", "w_k", "w_v", "w_o")
SWIGLU = ("w_gate", "w_up", "w_down")  # the feed-forward Linears of activation="swiglu"
FEATURE_MAPS = ("elu", "relu", "identity")  # linear_attention's phi: elu(x) + 1, max(x, 0), x
# linear_attention's update rules (ONNX LinearAttention's), each with whether it takes (decay, beta)
UPDATE_RULES = {"linear": (False, False), "gated": (True, False), "delta": (False, True),
                "gated_delta": (True, True)}


def _shape(shape: Iterable[int]) -> Shape:
    return tuple(map(int, shape))


def attention_batch(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> Shape:
    """Check q (..., L, E), k (..., S, E), v (..., S, Ev); return the broadcast leading axes (...)."""
    q, k, v = _shape(q), _shape(k), _shape(v)
    for name, shape, letters in (("q", q, "L, E"), ("k", k, "S, E"), ("v", v, "S, Ev")):
        if len(shape) < 2:
            raise ValueError(f"{name} must have shape (..., {letters}); got {shape}")
    if q[-1] != k[-1]:
        raise ValueError(f"q and k must have the same width E: q {q} is (..., L, E), k {k} is (..., S, E)")
    if k[-2] != v[-2]:
        raise ValueError(f"k and v must have the same length S: k {k} is (..., S, E), v {v} is (..., S, Ev)")
    batch = _broadcast(q[:-2], k[:-2], v[:-2])
    if batch is None:
        raise ValueError(f"the leading axes of q {q}, k {k} and v {v} do not broadcast")
    return batch


def _broadcast(*shapes: Shape) -> Shape | None:
    """The shape the `shapes` broadcast to (NumPy's rule, aligned at the right), or None where they do not.
    Plain Python: these checks run on every call, where np.broadcast_shapes costs microseconds."""
    rank = 0
    for shape in shapes:  # a plain loop: torch.compile traces these checks too
        rank = max(rank, len(shape))
    out = [1] * rank
    for shape in shapes:
        for axis, n in enumerate(shape, start=len(out) - len(shape)):
            if n != out[axis] and out[axis] != 1 and n != 1:
                return None
            out[axis] = n if out[axis] == 1 else out[axis]
    return tuple(out)


def default_scale(scale: float | None, q: Sequence[int], k: Sequence[int]) -> float:
    """The scale of the scores: `scale` as given, else 1 / sqrt(E), which needs E > 0 (with an explicit
    scale, E = 0 is fine: every score is an empty sum, 0)."""
    if scale is not None:
        return scale
    q, k = _shape(q), _shape(k)
    if q[-1] == 0:
        raise ValueError(f"the default scale 1 / sqrt(E) needs E > 0; q {q} and k {k} have width E = 0: "
                         "pass scale= explicitly")
    return 1.0 / math.sqrt(q[-1])


def broadcasts_to(name: str, shape: Sequence[int], target: Sequence[int], letters: str) -> None:
    """`shape` must broadcast to `target` without enlarging it (a mask never adds batch axes)."""
    shape, target = _shape(shape), _shape(target)
    if not _fits(shape, target):
        raise ValueError(f"{name} of shape {shape} does not broadcast to {target} ({letters})")


def _fits(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether `shape` broadcasts to `target` without enlarging it."""
    return _broadcast(shape, target) == target


def window(window: object) -> tuple[int | None, int | None] | None:
    """`window` is None or (left, right), each a non-negative int or None (unbounded on that side)."""
    if window is None:
        return None
    pair = tuple(window) if isinstance(window, tuple | list) else ()
    sides_ok = all(side is None or (isinstance(side, int | np.integer) and not isinstance(side, bool) and side >= 0)
                   for side in pair)
    if len(pair) != 2 or not sides_ok:
        raise ValueError(f"window must be None or a pair (left, right) of non-negative ints or None; got {window!r}")
    return tuple(None if side is None else int(side) for side in pair)


def softcap(softcap: object) -> None:
    """`softcap` is None or a positive finite number (softcap * tanh(raw / softcap) of inf is NaN)."""
    number = isinstance(softcap, int | float | np.integer | np.floating) and not isinstance(softcap, bool)
    if softcap is not None and not (number and 0 < softcap < math.inf):
        raise ValueError(f"softcap must be None or a positive finite number; got {softcap!r}")


def positions(name: str, shape: Sequence[int], dtype: str, integer: bool, batch: Sequence[int]) -> None:
    """`q_offset` or `key_lengths`: integer, and broadcasting to the scores' leading axes (...) without
    enlarging them (one value per sequence, never per query or key)."""
    if not integer:
        raise TypeError(f"{name} must be an int or an integer array; got dtype {dtype}")
    shape, batch = _shape(shape), _shape(batch)
    if not _fits(shape, batch):
        raise ValueError(f"{name} of shape {shape} does not broadcast to the scores' leading axes {batch} (...)")


def grouped_heads(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> tuple[int, int]:
    """enable_gqa: q (..., H, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev), H a multiple of Hkv; returns
    (H, Hkv)."""
    q, k, v = _shape(q), _shape(k), _shape(v)
    for name, shape, letters in (("q", q, "H, L, E"), ("k", k, "Hkv, S, E"), ("v", v, "Hkv, S, Ev")):
        if len(shape) < 3:
            raise ValueError(f"enable_gqa needs a head axis: {name} must have shape (..., {letters}); got {shape}")
    H, Hkv = q[-3], k[-3]
    if v[-3] != Hkv:
        raise ValueError(f"enable_gqa: k and v must have the same number of heads Hkv; k {k} is (..., Hkv, S, E), "
                         f"v {v} is (..., Hkv, S, Ev)")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"enable_gqa: the H = {H} query heads must be a multiple of the Hkv = {Hkv} key/value "
                         f"heads; q {q} is (..., H, L, E), k {k} is (..., Hkv, S, E)")
    return H, Hkv


def grouped_shape(shape: Sequence[int], H: int, Hkv: int, trailing: int) -> Shape:
    """The shape of an array with its head axis (the one before its `trailing` last axes) split into groups:
    H -> (Hkv, G), Hkv -> (Hkv, 1), 1 -> (1, 1), G = H // Hkv; unchanged without a head axis. Query head h is
    then (h // G, h % G), and key/value head h // G broadcasts over its group."""
    shape = _shape(shape)
    if len(shape) <= trailing:
        return shape
    axis = len(shape) - trailing - 1
    heads = shape[axis]
    split = (Hkv, H // Hkv) if heads == H else (heads, 1)  # H == Hkv: (H, 1) either way
    return shape[:axis] + split + shape[axis + 1:]


def sinks(shape: Sequence[int], batch: Sequence[int], grouped: bool) -> Shape:
    """The sinks, one logit per head, must broadcast to the scores' leading axes (..., H), `batch` those axes
    ((..., Hkv, G) with enable_gqa, H = Hkv * G). Returns the sinks' shape laid out against the scores
    (..., L, S): (..., 1, 1), the head axis split into (Hkv, G) where the heads are grouped."""
    shape, batch = _shape(shape), _shape(batch)
    heads = (*batch[:-2], batch[-2] * batch[-1]) if grouped else batch
    broadcasts_to("sinks", shape, heads, "..., H")
    if grouped:
        shape = grouped_shape(shape, heads[-1], batch[-2], 0)
    return (*shape, 1, 1)


def alibi_slopes(shape: Sequence[int], batch: Sequence[int], grouped: bool) -> Shape:
    """ALiBi's slopes, one per query head, (H,) or (B, H), must broadcast to the scores' leading axes (..., H),
    `batch` those axes ((..., Hkv, G) with enable_gqa, H = Hkv * G). Returns the slopes' shape laid out against
    the scores (..., L, S): (..., 1, 1), the head axis split into (Hkv, G) where the heads are grouped."""
    shape, batch = _shape(shape), _shape(batch)
    heads = (*batch[:-2], batch[-2] * batch[-1]) if grouped else batch
    if len(shape) not in (1, 2) or not heads or shape[-1] != heads[-1] or not _fits(shape, heads):
        raise ValueError(f"alibi_slopes of shape {shape} must be (H,) or (B, H), one slope per query head, "
                         f"broadcasting to the scores' leading axes {heads} (..., H)")
    if grouped:
        shape = grouped_shape(shape, heads[-1], batch[-2], 0)
    return (*shape, 1, 1)


def shared_kv_head(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> bool:
    """Whether k and v hold one head (axis -3, or none) that several query heads of q's axis -3 share: GQA's
    groups (enable_gqa), or multi-query attention by broadcasting. A fast path then needs no copy of k and v
    per query head."""
    def heads(shape: Sequence[int]) -> int:
        return shape[-3] if len(shape) >= 3 else 1
    return heads(q) > 1 and heads(k) == heads(v) == 1


def rope(x: Sequence[int], positions: Sequence[int], dtype: str, integer: bool, theta: object) -> None:
    """apply_rope: x (..., L, E) with E even; positions integer, broadcasting to x's (..., L) without
    enlarging it; theta a positive finite number."""
    x, positions = _shape(x), _shape(positions)
    if len(x) < 2 or x[-1] % 2:
        raise ValueError(f"apply_rope rotates pairs of entries: x must have shape (..., L, E) with E even; got {x}")
    if not integer:
        raise TypeError(f"positions must be an int or an integer array; got dtype {dtype}")
    if not _fits(positions, x[:-1]):
        raise ValueError(f"positions of shape {positions} does not broadcast to x's (..., L) {x[:-1]}; x is {x}")
    if not _positive_finite(theta):
        raise ValueError(f"theta must be a positive finite number; got {theta!r}")


def _positive_finite(x: object) -> bool:
    """Whether x is a real number (not a bool) in (0, inf)."""
    number = isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)
    return number and 0 < x < math.inf


def same_floating_dtype(dtypes: Mapping[str, tuple[str, bool]], where: str = "") -> None:
    """`dtypes` maps an argument name to (dtype name, is floating); all must be one floating dtype."""
    for name, (dtype, floating) in dtypes.items():
        if not floating:
            raise TypeError(f"{where}{name} must have a floating dtype; got {dtype}")
    if len({dtype for dtype, _ in dtypes.values()}) > 1:
        listed = ", ".join(f"{name} {dtype}" for name, (dtype, _) in dtypes.items())
        raise TypeError(f"{where}{', '.join(dtypes)} must share one dtype; got {listed}")


def binary_mask(floating: bool, binary: bool | None) -> None:
    """A floating mask holds 0 and 1 only (binary None: its values cannot be seen, as under jax.jit)."""
    if floating and binary is False:
        raise ValueError("mask holds values other than 0 and 1: a mask hides a key where it equals 0 and keeps "
                         "it elsewhere; pass an additive mask (0 and -inf, say) as bias= instead")


def probability(name: str, p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1); got {p}")


def tiles(block_q: object, block_k: object) -> None:
    """flash_attention's tile sizes: positive integers (the last tile of each axis may be shorter), or None, which
    default_tiles chooses."""
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None and not (isinstance(size, int | np.integer) and not isinstance(size, bool) and size > 0):
            raise ValueError(f"{name} must be None or a positive integer; got {size!r}")


def default_tiles(block_q: int | None, block_k: int | None, batch: Sequence[int], L: int, S: int,
                  scores: int) -> tuple[int, int]:
    """flash_attention's tiles, each None chosen from the shapes: block_k = 2 block_q, block_q the largest power of
    two (at least 16) whose tile of scores over the batch, prod(batch) * block_q * block_k values, stays within
    `scores`, the backend's budget, and neither larger than the sequence it cuts. Few large tiles: each tile
    costs every backend a fixed number of calls, whatever its size (B=1, H=8, L=S=4096: 256 x 512)."""
    rows = 16
    while 2 * max(1, math.prod(batch)) * (2 * rows) ** 2 <= scores:
        rows *= 2
    return (min(rows, max(L, 1)) if block_q is None else block_q,
            min(2 * rows, max(S, 1)) if block_k is None else block_k)


def key_tiles(start: int, stop: int, S: int, block_k: int, *, is_causal: bool,
              window: tuple[int | None, int | None] | None, q_offset: tuple[int, int],
              key_lengths: int | None) -> range:
    """The key tiles (indices t, keys t * block_k .. (t + 1) * block_k - 1) that the structure (is_causal,
    window, q_offset, key_lengths) may leave visible to some query of rows start .. stop - 1; the others are
    hidden for every query of the tile and are skipped. q_offset is (its least, its greatest) over the
    batch, key_lengths the greatest (None: S). Query i stands at p_i = q_offset + i: causal keeps keys
    j <= p_i, the window p_i - left <= j <= p_i + right, key_lengths j < key_lengths."""
    first_p, last_p = q_offset[0] + start, q_offset[1] + stop - 1  # the tile's least and greatest position
    lo, hi = 0, S if key_lengths is None else max(0, min(S, key_lengths))  # keys lo .. hi - 1
    if is_causal:
        hi = min(hi, last_p + 1)
    if window is not None and window[1] is not None:
        hi = min(hi, last_p + window[1] + 1)
    if window is not None and window[0] is not None:
        lo = max(lo, first_p - window[0])
    if hi <= lo:
        return range(0)
    return range(lo // block_k, (hi - 1) // block_k + 1)


def ring_chunks(devices: object, L: int, S: int, is_causal: bool) -> dict[str, list[list[tuple[int, int]]]]:
    """ring_attention's layout: for each of the P devices, its chunks of the queries ("q") and of the keys and
    values ("k") as (start, stop) positions. Contiguous shards, or with is_causal the zig-zag layout: 2P chunks,
    device d holding chunks d and 2P - 1 - d, so that causal attention gives every device the same work.
    ValueError unless P is a positive int and L and S are multiples of P (2P with is_causal)."""
    if not (isinstance(devices, int | np.integer) and not isinstance(devices, bool) and devices > 0):
        raise ValueError(f"devices must be a positive integer; got {devices!r}")
    pieces = 2 * devices if is_causal else devices
    layout = "the zig-zag layout of is_causal cuts it into 2P chunks" if is_causal else "one shard per device"
    for name, n in (("L", L), ("S", S)):
        if n % pieces:
            raise ValueError(f"ring_attention: {name} = {n} is not a multiple of {pieces} (P = {devices} devices; "
                             f"{layout})")

    def shards(n: int) -> list[list[tuple[int, int]]]:
        size = n // pieces
        if not is_causal:
            return [[(d * size, (d + 1) * size)] for d in range(devices)]
        return [[(d * size, (d + 1) * size), ((pieces - 1 - d) * size, (pieces - d) * size)] for d in range(devices)]

    return {"q": shards(L), "k": shards(S)}


ATTENTIONS = ("softmax", "linear")  # MultiHeadAttention's attention in each head


def attention(name: str, dropout: float) -> None:
    """MultiHeadAttention's attention, one of ATTENTIONS; "linear" forms no attention weights, so dropout, which
    acts on them, is 0."""
    if name not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}; got {name!r}")
    if name == "linear" and dropout != 0:
        raise ValueError(f"dropout must be 0 with attention='linear' (dropout acts on the attention weights, which "
                         f"linear attention does not form); got {dropout!r}")


def attention_sinks(attention: str, sinks: bool) -> None:
    """MultiHeadAttention's sinks join a softmax's denominator: linear attention has none."""
    if sinks and attention != "softmax":
        raise ValueError(f"sinks=True needs attention='softmax': a sink logit joins the softmax's denominator, "
                         f"which attention={attention!r} does not form")


def cached(attention: str) -> None:
    """init_paged_cache keeps softmax attention's keys and values in pages: linear attention keeps a state."""
    if attention != "softmax":
        raise ValueError(f"init_paged_cache needs attention='softmax'; got attention={attention!r} (linear "
                         "attention's cache is init_cache's recurrent state, whose size does not grow)")


def cache_kind(attention: str, kind: str) -> None:
    """extend's cache is its attention's: softmax attention keeps keys and values (KVCache, PagedKVCache,
    StreamingKVCache), linear attention its recurrent state (LinearCache); `kind` the cache's class name."""
    if (attention == "linear") != (kind == "LinearCache"):
        wanted = "a LinearCache" if attention == "linear" else "a KVCache, PagedKVCache or StreamingKVCache"
        raise ValueError(f"extend with attention={attention!r} needs {wanted} from init_cache; got a {kind}")


def linear_cache(sink_tokens: int, window: int | None, rope_positions: str) -> None:
    """init_cache with attention='linear': the recurrent state holds every position, so no streaming options."""
    if sink_tokens != 0 or window is not None or rope_positions != "original":
        raise ValueError("init_cache with attention='linear' keeps the recurrent state of every position: "
                         "sink_tokens, window and rope_positions keep their defaults; got "
                         f"sink_tokens={sink_tokens!r}, window={window!r}, rope_positions={rope_positions!r}")


def linear_extend(mask: object, new_lengths: object, mask_mod: object, score_mod: object) -> None:
    """extend with attention='linear': every position of the chunk causal over the state, nothing to hide or
    modify: no mask, new_lengths, mask_mod or score_mod."""
    for name, value in (("mask", mask), ("new_lengths", new_lengths), ("mask_mod", mask_mod),
                        ("score_mod", score_mod)):
        if value is not None:
            raise ValueError(f"{name} must be None in extend with attention='linear': each new position reads the "
                             "state of the earlier ones and the chunk's positions up to its own")


def ring_offset(q_offset: object) -> None:
    """ring_attention's q_offset: a Python int, one for every sequence (the devices' chunks are placed by it)."""
    if not isinstance(q_offset, int | np.integer) or isinstance(q_offset, bool):
        raise ValueError(f"ring_attention: q_offset must be a Python int; got {q_offset!r}")


def feature_map(name: object) -> None:
    """linear_attention's feature map phi: one of FEATURE_MAPS."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS}; got {name!r}")


def linear_options(feature_map_: object, eps: object, chunk: object = None) -> None:
    """linear_attention's keywords: the feature map, eps a positive finite number (it keeps the normaliser of a
    query that sees no key away from 0), chunk None or a positive int (the chunks of the causal form)."""
    feature_map(feature_map_)
    if not _positive_finite(eps):
        raise ValueError(f"eps must be a positive finite number; got {eps!r}")
    if chunk is not None and not (isinstance(chunk, int | np.integer) and not isinstance(chunk, bool) and chunk > 0):
        raise ValueError(f"chunk must be None or a positive integer; got {chunk!r}")


def linear_causal(L: int, S: int) -> None:
    """Causal linear attention is autoregressive self-attention (the recurrent form's): L == S."""
    if L != S:
        raise ValueError(f"linear_attention with is_causal=True needs L == S (autoregressive self-attention, as "
                         f"the recurrent form linear_attention_step computes it); got L = {L}, S = {S}")


def update_rule(rule: object) -> None:
    """linear_attention's update_rule: one of UPDATE_RULES."""
    if rule not in UPDATE_RULES:
        raise ValueError(f"update_rule must be one of {tuple(UPDATE_RULES)}; got {rule!r}")


def linear_gates(rule: object, decay: Sequence[int] | None, beta: Sequence[int] | None, batch: Sequence[int],
                 S: int | None, E: int) -> None:
    """linear_attention's update_rule with the inputs it takes (their shapes, or None): decay for "gated" and
    "gated_delta", beta for "delta" and "gated_delta", neither for "linear". decay is (..., S, 1), a scalar per
    head, or (..., S, E), one per key dimension; beta (..., S, 1); their leading axes (...) broadcast to the
    inputs' `batch` without enlarging it. The step's (S None) drop the S axis: (..., 1) or (..., E)."""
    update_rule(rule)
    for name, shape, needed, widths in (("decay", decay, UPDATE_RULES[rule][0], (1, E)),
                                        ("beta", beta, UPDATE_RULES[rule][1], (1,))):
        if needed and shape is None:
            raise ValueError(f"update_rule={rule!r} needs {name}; got {name}=None")
        if not needed and shape is not None:
            raise ValueError(f"update_rule={rule!r} takes no {name}; got {name} of shape {_shape(shape)}")
        if shape is not None:
            _linear_gate(name, _shape(shape), widths, _shape(batch), S, E)


def _linear_gate(name: str, shape: Shape, widths: tuple[int, ...], batch: Shape, S: int | None, E: int) -> None:
    rank = 1 if S is None else 2
    rows = "" if S is None else "S, "
    forms = " or ".join(dict.fromkeys(f"(..., {rows}{'1' if w == 1 else 'E'})" for w in widths))
    if not (len(shape) >= rank and shape[-1] in widths and (S is None or shape[-2] == S)
            and _fits(shape[:len(shape) - rank], batch)):
        raise ValueError(f"{name} must have shape {forms} with E = {E}{'' if S is None else f', S = {S}'} and "
                         f"leading axes that broadcast to the inputs' {batch}; got {name} of shape {shape}")


def linear_rule_causal(rule: str, is_causal: bool) -> None:
    """The rules with decay or beta are recurrences over the positions: causal only."""
    if rule != "linear" and not is_causal:
        raise ValueError(f"update_rule={rule!r} is a recurrence over the positions: it needs is_causal=True")


def linear_state_size(batch_shape: object, E: object, Ev: object) -> Shape:
    """linear_attention_state: batch_shape a tuple of non-negative ints, E and Ev non-negative ints; returns
    batch_shape as a tuple."""
    def size(n: object) -> bool:
        return isinstance(n, int | np.integer) and not isinstance(n, bool) and n >= 0
    if not (isinstance(batch_shape, tuple | list) and all(size(n) for n in batch_shape)):
        raise ValueError(f"batch_shape must be a tuple of non-negative ints (the inputs' leading axes); "
                         f"got {batch_shape!r}")
    for name, n in (("E", E), ("Ev", Ev)):
        if not size(n):
            raise ValueError(f"{name} must be a non-negative int; got {n!r}")
    return _shape(batch_shape)


def linear_state_pair(state: object) -> None:
    """linear_attention_step's state: the pair (S, z) that linear_attention_state returns."""
    if not (isinstance(state, tuple | list) and len(state) == 2):
        raise ValueError(f"state must be the pair (S, z) that linear_attention_state returns; got "
                         f"{type(state).__name__}")


def linear_state_rule(rule: str, has_z: bool) -> None:
    """The state's second entry: z (..., E) under "linear", whose normaliser it sums; None under the rules with
    decay or beta, which have no normaliser."""
    if (rule == "linear") != has_z:
        form = "(S, z)" if rule == "linear" else "(S, None)"
        raise ValueError(f"state must be {form} under update_rule={rule!r}, as linear_attention_state(..., "
                         f"update_rule={rule!r}) returns; got z {'None' if not has_z else 'an array'}")


def linear_step(q: Sequence[int], k: Sequence[int], v: Sequence[int], S: Sequence[int], z: Sequence[int]) -> None:
    """linear_attention_step: q_t, k_t (..., E) and v_t (..., Ev), one position; the state's S (..., E, Ev) and
    z (..., E), whose leading axes the inputs' broadcast to without enlarging them (the new state keeps the
    state's shape)."""
    q, k, v, S, z = _shape(q), _shape(k), _shape(v), _shape(S), _shape(z)
    for name, shape, letters in (("q_t", q, "E"), ("k_t", k, "E"), ("v_t", v, "Ev")):
        if len(shape) < 1:
            raise ValueError(f"{name} must have shape (..., {letters}); got {shape}")
    if q[-1] != k[-1]:
        raise ValueError(f"q_t and k_t must have the same width E: q_t {q} is (..., E), k_t {k} is (..., E)")
    inputs = _broadcast(q[:-1], k[:-1], v[:-1])
    if inputs is None:
        raise ValueError(f"the leading axes of q_t {q}, k_t {k} and v_t {v} do not broadcast")
    if not (len(S) >= 2 and S[-2:] == (k[-1], v[-1]) and z == S[:-1] and _fits(inputs, S[:-2])):
        raise ValueError(f"state (S {S}, z {z}) does not fit the inputs q_t {q}, k_t {k}, v_t {v}: S must be "
                         f"(..., E, Ev) and z (..., E) with E = {k[-1]}, Ev = {v[-1]} and leading axes (...) that "
                         f"the inputs' {inputs} broadcast to")


def linear_state_dtype(state: Mapping[str, tuple[str, bool]], bits: int, work: str, work_bits: int) -> None:
    """linear_attention_step computes in the state's dtype: S and z one floating dtype (of `bits` bits), at least
    the inputs' working dtype `work` (float32 for float16 and bfloat16 inputs), else TypeError naming both."""
    same_floating_dtype(state, "the state's ")
    if bits < work_bits:
        dtype = next(iter(state.values()))[0]
        raise TypeError(f"state of dtype {dtype} is below the inputs' working dtype {work}: the step computes in "
                        f"the state's dtype; start from linear_attention_state(..., dtype={work})")


def module_sizes(d_model: int, num_heads: int, d_ff: int | None = None) -> None:
    sizes = {"d_model": d_model, "num_heads": num_heads} | ({} if d_ff is None else {"d_ff": d_ff})
    for name, size in sizes.items():
        if not (isinstance(size, int | np.integer) and size > 0):
            raise ValueError(f"{name} must be a positive integer; got {size!r}")
    if d_model % num_heads:
        raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")


def block_window(window_: object, attention_: str) -> tuple[int | None, int | None] | None:
    """TransformerBlock's window: None or (left, right) as `window`; softmax attention only (a mask)."""
    if window_ is not None and attention_ != "softmax":
        raise ValueError(f"TransformerBlock: window={window_!r} needs attention='softmax' (the window is a mask); "
                         f"got attention={attention_!r}")
    return window(window_)

def activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {name!r}")


def norm(name: str) -> None:
    if name not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}; got {name!r}")


def alibi_heads(H: object) -> int:
    """alibi_slopes(H): one slope per head, H a positive integer."""
    if not (isinstance(H, int | np.integer) and not isinstance(H, bool) and H > 0):
        raise ValueError(f"alibi_slopes needs the number of heads H, a positive integer; got {H!r}")
    return int(H)


def position(position: object, rope_theta: float | None, attention: str) -> str | None:
    """MultiHeadAttention's position encoding: None (rope_theta decides: "rope" where it is given), "rope"
    (needs rope_theta) or "alibi" (ALiBi's bias in the softmax: needs attention="softmax" and no rope_theta).
    Returns the encoding in use, "rope", "alibi" or None."""
    if position not in (None, "rope", "alibi"):
        raise ValueError(f"position must be None, 'rope' or 'alibi'; got {position!r}")
    if position == "rope" and rope_theta is None:
        raise ValueError("position='rope' needs rope_theta, the rotary embeddings' base; got rope_theta=None")
    if position == "alibi" and rope_theta is not None:
        raise ValueError(f"position='alibi' takes no rope_theta (one position encoding); got rope_theta={rope_theta}")
    if position == "alibi" and attention != "softmax":
        raise ValueError(f"position='alibi' needs attention='softmax': ALiBi's bias joins the softmax's scores, "
                         f"which attention={attention!r} does not form")
    return "rope" if position is None and rope_theta is not None else position


def rope_theta(theta: object, d_model: int, num_heads: int) -> float | None:
    """rope_theta None (no rotary embeddings) or a positive finite number; RoPE turns pairs of each head's
    entries, so d_k = d_model / num_heads must be even. Returns the theta as a float (or None)."""
    if theta is None:
        return None
    if not _positive_finite(theta):
        raise ValueError(f"rope_theta must be None or a positive finite number; got {theta!r}")
    if (d_model // num_heads) % 2:
        raise ValueError(f"rope_theta turns pairs of each head's entries: d_k = d_model / num_heads = "
                         f"{d_model} / {num_heads} = {d_model // num_heads} must be even")
    return float(theta)


def kv_heads(num_heads: int, num_kv_heads: int | None) -> int:
    """num_kv_heads None (one key/value head per query head) or a positive int dividing num_heads; returns Hkv."""
    if num_kv_heads is None:
        return num_heads
    integer = isinstance(num_kv_heads, int | np.integer) and not isinstance(num_kv_heads, bool)
    if not (integer and num_kv_heads > 0 and num_heads % num_kv_heads == 0):
        raise ValueError(f"num_kv_heads must be a positive integer dividing num_heads={num_heads}; "
                         f"got num_kv_heads={num_kv_heads!r}")
    return int(num_kv_heads)


def module_input(name: str, shape: Sequence[int], d_model: int, letter: str) -> None:
    shape = _shape(shape)
    if len(shape) < 2 or shape[-1] != d_model:
        raise ValueError(f"{name} must have shape (..., {letter}, D) with D = d_model = {d_model}; "
                         f"got {shape}")


def dropout_rng(p: float, rng: object, what: str) -> None:
    """A backend without global randomness (JAX) needs an rng whenever dropout is active."""
    if p > 0.0 and rng is None:
        raise ValueError(f"{what} with dropout probability {p} needs rng (a jax.random key); "
                         "pass rng=jax.random.key(seed), or use .eval() / dropout 0 for no dropout")


def no_dropout(what: str, p: float) -> None:
    """vjp differentiates the deterministic forward pass."""
    if p > 0.0:
        raise ValueError(f"{what}.vjp differentiates the forward pass without dropout; got dropout {p} in "
                         "training mode: call .eval() first, or build the module with dropout 0")


def cotangent(name: str, shape: Sequence[int], expected: Sequence[int],
              dtypes: Mapping[str, tuple[str, bool]]) -> None:
    """A pullback's argument has the shape (else ValueError) and the dtype (else TypeError) of the output it
    belongs to; `dtypes` maps the two names to (dtype name, is floating), as for same_floating_dtype."""
    if _shape(shape) != _shape(expected):
        raise ValueError(f"{name} must have the output's shape {_shape(expected)}; got {_shape(shape)}")
    same_floating_dtype(dtypes, "a pullback's ")


def cache_size(batch_shape: object, capacity: object) -> Shape:
    """init_cache: batch_shape a tuple of non-negative ints (the inputs' leading axes), capacity a
    non-negative int (the positions the cache can hold); returns batch_shape as a tuple."""
    def size(n: object) -> bool:
        return isinstance(n, int | np.integer) and not isinstance(n, bool) and n >= 0
    if not (isinstance(batch_shape, tuple | list) and all(size(n) for n in batch_shape)):
        raise ValueError(f"batch_shape must be a tuple of non-negative ints (the inputs' leading axes); "
                         f"got {batch_shape!r}")
    if not size(capacity):
        raise ValueError(f"capacity must be a non-negative int; got {capacity!r}")
    return _shape(batch_shape)


def cache_inputs(names: Sequence[str], shapes: Sequence[Sequence[int]], cache: Sequence[int], d_model: int) -> int:
    """extend: each input (..., L, D), one L for all, with the cache's leading axes (...); `cache` is the
    cache's keys' shape (..., heads, capacity, d_k). Returns L."""
    cache, shapes = _shape(cache), [_shape(shape) for shape in shapes]
    batch = cache[:-3]
    for name, shape in zip(names, shapes, strict=True):
        if len(shape) < 2 or shape[-1] != d_model or shape[:-2] != batch:
            raise ValueError(f"{name} must have shape (..., L, D) with the cache's leading axes (...) = {batch} "
                             f"and D = d_model = {d_model}; got {shape} (the cache's keys are {cache})")
    lengths = {shape[-2] for shape in shapes}
    if len(lengths) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in zip(names, shapes, strict=True))
        raise ValueError(f"the new queries and keys stand at the same positions: one length L for {listed}")
    return lengths.pop()


def cache_room(capacity: int, length: int | np.ndarray, new: int | np.ndarray) -> None:
    """extend: the cache must hold its `length` positions and the `new` ones, in every sequence (either may be
    an array of a length per sequence)."""
    if not isinstance(length, np.ndarray) and not isinstance(new, np.ndarray):  # plain ints (symbolic ones too:
        if length + new > capacity:  # torch.compile traces this check)
            raise ValueError(f"the cache is full: its capacity is {capacity} positions, {length} are filled, and "
                             f"extend asks for {new} more ({length + new} in all); start from a larger init_cache")
        return
    total = np.asarray(length) + np.asarray(new)
    if (total > capacity).any():
        at = np.unravel_index(int(np.argmax(total)), total.shape)
        which = f"sequence {tuple(map(int, at))}: " if total.ndim else ""
        filled, more = int(np.broadcast_to(length, total.shape)[at]), int(np.broadcast_to(new, total.shape)[at])
        raise ValueError(f"the cache is full: {which}its capacity is {capacity} positions, {filled} are filled, "
                         f"and extend asks for {more} more ({filled + more} in all); start from a larger init_cache")


def lengths(name: str, batch: Sequence[int], shape: Sequence[int], dtype: str, integer: bool) -> None:
    """A length per sequence (a cache's length, extend's new_lengths): an int, or an integer array of the cache's
    leading axes (...), one per sequence."""
    if not integer:
        raise TypeError(f"{name} must be an int or an integer array; got dtype {dtype}")
    if _shape(shape) not in ((), _shape(batch)):
        raise ValueError(f"{name} must be an int or one per sequence, of the cache's leading axes {_shape(batch)}; "
                         f"got shape {_shape(shape)}")


def new_lengths_range(L: int, values: np.ndarray) -> None:
    """new_lengths' values within 0 .. L, the chunk's rows (read where they are concrete)."""
    if values.size and (values.min() < 0 or values.max() > L):
        bad = int(values.min()) if values.min() < 0 else int(values.max())
        raise ValueError(f"new_lengths must lie in 0 .. L = {L}, the chunk's rows; got {bad}")


def mha_state_shapes(d_model: int, num_heads: int = 1, num_kv_heads: int | None = None,
                     bias: bool = True, sinks: bool = False) -> dict[str, Shape]:
    """State-dict names and shapes of MultiHeadAttention (nn.Linear layout: weight (out, in)): w_q and w_o
    (D, D), w_k and w_v (Hkv * d_k, D), d_k = D / H; each with its bias (out,) unless bias is False; with sinks,
    first the sink logits sinks (H,) (torch's state dict holds a module's own parameters before its children's)."""
    d_kv = d_model // num_heads * kv_heads(num_heads, num_kv_heads)
    return ({"sinks": (num_heads,)} if sinks else {}) | _linear_shapes(
        {"w_q": (d_model, d_model), "w_k": (d_kv, d_model), "w_v": (d_kv, d_model), "w_o": (d_model, d_model)},
        bias)


def block_state_shapes(d_model: int, d_ff: int, *, num_heads: int = 1, num_kv_heads: int | None = None,
                       bias: bool = True, norm: str = "layer", activation: str = "relu",
                       sinks: bool = False) -> dict[str, Shape]:
    """State-dict names and shapes of TransformerBlock: attn.*, norm1 and norm2 (weight, and bias with
    norm="layer"), then ffn.0 (F, D) and ffn.3 (D, F), or with activation="swiglu" ffn.w_gate, ffn.w_up (F, D)
    and ffn.w_down (D, F); the Linears' biases unless bias is False; with sinks, attn.sinks (H,)."""
    attn = mha_state_shapes(d_model, num_heads, num_kv_heads, bias, sinks)
    norms = {f"{name}.{part}": (d_model,) for name in ("norm1", "norm2")
             for part in (("weight", "bias") if norm == "layer" else ("weight",))}
    linears = ({"w_gate": (d_ff, d_model), "w_up": (d_ff, d_model), "w_down": (d_model, d_ff)}
               if activation in GATED else {"0": (d_ff, d_model), "3": (d_model, d_ff)})
    return ({f"attn.{name}": shape for name, shape in attn.items()} | norms
            | {f"ffn.{name}": shape for name, shape in _linear_shapes(linears, bias).items()})


def _linear_shapes(linears: Mapping[str, Shape], bias: bool) -> dict[str, Shape]:
    """name.weight (out, in) and, with bias, name.bias (out,), for each name: (out, in)."""
    shapes: dict[str, Shape] = {}
    for name, (d_out, d_in) in linears.items():
        shapes[f"{name}.weight"] = (d_out, d_in)
        shapes |= {f"{name}.bias": (d_out,)} if bias else {}
    return shapes


def mha_layout(shapes: Mapping[str, Sequence[int]], num_heads: int, prefix: str = "") -> MhaLayout:
    """A MultiHeadAttention state's sizes and options, read off its shapes: d_model (w_q.weight's columns),
    num_kv_heads (w_k.weight's rows / d_k) and bias (whether any projection has one; validation.state then names
    those missing from a partial set), and sinks (whether it holds the sink logits). A shape that fits no Hkv gives
    Hkv = H, so that validation.state names it."""
    (d_model,) = state_widths(shapes, {f"{prefix}w_q.weight": 1})
    module_sizes(d_model, num_heads)
    d_k, rows = d_model // num_heads, _shape(shapes.get(f"{prefix}w_k.weight", (d_model,)))[0]
    fits = rows % d_k == 0 and rows > 0 and num_heads % (rows // d_k) == 0
    return MhaLayout(d_model=d_model, num_kv_heads=rows // d_k if fits else num_heads,
                     bias=any(f"{prefix}{name}.bias" in shapes for name in PROJECTIONS),
                     sinks=f"{prefix}sinks" in shapes)


def block_layout(shapes: Mapping[str, Sequence[int]], num_heads: int, activation_: str | None) -> BlockLayout:
    """A TransformerBlock state's sizes and options, read off its shapes as mha_layout does, and d_ff, norm
    ("rms" without norm1.bias) and the activation: whether the feed-forward is SwiGLU (ffn.w_gate, ffn.w_up,
    ffn.w_down), which `activation_` must agree with: "swiglu" or "swiglu_oss" for those entries, "relu" or
    "gelu" for ffn.0 and ffn.3; None takes "swiglu" or "relu" (the shapes cannot tell ReLU from GELU)."""
    swiglu = any(name.startswith(tuple(f"ffn.{linear}." for linear in SWIGLU)) for name in shapes)
    activation_ = ("swiglu" if swiglu else "relu") if activation_ is None else activation_
    activation(activation_)
    if swiglu != (activation_ in GATED):
        found = "ffn.w_gate, ffn.w_up and ffn.w_down (SwiGLU)" if swiglu else "ffn.0 and ffn.3"
        raise ValueError(f"TransformerBlock.from_state_dict: activation={activation_!r} does not match the state's "
                         f"feed-forward entries {found}; pass activation="
                         + ("'swiglu' or 'swiglu_oss'" if swiglu else "'relu' or 'gelu'"))
    layout = mha_layout(shapes, num_heads, "attn.")
    (d_ff,) = state_widths(shapes, {"ffn.w_gate.weight" if swiglu else "ffn.0.weight": 0})
    module_sizes(layout.d_model, num_heads, d_ff)
    ffn_bias = any(name.startswith("ffn.") and name.endswith(".bias") for name in shapes)
    return BlockLayout(d_model=layout.d_model, num_kv_heads=layout.num_kv_heads, bias=layout.bias or ffn_bias,
                       d_ff=d_ff, norm="layer" if "norm1.bias" in shapes else "rms", activation=activation_,
                       sinks=layout.sinks)


def state(cls_name: str, shapes: Mapping[str, Sequence[int]], expected: Mapping[str, Shape]) -> None:
    """Compare a state dict's entry shapes with the expected ones; name every missing, unexpected or
    mis-shaped entry in one error."""
    shapes = {name: _shape(shape) for name, shape in shapes.items()}
    problems = [f"missing {name} {expected[name]}" for name in expected if name not in shapes]
    problems += [f"unexpected {name} {shapes[name]}" for name in shapes if name not in expected]
    problems += [f"{name} has shape {shapes[name]}, expected {shape}"
                 for name, shape in expected.items() if name in shapes and shapes[name] != shape]
    if problems:
        raise ValueError(f"{cls_name}.from_state_dict: " + "; ".join(problems))


def state_widths(state_shapes: Mapping[str, Sequence[int]], names: Mapping[str, int]) -> list[int]:
    """Read sizes off a state dict: `names` maps an entry to the axis that holds the size."""
    widths = []
    for name, axis in names.items():
        if name not in state_shapes or len(state_shapes[name]) <= axis:
            raise ValueError(f"state dict needs {name} to infer the sizes; "
                             f"got entries {sorted(state_shapes)}")
        widths.append(int(state_shapes[name][axis]))
    return widths


# --- flex_attention and block masks --------------------------------------------------------------------------

def _positive_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool) and x > 0


def block_mask_args(mask_mod: object, B: object, H: object, Q_LEN: object, KV_LEN: object,
                    BLOCK_SIZE: object) -> tuple[int, int, tuple[int, int]]:
    """create_block_mask's arguments: a callable mask_mod; B and H positive ints or None (1: broadcast);
    Q_LEN and KV_LEN non-negative ints; BLOCK_SIZE a positive int or a pair (block_q, block_k) of them.
    Returns (B, H, (block_q, block_k))."""
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx) -> bool; got {type(mask_mod).__name__}")
    for name, n in (("B", B), ("H", H)):
        if n is not None and not _positive_int(n):
            raise ValueError(f"{name} must be None (broadcast) or a positive int; got {n!r}")
    for name, n in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not (isinstance(n, int | np.integer) and not isinstance(n, bool) and n >= 0):
            raise ValueError(f"{name} must be a non-negative int; got {n!r}")
    pair = tuple(BLOCK_SIZE) if isinstance(BLOCK_SIZE, tuple | list) else (BLOCK_SIZE, BLOCK_SIZE)
    if len(pair) != 2 or not all(_positive_int(size) for size in pair):
        raise ValueError(f"BLOCK_SIZE must be a positive int or a pair (block_q, block_k) of them; got {BLOCK_SIZE!r}")
    return 1 if B is None else int(B), 1 if H is None else int(H), (int(pair[0]), int(pair[1]))


def mask_mod_result(name: str, shape: Sequence[int], dtype: str, target: Sequence[int]) -> None:
    """What a mask function returned over a tile (B, H, block_q, block_k): booleans broadcasting to it."""
    if dtype != "bool" and not dtype.endswith(".bool"):  # NumPy's "bool", torch's "torch.bool"
        raise TypeError(f"{name} must return booleans (True: the query sees the key); got dtype {dtype}")
    if not _fits(_shape(shape), _shape(target)):
        raise ValueError(f"{name} returned shape {_shape(shape)}, which does not broadcast to the tile "
                         f"{_shape(target)} (B, H, block_q, block_k)")


def score_mod_result(shape: Sequence[int], target: Sequence[int]) -> None:
    """What a score function returned for a tile of scores (B, H, block_q, block_k): the tile's shape."""
    if _broadcast(_shape(shape), _shape(target)) != _shape(target):
        raise ValueError(f"score_mod returned shape {_shape(shape)} for scores of shape {_shape(target)} "
                         "(B, H, block_q, block_k): it must keep the scores' shape")


def flex_inputs(q: Sequence[int], k: Sequence[int], v: Sequence[int], enable_gqa: bool) -> tuple[int, int]:
    """flex_attention's q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev): four axes, the same B; Hkv = H, or
    with enable_gqa a divisor of it. Returns (B, H)."""
    q, k, v = _shape(q), _shape(k), _shape(v)
    for name, shape, letters in (("q", q, "B, H, L, E"), ("k", k, "B, Hkv, S, E"), ("v", v, "B, Hkv, S, Ev")):
        if len(shape) != 4:
            raise ValueError(f"flex_attention: {name} must have shape ({letters}); got {shape}")
    if q[3] != k[3] or k[2] != v[2]:  # the widths and lengths (B and H are not broadcast: checked below)
        raise ValueError(f"flex_attention: q {q} is (B, H, L, E), k {k} (B, Hkv, S, E) and v {v} (B, Hkv, S, Ev): "
                         "q and k must have the same width E, k and v the same length S")
    if not q[0] == k[0] == v[0]:
        raise ValueError(f"flex_attention: q {q}, k {k} and v {v} must have the same batch size B")
    if enable_gqa:
        grouped_heads(q, k, v)
    elif not q[1] == k[1] == v[1]:
        raise ValueError(f"flex_attention: q {q}, k {k} and v {v} must have the same number of heads H; with "
                         "fewer key/value heads pass enable_gqa=True")
    return q[0], q[1]


def block_mask_fits(block_mask: object, B: int, H: int, L: int, S: int) -> None:
    """A block mask made for scores (B', H', L, S), B' in (1, B) and H' in (1, H) (1: broadcast)."""
    shape = getattr(block_mask, "shape", None)
    if shape is None or not hasattr(block_mask, "tiles"):
        raise TypeError(f"block_mask must be a BlockMask from create_block_mask; got {type(block_mask).__name__}")
    mask_B, mask_H, mask_L, mask_S = shape
    if mask_B not in (1, B) or mask_H not in (1, H) or (mask_L, mask_S) != (L, S):
        raise ValueError(f"block_mask was made for scores {tuple(shape)} (B, H, L, S), which do not fit these "
                         f"scores {(B, H, L, S)}: make it with create_block_mask(mask_mod, {B}, {H}, {L}, {S})")


def mods_inputs(function: str, q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> tuple[int, int]:
    """q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) of an attention function given mask_mod, score_mod or
    block_mask: the mods index the scores by (b, h, q_idx, kv_idx), so each input has exactly four axes (B may
    broadcast, as elsewhere). Returns (B, H): the scores' batch size and q's heads, which b and h run over."""
    shapes = {"q": _shape(q), "k": _shape(k), "v": _shape(v)}
    if any(len(shape) != 4 for shape in shapes.values()):
        got = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{function}: mask_mod, score_mod and block_mask index the scores (B, H, L, S), so q, k and "
                         f"v must have four axes, (B, H, L, E), (B, Hkv, S, E) and (B, Hkv, S, Ev); got {got}")
    batch = _broadcast(*(shape[:1] for shape in shapes.values()))
    if batch is None:
        raise ValueError(f"{function}: q {shapes['q']}, k {shapes['k']} and v {shapes['v']} must have batch sizes "
                         "that broadcast")
    return batch[0], shapes["q"][1]


def flash_block_mask(block_mask: object, mask_mod: object, block_q: object, block_k: object,
                     scores: Sequence[int]) -> tuple[int, int]:
    """flash_attention's block_mask, for scores (B, H, L, S): a BlockMask that fits them (block_mask_fits),
    given without mask_mod (it carries its own), whose tiles are flash's: block_q and block_k None or equal to
    its BLOCK_SIZE. Returns its (block_q, block_k)."""
    if mask_mod is not None:
        raise ValueError("flash_attention: pass mask_mod or block_mask, not both: a block mask carries its mask "
                         "function (create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE))")
    block_mask_fits(block_mask, *scores)
    tiles = tuple(block_mask.block_size)  # type: ignore[attr-defined]
    if (block_q, block_k) != (None, None) and (block_q, block_k) != tiles:
        raise ValueError(f"flash_attention: with a block mask the tiles are its BLOCK_SIZE {tiles} (block_q, "
                         f"block_k); got block_q={block_q!r}, block_k={block_k!r}: leave them None")
    return tiles


def varlen_inputs(q: Sequence[int], k: Sequence[int], v: Sequence[int], bounds: Mapping[str, Sequence[int]],
                  enable_gqa: bool, block_size: object) -> None:
    """varlen_attention's packed q (Tq, H, E), k (Tk, Hkv, E), v (Tk, Hkv, Ev): three axes, q and k one width E,
    k and v one length Tk; Hkv = H, or with enable_gqa a divisor of it. cu_seqlens_q and cu_seqlens_k: one
    axis each, the same length N + 1 (N sequences). block_size None or a positive integer."""
    q, k, v = _shape(q), _shape(k), _shape(v)
    for name, shape, letters in (("q", q, "Tq, H, E"), ("k", k, "Tk, Hkv, E"), ("v", v, "Tk, Hkv, Ev")):
        if len(shape) != 3:
            raise ValueError(f"varlen_attention: {name} must have shape ({letters}), packed sequences; got {shape}")
    if q[2] != k[2] or k[0] != v[0]:
        raise ValueError(f"varlen_attention: q {q} is (Tq, H, E), k {k} (Tk, Hkv, E) and v {v} (Tk, Hkv, Ev): "
                         "q and k must have the same width E, k and v the same length Tk")
    H, Hkv = q[1], k[1]
    if v[1] != Hkv:
        raise ValueError(f"varlen_attention: k {k} (Tk, Hkv, E) and v {v} (Tk, Hkv, Ev) must have the same number "
                         "of heads Hkv")
    if enable_gqa and (Hkv == 0 or H % Hkv):
        raise ValueError(f"varlen_attention: enable_gqa: the H = {H} query heads must be a multiple of the Hkv = "
                         f"{Hkv} key/value heads; q {q} is (Tq, H, E), k {k} is (Tk, Hkv, E)")
    if not enable_gqa and Hkv != H:
        raise ValueError(f"varlen_attention: q {q} and k {k} must have the same number of heads H; with fewer "
                         "key/value heads pass enable_gqa=True")
    shapes = {name: _shape(shape) for name, shape in bounds.items()}
    if any(len(shape) != 1 for shape in shapes.values()) or len(set(shapes.values())) != 1:
        got = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"varlen_attention: cu_seqlens_q and cu_seqlens_k must both have shape (N + 1,), the "
                         f"boundaries of the same N sequences; got {got}")
    if block_size is not None and not _positive_int(block_size):
        raise ValueError(f"varlen_attention: block_size must be None or a positive integer; got {block_size!r}")


def varlen_bounds(name: str, bounds: np.ndarray, total: int, max_seqlen: object) -> None:
    """cu_seqlens (N + 1,) of packed sequences along an axis of `total` positions: integers, starting at 0,
    never decreasing (a sequence may be empty), at most `total` at the end; each sequence at most `max_seqlen`
    long, a non-negative int. The values are read here, so a backend calls it with concrete boundaries only."""
    axis = "Tq" if name.endswith("_q") else "Tk"
    longest = f"max_seqlen{name[len('cu_seqlens'):]}"
    if not (isinstance(max_seqlen, int | np.integer) and not isinstance(max_seqlen, bool) and max_seqlen >= 0):
        raise ValueError(f"varlen_attention: {longest} must be a non-negative int; got {max_seqlen!r}")
    if not np.issubdtype(bounds.dtype, np.integer):
        raise TypeError(f"varlen_attention: {name} must be an integer array; got dtype {bounds.dtype}")
    values = bounds.tolist()
    if values[0] != 0:
        raise ValueError(f"varlen_attention: {name} must start at 0; got {values[:4]}...")
    lengths = np.diff(bounds)
    if (lengths < 0).any():
        n = int(np.argmax(lengths < 0))
        raise ValueError(f"varlen_attention: {name} must not decrease; {name}[{n}] = {values[n]} > "
                         f"{name}[{n + 1}] = {values[n + 1]}")
    if values[-1] > total:
        raise ValueError(f"varlen_attention: {name} ends at {values[-1]}, past the {total} packed positions "
                         f"({axis} = {total})")
    if lengths.size and lengths.max() > max_seqlen:
        n = int(np.argmax(lengths))
        raise ValueError(f"varlen_attention: sequence {n} has {int(lengths[n])} positions in {name}, more than "
                         f"{longest} = {max_seqlen}")


def paged_sizes(batch_size: object, num_pages: object, page_size: object, max_pages: object) -> None:
    """init_paged_cache: batch_size and num_pages non-negative ints, page_size and max_pages positive ones."""
    for name, n, least in (("batch_size", batch_size, 0), ("num_pages", num_pages, 0), ("page_size", page_size, 1),
                           ("max_pages", max_pages, 1)):
        if not (isinstance(n, int | np.integer) and not isinstance(n, bool) and n >= least):
            raise ValueError(f"{name} must be an int >= {least}; got {n!r}")


def block_table(table: np.ndarray, num_pages: int) -> None:
    """extend over a paged cache: every entry of the block table (B, max_pages) names a page of the pool,
    0 .. num_pages - 1, or is -1 (no page)."""
    bad = (table < -1) | (table >= num_pages)
    if bad.any():
        b, block = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_table {tuple(table.shape)} must hold pages of the pool, 0 .. {num_pages - 1} "
                         f"(num_pages = {num_pages}), or -1 for none; got {int(table[b, block])} at sequence {b}, "
                         f"block {block}")


def pages_reserved(block_table: np.ndarray, length: np.ndarray, new: np.ndarray, page: int) -> None:
    """extend over a paged cache: every position it writes, length[b] .. length[b] + new[b] - 1, lies in a page the
    block table holds (cache.reserve(new_lengths) first)."""
    for b, (start, count) in enumerate(zip(length.tolist(), new.tolist(), strict=True)):
        blocks = range(start // page, -(-(start + count) // page))
        missing = [block for block in blocks if block_table[b, block] < 0]
        if missing:
            raise ValueError(f"sequence {b} has no page for its positions {start} .. {start + count - 1} (block "
                             f"{missing[0]} of its block table is -1): call cache.reserve(new_lengths) before extend")


def paged_options(mask_mod: object, score_mod: object, dropout_p: float) -> None:
    """extend over a paged cache takes neither mods nor dropout (yet): refused, never ignored."""
    for name, given in (("mask_mod", mask_mod is not None), ("score_mod", score_mod is not None),
                        ("dropout", dropout_p > 0)):
        if given:
            raise ValueError(f"extend over a PagedKVCache takes no {name}: use the module in eval mode (or dropout 0) "
                             "without mask_mod and score_mod, or a KVCache")


ROPE_POSITIONS = ("original", "cache")  # a streaming cache's RoPE positions (SPEC 3c)


def streaming_sizes(capacity: int, sink_tokens: object, window: object, rope_positions: object) -> bool:
    """init_cache: a streaming cache (window given) keeps sink_tokens >= 0 first positions and the last
    window >= 1 in sink_tokens + window <= capacity slots; returns whether the cache streams (window given)."""
    if window is None:
        for name, value, default in (("sink_tokens", sink_tokens, 0), ("rope_positions", rope_positions, "original")):
            if value != default:
                raise ValueError(f"{name}={value!r} needs window (a streaming cache); got window=None")
        return False

    def count(n: object) -> bool:
        return isinstance(n, int | np.integer) and not isinstance(n, bool)
    if not count(window) or window < 1:
        raise ValueError(f"window must be a positive int (the last positions a streaming cache keeps); got {window!r}")
    if not count(sink_tokens) or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be a non-negative int (the first positions a streaming cache keeps "
                         f"forever); got {sink_tokens!r}")
    if sink_tokens + window > capacity:
        raise ValueError(f"sink_tokens + window must fit the capacity: sink_tokens={sink_tokens} + window={window} "
                         f"= {sink_tokens + window} slots, capacity={capacity}")
    if rope_positions not in ROPE_POSITIONS:
        raise ValueError(f"rope_positions must be one of {ROPE_POSITIONS}; got {rope_positions!r}")
    return True


def streaming_step(rows: int, window: int, new_lengths: object, length_shape: Shape, mask: object, mask_mod: object,
                   score_mod: object) -> None:
    """extend over a streaming cache: a chunk of at most `window` rows, every sequence as long, no mask or mods."""
    if rows > window:
        raise ValueError(f"extend over a streaming cache takes at most window={window} new positions at once; got "
                         f"L={rows} (its early rows' slots would be overwritten by its later rows): extend in chunks "
                         f"of at most {window}")
    if new_lengths is not None or tuple(length_shape) != ():
        raise ValueError("extend over a streaming cache (sink_tokens, window) takes no new_lengths and needs an int "
                         f"length, every sequence as long; got new_lengths={'None' if new_lengths is None else 'given'}"
                         f" and a length of shape {tuple(length_shape)}")
    for name, given in (("mask", mask), ("mask_mod", mask_mod), ("score_mod", score_mod)):
        if given is not None:
            raise ValueError(f"extend over a streaming cache takes no {name}: its mask is the streaming rule "
                             "(SPEC 3c), j < sink_tokens or p - window < j <= p")


def latent_sizes(d_model: object, num_heads: object, *, q_lora_rank: object, kv_lora_rank: object,
                 qk_nope_head_dim: object, qk_rope_head_dim: object, v_head_dim: object) -> LatentSizes:
    """MultiHeadLatentAttention's sizes: positive ints (q_lora_rank may be None: no query latent), and
    qk_rope_head_dim even, as RoPE turns pairs of entries. Returns them as a record."""
    sizes = {"d_model": d_model, "num_heads": num_heads, "q_lora_rank": q_lora_rank, "kv_lora_rank": kv_lora_rank,
             "qk_nope_head_dim": qk_nope_head_dim, "qk_rope_head_dim": qk_rope_head_dim, "v_head_dim": v_head_dim}
    for name, size in sizes.items():
        if name == "q_lora_rank" and size is None:
            continue
        if not (isinstance(size, int | np.integer) and not isinstance(size, bool) and size > 0):
            raise ValueError(f"{name} must be a positive integer{' or None' if name == 'q_lora_rank' else ''}; "
                             f"got {size!r}")
    if qk_rope_head_dim % 2:  # type: ignore[operator]
        raise ValueError(f"qk_rope_head_dim must be even: RoPE turns pairs of entries; got {qk_rope_head_dim}")
    return LatentSizes(**{name: None if size is None else int(size) for name, size in sizes.items()})


def latent_theta(theta: object) -> float:
    """MultiHeadLatentAttention's rope_theta: a positive finite number (its RoPE is not optional)."""
    if not _positive_finite(theta):
        raise ValueError(f"rope_theta must be a positive finite number; got {theta!r}")
    return float(theta)  # type: ignore[arg-type]


def latent_state_shapes(sizes: LatentSizes) -> dict[str, Shape]:
    """State-dict names and shapes of MultiHeadLatentAttention, DeepSeek-V3's (nn.Linear layout: weight (out,
    in), no biases): q_a_proj (Dq, D), q_a_layernorm (Dq,), q_b_proj (H (En + Er), Dq), or q_proj (H (En + Er), D)
    without a query latent; kv_a_proj_with_mqa (Dc + Er, D), kv_a_layernorm (Dc,), kv_b_proj (H (En + Ev), Dc),
    o_proj (D, H Ev)."""
    D, H, Dq, Dc = sizes.d_model, sizes.num_heads, sizes.q_lora_rank, sizes.kv_lora_rank
    E = sizes.qk_nope_head_dim + sizes.qk_rope_head_dim
    if Dq is None:
        queries = {"q_proj.weight": (H * E, D)}
    else:
        queries = {"q_a_proj.weight": (Dq, D), "q_a_layernorm.weight": (Dq,), "q_b_proj.weight": (H * E, Dq)}
    return queries | {"kv_a_proj_with_mqa.weight": (Dc + sizes.qk_rope_head_dim, D), "kv_a_layernorm.weight": (Dc,),
                      "kv_b_proj.weight": (H * (sizes.qk_nope_head_dim + sizes.v_head_dim), Dc),
                      "o_proj.weight": (D, H * sizes.v_head_dim)}


def latent_d_ff(d_ff: int) -> int:
    """LatentTransformerBlock's d_ff: a positive integer."""
    if not _positive_int(d_ff):
        raise ValueError(f"d_ff must be a positive integer; got {d_ff!r}")
    return int(d_ff)


def latent_block_state_shapes(sizes: LatentSizes, d_ff: int) -> dict[str, Shape]:
    """State-dict names and shapes of LatentTransformerBlock: attn.* as latent_state_shapes, norm1 and norm2 (D,),
    ffn.w_gate and ffn.w_up (F, D), ffn.w_down (D, F), no biases."""
    D = sizes.d_model
    return ({f"attn.{name}": shape for name, shape in latent_state_shapes(sizes).items()}
            | {"norm1.weight": (D,), "norm2.weight": (D,), "ffn.w_gate.weight": (d_ff, D), "ffn.w_up.weight": (d_ff, D),
               "ffn.w_down.weight": (D, d_ff)})


def latent_block_layout(shapes: Mapping[str, Sequence[int]], num_heads: int) -> tuple[LatentSizes, int]:
    """A LatentTransformerBlock state's sizes: the attention's (latent_layout on attn.*) and F from ffn.w_gate's
    rows; validation.state then compares every entry with latent_block_state_shapes."""
    (d_ff,) = state_widths(shapes, {"ffn.w_gate.weight": 0})
    attention = {name.removeprefix("attn."): shape for name, shape in shapes.items() if name.startswith("attn.")}
    return latent_layout(attention, num_heads), d_ff


def latent_layout(shapes: Mapping[str, Sequence[int]], num_heads: int) -> LatentSizes:
    """A MultiHeadLatentAttention state's sizes, read off its shapes: D and Dc + Er from kv_a_proj_with_mqa, Dc
    from kv_a_layernorm, Dq from q_a_proj (None with q_proj instead), Ev from o_proj's columns / H, En from
    kv_b_proj's rows / H - Ev. validation.state then compares every entry with the shapes these sizes give."""
    missing = [name for name in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                                 "o_proj.weight") if name not in shapes]
    if "q_proj.weight" not in shapes and "q_a_proj.weight" not in shapes:
        missing.append("q_a_proj.weight (or q_proj.weight)")
    if missing:
        raise ValueError(f"MultiHeadLatentAttention.from_state_dict: missing {', '.join(missing)}")
    rows, d_model = _shape(shapes["kv_a_proj_with_mqa.weight"])
    (kv_lora_rank,) = _shape(shapes["kv_a_layernorm.weight"])
    v_rows = _shape(shapes["o_proj.weight"])[-1]
    if not (isinstance(num_heads, int | np.integer) and num_heads > 0):
        raise ValueError(f"num_heads must be a positive integer; got {num_heads!r}")
    if v_rows % num_heads or _shape(shapes["kv_b_proj.weight"])[0] % num_heads:
        raise ValueError(f"MultiHeadLatentAttention.from_state_dict: o_proj.weight {_shape(shapes['o_proj.weight'])} "
                         f"and kv_b_proj.weight {_shape(shapes['kv_b_proj.weight'])} must have H = num_heads = "
                         f"{num_heads} heads' widths")
    v_head_dim = v_rows // num_heads
    q_lora_rank = _shape(shapes["q_a_proj.weight"])[0] if "q_a_proj.weight" in shapes else None
    return latent_sizes(d_model, num_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                        qk_nope_head_dim=_shape(shapes["kv_b_proj.weight"])[0] // num_heads - v_head_dim,
                        qk_rope_head_dim=rows - kv_lora_rank, v_head_dim=v_head_dim)


def latent_cache_input(x: Sequence[int], c_kv: Sequence[int], d_model: int) -> int:
    """MultiHeadLatentAttention.extend: x (..., L, D) with the cache's leading axes (...), the cache's latents
    c_kv (..., capacity, Dc). Returns L."""
    x, c_kv = _shape(x), _shape(c_kv)
    if len(x) < 2 or x[-1] != d_model or x[:-2] != c_kv[:-2]:
        raise ValueError(f"x must have shape (..., L, D) with the cache's leading axes (...) = {c_kv[:-2]} and D = "
                         f"d_model = {d_model}; got {x} (the cache's c_kv is {c_kv})")
    return x[-2]
