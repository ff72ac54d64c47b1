"""SPEC 2a against ONNX's `Attention` operator (opset 25), run by onnx's reference evaluator: the README's
ONNX column, measured. A past key/value cache is our concatenation with `q_offset=P`; `nonpad_kv_seqlen`
is `key_lengths` with `q_offset = key_lengths - L` for its causal rule; `left_window_size` and
`right_window_size` are our `window`; `softcap` comes before the mask; fewer key/value heads are
`enable_gqa` with the same head mapping; a row that sees no key is zeros."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402 (after the skip: onnx is a test extra)
from onnx.reference import ReferenceEvaluator  # noqa: E402

OPSET = 25  # Attention with left_window_size and right_window_size
RTOL = REORDERED  # float64 on both sides: the same math computed another way
B, H, L, E = 2, 4, 3, 4


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _onnx_attention(inputs: dict[str, np.ndarray], **attributes: object) -> np.ndarray:
    """Y of one Attention node; `inputs` by the operator's input names (Q, K, V, attn_mask, past_key,
    past_value, nonpad_kv_seqlen), an absent one left out."""
    order = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
    names = [name if name in inputs else "" for name in order]
    while names[-1] == "":
        names.pop()
    types = {np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.int64): TensorProto.INT64,
             np.dtype(bool): TensorProto.BOOL}
    graph = helper.make_graph(
        [helper.make_node("Attention", names, ["Y"], **attributes)], "attention",
        [helper.make_tensor_value_info(name, types[x.dtype], x.shape) for name, x in inputs.items()],
        [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    return ReferenceEvaluator(model).run(None, inputs)[0]


def _ours(M: ModuleType, q, k, v, mask=None, **options) -> np.ndarray:
    options = {name: M.asarray(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}
    out, _ = M.scaled_dot_product_attention(*(M.asarray(x) for x in (q, k, v)),
                                            None if mask is None else M.asarray(mask), need_weights=False,
                                            **options)
    return M.to_numpy(out)


@pytest.mark.parametrize("Hkv", [1, 2])
def test_fewer_key_value_heads_are_enable_gqa(backend: ModuleType, Hkv: int):
    q, k, v = _random(B, H, L, E), _random(B, Hkv, 5, E, seed=1), _random(B, Hkv, 5, E, seed=2)
    theirs = _onnx_attention({"Q": q, "K": k, "V": v})
    assert_close(_ours(backend, q, k, v, enable_gqa=True), theirs, RTOL, "GQA")


def test_softcap_comes_before_the_mask(backend: ModuleType):
    # a -inf entry of the additive mask stays hidden: capping after it would give the key weight
    q, k, v = 4 * _random(B, H, L, E), 4 * _random(B, H, 5, E, seed=1), _random(B, H, 5, E, seed=2)
    bias = _random(L, 5, seed=3)
    bias[:, 1] = -np.inf
    theirs = _onnx_attention({"Q": q, "K": k, "V": v, "attn_mask": bias}, softcap=1.5)
    assert_close(_ours(backend, q, k, v, bias=bias, softcap=1.5), theirs, RTOL, "softcap")


@pytest.mark.parametrize("window", [None, (2, 0), (1, 1)], ids=str)
def test_a_past_cache_is_concatenation_with_q_offset_p(backend: ModuleType, window):
    P, Hkv = 6, 2
    q, k, v = _random(B, H, L, E), _random(B, Hkv, L, E, seed=1), _random(B, Hkv, L, E, seed=2)
    past_key, past_value = _random(B, Hkv, P, E, seed=3), _random(B, Hkv, P, E, seed=4)
    sides = {} if window is None else {"left_window_size": window[0], "right_window_size": window[1]}
    theirs = _onnx_attention({"Q": q, "K": k, "V": v, "past_key": past_key, "past_value": past_value},
                             is_causal=1, **sides)
    keys, values = np.concatenate([past_key, k], axis=-2), np.concatenate([past_value, v], axis=-2)
    ours = _ours(backend, q, keys, values, is_causal=True, q_offset=P, window=window, enable_gqa=True)
    assert_close(ours, theirs, RTOL, "past cache")


def test_nonpad_kv_seqlen_is_key_lengths_with_its_causal_offset(backend: ModuleType):
    S, lengths = 7, np.array([7, 4])
    q, k, v = _random(B, H, L, E), _random(B, H, S, E, seed=1), _random(B, H, S, E, seed=2)
    theirs = _onnx_attention({"Q": q, "K": k, "V": v, "nonpad_kv_seqlen": lengths}, is_causal=1)
    per_sequence = lengths[:, None]  # (B, 1): one per batch element, broadcast over the heads
    ours = _ours(backend, q, k, v, is_causal=True, key_lengths=per_sequence, q_offset=per_sequence - L)
    assert_close(ours, theirs, RTOL, "nonpad_kv_seqlen")


def test_a_query_that_sees_no_key_gives_zeros(backend: ModuleType):
    q, k, v = _random(B, H, L, E), _random(B, H, 5, E, seed=1), _random(B, H, 5, E, seed=2)
    mask = _random(L, 5, seed=3) > 0
    mask[1] = False  # query 1 sees no key
    theirs = _onnx_attention({"Q": q, "K": k, "V": v, "attn_mask": mask})
    ours = _ours(backend, q, k, v, mask)
    np.testing.assert_array_equal(theirs[:, :, 1], 0)
    assert_close(ours, theirs, RTOL, "fully masked row")
