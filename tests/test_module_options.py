"""The module options of SPEC sections 3 to 5: num_kv_heads (grouped-query attention), bias=False, rope_theta,
norm="rms" and activation="swiglu". Checked against torch's own pieces (nn.RMSNorm, F.silu,
nn.Linear(bias=False), F.scaled_dot_product_attention's enable_gqa, Hugging Face's rotate_half written out)
in float64, across the three backends on both paths, through from_state_dict's inference and errors, and
through NumPy's hand-derived backward pass."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close, central_differences, method_program
from tests.conftest import BACKENDS, import_backend

D, H, HKV, F, B, L = 8, 4, 2, 12, 2, 5  # d_model, heads, key/value heads, d_ff, batch, positions
D_K = D // H
LLAMA = {"norm_first": True, "norm": "rms", "activation": "swiglu", "bias": False, "num_kv_heads": HKV}
LAYOUTS = {  # block options -> (from_state_dict's activation, norm_first)
    "llama": LLAMA,
    "post_rms_swiglu_bias_mqa": {"norm": "rms", "activation": "swiglu", "num_kv_heads": 1},
    "pre_layer_gelu_no_bias": {"norm_first": True, "activation": "gelu", "bias": False},
    "seed": {},
}
EPS = 1e-3  # not the default, so an eps that does not reach the norm shows


def _x(*shape: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _block(M: ModuleType, options: dict, seed: int = 0) -> object:
    """A float64 block with random parameters drawn by the NumPy backend (norm gains not one), loaded into M."""
    import attention_np

    block = attention_np.TransformerBlock(D, H, F, 0.0, eps=EPS, rng=seed, dtype=np.float64, **options)
    state = {name: value * (1.5 if name.startswith("norm") else 1.0) for name, value in block.state_dict().items()}
    state = {name: M.asarray(value + 0.1 * _x(*value.shape, seed=3)) for name, value in state.items()}
    return M.TransformerBlock.from_state_dict(state, num_heads=H, dropout=0.0, eps=EPS,
                                              norm_first=options.get("norm_first", False),
                                              activation=options.get("activation", "relu"))


def _numpy_state(module: object, M: ModuleType) -> dict[str, np.ndarray]:
    return {name: M.to_numpy(value) for name, value in module.state_dict().items()}


# --- torch's own pieces as the reference ----------------------------------------------------------------

def _torch_reference(state: dict[str, np.ndarray], x: np.ndarray, options: dict) -> tuple[np.ndarray, np.ndarray]:
    """The block written plainly with torch pieces in float64: nn.RMSNorm / F.layer_norm, nn.Linear(bias=False)
    where there is no bias, F.silu, and heads repeated per group for grouped-query attention."""
    torch = pytest.importorskip("torch")
    t = {name: torch.tensor(value) for name, value in state.items()}

    def linear(name: str, y: torch.Tensor) -> torch.Tensor:
        weight = t[f"{name}.weight"]
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=f"{name}.bias" in t, dtype=torch.float64)
        layer.load_state_dict({part: t[f"{name}.{part}"] for part in ("weight", "bias") if f"{name}.{part}" in t})
        return layer(y)

    def norm(name: str, y: torch.Tensor) -> torch.Tensor:
        if options.get("norm") == "rms":
            layer = torch.nn.RMSNorm(D, eps=EPS, dtype=torch.float64)
            layer.load_state_dict({"weight": t[f"{name}.weight"]})
            return layer(y)
        return torch.nn.functional.layer_norm(y, (D,), t[f"{name}.weight"], t[f"{name}.bias"], EPS)

    def attention(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hkv = options.get("num_kv_heads") or H
        q = linear("attn.w_q", y).unflatten(-1, (H, D_K)).transpose(-2, -3)  # (B, H, L, d_k)
        k, v = (linear(f"attn.{name}", y).unflatten(-1, (hkv, D_K)).transpose(-2, -3) for name in ("w_k", "w_v"))
        k, v = (z.repeat_interleave(H // hkv, dim=-3) for z in (k, v))  # head g serves query heads g*G..g*G+G-1
        weights = torch.softmax(q @ k.transpose(-1, -2) / D_K**0.5, dim=-1)  # (B, H, L, L)
        return linear("attn.w_o", (weights @ v).transpose(-2, -3).flatten(-2)), weights

    def feed_forward(y: torch.Tensor) -> torch.Tensor:
        if options.get("activation") == "swiglu":
            return linear("ffn.w_down", torch.nn.functional.silu(linear("ffn.w_gate", y)) * linear("ffn.w_up", y))
        act = torch.nn.functional.gelu if options.get("activation") == "gelu" else torch.relu
        return linear("ffn.3", act(linear("ffn.0", y)))

    with torch.no_grad():
        y = torch.tensor(x)
        if options.get("norm_first"):
            a, weights = attention(norm("norm1", y))
            y = y + a
            y = y + feed_forward(norm("norm2", y))
        else:
            a, weights = attention(y)
            y = norm("norm1", y + a)
            y = norm("norm2", y + feed_forward(y))
    return y.numpy(), weights.numpy()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", BACKENDS)
def test_block_matches_torch_pieces_on_both_paths(name: str, layout: str) -> None:
    M, options = import_backend(name), LAYOUTS[layout]
    block, x = _block(M, options).eval(), _x(B, L, D)
    expected_out, expected_weights = _torch_reference(_numpy_state(block, M), x, options)
    out, weights = block(M.asarray(x))
    fast, none = block(M.asarray(x), need_weights=False)
    assert none is None
    assert_close(M.to_numpy(out), expected_out, REORDERED, f"{name} {layout} out")
    assert_close(M.to_numpy(weights), expected_weights, REORDERED, f"{name} {layout} weights")
    assert_close(M.to_numpy(fast), expected_out, REORDERED, f"{name} {layout} fast path")


@pytest.mark.parametrize("name", BACKENDS)
def test_mha_one_kv_head_is_every_query_head_reading_it(name: str) -> None:
    # multi-query attention equals the full MHA whose w_k, w_v repeat the one key/value head H times
    M = import_backend(name)
    mqa = M.MultiHeadAttention(D, H, 0.0, num_kv_heads=1, bias=False, rng=_rng(M), dtype=_float64(M)).eval()
    state = _numpy_state(mqa, M)
    assert state["w_k.weight"].shape == (D_K, D) and "w_k.bias" not in state
    full = {name: np.tile(value, (H, 1)) if name[:3] in ("w_k", "w_v") else value for name, value in state.items()}
    mha = M.MultiHeadAttention.from_state_dict({n: M.asarray(v) for n, v in full.items()}, num_heads=H).eval()
    q, kv = M.asarray(_x(B, 3, D)), M.asarray(_x(B, L, D, seed=2))
    called = method_program(M, "__call__")
    for a, b in zip(called(mqa, q, kv, kv), called(mha, q, kv, kv), strict=True):
        assert_close(M.to_numpy(a), M.to_numpy(b), 1e-13, name)


def _rotate_half_rope(x: object, positions: object, theta: float) -> object:
    """Hugging Face's RoPE, written out: x * cos + rotate_half(x) * sin, angles p * theta^(-2j / E) repeated
    over both halves; x (..., n, E) torch, positions (n,)."""
    import torch

    E = x.shape[-1]
    angles = positions[:, None].double() * theta ** (-torch.arange(0, E, 2, dtype=torch.float64) / E)
    angles = torch.cat([angles, angles], dim=-1)  # (n, E)
    rotated = torch.cat([-x[..., E // 2:], x[..., : E // 2]], dim=-1)  # rotate_half
    return x * torch.cos(angles) + rotated * torch.sin(angles)


@pytest.mark.parametrize("name", BACKENDS)
def test_mha_with_rope_matches_torch_pieces_in_cross_attention(name: str) -> None:
    # queries turned at 0 .. L - 1 and keys at 0 .. S - 1 (each sequence counts its own), values not turned;
    # grouped heads, on both paths
    torch = pytest.importorskip("torch")
    M, S, theta = import_backend(name), L + 3, 10.0
    mha = M.MultiHeadAttention(D, H, 0.0, num_kv_heads=HKV, rope_theta=theta, rng=_rng(M),
                               dtype=_float64(M)).eval()
    state, q, kv = _numpy_state(mha, M), _x(B, L, D), _x(B, S, D, seed=2)
    t = {n: torch.tensor(v) for n, v in state.items()}

    def heads(x: np.ndarray, name: str, count: int) -> object:
        y = torch.nn.functional.linear(torch.tensor(x), t[f"{name}.weight"], t[f"{name}.bias"])
        return y.unflatten(-1, (count, D_K)).transpose(-2, -3)  # (B, count, n, d_k)

    q_h = _rotate_half_rope(heads(q, "w_q", H), torch.arange(L), theta)
    k_h = _rotate_half_rope(heads(kv, "w_k", HKV), torch.arange(S), theta)
    out = torch.nn.functional.scaled_dot_product_attention(q_h, k_h, heads(kv, "w_v", HKV), enable_gqa=True)
    expected = torch.nn.functional.linear(out.transpose(-2, -3).flatten(-2), t["w_o.weight"], t["w_o.bias"])
    for need_weights in (True, False):
        got, _ = method_program(M, "__call__", need_weights=need_weights)(mha, M.asarray(q), M.asarray(kv),
                                                                          M.asarray(kv))
        assert_close(M.to_numpy(got), expected.numpy(), REORDERED, f"{name} need_weights={need_weights}")
    plain = M.MultiHeadAttention.from_state_dict({n: M.asarray(v) for n, v in state.items()}, num_heads=H).eval()
    got = method_program(M, "__call__")(plain, M.asarray(q), M.asarray(kv), M.asarray(kv))[0]
    assert np.max(np.abs(M.to_numpy(got) - expected.numpy())) > 1e-3


def _rng(M: ModuleType) -> object:
    from tests.conftest import backend_rng

    return backend_rng(M, 0)


def _float64(M: ModuleType) -> object:
    if M.__name__ == "attention_torch":
        import torch

        return torch.float64
    return np.float64


# --- state dicts: layouts, inference, errors ------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
def test_llama_block_state_names_and_shapes(name: str) -> None:
    M = import_backend(name)
    block = M.TransformerBlock(D, H, F, rng=_rng(M), **LLAMA)
    shapes = {key: tuple(value.shape) for key, value in block.state_dict().items()}
    assert shapes == {"attn.w_q.weight": (D, D), "attn.w_k.weight": (HKV * D_K, D),
                      "attn.w_v.weight": (HKV * D_K, D), "attn.w_o.weight": (D, D),
                      "norm1.weight": (D,), "norm2.weight": (D,), "ffn.w_gate.weight": (F, D),
                      "ffn.w_up.weight": (F, D), "ffn.w_down.weight": (D, F)}


@pytest.mark.parametrize("name", BACKENDS)
def test_layer_norm_keeps_its_bias_without_linear_biases(name: str) -> None:
    M = import_backend(name)
    names = list(M.TransformerBlock(D, H, F, bias=False, rng=_rng(M)).state_dict())
    assert names == ["attn.w_q.weight", "attn.w_k.weight", "attn.w_v.weight", "attn.w_o.weight",
                     "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "ffn.0.weight", "ffn.3.weight"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", BACKENDS)
def test_from_state_dict_infers_the_layout(name: str, layout: str) -> None:
    M, options = import_backend(name), LAYOUTS[layout]
    block = _block(M, options)
    assert block.attn.num_kv_heads == (options.get("num_kv_heads") or H)
    assert (block.attn.w_q.bias is None) == (options.get("bias") is False)
    assert type(block.norm1).__name__ == ("RMSNorm" if options.get("norm") == "rms" else "LayerNorm")
    assert block.ffn.activation == options.get("activation", "relu")


@pytest.mark.parametrize("name", BACKENDS)
def test_from_state_dict_reads_swiglu_off_the_entries(name: str) -> None:
    # activation=None (the default): SwiGLU for ffn.w_gate, w_up, w_down; ReLU, the seed's, for ffn.0, ffn.3
    M = import_backend(name)
    for options, activation in ((LLAMA, "swiglu"), ({}, "relu")):
        state = {n: M.asarray(v) for n, v in _state(options).items()}
        assert M.TransformerBlock.from_state_dict(state, num_heads=H).ffn.activation == activation
    gelu = M.TransformerBlock.from_state_dict({n: M.asarray(v) for n, v in _state({}).items()}, num_heads=H,
                                              activation="gelu")
    assert gelu.ffn.activation == "gelu"  # the shapes cannot tell GELU from ReLU: it is still an argument


def _errors(make: object) -> set[tuple[str, str]]:
    """The (type, message) that building raises on every backend."""
    seen = set()
    for name in BACKENDS:
        with pytest.raises((ValueError, TypeError)) as info:
            make(import_backend(name))
        seen.add((type(info.value).__name__, str(info.value)))
    return seen


@pytest.mark.parametrize(("build", "words"), [
    (lambda M: M.MultiHeadAttention(D, H, num_kv_heads=3), ("num_kv_heads", "num_heads=4", "3")),
    (lambda M: M.MultiHeadAttention(D, H, num_kv_heads=True), ("num_kv_heads",)),
    (lambda M: M.TransformerBlock(D, H, F, norm="batch"), ("norm", "'batch'")),
    (lambda M: M.TransformerBlock(D, H, F, activation="geglu"), ("activation", "'geglu'")),
    (lambda M: M.MultiHeadAttention(D, H, rope_theta=0.0), ("rope_theta", "0.0")),
    (lambda M: M.TransformerBlock(D, H, F, rope_theta=True), ("rope_theta", "True")),
    (lambda M: M.MultiHeadAttention(6, 2, rope_theta=1e4), ("rope_theta", "6 / 2 = 3", "even")),
    (lambda M: M.MultiHeadAttention.from_state_dict(
        {n.removeprefix("attn."): M.asarray(v) for n, v in _state({}).items() if n.startswith("attn.")},
        num_heads=8, rope_theta=10.0), ("rope_theta", "8 / 8 = 1")),
])
def test_bad_options_raise_one_error_on_every_backend(build: object, words: tuple[str, ...]) -> None:
    (seen,) = _errors(build)  # one type and message on all three backends
    assert seen[0] == "ValueError" and all(word in seen[1] for word in words), seen


def _state(options: dict) -> dict[str, np.ndarray]:
    import attention_np

    return attention_np.TransformerBlock(D, H, F, rng=0, dtype=np.float64, **options).state_dict()


@pytest.mark.parametrize(("state", "activation", "words"), [
    (lambda: _state(LLAMA), "relu", ("'relu'", "ffn.w_gate")),
    (lambda: _state({}), "swiglu", ("'swiglu'", "ffn.0")),
    (lambda: {k: v for k, v in _state({}).items() if k not in ("attn.w_k.bias", "ffn.3.bias")}, "relu",
     ("missing attn.w_k.bias", "missing ffn.3.bias")),
    (lambda: _state(LLAMA) | {"attn.w_q.bias": np.zeros(D)}, "swiglu",
     ("missing attn.w_k.bias", "missing ffn.w_down.bias")),
])
def test_bad_states_raise_one_error_on_every_backend(state: object, activation: str, words: tuple[str, ...]) -> None:
    made = state()
    (seen,) = _errors(lambda M: M.TransformerBlock.from_state_dict(
        {n: M.asarray(v) for n, v in made.items()}, num_heads=H, activation=activation))
    assert seen[0] == "ValueError" and all(word in seen[1] for word in words), seen


# --- gradients -----------------------------------------------------------------------------------------------

STEP = 1e-6  # the central differences' step


@pytest.mark.parametrize("layout", ["llama", "post_rms_swiglu_bias_mqa", "pre_layer_gelu_no_bias"])
def test_numpy_block_vjp_matches_central_differences(layout: str) -> None:
    M = import_backend("attention_np")
    block, x = _block(M, LAYOUTS[layout]).eval(), _x(1, 3, D)
    d_out = _x(1, 3, D, seed=5)
    _, _, pullback = block.vjp(x)
    dx, grads = pullback(d_out)
    assert_close(dx, central_differences(lambda y: block(y)[0], x, d_out, STEP), 1e-7, "dx")
    state = block.state_dict()
    for name in ("norm1.weight", "attn.w_k.weight", "ffn.w_gate.weight" if "ffn.w_gate.weight" in state
                 else "ffn.0.weight"):
        def loaded(value: np.ndarray, name: str = name) -> np.ndarray:
            changed = type(block).from_state_dict(state | {name: value}, num_heads=H, dropout=0.0, eps=EPS,
                                                  norm_first=block.norm_first, activation=block.ffn.activation)
            return changed(x)[0]
        assert_close(grads[name], central_differences(loaded, state[name], d_out, STEP), 1e-7, name)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_numpy_block_vjp_matches_torch_autograd(layout: str) -> None:
    np_block = _block(import_backend("attention_np"), LAYOUTS[layout]).eval()
    T = import_backend("attention_torch")
    t_block = _block(T, LAYOUTS[layout]).eval()
    x, d_out = _x(B, L, D), _x(B, L, D, seed=4)
    dx, grads = np_block.vjp(x)[2](d_out)
    t_dx, t_grads = t_block.vjp(T.asarray(x))[2](T.asarray(d_out))
    assert list(grads) == list(t_grads) == list(np_block.state_dict())
    assert_close(dx, T.to_numpy(t_dx), REORDERED, "dx")
    for name, grad in grads.items():  # w_k.bias adds q . b_k to a whole row of scores: its gradient is 0
        np.testing.assert_allclose(grad, T.to_numpy(t_grads[name]), rtol=1e-11, atol=1e-13, err_msg=name)


def test_numpy_mha_vjp_sums_each_kv_head_over_its_group() -> None:
    # against torch autograd through the torch backend's grouped MHA without biases
    N, T = import_backend("attention_np"), import_backend("attention_torch")
    mha = N.MultiHeadAttention(D, H, 0.0, num_kv_heads=HKV, bias=False, rng=0, dtype=np.float64)
    t_mha = T.MultiHeadAttention.from_state_dict({n: T.asarray(v) for n, v in mha.state_dict().items()},
                                                 num_heads=H, dropout=0.0)
    q, k, d_out = _x(B, 3, D), _x(B, L, D, seed=2), _x(B, 3, D, seed=3)
    ours = mha.vjp(q, k, k)[2](d_out)
    theirs = t_mha.vjp(*(T.asarray(a) for a in (q, k, k)))[2](T.asarray(d_out))
    for a, b, what in zip(ours[:3], theirs[:3], "qkv", strict=True):
        assert_close(a, T.to_numpy(b), REORDERED, f"d{what}")
    assert set(ours[3]) == {"w_q.weight", "w_k.weight", "w_v.weight", "w_o.weight"}
    for name, grad in ours[3].items():
        assert_close(grad, T.to_numpy(theirs[3][name]), REORDERED, name)


def test_jax_llama_block_under_jit_and_grad() -> None:
    jax = pytest.importorskip("jax")
    J = import_backend("attention_jax")
    block, x = _block(J, LLAMA).eval(), J.asarray(_x(B, L, D))
    out = jax.jit(lambda b, y: b(y)[0])(block, x)
    assert_close(J.to_numpy(out), J.to_numpy(block(x)[0]), 1e-14, "jit")
    grads = jax.jit(jax.grad(lambda b, y: b(y)[0].sum()))(block, x)  # one program: an eager grad compiles each
    # primitive of the block's forward and backward apart (most of this test's CPU time)
    assert list(grads.state_dict()) == list(block.state_dict())
    _, _, pullback = _block(import_backend("attention_np"), LLAMA).eval().vjp(_x(B, L, D))
    _, np_grads = pullback(np.ones((B, L, D)))
    for name, grad in grads.state_dict().items():
        assert_close(J.to_numpy(grad), np_grads[name], REORDERED, name)
