"""State dicts: torch's names and layouts, one state loaded anywhere gives one answer, files move weights
bit for bit between frameworks, bad states are rejected, and initial values follow nn.Linear."""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, TOLERANCE, assert_close
from tests.conftest import backend_rng, import_backend

D, H, F, B, L = 8, 2, 16, 2, 5  # d_model, heads, d_ff, batch, positions: small and fast
MHA_NAMES = ["w_q.weight", "w_q.bias", "w_k.weight", "w_k.bias",
             "w_v.weight", "w_v.bias", "w_o.weight", "w_o.bias"]
BLOCK_NAMES = [f"attn.{name}" for name in MHA_NAMES] + [
    "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias",
    "ffn.0.weight", "ffn.0.bias", "ffn.3.weight", "ffn.3.bias"]
# nn.Linear layout: weight (out, in), bias (out,); LayerNorm weight and bias (D,)
MHA_SHAPES = {name: (D, D) if name.endswith("weight") else (D,) for name in MHA_NAMES}
BLOCK_SHAPES = ({f"attn.{name}": shape for name, shape in MHA_SHAPES.items()}
                | {f"{norm}.{part}": (D,) for norm in ("norm1", "norm2") for part in ("weight", "bias")}
                | {"ffn.0.weight": (F, D), "ffn.0.bias": (F,), "ffn.3.weight": (D, F), "ffn.3.bias": (D,)})
# (module kind, from_state_dict options) for the cross-backend comparison
CASES = {"mha": ("mha", {}), "block post-LN relu": ("block", {}),
         "block pre-LN gelu": ("block", {"norm_first": True, "activation": "gelu"})}


def _dtype(M: ModuleType, dtype: type) -> object:
    """The backend's name for a NumPy dtype (torch has its own dtype objects)."""
    if M.__name__ == "attention_torch":
        import torch

        return getattr(torch, np.dtype(dtype).name)
    return dtype


def _random_state(shapes: dict[str, tuple[int, ...]], dtype: type, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (0.5 * rng.standard_normal(shape)).astype(dtype) for name, shape in shapes.items()}


def _numpy_state(module: object, M: ModuleType) -> dict[str, np.ndarray]:
    return {name: M.to_numpy(value) for name, value in module.state_dict().items()}


def _mask() -> np.ndarray:
    """Padding mask (B, 1, 1, L): sequence 0 sees all L keys, sequence 1 the first 3."""
    return np.arange(L) < np.array([L, 3])[:, None, None, None]


