"""Every backend against PyTorch's own attention: F.scaled_dot_product_attention, nn.MultiheadAttention
and nn.TransformerEncoderLayer (eval mode, dropout 0), in float32 and float64.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff.

Mask conventions: ours is a keep-mask (True / nonzero = key visible). F.scaled_dot_product_attention's
boolean attn_mask means the same (True = takes part) and its float attn_mask is an additive bias;
nn.MultiheadAttention's and nn.TransformerEncoderLayer's boolean masks mean the opposite (True = NOT
allowed), as do their key_padding_mask / src_key_padding_mask (B, S) (True = padding, ignored).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import pytest

from tests._compare import TOLERANCE, assert_close

torch = pytest.importorskip("torch")

from conformance.bench.baselines import (  # noqa: E402
    random_state,
    torch_attn_mask,
    torch_encoder_layer,
    torch_multihead,
)

sdpa = torch.nn.functional.scaled_dot_product_attention
B, H, D, F = 2, 2, 8, 32
EPS = 1e-3  # not LayerNorm's default, so an eps that does not reach the module shows in float64


@pytest.fixture(params=[np.float32, np.float64], ids=["float32", "float64"])
def dtype(request: pytest.FixtureRequest) -> np.dtype:
    return np.dtype(request.param)


def _t(x: np.ndarray | None) -> Any:
    """NumPy -> torch tensor (same dtype), None stays None."""
    return None if x is None else torch.from_numpy(np.array(x))  # a copy: torch wants writable memory


def _ours(backend: ModuleType, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments with NumPy arrays turned into the backend's arrays."""
    return {name: backend.asarray(x) if isinstance(x, np.ndarray) else x for name, x in kwargs.items()}


# ---- scaled dot-product attention vs F.scaled_dot_product_attention ----------------------------------


class SdpaCase(NamedTuple):
    """One attention call in NumPy: `ours` are our keyword arguments, `theirs` torch's."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    ours: dict[str, Any]
    theirs: dict[str, Any]


def _qkv(rng: np.random.Generator, dtype: np.dtype, lead: tuple[int, ...] = (B, H), L: int = 5, S: int = 7,
         E: int = 4, Ev: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standard normal q (..., L, E), k (..., S, E), v (..., S, Ev)."""
    return tuple(rng.standard_normal((*lead, n, e)).astype(dtype) for n, e in ((L, E), (S, E), (S, Ev)))


