"""SPEC 2a on every backend and both paths: q_offset, window, key_lengths and softcap against masks and
formulas built here, independently of the backends, and against torch's and jax.nn's built-ins; their
gradients; their errors (SPEC 7)."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close, converted, one_program, sdpa
from tests.conftest import BACKENDS, import_backend

RTOL = REORDERED  # float64 on every backend: the same math computed another way


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _qkv(lead: tuple[int, ...] = (2, 3), L: int = 4, S: int = 6, E: int = 5, Ev: int = 3, seed: int = 0) -> list:
    return [_random(*lead, L, E, seed=seed), _random(*lead, S, E, seed=seed + 1), _random(*lead, S, Ev, seed=seed + 2)]


def _reference(q, k, v, visible, *, bias=None, softcap=None, scale=None) -> tuple[np.ndarray, np.ndarray]:
    """The test's own attention: one query row at a time over an explicit boolean `visible` (..., L, S),
    raw scores capped as softcap * tanh(raw / softcap), zeros for a row that sees no key."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    raw = np.einsum("...le,...se->...ls", q, k) * scale
    scores = raw if softcap is None else softcap * np.tanh(raw / softcap)
    scores = scores + (0 if bias is None else bias)
    visible = np.broadcast_to(visible, scores.shape)
    weights = np.zeros_like(scores)
    for index in np.ndindex(scores.shape[:-1]):
        seen = visible[index]
        if seen.any():
            row = np.exp(scores[index][seen] - scores[index][seen].max())
            weights[index][seen] = row / row.sum()
    return weights @ v, weights


def _program(M: ModuleType, q, k, v, mask=None, **options) -> tuple[np.ndarray, np.ndarray | None]:
    """tests._compare.sdpa as one program: JAX's under one jax.jit per shape and set of static options, where a
    test's shapes are its own (eagerly, each primitive compiles apart at every new shape); the tests whose
    shapes many calls share run eagerly, as users do."""
    out, weights = one_program(M, "scaled_dot_product_attention", q, k, v, mask, **options)
    return M.to_numpy(out), None if weights is None else M.to_numpy(weights)


def _positions_mask(L: int, S: int, *, lead=(), is_causal=False, q_offset=0, window=None, key_lengths=None):
    """The visible keys as SPEC 2a defines them, by loops over (batch index, i, j)."""
    q_offset, key_lengths = np.broadcast_to(q_offset, lead), np.broadcast_to(S if key_lengths is None
                                                                             else key_lengths, lead)
    visible = np.ones((*lead, L, S), bool)
    for b in np.ndindex(lead):
        for i in range(L):
            p = q_offset[b] + i
            for j in range(S):
                seen = j < key_lengths[b] and (j <= p or not is_causal)
                if window is not None:
                    left, right = window
                    seen &= (left is None or p - left <= j) and (right is None or j <= p + right)
                visible[(*b, i, j)] = seen
    return visible


# ---- the mask helpers


def test_causal_mask_with_offset_s_minus_l_is_bottom_right(backend: ModuleType):
    # q_offset = S - L = 2: query 0 sees keys 0..2, the last query all five
    expected = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
    assert np.array_equal(backend.to_numpy(backend.causal_mask(3, 5, q_offset=2)), expected)
    assert np.array_equal(backend.to_numpy(backend.causal_mask(3, 5)), np.tril(np.ones((3, 5), bool)))


def test_bottom_right_causal_equals_torchs_causal_lower_right(backend: ModuleType):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    for L, S in ((3, 5), (4, 4), (1, 6)):
        q, k, v = _qkv(L=L, S=S)
        theirs = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                                attn_mask=causal_lower_right(L, S)).numpy()
        for need_weights in (True, False):
            ours, _ = _program(backend, q, k, v, is_causal=True, q_offset=S - L, need_weights=need_weights)
            assert_close(ours, theirs, RTOL, f"L={L}, S={S}, need_weights={need_weights}")


