"""The catalogue of score and mask functions (attention_np/common/mods.py) and the block masks made from them
(attention_np/common/block_mask.py), on their own: each entry's formula by hand on a tiny grid of indices, in
NumPy, torch and JAX alike; each entry against attn-gym's own mask and score functions where it has one, and the
combinators against torch's; each ScoreMod's vjp against central differences; create_block_mask's tiles against
a dense evaluation, its counts and sparsity against torch's BlockMask, its picture, the bounded evaluation of the
mask function, and its errors; and flex_attention against ONNX's preview FlexAttention operator."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import attention_np
from attention_np.common import block_mask as blocks
from attention_np.common import mods, validation
from attention_np.common.records import Structure
from tests.conftest import import_backend

FRAMEWORKS = ("numpy", "torch", "jax")


def _namespace(framework: str) -> ModuleType:
    """The framework's array module (numpy, torch or jax.numpy), or a skip when it is not installed."""
    if framework == "jax":
        return pytest.importorskip("jax.numpy")
    return pytest.importorskip(framework)


def _indices(xp: ModuleType, B: int, H: int, L: int, S: int) -> tuple[Any, Any, Any, Any]:
    """b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, L, 1), kv_idx (1, 1, 1, S) in xp's integers, as a kernel's
    tile has them."""
    return (xp.reshape(xp.arange(B), (B, 1, 1, 1)), xp.reshape(xp.arange(H), (1, H, 1, 1)),
            xp.reshape(xp.arange(L), (1, 1, L, 1)), xp.reshape(xp.arange(S), (1, 1, 1, S)))


def _dense(mask_mod: Callable[..., Any], B: int, H: int, L: int, S: int, framework: str = "numpy") -> np.ndarray:
    """mask_mod over the whole (B, H, L, S) grid, as NumPy booleans."""
    visible = mask_mod(*_indices(_namespace(framework), B, H, L, S))
    return np.broadcast_to(np.asarray(visible), (B, H, L, S))


def _matrix(*rows: str) -> np.ndarray:
    """A hand-written mask: one string of 0 and 1 per query, one character per key."""
    return np.array([[char == "1" for char in row] for row in rows])