def _keep_mask(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A random boolean keep-mask with at least one visible key in every row (no fully masked row)."""
    mask = rng.random(shape) < 0.5
    np.put_along_axis(mask, rng.integers(shape[-1], size=(*shape[:-1], 1)), True, axis=-1)
    return mask


def _mask_case(shape: tuple[int, ...]) -> Callable[[np.random.Generator, np.dtype], SdpaCase]:
    def build(rng: np.random.Generator, dtype: np.dtype) -> SdpaCase:
        mask = _keep_mask(rng, shape)  # broadcasts to (B, H, L, S)
        return SdpaCase(*_qkv(rng, dtype), {"mask": mask}, {"attn_mask": mask})
    return build


def _int_mask(rng: np.random.Generator, dtype: np.dtype) -> SdpaCase:
    mask = _keep_mask(rng, (B, 1, 5, 7)).astype(np.int64)  # 0 / 1; torch takes only a boolean as a mask
    return SdpaCase(*_qkv(rng, dtype), {"mask": mask}, {"attn_mask": mask != 0})


def _neg_inf_bias(rng: np.random.Generator, dtype: np.dtype) -> SdpaCase:
    bias = np.where(_keep_mask(rng, (B, H, 5, 7)), rng.standard_normal((B, H, 5, 7)), -np.inf).astype(dtype)
    return SdpaCase(*_qkv(rng, dtype), {"bias": bias}, {"attn_mask": bias})  # torch: float mask is added


def _causal(L: int, S: int) -> Callable[[np.random.Generator, np.dtype], SdpaCase]:
    # torch 2.13's is_causal is top-left aligned, as ours: query i sees keys j <= i, i.e. the mask
    # tril(ones(L, S)) (torch.nn.attention.bias.causal_upper_left), also when L != S; the bottom-right
    # variant is the separate causal_lower_right. test_torch_is_causal_is_our_causal_mask pins this.
    def build(rng: np.random.Generator, dtype: np.dtype) -> SdpaCase:
        return SdpaCase(*_qkv(rng, dtype, L=L, S=S), {"is_causal": True}, {"is_causal": True})
    return build


def _causal_and_mask(rng: np.random.Generator, dtype: np.dtype) -> SdpaCase:
    mask = _keep_mask(rng, (B, H, 5, 7))
    mask[..., 0] = True  # key 0 survives the causal rule, so no row is fully masked
    # torch refuses attn_mask together with is_causal, so it gets the combined boolean
    both = mask & np.tril(np.ones((5, 7), dtype=bool))  # (B, H, L, S) & (L, S), True = visible
    return SdpaCase(*_qkv(rng, dtype), {"mask": mask, "is_causal": True}, {"attn_mask": both})


def _plain(**shape: Any) -> Callable[[np.random.Generator, np.dtype], SdpaCase]:
    def build(rng: np.random.Generator, dtype: np.dtype) -> SdpaCase:
        return SdpaCase(*_qkv(rng, dtype, **shape), {}, {})
    return build


def _custom_scale(rng: np.random.Generator, dtype: np.dtype) -> SdpaCase:
    return SdpaCase(*_qkv(rng, dtype), {"scale": 0.3}, {"scale": 0.3})


SDPA_CASES = {
    "no-mask": _plain(),
    "bool-mask-(L,S)": _mask_case((5, 7)),
    "bool-mask-(B,1,L,S)": _mask_case((B, 1, 5, 7)),
    "int-0/1-mask": _int_mask,
    "bias-with-neg-inf": _neg_inf_bias,
    "causal-L=S": _causal(5, 5),
    "causal-L<S": _causal(3, 7),
    "causal-L>S": _causal(7, 3),
    "causal-and-mask": _causal_and_mask,
    "custom-scale": _custom_scale,
    "E!=Ev": _plain(E=4, Ev=6),
    "lead-none": _plain(lead=()),
    "lead-one": _plain(lead=(B,)),
    "lead-two": _plain(lead=(B, H)),
}


def _torch_sdpa(case: SdpaCase) -> tuple[np.ndarray, np.ndarray]:
    """torch's output, and torch's weights: attention applied to v = identity (S, S) returns the
    weights themselves, since weights @ I = weights."""
    theirs = {name: _t(x) if isinstance(x, np.ndarray) else x for name, x in case.theirs.items()}
    S = case.k.shape[-2]
    eye = np.broadcast_to(np.eye(S, dtype=case.v.dtype), (*case.v.shape[:-2], S, S))  # (..., S, S)
    with torch.no_grad():
        out = sdpa(_t(case.q), _t(case.k), _t(case.v), **theirs)  # (..., L, Ev)
        weights = sdpa(_t(case.q), _t(case.k), _t(eye), **theirs)  # (..., L, S)
    return out.numpy(), weights.numpy()


@pytest.mark.parametrize("build", SDPA_CASES.values(), ids=SDPA_CASES.keys())
def test_sdpa_output_and_weights_match_torch_sdpa(backend: ModuleType, dtype: np.dtype,
                                                  build: Callable) -> None:
    case = build(np.random.default_rng(0), dtype)
    expected_out, expected_weights = _torch_sdpa(case)
    q, k, v = (backend.asarray(x) for x in (case.q, case.k, case.v))
    out, weights = backend.scaled_dot_product_attention(q, k, v, **_ours(backend, case.ours))
    assert_close(backend.to_numpy(out), expected_out, TOLERANCE[dtype], "out")
    assert_close(backend.to_numpy(weights), expected_weights, TOLERANCE[dtype], "weights")


@pytest.mark.parametrize(("L", "S"), [(5, 5), (3, 7), (7, 3)], ids=["L=S", "L<S", "L>S"])
def test_torch_is_causal_is_our_causal_mask(backend: ModuleType, L: int, S: int) -> None:
    """The assumption behind the causal cases: torch's is_causal hides exactly what our causal_mask does."""
    q, k, v = (_t(x) for x in _qkv(np.random.default_rng(0), np.dtype(np.float64), L=L, S=S))
    mask = _t(backend.to_numpy(backend.causal_mask(L, S)))  # (L, S), True = visible
    with torch.no_grad():
        assert_close(sdpa(q, k, v, is_causal=True).numpy(), sdpa(q, k, v, attn_mask=mask).numpy(),
                     TOLERANCE[np.dtype(np.float64)], "is_causal vs causal_mask")


@pytest.mark.parametrize("hide", ["bool-mask", "neg-inf-bias"])
def test_fully_masked_row_gives_zeros_like_torch_sdpa(backend: ModuleType, dtype: np.dtype,
                                                      hide: str) -> None:
    # torch 2.13's SDPA returns zeros for a query with no visible key (not NaN); so do we, in out and weights
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, dtype)
    keep = _keep_mask(rng, (B, H, 5, 7))
    keep[0, 1, 2] = False  # batch 0, head 1, query 2 sees no key
    bias = np.where(keep, 0, -np.inf).astype(dtype)  # torch: a float attn_mask is added to the scores
    ours, theirs = ({"mask": keep}, {"attn_mask": keep}) if hide == "bool-mask" else (
        {"bias": bias}, {"attn_mask": bias})
    expected_out, _ = _torch_sdpa(SdpaCase(q, k, v, ours, theirs))
    assert np.all(expected_out[0, 1, 2] == 0), "torch no longer returns zeros for a fully masked row"
    out, weights = backend.scaled_dot_product_attention(*(backend.asarray(x) for x in (q, k, v)),
                                                        **_ours(backend, ours))
    out, weights = backend.to_numpy(out), backend.to_numpy(weights)
    assert np.all(out[0, 1, 2] == 0) and np.all(weights[0, 1, 2] == 0)
    assert_close(out, expected_out, TOLERANCE[dtype], "out")


