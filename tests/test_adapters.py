"""conformance.adapters on tiny hand-made inputs: each layout hands the kernel exactly the shapes it expects and
puts its output back; each mask polarity gives it the right array; leading axes fold into (B, H) or N and
broadcast; grouped heads reach a kernel that takes them; the declaration is what the signature leaves out; bad
input raises the contract's errors before the kernel runs; `vjp` gives torch's and JAX's own gradients.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes; N = B * H.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance import adapters
from conformance.contract.features import Declaration

B, H, L, S, E, Ev = 2, 3, 4, 5, 2, 3


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _qkv(*lead: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (..., L, E), k (..., S, E), v (..., S, Ev) in float64."""
    return _random(*lead, L, E, seed=seed), _random(*lead, S, E, seed=seed + 1), _random(*lead, S, Ev, seed=seed + 2)


class Recorder:
    """A kernel that records what it is given and returns zeros of its layout's output shape: (*q.shape[:-1], Ev)
    is (B, H, L, Ev), (B, L, H, Ev) and (N, L, Ev) alike."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray | None = None,
                 bias: np.ndarray | None = None, is_causal: bool = False, q_offset: object = 0,
                 key_lengths: object = None) -> np.ndarray:
        self.calls.append({"q": q, "k": k, "v": v, "mask": mask, "bias": bias, "is_causal": is_causal,
                           "q_offset": q_offset, "key_lengths": key_lengths})
        return np.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)


def _recorded(layout: str = "BHLE", polarity: str = "keep", *args: object, **keywords: object) -> dict:
    """The one call the kernel gets from adapters.sdpa(layout, polarity)(*args, **keywords)."""
    recorder = Recorder()
    adapters.sdpa(recorder, layout=layout, mask=polarity)(*args, **keywords)
    (call,) = recorder.calls
    return call


# --- layouts ---------------------------------------------------------------------------------------------

# layout -> the shapes of q, k, v the kernel gets for the contract's q (B, H, L, E), k (B, H, S, E), v (B, H, S, Ev)
LAYOUT_SHAPES = {
    "BHLE": ((B, H, L, E), (B, H, S, E), (B, H, S, Ev)),
    "BLHE": ((B, L, H, E), (B, S, H, E), (B, S, H, Ev)),
    "NLE": ((B * H, L, E), (B * H, S, E), (B * H, S, Ev)),
}


def _in_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """(B, H, T, *) -> the layout's array, entry by entry (no transpose, so it cannot share the adapter's)."""
    b, h, t, c = x.shape
    shape = {"BHLE": (b, h, t, c), "BLHE": (b, t, h, c), "NLE": (b * h, t, c)}[layout]
    y = np.empty(shape, x.dtype)
    for i in range(b):
        for j in range(h):
            for p in range(t):
                index = {"BHLE": (i, j, p), "BLHE": (i, p, j), "NLE": (i * h + j, p)}[layout]
                y[index] = x[i, j, p]
    return y


@pytest.mark.parametrize("layout", sorted(LAYOUT_SHAPES))
def test_layout_hands_the_kernel_its_shapes_and_entries(layout: str):
    q, k, v = _qkv(B, H)
    call = _recorded(layout, "keep", q, k, v)
    assert tuple(call[name].shape for name in "qkv") == LAYOUT_SHAPES[layout]
    for name, x in zip("qkv", (q, k, v), strict=True):
        np.testing.assert_array_equal(call[name], _in_layout(x, layout))


@pytest.mark.parametrize("layout", sorted(LAYOUT_SHAPES))
def test_layout_puts_the_kernel_output_back(layout: str):
    # a kernel that returns q (E = Ev) gives q back in the contract's (B, H, L, E)
    q, k, _ = _qkv(B, H)

    def identity(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        return q

    out, weights = adapters.sdpa(identity, layout=layout)(q, k, k)
    np.testing.assert_array_equal(out, q)
    assert weights is None


# layout -> the einsum of the scores and of the value product, each in the layout's own letters
LAYOUT_EINSUMS = {
    "BHLE": ("bhle,bhse->bhls", "bhls,bhsv->bhlv"),
    "BLHE": ("blhe,bshe->bhls", "bhls,bshv->blhv"),
    "NLE": ("nle,nse->nls", "nls,nsv->nlv"),
}


def _layout_kernel(layout: str):
    """softmax(q k^T / sqrt(E) over the kept keys) v, written in the layout's letters; the mask keeps."""
    to_scores, to_out = LAYOUT_EINSUMS[layout]

    def kernel(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray | None = None) -> np.ndarray:
        scores = np.einsum(to_scores, q, k) / math.sqrt(q.shape[-1])  # (B, H, L, S) or (N, L, S)
        scores = scores if mask is None else np.where(mask, scores, -np.inf)
        exp = np.exp(scores - scores.max(axis=-1, keepdims=True))  # every row keeps a key below
        return np.einsum(to_out, exp / exp.sum(axis=-1, keepdims=True), v)

    return kernel


