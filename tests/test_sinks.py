"""Attention sinks (SPEC.md section 2g) on every backend: one logit per head that joins every softmax's
denominator and carries no value, weights_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)).

scaled_dot_product_attention (both paths), flash_attention (several tiles) and their vjps against a
hand-derived case, the float64 oracle (which takes the sink as one more logit of a key of zero value, one query
at a time) and central differences of the oracle; the rule that a query that sees no key outputs zeros; the
errors; and MultiHeadAttention(sinks=True) against transformers' GptOssAttention (gpt-oss), with the same
weights mapped by name, grouped-query heads and RoPE, through the full pass, its gradients and the cache;
ring_attention (the sink joined once, never once per device) and flex_attention with sinks.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from conformance.contract import oracle
from tests._compare import REORDERED, assert_close, central_differences, method_program, one_program

B, H, HKV, L, S, E = 2, 4, 2, 5, 7, 3  # grouped-query heads: two query heads per key/value head
GRADIENT_RTOL = 1e-7  # central differences at h = 1e-5 resolve a float64 derivative to about 1e-10
TILES = ((1, 1), (2, 3), (4, 16))  # flash_attention's (block_q, block_k): single entries, ragged, one key tile


def _case(seed: int = 0) -> dict[str, np.ndarray]:
    """q (B, H, L, E), k and v (B, Hkv, S, E), sinks (H,) with one of -inf (no sink for that head), and a mask
    (L, S) that hides every key from query 1 and a few more."""
    rng = np.random.default_rng(seed)
    mask = rng.random((L, S)) > 0.3
    mask[1] = False  # query 1 sees no key
    return {"q": rng.standard_normal((B, H, L, E)), "k": rng.standard_normal((B, HKV, S, E)),
            "v": rng.standard_normal((B, HKV, S, E)), "mask": mask,
            "sinks": np.array([0.5, -1.0, 2.0, -np.inf])}


def _finite(case: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The case with every sink finite, for the gradients (a sink of -inf has no derivative to take)."""
    return case | {"sinks": np.array([0.5, -1.0, 2.0, 1.5])}


def _numpy(M: ModuleType, x: object) -> object:
    return M.to_numpy(x) if x is not None else None


def test_hand_derived_weights_leave_the_sink_its_share(backend: ModuleType) -> None:
    # one query, two keys, E = 1 (scale 1): scores q k_j = [0, ln 2], so exp(scores) = [1, 2]; with sink 0 the
    # denominator is e^0 + 1 + 2 = 4: weights [1/4, 2/4] (the sink's 1/4 dropped), out = 1/4 * 1 + 2/4 * 3 = 7/4;
    # with sink ln 2: 2 + 1 + 2 = 5, weights [1/5, 2/5], out = 1/5 + 6/5 = 7/5
    q, k, v = np.array([[1.0]]), np.array([[0.0], [math.log(2)]]), np.array([[1.0], [3.0]])
    for sink, weights, out in ((0.0, [0.25, 0.5], 1.75), (math.log(2), [0.2, 0.4], 1.4)):
        got_out, got_weights = backend.scaled_dot_product_attention(
            *(backend.asarray(x) for x in (q, k, v)), sinks=backend.asarray(np.array(sink)))
        np.testing.assert_allclose(backend.to_numpy(got_weights), [weights], rtol=1e-15)
        np.testing.assert_allclose(backend.to_numpy(got_out), [[out]], rtol=1e-15)


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
@pytest.mark.parametrize("shape", ["(H,)", "(B, H)"])
def test_sdpa_with_sinks_is_the_oracles(backend: ModuleType, need_weights: bool, shape: str) -> None:
    case = _case()
    sinks = case["sinks"] if shape == "(H,)" else case["sinks"] + np.array([[0.0], [0.7]])  # (B, H)
    expected_out, expected_weights = oracle.sdpa(case["q"], case["k"], case["v"], case["mask"], is_causal=True,
                                                 enable_gqa=True, sinks=sinks)
    out, weights = one_program(backend, "scaled_dot_product_attention", case["q"], case["k"], case["v"],
                               case["mask"], is_causal=True, enable_gqa=True, need_weights=need_weights, sinks=sinks)
    assert_close(backend.to_numpy(out), expected_out, REORDERED, "out")
    if need_weights:
        assert_close(backend.to_numpy(weights), expected_weights, REORDERED, "weights")
        assert np.all(backend.to_numpy(weights)[:, :3].sum(axis=-1) < 1), "a finite sink keeps a share of each row"