@pytest.mark.parametrize("window", [(1, 2), (0, 0), (None, 1), (2, None), (None, None)], ids=str)
def test_window_mask_per_offset_matches_the_loops(backend: ModuleType, window):
    q_offset = np.array([0, 3, -2])
    got = backend.to_numpy(backend.window_mask(4, 6, window, q_offset=converted(backend, q_offset)))
    assert got.shape == (3, 4, 6) and got.dtype == bool
    assert np.array_equal(got, _positions_mask(4, 6, lead=(3,), q_offset=q_offset, window=window))


def test_window_mask_known_rows(backend: ModuleType):
    # p_i = 1 + i; window (1, 0): keys p_i - 1 and p_i
    expected = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], bool)
    assert np.array_equal(backend.to_numpy(backend.window_mask(3, 4, (1, 0), q_offset=1)), expected)


# ---- each keyword against an explicit mask, both paths

CASES = {
    "causal_offset_int": dict(is_causal=True, q_offset=2),
    "causal_offset_per_batch": dict(is_causal=True, q_offset=np.array([[2], [-1]])),  # (2, 1): one per b
    "causal_offset_per_head": dict(is_causal=True, q_offset=np.array([0, 2, 5])),  # (3,): one per h
    "window": dict(window=(1, 1)),
    "window_offset": dict(window=(2, 0), q_offset=np.array([[0], [3]])),
    "mistral": dict(is_causal=True, window=(2, 0)),
    "key_lengths": dict(key_lengths=np.array([[6], [2]])),
    "key_lengths_zero": dict(key_lengths=np.array([[0], [3]])),
    "everything": dict(is_causal=True, q_offset=np.array([[1], [2]]), window=(3, None),
                       key_lengths=np.array([[5], [4]])),
}


def _explicit(options: dict, L=4, S=6, lead=(2, 3)) -> np.ndarray:
    return _positions_mask(L, S, lead=lead, **{name: options[name] for name in options if name != "softcap"})


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_keywords_equal_the_explicit_mask(backend: ModuleType, options: dict, need_weights: bool):
    q, k, v = _qkv()
    out, weights = sdpa(backend, q, k, v, **options, need_weights=need_weights)
    expected_out, expected_weights = _reference(q, k, v, _explicit(options))
    assert_close(out, expected_out, RTOL, "out")
    if need_weights:
        assert_close(weights, expected_weights, RTOL, "weights")
    # the same through the caller's own mask: the keywords are a mask built from positions
    via_mask, _ = sdpa(backend, q, k, v, _explicit(options), need_weights=need_weights)
    assert_close(out, via_mask, RTOL, "keywords against mask=")


def test_q_offset_alone_changes_nothing(backend: ModuleType):
    q, k, v = _qkv()
    plain, _ = sdpa(backend, q, k, v)
    moved, _ = sdpa(backend, q, k, v, q_offset=np.array([[7], [-3]]))
    assert_close(moved, plain, 0.0, "q_offset without is_causal or window")