@pytest.mark.parametrize("layout", sorted(LAYOUT_EINSUMS))
def test_layout_kernel_equals_torch_sdpa(layout: str):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    q, k, v = _qkv(B, H)
    mask = _random(B, H, L, S, seed=5) > 0
    mask[..., 0] = True  # every query keeps key 0
    out, _ = adapters.sdpa(_layout_kernel(layout), layout=layout)(q, k, v, mask)
    expected = F.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)), attn_mask=torch.from_numpy(mask))
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-12, atol=1e-12)


# the contract's leading axes (...) -> the kernel's (B, H): the last axis is the heads, the others the batch
@pytest.mark.parametrize(("lead", "folded"), [((), (1, 1)), ((3,), (1, 3)), ((2, 3), (2, 3)), ((2, 2, 3), (4, 3))])
@pytest.mark.parametrize("layout", sorted(LAYOUT_SHAPES))
def test_leading_axes_fold_into_batch_and_heads(layout: str, lead: tuple, folded: tuple):
    q, k, v = _qkv(*lead)
    call = _recorded(layout, "keep", q, k, v)
    b, h = folded
    expected = {"BHLE": (b, h, L, E), "BLHE": (b, L, h, E), "NLE": (b * h, L, E)}[layout]
    assert call["q"].shape == expected
    np.testing.assert_array_equal(call["q"], _in_layout(q.reshape(b, h, L, E), layout))
    out, _ = adapters.sdpa(_layout_kernel(layout), layout=layout)(q, k, v)
    assert out.shape == (*lead, L, Ev)


@pytest.mark.parametrize("layout", sorted(LAYOUT_SHAPES))
def test_leading_axes_of_q_k_v_broadcast(layout: str):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    q, k, v = _random(B, H, L, E), _random(H, S, E, seed=1), _random(B, 1, S, Ev, seed=2)  # k: no batch, v: one head
    call = _recorded(layout, "keep", q, k, v)
    assert tuple(call[name].shape for name in "qkv") == LAYOUT_SHAPES[layout]
    full = [np.broadcast_to(x, (B, H, *x.shape[-2:])) for x in (q, k, v)]
    for name, x in zip("qkv", full, strict=True):
        np.testing.assert_array_equal(call[name], _in_layout(np.array(x), layout))
    out, _ = adapters.sdpa(_layout_kernel(layout), layout=layout)(q, k, v)
    expected = F.scaled_dot_product_attention(*(torch.from_numpy(np.array(x)) for x in full))
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", sorted(LAYOUT_SHAPES))
def test_positions_per_sequence_follow_the_layout(layout: str):
    # q_offset (B, H) and key_lengths (B, 1) broadcast to the scores' (B, H): (B, H) or, folded, (N,)
    q, k, v = _qkv(B, H)
    q_offset, key_lengths = np.arange(B * H).reshape(B, H), np.array([[1], [4]])
    call = _recorded(layout, "keep", q, k, v, q_offset=q_offset, key_lengths=key_lengths)
    if layout == "NLE":
        np.testing.assert_array_equal(call["q_offset"], [0, 1, 2, 3, 4, 5])
        np.testing.assert_array_equal(call["key_lengths"], [1, 1, 1, 4, 4, 4])
    else:
        np.testing.assert_array_equal(call["q_offset"], q_offset)
        np.testing.assert_array_equal(call["key_lengths"], [[1, 1, 1], [4, 4, 4]])
    assert _recorded(layout, "keep", q, k, v, q_offset=2)["q_offset"] == 2  # an int passes as it is


