"""SPEC 2e on every backend: linear_attention against cases derived by hand and a double sum written here (one
query at a time), for every feature map, causal and not, every chunk size, with key_lengths; the causal forward
equals stepping the recurrent form; the vjp against torch's autograd of the quadratic form; half precision; the
errors; JAX under jit, grad and vmap with a lax.scan whose program does not grow with the chunks; torch's vjp
under no_grad and inference_mode."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from attention_np.common import validation
from tests._compare import REORDERED, assert_close, one_program
from tests.conftest import import_backend

RTOL = REORDERED  # float64 on every backend: the same math computed another way
CHUNKS = (None, 1, 2, 3)  # the prefix sums, and chunks that do not divide L = 5


def _phi(x: float, feature_map: str) -> float:
    """One entry of phi, written out: elu(x) + 1, max(x, 0), x."""
    if feature_map == "elu":
        return x + 1 if x > 0 else math.exp(x)
    return max(x, 0.0) if feature_map == "relu" else x


def _direct(q, k, v, feature_map, is_causal=False, key_lengths=None, eps=1e-6) -> np.ndarray:
    """out_i = sum_j w_ij v_j / (sum_j w_ij + eps), w_ij = phi(q_i) . phi(k_j), over the keys query i sees: a
    double sum, one query and one key at a time, on inputs already broadcast to (..., L or S, *)."""
    out = np.zeros((*q.shape[:-1], v.shape[-1]))
    lengths = np.broadcast_to(np.full(q.shape[:-2], k.shape[-2]) if key_lengths is None else key_lengths,
                              q.shape[:-2])
    for b in np.ndindex(*q.shape[:-2]):
        for i in range(q.shape[-2]):
            num, den = np.zeros(v.shape[-1]), eps
            for j in range(min(lengths[b], i + 1 if is_causal else k.shape[-2])):
                w = sum(_phi(a, feature_map) * _phi(c, feature_map) for a, c in zip(q[b][i], k[b][j], strict=True))
                num, den = num + w * v[b][j], den + w
            out[b][i] = num / den
    return out


def _inputs(feature_map: str, L: int = 5, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (2, 1, L, 3), k (1, 3, L, 3), v (2, 3, L, 4): leading axes that broadcast to (2, 3). The identity map's
    kernel q . k changes sign, so its inputs are positive (a normaliser near 0 would be ill-conditioned)."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, 1, L, 3)), rng.standard_normal((1, 3, L, 3)), rng.standard_normal((2, 3, L, 4))
    return (np.abs(q), np.abs(k), v) if feature_map == "identity" else (q, k, v)


def linear(M: ModuleType, q, k, v, key_lengths=None, **options) -> np.ndarray:
    """M's linear_attention on NumPy inputs; the output as a NumPy array."""
    key_lengths = None if key_lengths is None else M.asarray(key_lengths)
    return M.to_numpy(M.linear_attention(*(M.asarray(x) for x in (q, k, v)), key_lengths=key_lengths, **options))


def test_two_keys_by_hand(backend):
    # identity map, E = Ev = 1, q = 1, keys 1 and 2, values 3 and 6: weights phi(q) phi(k) = 1 and 2, so
    # out = (1 * 3 + 2 * 6) / (1 + 2) = 15 / 3 = 5; causal, query 0 sees key 0 alone: 3 / 1 = 3.
    # elu + 1: phi(1) = 2, phi(2) = 3, weights 2 * 2 = 4 and 2 * 3 = 6: (4 * 3 + 6 * 6) / (4 + 6) = 4.8.
    q, k, v = np.ones((2, 1)), np.array([[1.0], [2.0]]), np.array([[3.0], [6.0]])
    tiny = {"eps": 1e-300}  # below float64's resolution of these sums: the exact quotients
    np.testing.assert_array_equal(linear(backend, q, k, v, feature_map="identity", **tiny), [[5.0], [5.0]])
    for chunk in (None, 1):
        out = linear(backend, q, k, v, feature_map="identity", is_causal=True, chunk=chunk, **tiny)
        np.testing.assert_array_equal(out, [[3.0], [5.0]])
    np.testing.assert_allclose(linear(backend, q, k, v, **tiny), [[4.8], [4.8]], rtol=1e-15)
    # a query that sees no key: 0 / (0 + eps) = 0, and eps itself in the normaliser: 15 / (3 + 1)
    assert linear(backend, q, k, v, key_lengths=np.array(0))[0, 0] == 0.0
    np.testing.assert_allclose(linear(backend, q, k, v, feature_map="identity", eps=1.0), [[3.75], [3.75]])