def test_key_lengths_equal_the_padding_mask(backend: ModuleType):
    q, k, v = _qkv(lead=(3,), S=5)
    lengths = np.array([5, 2, 1])
    padded, _ = sdpa(backend, q, k, v, backend.to_numpy(backend.padding_mask(backend.asarray(lengths), 5))[:, 0])
    by_lengths, _ = sdpa(backend, q, k, v, key_lengths=lengths)
    assert_close(by_lengths, padded, 0.0, "key_lengths against padding_mask")


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
def test_fully_masked_rows_from_positions_are_zeros(backend: ModuleType, need_weights: bool):
    q, k, v = _qkv(lead=(2,), L=3, S=4)
    cases = {  # each hides every key from some rows
        "key_lengths 0": dict(key_lengths=np.array([0, 4])),  # batch 0: no keys
        "window outside the keys": dict(window=(0, 0), q_offset=np.array([2, 0])),  # p_i = 4 >= S for i = 2, b 0
        "negative offset, causal": dict(is_causal=True, q_offset=np.array([-2, 0])),  # p_0 = -2, p_1 = -1: no key
    }
    for name, options in cases.items():
        visible = _positions_mask(3, 4, lead=(2,), **options)
        assert not visible.any(axis=-1).all(), name  # the case does hide whole rows
        out, weights = sdpa(backend, q, k, v, **options, need_weights=need_weights)
        assert np.all(out[~visible.any(axis=-1)] == 0), name
        assert np.all(np.isfinite(out)), name
        assert_close(out, _reference(q, k, v, visible)[0], RTOL, name)
        if need_weights:
            assert np.all(weights[~visible.any(axis=-1)] == 0), name


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
def test_nan_behind_a_window_or_key_length_reaches_no_row(backend: ModuleType, need_weights: bool):
    q, k, v = _qkv(lead=(), L=3, S=5)
    k[4] = np.nan  # key 4: hidden by key_lengths 4 from every row (a NaN score, SPEC 2's rule)
    k[0] = np.nan  # key 0: seen only by query 0 under the window (0, 1)
    out, _ = sdpa(backend, q, k, v, window=(0, 1), key_lengths=np.array(4), need_weights=need_weights)
    assert np.isnan(out[0]).all() and np.isfinite(out[1:]).all()


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
def test_empty_queries_or_keys_with_every_keyword(backend: ModuleType, need_weights: bool):
    options = dict(is_causal=True, q_offset=np.array([1, 2]), window=(1, 1), key_lengths=np.array([1, 0]),
                   softcap=3.0)
    for L, S in ((0, 4), (3, 0)):
        q, k, v = _qkv(lead=(2,), L=L, S=S)
        out, weights = _program(backend, q, k, v, **options, need_weights=need_weights)
        assert out.shape == (2, L, 3) and not out.any()
        if need_weights:
            assert weights.shape == (2, L, S)


# ---- softcap


def test_softcap_known_value(backend: ModuleType):
    # one query, two keys; raw scores q k^T * scale = [0, 4] with scale 1; softcap 2: [0, 2 tanh(2)],
    # weights [1, e^(2 tanh 2)] / (1 + e^(2 tanh 2)); v = [[0], [1]] gives out = the second weight
    q, k, v = np.array([[1.0, 0.0]]), np.array([[0.0, 0.0], [4.0, 0.0]]), np.array([[0.0], [1.0]])
    capped = np.exp(2 * np.tanh(2.0))
    out, weights = sdpa(backend, q, k, v, scale=1.0, softcap=2.0)
    assert_close(weights, np.array([[1, capped]]) / (1 + capped), RTOL, "weights")
    assert_close(out, np.array([[capped / (1 + capped)]]), RTOL, "out")


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
def test_softcap_before_bias_and_masks(backend: ModuleType, need_weights: bool):
    q, k, v = _qkv()
    q *= 4  # raw scores well beyond the cap, where it matters
    bias = _random(3, 4, 6, seed=9)
    bias[0, 0, 1] = -np.inf  # a -inf bias still hides
    mask = _random(2, 1, 4, 6, seed=8) > -0.7
    out, weights = sdpa(backend, q, k, v, mask, bias=bias, softcap=1.5, need_weights=need_weights)
    expected_out, expected_weights = _reference(q, k, v, mask & (bias != -np.inf), bias=bias, softcap=1.5)
    assert_close(out, expected_out, RTOL, "out")
    if need_weights:
        assert_close(weights, expected_weights, RTOL, "weights")


# ---- every backend and path agree with everything combined