# --- mask polarities --------------------------------------------------------------------------------------

MASK = np.array([[1, 0, 1, 1, 0]] * L)  # (L, S) as 0/1 integers: keys 1 and 4 hidden from every query
BIAS = np.arange(L * S, dtype=np.float64).reshape(L, S) / 10  # (L, S)


@pytest.mark.parametrize("layout", sorted(LAYOUT_SHAPES))
def test_keep_mask_is_boolean_true_where_a_key_is_seen(layout: str):
    q, k, v = _qkv(B, H)
    mask = _recorded(layout, "keep", q, k, v, MASK)["mask"]
    lead = (B * H,) if layout == "NLE" else (B, H)
    assert mask.dtype == np.bool_
    np.testing.assert_array_equal(mask, np.broadcast_to(MASK == 1, (*lead, L, S)))  # (B, H, L, S) in every layout


@pytest.mark.parametrize("layout", sorted(LAYOUT_SHAPES))
def test_mask_per_head_and_per_sequence_keep_their_axes(layout: str):
    # a mask (H, L, S) differs between heads, one (B, 1, 1, S) between sequences: (b, h) reads head h's, sequence b's
    q, k, v = _qkv(B, H)
    per_head, per_sequence = _random(H, L, S, seed=7) > 0, np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])[:, None, None]
    for given, entry in ((per_head, lambda b, h: per_head[h]), (per_sequence, lambda b, h: per_sequence[b, 0])):
        mask = _recorded(layout, "keep", q, k, v, given)["mask"]
        for b in range(B):
            for h in range(H):
                np.testing.assert_array_equal(mask[b * H + h] if layout == "NLE" else mask[b, h],
                                              np.broadcast_to(entry(b, h), (L, S)) != 0)


def test_hide_mask_is_true_where_a_key_is_hidden():
    q, k, v = _qkv(B, H)
    mask = _recorded("BLHE", "hide", q, k, v, MASK)["mask"]
    assert mask.dtype == np.bool_
    np.testing.assert_array_equal(mask, np.broadcast_to(MASK == 0, (B, H, L, S)))


def test_additive_mask_folds_the_bias_in_with_minus_inf_where_hidden():
    q, k, v = (x.astype(np.float32) for x in _qkv(B, H))
    mask = _recorded("BHLE", "additive", q, k, v, MASK, bias=BIAS)["mask"]
    # row i: [BIAS[i, 0], -inf, BIAS[i, 2], BIAS[i, 3], -inf], in q's dtype
    assert mask.dtype == np.float32 and mask.shape == (B, H, L, S)
    expected = np.where(MASK == 1, BIAS, -np.inf).astype(np.float32)
    np.testing.assert_array_equal(mask, np.broadcast_to(expected, (B, H, L, S)))


def test_additive_mask_without_bias_is_zero_where_kept():
    q, k, v = _qkv(B, H)
    mask = _recorded("BHLE", "additive", q, k, v, MASK)["mask"]
    np.testing.assert_array_equal(mask[0, 0, 0], [0.0, -np.inf, 0.0, 0.0, -np.inf])


def test_additive_mask_without_mask_is_the_bias():
    q, k, v = _qkv(B, H)
    mask = _recorded("NLE", "additive", q, k, v, bias=BIAS)["mask"]
    np.testing.assert_array_equal(mask, np.broadcast_to(BIAS, (B * H, L, S)))


def test_no_mask_and_no_bias_reach_the_kernel_as_its_defaults():
    call = _recorded("BHLE", "additive", *_qkv(B, H))
    assert call["mask"] is None and call["bias"] is None


def test_bias_beside_a_keep_mask_arrives_full_in_q_dtype():
    q, k, v = (x.astype(np.float32) for x in _qkv(B, H))
    call = _recorded("BLHE", "keep", q, k, v, MASK, bias=BIAS)
    assert call["bias"].dtype == np.float32
    np.testing.assert_array_equal(call["bias"], np.broadcast_to(BIAS.astype(np.float32), (B, H, L, S)))


