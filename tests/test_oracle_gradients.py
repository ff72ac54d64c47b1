"""The oracle's own vector-Jacobian products (conformance/contract/oracle_gradients.py) in float64, against central
differences of the oracle's forward and against attention_np's hand-derived backward: two independent checks."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes  # noqa: F401  (gives NumPy the name bfloat16)
import numpy as np
import pytest

import attention_np
from attention_np.common import mods
from conformance.contract import oracle, oracle_gradients

STEP = 1e-6  # central differences of tiny, well-conditioned cases: truncation ~ STEP^2, rounding ~ 1e-16 / STEP


def _directional(forward: Callable[..., np.ndarray], arrays: dict[str, np.ndarray], d_out: np.ndarray,
                 name: str, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """<d_out, (f(a + h u) - f(a - h u)) / 2h> for argument `name` along a random u (0 where a is -inf)."""
    value = arrays[name]
    u = np.where(np.isfinite(value), rng.standard_normal(value.shape), 0.0)
    plus, minus = (forward(**arrays | {name: value + sign * STEP * u}) for sign in (1, -1))
    return float(np.sum(d_out * (plus - minus)) / (2 * STEP)), u


def _assert_matches_differences(forward: Callable[..., np.ndarray], vjp: Callable[..., dict], arrays: dict,
                                               seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d_out = rng.standard_normal(forward(**arrays).shape)
    grads = vjp(**arrays, d_out=d_out)
    assert set(grads) == set(arrays)
    for name, grad in grads.items():
        assert grad.shape == np.shape(arrays[name]) and grad.dtype == np.float64
        difference, u = _directional(forward, arrays, d_out, name, rng)
        assert abs(np.sum(grad * u) - difference) <= 1e-6 * (1 + abs(difference)), name
    return grads


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


SDPA_CASES = {  # keywords of oracle.sdpa; q (2, 2, 3, 4), k and v (2, 2 or 1, 5, 4 | 3) unless grouped
    "plain": {},
    "causal_with_offset": {"is_causal": True, "q_offset": 1},
    "softcap": {"softcap": 1.5, "scale": 2.0},
    "window": {"window": (1, 2), "q_offset": np.array([[0], [2]])},
    "key_lengths_per_sequence": {"key_lengths": np.array([[2], [5]])},
    "grouped_heads": {"enable_gqa": True, "is_causal": True},
    "mask": {"mask": np.array([[1, 0, 1, 1, 0], [0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], bool)},
}


@pytest.mark.parametrize("name", sorted(SDPA_CASES))
def test_sdpa_vjp_matches_central_differences_and_attention_np(name: str):
    rng = np.random.default_rng(1)
    keywords = dict(SDPA_CASES[name])
    Hkv = 1 if keywords.get("enable_gqa") else 2
    arrays = {"q": _rand(rng, 2, 2, 3, 4), "k": _rand(rng, 2, Hkv, 5, 4), "v": _rand(rng, 2, Hkv, 5, 3)}
    mask = keywords.pop("mask", None)

    def forward(**a: np.ndarray) -> np.ndarray:
        return oracle.sdpa(a["q"], a["k"], a["v"], mask, **keywords)[0]

    def vjp(d_out: np.ndarray, **a: np.ndarray) -> dict:
        return oracle_gradients.sdpa_vjp(a["q"], a["k"], a["v"], d_out, mask, **keywords)

    grads = _assert_matches_differences(forward, vjp, arrays)
    d_out = np.random.default_rng(0).standard_normal(forward(**arrays).shape)
    _, _, pullback = attention_np.scaled_dot_product_attention_vjp(arrays["q"], arrays["k"], arrays["v"], mask,
                                                                   **keywords)
    theirs = dict(zip(("q", "k", "v"), pullback(d_out), strict=False))
    for key in ("q", "k", "v"):
        np.testing.assert_allclose(grads[key], theirs[key], rtol=1e-12, atol=1e-12)


def test_sdpa_vjp_sums_a_broadcast_bias_and_passes_no_gradient_through_a_hidden_key():
    rng = np.random.default_rng(2)
    bias = _rand(rng, 1, 3, 4)  # (1, L, S): broadcast over the batch of 2
    bias[0, 1, 2] = -np.inf  # key 2 hidden from query 1
    arrays = {"q": _rand(rng, 2, 3, 4), "k": _rand(rng, 2, 4, 4), "v": _rand(rng, 2, 4, 2), "bias": bias}

    def forward(**a: np.ndarray) -> np.ndarray:
        return oracle.sdpa(a["q"], a["k"], a["v"], bias=a["bias"])[0]

    def vjp(d_out: np.ndarray, **a: np.ndarray) -> dict:
        return oracle_gradients.sdpa_vjp(a["q"], a["k"], a["v"], d_out, bias=a["bias"])

    grads = _assert_matches_differences(forward, vjp, arrays)
    assert grads["bias"].shape == (1, 3, 4) and grads["bias"][0, 1, 2] == 0


def test_a_query_that_sees_no_key_gets_zero_gradient_and_gives_none():
    rng = np.random.default_rng(3)
    q, k, v = _rand(rng, 3, 4), _rand(rng, 4, 4), _rand(rng, 4, 2)
    mask = np.ones((3, 4), bool)
    mask[1] = False  # query 1 sees nothing: its out is zeros whatever q, k, v are
    grads = oracle_gradients.sdpa_vjp(q, k, v, np.ones((3, 2)), mask)
    assert np.all(grads["q"][1] == 0)
    only_row_1 = oracle_gradients.sdpa_vjp(q, k, v, np.eye(3)[:, [1]] * np.ones((3, 2)), mask)
    assert all(np.all(grad == 0) for grad in only_row_1.values())


def test_sdpa_vjp_refuses_mods():
    q = np.ones((1, 1, 2, 2))
    with pytest.raises(NotImplementedError, match="mask_mod"):
        oracle_gradients.sdpa_vjp(q, q, q, q, mask_mod=mods.causal())


LINEAR_CASES = {  # keywords of oracle.linear_attention; q (2, 3, 2), k and v (2, 3, 2 | 3); eps large enough to
    # keep the central differences resolvable
    "elu": {"eps": 1e-3},
    "relu_causal": {"feature_map": "relu", "is_causal": True, "eps": 1e-3},
    "identity": {"feature_map": "identity", "eps": 1.0},
    "key_lengths": {"key_lengths": np.array([1, 3]), "eps": 1e-3},
}


@pytest.mark.parametrize("name", sorted(LINEAR_CASES))
def test_linear_attention_vjp_matches_central_differences_and_attention_np(name: str):
    rng = np.random.default_rng(4)
    keywords = LINEAR_CASES[name]
    arrays = {"q": _rand(rng, 2, 3, 2) + 0.5, "k": _rand(rng, 2, 3, 2) + 0.5, "v": _rand(rng, 2, 3, 3)}  # relu: off
    # its kink

    def forward(**a: np.ndarray) -> np.ndarray:
        return oracle.linear_attention(a["q"], a["k"], a["v"], **keywords)

    def vjp(d_out: np.ndarray, **a: np.ndarray) -> dict:
        return oracle_gradients.linear_attention_vjp(a["q"], a["k"], a["v"], d_out, **keywords)

    grads = _assert_matches_differences(forward, vjp, arrays)
    d_out = np.random.default_rng(0).standard_normal(forward(**arrays).shape)
    _, pullback = attention_np.linear_attention_vjp(arrays["q"], arrays["k"], arrays["v"], **keywords)
    for key, theirs in zip(("q", "k", "v"), pullback(d_out), strict=True):
        np.testing.assert_allclose(grads[key], theirs, rtol=1e-10, atol=1e-12)


RULE_CASES = {  # update_rule, the decay's width (None: no decay), whether beta is given, key_lengths; identity on
    # unit keys, q (2, 4, 2), v (2, 4, 3)
    "gated_per_head": ("gated", 1, False, None),
    "gated_per_key_dimension": ("gated", 2, False, None),
    "delta": ("delta", None, True, None),
    "gated_delta_with_key_lengths": ("gated_delta", 2, True, np.array([2, 4])),
}


@pytest.mark.parametrize("name", sorted(RULE_CASES))
def test_linear_recurrence_vjp_matches_central_differences_and_attention_np(name: str):
    rule, width, with_beta, key_lengths = RULE_CASES[name]
    rng = np.random.default_rng(7)
    k = _rand(rng, 2, 4, 2)
    arrays = {"q": _rand(rng, 2, 4, 2), "k": k / np.linalg.norm(k, axis=-1, keepdims=True), "v": _rand(rng, 2, 4, 3)}
    if width is not None:
        arrays["decay"] = -rng.uniform(0.05, 0.5, (2, 4, width))
    if with_beta:
        arrays["beta"] = rng.uniform(0.2, 0.9, (2, 4, 1))
    keywords = {"feature_map": "identity", "is_causal": True, "key_lengths": key_lengths, "update_rule": rule}

    def forward(**a: np.ndarray) -> np.ndarray:
        return oracle.linear_attention(**a, **keywords)

    def vjp(d_out: np.ndarray, **a: np.ndarray) -> dict:
        return oracle_gradients.linear_attention_vjp(d_out=d_out, **a, **keywords)

    grads = _assert_matches_differences(forward, vjp, arrays)  # every argument, decay and beta too
    d_out = np.random.default_rng(0).standard_normal(forward(**arrays).shape)
    _, pullback = attention_np.linear_attention_vjp(**arrays, **keywords)
    for key, theirs in zip(arrays, pullback(d_out), strict=True):  # q, k, v, then decay and beta where given
        np.testing.assert_allclose(grads[key], theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_plain_low_precision_vjp_loses_a_few_roundings(dtype: str):
    """In `dtype` each stored tensor is rounded: the gradients come back in dtype, within a few units of its
    rounding of the float64 ones (the inputs rounded to dtype first, as the suite's `rounded` does)."""
    rng = np.random.default_rng(5)
    q, k, v, d_out = (np.asarray(x, dtype).astype(np.float64) for x in (
        _rand(rng, 2, 4, 4), _rand(rng, 2, 6, 4), _rand(rng, 2, 6, 3), _rand(rng, 2, 4, 3)))
    unit = float(np.finfo(np.dtype(dtype)).eps) if dtype != "bfloat16" else 2.0**-7
    exact = oracle_gradients.sdpa_vjp(q, k, v, d_out, is_causal=True)
    plain = oracle_gradients.sdpa_vjp(q, k, v, d_out, is_causal=True, dtype=dtype)
    for name in ("q", "k", "v"):
        assert plain[name].dtype == np.dtype(dtype)
        error = np.max(np.abs(plain[name].astype(np.float64) - exact[name])) / np.max(np.abs(exact[name]))
        assert 0 < error <= 20 * unit, name


def _mha_state(rng: np.random.Generator, D: int, kv_rows: int, bias: bool, prefix: str = "") -> dict[str, np.ndarray]:
    """w_q, w_k, w_v, w_o in nn.Linear's layout (out, in), scaled as its initialisation; biases where asked."""
    state = {}
    for name, rows in (("w_q", D), ("w_k", kv_rows), ("w_v", kv_rows), ("w_o", D)):
        state[f"{prefix}{name}.weight"] = _rand(rng, rows, D) / np.sqrt(D)
        state |= {f"{prefix}{name}.bias": 0.1 * _rand(rng, rows)} if bias else {}
    return state


def _block_state(rng: np.random.Generator, D: int, F: int, *, norm: str, activation: str,
                 bias: bool) -> dict[str, np.ndarray]:
    state = _mha_state(rng, D, D, bias, "attn.")
    for name in ("norm1", "norm2"):
        state[f"{name}.weight"] = 1 + 0.1 * _rand(rng, D)
        state |= {f"{name}.bias": 0.1 * _rand(rng, D)} if norm == "layer" else {}
    linears = ((("w_gate", F, D), ("w_up", F, D), ("w_down", D, F)) if activation == "swiglu" else
               (("0", F, D), ("3", D, F)))
    for name, rows, cols in linears:
        state[f"ffn.{name}.weight"] = _rand(rng, rows, cols) / np.sqrt(cols)
        state |= {f"ffn.{name}.bias": 0.1 * _rand(rng, rows)} if bias else {}
    return state


MHA_CASES = {  # options of oracle.multi_head_attention, and whether the state has biases; D = 8
    "softmax_with_mask": ({"num_heads": 2}, True),
    "grouped_heads": ({"num_heads": 4, "num_kv_heads": 2}, True),
    "rope": ({"num_heads": 2, "rope_theta": 100.0}, True),
    "linear_heads": ({"num_heads": 2, "attention": "linear"}, True),
    "no_bias": ({"num_heads": 2}, False),
    "sinks_and_alibi": ({"num_heads": 4, "num_kv_heads": 2, "sinks": True, "position": "alibi"}, True),
}


@pytest.mark.parametrize("name", sorted(MHA_CASES))
def test_multi_head_attention_vjp_matches_attention_np(name: str):
    rng = np.random.default_rng(6)
    options, bias = MHA_CASES[name]
    H, D = options["num_heads"], 8
    state = _mha_state(rng, D, (options.get("num_kv_heads") or H) * D // H, bias)
    state |= {"sinks": 2 * _rand(rng, H)} if options.pop("sinks", False) else {}  # sinks=True's, in the state
    q, k, v = _rand(rng, 2, 3, D), _rand(rng, 2, 5, D), _rand(rng, 2, 5, D)
    mask = None if options.get("attention") == "linear" else rng.random((2, H, 3, 5)) > 0.3
    d_out = _rand(rng, 2, 3, D)
    grads = oracle_gradients.multi_head_attention_vjp(state, q, k, v, d_out, mask, **options)
    later = {name: options[name] for name in ("rope_theta", "attention", "position") if name in options}
    mha = attention_np.MultiHeadAttention.from_state_dict(state, num_heads=H, dropout=0.0, **later)
    dq, dk, dv, d_params = mha.eval().vjp(q, k, v, mask)[2](d_out)
    theirs = {"q": dq, "k": dk, "v": dv} | dict(d_params)
    assert set(grads) == set(theirs)
    largest = max(np.max(np.abs(grad)) for grad in theirs.values())  # w_k.bias's is zero: softmax ignores a shift
    for key, grad in grads.items():
        assert np.max(np.abs(grad - theirs[key])) <= 1e-12 * largest, key


BLOCK_CASES = {  # options of oracle.transformer_block, and whether the Linears have biases; D = 8, F = 12
    "post_ln_relu": ({}, True),
    "pre_ln_gelu": ({"norm_first": True, "activation": "gelu"}, True),
    "rms_post_ln": ({"norm": "rms"}, True),
    "llama": ({"norm_first": True, "norm": "rms", "activation": "swiglu", "num_kv_heads": 1, "rope_theta": 100.0},
              False),
}


@pytest.mark.parametrize("name", sorted(BLOCK_CASES))
def test_transformer_block_vjp_matches_attention_np(name: str):
    rng = np.random.default_rng(7)
    options, bias = BLOCK_CASES[name]
    D = 8
    state = _block_state(rng, D, 12, norm=options.get("norm", "layer"), activation=options.get("activation", "relu"),
                         bias=bias)
    if options.get("num_kv_heads"):  # w_k, w_v of one key/value head: d_k rows
        state |= {f"attn.{w}.weight": state[f"attn.{w}.weight"][: D // 2] for w in ("w_k", "w_v")}
    x, d_out, mask = _rand(rng, 2, 4, D), _rand(rng, 2, 4, D), np.tril(np.ones((4, 4), bool))
    grads = oracle_gradients.transformer_block_vjp(state, x, d_out, mask, num_heads=2, **options)
    later = {name: options[name] for name in ("norm_first", "activation", "rope_theta") if name in options}
    block = attention_np.TransformerBlock.from_state_dict(state, num_heads=2, dropout=0.0, **later)
    dx, d_params = block.eval().vjp(x, mask)[2](d_out)
    theirs = {"x": dx} | dict(d_params)
    assert set(grads) == set(theirs)
    largest = max(np.max(np.abs(grad)) for grad in theirs.values())
    for key, grad in grads.items():
        assert np.max(np.abs(grad - theirs[key])) <= 1e-12 * largest, key


def test_the_mha_vjp_with_sinks_and_alibi_matches_central_differences():
    """MultiHeadAttention with sinks (H,) in the state and ALiBi on three heads (not a power of two), grouped, in
    cross-attention under a mask per head: every argument's directional derivative, d sinks too, against central
    differences of the oracle's forward."""
    rng = np.random.default_rng(9)
    options = {"num_heads": 3, "position": "alibi"}
    state = _mha_state(rng, 6, 6, True) | {"sinks": 2 * _rand(rng, 3)}
    inputs = {"q": _rand(rng, 2, 3, 6), "k": _rand(rng, 2, 5, 6), "v": _rand(rng, 2, 5, 6)}
    mask, d_out = rng.random((2, 3, 3, 5)) > 0.3, _rand(rng, 2, 3, 6)
    grads = oracle_gradients.multi_head_attention_vjp(state, *inputs.values(), d_out, mask, **options)
    assert grads["sinks"].shape == (3,) and np.all(grads["sinks"] != 0)
    for name in (*inputs, *state):
        u = rng.standard_normal(np.shape(inputs[name] if name in inputs else state[name]))

        def loss(step: float, name: str = name, u: np.ndarray = u) -> float:
            moved = inputs | ({name: inputs[name] + step * u} if name in inputs else {})
            given = state | ({} if name in inputs else {name: state[name] + step * u})
            return float(np.sum(d_out * oracle.multi_head_attention(given, *moved.values(), mask, **options)[0]))

        difference = (loss(STEP) - loss(-STEP)) / (2 * STEP)
        assert abs(np.sum(grads[name] * u) - difference) <= 1e-6 * (1 + abs(difference)), name


def test_the_modules_vjps_match_central_differences():
    """One pre-LN block with RoPE and grouped heads (its attention's vjp inside): every argument's directional
    derivative against central differences of the oracle's forward."""
    rng = np.random.default_rng(8)
    options = {"num_heads": 2, "num_kv_heads": 1, "norm_first": True, "activation": "gelu", "rope_theta": 100.0}
    state = _block_state(rng, 4, 6, norm="layer", activation="gelu", bias=True)
    state |= {f"attn.{w}.weight": state[f"attn.{w}.weight"][:2] for w in ("w_k", "w_v")}
    state |= {f"attn.{w}.bias": state[f"attn.{w}.bias"][:2] for w in ("w_k", "w_v")}
    x, d_out = _rand(rng, 3, 4), _rand(rng, 3, 4)
    grads = oracle_gradients.transformer_block_vjp(state, x, d_out, num_heads=2, **{
        name: value for name, value in options.items() if name != "num_heads"})
    for name in ("x", *state):
        u = rng.standard_normal(np.shape(x if name == "x" else state[name]))

        def loss(step: float, name: str = name, u: np.ndarray = u) -> float:
            moved = {"x": x + step * u} if name == "x" else {"x": x}
            given = state | ({} if name == "x" else {name: state[name] + step * u})
            return float(np.sum(d_out * oracle.transformer_block(given, moved["x"], **options)[0]))

        difference = (loss(STEP) - loss(-STEP)) / (2 * STEP)
        assert abs(np.sum(grads[name] * u) - difference) <= 1e-6 * (1 + abs(difference)), name