# ---- multi-head attention vs nn.MultiheadAttention ----------------------------------------------------


class MhaCase(NamedTuple):
    """Inputs in NumPy: q (B, L, D), k and v (B, S, D); our mask (B, 1|H, 1|L, S) or None; torch's masks."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    theirs: dict[str, Any]


def _mha_case(backend: ModuleType, kind: str, rng: np.random.Generator, dtype: np.dtype) -> MhaCase:
    L, S = (5, 5) if kind in ("self-attention", "padding-mask") else (3, 6)
    q = rng.standard_normal((B, L, D)).astype(dtype)
    k, v = (rng.standard_normal((B, S, D)).astype(dtype) for _ in range(2))
    if kind in ("self-attention", "padding-mask"):
        k = v = q
    if kind == "padding-mask":  # lengths >= 1, so every query sees a key
        mask = backend.to_numpy(backend.padding_mask(backend.asarray(np.array([S, 2])), S))  # (B, 1, 1, S)
        return MhaCase(q, k, v, mask, {"key_padding_mask": _t(~mask[:, 0, 0, :])})  # (B, S), True = pad
    if kind == "random-mask":
        # no fully masked row: nn.MultiheadAttention gives NaN there (softmax over all -inf), we give zeros
        mask = _keep_mask(rng, (B, H, L, S))
        return MhaCase(q, k, v, mask, {"attn_mask": torch_attn_mask(mask, H)})  # (B*H, L, S)
    return MhaCase(q, k, v, None, {})


@pytest.mark.parametrize("kind", ["self-attention", "cross-attention", "padding-mask", "random-mask"])
def test_mha_output_and_weights_match_nn_multihead_attention(backend: ModuleType, dtype: np.dtype,
                                                             kind: str) -> None:
    rng = np.random.default_rng(0)
    state = random_state("mha", D, F, rng, dtype)
    case = _mha_case(backend, kind, rng, dtype)
    with torch.no_grad():
        expected_out, expected_weights = torch_multihead(state, num_heads=H, dtype=dtype)(
            _t(case.q), _t(case.k), _t(case.v), **case.theirs, need_weights=True,
            average_attn_weights=False)  # (B, L, D), (B, H, L, S)
    mha = backend.MultiHeadAttention.from_state_dict(state, num_heads=H).eval()
    mask = None if case.mask is None else backend.asarray(case.mask)
    out, weights = mha(*(backend.asarray(x) for x in (case.q, case.k, case.v)), mask)
    assert_close(backend.to_numpy(out), expected_out.numpy(), TOLERANCE[dtype], "out")
    assert_close(backend.to_numpy(weights), expected_weights.numpy(), TOLERANCE[dtype], "weights")


# ---- transformer block vs nn.TransformerEncoderLayer ---------------------------------------------------


BLOCKS = {"post-LN-relu": (False, "relu"), "pre-LN-gelu": (True, "gelu")}


def _block_masks(backend: ModuleType, kind: str, L: int) -> tuple[np.ndarray | None, dict[str, Any]]:
    """Our keep-mask, and the same as nn.TransformerEncoderLayer's keyword arguments (True = hidden)."""
    if kind == "causal-mask":
        mask = backend.to_numpy(backend.causal_mask(L, L))  # (L, L)
        return mask, {"src_mask": _t(~mask)}
    if kind == "padding-mask":  # lengths >= 1, so every query sees a key
        mask = backend.to_numpy(backend.padding_mask(backend.asarray(np.array([L, 3])), L))  # (B, 1, 1, L)
        return mask, {"src_key_padding_mask": _t(~mask[:, 0, 0, :])}  # (B, L)
    return None, {}