@pytest.mark.parametrize("polarity", sorted(adapters.MASKS))
def test_each_polarity_hides_the_same_key(polarity: str):
    # q = [1, 0], k = [[1, 0], [0, 1]], scale 1: scores [1, 0]; hiding key 1 leaves out = v[0] = [2, 3];
    # with bias [0, 1] and no mask the scores are [1, 1] and out = (v[0] + v[1]) / 2 = [3, 4]
    q, k, v = np.array([[1.0, 0.0]]), np.eye(2), np.array([[2.0, 3.0], [4.0, 5.0]])
    hidden = {"keep": False, "hide": True, "additive": -np.inf}[polarity]

    def kernel(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray | None = None,
               scale: float | None = None) -> np.ndarray:
        scores = np.einsum("nle,nse->nls", q, k) * scale
        if polarity == "additive":
            scores = scores + (0.0 if mask is None else mask)
        elif mask is not None:
            scores = np.where(mask == (polarity == "keep"), scores, -np.inf)
        exp = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return np.einsum("nls,nsv->nlv", exp / exp.sum(axis=-1, keepdims=True), v)

    sdpa = adapters.sdpa(kernel, layout="NLE", mask=polarity)
    assert _recorded("NLE", polarity, q, k, v, np.array([True, False]))["mask"][0, 0, 1] == hidden
    np.testing.assert_allclose(sdpa(q, k, v, np.array([True, False]), scale=1.0)[0], [[2.0, 3.0]], rtol=1e-15)
    if polarity == "additive":
        np.testing.assert_allclose(sdpa(q, k, v, bias=np.array([0.0, 1.0]), scale=1.0)[0], [[3.0, 4.0]], rtol=1e-15)


# --- weights, dropout and flags ---------------------------------------------------------------------------

def test_weights_come_back_as_the_scores_leading_axes():
    # q = [1, 0], k = [[1, 0], [0, 1]], scale 1: scores [1, 0], weights [e, 1] / (1 + e) for every (b, h);
    # the kernel returns them (B, H, L, S) in every layout, BLHE too, as it takes the mask
    q, k, v = np.tile([1.0, 0.0], (B, H, 1, 1)), np.tile(np.eye(2), (B, H, 1, 1)), np.ones((B, H, 2, 1))
    given = []

    def kernel(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, dropout_p: float = 0.0, rng: object = None,
               need_weights: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        given.append((dropout_p, rng, need_weights))
        scores = np.einsum("blhe,bshe->bhls", q, k)  # (B, L, H, E) x (B, S, H, E) -> (B, H, L, S)
        weights = np.exp(scores) / np.exp(scores).sum(axis=-1, keepdims=True)
        return np.einsum("bhls,bshv->blhv", weights, v), weights if need_weights else None

    sdpa = adapters.sdpa(kernel, layout="BLHE")
    out, weights = sdpa(q, k, v, dropout_p=0.25, rng=7)
    e = math.e
    np.testing.assert_allclose(weights, np.broadcast_to([e / (1 + e), 1 / (1 + e)], (B, H, 1, 2)), rtol=1e-15)
    np.testing.assert_allclose(out, np.ones((B, H, 1, 1)), rtol=1e-15)  # v = 1: the weights sum to 1
    assert sdpa(q, k, v, need_weights=False)[1] is None
    assert given == [(0.25, 7, True), (0.0, None, False)]


def test_is_causal_reaches_the_kernel_only_when_set():
    q, k, v = _qkv(B, H)
    assert _recorded("BLHE", "keep", q, k, v, is_causal=True)["is_causal"] is True
    assert _recorded("BLHE", "keep", q, k, v)["is_causal"] is False  # the kernel's own default


# --- grouped heads --------------------------------------------------------------------------------------

class GroupedRecorder(Recorder):
    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray | None = None,
                 enable_gqa: bool = False) -> np.ndarray:
        self.calls.append({"q": q, "k": k, "v": v, "mask": mask, "enable_gqa": enable_gqa})
        return np.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)


