"""MultiHeadAttention(..., attention="linear") on every backend (SPEC sections 3, 5 and 7): the projections,
RoPE and grouped heads of softmax attention around linear_attention in each head, in float64, against the pieces
written out here (one head at a time) and against torch autograd of the composition written in torch; the state
dict is the softmax module's; no weights; the errors, the same on every backend; NumPy's hand-written vjp against
central differences; JAX under jit and grad."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close, central_differences
from tests.conftest import BACKENDS, import_backend

D, H, B, L, S = 8, 4, 2, 3, 5  # d_model, heads, batch, query and key positions (cross-attention: L != S)
D_K = D // H
OPTIONS = {  # MultiHeadAttention options -> the layout each case pins
    "grouped": {"num_kv_heads": 2},
    "no_bias": {"bias": False},
    "rope_one_kv_head": {"rope_theta": 10.0, "num_kv_heads": 1},
}


def _x(*shape: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _state(options: dict) -> dict[str, np.ndarray]:
    """float64 parameters drawn by the NumPy backend (the softmax module's: the state dict does not depend on it)."""
    import attention_np

    return attention_np.MultiHeadAttention(D, H, 0.0, rng=0, dtype=np.float64, **options).state_dict()


def _linear_mha(M: ModuleType, state: dict[str, np.ndarray], options: dict) -> object:
    return M.MultiHeadAttention.from_state_dict({n: M.asarray(v) for n, v in state.items()}, num_heads=H,
                                                dropout=0.0, rope_theta=options.get("rope_theta"), attention="linear")


def _written_out(state: dict[str, np.ndarray], options: dict, q: np.ndarray, kv: np.ndarray, *,
                 is_causal: bool = False) -> np.ndarray:
    """The module written out one head at a time: project, slice head h and its key/value head g = h // (H / Hkv),
    turn q and k by RoPE (apply_rope, positions from 0 in each), linear_attention with its defaults (causal or
    not), then concatenate and mix with w_o. NumPy's pieces, which tests/test_rope.py and tests/test_linear.py hold
    to the other backends'."""
    import attention_np as N

    hkv = options.get("num_kv_heads") or H

    def linear(name: str, x: np.ndarray) -> np.ndarray:
        return x @ state[f"{name}.weight"].T + state.get(f"{name}.bias", 0.0)  # (..., n, in) -> (..., n, out)

    q_p, k_p, v_p = linear("w_q", q), linear("w_k", kv), linear("w_v", kv)
    heads = []
    for h in range(H):
        g = h // (H // hkv)
        q_h, k_h, v_h = (x[..., i * D_K:(i + 1) * D_K] for x, i in ((q_p, h), (k_p, g), (v_p, g)))  # (B, n, d_k)
        if "rope_theta" in options:
            q_h = N.apply_rope(q_h, np.arange(q.shape[-2]), theta=options["rope_theta"])
            k_h = N.apply_rope(k_h, np.arange(kv.shape[-2]), theta=options["rope_theta"])
        heads.append(N.linear_attention(q_h, k_h, v_h, is_causal=is_causal))  # (B, L, d_k)
    return linear("w_o", np.concatenate(heads, axis=-1))  # (B, L, H * d_k) -> (B, L, D)


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_linear_mha_is_the_projections_around_linear_attention_per_head(backend: ModuleType, case: str) -> None:
    options, q, kv = OPTIONS[case], _x(B, L, D), _x(B, S, D, seed=2)
    state = _state(options)
    mha = _linear_mha(backend, state, options)
    expected = _written_out(state, options, q, kv)
    for need_weights in (True, False):  # linear attention forms no weights: None either way
        out, weights = mha(backend.asarray(q), backend.asarray(kv), backend.asarray(kv), need_weights=need_weights)
        assert weights is None
        assert_close(backend.to_numpy(out), expected, REORDERED, f"{backend.__name__} {case}")
    out, _ = mha.eval()(backend.asarray(q), backend.asarray(kv), backend.asarray(kv))  # eval: the same numbers
    assert_close(backend.to_numpy(out), expected, REORDERED, f"{backend.__name__} {case} eval")


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_causal_linear_mha_is_the_causal_linear_attention_per_head(backend: ModuleType, case: str) -> None:
    # self-attention (L = S), each head's linear_attention(is_causal=True): query i sees keys j <= i only
    options, x = OPTIONS[case], _x(B, S, D)
    state = _state(options)
    mha, X = _linear_mha(backend, state, options), backend.asarray(x)
    expected = _written_out(state, options, x, x, is_causal=True)
    out, weights = mha(X, X, X, is_causal=True)
    assert weights is None
    assert_close(backend.to_numpy(out), expected, REORDERED, f"{backend.__name__} {case} causal")
    # the last query sees every key: causal or not, the same row; the first differs (it sees one key)
    bidirectional = backend.to_numpy(mha(X, X, X)[0])
    assert_close(backend.to_numpy(out)[:, -1], bidirectional[:, -1], REORDERED, "the last query")
    assert np.abs(backend.to_numpy(out)[:, 0] - bidirectional[:, 0]).max() > 1e-3


def test_linear_mha_state_dict_is_the_softmax_modules(backend: ModuleType) -> None:
    # same names and shapes; each module loads the other's state, bit for bit
    options = {"num_kv_heads": 2, "bias": False}
    linear = backend.MultiHeadAttention(D, H, 0.0, attention="linear", **options)
    softmax = backend.MultiHeadAttention(D, H, 0.0, **options)
    shapes = {name: tuple(value.shape) for name, value in linear.state_dict().items()}
    assert shapes == {name: tuple(value.shape) for name, value in softmax.state_dict().items()}
    for source, attention in ((linear, "softmax"), (softmax, "linear")):
        state = source.state_dict()
        loaded = backend.MultiHeadAttention.from_state_dict(state, num_heads=H, dropout=0.0, attention=attention)
        assert loaded.attention == attention and loaded.eval().attention == attention
        for name, value in loaded.state_dict().items():
            assert np.array_equal(backend.to_numpy(value), backend.to_numpy(state[name])), name


def _errors(make: Callable) -> set[tuple[str, str]]:
    """The (type, message) that `make(M)` raises on every backend."""
    seen = set()
    for name in BACKENDS:
        with pytest.raises((ValueError, TypeError, NotImplementedError)) as info:
            make(import_backend(name))
        seen.add((type(info.value).__name__, str(info.value)))
    return seen


def _call_with_mask(M: ModuleType) -> object:
    x = M.asarray(_x(B, L, D))
    mha = _linear_mha(M, _state({}), {})
    return mha(x, x, x, M.asarray(np.ones((L, L), bool)))


def _extend_a_softmax_cache(M: ModuleType) -> object:
    cache = M.MultiHeadAttention.from_state_dict({n: M.asarray(v) for n, v in _state({}).items()},
                                                 num_heads=H).init_cache((B,), L)
    x = M.asarray(_x(B, 1, D))
    return _linear_mha(M, _state({}), {}).extend(x, x, cache)


@pytest.mark.parametrize(("make", "words"), [
    (lambda M: M.MultiHeadAttention(D, H, 0.0, attention="performer"),
     ("attention", "'softmax', 'linear'", "'performer'")),
    (lambda M: M.MultiHeadAttention(D, H, attention="linear"), ("dropout", "attention='linear'", "0.1")),
    (lambda M: M.MultiHeadAttention.from_state_dict({n: M.asarray(v) for n, v in _state({}).items()},
                                                    num_heads=H, attention="linear"),
     ("dropout", "attention='linear'", "0.1")),
    (lambda M: M.MultiHeadAttention.from_state_dict({n: M.asarray(v) for n, v in _state({}).items()},
                                                    num_heads=H, dropout=0.0, attention="Linear"),
     ("attention", "'Linear'")),
    (_call_with_mask, ("mask", "attention='linear'")),
    (lambda M: _linear_mha(M, _state({}), {}).init_paged_cache(B, 2, 2, 2),
     ("init_paged_cache", "attention='linear'")),
    (_extend_a_softmax_cache, ("extend", "attention='linear'")),
], ids=["unknown", "dropout", "dropout_from_state_dict", "unknown_from_state_dict", "mask", "init_paged_cache",
        "extend"])
def test_linear_mha_errors_are_one_value_error_on_every_backend(make: Callable, words: tuple[str, ...]) -> None:
    (seen,) = _errors(make)  # one type and message on all three backends
    assert seen[0] == "ValueError" and all(word in seen[1] for word in words), seen


# --- gradients -----------------------------------------------------------------------------------------------

def _torch_composition(state: dict[str, np.ndarray], q: np.ndarray, kv: np.ndarray, d_out: np.ndarray,
                       hkv: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The module written in torch, key/value heads repeated per group and linear attention as
    phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1 + eps), phi = elu + 1; out and torch autograd's gradients of
    <out, d_out> with respect to q, kv (as k and v) and every state entry."""
    torch = pytest.importorskip("torch")
    t = {name: torch.tensor(value, requires_grad=True) for name, value in state.items()}
    inputs = {name: torch.tensor(x, requires_grad=True) for name, x in (("q", q), ("k", kv), ("v", kv))}

    def heads(name: str, x: torch.Tensor, count: int) -> torch.Tensor:
        y = torch.nn.functional.linear(x, t[f"{name}.weight"], t.get(f"{name}.bias"))
        return y.unflatten(-1, (count, D_K)).transpose(-2, -3)  # (B, n, count * d_k) -> (B, count, n, d_k)

    phi_q = torch.nn.functional.elu(heads("w_q", inputs["q"], H)) + 1  # (B, H, L, d_k)
    phi_k = (torch.nn.functional.elu(heads("w_k", inputs["k"], hkv)) + 1).repeat_interleave(H // hkv, dim=-3)
    v = heads("w_v", inputs["v"], hkv).repeat_interleave(H // hkv, dim=-3)  # (B, H, S, d_k)
    num = phi_q @ (phi_k.transpose(-1, -2) @ v)  # (B, H, L, d_k) x (B, H, d_k, d_k)
    den = phi_q @ phi_k.sum(dim=-2, keepdim=True).transpose(-1, -2) + 1e-6  # (B, H, L, 1)
    out = torch.nn.functional.linear((num / den).transpose(-2, -3).flatten(-2), t["w_o.weight"], t["w_o.bias"])
    out.backward(torch.tensor(d_out))
    grads = {name: x.grad.numpy() for name, x in (inputs | t).items()}
    return out.detach().numpy(), grads


def _vjp_values(M: ModuleType, mha: object, q: object, k: object, v: object, d_out: object) -> tuple:
    """mha.vjp(q, k, v): out, weights and the pullback's gradients at d_out. JAX's runs as one jax.jit, the module a
    traced pytree: eagerly, each primitive of the forward and backward passes compiled apart (most of the JAX
    case's CPU time). The claim is values; test_jax_linear_mha_under_jit_and_grad calls the module eagerly."""
    def values(mha: object, q: object, k: object, v: object, d_out: object) -> tuple:
        out, weights, pullback = mha.vjp(q, k, v)
        return out, weights, pullback(d_out)

    if M.__name__ == "attention_jax":
        import jax

        values = jax.jit(values)
    return values(mha, q, k, v, d_out)


def test_linear_mha_vjp_matches_torch_autograd_of_the_composition(backend: ModuleType) -> None:
    # grouped heads (each key/value head's gradients summed over its group), with biases
    options = {"num_kv_heads": 2}
    state, q, kv, d_out = _state(options), _x(B, L, D), _x(B, S, D, seed=2), _x(B, L, D, seed=3)
    expected_out, expected = _torch_composition(state, q, kv, d_out, options["num_kv_heads"])
    out, weights, (dq, dk, dv, grads) = _vjp_values(backend, _linear_mha(backend, state, options),
                                                    *(backend.asarray(x) for x in (q, kv, kv, d_out)))
    assert weights is None
    assert_close(backend.to_numpy(out), expected_out, REORDERED, "out")
    for name, grad in (("q", dq), ("k", dk), ("v", dv), *grads.items()):
        assert_close(backend.to_numpy(grad), expected[name], REORDERED, f"{backend.__name__} d{name}")
    assert set(grads) == set(state)


STEP = 1e-5  # the central differences' step: dq is small here, and 1e-6 missed by rounding


def test_numpy_linear_mha_vjp_matches_central_differences() -> None:
    # the hand-written backward pass through RoPE, one key/value head shared by every query head, and biases
    N, options = import_backend("attention_np"), OPTIONS["rope_one_kv_head"]
    state, q, kv, d_out = _state(options), _x(1, 2, D), _x(1, 3, D, seed=2), _x(1, 2, D, seed=3)
    mha = _linear_mha(N, state, options)
    dq, dk, dv, grads = mha.vjp(q, kv, kv)[2](d_out)
    for name, grad, f, x in (("q", dq, lambda y: mha(y, kv, kv)[0], q), ("k", dk, lambda y: mha(q, y, kv)[0], kv),
                             ("v", dv, lambda y: mha(q, kv, y)[0], kv)):
        assert_close(grad, central_differences(f, x, d_out, STEP), 1e-7, f"d{name}")
    for name in ("w_q.weight", "w_k.weight", "w_k.bias", "w_v.bias", "w_o.weight"):
        def loaded(value: np.ndarray, name: str = name) -> np.ndarray:
            return _linear_mha(N, state | {name: value}, options)(q, kv, kv)[0]
        assert_close(grads[name], central_differences(loaded, state[name], d_out, STEP), 1e-7, name)


def test_jax_linear_mha_under_jit_and_grad() -> None:
    jax = pytest.importorskip("jax")
    J, N, options = import_backend("attention_jax"), import_backend("attention_np"), OPTIONS["rope_one_kv_head"]
    state, x = _state(options), _x(B, L, D)
    mha = _linear_mha(J, state, options)
    out = jax.jit(lambda m, y: m(y, y, y)[0])(mha, J.asarray(x))
    assert_close(J.to_numpy(out), J.to_numpy(mha(J.asarray(x), J.asarray(x), J.asarray(x))[0]), 1e-14, "jit")
    grads = jax.jit(jax.grad(lambda m, y: m(y, y, y)[0].sum()))(mha, J.asarray(x)).state_dict()
    _, _, pullback = _linear_mha(N, state, options).vjp(x, x, x)
    np_grads = pullback(np.ones((B, L, D)))[3]
    assert list(grads) == list(np_grads) == list(state)
    for name, grad in grads.items():
        assert_close(J.to_numpy(grad), np_grads[name], REORDERED, name)