@pytest.mark.parametrize("tiles", TILES, ids=str)
def test_flash_with_sinks_is_the_oracles_out_and_lse(backend: ModuleType, tiles: tuple[int, int]) -> None:
    case = _case()
    expected_out, expected_lse = oracle.log_sum_exp(case["q"], case["k"], case["v"], case["mask"], is_causal=True,
                                                    enable_gqa=True, sinks=case["sinks"])
    out, lse = one_program(backend, "flash_attention", case["q"], case["k"], case["v"], case["mask"],
                           is_causal=True, enable_gqa=True, sinks=case["sinks"], block_q=tiles[0], block_k=tiles[1])
    assert_close(backend.to_numpy(out), expected_out, REORDERED, "out")
    assert_close(backend.to_numpy(lse), expected_lse, REORDERED, "lse")
    assert np.all(backend.to_numpy(lse)[:, :3, 1] == case["sinks"][:3]), "a query that sees no key: lse = sink"


def test_a_query_that_sees_no_key_gets_zeros_with_any_sink(backend: ModuleType) -> None:
    # query 1 sees no key: out and weights 0 whatever the sink (0, -1, 2, and -inf, which is no sink at all)
    case = _case()
    arrays = (case["q"], case["k"], case["v"], case["mask"])
    for need_weights in (True, False):
        out, weights = one_program(backend, "scaled_dot_product_attention", *arrays, enable_gqa=True,
                                   need_weights=need_weights, sinks=case["sinks"])
        assert np.all(backend.to_numpy(out)[:, :, 1] == 0), f"out, need_weights={need_weights}"
        assert weights is None or np.all(backend.to_numpy(weights)[:, :, 1] == 0), "weights"
    out, _ = one_program(backend, "flash_attention", *arrays, enable_gqa=True, sinks=case["sinks"], block_q=2,
                         block_k=3)
    assert np.all(backend.to_numpy(out)[:, :, 1] == 0), "flash out"


@pytest.fixture(scope="module")
def reference_gradients() -> dict[str, np.ndarray]:
    """d <oracle.sdpa(...), d_out> / d{q, k, v, sinks} by central differences, float64, and the d_out."""
    case = _finite(_case(1))
    d_out = np.random.default_rng(2).standard_normal((B, H, L, E))

    def out(**changed: np.ndarray) -> np.ndarray:
        arrays = case | changed
        return oracle.sdpa(arrays["q"], arrays["k"], arrays["v"], arrays["mask"], is_causal=True, enable_gqa=True,
                           sinks=arrays["sinks"])[0]

    grads = {name: central_differences(lambda x, name=name: out(**{name: x}), case[name], d_out, 1e-5)
             for name in ("q", "k", "v", "sinks")}
    return grads | {"d_out": d_out}


@pytest.mark.parametrize("function", ["scaled_dot_product_attention_vjp", "flash_attention_vjp"])
def test_gradients_with_sinks_are_central_differences(backend: ModuleType, function: str,
                                                      reference_gradients: dict[str, np.ndarray]) -> None:
    case = _finite(_case(1))
    tiles = {"block_q": 2, "block_k": 3} if function == "flash_attention_vjp" else {}
    *_, grads = one_program(backend, function, case["q"], case["k"], case["v"], case["mask"],
                            d_out=reference_gradients["d_out"], is_causal=True, enable_gqa=True,
                            sinks=case["sinks"], **tiles)
    dq, dk, dv, dbias, d_sinks = grads  # with sinks, d_sinks follows dbias
    assert dbias is None
    for name, grad in (("q", dq), ("k", dk), ("v", dv), ("sinks", d_sinks)):
        assert_close(backend.to_numpy(grad), reference_gradients[name], GRADIENT_RTOL, f"d{name}")