@pytest.mark.parametrize("is_causal", [False, True], ids=["global", "causal"])
@pytest.mark.parametrize("feature_map", validation.FEATURE_MAPS)
def test_equals_the_double_sum(backend, feature_map, is_causal):
    q, k, v = _inputs(feature_map)
    key_lengths = np.array([[5, 3, 0], [2, 4, 5]])  # (2, 3): all keys, some, none
    wide = [np.broadcast_to(x, (2, 3, *x.shape[-2:])) for x in (q, k, v)]
    for lengths in (None, key_lengths):
        expected = _direct(*wide, feature_map, is_causal, lengths)
        for chunk in CHUNKS:  # non-causal attention ignores it
            out = linear(backend, q, k, v, lengths, feature_map=feature_map, is_causal=is_causal, chunk=chunk)
            assert_close(out, expected, RTOL, f"chunk={chunk} key_lengths={lengths is not None}")


@pytest.mark.parametrize("feature_map", validation.FEATURE_MAPS)
def test_causal_forward_equals_stepping_the_state(backend, feature_map):
    q, k, v = _inputs(feature_map)
    M = backend
    state = M.linear_attention_state((2, 3), 3, 4, dtype=M.asarray(np.zeros(0)).dtype)  # float64
    outs = []
    for t in range(5):  # one position at a time; q_t (2, 1, 3), k_t (1, 3, 3) broadcast to the state's (2, 3)
        out_t, state = M.linear_attention_step(*(M.asarray(x[..., t, :]) for x in (q, k, v)), state,
                                               feature_map=feature_map)
        outs.append(M.to_numpy(out_t))
    expected = linear(M, q, k, v, feature_map=feature_map, is_causal=True)
    assert_close(np.stack(outs, axis=-2), expected, RTOL, "steps")
    S, z = (M.to_numpy(x) for x in state)  # the state holds the sums over all positions
    phi_k = np.vectorize(lambda x: _phi(x, feature_map))(np.broadcast_to(k, (2, 3, 5, 3)))  # (2, 3, S, E)
    assert_close(z, phi_k.sum(axis=-2), RTOL, "z")
    assert_close(S, np.swapaxes(phi_k, -1, -2) @ v, RTOL, "S")


def test_step_returns_a_new_state_and_the_dtypes(backend):
    M = backend
    state = M.linear_attention_state((2,), 3, 4)  # float32, zeros
    assert [tuple(x.shape) for x in state] == [(2, 3, 4), (2, 3)]
    q = M.asarray(np.ones((2, 3), np.float16))
    out, new = M.linear_attention_step(q, q, M.asarray(np.ones((2, 4), np.float16)), state)
    assert M.to_numpy(out).dtype == np.float16 and all(M.to_numpy(x).dtype == np.float32 for x in new)
    assert all(not M.to_numpy(x).any() for x in state), "the state passed in changed"
    # phi(1) = 2: S' = phi(k) v^T = 2 and z' = 2 in every entry, out = 3 * (2 * 2) / (3 * (2 * 2) + eps) = 1
    np.testing.assert_allclose(M.to_numpy(out), np.ones((2, 4)), rtol=1e-3)


def _torch_direct(torch, q, k, v, feature_map, is_causal, key_lengths):
    """The quadratic form: w = phi(Q) phi(K)^T times the visible keys, out = w V / (rowsum(w) + eps)."""
    phi = {"elu": lambda x: torch.nn.functional.elu(x) + 1, "relu": torch.relu, "identity": lambda x: x}[feature_map]
    w = phi(q) @ phi(k).transpose(-1, -2)  # (..., L, S)
    L, S = w.shape[-2:]
    visible = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        visible = torch.tril(visible)
    visible = visible & (torch.arange(S) < torch.as_tensor(key_lengths)[..., None, None])
    w = torch.where(visible, w, 0)
    return (w @ v) / (w.sum(-1, keepdim=True) + 1e-6)