@pytest.mark.parametrize(("layout", "shapes"), [
    ("BHLE", ((B, 4, L, E), (B, 2, S, E), (B, 2, S, Ev))),
    ("BLHE", ((B, L, 4, E), (B, S, 2, E), (B, S, 2, Ev))),
])
def test_grouped_heads_give_the_kernel_k_and_v_with_hkv_heads(layout: str, shapes: tuple):
    q, k, v = _random(B, 4, L, E), _random(B, 2, S, E, seed=1), _random(B, 2, S, Ev, seed=2)  # H = 4, Hkv = 2
    mask = _random(4, L, S, seed=3) > 0  # one mask per query head
    recorder = GroupedRecorder()
    out, _ = adapters.sdpa(recorder, layout=layout)(q, k, v, mask, enable_gqa=True)
    (call,) = recorder.calls
    assert tuple(call[name].shape for name in "qkv") == shapes
    assert call["enable_gqa"] is True
    np.testing.assert_array_equal(call["k"], _in_layout(k, layout))
    np.testing.assert_array_equal(call["mask"], np.broadcast_to(mask, (B, 4, L, S)))  # it follows the query heads
    assert out.shape == (B, 4, L, Ev)


@pytest.mark.parametrize("layout", ["BHLE", "BLHE"])
def test_grouped_heads_equal_torch_enable_gqa(layout: str):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    q, k, v = (torch.from_numpy(x) for x in (_random(B, 4, L, E), _random(B, 2, S, E, seed=1),
                                              _random(B, 2, S, Ev, seed=2)))
    to_kernel = (lambda x: x) if layout == "BHLE" else (lambda x: x.transpose(1, 2))  # (B, H, T, *) <-> (B, T, H, *)

    def kernel(q: object, k: object, v: object, *, enable_gqa: bool = False) -> object:
        return to_kernel(F.scaled_dot_product_attention(*map(to_kernel, (q, k, v)), enable_gqa=enable_gqa))

    out, _ = adapters.sdpa(kernel, layout=layout)(q, k, v, enable_gqa=True)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_nle_refuses_a_kernel_that_groups_heads():
    with pytest.raises(ValueError, match="enable_gqa"):
        adapters.sdpa(GroupedRecorder(), layout="NLE")


# --- the declaration and refused keywords ---------------------------------------------------------------

def _causal_only(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, is_causal: bool = False) -> np.ndarray:
    return np.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)


def _everything(q: object, k: object, v: object, *, mask: object = None, bias: object = None, is_causal: bool = False,
                scale: float | None = None, q_offset: object = 0, window: object = None, key_lengths: object = None,
                softcap: float | None = None, enable_gqa: bool = False, mask_mod: object = None,
                score_mod: object = None, dropout_p: float = 0.0, rng: object = None,
                need_weights: bool = True) -> tuple:
    return q, None


def test_declaration_lists_what_the_signature_does_not_name():
    assert set(adapters.sdpa(_causal_only).declaration.lacks) == {
        "mask", "bias", "scale", "q_offset", "window", "key_lengths", "softcap", "enable_gqa", "mods", "score_mod",
        "dropout", "weights", "sinks", "alibi_slopes"}
    # sinks and alibi_slopes: the adapter lays out neither for a kernel, so every adapted kernel lacks them
    assert adapters.sdpa(_everything).declaration == Declaration(dict.fromkeys(("sinks", "alibi_slopes"),
                                                                               "the adapter passes none"))


def test_declaration_of_an_additive_mask_has_the_bias():
    def additive(q: object, k: object, v: object, *, mask: object = None) -> object:
        return q

    lacks = set(adapters.sdpa(additive, mask="additive").declaration.lacks)
    assert "mask" not in lacks and "bias" not in lacks
    assert "bias" in adapters.sdpa(additive, mask="keep").declaration.lacks


@pytest.mark.parametrize(("keywords", "named"), [
    ({"scale": 0.5}, "scale"), ({"bias": np.zeros((L, S))}, "bias"), ({"dropout_p": 0.1}, "dropout_p"),
    ({"window": (1, 0)}, "window"), ({"q_offset": 1}, "q_offset"),
])
def test_keyword_the_kernel_does_not_take_raises_naming_it(keywords: dict, named: str):
    with pytest.raises(ValueError, match=named):
        adapters.sdpa(_causal_only)(*_qkv(B, H), **keywords)


def test_keywords_at_their_defaults_reach_no_kernel():
    out, _ = adapters.sdpa(_causal_only)(*_qkv(B, H), None, bias=None, scale=None, q_offset=0, window=None,
                                         dropout_p=0.0, enable_gqa=False)
    assert out.shape == (B, H, L, Ev)