@pytest.mark.parametrize("seed", range(4))
def test_backends_and_paths_agree_with_every_keyword(seed: int):
    rng = np.random.default_rng(seed)
    L, S = int(rng.integers(1, 6)), int(rng.integers(1, 7))
    q, k, v = _qkv(L=L, S=S, seed=seed)
    mask = rng.random((2, 1, L, S)) > 0.2
    bias = np.where(rng.random((3, L, S)) > 0.9, -np.inf, rng.standard_normal((3, L, S)))
    options = dict(bias=bias, is_causal=bool(seed % 2), q_offset=rng.integers(-2, S, (2, 1)),
                   window=(int(rng.integers(0, 3)), [None, 1][seed % 2]), key_lengths=rng.integers(0, S + 1, (2, 3)),
                   softcap=[None, 2.0][seed // 2 % 2])
    visible = mask & (bias != -np.inf) & _positions_mask(L, S, lead=(2, 3), **{n: options[n] for n in (
        "is_causal", "q_offset", "window", "key_lengths")})
    expected, _ = _reference(q, k, v, visible, bias=np.where(bias == -np.inf, 0, bias), softcap=options["softcap"])
    for name in BACKENDS:
        M = import_backend(name)
        for need_weights in (True, False):
            out, _ = _program(M, q, k, v, mask, **options, need_weights=need_weights)
            assert_close(out, expected, RTOL, f"{name} need_weights={need_weights}")


def test_half_precision_is_computed_in_float32(backend: ModuleType):
    q, k, v = (x.astype(np.float16) for x in _qkv())
    options = dict(is_causal=True, q_offset=np.array([[1], [0]]), window=(2, 1), key_lengths=np.array([[5], [3]]),
                   softcap=2.0)
    expected, _ = _reference(*(x.astype(np.float64) for x in (q, k, v)), _explicit(options), softcap=2.0)
    for need_weights in (True, False):
        out, _ = _program(backend, q, k, v, **options, need_weights=need_weights)
        assert out.dtype == np.float16
        assert_close(out.astype(np.float64), expected.astype(np.float16).astype(np.float64), 2e-3, "float16")


# ---- against the frameworks' built-ins


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_against_torch_sdpa_with_the_explicit_boolean_mask(backend: ModuleType, options: dict):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    q, k, v = _qkv()
    visible = _explicit(options)
    theirs = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                            attn_mask=torch.from_numpy(visible)).numpy()
    theirs = np.where(visible.any(axis=-1, keepdims=True), theirs, 0)  # torch: NaN rows where none is visible
    ours, _ = sdpa(backend, q, k, v, **options, need_weights=False)
    assert_close(ours, theirs, RTOL, "against torch")


@pytest.mark.parametrize("window", [(1, 1), (2, 0), (0, 3)], ids=str)
def test_against_jax_nn_local_window_and_key_value_lengths(backend: ModuleType, window):
    # jax.nn's window is i - left <= j <= i + right, ours with q_offset 0; its key_value_seq_lengths are our
    # key_lengths, one per batch element. It averages the values of a row with no visible key, so every row
    # here sees one: every window holds the query's own key, and the lengths are at least L
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    B, N, L, S, E = 2, 3, 4, 6, 5
    q, k, v = _qkv(lead=(B, N), L=L, S=S, E=E, Ev=E)
    lengths = np.array([6, 4])
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):  # jax: its own code mixes
        theirs = jax.nn.dot_product_attention(*(jnp.asarray(np.swapaxes(x, 1, 2)) for x in (q, k, v)),
                                              local_window_size=window,
                                              key_value_seq_lengths=jnp.asarray(lengths, jnp.int32),
                                              implementation="xla")  # (B, L, N, E)
    ours, _ = sdpa(backend, q, k, v, window=window, key_lengths=lengths[:, None], need_weights=False)
    # jax.nn: its softmax runs in float32 even for float64 inputs; a wrong key would be off by far more
    assert_close(ours, np.swapaxes(np.asarray(theirs), 1, 2), 1e-6, "against jax.nn")


# ---- gradients

GRADIENT_CASES = {
    "softcap": dict(softcap=1.5),
    "softcap_bias_causal": dict(softcap=2.0, is_causal=True, q_offset=np.array([[1], [0]]), bias=True),
    "window": dict(window=(1, 1), q_offset=np.array([[0], [2]])),
    "key_lengths": dict(key_lengths=np.array([[4], [0]]), bias=True),
    "everything": dict(softcap=3.0, is_causal=True, q_offset=np.array([[2], [1]]), window=(2, None),
                       key_lengths=np.array([[5], [3]]), bias=True),
}


def _gradient_case(options: dict) -> tuple[list, np.ndarray, dict]:
    q, k, v = _qkv(L=3, S=5, seed=4)
    q *= 3  # beyond the cap
    options = dict(options)
    if options.pop("bias", False):
        options["bias"] = _random(3, 3, 5, seed=5)
    return [q, k, v], _random(2, 3, 3, 3, seed=6), options