def _vjp_values(M: ModuleType, q, k, v, key_lengths, d_out, **options) -> tuple:
    """M's linear_attention_vjp on NumPy inputs: out and the pullback's (dq, dk, dv) at d_out; JAX's as one program
    per set of options (tests._compare.one_program: eagerly, each primitive compiled apart, 1.8 s of CPU over the
    feature maps, where the programs take 1). The eager vjp and pullback run in the last check of
    test_vjp_against_torch_autograd_of_the_quadratic_form."""
    return one_program(M, "linear_attention_vjp", q, k, v, d_out=d_out, key_lengths=key_lengths, **options)


@pytest.mark.parametrize("feature_map", validation.FEATURE_MAPS)
def test_vjp_against_torch_autograd_of_the_quadratic_form(backend, feature_map):
    torch = pytest.importorskip("torch")
    M = backend
    q, k, v = _inputs(feature_map, seed=1)
    key_lengths = np.array([[5, 3, 0], [2, 4, 5]])
    d_out = np.random.default_rng(2).standard_normal((2, 3, 5, 4))
    for is_causal, chunk in ((False, None), (True, None), (True, 2), (True, 3)):
        inputs = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        out = _torch_direct(torch, *inputs, feature_map, is_causal, key_lengths)
        expected = torch.autograd.grad(out, inputs, torch.tensor(d_out))  # summed over the broadcast axes
        got_out, grads = _vjp_values(M, q, k, v, key_lengths, d_out, feature_map=feature_map, is_causal=is_causal,
                                     chunk=chunk)
        assert_close(M.to_numpy(got_out), out.detach().numpy(), RTOL, "out")
        for name, got, want in zip("qkv", grads, expected, strict=True):
            assert tuple(got.shape) == tuple(want.shape), name
            assert_close(M.to_numpy(got), want.numpy(), 1e-10, f"d{name} causal={is_causal} chunk={chunk}")
    # the hidden keys of the sequences with key_lengths 0 get no gradient: k and v's batch entry (., 2)
    _, pullback = M.linear_attention_vjp(*(M.asarray(x) for x in (q, k, v)), key_lengths=M.asarray(key_lengths * 0))
    assert all(not M.to_numpy(g).any() for g in pullback(M.asarray(d_out))[1:])


def test_numpy_backward_by_hand_against_central_differences():
    M = import_backend("attention_np")
    q, k, v = _inputs("elu", L=4, seed=3)
    d_out = np.random.default_rng(4).standard_normal((2, 3, 4, 4))
    options = dict(is_causal=True, chunk=3, key_lengths=np.array([4, 2, 3]))
    _, pullback = M.linear_attention_vjp(q, k, v, **options)
    grads, h = pullback(d_out), 1e-6
    for index, x in enumerate((q, k, v)):
        numeric = np.zeros_like(x)
        for at in np.ndindex(*x.shape):
            moved = [[y.copy() for y in (q, k, v)] for _ in range(2)]
            moved[0][index][at] += h
            moved[1][index][at] -= h
            plus, minus = (np.sum(d_out * M.linear_attention(*xs, **options)) for xs in moved)
            numeric[at] = (plus - minus) / (2 * h)
        assert_close(grads[index], numeric, 1e-7, "dqkv"[index])


def test_no_positions_and_no_keys(backend):
    # JAX's as one program each (tests._compare.one_program): eagerly, each primitive compiled apart at these
    # shapes alone, 1.5 s of CPU
    M = backend
    empty, none = np.zeros((2, 0, 3)), np.zeros((2, 0, 4))
    for chunk in (None, 2):  # L = S = 0: empty outputs and gradients, also through autodiff
        out, grads = one_program(M, "linear_attention_vjp", empty, empty, none, d_out=none, is_causal=True,
                                 chunk=chunk)
        assert tuple(out.shape) == (2, 0, 4)
        assert [tuple(g.shape) for g in grads] == [(2, 0, 3), (2, 0, 3), (2, 0, 4)]
    q = np.ones((2, 3, 3))  # S = 0: every query sees no key, 0 / eps
    np.testing.assert_array_equal(M.to_numpy(one_program(M, "linear_attention", q, empty, none)), np.zeros((2, 3, 4)))


