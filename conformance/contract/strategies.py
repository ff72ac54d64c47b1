"""Hypothesis strategies for the conformance suite: random inputs of sdpa, multi-head attention and the
transformer block (the cases that random draws rarely hit are pinned in conformance/contract/fixed_cases.py).

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

JAX compiles once per distinct shape (and per static argument), so every size comes from a few fixed
values: L, S mostly in 1..5, and about one draw in eight from LONG_LENGTHS (8 to 65, at and just above
powers of two: tile, chunk and vector-width boundaries); E, Ev in {1, 2, 4}; H in 1..4 with d_k in {1, 2},
so D = H * d_k <= 8; F in {4, 8}; leading axes (), (2,) or (2, 3) (grouped-query sdpa cases: the last one
H in {2, 4} query heads, Hkv in {1, H / 2, H} for k and v); scale, dropout and eps from short fixed lists. The
keywords of one value per head (sinks, alibi_slopes: `per_head`) are arrays, which JAX traces, each in about one
case of three of the operations whose options name it (sdpa's and flash's positioned cases, ring's and flex's).
About one module case in three (OPTIONED) draws the module options of SPEC 5 (num_kv_heads among the divisors
of H, bias, rope_theta with d_k = 4; in MultiHeadAttention also attention "linear", one in four, without a mask
and dropout, causal in one of two in self-attention; in the block also norm and activation "swiglu"); the rest
keep the seed's layout, so JAX compiles few new shapes. A causal linear case takes an update rule of ONNX's
(gated, delta, gated_delta) in one case of two, its decay and beta from short spans, the delta rules on unit keys.

Hypothesis draws every shape, flag and mask family, so it can shrink them; the numbers come from a NumPy
Generator seeded by one drawn integer (fast, and the seed is part of the example). Floating arrays are
float64 NumPy arrays (a suite casts them); masks are bool or 0/1 integers and keep their dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st

from attention_np.common import keywords, mods

from .cases import (
    LARGE,
    RING_DEVICES,
    SMALL,
    Batch,
    BlockCase,
    DecodeCase,
    FlashCase,
    FlexCase,
    LinearCase,
    MhaCase,
    MlaCase,
    Paging,
    RingCase,
    SdpaCase,
    State,
    Streaming,
    VarlenCase,
    block_state,
    mha_state,
    mla_state,
    tiled,
)
from .operations import OPERATIONS

BATCH_SHAPES: tuple[Batch, ...] = ((), (2,), (2, 3))
LENGTHS = (1, 2, 3, 4, 5)  # L and S, most draws
LONG_LENGTHS = (8, 9, 16, 17, 32, 33, 64, 65)  # L and S, about one draw in eight: past a tile, a remainder
SHORT_WEIGHT = 12  # each short length this many times as likely as each long one
WIDTHS = (1, 2, 4)  # E and Ev
HEADS = (1, 2, 3, 4)
D_K = (1, 2)  # D = H * d_k
D_FF = (4, 8)
SCALES = (None, 0.0, 1e-3, 0.125, 0.37, 1.0, 2.5, 10.0)  # None: 1 / sqrt(E); 0 and the extremes on purpose
DROPOUTS = (0.0, 0.1, 0.5)
EPSILONS = (1e-5, 1e-6, 1e-3)
ACTIVATIONS = ("relu", "gelu")
OPTIONED = (False, False, True)  # about one mha or block case in three draws the module options of SPEC 5
OPTIONED_HEADS = (4, 2, 3, 1)  # H of an optioned case: 4 first, for Hkv = 2 of 4
NORMS = ("layer", "rms")
OPTIONED_ACTIVATIONS = ("relu", "gelu", "swiglu", "swiglu")  # swiglu in half of the optioned blocks
ROPE_THETAS = (None, None, 10.0, 10000.0)  # an optioned case's rope_theta: RoPE in half of them
ROPE_D_K = 4  # d_k with RoPE: two pairs per head, so their layout and theta matter (one pair turns by p alone)
ATTENTIONS = ("softmax", "softmax", "softmax", "linear")  # an optioned mha case's heads: linear in one in four
MHA_SINKS = (False, True)  # an optioned mha case of softmax heads: sinks=True (the state's sinks (H,)) in one of two
MHA_POSITIONS = (None, "alibi")  # an optioned mha case of softmax heads without RoPE: ALiBi in one of two
MHA_SINK_FLOOR = -1e4  # in one sinks=True case of two, a share HIDDEN_SINK of the sinks this far below (finite)
MASK_DTYPES = ("bool", "int32", "int64")
MAGNITUDES = ("normal", "large", "small_variance")
HIDDEN = 0.3  # share of keys a random mask hides
BIAS_MAGNITUDES = ("normal", "large", "offset")
LARGE_BIAS = 1000.0  # "large" biases: N(0, 1) * LARGE_BIAS, hundreds to thousands
OFFSETS = (1e4, 1e5)  # "offset" biases: each row shifted by -U(1e4, 1e5), below masked-fill constants
KEY_OFFSET = 300.0  # the size of the vector that key_offset adds to every key
POSITIONED = (False, False, True)  # about one sdpa case in three draws the keywords of SPEC 2a
OFFSET_FORMS = ("zero", "int", "array")  # q_offset: the default, a Python int (static), one per sequence
WINDOW_SIDES = (None, 0, 1, 3)  # each side of a window: unbounded, the query's own key, one, three
SOFTCAPS = (0.5, 1.0, 5.0, 50.0)  # 0.5 and 1 saturate ordinary logits; 50 barely touches them
GROUPED = (False, True)  # about one positioned sdpa case in two uses enable_gqa
MODS_RATE = 3  # about one sdpa or flash case in three passes mods (four axes, the flex sizes)
TILE_SIZES = (1, 2, 3, 4, 5, 6, 7)  # block_q and block_k of a flash case: short sequences cross their boundaries
RING_CHUNK_ROWS = (1, 2, 3)  # the rows of one chunk of a ring case: L = P n (2P n with is_causal), S likewise
QUERY_HEADS = (2, 4)  # H of an enable_gqa case; its key/value heads Hkv are 1, H / 2 or H
FEATURE_MAPS = ("elu", "relu", "identity")  # linear attention's phi
CHUNKS = (1, 2, 3, 4, 5, 6, 7)  # a causal linear case's chunk: one drawn that does not divide L (or 1)
LINEAR_EPSILONS = (1e-6, 1e-3, 1.0)  # the default; one that matters for small weights; one as large as they are
PER_HEAD_RATE = 3  # each keyword of one value per head (sinks, alibi_slopes) in about one case of three that take it
SINK_FORMS = ("head", "sequence", "scalar")  # sinks (H,), one per sequence and head (..., H), or one for all ()
SINK_SCALE = 3.0  # sinks N(0, 1) * SINK_SCALE: from far below a row's logits (no effect) to far above (most weight)
HIDDEN_SINK = 0.25  # share of the sinks set to -inf (no sink) in one case of two
SLOPE_FORMS = ("geometric", "head", "sequence")  # alibi_slopes: BLOOM's 2^(-8h/H), or U(0, 1) (H,) or (B, H)
OVERFLOW_LENGTHS = (512, 513)  # L = S of a linear case past float16's range: q and k LARGE, so phi(q_i) . z_i
# (hundreds of keys of features near 15) passes 65504, and a float16 prefix sum stalls (its spacing passes 2)
UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")  # a causal linear case's rule: "linear" in one of two
RULE_WEIGHTS = (3, 1, 1, 1)  # how many times each rule stands in the list a causal case draws from
DECAY_WIDTHS = (1, "E")  # a gated rule's decay (..., S, 1), one per head, or (..., S, E), one per key dimension
DECAY_SPAN = (0.02, 0.5)  # -g uniform in it: exp(g) from 0.61 to 0.98 per position, far from float16's spacing
BETA_SPAN = (0.1, 0.9)  # beta uniform in it
DELTA_MAPS = ("identity", "identity", "relu")  # the delta rules' phi, on unit keys: |phi(k)| <= 1

SEEDS = st.integers(0, 2**32 - 1)


class LabelledMask(NamedTuple):
    """A drawn mask and the MASK_FAMILIES name that made it, for coverage checks."""

    family: str
    mask: np.ndarray | None


# --- sizes and numbers -------------------------------------------------------------------------------------

def batch_shapes() -> st.SearchStrategy[Batch]:
    """Leading axes: none, (2,) or (2, 3)."""
    return st.sampled_from(BATCH_SHAPES)


def lengths(*, exclude: int | None = None, long: bool = True) -> st.SearchStrategy[int]:
    """A sequence length (not `exclude`): each of LENGTHS SHORT_WEIGHT times as likely as each of LONG_LENGTHS,
    so about one length in eight is long; shrinks towards 1. long=False: LENGTHS only (the dropout checks,
    which repeat each case hundreds of times)."""
    return st.sampled_from([n for n in LENGTHS * SHORT_WEIGHT + (LONG_LENGTHS if long else ()) if n != exclude])


def _rng(draw: Callable) -> np.random.Generator:
    return np.random.default_rng(draw(SEEDS))


def _values(rng: np.random.Generator, shape: Batch, magnitude: str) -> np.ndarray:
    """normal: N(0, 1); large: LARGE * N(0, 1); small_variance: c + SMALL * N(0, 1), c ~ N(0, 1) per row."""
    noise = rng.standard_normal(shape)  # (..., width)
    if magnitude == "normal":
        return noise
    if magnitude == "large":
        return LARGE * noise
    if magnitude == "small_variance":
        return rng.standard_normal((*shape[:-1], 1)) + SMALL * noise  # (..., 1) + (..., width)
    raise ValueError(f"magnitude must be one of {MAGNITUDES}; got {magnitude!r}")


# --- masks -------------------------------------------------------------------------------------------------
# Each family is a strategy factory (batch, L, S, heads) -> bool mask (or None) that broadcasts to the
# scores' shape (..., L, S), or (..., H, L, S) when heads is given, without adding axes.

def _target(batch: Batch, L: int, S: int, heads: int | None) -> Batch:
    """The scores' shape a mask must broadcast to."""
    return (*batch, L, S) if heads is None else (*batch, heads, L, S)