# --- the contract's errors, before the kernel runs -------------------------------------------------------

@pytest.mark.parametrize(("arrays", "keywords", "error", "words"), [
    ((_random(L, E), _random(S, E + 1), _random(S, Ev)), {}, ValueError, ["q", "k", "(4, 2)", "(5, 3)"]),
    ((_random(L, E), _random(S, E), _random(S + 1, Ev)), {}, ValueError, ["k", "v", "(5, 2)", "(6, 3)"]),
    ((_random(2, L, E), _random(3, S, E), _random(3, S, Ev)), {}, ValueError, ["leading axes", "(2, 4, 2)"]),
    ((_random(L, E), _random(S, E), _random(S, Ev)), {"mask": np.ones((L, S + 1))}, ValueError, ["mask", "(4, 6)"]),
    ((_random(L, E), _random(S, E), _random(S, Ev)), {"mask": np.full((L, S), 0.5)}, ValueError, ["mask", "bias="]),
    ((_random(L, E), _random(S, E), _random(S, Ev).astype(np.float32)), {}, TypeError, ["q, k, v", "float32"]),
    ((np.ones((L, E), int), np.ones((S, E), int), np.ones((S, Ev), int)), {}, TypeError, ["floating"]),
    ((_random(L, 0), _random(S, 0), _random(S, Ev)), {}, ValueError, ["E = 0", "(4, 0)", "(5, 0)"]),
])
def test_bad_input_raises_the_contract_error(arrays: tuple, keywords: dict, error: type, words: list):
    recorder = Recorder()
    with pytest.raises(error) as raised:
        adapters.sdpa(recorder)(*arrays, **keywords)
    assert all(word in str(raised.value) for word in words), str(raised.value)
    assert recorder.calls == []  # refused before the kernel saw it


def test_grouped_heads_that_do_not_divide_raise_naming_the_shapes():
    q, k, v = _random(B, 3, L, E), _random(B, 2, S, E), _random(B, 2, S, Ev)
    with pytest.raises(ValueError, match=r"\(2, 3, 4, 2\).*\(2, 2, 5, 2\)"):
        adapters.sdpa(GroupedRecorder())(q, k, v, enable_gqa=True)


def test_unknown_layout_and_polarity_are_refused():
    with pytest.raises(ValueError, match="layout"):
        adapters.sdpa(_causal_only, layout="LBHE")
    with pytest.raises(ValueError, match="mask"):
        adapters.sdpa(_causal_only, mask="boolean")


# --- vjp ------------------------------------------------------------------------------------------------

def _torch_blhe_kernel(q: object, k: object, v: object, *, mask: object = None, bias: object = None) -> object:
    """softmax(q k^T / sqrt(E) + bias over the kept keys) v, by hand in torch on (B, L, H, E)."""
    import torch

    scores = torch.einsum("blhe,bshe->bhls", q, k) / math.sqrt(q.shape[-1]) + bias  # (B, H, L, S)
    weights = torch.softmax(torch.where(mask, scores, -math.inf), dim=-1)  # every row keeps a key below
    return torch.einsum("bhls,bshv->blhv", weights, v)  # (B, H, L, S) x (B, S, H, Ev) -> (B, L, H, Ev)


def _vjp_inputs(width: int = Ev) -> tuple[np.ndarray, ...]:
    """q, k, v (B, H, T, *) with v of `width`, a mask that keeps key 2 for every query, a bias (H, L, S), d_out."""
    q, k, v = _qkv(B, H, seed=10)
    mask = _random(B, H, L, S, seed=13) > 0
    mask[..., 2] = True  # every query keeps key 2
    return q, k, v[..., :width], mask, _random(H, L, S, seed=14), _random(B, H, L, width, seed=15)


def _torch_reference(q, k, v, mask, bias, d_out) -> tuple[np.ndarray, ...]:
    """F.scaled_dot_product_attention's out and autograd gradients (dq, dk, dv, dbias)."""
    import torch

    F = torch.nn.functional
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, bias)]
    out = F.scaled_dot_product_attention(*leaves[:3], attn_mask=torch.where(torch.from_numpy(mask), leaves[3],
                                                                            -math.inf))
    out.backward(torch.from_numpy(d_out))
    return out.detach().numpy(), *(leaf.grad.numpy() for leaf in leaves)