def test_half_precision_returns_its_dtype(backend):
    M = backend
    q, k, v = _inputs("elu")
    expected = linear(M, q, k, v, is_causal=True, chunk=2)
    for dtype in (np.float16,):
        out = linear(M, *(x.astype(dtype) for x in (q, k, v)), is_causal=True, chunk=2)
        assert out.dtype == dtype
        assert_close(out.astype(np.float64), expected, 5e-3, "float16")  # the inputs' and output's rounding


def _errors(M: ModuleType) -> dict[str, tuple[type, str, Callable]]:
    """Each bad input: (the exception, a word its message holds, the call)."""
    x = M.asarray(np.ones((2, 4, 3)))
    f32 = M.asarray(np.ones((2, 4, 3), np.float32))
    state = M.linear_attention_state((2,), 3, 3, dtype=x.dtype)
    t = x[:, 0, :]
    return {
        "feature_map": (ValueError, "feature_map", lambda: M.linear_attention(x, x, x, feature_map="softmax")),
        "eps zero": (ValueError, "eps", lambda: M.linear_attention(x, x, x, eps=0.0)),
        "eps inf": (ValueError, "eps", lambda: M.linear_attention(x, x, x, eps=math.inf)),
        "chunk zero": (ValueError, "chunk", lambda: M.linear_attention(x, x, x, is_causal=True, chunk=0)),
        "chunk float": (ValueError, "chunk", lambda: M.linear_attention(x, x, x, chunk=2.0)),  # checked, unused
        "chunk bool": (ValueError, "chunk", lambda: M.linear_attention(x, x, x, is_causal=True, chunk=True)),
        "causal L != S": (ValueError, "L = 3, S = 4", lambda: M.linear_attention(x[:, :3], x, x, is_causal=True)),
        "widths": (ValueError, "q and k", lambda: M.linear_attention(x[..., :2], x, x)),
        "key_lengths float": (TypeError, "key_lengths",
                              lambda: M.linear_attention(x, x, x, key_lengths=M.asarray(np.ones(2)))),
        "key_lengths shape": (ValueError, "key_lengths",
                              lambda: M.linear_attention(x, x, x, key_lengths=M.asarray(np.ones(3, int)))),
        "mixed dtypes": (TypeError, "dtype", lambda: M.linear_attention(x, f32, x)),
        "integers": (TypeError, "floating", lambda: M.linear_attention(*[M.asarray(np.ones((2, 4, 3), int))] * 3)),
        "d_out": (ValueError, "d_out", lambda: M.linear_attention_vjp(x, x, x)[1](x[:, :2])),
        "batch_shape": (ValueError, "batch_shape", lambda: M.linear_attention_state((-1,), 3, 3)),
        "state dtype": (TypeError, "state", lambda: M.linear_attention_step(t, t, t, M.linear_attention_state(
            (2,), 3, 3))),  # float32 for float64 inputs
        "state shape": (ValueError, "state", lambda: M.linear_attention_step(t, t, t, M.linear_attention_state(
            (3,), 3, 3, dtype=x.dtype))),
        "state pair": (ValueError, "state", lambda: M.linear_attention_step(t, t, t, state[0])),
        "step feature_map": (ValueError, "feature_map",
                             lambda: M.linear_attention_step(t, t, t, state, feature_map="exp")),
    }


def test_errors_name_the_argument(backend):
    for case, (error, word, call) in _errors(backend).items():
        with pytest.raises(error, match=word) as raised:
            call()
        assert type(raised.value) is error, case  # the same type on every backend, not a subclass


def test_feature_maps_are_the_shared_table(backend):
    assert tuple(importlib.import_module(f"{backend.__name__}.linear").FEATURE_MAPS) == validation.FEATURE_MAPS