def _random(rng: np.random.Generator, shape: Batch) -> np.ndarray:
    return rng.random(shape) >= HIDDEN  # about 30% hidden


def _no_mask(batch: Batch, L: int, S: int, heads: int | None) -> st.SearchStrategy[None]:
    return st.none()


@st.composite
def _random_mask(draw: Callable, batch: Batch, L: int, S: int, heads: int | None) -> np.ndarray:
    """Each key hidden independently with probability HIDDEN."""
    return _random(_rng(draw), _target(batch, L, S, heads))  # (..., [H,] L, S)


def _causal_mask(batch: Batch, L: int, S: int, heads: int | None) -> st.SearchStrategy[np.ndarray]:
    """tril(L, S): query i sees keys 0..i, top-left aligned, shared by every sequence and head."""
    return st.builds(lambda: np.tri(L, S, dtype=bool))  # (L, S), a fresh array each draw


@st.composite
def _padding_mask(draw: Callable, batch: Batch, L: int, S: int, heads: int | None) -> np.ndarray:
    """Key padding: sequence b sees its first lengths[b] keys, lengths in 0..S (0 hides every key)."""
    n, ones = math.prod(batch), (1, 1) if heads is None else (1, 1, 1)
    lengths = draw(st.lists(st.integers(0, S), min_size=n, max_size=n))
    return np.arange(S) < np.reshape(lengths, (*batch, *ones))  # (..., [1,] 1, 1) -> (..., [1,] 1, S)


def _all_visible_mask(batch: Batch, L: int, S: int, heads: int | None) -> st.SearchStrategy[np.ndarray]:
    """Every key visible: the same as no mask."""
    return st.builds(lambda: np.ones(_target(batch, L, S, heads), bool))  # (..., [H,] L, S)


@st.composite
def _fully_masked_rows_mask(draw: Callable, batch: Batch, L: int, S: int, heads: int | None) -> np.ndarray:
    """Random, then one or two query rows (of any sequence and head) hide every key."""
    shape = _target(batch, L, S, heads)
    n_rows = math.prod(shape[:-1])
    rows = draw(st.sets(st.integers(0, n_rows - 1), min_size=1, max_size=min(2, n_rows)))
    mask = _random(_rng(draw), shape).reshape(n_rows, S)  # (..., [H,] L, S) -> (... * [H *] L, S)
    mask[sorted(rows)] = False
    return mask.reshape(shape)


@st.composite
def _fully_masked_head_mask(draw: Callable, batch: Batch, L: int, S: int, heads: int | None) -> np.ndarray:
    """Random, then head h hides every key from every query; needs heads."""
    mask = _random(_rng(draw), _target(batch, L, S, heads))  # (..., H, L, S)
    mask[..., draw(st.integers(0, heads - 1)), :, :] = False
    return mask


@st.composite
def _fully_masked_batch_element_mask(draw: Callable, batch: Batch, L: int, S: int,
                                     heads: int | None) -> np.ndarray:
    """Random, then one batch element hides every key everywhere (with no batch axes: the whole mask)."""
    mask = _random(_rng(draw), _target(batch, L, S, heads))  # (..., [H,] L, S)
    mask[draw(st.tuples(*(st.integers(0, n - 1) for n in batch)))] = False  # index () is the whole mask
    return mask


@st.composite
def _one_visible_key_mask(draw: Callable, batch: Batch, L: int, S: int, heads: int | None, *,
                          causal: bool = False) -> np.ndarray:
    """Exactly one visible key per query row; with causal, chosen in the causal window 0..min(i, S - 1)."""
    shape = _target(batch, L, S, heads)
    window = np.minimum(np.arange(L), S - 1) + 1 if causal else np.full(L, S)  # (L,) keys row i may see
    j = (_rng(draw).random(shape[:-1]) * window).astype(np.int64)  # (..., [H,] L), j < window
    return np.arange(S) == j[..., None]  # (S,) == (..., [H,] L, 1) -> (..., [H,] L, S)


@st.composite
def _stored_shape(draw: Callable, shape: Batch) -> Batch:
    """A shape that broadcasts to `shape` without adding axes: rank 1 to len(shape), drawn evenly, each axis
    but the last either its full size or 1; e.g. (S,), (1, S), (L, S), (1, H, 1, S) for (B, H, L, S)."""
    rank = draw(st.integers(1, len(shape)))
    stored = shape[len(shape) - rank:]
    ones = draw(st.lists(st.booleans(), min_size=rank - 1, max_size=rank - 1))
    return (*(1 if one else n for one, n in zip(ones, stored[:-1], strict=True)), stored[-1])


@st.composite
def _broadcast_mask(draw: Callable, batch: Batch, L: int, S: int, heads: int | None) -> np.ndarray:
    """Random, stored with fewer axes or axes of size 1: every rank from 1 to the full one (S stays)."""
    shape = _target(batch, L, S, heads)
    stored = draw(_stored_shape(shape))
    if stored == shape:  # nothing reduced: drop the first axis
        stored = stored[1:]
    return _random(_rng(draw), stored)  # e.g. (1, [H,] L, S), ([H,] 1, S), (S,)


MaskFamily = Callable[[Batch, int, int, int | None], st.SearchStrategy]

# Every kind of mask `masks` draws, by name. "none" comes first, so Hypothesis shrinks towards no mask.
MASK_FAMILIES: dict[str, MaskFamily] = {
    "none": _no_mask,
    "random": _random_mask,
    "causal": _causal_mask,
    "padding": _padding_mask,
    "all_visible": _all_visible_mask,
    "fully_masked_rows": _fully_masked_rows_mask,
    "fully_masked_head": _fully_masked_head_mask,  # only with heads
    "fully_masked_batch_element": _fully_masked_batch_element_mask,
    "one_visible_key": _one_visible_key_mask,
    "broadcast": _broadcast_mask,
}
MASKED_FAMILIES = tuple(name for name in MASK_FAMILIES if name != "none")  # those that give an array


def labelled_masks(batch: Batch, L: int, S: int, *, heads: int | None = None,
                   families: Sequence[str] | None = None) -> st.SearchStrategy[LabelledMask]:
    """A mask from one of `families` (default: all of MASK_FAMILIES) with its family's name; the array
    is bool, int32 or int64 (0/1), broadcasting to (..., L, S), or (..., H, L, S) with heads.
    "fully_masked_head" applies only with heads; a ValueError when no family applies."""
    names = [name for name in (families or MASK_FAMILIES) if heads is not None or name != "fully_masked_head"]
    if not names:
        raise ValueError(f"no mask family applies: families={families}, heads={heads}")
    return _labelled_masks(batch, L, S, heads, names)


@st.composite
def _labelled_masks(draw: Callable, batch: Batch, L: int, S: int, heads: int | None,
                    names: list[str]) -> LabelledMask:
    family = draw(st.sampled_from(names))
    mask = draw(MASK_FAMILIES[family](batch, L, S, heads))
    return LabelledMask(family, None if mask is None else _cast_mask(draw, mask))


def masks(batch: Batch, L: int, S: int, *, heads: int | None = None,
          families: Sequence[str] | None = None) -> st.SearchStrategy[np.ndarray | None]:
    """A mask (or None) from one of `families`; see labelled_masks."""
    return labelled_masks(batch, L, S, heads=heads, families=families).map(lambda labelled: labelled.mask)


def _cast_mask(draw: Callable, mask: np.ndarray) -> np.ndarray:
    """Boolean and 0/1 integer masks are the same mask (SPEC 2)."""
    return mask.astype(draw(st.sampled_from(MASK_DTYPES)))


# --- biases ------------------------------------------------------------------------------------------------

@st.composite
def biases(draw: Callable, batch: Batch, L: int, S: int, *, allow_none: bool = True) -> np.ndarray | None:
    """None (if allowed), or finite values with about 20% -inf (hidden keys) and sometimes a whole row -inf;
    of every rank from 1 to that of the scores (..., L, S), each axis but S full or 1. The finite values
    are drawn from BIAS_MAGNITUDES: "normal" N(0, 1); "large" LARGE_BIAS * N(0, 1), which decides the row
    maximum alone; "offset" N(0, 1) - c, c ~ U(1e4, 1e5) per row, so every visible score of a row lies
    tens of thousands below zero, under the constants a masked fill would use (-1e4)."""
    if allow_none and not draw(st.booleans()):
        return None
    shape, magnitude = draw(_stored_shape((*batch, L, S))), draw(st.sampled_from(BIAS_MAGNITUDES))
    rng = _rng(draw)
    bias = rng.standard_normal(shape)  # (..., L, S) or fewer axes
    if magnitude == "large":
        bias *= LARGE_BIAS
    elif magnitude == "offset":
        bias -= rng.uniform(*OFFSETS, (*shape[:-1], 1))  # (..., L, 1): one shift per row
    bias[rng.random(shape) < 0.2] = -np.inf
    if draw(st.booleans()):  # one query row sees no key through the bias alone
        n_rows = math.prod(shape[:-1])
        bias.reshape(n_rows, S)[draw(st.integers(0, n_rows - 1))] = -np.inf  # a view: (... * L, S)
    return bias