@pytest.mark.parametrize("function", ["scaled_dot_product_attention", "flash_attention"])
def test_sinks_that_do_not_broadcast_to_the_heads_raise(backend: ModuleType, function: str) -> None:
    case = _case()
    q, k, v = (backend.asarray(case[name]) for name in "qkv")
    with pytest.raises(ValueError, match=r"sinks of shape \(3,\) does not broadcast to \(2, 4\)"):
        getattr(backend, function)(q, k, v, enable_gqa=True, sinks=backend.asarray(np.zeros(3)))
    with pytest.raises(ValueError, match=r"sinks of shape \(3, 4\) does not broadcast"):
        getattr(backend, function)(q, k, v, enable_gqa=True, sinks=backend.asarray(np.zeros((3, 4))))


# MultiHeadAttention(sinks=True) is gpt-oss's attention: GptOssAttention with its eager attention function
D, THETA = 16, 500.0  # d_k = 4: two RoPE pairs
NAMES = {"sinks": "sinks"} | {f"w_{ours}.{part}": f"{theirs}_proj.{part}" for ours, theirs in
                              (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o")) for part in ("weight", "bias")}


def test_mha_sinks_is_a_parameter_of_zeros_in_the_state_dict(backend: ModuleType) -> None:
    mha = backend.MultiHeadAttention(D, H, 0.0, num_kv_heads=HKV, sinks=True)
    state = mha.state_dict()
    assert next(iter(state)) == "sinks" and backend.to_numpy(state["sinks"]).tolist() == [0.0] * H
    assert "sinks" not in backend.MultiHeadAttention(D, H, 0.0).state_dict()
    block = backend.TransformerBlock(D, H, 2 * D, 0.0, num_kv_heads=HKV, rope_theta=THETA, sinks=True)
    loaded = backend.TransformerBlock.from_state_dict(block.state_dict(), num_heads=H, rope_theta=THETA)
    assert "attn.sinks" in loaded.state_dict()
    with pytest.raises(ValueError, match="sinks=True needs attention='softmax'"):
        backend.MultiHeadAttention(D, H, 0.0, attention="linear", sinks=True)


@pytest.fixture(scope="module")
def gpt_oss() -> dict[str, object]:
    """Random weights and sinks, an input, and transformers' GptOssAttention's out, weights and gradients of
    sum(out * d_out) (float64, CPU, eager attention, RoPE without scaling at positions 0 .. L - 1)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    config = transformers.GptOssConfig(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV, head_dim=D // H, attention_bias=True,
        attention_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": THETA},
        layer_types=["full_attention"], num_hidden_layers=1)
    config._attn_implementation = "eager"  # eager_attention_forward: the sink column joins the softmax
    layer = modeling.GptOssAttention(config, layer_idx=0).double().eval()
    rng = np.random.default_rng(3)
    theirs = {name: rng.uniform(-0.5, 0.5, tuple(value.shape)) for name, value in layer.state_dict().items()}
    theirs["sinks"] = rng.uniform(-1.0, 1.0, H)
    layer.load_state_dict({name: torch.from_numpy(value) for name, value in theirs.items()})
    x = rng.standard_normal((B, L, D))
    d_out = rng.standard_normal((B, L, D))
    angles = np.arange(L)[:, None] * THETA ** (-np.arange(0, D // H, 2) / (D // H))  # (L, d_k / 2), float64
    cos_sin = (torch.from_numpy(np.cos(angles))[None], torch.from_numpy(np.sin(angles))[None])  # gpt-oss's halves
    hidden = torch.from_numpy(np.where(np.tri(L, L, dtype=bool), 0.0, -np.inf)[None, None])  # causal, additive
    out, weights = layer(torch.from_numpy(x), position_embeddings=cos_sin, attention_mask=hidden)
    (out * torch.from_numpy(d_out)).sum().backward()
    grads = {name: parameter.grad.numpy() for name, parameter in layer.named_parameters()}
    return {"state": {ours: theirs[name] for ours, name in NAMES.items()}, "x": x, "d_out": d_out,
            "out": out.detach().numpy(), "weights": weights.detach().numpy(),
            "grads": {ours: grads[name] for ours, name in NAMES.items()}}


def _mha(M: ModuleType, state: dict[str, np.ndarray]):
    return M.MultiHeadAttention.from_state_dict({name: M.asarray(value) for name, value in state.items()},
                                                num_heads=H, dropout=0.0, rope_theta=THETA).eval()


GPT_OSS_RTOL = 1e-10


def test_mha_with_sinks_is_gpt_oss_attention(backend: ModuleType, gpt_oss: dict) -> None:
    mha, x = _mha(backend, gpt_oss["state"]), backend.asarray(gpt_oss["x"])
    out, weights = method_program(backend, "__call__")(mha, x, x, x, backend.causal_mask(L, L))
    assert_close(backend.to_numpy(out), gpt_oss["out"], GPT_OSS_RTOL, "out")
    assert_close(backend.to_numpy(weights), gpt_oss["weights"], GPT_OSS_RTOL, "weights")
    *_, pullback = mha.vjp(x, x, x, backend.causal_mask(L, L))
    grads = pullback(backend.asarray(gpt_oss["d_out"]))[3]
    for name in ("sinks", "w_q.weight", "w_k.bias", "w_o.weight"):
        assert_close(backend.to_numpy(grads[name]), gpt_oss["grads"][name], GPT_OSS_RTOL, f"d {name}")


@pytest.mark.parametrize("cache", ["dense", "ragged", "paged"])
def test_decoding_with_sinks_is_gpt_oss_attention(backend: ModuleType, gpt_oss: dict, cache: str) -> None:
    mha, x = _mha(backend, gpt_oss["state"]), backend.asarray(gpt_oss["x"])
    if cache == "paged":  # pages of 2 positions, 3 per sequence
        store = mha.init_paged_cache(B, 8, 2, 3).reserve(backend.asarray(np.array([L, L])))
    else:
        store = mha.init_cache((B,), L)
    options = {"new_lengths": backend.asarray(np.array([1, 1]))} if cache == "ragged" else {}
    outs = []
    for i in range(L):  # one position at a time: each query over the cache and itself
        out, _, store = mha.extend(x[:, i:i + 1], x[:, i:i + 1], store, need_weights=False, **options)
        outs.append(backend.to_numpy(out))
    assert_close(np.concatenate(outs, axis=1), gpt_oss["out"], GPT_OSS_RTOL, f"{cache} decode")


# ring_attention: the sink joins each row once, after the ring, never once per device
RING = {"B": 2, "H": 4, "HKV": 2, "L": 8, "E": 3}  # L = S = 8: 2P chunks of 2 on P = 2 devices with is_causal


def _ring_case(seed: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    (B, H, HKV, L, E) = RING.values()
    return {"q": rng.standard_normal((B, H, L, E)), "k": rng.standard_normal((B, HKV, L, E)),
            "v": rng.standard_normal((B, HKV, L, E)), "d_out": rng.standard_normal((B, H, L, E)),
            "sinks": np.array([0.5, -1.0, 2.0, 1.5])}


def _ring_reference(case: dict[str, np.ndarray], is_causal: bool) -> tuple:
    """The oracle's out and lse, and NumPy's flash_attention_vjp's gradients (held to central differences
    above): the ring's reference."""
    q, k, v, d_out, sinks = case.values()
    out, lse = oracle.log_sum_exp(q, k, v, is_causal=is_causal, enable_gqa=True, sinks=sinks)
    import attention_np

    *_, pullback = attention_np.flash_attention_vjp(q, k, v, is_causal=is_causal, enable_gqa=True, sinks=sinks)
    dq, dk, dv, _, d_sinks = pullback(d_out)
    return out, lse, (dq, dk, dv, d_sinks)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_numpy_ring_with_sinks_is_the_oracles(devices: int, is_causal: bool) -> None:
    import attention_np

    case = _ring_case()  # with is_causal on 4 devices: 2P = 8 chunks of one position each
    out, lse, grads = _ring_reference(case, is_causal)
    got_out, got_lse, pullback = attention_np.ring_attention_vjp(
        case["q"], case["k"], case["v"], devices=devices, is_causal=is_causal, enable_gqa=True,
        sinks=case["sinks"], block_q=2, block_k=2)
    assert_close(got_out, out, REORDERED, "out")
    assert_close(got_lse, lse, REORDERED, "lse")
    for name, got, expected in zip(("dq", "dk", "dv", "d_sinks"), pullback(case["d_out"]), grads, strict=True):
        assert_close(got, expected, REORDERED, name)


def _torch_ring_with_sinks(rank: int, world_size: int) -> list[str]:
    """On one rank of a gloo group: ring_attention_vjp with sinks against the rank's rows of the reference;
    what failed."""
    import torch

    import attention_torch

    failures = []
    for is_causal in (False, True):
        case = _ring_case()
        out, lse, grads = _ring_reference(case, is_causal)
        rows = slice(rank * RING["L"] // world_size, (rank + 1) * RING["L"] // world_size)
        q, k, v, d_out = (torch.from_numpy(case[name][..., rows, :].copy()) for name in ("q", "k", "v", "d_out"))
        got_out, got_lse, pullback = attention_torch.ring_attention_vjp(
            q, k, v, is_causal=is_causal, enable_gqa=True, sinks=torch.from_numpy(case["sinks"]), block_q=2,
            block_k=2)
        dq, dk, dv, d_sinks = (g.numpy() for g in pullback(d_out))
        for name, got, expected in (("out", got_out.numpy(), out[..., rows, :]), ("lse", got_lse.numpy(),
                                    lse[..., rows]), ("dq", dq, grads[0][..., rows, :]),
                                    ("dk", dk, grads[1][..., rows, :]), ("dv", dv, grads[2][..., rows, :]),
                                    ("d_sinks", d_sinks, grads[3])):
            error = np.max(np.abs(got - expected)) / np.max(np.abs(expected))
            if not error <= REORDERED:
                failures.append(f"rank {rank}, is_causal={is_causal}, {name}: relative error {error:.3g}")
    return failures


@pytest.mark.slow  # starts two processes joined in a gloo group
def test_torch_ring_with_sinks_is_the_oracles_on_two_ranks() -> None:
    pytest.importorskip("torch")
    from conformance.bench.ring_torch import launch

    failures = [failure for rank in launch(2, _torch_ring_with_sinks) for failure in rank]
    assert not failures, "\n".join(failures)


JAX_RING = """
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
from jax.sharding import Mesh
import attention_jax
from tests.test_sinks import _ring_case, _ring_reference, REORDERED
mesh = Mesh(np.array(jax.devices()), ("x",))
assert mesh.shape["x"] == 2, mesh
for is_causal in (False, True):
    case = _ring_case()
    out, lse, grads = _ring_reference(case, is_causal)
    q, k, v, d_out, sinks = (jax.numpy.asarray(x) for x in case.values())
    got_out, got_lse, pullback = attention_jax.ring_attention_vjp(q, k, v, mesh=mesh, axis="x", is_causal=is_causal,
                                                                  enable_gqa=True, sinks=sinks, block_q=2, block_k=2)
    for name, got, expected in zip(("out", "lse", "dq", "dk", "dv", "d_sinks"), (got_out, got_lse, *pullback(d_out)),
                                   (out, lse, *grads)):
        error = np.max(np.abs(np.asarray(got) - expected)) / np.max(np.abs(expected))
        assert error <= REORDERED, (is_causal, name, error)
print("ok")
"""


@pytest.mark.slow  # starts a process with its own JAX, on two simulated devices
def test_jax_ring_with_sinks_is_the_oracles_on_two_devices() -> None:
    pytest.importorskip("jax")
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    result = subprocess.run([sys.executable, "-c", JAX_RING], env=env, capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0 and "ok" in result.stdout, f"{result.stdout}\n{result.stderr}"


# flex_attention: the sink joins each row once, after the tiles of the block mask
def test_flex_with_sinks_is_the_oracles(backend: ModuleType) -> None:
    from attention_np.common import mods

    case = _finite(_case(5))
    q, k, v = case["q"], case["k"], case["v"]
    mask_mod, score_mod = mods.causal(), mods.softcap(2.0)
    out, lse = oracle.log_sum_exp(q, k, v, enable_gqa=True, mask_mod=mask_mod, score_mod=score_mod,
                                  sinks=case["sinks"])
    block_mask = backend.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=(2, 3))
    arrays = [backend.asarray(x) for x in (q, k, v)]
    got_out, got_lse = backend.flex_attention(*arrays, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                              return_lse=True, sinks=backend.asarray(case["sinks"]))
    assert_close(backend.to_numpy(got_out), out, REORDERED, "out")
    assert_close(backend.to_numpy(got_lse), lse, REORDERED, "lse")
    # the gradients: NumPy's flash_attention_vjp with the same mods (held to central differences above, without)
    import attention_np

    d_out = np.random.default_rng(6).standard_normal(out.shape)
    *_, pullback = attention_np.flash_attention_vjp(q, k, v, enable_gqa=True, mask_mod=mask_mod, score_mod=score_mod,
                                                    sinks=case["sinks"], block_q=2, block_k=3)
    dq, dk, dv, _, d_sinks, _ = pullback(d_out)
    *_, got_pullback = backend.flex_attention_vjp(*arrays, score_mod=score_mod, block_mask=block_mask,
                                                  enable_gqa=True, sinks=backend.asarray(case["sinks"]))
    got = got_pullback(backend.asarray(d_out))
    for name, grad, expected in zip(("dq", "dk", "dv", "d_sinks"), got[:4], (dq, dk, dv, d_sinks), strict=True):
        assert_close(backend.to_numpy(grad), expected, REORDERED, name)


def test_flex_gradient_of_a_sink_of_minus_inf_on_a_query_that_sees_no_key_is_zero(backend: ModuleType) -> None:
    # causal from q_offset -1: query 0 sees no key, so with the sink of -inf (head 3) its lse is -inf, and the merge
    # logaddexp(-inf, -inf) must take no NaN into d_sinks (JAX's and torch's autodiff of it did): that head's
    # d_sink is 0 (no sink reaches the loss), the others' the NumPy vjp's, derived by hand
    import attention_np
    from attention_np.common import mods

    case = _case(7)
    q, k, v = case["q"], case["k"], case["v"]
    block_mask = backend.create_block_mask(mods.causal(-1), B, H, L, S, BLOCK_SIZE=(2, 3))
    d_out = np.random.default_rng(8).standard_normal((B, H, L, E))
    *_, pullback = backend.flex_attention_vjp(*(backend.asarray(x) for x in (q, k, v)), block_mask=block_mask,
                                              enable_gqa=True, sinks=backend.asarray(case["sinks"]))
    d_sinks = backend.to_numpy(pullback(backend.asarray(d_out))[3])
    *_, expected = attention_np.flash_attention_vjp(q, k, v, enable_gqa=True, mask_mod=mods.causal(-1),
                                                    sinks=case["sinks"], block_q=2, block_k=3)
    assert np.all(np.isfinite(d_sinks)) and d_sinks[3] == 0, d_sinks
    assert_close(d_sinks, expected(d_out)[4], REORDERED, "d_sinks")


def test_the_oracles_vjp_with_sinks_is_central_differences(reference_gradients: dict[str, np.ndarray]) -> None:
    from conformance.contract import oracle_gradients

    case = _finite(_case(1))
    for from_lse in (False, True):
        grads = oracle_gradients.sdpa_vjp(case["q"], case["k"], case["v"], reference_gradients["d_out"], case["mask"],
                                          is_causal=True, enable_gqa=True, sinks=case["sinks"], from_lse=from_lse)
        for name in ("q", "k", "v", "sinks"):
            assert_close(grads[name], reference_gradients[name], GRADIENT_RTOL, f"d{name}, from_lse={from_lse}")