def test_jax_under_jit_grad_and_vmap_with_one_scan():
    M = import_backend("attention_jax")
    import jax
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(x[0]) for x in _inputs("elu"))  # (1, 5, 3), (3, 5, 3), (3, 5, 4)
    lengths = jnp.asarray([5, 2, 4])

    def loss(q, k, v, key_lengths):
        return jnp.sum(M.linear_attention(q, k, v, is_causal=True, key_lengths=key_lengths, chunk=2) ** 2)

    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v, lengths)  # key_lengths traced
    # the reference without chunks, its key_lengths a constant, is one program too: its eager grad compiled each
    # primitive apart (1.5 s of CPU, where the program takes 0.3); the eager forward is what vmap and scan meet
    reference = jax.jit(jax.grad(lambda q, k, v: jnp.sum(M.linear_attention(q, k, v, is_causal=True,
                                                                            key_lengths=lengths) ** 2),
                                 (0, 1, 2)))(q, k, v)
    for got, expected in zip(grads, reference, strict=True):
        assert_close(np.asarray(got), np.asarray(expected), RTOL, "jit(grad)")
    eager = np.asarray(M.linear_attention(k, k, v, is_causal=True))
    batched = jax.vmap(lambda q, k, v: M.linear_attention(q, k, v, is_causal=True, chunk=3))(k, k, v)
    assert_close(np.asarray(batched), eager, RTOL, "vmap")
    # one lax.scan: the traced program has the same size whatever the number of chunks
    sizes = [len(jax.make_jaxpr(lambda x: loss(x, x, x, None))(jnp.zeros((L, 3))).jaxpr.eqns) for L in (5, 41)]
    assert sizes[0] == sizes[1], sizes
    # the recurrent form under lax.scan: the state is a pytree
    _, outs = jax.lax.scan(lambda state, x: M.linear_attention_step(*x, state)[::-1],
                           M.linear_attention_state((3,), 3, 4, dtype=jnp.float64),
                           (jnp.moveaxis(k, -2, 0), jnp.moveaxis(k, -2, 0), jnp.moveaxis(v, -2, 0)))
    assert_close(np.asarray(jnp.moveaxis(outs, 0, -2)), eager, RTOL, "scan of steps")


def test_torch_vjp_under_no_grad_and_inference_mode():
    M = import_backend("attention_torch")
    import torch

    q, k, v = (torch.tensor(x) for x in _inputs("relu"))
    d_out = torch.ones(2, 3, 5, 4, dtype=torch.float64)
    _, pullback = M.linear_attention_vjp(q, k, v, is_causal=True, chunk=2)
    expected = pullback(d_out)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            _, pullback = M.linear_attention_vjp(q, k, v, is_causal=True, chunk=2)
            for got, want in zip(pullback(d_out), expected, strict=True):
                assert_close(got.numpy(), want.numpy(), RTOL, context.__name__)


def test_numpy_chunked_causal_memory_stays_below_the_prefix_states():
    """tracemalloc's peak at L = 2048, E = Ev = 64, float64, B = H = 1, over the forward and backward pass: the
    prefix sums keep (L, E, Ev) states, 64 MiB; chunks of 64 keep L / 64 states of E x Ev (2 MiB) and (64, 64)
    scores, so the peak is that of a few (L, E) arrays (the inputs' features, out, the gradients: 1 MiB each),
    at most 16 of them (SPEC 2e)."""
    import tracemalloc

    M = import_backend("attention_np")
    rng = np.random.default_rng(0)
    L, E = 2048, 64
    q, k, v, d_out = (rng.standard_normal((L, E)) for _ in range(4))
    states, row_arrays = L * E * E * 8, L * E * 8  # (L, E, Ev) and (L, E) in float64

    def peak(chunk: int | None) -> int:
        tracemalloc.start()
        try:
            _, pullback = M.linear_attention_vjp(q, k, v, is_causal=True, chunk=chunk)
            pullback(d_out)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    prefix, chunked = peak(None), peak(64)
    assert prefix >= states, f"the prefix form peaked at {prefix / 2**20:.1f} MiB, below its states"  # the check bites
    assert chunked <= 16 * row_arrays, f"chunks of 64 peaked at {chunked / 2**20:.1f} MiB"