# --- each entry's formula by hand ------------------------------------------------------------------------------
# (name, mask_mod, (B, H, L, S), the expected mask: (L, S) for every b and h, or (B, H, L, S)); i the query, j the key
HAND_MASKS = [
    ("causal", mods.causal(), (1, 1, 4, 5),  # j <= i
     _matrix("10000", "11000", "11100", "11110")),
    ("causal_offset", mods.causal(q_offset=1), (1, 1, 4, 5),  # j <= i + 1
     _matrix("11000", "11100", "11110", "11111")),
    ("causal_per_sequence", mods.causal(q_offset=np.array([0, 2])), (2, 1, 4, 5),  # j <= i + [0, 2][b]
     np.stack([_matrix("10000", "11000", "11100", "11110"),
               _matrix("11100", "11110", "11111", "11111")])[:, None]),
    ("sliding_window", mods.sliding_window(1, 0), (1, 1, 4, 5),  # i - 1 <= j <= i
     _matrix("10000", "11000", "01100", "00110")),
    ("sliding_window_offset", mods.sliding_window(1, 1, q_offset=1), (1, 1, 4, 5),  # i <= j <= i + 2
     _matrix("11100", "01110", "00111", "00011")),
    ("sliding_window_no_left", mods.sliding_window(None, 1), (1, 1, 4, 5),  # j <= i + 1
     _matrix("11000", "11100", "11110", "11111")),
    ("sliding_window_no_right", mods.sliding_window(0, None), (1, 1, 4, 5),  # j >= i
     _matrix("11111", "01111", "00111", "00011")),
    ("key_lengths", mods.key_lengths(np.array([2, 4])), (2, 1, 2, 5),  # j < [2, 4][b]
     np.stack([_matrix("11000", "11000"), _matrix("11110", "11110")])[:, None]),
    ("key_lengths_per_head", mods.key_lengths(np.array([[1, 3]])), (1, 2, 2, 5),  # j < [1, 3][h]
     np.stack([_matrix("10000", "10000"), _matrix("11100", "11100")])[None]),
    ("key_lengths_zero", mods.key_lengths(0), (1, 1, 2, 3), _matrix("000", "000")),
    ("document", mods.document(np.array([0, 0, 1, 1])), (1, 1, 4, 4),  # segment ids 0 0 1 1
     _matrix("1100", "1100", "0011", "0011")),
    ("document_cross", mods.document(np.array([1, 2]), np.array([0, 1, 1, 2])), (1, 1, 2, 4),
     _matrix("0110", "0001")),
    ("document_per_sequence", mods.document(np.array([[0, 0, 1], [0, 1, 1]])), (2, 1, 3, 3),
     np.stack([_matrix("110", "110", "001"), _matrix("100", "011", "011")])[:, None]),
    ("prefix_lm", mods.prefix_lm(2), (1, 1, 5, 5),  # j <= i or j < 2
     _matrix("11000", "11000", "11100", "11110", "11111")),
    ("prefix_lm_per_sequence", mods.prefix_lm(np.array([0, 3])), (2, 1, 4, 4),  # j <= i or j < [0, 3][b]
     np.stack([_matrix("1000", "1100", "1110", "1111"), _matrix("1110", "1110", "1110", "1111")])[:, None]),
    ("chunked", mods.chunked(2), (1, 1, 5, 5),  # j <= i and i // 2 == j // 2
     _matrix("10000", "11000", "00100", "00110", "00001")),
    ("dilated", mods.dilated(2, 2), (1, 1, 6, 6),  # i - j in {0, 2}
     _matrix("100000", "010000", "101000", "010100", "001010", "000101")),
    ("noop", mods.noop_mask, (1, 1, 2, 3), _matrix("111", "111")),
    ("and_none", mods.and_masks(), (1, 1, 2, 3), _matrix("111", "111")),
    ("or_none", mods.or_masks(), (1, 1, 2, 3), _matrix("000", "000")),
    ("and", mods.and_masks(mods.causal(), mods.document(np.array([0, 0, 1, 1]))), (1, 1, 4, 4),
     _matrix("1000", "1100", "0010", "0011")),
    ("or", mods.or_masks(mods.causal(), mods.key_lengths(3)), (1, 1, 4, 4),  # j <= i or j < 3
     _matrix("1110", "1110", "1110", "1111")),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(("name", "mask_mod", "shape", "expected"), HAND_MASKS, ids=[c[0] for c in HAND_MASKS])
def test_each_mask_function_is_its_formula(name, mask_mod, shape, expected, framework):
    assert np.array_equal(_dense(mask_mod, *shape, framework), np.broadcast_to(expected, shape)), name


def _scores(framework: str, values: np.ndarray) -> Any:
    xp = _namespace(framework)
    return xp.asarray(values)


TABLE = np.array([[10.0, 20.0, 30.0]])  # (H, 2R + 1), R = 1: distances -1, 0, 1 and beyond
# (name, score_mod, (B, H, L, S), the scores given, the scores expected)
HAND_SCORES = [
    # slopes [0.5, 2] times j - i: head 0 [[0, .5, 1], [-.5, 0, .5]], head 1 four times those
    ("alibi", mods.alibi(np.array([0.5, 2.0])), (1, 2, 2, 3), np.ones((1, 2, 2, 3)),
     1 + np.array([[[[0, 0.5, 1], [-0.5, 0, 0.5]], [[0, 2, 4], [-2, 0, 2]]]])),
    # 2 tanh(s / 2): 0 -> 0, 2 -> 2 tanh 1, -2 -> -2 tanh 1, 200 -> 2 (tanh 100 is 1 in float64)
    ("softcap", mods.softcap(2.0), (1, 1, 1, 4), np.array([[[[0.0, 2.0, -2.0, 200.0]]]]),
     np.array([[[[0.0, 2 * math.tanh(1), -2 * math.tanh(1), 2.0]]]])),
    # table[0, clip(j - i, -1, 1) + 1]: query 0: 20 30 30 30; query 1: 10 20 30 30; query 2: 10 10 20 30
    ("relative_bias", mods.relative_bias(TABLE), (1, 1, 3, 4), np.zeros((1, 1, 3, 4)),
     np.array([[[[20, 30, 30, 30], [10, 20, 30, 30], [10, 10, 20, 30]]]], dtype=float)),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(("name", "score_mod", "shape", "scores", "expected"), HAND_SCORES,
                         ids=[c[0] for c in HAND_SCORES])
def test_each_score_function_is_its_formula(name, score_mod, shape, scores, expected, framework):
    xp = _namespace(framework)
    new = score_mod(_scores(framework, scores), *_indices(xp, *shape))
    assert np.asarray(new).dtype == np.float64, name  # the scores' dtype: a parameter does not promote them
    np.testing.assert_allclose(np.asarray(new), expected, rtol=1e-15, atol=0, err_msg=name)


def test_the_position_keywords_are_the_catalogues_entries_composed():
    """mods.from_keywords, the one function behind is_causal, q_offset, window, key_lengths and softcap: on a
    hand-written grid (p_i = i + 1: causal j <= i + 1, window (1, None) j >= i, key_lengths 3 j < 3), with
    per-sequence values laid out against the scores (Aligned), and nothing where no keyword is given."""
    structure = Structure(is_causal=True, q_offset=1, window=(1, None), key_lengths=3)
    mask_mod, score_mod = mods.from_keywords(structure, 2.0)
    q_idx, kv_idx = np.arange(3)[:, None], np.arange(4)
    expected = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 0]], bool)
    np.testing.assert_array_equal(mask_mod(None, None, q_idx, kv_idx), expected)
    np.testing.assert_allclose(score_mod(np.array([0.0, 2.0]), None, None, None, None), 2 * np.tanh([0.0, 1.0]),
                               rtol=1e-15)
    per_sequence = structure._replace(q_offset=mods.Aligned(np.array([1, 0])[:, None, None]),
                                      key_lengths=mods.Aligned(np.array([3, 1])[:, None, None]))
    got = mods.from_keywords(per_sequence)[0](None, None, q_idx, kv_idx)  # (2, 3, 4)
    np.testing.assert_array_equal(got[0], expected)
    np.testing.assert_array_equal(got[1], [[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # p_i = i: i - 1 <= j < 1
    assert mods.from_keywords(Structure(is_causal=False, q_offset=5, window=None, key_lengths=None)) == (None, None)


def test_a_float64_parameter_keeps_float32_scores_float32():
    scores = np.zeros((1, 2, 2, 3), dtype=np.float32)
    for mod in (mods.alibi(np.array([0.5, 2.0])), mods.relative_bias(np.zeros((2, 3))), mods.softcap(2.0)):
        assert mod(scores, *_indices(np, 1, 2, 2, 3)).dtype == np.float32, mod


def test_a_torch_parameter_that_requires_grad_stays_in_its_graph_without_a_warning():
    # the parameter is the framework's own tensor: kept as it is (torch.asarray would warn about requires_grad)
    torch = pytest.importorskip("torch")
    slopes = torch.tensor([0.5, 2.0], dtype=torch.float64, requires_grad=True)
    scores = torch.zeros((1, 2, 2, 3), dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = mods.alibi(slopes)(scores, *_indices(torch, 1, 2, 2, 3))
    out.sum().backward()
    torch.testing.assert_close(slopes.grad, torch.tensor([3.0, 3.0], dtype=torch.float64))  # sum of j - i


# --- against attn-gym's mask and score functions and torch's combinators ---------------------------------------
B, H, L = 2, 4, 12
LENGTHS = [3, 5, 4]  # three packed documents of 12 positions


ATTN_GYM = ("causal", "sliding_window", "symmetric_window", "prefix_lm", "document", "document_causal",
            "packed_causal", "dilated")


def _attn_gym_pairs() -> dict[str, tuple[Any, Any]]:
    """{name: (ours, attn-gym's)} for every entry attn-gym has."""
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    masks = pytest.importorskip("attn_gym.masks")
    from attn_gym.masks.document_mask import length_to_offsets

    offsets = length_to_offsets(LENGTHS, "cpu")
    ids = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    pairs = [
        ("causal", mods.causal(), masks.causal_mask),
        ("sliding_window", mods.sliding_window(3, 0), masks.generate_sliding_window(3)),  # q - kv <= 3, causal
        ("symmetric_window", mods.sliding_window(2, 2),  # |q - kv| <= 2, without global tokens
         masks.generate_global_sliding_window(2, torch.zeros(L, dtype=torch.bool))),
        ("prefix_lm", mods.prefix_lm(4), masks.generate_prefix_lm_mask(4)),
        ("document", mods.document(ids), masks.generate_doc_mask_mod(flex.noop_mask, offsets)),
        ("document_causal", mods.and_masks(mods.document(ids), mods.causal()),
         masks.generate_doc_mask_mod(masks.causal_mask, offsets)),
        ("packed_causal", mods.and_masks(mods.causal(), mods.document(ids)),
         masks.generate_packed_causal_doc_mask_mod(offsets)),
        # attn-gym's window is symmetric, |i - j| <= window_size: ours is its causal half, `window` keys back
        ("dilated", mods.dilated(3, 2),
         flex.and_masks(masks.generate_dilated_sliding_window((3 - 1) * 2, 2), masks.causal_mask)),
    ]
    return {name: (ours, theirs) for name, ours, theirs in pairs}


@pytest.mark.parametrize("name", ATTN_GYM)
def test_each_mask_function_equals_attn_gyms(name):
    ours, theirs = _attn_gym_pairs()[name]
    assert np.array_equal(_dense(ours, B, H, L, L, "torch"), _dense(theirs, B, H, L, L, "torch")), name


def test_alibi_and_softcap_equal_attn_gyms_score_functions():
    torch = pytest.importorskip("torch")
    score_mods = pytest.importorskip("attn_gym.mods")
    b, h, q_idx, kv_idx = _indices(torch, B, H, L, L)
    for dtype in (torch.float32, torch.float64):
        scores = torch.randn(B, H, L, L, dtype=dtype, generator=torch.Generator().manual_seed(0))
        # attn-gym's slope of head h: 2^(-(h + 1) 8 / H), here powers of two, exact in every dtype
        slopes = 2.0 ** (-(np.arange(H) + 1) * 8 / H)
        for ours, theirs in ((mods.alibi(slopes), score_mods.generate_alibi_bias(H)),
                             (mods.softcap(3.0), score_mods.generate_tanh_softcap(3.0))):
            new, expected = ours(scores, b, h, q_idx, kv_idx), theirs(scores, b, h, q_idx, kv_idx)
            assert new.dtype == expected.dtype == dtype and torch.equal(new, expected), (ours, dtype)


def test_the_combinators_equal_torchs():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    rng = np.random.default_rng(0)
    entries = [mods.causal(), mods.sliding_window(2, 1), mods.key_lengths(np.array([7, 12])), mods.chunked(4),
               mods.prefix_lm(3), mods.dilated(2, 3), mods.document(rng.integers(0, 3, (B, L)))]
    for draw in range(20):  # random compositions, nested one level
        parts = [entries[i] for i in rng.choice(len(entries), size=rng.integers(0, 4), replace=False)]
        inner = [entries[i] for i in rng.choice(len(entries), size=2, replace=False)]
        ours = (mods.and_masks if draw % 2 else mods.or_masks)(*parts, mods.or_masks(*inner))
        theirs = (flex.and_masks if draw % 2 else flex.or_masks)(*parts, flex.or_masks(*inner))
        assert np.array_equal(_dense(ours, B, H, L, L, "torch"), _dense(theirs, B, H, L, L, "torch")), ours
    assert np.array_equal(_dense(mods.noop_mask, B, H, L, L, "torch"), _dense(flex.noop_mask, B, H, L, L, "torch"))
    for combine, theirs in ((mods.and_masks, flex.and_masks), (mods.or_masks, flex.or_masks)):
        assert np.array_equal(_dense(combine(), B, H, L, L, "torch"), _dense(theirs(), B, H, L, L, "torch"))


# --- ScoreMod.vjp against central differences ------------------------------------------------------------------
STEP = 1e-6  # central differences in float64: truncation ~STEP^2, rounding ~1e-16 / STEP


def _loss(mod: mods.ScoreMod, d_new: np.ndarray, scores: np.ndarray, grid: tuple) -> float:
    return float(np.sum(d_new * mod(scores, *grid)))


@pytest.mark.parametrize("mod", [mods.alibi(np.array([0.5, -0.25, 1.0])), mods.softcap(1.5),
                                 mods.relative_bias(np.random.default_rng(1).standard_normal((3, 5)))],
                         ids=["alibi", "softcap", "relative_bias"])
def test_the_vjp_of_each_score_function_is_its_derivative(mod):
    rng = np.random.default_rng(0)
    grid = _indices(np, 2, 3, 4, 7)  # distances -3 .. 6: relative_bias's reach 2 is clipped both ways
    scores, d_new = rng.standard_normal((2, 2, 3, 4, 7))
    d_scores, d_parameters = mod.vjp(d_new, scores, *grid)
    # the rule is elementwise in the score: d score = d_new * (f(s + t) - f(s - t)) / 2t, entry by entry
    numeric = d_new * (mod(scores + STEP, *grid) - mod(scores - STEP, *grid)) / (2 * STEP)
    np.testing.assert_allclose(d_scores, numeric, rtol=1e-8, atol=1e-9)
    assert set(d_parameters) == set(mod.parameters)
    for name, value in mod.parameters.items():
        numeric = np.zeros(np.shape(value))
        for index in np.ndindex(numeric.shape):  # d loss / d parameter[index], one entry at a time
            step = np.zeros(np.shape(value))
            step[index] = STEP
            numeric[index] = (_loss(mod.replace(**{name: value + step}), d_new, scores, grid)
                              - _loss(mod.replace(**{name: value - step}), d_new, scores, grid)) / (2 * STEP)
        assert d_parameters[name].shape == np.shape(value)
        np.testing.assert_allclose(d_parameters[name], numeric, rtol=1e-8, atol=1e-8, err_msg=name)


# --- block masks -----------------------------------------------------------------------------------------------

def _expected_tiles(dense: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """Each tile's kind from the dense mask, one tile at a time (the last ones shorter)."""
    B, H, L, S = dense.shape
    tiles = np.empty((B, H, -(-L // block_q), -(-S // block_k)), dtype=np.uint8)
    for b, h, row, column in np.ndindex(*tiles.shape):
        tile = dense[b, h, row * block_q:(row + 1) * block_q, column * block_k:(column + 1) * block_k]
        tiles[b, h, row, column] = blocks.FULL if tile.all() else blocks.PARTIAL if tile.any() else blocks.EMPTY
    return tiles


def _random_mask(rng: np.random.Generator, B: int, H: int, L: int, S: int) -> np.ndarray:
    """Booleans (B, H, L, S) with regions all True, all False and mixed, cells of 3 x 2 entries, so that tiles of
    every kind appear."""
    kinds = rng.integers(0, 3, (B, H, -(-L // 3), -(-S // 2)))
    kinds = np.repeat(np.repeat(kinds, 3, axis=2), 2, axis=3)[:, :, :L, :S]
    return np.where(kinds == 2, True, np.where(kinds == 0, False, rng.random((B, H, L, S)) < 0.5))


SIZES = [(1, 1), (3, 2), (4, 4), (5, 7), (16, 16), 4]  # tiles that do and do not divide L = 12 and S = 10


@pytest.mark.parametrize("backend", ["attention_np", "attention_torch"])
@pytest.mark.parametrize("block_size", SIZES, ids=str)
@pytest.mark.parametrize(("B", "H"), [(2, 3), (None, 3), (2, None), (None, None)])
def test_the_tiles_are_those_of_the_dense_mask(backend, block_size, B, H):
    M = import_backend(backend)
    table = _random_mask(np.random.default_rng(0), B or 1, H or 1, 12, 10)
    stored = M.asarray(table)

    def mask_mod(b, h, q_idx, kv_idx):
        return stored[b, h, q_idx, kv_idx]  # b and h are 0 where the mask is broadcast (None)

    block_mask = M.create_block_mask(mask_mod, B, H, 12, 10, block_size)
    block_q, block_k = block_size if isinstance(block_size, tuple) else (block_size, block_size)
    assert block_mask.shape == (B or 1, H or 1, 12, 10) and block_mask.block_size == (block_q, block_k)
    assert np.array_equal(block_mask.tiles, _expected_tiles(table, block_q, block_k))
    counts = block_mask.counts()
    assert [counts[name] for name in ("empty", "partial", "full")] == [
        int(np.sum(block_mask.tiles == kind)) for kind in (blocks.EMPTY, blocks.PARTIAL, blocks.FULL)]
    assert sum(counts.values()) == block_mask.tiles.size


@pytest.mark.parametrize("mask_mod", [mods.causal(), mods.sliding_window(5, 0), mods.chunked(24),
                                      mods.document(np.repeat(np.arange(4), [10, 30, 20, 36])),
                                      mods.prefix_lm(np.array([20, 70])), mods.noop_mask, mods.or_masks()],
                         ids=mods._name)
def test_the_catalogues_tiles_are_those_of_its_dense_masks(mask_mod):
    for block_size in (7, (8, 16), 32):
        block_mask = attention_np.create_block_mask(mask_mod, 2, None, 96, 96, block_size)
        block_q, block_k = block_mask.block_size
        assert np.array_equal(block_mask.tiles, _expected_tiles(_dense(mask_mod, 2, 1, 96, 96), block_q, block_k))


@pytest.mark.parametrize("mask_mod", [mods.causal(), mods.sliding_window(40, 0), mods.chunked(48),
                                      mods.document(np.repeat(np.arange(4), 64)),
                                      mods.and_masks(mods.prefix_lm(np.array([32, 100])), mods.key_lengths(200)),
                                      mods.noop_mask, mods.or_masks()], ids=mods._name)  # noop_mask: by name
@pytest.mark.parametrize(("B", "H", "block_size"), [(None, None, 32), (2, 3, (32, 64)), (2, None, 128)])
def test_sparsity_is_torchs(mask_mod, B, H, block_size):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    # torch's sparsity counts whole tiles of BLOCK_SIZE entries, so the lengths are multiples of the tiles here
    theirs = flex.create_block_mask(mask_mod, B, H, 256, 256, device="cpu", BLOCK_SIZE=block_size)
    ours = attention_np.create_block_mask(mask_mod, B, H, 256, 256, block_size)
    assert ours.sparsity() == pytest.approx(theirs.sparsity(), abs=1e-9)
    # and torch's counts of the tiles it computes per row, partial and full
    assert np.array_equal(np.sum(ours.tiles == blocks.PARTIAL, axis=-1), theirs.kv_num_blocks.numpy())
    assert np.array_equal(np.sum(ours.tiles == blocks.FULL, axis=-1), theirs.full_kv_num_blocks.numpy())


def test_the_picture_of_a_causal_mask_is_the_modules():
    block_mask = attention_np.create_block_mask(mods.causal(), None, None, 12, 12, 4)
    assert str(block_mask) == "b=0, h=0:\n░..\n█░.\n██░"
    # the picture drawn in block_mask.py's docstring
    assert [line.split()[0] for line in blocks.__doc__.split("\n") if line.startswith("    ") and line.strip()][:3] \
        == ["░..", "█░.", "██░"]
    assert block_mask.counts() == {"empty": 3, "partial": 3, "full": 3}
    assert block_mask.sparsity() == pytest.approx(100 * 3 / 9)


def test_the_picture_shows_each_batch_element_and_head():
    block_mask = attention_np.create_block_mask(mods.key_lengths(np.array([[4, 8], [0, 5]])), 2, 2, 4, 8, 4)
    assert str(block_mask) == "b=0, h=0:\n█.\nb=0, h=1:\n██\nb=1, h=0:\n..\nb=1, h=1:\n█░"
    assert repr(block_mask).startswith("BlockMask(key_lengths([[4, 8], [0, 5]]), shape=(2, 2, 4, 8)")


@pytest.mark.parametrize("backend", ["attention_np", "attention_torch"])
@pytest.mark.parametrize(("B", "H"), [(None, None), (2, 4)])
def test_the_mask_function_is_evaluated_on_bounded_pieces_never_the_whole_grid(backend, B, H):
    M = import_backend(backend)
    document = mods.document(np.repeat(np.arange(8), 512))  # 8 documents of 512 positions
    shapes = []

    def recorded(b, h, q_idx, kv_idx):
        shapes.append(tuple(np.broadcast_shapes(*(tuple(x.shape) for x in (b, h, q_idx, kv_idx)))))
        return document(b, h, q_idx, kv_idx)

    block_mask = M.create_block_mask(recorded, B, H, 4096, 4096)
    assert max(math.prod(shape) for shape in shapes) <= blocks.CLASSIFY_ENTRIES, set(shapes)
    assert all(shape[2:] != (4096, 4096) for shape in shapes), set(shapes)
    # 32 x 32 tiles of 128 per (b, h), of which each document's 4 x 4 on the diagonal are full
    assert block_mask.counts() == {"empty": (1024 - 8 * 16) * (B or 1) * (H or 1), "partial": 0,
                                   "full": 8 * 16 * (B or 1) * (H or 1)}


def test_a_tile_larger_than_the_budget_is_evaluated_alone():
    # one key tile over the whole batch is the least create_block_mask evaluates: B H block_q block_k entries
    shapes = []

    def recorded(b, h, q_idx, kv_idx):
        shapes.append(np.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape))
        return q_idx >= kv_idx

    attention_np.create_block_mask(recorded, 16, 8, 256, 512, 128)  # 16 * 8 * 128 * 128 = 2^21 entries a tile
    assert set(shapes) == {(16, 8, 128, 128)}


# create_block_mask's arguments and what the mask function returns: (arguments, exception, message)
BAD_ARGUMENTS = [
    (("causal", 1, 1, 4, 4), TypeError, "mask_mod must be a function (b, h, q_idx, kv_idx) -> bool; got str"),
    ((mods.causal(), 0, 1, 4, 4), ValueError, "B must be None (broadcast) or a positive int; got 0"),
    ((mods.causal(), 1, 2.0, 4, 4), ValueError, "H must be None (broadcast) or a positive int; got 2.0"),
    ((mods.causal(), 1, 1, -1, 4), ValueError, "Q_LEN must be a non-negative int; got -1"),
    ((mods.causal(), 1, 1, 4, 4.0), ValueError, "KV_LEN must be a non-negative int; got 4.0"),
    ((mods.causal(), 1, 1, 4, 4, 0), ValueError,
     "BLOCK_SIZE must be a positive int or a pair (block_q, block_k) of them; got 0"),
    ((mods.causal(), 1, 1, 4, 4, (2, 2, 2)), ValueError,
     "BLOCK_SIZE must be a positive int or a pair (block_q, block_k) of them; got (2, 2, 2)"),
    ((lambda b, h, q_idx, kv_idx: q_idx - kv_idx, 1, 1, 4, 4), TypeError,
     "mask_mod must return booleans (True: the query sees the key); got dtype int64"),
    ((lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx)[..., None], 1, 1, 4, 4), ValueError,
     "mask_mod returned shape (1, 1, 4, 4, 1), which does not broadcast to the tile (1, 1, 4, 4) "
     "(B, H, block_q, block_k)"),
]


@pytest.mark.parametrize(("arguments", "exception", "message"), BAD_ARGUMENTS)
def test_create_block_mask_refuses_bad_arguments_with_a_message(arguments, exception, message):
    with pytest.raises(exception) as error:
        attention_np.create_block_mask(*arguments)
    assert str(error.value) == message


# --- flex_attention against ONNX's preview FlexAttention -------------------------------------------------------

def _onnx_score_mod(kind: str) -> Any:
    """A FlexAttention score_mod graph of ONNX over the whole (B, H, L, S) float64 scores: "softcap" (cap 1.5),
    "causal" (-inf above the diagonal), "relative" (+ (q_idx - k_idx), which is alibi with slopes -1)."""
    from onnx import TensorProto, helper

    def value(name):
        return helper.make_tensor_value_info(name, TensorProto.DOUBLE, ["B", "H", "L", "S"])

    def integer(name, values, dims=()):
        return helper.make_tensor(name, TensorProto.INT64, list(dims), values)

    positions = [  # q_idx (L, 1), k_idx (1, S) from the scores' shape
        helper.make_node("Shape", ["scores"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["L"], axis=0),
        helper.make_node("Gather", ["shape", "three"], ["S"], axis=0),
        helper.make_node("Range", ["zero", "L", "one"], ["q_range"]),
        helper.make_node("Reshape", ["q_range", "column"], ["q_idx"]),
        helper.make_node("Range", ["zero", "S", "one"], ["k_range"]),
        helper.make_node("Reshape", ["k_range", "row"], ["k_idx"]),
    ]
    constants = [integer("zero", [0]), integer("one", [1]), integer("two", [2]), integer("three", [3]),
                 integer("column", [-1, 1], [2]), integer("row", [1, -1], [2])]
    if kind == "softcap":
        nodes = [helper.make_node("Div", ["scores", "cap"], ["x"]), helper.make_node("Tanh", ["x"], ["t"]),
                 helper.make_node("Mul", ["t", "cap"], ["new"])]
        constants = [helper.make_tensor("cap", TensorProto.DOUBLE, [], [1.5])]
    elif kind == "causal":
        nodes = [*positions, helper.make_node("GreaterOrEqual", ["q_idx", "k_idx"], ["visible"]),
                 helper.make_node("Where", ["visible", "scores", "minus_inf"], ["new"])]
        constants = [*constants, helper.make_tensor("minus_inf", TensorProto.DOUBLE, [], [-math.inf])]
    else:
        nodes = [*positions, helper.make_node("Sub", ["q_idx", "k_idx"], ["distance"]),
                 helper.make_node("Cast", ["distance"], ["bias"], to=TensorProto.DOUBLE),
                 helper.make_node("Add", ["scores", "bias"], ["new"])]
    return helper.make_graph(nodes, f"score_mod_{kind}", [value("scores")], [value("new")], constants)


def _onnx_flex_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, score_mod: str, scale: float) -> np.ndarray:
    from onnx import TensorProto, helper
    from onnx.defs import AI_ONNX_PREVIEW_DOMAIN
    from onnx.reference import ReferenceEvaluator

    node = helper.make_node("FlexAttention", ["Q", "K", "V"], ["Y"], domain=AI_ONNX_PREVIEW_DOMAIN, scale=scale,
                            score_mod=_onnx_score_mod(score_mod))
    graph = helper.make_graph([node], "flex", [helper.make_tensor_value_info(name, TensorProto.DOUBLE, x.shape)
                                               for name, x in (("Q", q), ("K", k), ("V", v))],
                              [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26),
                                                    helper.make_opsetid(AI_ONNX_PREVIEW_DOMAIN, 1)])
    return ReferenceEvaluator(model).run(None, {"Q": q, "K": k, "V": v})[0]


# ONNX's score_mod graph -> (our score_mod, our mask_mod): the same attention
ONNX_CASES = {"softcap": (mods.softcap(1.5), None), "causal": (None, mods.causal()),
              "relative": (mods.alibi(-np.ones(4)), None)}


@pytest.mark.parametrize("backend", ["attention_np", "attention_torch"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("case", ONNX_CASES)
def test_flex_attention_equals_onnxs_flex_attention(case, kv_heads, backend):
    pytest.importorskip("onnx")
    M = import_backend(backend)
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 5, 8)), *rng.standard_normal((2, 2, kv_heads, 7, 8))
    scale = 0.25  # ONNX multiplies q and k by sqrt(scale) rounded to float32: 0.5 is exact
    expected = _onnx_flex_attention(q, k, v, case, scale)
    score_mod, mask_mod = ONNX_CASES[case]
    block_mask = None if mask_mod is None else M.create_block_mask(mask_mod, None, None, 5, 7, (2, 3))
    out = M.flex_attention(*(M.asarray(x) for x in (q, k, v)), score_mod=score_mod, block_mask=block_mask,
                           scale=scale, enable_gqa=kv_heads != 4)
    np.testing.assert_allclose(M.to_numpy(out), expected, rtol=1e-12, atol=1e-13)


# --- flex_attention's other checks (attention_np/common/validation.py), which every backend calls ---------------
# (check, arguments, exception, message)
BAD_INPUTS = [
    (validation.flex_inputs, ((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7), False), ValueError,
     "flex_attention: v must have shape (B, Hkv, S, Ev); got (2, 4, 7)"),
    (validation.flex_inputs, ((2, 4, 5, 8), (3, 4, 7, 8), (3, 4, 7, 6), False), ValueError,
     "flex_attention: q (2, 4, 5, 8), k (3, 4, 7, 8) and v (3, 4, 7, 6) must have the same batch size B"),
    (validation.flex_inputs, ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6), False), ValueError,
     "flex_attention: q (2, 4, 5, 8), k (2, 2, 7, 8) and v (2, 2, 7, 6) must have the same number of heads H; "
     "with fewer key/value heads pass enable_gqa=True"),
    (validation.flex_inputs, ((2, 4, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6), True), ValueError,
     "enable_gqa: the H = 4 query heads must be a multiple of the Hkv = 3 key/value heads; q (2, 4, 5, 8) is "
     "(..., H, L, E), k (2, 3, 7, 8) is (..., Hkv, S, E)"),
    (validation.flex_inputs, ((2, 4, 5, 8), (2, 4, 7, 6), (2, 4, 7, 6), False), ValueError,
     "flex_attention: q (2, 4, 5, 8) is (B, H, L, E), k (2, 4, 7, 6) (B, Hkv, S, E) and v (2, 4, 7, 6) "
     "(B, Hkv, S, Ev): q and k must have the same width E, k and v the same length S"),
    (validation.flex_inputs, ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 6, 6), True), ValueError,
     "flex_attention: q (2, 4, 5, 8) is (B, H, L, E), k (2, 2, 7, 8) (B, Hkv, S, E) and v (2, 2, 6, 6) "
     "(B, Hkv, S, Ev): q and k must have the same width E, k and v the same length S"),
    (validation.mask_mod_result, ("mask_mod", (2, 4, 3, 3), "float32", (2, 4, 3, 3)), TypeError,
     "mask_mod must return booleans (True: the query sees the key); got dtype float32"),
    (validation.mask_mod_result, ("mask_mod", (3, 1, 1, 1), "torch.bool", (2, 4, 3, 3)), ValueError,
     "mask_mod returned shape (3, 1, 1, 1), which does not broadcast to the tile (2, 4, 3, 3) "
     "(B, H, block_q, block_k)"),
    (validation.score_mod_result, ((2, 4, 3), (2, 4, 3, 3)), ValueError,
     "score_mod returned shape (2, 4, 3) for scores of shape (2, 4, 3, 3) (B, H, block_q, block_k): it must keep "
     "the scores' shape"),
    (validation.block_mask_fits, ("causal", 2, 4, 5, 7), TypeError,
     "block_mask must be a BlockMask from create_block_mask; got str"),
    (validation.block_mask_fits, (attention_np.create_block_mask(mods.causal(), 3, None, 5, 7), 2, 4, 5, 7), ValueError,
     "block_mask was made for scores (3, 1, 5, 7) (B, H, L, S), which do not fit these scores (2, 4, 5, 7): make it "
     "with create_block_mask(mask_mod, 2, 4, 5, 7)"),
]


@pytest.mark.parametrize(("check", "arguments", "exception", "message"), BAD_INPUTS,
                         ids=[f"{case[0].__name__}-{index}" for index, case in enumerate(BAD_INPUTS)])
def test_flex_attentions_checks_refuse_with_a_message(check, arguments, exception, message):
    with pytest.raises(exception) as error:
        check(*arguments)
    assert str(error.value) == message


def test_flex_attentions_checks_accept_what_fits():
    assert validation.flex_inputs((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6), True) == (2, 4)  # grouped heads
    assert validation.flex_inputs((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 6), False) == (2, 4)
    validation.mask_mod_result("mask_mod", (1, 1, 3, 1), "bool", (2, 4, 3, 3))  # broadcasting booleans
    validation.score_mod_result((2, 4, 3, 3), (2, 4, 3, 3))
    for B, H in ((None, None), (2, None), (None, 4), (2, 4)):  # broadcast over the batch, the heads, or neither
        validation.block_mask_fits(attention_np.create_block_mask(mods.causal(), B, H, 5, 7), 2, 4, 5, 7)