def test_vjp_gives_torch_autograd_gradients_of_sdpa():
    torch = pytest.importorskip("torch")
    q, k, v, mask, bias, d_out = _vjp_inputs()
    vjp = adapters.vjp(adapters.sdpa(_torch_blhe_kernel, layout="BLHE"))
    out, weights, pullback = vjp(*map(torch.from_numpy, (q, k, v, mask)), bias=torch.from_numpy(bias))
    expected_out, *expected_grads = _torch_reference(q, k, v, mask, bias, d_out)
    assert weights is None
    np.testing.assert_allclose(out.numpy(), expected_out, rtol=1e-12, atol=1e-12)
    grads = pullback(torch.from_numpy(d_out))
    assert [g.shape for g in grads] == [x.shape for x in (q, k, v, bias)]
    for grad, expected in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_vjp_works_inside_inference_mode():
    torch = pytest.importorskip("torch")
    q, k, v, mask, bias, d_out = _vjp_inputs()
    _, *expected_grads = _torch_reference(q, k, v, mask, bias, d_out)
    vjp = adapters.vjp(adapters.sdpa(_torch_blhe_kernel, layout="BLHE"))
    with torch.inference_mode():
        arrays = [torch.from_numpy(x).clone() for x in (q, k, v, mask, bias, d_out)]  # inference tensors
        _, _, pullback = vjp(*arrays[:4], bias=arrays[4])
        grads = pullback(arrays[5])
    for grad, expected in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_vjp_without_bias_gives_none_for_it_and_checks_d_out():
    torch = pytest.importorskip("torch")
    q, k, v, _, _, d_out = _vjp_inputs()

    def values_only(q: object, k: object, v: object) -> object:  # out = 2 v[..., :L, :]: no gradient for q or k
        return 2 * v[..., :L, :]

    _, _, pullback = adapters.vjp(adapters.sdpa(values_only))(*map(torch.from_numpy, (q, k, v)))
    dq, dk, dv, dbias = pullback(torch.from_numpy(d_out))
    assert dbias is None
    np.testing.assert_array_equal(dq.numpy(), np.zeros_like(q))  # unused: zeros, not None
    np.testing.assert_array_equal(dk.numpy(), np.zeros_like(k))
    np.testing.assert_array_equal(dv.numpy()[..., :L, :], 2 * d_out)
    np.testing.assert_array_equal(dv.numpy()[..., L:, :], 0.0)
    with pytest.raises(ValueError, match="d_out"):
        pullback(torch.from_numpy(d_out[..., :2]))


def test_vjp_with_jax_dot_product_attention_equals_jax_vjp():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, mask, bias, d_out = _vjp_inputs(width=E)  # jax.nn: Ev = E

    def kernel(q: object, k: object, v: object, *, mask: object = None, bias: object = None) -> object:
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask)  # (B, T, N, H): BLHE

    def to_blhe(x: object) -> object:  # the contract's (B, H, T, *) as jax.nn's (B, T, H, *), and back
        return jnp.swapaxes(x, 1, 2)

    def direct(q: object, k: object, v: object, bias: object) -> object:
        full_bias = jnp.broadcast_to(bias, (B, H, L, S))  # jax.nn: a bias (B, H, L, S)
        return to_blhe(jax.nn.dot_product_attention(*map(to_blhe, (q, k, v)), bias=full_bias, mask=jnp.asarray(mask)))

    sdpa = adapters.sdpa(kernel, layout="BLHE")
    arrays = [jnp.asarray(x) for x in (q, k, v, mask, bias, d_out)]
    with jax.numpy_dtype_promotion("standard"):  # jax.nn mixes float32 into float64 itself (test_against_jax.py)
        out, _, pullback = adapters.vjp(sdpa)(*arrays[:4], bias=arrays[4])
        grads = pullback(arrays[5])
        expected_out, direct_vjp = jax.vjp(direct, *arrays[:3], arrays[4])
        expected_grads = direct_vjp(arrays[5])
        jitted = jax.jit(lambda q, k, v, mask, bias: sdpa(q, k, v, mask, bias=bias)[0])(*arrays[:5])
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected_out), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(expected_out), rtol=1e-12, atol=1e-12)
    for grad, expected in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-10, atol=1e-12)
    pytest.importorskip("torch")  # and equal torch's autograd of F.scaled_dot_product_attention, within float32:
    _, *torch_grads = _torch_reference(q, k, v, mask, bias, d_out)  # jax.nn's softmax is float32 (test_against_jax)
    for grad, expected in zip(grads, torch_grads, strict=True):
        np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-6)