def _vjp(M: ModuleType, inputs: list, d_out: np.ndarray, options: dict) -> dict[str, np.ndarray]:
    keywords = {name: converted(M, value) for name, value in options.items()}
    _, _, pullback = M.scaled_dot_product_attention_vjp(*(M.asarray(x) for x in inputs), **keywords)
    grads = pullback(M.asarray(d_out))
    return {name: M.to_numpy(g) for name, g in zip(("dq", "dk", "dv", "dbias"), grads, strict=True) if g is not None}


@pytest.mark.parametrize("options", GRADIENT_CASES.values(), ids=GRADIENT_CASES.keys())
def test_vjp_agrees_across_backends(options: dict):
    inputs, d_out, options = _gradient_case(options)
    expected = _vjp(import_backend("attention_np"), inputs, d_out, options)
    for name in BACKENDS[1:]:
        got = _vjp(import_backend(name), inputs, d_out, options)
        assert got.keys() == expected.keys()
        for grad in expected:
            assert_close(got[grad], expected[grad], 1e-11, f"{name} {grad}")


@pytest.mark.parametrize("options", GRADIENT_CASES.values(), ids=GRADIENT_CASES.keys())
def test_numpy_vjp_matches_central_differences(options: dict):
    import attention_np

    inputs, d_out, options = _gradient_case(options)
    grads = _vjp(attention_np, inputs, d_out, options)
    names = ["dq", "dk", "dv"] + (["dbias"] if "bias" in options else [])
    arrays = [*inputs] + ([options["bias"]] if "bias" in options else [])

    def loss(*xs: np.ndarray) -> float:
        extra = {"bias": xs[3]} if len(xs) > 3 else {}
        out, _ = attention_np.scaled_dot_product_attention(*xs[:3], **{**options, **extra})
        return float(np.sum(out * d_out))

    h = 1e-6
    for position, name in enumerate(names):
        numeric = np.zeros_like(arrays[position])
        for index in np.ndindex(arrays[position].shape):
            plus, minus = [list(arrays) for _ in range(2)]
            plus[position], minus[position] = arrays[position].copy(), arrays[position].copy()
            plus[position][index] += h
            minus[position][index] -= h
            numeric[index] = (loss(*plus) - loss(*minus)) / (2 * h)
        assert_close(grads[name], numeric, 1e-7, name)


def test_jax_grad_under_jit_with_traced_offsets_and_lengths():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import attention_jax
    import attention_np

    inputs, d_out, options = _gradient_case(GRADIENT_CASES["everything"])
    bias, q_offset, key_lengths = (jnp.asarray(options.pop(name)) for name in ("bias", "q_offset", "key_lengths"))

    @jax.jit
    def loss(q, k, v, bias, q_offset, key_lengths):  # q_offset and key_lengths: tracers here
        out, _ = attention_jax.scaled_dot_product_attention(q, k, v, bias=bias, q_offset=q_offset,
                                                            key_lengths=key_lengths, need_weights=False, **options)
        return jnp.sum(out * jnp.asarray(d_out))

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*(jnp.asarray(x) for x in inputs), bias, q_offset, key_lengths)
    expected = _vjp(attention_np, inputs, d_out, {**GRADIENT_CASES["everything"], "bias": np.asarray(bias)})
    for name, grad in zip(("dq", "dk", "dv", "dbias"), grads, strict=True):
        assert_close(np.asarray(grad), expected[name], 1e-11, name)


def test_torch_autograd_matches_the_numpy_vjp():
    torch = pytest.importorskip("torch")

    import attention_np
    import attention_torch

    inputs, d_out, options = _gradient_case(GRADIENT_CASES["everything"])
    leaves = [torch.tensor(x, requires_grad=True) for x in (*inputs, options["bias"])]
    keywords = {name: converted(attention_torch, value) for name, value in options.items() if name != "bias"}
    out, _ = attention_torch.scaled_dot_product_attention(*leaves[:3], bias=leaves[3], **keywords)
    out.backward(torch.from_numpy(d_out))
    expected = _vjp(attention_np, inputs, d_out, options)
    for name, leaf in zip(("dq", "dk", "dv", "dbias"), leaves, strict=True):
        assert_close(leaf.grad.numpy(), expected[name], 1e-11, name)