def _finite_where_visible(bias: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The bias with 0 instead of -inf wherever the mask keeps the key, so the bias hides nothing more."""
    visible = True if mask is None else np.asarray(mask) != 0
    return np.where(np.isneginf(bias) & visible, 0.0, bias)  # broadcast of the two shapes


# --- positions, windows, key lengths and soft-capping (SPEC 2a) ------------------------------------------

def offsets(L: int, S: int) -> tuple[int, ...]:
    """q_offset's values: S - L (bottom-right causal), negative (rows that see no key when causal), small,
    and at or past the last key."""
    return (S - L, -S, -1, 1, S, S + L)


def key_lengths(S: int) -> tuple[int, ...]:
    """key_lengths' values: 0 hides every key, S or more none."""
    return (0, 1, S // 2, S, S + 2)


@st.composite
def _per_sequence(draw: Callable, batch: Batch, values: Sequence[int]) -> np.ndarray:
    """int64 (...) broadcasting to `batch` without adding axes (rank 0 to len(batch), each axis full or 1),
    each entry one of `values`."""
    rank = draw(st.integers(0, len(batch)))
    shape = tuple(n if draw(st.booleans()) else 1 for n in batch[len(batch) - rank:])
    n = math.prod(shape)
    return np.reshape(draw(st.lists(st.sampled_from(values), min_size=n, max_size=n)), shape).astype(np.int64)


def _q_offsets(batch: Batch, L: int, S: int) -> st.SearchStrategy:
    """q_offset in OFFSET_FORMS: the default, a Python int of `offsets`, or one per sequence."""
    return st.sampled_from(OFFSET_FORMS).flatmap(
        lambda form: st.just(0) if form == "zero" else st.sampled_from(offsets(L, S)) if form == "int"
        else _per_sequence(batch, offsets(L, S)))


# How a case draws each keyword of SPEC 2a (keywords.POSITIONS, read from the one table): {keyword: (batch, L, S)
# -> strategy}. enable_gqa is drawn with the heads (`grouped_heads`); a keyword added to the table without a drawer
# here fails every positioned draw (KeyError), so none is left undrawn.
POSITION_DRAWERS: dict[str, Callable[[Batch, int, int], st.SearchStrategy]] = {
    "q_offset": _q_offsets,
    "window": lambda batch, L, S: st.none() | st.tuples(st.sampled_from(WINDOW_SIDES), st.sampled_from(WINDOW_SIDES)),
    "key_lengths": lambda batch, L, S: st.none() | _per_sequence(batch, key_lengths(S)),
    "softcap": lambda batch, L, S: st.none() | st.sampled_from(SOFTCAPS),
}
DRAWN_WITH_HEADS = ("enable_gqa",)  # keywords of POSITIONS that `grouped_heads` decides


@st.composite
def positions(draw: Callable, batch: Batch, L: int, S: int) -> dict[str, Any]:
    """{keyword: value} for each keyword of SPEC 2a in keywords.POSITIONS (but enable_gqa), each set or left at its
    default by its drawer in POSITION_DRAWERS, each set one from a short fixed list (JAX compiles once per static
    q_offset, window and softcap): q_offset in OFFSET_FORMS, from `offsets`; a window of WINDOW_SIDES (a side 0
    with a negative offset leaves whole rows without a key); key lengths from `key_lengths`, per sequence; a
    softcap of SOFTCAPS."""
    return {name: draw(POSITION_DRAWERS[name](batch, L, S)) for name in keywords.POSITIONS
            if name not in DRAWN_WITH_HEADS}


# --- sinks and ALiBi (SPEC 2h, 2i): one value per head ------------------------------------------------------

@st.composite
def _sinks(draw: Callable, batch: Batch) -> np.ndarray:
    """sinks in a form of SINK_FORMS broadcasting to the scores' leading axes `batch` (..., H): (H,), `batch`
    itself, or a scalar (); values N(0, 1) * SINK_SCALE, in one case of two a share HIDDEN_SINK of them -inf."""
    forms = [form for form in SINK_FORMS if form == "scalar" or len(batch) >= (1 if form == "head" else 2)]
    form = draw(st.sampled_from(forms))
    shape = {"head": batch[-1:], "sequence": batch, "scalar": ()}[form]
    rng = _rng(draw)
    sinks = np.array(SINK_SCALE * rng.standard_normal(shape))  # (H,), (..., H) or ()
    if draw(st.booleans()):
        sinks[rng.random(shape) < HIDDEN_SINK] = -np.inf
    return sinks


def geometric_slopes(H: int) -> np.ndarray:
    """BLOOM's and the ALiBi paper's slopes (H,): 2^(-8 h / n), h = 1 .. n, n the greatest power of two <= H, then
    the odd terms 2^(-8 h / 2n), h = 1, 3, .., of the sequence for 2n, H - n of them."""
    n = 2 ** int(math.log2(H))
    return np.array([2.0 ** (-8 * h / n) for h in range(1, n + 1)]
                    + [2.0 ** (-8 * h / (2 * n)) for h in range(1, 2 * n, 2)][:H - n])


@st.composite
def _alibi_slopes(draw: Callable, batch: Batch) -> np.ndarray | None:
    """alibi_slopes of the scores' leading axes `batch` (..., H) in a form of SLOPE_FORMS: BLOOM's (H,), or U(0, 1)
    (H,) or (B, H) (`batch` of two axes); None where the scores have no head axis."""
    if not batch:
        return None
    forms = [form for form in SLOPE_FORMS if form != "sequence" or len(batch) == 2]
    form = draw(st.sampled_from(forms))
    if form == "geometric":
        return geometric_slopes(batch[-1])  # (H,)
    return _rng(draw).uniform(0.0, 1.0, batch[-1:] if form == "head" else batch)  # (H,) or (B, H)


# How a case draws each keyword of one value per head (keywords.PER_HEAD): {keyword: batch -> strategy}, batch the
# scores' leading axes (..., H). An operation takes those its options name (OPERATIONS); a keyword of the table
# without a drawer here fails every draw of an operation that takes it (KeyError).
PER_HEAD_DRAWERS: dict[str, Callable[[Batch], st.SearchStrategy]] = {
    "sinks": _sinks,
    "alibi_slopes": _alibi_slopes,
}


def per_head_keywords(operation: str) -> tuple[str, ...]:
    """The keywords of keywords.PER_HEAD that `operation` takes: those its entry of OPERATIONS names in its options."""
    return tuple(name for name in keywords.PER_HEAD if name in OPERATIONS[operation].options)


@st.composite
def per_head(draw: Callable, operation: str, batch: Batch) -> dict[str, Any]:
    """{keyword: value} for each keyword of one value per head that `operation` takes (`per_head_keywords`), each
    in about one case of PER_HEAD_RATE, by its drawer in PER_HEAD_DRAWERS; `batch` the scores' leading axes
    (..., H). Arrays, which JAX traces: a new value compiles nothing, a new form (shape) once."""
    drawn = {name: draw(PER_HEAD_DRAWERS[name](batch)) for name in per_head_keywords(operation)
             if draw(_one_in(PER_HEAD_RATE))}
    return {name: value for name, value in drawn.items() if value is not None}


@st.composite
def grouped_heads(draw: Callable, batch: Batch) -> tuple[Batch, Batch]:
    """The leading axes of q and of k, v in an enable_gqa case: `batch` with its last axis (or a new one)
    holding H query heads from QUERY_HEADS, and Hkv in {1, H / 2, H} key/value heads (multi-query, grouped,
    one each)."""
    H = draw(st.sampled_from(QUERY_HEADS))
    Hkv = draw(st.sampled_from((1, H // 2, H)))
    return (*batch[:-1], H), (*batch[:-1], Hkv)


# --- scaled dot-product attention --------------------------------------------------------------------------

@st.composite
def sdpa_cases(draw: Callable, *, is_causal: bool | None = None, mask: bool | None = None,
               bias: bool | None = None, single_key: bool = False, magnitude: str | None = None,
               key_offset: bool = False, positioned: bool | None = None, long: bool = True,
               modded: bool | None = None, mods_rate: int = MODS_RATE, operation: str = "sdpa") -> SdpaCase:
    """Random sdpa inputs. None draws a setting; True / False force it: `mask=True` always gives a mask
    array, `mask=False` none, likewise `bias`; `is_causal` as given. `magnitude` is drawn from "normal"
    and "large" (q, k scaled by LARGE, logits in the hundreds); v is always N(0, 1).

    single_key=True: every query sees exactly one key. The mask is one-hot per row (the key chosen in the
    causal window when is_causal), or, with mask=False, S == 1 and no mask; a drawn bias is then 0
    wherever it was -inf on that visible key, so it hides nothing more.

    key_offset=True: every key adds one vector of KEY_OFFSET * N(0, 1) entries, so with normal q the scores
    of a query share a term in the hundreds and differ by about one: scores rounded to half precision lose
    those differences, scores in float32 keep them (SPEC 2).

    positioned: whether the case passes the keywords of SPEC 2a (`positions`); None draws it, True in
    about one case of three (POSITIONED), never with single_key. False for the checks whose property they
    break (a permutation of the keys, a causal prefix). About one positioned case in two (GROUPED) is also
    grouped-query attention (`grouped_heads`): masks, bias and positions then follow q's heads. A positioned case
    also draws the keywords of one value per head that `operation` takes (`per_head`: sinks, alibi_slopes).

    modded: whether the case passes mods (a mask function of `mask_functions`, a score function of
    `score_functions`); None draws it, True in about one case of `mods_rate`, never with single_key or
    positioned=False (the properties those checks test hold for the keys as given). A modded case has four axes,
    (B, H, L, E), B and H, L and S from the flex strategy's few sizes (JAX compiles per shape and per mod), grouped
    heads in one case of two (`_modded_sdpa_cases`).
    """
    if modded is None:
        modded = not single_key and positioned is not False and draw(_one_in(mods_rate))
    if positioned is None:  # a single-key case keeps its one key: the keywords could hide it
        positioned = False if single_key else draw(st.sampled_from(POSITIONED))
    if modded:
        return draw(_modded_sdpa_cases(is_causal, mask, bias, magnitude, key_offset, operation))
    batch, L = draw(batch_shapes()), draw(lengths(long=long))
    grouped = positioned and draw(st.sampled_from(GROUPED))
    batch, kv_batch = draw(grouped_heads(batch)) if grouped else (batch, batch)  # q's, and k's and v's
    S = 1 if single_key and mask is False else draw(lengths(long=long))
    E, Ev = draw(st.sampled_from(WIDTHS)), draw(st.sampled_from(WIDTHS))
    is_causal = draw(st.booleans()) if is_causal is None else is_causal
    magnitude = draw(st.sampled_from(MAGNITUDES[:2])) if magnitude is None else magnitude
    scale = draw(st.sampled_from(SCALES))
    rng = _rng(draw)
    q = _values(rng, (*batch, L, E), magnitude)  # (..., L, E)
    k = _values(rng, (*kv_batch, S, E), magnitude)  # (..., S, E)
    v = rng.standard_normal((*kv_batch, S, Ev))  # (..., S, Ev)
    if key_offset:  # one vector shared by every key
        k = k + KEY_OFFSET * rng.standard_normal((*kv_batch, 1, E))  # (..., S, E) + (..., 1, E)

    if mask is False:
        mask_ = None
    elif single_key:
        mask_ = _cast_mask(draw, draw(_one_visible_key_mask(batch, L, S, None, causal=is_causal)))
    else:
        mask_ = draw(masks(batch, L, S, families=MASKED_FAMILIES if mask else None))
    bias_ = None if bias is False else draw(biases(batch, L, S, allow_none=bias is None))
    if single_key and bias_ is not None:
        bias_ = _finite_where_visible(bias_, mask_)
    extra = draw(positions(batch, L, S)) | draw(per_head(operation, batch)) if positioned else {}
    return SdpaCase(q=q, k=k, v=v, mask=mask_, bias=bias_, is_causal=is_causal, scale=scale, dropout=0.0,
                    **extra, enable_gqa=grouped)


@st.composite
def _modded_sdpa_cases(draw: Callable, is_causal: bool | None, mask: bool | None, bias: bool | None,
                       magnitude: str | None, key_offset: bool, operation: str) -> SdpaCase:
    """An sdpa case with mods: q (B, H, L, E), k and v (B, Hkv, S, *) of the flex strategy's sizes (grouped heads
    in one case of two), a mask function (`mask_functions`, never none) and a score function (`score_functions`)
    of the catalogue, and the rest drawn as an sdpa case's: a mask and a bias (..., L, S), causal, a scale, and
    the keywords of SPEC 2a (`positions`) and those of one value per head (`per_head`) in one case of two."""
    B, grouped = draw(st.sampled_from(FLEX_BATCH)), draw(st.sampled_from(GROUPED))
    H = draw(st.sampled_from(QUERY_HEADS if grouped else FLEX_HEADS))
    Hkv = draw(st.sampled_from((1, H // 2, H))) if grouped else H
    L, S = draw(flex_lengths()), draw(flex_lengths())
    q, k, v = draw(_inputs((B, H), (B, Hkv), L, S, magnitude))  # (B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev)
    if key_offset:  # one vector shared by every key
        k = k + KEY_OFFSET * _rng(draw).standard_normal((B, Hkv, 1, k.shape[-1]))  # (B, Hkv, S, E) + (.., 1, E)
    mask_ = None if mask is False else draw(masks((B, H), L, S, families=MASKED_FAMILIES if mask else None))
    bias_ = None if bias is False else draw(biases((B, H), L, S, allow_none=bias is None))
    extra = draw(positions((B, H), L, S)) | draw(per_head(operation, (B, H))) if draw(st.booleans()) else {}
    return SdpaCase(q=q, k=k, v=v, mask=mask_, bias=bias_,
                    is_causal=draw(st.booleans()) if is_causal is None else is_causal,
                    scale=draw(st.sampled_from(SCALES)), dropout=0.0, **extra, enable_gqa=grouped,
                    mask_mod=draw(mask_functions(B, H, L, S, always=True)), score_mod=draw(score_functions(H)))


def _one_in(n: int) -> st.SearchStrategy[bool]:
    """True in about one draw of n; shrinks towards False."""
    return st.sampled_from((False,) * (n - 1) + (True,))


@st.composite
def flash_cases(draw: Callable, *, magnitude: str | None = None, key_offset: bool = False,
                modded: bool | None = None, mods_rate: int = MODS_RATE) -> FlashCase:
    """An sdpa case (no dropout; the keywords of SPEC 2a and those of one value per head that flash takes in one
    draw of two, grouped heads in half of those;
    mods in about one case of `mods_rate`, or as `modded` says) in tiles of 1 to 7 queries and 1 to 7 keys, drawn
    apart, so L and S are seldom multiples of them; a modded case passes its mask function as a block mask of those
    tiles in one case of two."""
    modded = draw(_one_in(mods_rate)) if modded is None else modded
    case = draw(sdpa_cases(magnitude=magnitude, key_offset=key_offset, positioned=draw(st.booleans()),
                           modded=modded, operation="flash"))
    flash = tiled(case, draw(st.sampled_from(TILE_SIZES)), draw(st.sampled_from(TILE_SIZES)))
    if case.mask_mod is not None and draw(st.booleans()):
        return flash._replace(block_size=(flash.block_q, flash.block_k))
    return flash


@st.composite
def _inputs(draw: Callable, batch: Batch, kv_batch: Batch, L: int, S: int,
            magnitude: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (..., L, E) and k (..., S, E) of `magnitude` (None: "normal" or "large", drawn), v (..., S, Ev) N(0, 1),
    E and Ev from WIDTHS; k and v with the leading axes kv_batch (grouped heads: fewer than q's)."""
    E, Ev = draw(st.sampled_from(WIDTHS)), draw(st.sampled_from(WIDTHS))
    magnitude = draw(st.sampled_from(MAGNITUDES[:2])) if magnitude is None else magnitude
    rng = _rng(draw)
    q = _values(rng, (*batch, L, E), magnitude)  # (..., L, E)
    k = _values(rng, (*kv_batch, S, E), magnitude)  # (..., S, E)
    v = rng.standard_normal((*kv_batch, S, Ev))  # (..., S, Ev)
    return q, k, v


@st.composite
def ring_cases(draw: Callable, *, magnitude: str | None = None) -> RingCase:
    """Ring attention over P of RING_DEVICES devices: L and S multiples of P (of 2P with is_causal, the zig-zag
    layout's chunks) of RING_CHUNK_ROWS rows a chunk, drawn apart (cross-attention); q_offset a Python int from
    `offsets` in one case of two (with is_causal, rows before every key and keys past the last query), a
    window and a softcap each in one case of two, grouped heads in one of two; tiles of 1 to 7 inside each step;
    the keywords of one value per head that ring takes (`per_head`). No mask, bias or key lengths: ring attention
    takes none."""
    P, is_causal = draw(st.sampled_from(RING_DEVICES)), draw(st.booleans())
    chunks = 2 * P if is_causal else P
    L, S = (chunks * draw(st.sampled_from(RING_CHUNK_ROWS)) for _ in range(2))
    batch = draw(batch_shapes())
    grouped = draw(st.sampled_from(GROUPED))
    batch, kv_batch = draw(grouped_heads(batch)) if grouped else (batch, batch)  # q's, and k's and v's
    q, k, v = draw(_inputs(batch, kv_batch, L, S, magnitude))
    q_offset = draw(st.sampled_from(offsets(L, S))) if draw(st.booleans()) else 0
    window = draw(st.none() | st.tuples(st.sampled_from(WINDOW_SIDES), st.sampled_from(WINDOW_SIDES)))
    softcap = draw(st.none() | st.sampled_from(SOFTCAPS))
    extra = draw(per_head("ring", batch))  # q's leading axes: the query heads'
    return RingCase(q=q,
                    k=k,
                    v=v,
                    mask=None,
                    bias=None,
                    is_causal=is_causal,
                    scale=draw(st.sampled_from(SCALES)),
                    q_offset=q_offset,
                    window=window,
                    softcap=softcap,
                    enable_gqa=grouped,
                    block_q=draw(st.sampled_from(TILE_SIZES)),
                    block_k=draw(st.sampled_from(TILE_SIZES)),
                    devices=P,
                    **extra)


@st.composite
def linear_cases(draw: Callable, *, is_causal: bool | None = None, with_lengths: bool | None = None,
                 magnitude: str | None = None, long: bool = True, overflowing: bool = False,
                 rules: tuple[str, ...] = UPDATE_RULES) -> LinearCase:
    """Linear attention (SPEC 2e): a feature map of FEATURE_MAPS; causal or not (None draws it; causal: L == S,
    the chunked form in three cases of four, with a chunk of CHUNKS that does not divide L, so the last chunk is
    partial, or 1, or one larger than L; not causal: L and S drawn apart, no chunk); key lengths per sequence
    in one case of two (None draws it; False: none, as the recurrent form takes none), from `key_lengths`; eps
    of LINEAR_EPSILONS; q and k of "normal" or "large" (LARGE: phi's exponential branch far below 1, its linear
    branch far above), v N(0, 1). overflowing=True (the half-precision group): one case of two, the least case
    among them, has L = S from OVERFLOW_LENGTHS and q and k LARGE, where the sums A and z and the normaliser of a
    float16 computation pass 65504 or stop growing, while float32 holds them to a rounding (SPEC 2e).

    With the identity map q and k are drawn positive (|x|): every weight phi(q_i) . phi(k_j) is then a sum of
    positive products, so the normaliser sum_j w_ij + eps sums positive terms and out is a weighted mean of the
    values, as with elu + 1 and relu. With signed features the normaliser can cancel to about 0 and out grows
    without bound: a relative error that measures rounding, not correctness, in float32 and in central
    differences alike, so the checks would either miss bugs or fail correct modules. relu's weights are >= 0
    whatever the inputs (a query or key with no positive entry gives weights of 0, out 0 / eps = 0).

    A causal case then draws its update rule from `rules` (UPDATE_RULES, "linear" weighted RULE_WEIGHTS: in one
    case of two; an overflowing one keeps "linear"): a gated rule's decay g = -U(DECAY_SPAN), (..., S, 1) or
    (..., S, E) (DECAY_WIDTHS), a delta rule's beta U(BETA_SPAN) (..., S, 1); the delta rules on unit keys
    (k / |k|) with phi of DELTA_MAPS, so |phi(k)| <= 1 and each step's I - beta phi(k) phi(k)^T shrinks the state
    (it stays bounded at every L)."""
    feature_map = draw(st.sampled_from(FEATURE_MAPS))
    is_causal = draw(st.booleans()) if is_causal is None else is_causal
    past_half = overflowing and draw(st.sampled_from((True, False)))  # True first: the least case is one
    batch = draw(batch_shapes())
    L = draw(st.sampled_from(OVERFLOW_LENGTHS)) if past_half else draw(lengths(long=long))
    S = L if is_causal or past_half else draw(lengths(long=long))
    chunk = None
    if is_causal and draw(st.sampled_from((False, True, True, True))):
        chunk = draw(st.sampled_from([c for c in CHUNKS if c == 1 or L % c]))
    q, k, v = draw(_inputs(batch, batch, L, S, "large" if past_half else magnitude))
    if feature_map == "identity":  # positive features: a normaliser that cannot cancel (see above)
        q, k = np.abs(q), np.abs(k)
    with_lengths = draw(st.booleans()) if with_lengths is None else with_lengths
    lengths_ = draw(_per_sequence(batch, key_lengths(S))) if with_lengths else None
    case = LinearCase(q=q,
                      k=k,
                      v=v,
                      feature_map=feature_map,
                      is_causal=is_causal,
                      key_lengths=lengths_,
                      eps=draw(st.sampled_from(LINEAR_EPSILONS)),
                      chunk=chunk)
    weighted = [rule for rule, weight in zip(UPDATE_RULES, RULE_WEIGHTS, strict=True) if rule in rules
                for _ in range(weight)]
    rule = draw(st.sampled_from(weighted)) if is_causal and not past_half else "linear"
    return case if rule == "linear" else draw(_with_rule(case, rule))


@st.composite
def _with_rule(draw: Callable, case: LinearCase, rule: str) -> LinearCase:
    """A causal case under update rule `rule` (linear_cases): the gates drawn, the delta rules' keys unit."""
    rng, (L, E) = _rng(draw), case.k.shape[-2:]
    batch = case.k.shape[:-2]
    decay = beta = None
    if rule in ("gated", "gated_delta"):
        width = E if draw(st.sampled_from(DECAY_WIDTHS)) == "E" else 1
        decay = -rng.uniform(*DECAY_SPAN, (*batch, L, width))  # (..., S, 1) or (..., S, E)
    if rule in ("delta", "gated_delta"):
        beta = rng.uniform(*BETA_SPAN, (*batch, L, 1))  # (..., S, 1)
        k = case.k / np.maximum(np.linalg.norm(case.k, axis=-1, keepdims=True), 1e-300)  # unit rows (..., S, E)
        case = case._replace(k=k, feature_map=draw(st.sampled_from(DELTA_MAPS)))
    return case._replace(update_rule=rule, decay=decay, beta=beta)


# --- programmable attention (flex_attention) -----------------------------------------------------------------
# A flex case's mods are entries of the catalogue (attention_np.common.mods) with drawn parameters, or and_masks /
# or_masks of two or three of them; every size from a few values, as JAX compiles per shape and per mod.

FLEX_BATCH = (1, 2)  # B
FLEX_HEADS = (1, 2)  # H without grouped heads (with them: QUERY_HEADS, and Hkv a divisor of H)
FLEX_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9)  # L and S, most draws
FLEX_LONG_LENGTHS = (16, 17)  # about one draw in ten: more than two tiles of 7
MASK_MODS = ("causal", "sliding_window", "key_lengths", "document", "prefix_lm", "chunked", "dilated", "noop_mask")
SCORE_MODS = ("alibi", "softcap", "relative_bias")
MASK_FORMS = ("none", "entry", "entry", "combined")  # no mask function in one case of four, a composition in one
SCORE_FORMS = ("none", "none", "entry")  # no score function in two cases of three
COMBINATIONS = {"and_masks": mods.and_masks, "or_masks": mods.or_masks}
CHUNK_SIZES = (1, 2, 3, 4)  # chunked(size)
DILATIONS = (1, 2, 3)  # dilated(window, dilation): each of window and dilation
SEGMENTS = 3  # document(...): segment ids 0..2, sorted (packed sequences)
REACH = (0, 1, 2)  # relative_bias's R: a table (H, 2R + 1)


def flex_lengths() -> st.SearchStrategy[int]:
    """L or S of a flex case: FLEX_LENGTHS, each nine times as likely as each of FLEX_LONG_LENGTHS."""
    return st.sampled_from(FLEX_LENGTHS * 9 + FLEX_LONG_LENGTHS)


@st.composite
def _sequence_values(draw: Callable, B: int, values: Sequence[int], *, heads: int | None = None) -> int | np.ndarray:
    """A number of `values`, or int64 (B,) (or (B, H) with heads) of them: a mod's parameter per sequence."""
    shapes = [(), (B,)] + ([(B, heads)] if heads is not None else [])
    shape = draw(st.sampled_from(shapes))
    if shape == ():
        return draw(st.sampled_from(values))
    n = math.prod(shape)
    return np.reshape(draw(st.lists(st.sampled_from(values), min_size=n, max_size=n)), shape).astype(np.int64)


@st.composite
def _segments(draw: Callable, B: int, n: int, per_sequence: bool) -> np.ndarray:
    """Sorted segment ids of 0..SEGMENTS - 1, (n,) or (B, n) per sequence."""
    rng = _rng(draw)
    return np.sort(rng.integers(0, SEGMENTS, (B, n) if per_sequence else (n,)), axis=-1)


@st.composite
def mask_entries(draw: Callable, B: int, H: int, L: int, S: int,
                 names: Sequence[str] = MASK_MODS) -> Callable[..., Any]:
    """One mask function of the catalogue, `names`, with drawn parameters: offsets of `offsets`, per sequence in
    some draws; windows of WINDOW_SIDES; key lengths of `key_lengths`, a number, per sequence or per head; document
    segments per sequence or shared, the keys' own or the queries'; chunks of CHUNK_SIZES; dilated windows."""
    name = draw(st.sampled_from(names))
    if name == "causal":
        return mods.causal(draw(_sequence_values(B, offsets(L, S))))
    if name == "sliding_window":
        left, right = draw(st.sampled_from(WINDOW_SIDES)), draw(st.sampled_from(WINDOW_SIDES))
        return mods.sliding_window(left, right, draw(_sequence_values(B, offsets(L, S))))
    if name == "key_lengths":
        return mods.key_lengths(draw(_sequence_values(B, key_lengths(S), heads=H)))
    if name == "document":
        per_sequence = draw(st.booleans())
        q_segments = draw(_segments(B, L, per_sequence))
        shared = L == S and draw(st.booleans())  # self-attention: the keys' segments are the queries'
        return mods.document(q_segments, None if shared else draw(_segments(B, S, per_sequence)))
    if name == "prefix_lm":
        return mods.prefix_lm(draw(_sequence_values(B, (0, 1, S // 2, S))))
    if name == "chunked":
        return mods.chunked(draw(st.sampled_from(CHUNK_SIZES)))
    if name == "dilated":
        return mods.dilated(draw(st.sampled_from(DILATIONS)), draw(st.sampled_from(DILATIONS)))
    return mods.noop_mask


@st.composite
def mask_functions(draw: Callable, B: int, H: int, L: int, S: int, *,
                   always: bool = False) -> Callable[..., Any] | None:
    """None (never with `always`), an entry of the catalogue (`mask_entries`), or and_masks / or_masks of two or
    three of them."""
    form = draw(st.sampled_from(MASK_FORMS[1:] if always else MASK_FORMS))
    if form == "none":
        return None
    if form == "entry":
        return draw(mask_entries(B, H, L, S))
    combine = COMBINATIONS[draw(st.sampled_from(sorted(COMBINATIONS)))]
    return combine(*draw(st.lists(mask_entries(B, H, L, S), min_size=2, max_size=3)))


@st.composite
def score_functions(draw: Callable, H: int, *, scored: bool = False) -> mods.ScoreMod | None:
    """None in two draws of three (never with `scored`), else a score function of the catalogue with drawn
    parameters: ALiBi slopes U(0.05, 1) per head, a softcap of SOFTCAPS, a relative-bias table N(0, 1) (H, 2R + 1)
    with R of REACH."""
    if not scored and draw(st.sampled_from(SCORE_FORMS)) == "none":
        return None
    name = draw(st.sampled_from(SCORE_MODS))
    if name == "softcap":
        return mods.softcap(draw(st.sampled_from(SOFTCAPS)))
    rng = _rng(draw)
    if name == "alibi":
        return mods.alibi(rng.uniform(0.05, 1.0, H))  # (H,)
    return mods.relative_bias(rng.standard_normal((H, 2 * draw(st.sampled_from(REACH)) + 1)))  # (H, 2R + 1)


@st.composite
def flex_cases(draw: Callable, *, magnitude: str | None = None, scored: bool = False) -> FlexCase:
    """Programmable attention: B of FLEX_BATCH, H of FLEX_HEADS, or grouped heads in one case of two (H of
    QUERY_HEADS, Hkv 1, H / 2 or H); L and S drawn apart (`flex_lengths`); q, k of `magnitude` (None: "normal" or
    "large"); a mask function (`mask_functions`) in tiles of 1 to 7 queries and 1 to 7 keys, drawn apart, so L and
    S are seldom multiples of them; a score function (`score_functions`; always one with `scored`); a scale of
    SCALES; the keywords of one value per head that flex takes (`per_head`)."""
    B, grouped = draw(st.sampled_from(FLEX_BATCH)), draw(st.sampled_from(GROUPED))
    H = draw(st.sampled_from(QUERY_HEADS if grouped else FLEX_HEADS))
    Hkv = draw(st.sampled_from((1, H // 2, H))) if grouped else H
    L, S = draw(flex_lengths()), draw(flex_lengths())
    q, k, v = draw(_inputs((B, H), (B, Hkv), L, S, magnitude))  # (B, H, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev)
    return FlexCase(q=q,
                    k=k,
                    v=v,
                    mask_mod=draw(mask_functions(B, H, L, S)),
                    score_mod=draw(score_functions(H, scored=scored)),
                    block_size=(draw(st.sampled_from(TILE_SIZES)), draw(st.sampled_from(TILE_SIZES))),
                    scale=draw(st.sampled_from(SCALES)),
                    enable_gqa=grouped,
                    **draw(per_head("flex", (B, H))))


# --- packed sequences (varlen_attention) ---------------------------------------------------------------------
# JAX compiles once per shape and static option, so the packed totals come from a few values, the sequences' lengths
# and their number vary inside them, and the boundaries are traced data (static only with a block_size).

VARLEN_SEQUENCES = (2, 1, 3, 4, 0)  # N: two first, so the least case has a boundary between two sequences
VARLEN_LENGTHS = (2, 0, 1, 3, 4, 5)  # each sequence's query and key lengths, drawn apart: empty ones included
VARLEN_TOTALS = (6, 12, 20)  # Tq and Tk: the least that holds the sequences (N <= 4 of <= 5 positions)
VARLEN_HEADS = ((1, 1), (2, 2), (2, 1))  # (H, Hkv): one head, two, grouped (enable_gqa)
VARLEN_BLOCKS = (None, None, None, None, 2, 3)  # block_size: tiles of 2 or 3 in one case of three (a tiled program,
# its boundaries static, takes JAX about twice as long to compile), else the untiled path


@st.composite
def _packed_bounds(draw: Callable, n: int) -> tuple[np.ndarray, int]:
    """Boundaries (N + 1,) int32 of n sequences of VARLEN_LENGTHS on an axis of T from VARLEN_TOTALS: in one case of
    two the last sequence stretched to fill the axis, else positions past the last boundary (all of them for N = 0)."""
    lengths = [draw(st.sampled_from(VARLEN_LENGTHS)) for _ in range(n)]
    padded = n == 0 or draw(st.booleans())
    T = min(total for total in VARLEN_TOTALS if total >= sum(lengths) + padded)
    if not padded:
        lengths[-1] += T - sum(lengths)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), T


@st.composite
def varlen_cases(draw: Callable, *, magnitude: str | None = None) -> VarlenCase:
    """Packed sequences (SPEC 2g): N of VARLEN_SEQUENCES sequences whose query and key lengths are drawn apart from
    VARLEN_LENGTHS (empty sequences, fewer queries than keys and more), on axes Tq and Tk of VARLEN_TOTALS, with
    positions past the last boundary in about one case of two per axis; heads of VARLEN_HEADS (grouped: enable_gqa);
    E and Ev of WIDTHS; q, k of `magnitude` (None: "normal" or "large"), v N(0, 1); is_causal, a window (of
    WINDOW_SIDES, None sides), a softcap and a scale each drawn (bottom-right in each sequence); block_size of
    VARLEN_BLOCKS (with one, the boundaries are static tuples); max_seqlen the longest sequence's."""
    n = draw(st.sampled_from(VARLEN_SEQUENCES))
    (cu_q, Tq), (cu_k, Tk) = draw(_packed_bounds(n)), draw(_packed_bounds(n))
    H, Hkv = draw(st.sampled_from(VARLEN_HEADS))
    q, k, v = draw(_inputs((H,), (Hkv,), Tq, Tk, magnitude))  # (H, Tq, E), (Hkv, Tk, E), (Hkv, Tk, Ev)
    q, k, v = (np.ascontiguousarray(np.swapaxes(x, 0, 1)) for x in (q, k, v))  # (Tq, H, E), (Tk, Hkv, *)
    block_size = draw(st.sampled_from(VARLEN_BLOCKS))
    static = (lambda bounds: tuple(bounds.tolist())) if block_size is not None else (lambda bounds: bounds)
    return VarlenCase(q=q,
                      k=k,
                      v=v,
                      cu_seqlens_q=static(cu_q),
                      cu_seqlens_k=static(cu_k),
                      max_seqlen_q=int(np.max(np.diff(cu_q), initial=0)),
                      max_seqlen_k=int(np.max(np.diff(cu_k), initial=0)),
                      is_causal=draw(st.booleans()),
                      window=draw(st.none() | st.tuples(st.sampled_from(WINDOW_SIDES), st.sampled_from(WINDOW_SIDES))),
                      softcap=draw(st.none() | st.sampled_from(SOFTCAPS)),
                      scale=draw(st.sampled_from(SCALES)),
                      enable_gqa=Hkv != H,
                      block_size=block_size)


# --- parameters --------------------------------------------------------------------------------------------

def mha_states(d_model: int, num_heads: int = 1, num_kv_heads: int | None = None,
               bias: bool = True) -> st.SearchStrategy[State]:
    """Random MultiHeadAttention parameters, nn.Linear's initialisation (biases are not zero), in the layout of
    num_kv_heads and bias."""
    return SEEDS.map(lambda seed: mha_state(np.random.default_rng(seed), d_model, num_heads, num_kv_heads, bias))


def block_states(d_model: int, d_ff: int, **layout: Any) -> st.SearchStrategy[State]:
    """Random TransformerBlock parameters; norm gains not 1 and LayerNorm biases not 0; `layout` as for
    cases.block_state (num_heads, num_kv_heads, bias, norm, activation)."""
    return SEEDS.map(lambda seed: block_state(np.random.default_rng(seed), d_model, d_ff, **layout))


@st.composite
def heads_and_options(draw: Callable, *, rope: bool = True) -> tuple[int, int, bool, dict[str, Any]]:
    """H, D, whether the case is optioned and the module options: about one case in three (OPTIONED) is, and
    then H comes from OPTIONED_HEADS, so that key/value heads shared in groups (Hkv = 2 of 4) are drawn often;
    with RoPE (rope_theta from ROPE_THETAS; never with rope=False), D = H * ROPE_D_K."""
    optioned = draw(st.sampled_from(OPTIONED))
    num_heads, d_model = draw(_heads_and_width(OPTIONED_HEADS if optioned else HEADS))
    if not optioned:
        return num_heads, d_model, optioned, {"num_kv_heads": None, "bias": True, "rope_theta": None}
    options = draw(module_options(num_heads)) | {"rope_theta": draw(st.sampled_from(ROPE_THETAS)) if rope else None}
    d_model = d_model if options["rope_theta"] is None else num_heads * ROPE_D_K
    return num_heads, d_model, optioned, options


@st.composite
def module_options(draw: Callable, num_heads: int) -> dict[str, Any]:
    """The options of SPEC 5 that MultiHeadAttention and the block share:
    num_kv_heads H / 2 (where it divides H), 1 or H, and bias; else the seed's (None and True)."""
    groups = [n for n in dict.fromkeys((num_heads // 2, 1, num_heads)) if n and num_heads % n == 0]  # H / 2 first
    return {"num_kv_heads": draw(st.sampled_from(groups)), "bias": draw(st.booleans())}


# --- multi-head attention and the block --------------------------------------------------------------------

@st.composite
def _heads_and_width(draw: Callable, heads: tuple[int, ...] = HEADS) -> tuple[int, int]:
    """H from `heads` and D = H * d_k <= 8."""
    num_heads = draw(st.sampled_from(heads))
    return num_heads, num_heads * draw(st.sampled_from(D_K))


@st.composite
def mha_cases(draw: Callable, *, cross: bool | None = None, magnitude: str | None = None,
              long: bool = True, rope: bool = True, linear: bool = True) -> MhaCase:
    """Self-attention (q, k, v the same array, L == S) or cross-attention (three different arrays, L != S);
    `cross` None draws it. Inputs "normal" or "large" unless `magnitude` is given; mask per head; num_kv_heads,
    bias and rope_theta from `heads_and_options` (rope=False: none, for properties of unpositioned attention);
    an optioned case draws its heads' attention from ATTENTIONS, and linear heads take no mask and no dropout
    (linear=False: softmax heads only, for the dropout checks: linear heads form no weights to drop); linear heads
    in self-attention are causal in one case of two. An optioned case of softmax heads draws sinks=True from
    MHA_SINKS (`mha_sinks`: the state's sinks (H,)) and, without RoPE (and never with rope=False), its position
    from MHA_POSITIONS (ALiBi)."""
    num_heads, d_model, optioned, options = draw(heads_and_options(rope=rope))
    attention = draw(st.sampled_from(ATTENTIONS)) if optioned and linear else "softmax"
    linear = attention == "linear"
    softmax_options = optioned and not linear
    sinks = draw(mha_sinks(num_heads)) if softmax_options and draw(st.sampled_from(MHA_SINKS)) else None
    alibi = softmax_options and rope and options["rope_theta"] is None  # rope=False: unpositioned, no ALiBi
    position = draw(st.sampled_from(MHA_POSITIONS)) if alibi else None
    batch, L = draw(batch_shapes()), draw(lengths(long=long))
    cross = draw(st.booleans()) if cross is None else cross
    S = draw(lengths(exclude=L, long=long)) if cross else L
    is_causal = linear and not cross and draw(st.booleans())  # linear heads in self-attention: causal in one of two
    magnitude = draw(st.sampled_from(MAGNITUDES[:2])) if magnitude is None else magnitude
    rng = _rng(draw)
    q = _values(rng, (*batch, L, d_model), magnitude)  # (..., L, D)
    k, v = (_values(rng, (*batch, S, d_model), magnitude),  # (..., S, D)
            _values(rng, (*batch, S, d_model), magnitude)) if cross else (q, q)
    state = draw(mha_states(d_model, num_heads, options["num_kv_heads"], options["bias"]))
    dropout = 0.0 if linear else draw(st.sampled_from(DROPOUTS))
    mask = None if linear else draw(masks(batch, L, S, heads=num_heads))
    state = state if sinks is None else state | {"sinks": sinks}  # sinks=True's (H,)
    return MhaCase(state=state,
                   num_heads=num_heads,
                   dropout=dropout,
                   q=q,
                   k=k,
                   v=v,
                   mask=mask,
                   **options,
                   attention=attention,
                   is_causal=is_causal,
                   position=position)


@st.composite
def mha_sinks(draw: Callable, num_heads: int) -> np.ndarray:
    """MultiHeadAttention's sinks (H,): N(0, 1) * SINK_SCALE, in one case of two a share HIDDEN_SINK of them at
    MHA_SINK_FLOOR (far below every logit, but finite: a state holds finite parameters)."""
    rng = _rng(draw)
    sinks = SINK_SCALE * rng.standard_normal(num_heads)
    if draw(st.booleans()):
        sinks[rng.random(num_heads) < HIDDEN_SINK] = MHA_SINK_FLOOR
    return sinks


@st.composite
def block_cases(draw: Callable, *, causal_mask: bool = False, magnitude: str | None = None,
                long: bool = True, rope: bool = True) -> BlockCase:
    """Pre-LN or post-LN, ReLU or GELU, eps from EPSILONS; x "normal", "large" or "small_variance"
    (c + 1e-3 * noise per row, variance ~1e-6, so eps matters) unless `magnitude` is given.
    causal_mask=True gives mask = tril(L, L), bool (L, L); otherwise a mask per head is drawn. An optioned
    case (`module_options`) also draws norm and activation among ReLU, GELU and SwiGLU; rope as for mha_cases."""
    num_heads, d_model, optioned, options = draw(heads_and_options(rope=rope))
    d_ff = draw(st.sampled_from(D_FF))
    batch, L = draw(batch_shapes()), draw(lengths(long=long))
    norm = draw(st.sampled_from(NORMS)) if optioned else "layer"
    norm_first = draw(st.booleans())
    activation = draw(st.sampled_from(OPTIONED_ACTIVATIONS if optioned else ACTIVATIONS))
    eps, dropout = draw(st.sampled_from(EPSILONS)), draw(st.sampled_from(DROPOUTS))
    magnitude = draw(st.sampled_from(MAGNITUDES)) if magnitude is None else magnitude
    x = _values(_rng(draw), (*batch, L, d_model), magnitude)  # (..., L, D)
    mask = np.tri(L, L, dtype=bool) if causal_mask else draw(masks(batch, L, L, heads=num_heads))
    state = draw(block_states(d_model, d_ff, num_heads=num_heads, norm=norm, activation=activation,
                              num_kv_heads=options["num_kv_heads"], bias=options["bias"]))
    return BlockCase(state=state,
                     num_heads=num_heads,
                     dropout=dropout,
                     norm_first=norm_first,
                     activation=activation,
                     eps=eps,
                     x=x,
                     mask=mask,
                     norm=norm,
                     **options)



# --- decoding through a key/value cache --------------------------------------------------------------------

CHUNKINGS = ("prefill_then_steps", "steps", "random")  # how a sequence is cut into chunks for extend
SPARE = (0, 1, 3)  # the cache's capacity beyond the sequence


@st.composite
def chunk_sizes(draw: Callable, L: int) -> tuple[int, ...]:
    """Sizes >= 1 summing to L: a prefill then steps of one position (decoding), one position at a time, or
    a random split."""
    kind = draw(st.sampled_from(CHUNKINGS))
    if kind == "steps":
        return (1,) * L
    if kind == "prefill_then_steps":
        prefill = draw(st.integers(1, L))
        return (prefill,) + (1,) * (L - prefill)
    cuts = sorted(draw(st.sets(st.integers(1, L - 1), max_size=3))) if L > 1 else []
    return tuple(int(b - a) for a, b in zip([0, *cuts], [*cuts, L], strict=True))


LAYOUTS = ("contiguous", "ragged", "paged", "streaming")  # a decode case's cache: init_cache's, with a length per
# sequence, paged, or streaming
PAGE_SIZES = (1, 2, 3, 4, 5)
# a streaming cache's sizes (SPEC 3c), a short fixed list (JAX compiles every case's chunks): (s, w), s >= 0 sinks
# (0: a window alone) and a window of w >= 1, and N = s + w + PAST positions decoded, so that the ring turns.
# Hypothesis shrinks towards the first entry: sinks to keep and a window of two, whose order shows once the ring has
# turned a part of a lap
STREAM_SIZES = ((1, 2), (0, 3), (2, 3), (2, 1))
PAST = (1, 3)
ROPE_POSITIONS = ("original", "cache")  # where RoPE turns the keys of a streaming cache: their positions, their places
DECODE_ATTENTIONS = ("softmax",) * 5 + ("linear",)  # a decode case's heads: linear (a LinearCache) in one of six
LINEAR_DECODE_LENGTHS = (4, 6)  # L of a linear decode case, a short fixed list: JAX compiles every case's chunks


@st.composite
def decode_cases(draw: Callable) -> DecodeCase:
    """A drawn block (block_cases) fed chunk by chunk: L of LENGTHS (each chunk is a call, which JAX compiles
    into one program per case), the chunks from `chunk_sizes`, a capacity of L plus SPARE; in about one case of
    two a mask of the whole sequence (`masks`, (..., [H,] L, capacity)), and in one of two the block's attention
    alone on x's queries and the keys and values of another input x_kv (cross-attention). In one case of four
    each chunk takes a length per sequence (`ragged_chunks`), in one of four besides through a paged cache
    (`paged`), and in one of four the cache streams (`streamed`). In about one case of six (DECODE_ATTENTIONS) the
    heads are linear and the cache their recurrent state (`linear_decoded`)."""
    block = draw(block_cases(causal_mask=True, long=False))
    if draw(st.sampled_from(DECODE_ATTENTIONS)) == "linear":
        return draw(linear_decoded(block))
    layout = draw(st.sampled_from(LAYOUTS))
    if layout == "streaming":
        return draw(streamed(block))
    if layout != "contiguous":
        return draw(ragged_chunks(block, paged=layout == "paged"))
    L = draw(st.sampled_from(LENGTHS))
    batch, D = block.x.shape[:-2], block.x.shape[-1]
    x = block.x[..., :L, :] if block.x.shape[-2] >= L else _values(_rng(draw), (*batch, L, D), "normal")
    capacity = L + draw(st.sampled_from(SPARE))
    mask = draw(masks(batch, L, capacity, heads=block.num_heads)) if draw(st.booleans()) else None
    x_kv = _values(_rng(draw), (*batch, L, D), "normal") if draw(st.booleans()) else None
    return _decode_case(block, x, draw(chunk_sizes(L)), capacity, mask=mask, x_kv=x_kv)


def _decode_case(block: BlockCase, x: np.ndarray, chunks: tuple[int, ...], capacity: int, **fields: Any) -> DecodeCase:
    return DecodeCase(state=block.state,
                      num_heads=block.num_heads,
                      dropout=block.dropout,
                      norm_first=block.norm_first,
                      activation=block.activation,
                      eps=block.eps,
                      x=x,
                      chunks=chunks,
                      capacity=capacity,
                      norm=block.norm,
                      num_kv_heads=block.num_kv_heads,
                      bias=block.bias,
                      rope_theta=block.rope_theta,
                      **fields)


@st.composite
def linear_decoded(draw: Callable, block: BlockCase) -> DecodeCase:
    """The block with attention="linear" through its LinearCache (SPEC 3a): L of LINEAR_DECODE_LENGTHS in chunks of
    `chunk_sizes`, x_kv in one case of two, a capacity of L plus SPARE (checked, no bound); no mask, no new_lengths,
    no paging or streaming (extend with a LinearCache takes none of them) and dropout 0 (linear heads form no
    weights to drop; the constructor refuses any other)."""
    L = draw(st.sampled_from(LINEAR_DECODE_LENGTHS))
    batch, D = block.x.shape[:-2], block.x.shape[-1]
    x = block.x[..., :L, :] if block.x.shape[-2] >= L else _values(_rng(draw), (*batch, L, D), "normal")
    x_kv = _values(_rng(draw), (*batch, L, D), "normal") if draw(st.booleans()) else None
    case = _decode_case(block, x, draw(chunk_sizes(L)), L + draw(st.sampled_from(SPARE)), x_kv=x_kv,
                        attention="linear")
    return case._replace(dropout=0.0)


@st.composite
def ragged_chunks(draw: Callable, block: BlockCase, *, paged: bool) -> DecodeCase:
    """The block on B <= 3 sequences (x (B, L, D), L <= 4) in at most two chunks, each sequence taking 0 .. the
    chunk's size of each (SPEC 3a), no mask, x_kv in one case of two; `paged`: a paged cache (SPEC 3b) of pages of
    1 .. 5 positions, enough blocks for the longest sequence and maybe one more, a pool one to three pages larger
    than the sequences need, given in a random order."""
    B, L, D = draw(st.integers(1, 3)), draw(st.integers(1, 4)), block.x.shape[-1]
    chunks = draw(chunk_sizes(L))
    chunks = chunks if len(chunks) <= 2 else (L - 1, 1)  # two calls at most, a prefill and a step: JAX compiles each
    new_lengths = tuple(tuple(draw(st.lists(st.integers(0, size), min_size=B, max_size=B))) for size in chunks)
    longest = max(map(sum, zip(*new_lengths, strict=True)))
    x = _values(_rng(draw), (B, L, D), "normal")
    x_kv = _values(_rng(draw), (B, L, D), "normal") if draw(st.booleans()) else None
    if not paged:
        return _decode_case(block, x, chunks, max(longest, 1) + draw(st.sampled_from(SPARE)), x_kv=x_kv,
                            new_lengths=new_lengths)
    page = draw(st.sampled_from(PAGE_SIZES))
    max_pages = max(1, -(-longest // page)) + draw(st.integers(0, 1))
    num_pages = B * max_pages + draw(st.integers(1, 3))
    paging = Paging(page_size=page, num_pages=num_pages, max_pages=max_pages,
                    order=tuple(draw(st.permutations(range(num_pages)))))
    return _decode_case(block, x, chunks, max_pages * page, x_kv=x_kv, new_lengths=new_lengths, paging=paging)


@st.composite
def streamed(draw: Callable, block: BlockCase) -> DecodeCase:
    """The block through a streaming cache (SPEC 3c): (s, w) of STREAM_SIZES, N = s + w + PAST positions (past the
    slots: the ring turns, evicting window positions, never the sinks), in `chunk_sizes` each cut into pieces of at
    most w (the spec's largest chunk); RoPE at the places in the cache in one case of two where the block has RoPE;
    x_kv in one case of two; no mask (the streaming rule is the mask); a capacity of s + w plus SPARE."""
    s, w = draw(st.sampled_from(STREAM_SIZES))
    N = s + w + draw(st.sampled_from(PAST))
    batch, D = block.x.shape[:-2], block.x.shape[-1]
    x = block.x[..., :N, :] if block.x.shape[-2] >= N else _values(_rng(draw), (*batch, N, D), "normal")
    x_kv = _values(_rng(draw), (*batch, N, D), "normal") if draw(st.booleans()) else None
    rope_positions = "original" if block.rope_theta is None else draw(st.sampled_from(ROPE_POSITIONS))
    chunks = tuple(piece for size in draw(chunk_sizes(N)) for piece in (w,) * (size // w) + (size % w,) if piece)
    return _decode_case(block, x, chunks, s + w + draw(st.sampled_from(SPARE)), x_kv=x_kv,
                        streaming=Streaming(sink_tokens=s, window=w, rope_positions=rope_positions))


# --- multi-head latent attention (MultiHeadLatentAttention) ---------------------------------------------------

MLA_BATCH = ((), (2,))  # leading axes
MLA_D_MODELS = (4, 6)  # D
MLA_HEADS = (1, 2)  # H
MLA_Q_RANKS = (None, 2, 3)  # q_lora_rank Dq: None is DeepSeek-V2-Lite's q_proj
MLA_KV_RANKS = (2, 3, 4)  # kv_lora_rank Dc: what the cache holds per position, with k_rope
MLA_NOPE = (1, 2)  # qk_nope_head_dim En
MLA_ROPE = (2, 4)  # qk_rope_head_dim Er, even: one pair turns by p alone, two show their frequencies
MLA_V = (1, 2, 3)  # v_head_dim Ev: mostly not the key width E = En + Er (3 to 6), as DeepSeek's 128 against 192
MLA_THETAS = (10000.0, 10.0)  # RoPE's base: DeepSeek's, and one whose second pair turns visibly in a few positions
MLA_FORMS = ("call", "call", "expanded", "absorbed")  # one call in half the cases, decoding in either form in the rest


@st.composite
def mla_cases(draw: Callable, *, decode: bool | None = None) -> MlaCase:
    """A MultiHeadLatentAttention of small drawn sizes (mla_state: Dq None or small, Dc, En, Er even, Ev often not
    En + Er), rope_theta from MLA_THETAS, x "normal" (..., L, D), L of LENGTHS. One call, with a mask per head
    (`masks`, (..., [H,] L, L): causal, random, hiding whole rows ...); or decoding (decode=True; None draws it as
    MLA_FORMS does): the chunks from `chunk_sizes`, a capacity of L plus SPARE, extend in the expanded or the
    absorbed form, and in one case of two a mask of the whole sequence (..., [H,] L, capacity)."""
    H, D = draw(st.sampled_from(MLA_HEADS)), draw(st.sampled_from(MLA_D_MODELS))
    sizes = {"q_lora_rank": draw(st.sampled_from(MLA_Q_RANKS)), "kv_lora_rank": draw(st.sampled_from(MLA_KV_RANKS)),
             "qk_nope_head_dim": draw(st.sampled_from(MLA_NOPE)), "qk_rope_head_dim": draw(st.sampled_from(MLA_ROPE)),
             "v_head_dim": draw(st.sampled_from(MLA_V))}
    batch, L = draw(st.sampled_from(MLA_BATCH)), draw(st.sampled_from(LENGTHS))
    forms = MLA_FORMS if decode is None else MLA_FORMS[2:] if decode else MLA_FORMS[:1]
    form = draw(st.sampled_from(forms))
    rng = _rng(draw)
    state = mla_state(rng, D, H, **sizes)
    x = _values(rng, (*batch, L, D), "normal")  # (..., L, D)
    case = MlaCase(state=state, num_heads=H, x=x, mask=None, rope_theta=draw(st.sampled_from(MLA_THETAS)))
    if form == "call":
        return case._replace(mask=draw(masks(batch, L, L, heads=H)))
    capacity = L + draw(st.sampled_from(SPARE))
    mask = draw(masks(batch, L, capacity, heads=H)) if draw(st.booleans()) else None
    return case._replace(mask=mask, chunks=draw(chunk_sizes(L)), capacity=capacity, absorbed=form == "absorbed")