def test_boolean_jax_mask_under_strict_promotion():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, mask, _, _ = _vjp_inputs()
    call = _recorded("BLHE", "keep", *map(jnp.asarray, (q, k, v, mask)))
    np.testing.assert_array_equal(np.asarray(call["mask"]), mask)


def test_vjp_of_numpy_arrays_is_refused():
    with pytest.raises(TypeError, match="torch or JAX"):
        adapters.vjp(adapters.sdpa(_causal_only))(*_qkv(B, H))


# --- mask and score functions ----------------------------------------------------------------------------

def _torch_modded_kernel(q: object, k: object, v: object, *, mask_mod: object = None,
                         score_mod: object = None) -> object:
    """Attention in torch on (B, H, L, E), the mods called with torch's index arrays over the whole grid."""
    import torch

    Bq, Hq, Lq, Eq = q.shape
    b, h, i, j = (torch.arange(n).reshape([n if axis == place else 1 for axis in range(4)])
                  for place, n in enumerate((Bq, Hq, Lq, k.shape[-2])))  # (B, 1, 1, 1) .. (1, 1, 1, S)
    scores = q @ k.transpose(-2, -1) / math.sqrt(Eq)  # (B, H, L, E) x (B, H, E, S) -> (B, H, L, S)
    scores = scores if score_mod is None else score_mod(scores, b, h, i, j)
    scores = scores if mask_mod is None else torch.where(mask_mod(b, h, i, j), scores, -math.inf)
    return torch.softmax(scores, dim=-1) @ v  # (B, H, L, S) x (B, H, S, Ev) -> (B, H, L, Ev)


def test_mods_reach_a_kernel_that_takes_them_and_their_parameters_get_gradients():
    torch = pytest.importorskip("torch")
    from attention_np.common import mods
    from conformance.contract import oracle

    q, k, v = _qkv(B, H)
    slopes, d_out = np.array([0.5, 0.25, 0.125]), _random(B, H, L, Ev, seed=9)
    mask_mod, score_mod = mods.causal(1), mods.alibi(slopes)
    sdpa = adapters.sdpa(_torch_modded_kernel)
    assert sdpa.declaration == Declaration({name: "the kernel takes no such argument" for name in (
        "mask", "bias", "is_causal", "scale", "q_offset", "window", "key_lengths", "softcap", "enable_gqa", "dropout",
        "weights")} | dict.fromkeys(("sinks", "alibi_slopes"), "the adapter passes none"))
    out, _, pullback = adapters.vjp(sdpa)(*map(torch.from_numpy, (q, k, v)), mask_mod=mask_mod, score_mod=score_mod)
    expected, _ = oracle.sdpa(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-12)
    *grads, d_score_mod = pullback(torch.from_numpy(d_out))
    assert [grad.shape for grad in grads[:3]] == [x.shape for x in (q, k, v)] and grads[3] is None
    step = 1e-6  # d <d_out, out> / d slopes[h], by central differences of the oracle
    for head in range(H):
        shift = np.eye(H)[head] * step
        up, down = (oracle.sdpa(q, k, v, mask_mod=mask_mod, score_mod=mods.alibi(slopes + sign * shift))[0]
                    for sign in (1, -1))
        np.testing.assert_allclose(d_score_mod["slopes"].numpy()[head], np.sum(d_out * (up - down)) / (2 * step),
                                   rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="four axes"):
        sdpa(*_qkv(B), mask_mod=mask_mod)  # three axes: refused before the kernel runs


def test_mods_in_layout_nle_are_refused():
    with pytest.raises(ValueError, match=r"NLE.*mask_mod"):
        adapters.sdpa(_torch_modded_kernel, layout="NLE")