@pytest.mark.parametrize("mask_kind", ["no-mask", "causal-mask", "padding-mask"])
@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_block_output_and_weights_match_nn_transformer_encoder_layer(
        backend: ModuleType, dtype: np.dtype, block: tuple[bool, str], mask_kind: str) -> None:
    norm_first, activation = block
    rng, L, d_model = np.random.default_rng(0), 6, 16
    state = random_state("block", d_model, F, rng, dtype)
    x = rng.standard_normal((B, L, d_model)).astype(dtype)
    mask, theirs = _block_masks(backend, mask_kind, L)
    layer = torch_encoder_layer(state, num_heads=H, norm_first=norm_first, activation=activation, eps=EPS,
                                dtype=dtype)
    with torch.no_grad():
        expected_x = layer(_t(x), **theirs)  # (B, L, D)
        # the weights: the layer's own attention on the block's attention input (x, or LN_1(x) in pre-LN)
        h = layer.norm1(_t(x)) if norm_first else _t(x)
        attn_masks = {"src_mask": "attn_mask", "src_key_padding_mask": "key_padding_mask"}
        _, expected_weights = layer.self_attn(h, h, h, **{attn_masks[name]: m for name, m in theirs.items()},
                                              need_weights=True, average_attn_weights=False)  # (B, H, L, L)
    ours = backend.TransformerBlock.from_state_dict(state, num_heads=H, norm_first=norm_first,
                                                    activation=activation, eps=EPS).eval()
    out, weights = ours(backend.asarray(x), None if mask is None else backend.asarray(mask))
    assert_close(backend.to_numpy(out), expected_x.numpy(), TOLERANCE[dtype], "x")
    assert_close(backend.to_numpy(weights), expected_weights.numpy(), TOLERANCE[dtype], "weights")