def _eval_outputs(M: ModuleType, kind: str, options: dict, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """One fixed state and input, run through M's module in eval mode; outputs as NumPy arrays."""
    shapes = MHA_SHAPES if kind == "mha" else BLOCK_SHAPES
    cls = M.MultiHeadAttention if kind == "mha" else M.TransformerBlock
    module = cls.from_state_dict(_random_state(shapes, dtype), num_heads=H, **options).eval()
    x = M.asarray(np.random.default_rng(1).standard_normal((B, L, D)).astype(dtype))
    mask = M.asarray(_mask())
    out, weights = module(x, x, x, mask) if kind == "mha" else module(x, mask)
    return M.to_numpy(out), M.to_numpy(weights)


def test_mha_state_dict_has_the_torch_names_in_order(backend):
    mha = backend.MultiHeadAttention(D, H, rng=backend_rng(backend, 0))
    assert list(mha.state_dict()) == MHA_NAMES


def test_block_state_dict_has_the_torch_names_in_order(backend):
    block = backend.TransformerBlock(D, H, F, rng=backend_rng(backend, 0))
    assert list(block.state_dict()) == BLOCK_NAMES


def test_torch_named_parameters_are_the_state_dict_names():
    M = import_backend("attention_torch")
    assert [name for name, _ in M.MultiHeadAttention(D, H).named_parameters()] == MHA_NAMES
    assert [name for name, _ in M.TransformerBlock(D, H, F).named_parameters()] == BLOCK_NAMES


def test_state_dict_shapes_use_the_nn_linear_layout(backend):
    block = backend.TransformerBlock(D, H, F, rng=backend_rng(backend, 0))
    shapes = {name: tuple(value.shape) for name, value in block.state_dict().items()}
    assert shapes == BLOCK_SHAPES


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", CASES)
def test_one_state_gives_the_same_outputs_on_every_backend(backend, case: str, dtype: type):
    # float64: the same math in another order differs by a few ulps times the conditioning, so the
    # backends agree far below 1e-12; float32 uses the spec's tolerance
    kind, options = CASES[case]
    rtol = REORDERED if dtype == np.float64 else TOLERANCE[np.dtype(dtype)]
    out, weights = _eval_outputs(backend, kind, options, dtype)
    expected_out, expected_weights = _eval_outputs(import_backend("attention_np"), kind, options, dtype)
    assert out.dtype == weights.dtype == dtype
    assert_close(out, expected_out, rtol, f"{backend.__name__} {case} {np.dtype(dtype)} out")
    assert_close(weights, expected_weights, rtol, f"{backend.__name__} {case} {np.dtype(dtype)} weights")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_from_state_dict_computes_in_the_state_dtype(backend, dtype: type):
    block = backend.TransformerBlock.from_state_dict(_random_state(BLOCK_SHAPES, dtype), num_heads=H)
    assert {value.dtype for value in _numpy_state(block, backend).values()} == {np.dtype(dtype)}
    x = backend.asarray(np.ones((B, L, D), dtype))
    out, weights = block.eval()(x)
    assert backend.to_numpy(out).dtype == backend.to_numpy(weights).dtype == dtype


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_file_round_trip_torch_jax_numpy_is_bit_exact(tmp_path, dtype: type):
    torch_M, jax_M, np_M = (import_backend(name) for name in ("attention_torch", "attention_jax",
                                                               "attention_np"))
    original = torch_M.TransformerBlock(D, H, F, rng=backend_rng(torch_M, 0), dtype=_dtype(torch_M, dtype))
    # torch -> file -> JAX module -> file -> NumPy module
    torch_M.save_state_dict(tmp_path / "torch.npz", original.state_dict())
    jax_block = jax_M.TransformerBlock.from_state_dict(jax_M.load_state_dict(tmp_path / "torch.npz"),
                                                       num_heads=H)
    jax_M.save_state_dict(tmp_path / "jax.npz", jax_block.state_dict())
    np_block = np_M.TransformerBlock.from_state_dict(np_M.load_state_dict(tmp_path / "jax.npz"),
                                                     num_heads=H)

    expected, actual = _numpy_state(original, torch_M), _numpy_state(np_block, np_M)
    assert list(actual) == list(expected) == BLOCK_NAMES
    for name in expected:
        assert actual[name].dtype == expected[name].dtype == dtype, name
        assert np.array_equal(actual[name], expected[name]), name


# every dtype a backend holds: asarray -> to_numpy gives back the same bits (NaN payloads, -0.0, subnormals
# included). NumPy has no bfloat16 of its own: ml_dtypes' passes through attention_np.asarray unchanged, as
# every NumPy array does, though the NumPy backend computes in float16, float32 and float64 only
ROUND_TRIP_DTYPES = ("float16", "bfloat16", "float32", "float64", "bool", "int32", "int64")


def _every_bit_pattern(name: str) -> np.ndarray:
    """(4, 6) entries of dtype `name` with random bits (bool: random truth values), and -0.0, inf, NaN."""
    dtype = np.dtype(pytest.importorskip("ml_dtypes").bfloat16 if name == "bfloat16" else name)
    rng = np.random.default_rng(7)
    if name == "bool":
        return rng.random((4, 6)) < 0.5
    x = rng.integers(0, 256, 24 * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(4, 6)
    if name not in ("int32", "int64"):
        x[0, :3] = np.array([-0.0, np.inf, np.nan]).astype(dtype)
    return x


@pytest.mark.parametrize("name", ROUND_TRIP_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_asarray_then_to_numpy_gives_back_the_same_bits(backend, name: str, layout: str):
    x = _every_bit_pattern(name)
    x = x if layout == "contiguous" else x.T  # a view with other strides
    native = backend.asarray(x)
    back = backend.to_numpy(native)
    assert back.dtype == x.dtype and back.shape == x.shape
    assert back.tobytes() == x.tobytes(), f"{backend.__name__} {name}: the bits changed"


def test_torch_asarray_of_a_read_only_array_is_a_copy():
    # a NumPy module's parameters are read-only; a tensor cannot be, so writing into it must not reach them
    M = import_backend("attention_torch")
    x = np.zeros(3, np.float32)
    x.flags.writeable = False
    M.asarray(x)[0] = 1.0
    assert np.array_equal(x, np.zeros(3))


def test_saved_state_is_an_npz_readable_without_pickle(backend, tmp_path):
    state = backend.MultiHeadAttention(D, H, rng=backend_rng(backend, 0)).state_dict()
    backend.save_state_dict(tmp_path / "state.npz", state)
    with np.load(tmp_path / "state.npz", allow_pickle=False) as arrays:
        assert arrays.files == MHA_NAMES
        for name in MHA_NAMES:
            assert np.array_equal(arrays[name], backend.to_numpy(state[name])), name


def test_saved_state_loads_from_the_exact_path_given(backend, tmp_path):
    # np.savez would append ".npz" to a bare path; the file must be where the caller said
    state = backend.MultiHeadAttention(D, H, rng=backend_rng(backend, 0)).state_dict()
    backend.save_state_dict(tmp_path / "weights", state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]
    loaded = backend.load_state_dict(tmp_path / "weights")
    for name in MHA_NAMES:
        assert np.array_equal(backend.to_numpy(loaded[name]), backend.to_numpy(state[name])), name


def test_initial_values_follow_nn_linear_and_layer_norm(backend):
    state = _numpy_state(backend.TransformerBlock(D, H, F, rng=backend_rng(backend, 0)), backend)
    for name, value in state.items():
        assert value.dtype == np.float32, name  # dtype=None means float32
        if name.startswith("norm"):  # LayerNorm: weight ones, bias zeros
            expected = np.ones(D) if name.endswith("weight") else np.zeros(D)
            assert np.array_equal(value, expected), name
            continue
        fan_in = state[name.replace(".bias", ".weight")].shape[1]
        bound = 1 / math.sqrt(fan_in)
        assert np.all(np.abs(value) <= bound), f"{name} outside ±1/sqrt({fan_in})"
        assert len(np.unique(value)) > 1, f"{name} has all entries equal"
        if name.endswith("weight"):
            # at least 128 draws uniform in [-b, b]: each half-range is missed with chance 0.75^128
            assert value.max() > bound / 2 and value.min() < -bound / 2, f"{name} does not fill the range"


def test_initial_values_take_the_requested_dtype(backend):
    block = backend.TransformerBlock(D, H, F, rng=backend_rng(backend, 0), dtype=_dtype(backend, np.float64))
    assert {value.dtype for value in _numpy_state(block, backend).values()} == {np.dtype(np.float64)}


def test_same_rng_gives_the_same_initial_values(backend):
    first, second, other = (_numpy_state(backend.TransformerBlock(D, H, F, rng=backend_rng(backend, seed)), backend)
                            for seed in (0, 0, 1))
    for name in BLOCK_NAMES:
        assert np.array_equal(first[name], second[name]), name
    assert not np.array_equal(first["attn.w_q.weight"], other["attn.w_q.weight"])


def test_numpy_modules_cannot_be_changed_through_the_arrays_they_take_or_give():
    # NumPy and JAX modules are immutable (SPEC section 1); NumPy arrays are not, so the module owns
    # read-only copies
    import attention_np

    state = attention_np.TransformerBlock(4, 2, 8, 0.0, rng=0).state_dict()
    given = {name: value.copy() for name, value in state.items()}
    block = attention_np.TransformerBlock.from_state_dict(given, num_heads=2)
    given["attn.w_q.weight"][...] = 0.0  # the caller's array changes, the module's does not
    assert np.array_equal(block.state_dict()["attn.w_q.weight"], state["attn.w_q.weight"])
    with pytest.raises(ValueError, match="read-only"):
        block.state_dict()["norm1.weight"][0] = 2.0
    assert block.eval().state_dict()["ffn.0.weight"] is block.state_dict()["ffn.0.weight"]  # no copy per mode