# ---- errors (SPEC 7): the same type and words on every backend

ERRORS = {
    "window negative": (dict(window=(-1, 0)), ValueError, ["window", "(-1, 0)"]),
    "window one side": (dict(window=(1,)), ValueError, ["window", "(1,)"]),
    "window float": (dict(window=(1.5, 0)), ValueError, ["window", "1.5"]),
    "window string": (dict(window="left"), ValueError, ["window", "left"]),
    "softcap zero": (dict(softcap=0.0), ValueError, ["softcap", "0.0"]),
    "softcap negative": (dict(softcap=-2.0), ValueError, ["softcap", "-2.0"]),
    "softcap nan": (dict(softcap=float("nan")), ValueError, ["softcap", "nan"]),
    "q_offset float": (dict(is_causal=True, q_offset=1.5), TypeError, ["q_offset", "float"]),
    "q_offset float array": (dict(q_offset=np.array([1.0, 2.0])), TypeError, ["q_offset", "float"]),
    "key_lengths float array": (dict(key_lengths=np.array([1.0, 2.0])), TypeError, ["key_lengths", "float"]),
    "q_offset shape": (dict(q_offset=np.array([1, 2, 3])), ValueError, ["q_offset", "(3,)", "(2,)"]),
    "key_lengths shape": (dict(key_lengths=np.ones((2, 1, 4), np.int64)), ValueError,
                          ["key_lengths", "(2, 1, 4)", "(2,)"]),
    "key_lengths per key": (dict(key_lengths=np.ones((2, 3), np.int64)), ValueError, ["key_lengths", "(2, 3)"]),
}


@pytest.mark.parametrize("vjp", [False, True], ids=["forward", "vjp"])
@pytest.mark.parametrize(("options", "error", "words"), ERRORS.values(), ids=ERRORS.keys())
def test_each_mistake_raises_the_same_error(backend: ModuleType, options: dict, error: type, words: list, vjp: bool):
    q, k, v = (backend.asarray(x) for x in _qkv(lead=(2,), L=3, S=4))
    options = {name: converted(backend, value) for name, value in options.items()}
    function = backend.scaled_dot_product_attention_vjp if vjp else backend.scaled_dot_product_attention
    with pytest.raises(error) as raised:
        function(q, k, v, **options)
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_errors_hold_with_empty_queries_and_in_the_mask_helpers(backend: ModuleType):
    q, k, v = (backend.asarray(x) for x in _qkv(lead=(2,), L=0, S=4))
    with pytest.raises(ValueError, match="window"):
        backend.scaled_dot_product_attention(q, k, v, window=(0, -1))
    with pytest.raises(TypeError, match="key_lengths"):
        backend.scaled_dot_product_attention(q, k, v, key_lengths=backend.asarray(np.array([0.5, 1.0])))
    with pytest.raises(ValueError, match="window"):
        backend.window_mask(2, 3, (None, -2))
    with pytest.raises(TypeError, match="q_offset"):
        backend.causal_mask(2, 3, q_offset=0.5)


def test_jax_checks_the_dtype_and_shape_of_traced_offsets_and_lengths():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import attention_jax

    q, k, v = (jnp.asarray(x) for x in _qkv(lead=(2,), L=3, S=4))
    attend = jax.jit(lambda q_offset, key_lengths: attention_jax.scaled_dot_product_attention(
        q, k, v, is_causal=True, q_offset=q_offset, key_lengths=key_lengths)[0])
    with pytest.raises(TypeError, match="q_offset"):
        attend(jnp.asarray([0.5, 1.0]), jnp.asarray([4, 4]))
    with pytest.raises(ValueError, match=r"key_lengths.*\(3,\).*\(2,\)"):
        attend(jnp.asarray([0, 1]), jnp.asarray([4, 4, 4]))
    out = attend(jnp.asarray([1, -3]), jnp.asarray([4, 2]))  # traced values: batch 1 sees no key at all
    assert not np.asarray(out[1]).any() and np.isfinite(np.asarray(out)).all()
