"""apply_rope, rotary position embeddings, on every backend: against ONNX's RotaryEmbedding (onnx's reference
evaluator) in both layouts, against Hugging Face's rotate_half formula written out here, hand-derived
values, the relative-position property, half precision, autodiff (the transpose of a rotation turns back),
and the errors, the same everywhere."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close, converted
from tests.conftest import import_backend

RTOL = REORDERED  # float64: the same math computed another way


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _rope(M: ModuleType, x: np.ndarray, positions, **options) -> np.ndarray:
    return M.to_numpy(M.apply_rope(M.asarray(x), converted(M, positions), **options))


def test_one_pair_turns_by_position_times_one(backend: ModuleType):
    # E = 2: one pair, j = 0, angle p * theta^0 = p; (1, 0) at position 1 -> (cos 1, sin 1), any theta
    got = _rope(backend, np.array([[1.0, 0.0], [0.0, 2.0]]), np.array([1, 3]), theta=7.0)
    np.testing.assert_allclose(got, [[np.cos(1), np.sin(1)], [-2 * np.sin(3), 2 * np.cos(3)]], rtol=1e-15)


def test_the_second_pair_turns_by_position_over_theta_to_the_half(backend: ModuleType):
    # E = 4, half layout: pairs (x0, x2) and (x1, x3); pair 1's angle is p * theta^(-2/4) = 2 / 2 = 1 for
    # p = 2, theta = 4; pair 0 turns by 2
    x = np.array([[1.0, 1.0, 0.0, 0.0]])
    got = _rope(backend, x, np.array([2]), theta=4.0)
    np.testing.assert_allclose(got, [[np.cos(2), np.cos(1), np.sin(2), np.sin(1)]], rtol=1e-15)
    interleaved = _rope(backend, np.array([[1.0, 0.0, 1.0, 0.0]]), np.array([2]), theta=4.0, interleaved=True)
    np.testing.assert_allclose(interleaved, [[np.cos(2), np.sin(2), np.cos(1), np.sin(1)]], rtol=1e-15)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_against_onnx_rotary_embedding(backend: ModuleType, interleaved: bool):
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    B, H, L, E, theta = 2, 3, 5, 8, 500.0
    x = _random(B, H, L, E)
    position_ids = np.array([[0, 1, 2, 3, 4], [9, 40, 41, 42, 100]])  # (B, L)
    angles = np.arange(128)[:, None] * theta ** (-np.arange(0, E, 2) / E)  # (positions, E/2)
    inputs = {"X": x, "cos_cache": np.cos(angles), "sin_cache": np.sin(angles), "position_ids": position_ids}
    types = {"position_ids": TensorProto.INT64}
    graph = helper.make_graph(
        [helper.make_node("RotaryEmbedding", list(inputs), ["Y"], interleaved=int(interleaved))], "rope",
        [helper.make_tensor_value_info(name, types.get(name, TensorProto.DOUBLE), value.shape)
         for name, value in inputs.items()],
        [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    theirs = ReferenceEvaluator(model).run(None, inputs)[0]  # (B, H, L, E)
    ours = _rope(backend, x, position_ids[:, None, :], theta=theta, interleaved=interleaved)
    assert_close(ours, theirs, RTOL, "against onnx")


def test_half_layout_is_hugging_faces_rotate_half(backend: ModuleType):
    # Llama's apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, cos and sin over the full width E
    x, positions, theta = _random(2, 6, 8, seed=1), np.arange(6) + 11, 10000.0
    half = np.arange(0, 8, 2) / 8
    angles = positions[:, None] * (1.0 / theta**half)  # (L, E/2)
    emb = np.concatenate([angles, angles], axis=-1)  # (L, E)
    rotate_half = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
    theirs = x * np.cos(emb) + rotate_half * np.sin(emb)
    assert_close(_rope(backend, x, positions, theta=theta), theirs, RTOL, "rotate_half")


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_scores_depend_on_the_positions_difference_only(backend: ModuleType, interleaved: bool):
    # <R(m) q, R(n) k> = <q, R(n - m) k>: shifting both positions by 100 changes no score
    q, k = _random(4, 8, seed=2), _random(4, 8, seed=3)
    m, n = np.array([0, 3, 5, 7]), np.array([2, 2, 9, 1])
    scores = np.einsum("le,le->l", _rope(backend, q, m, interleaved=interleaved),
                       _rope(backend, k, n, interleaved=interleaved))
    shifted = np.einsum("le,le->l", _rope(backend, q, m + 100, interleaved=interleaved),
                        _rope(backend, k, n + 100, interleaved=interleaved))
    np.testing.assert_allclose(shifted, scores, rtol=1e-10)
    np.testing.assert_allclose(np.linalg.norm(_rope(backend, q, m), axis=-1), np.linalg.norm(q, axis=-1),
                               rtol=1e-14)  # a rotation keeps lengths


def test_backends_agree_with_an_int_and_broadcast_positions():
    x = _random(2, 3, 4, 6, seed=4)
    expected = _rope(import_backend("attention_np"), x, np.array([[[0, 1, 2, 3]], [[5, 6, 7, 8]]]))
    for name in ("attention_jax", "attention_torch"):
        M = import_backend(name)
        assert_close(_rope(M, x, np.array([[[0, 1, 2, 3]], [[5, 6, 7, 8]]])), expected, RTOL, name)
        assert_close(_rope(M, x[0, 0], 4), _rope(import_backend("attention_np"), x[0, 0], 4), RTOL, f"{name} int")


def test_half_precision_is_turned_in_float32(backend: ModuleType):
    x, positions = _random(3, 8, seed=5), np.array([1, 50, 300])
    expected = _rope(import_backend("attention_np"), x.astype(np.float16).astype(np.float32), positions)
    got = backend.apply_rope(backend.asarray(x.astype(np.float16)), converted(backend, positions))
    got = backend.to_numpy(got)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, expected.astype(np.float16))  # float32 arithmetic, rounded once


def test_jax_gradient_is_the_backward_rotation():
    # a rotation's transpose is the rotation by minus the angle: grad <R(p) x, d> = R(-p) d
    jax = pytest.importorskip("jax")
    M = import_backend("attention_jax")
    x, d, positions = (M.asarray(a) for a in (_random(2, 5, 8, seed=6), _random(2, 5, 8, seed=7),
                                              np.arange(5) + 3))
    grad = jax.jit(jax.grad(lambda x: (M.apply_rope(x, positions) * d).sum()))(x)
    assert_close(np.asarray(grad), np.asarray(M.apply_rope(d, -positions)), RTOL, "jax.grad")
    batched = jax.vmap(lambda x: M.apply_rope(x, positions))(x)
    assert_close(np.asarray(batched), np.asarray(M.apply_rope(x, positions)), RTOL, "vmap")


def test_torch_gradient_is_the_backward_rotation():
    torch = pytest.importorskip("torch")
    M = import_backend("attention_torch")
    x = torch.tensor(_random(2, 5, 8, seed=6), requires_grad=True)
    d, positions = torch.tensor(_random(2, 5, 8, seed=7)), torch.arange(5) + 3
    (M.apply_rope(x, positions) * d).sum().backward()
    assert_close(x.grad.numpy(), M.apply_rope(d, -positions).numpy(), RTOL, "autograd")


ERRORS = {
    "odd width": ((3, 5), np.arange(3), {}, ValueError, ["E even", "(3, 5)"]),
    "rank 1": ((4,), 0, {}, ValueError, ["(4,)"]),
    "float positions": ((3, 4), np.arange(3.0), {}, TypeError, ["positions", "float64"]),
    "positions per entry": ((3, 4), np.zeros((3, 4), np.int64), {}, ValueError, ["positions", "(3, 4)", "(3,)"]),
    "positions add an axis": ((3, 4), np.zeros((2, 3), np.int64), {}, ValueError, ["positions", "(2, 3)"]),
    "theta zero": ((3, 4), np.arange(3), {"theta": 0.0}, ValueError, ["theta", "0.0"]),
    "theta infinite": ((3, 4), np.arange(3), {"theta": float("inf")}, ValueError, ["theta", "inf"]),
}


@pytest.mark.parametrize(("shape", "positions", "options", "error", "words"), ERRORS.values(), ids=ERRORS.keys())
def test_each_mistake_raises_the_same_error(backend: ModuleType, shape, positions, options, error, words):
    with pytest.raises(error) as raised:
        backend.apply_rope(backend.asarray(np.zeros(shape)), converted(backend, positions), **options)
    assert all(word in str(raised.value) for word in words), str(raised.value)
