"""MultiHeadLatentAttention is DeepSeek-V3's attention (MLA): checked against transformers' DeepseekV3Attention
with the same weights, mapped by name, on every backend, with and without the query latent (DeepSeek-V2-Lite's
q_proj); decoding through the latent cache, expanded and absorbed, equals the full causal pass; the cache holds
transformers' own latents; the state dict round-trips under DeepSeek's names; mistakes raise errors naming the
argument and the shapes; the vjp of every backend (NumPy's composed by hand) equals central differences.

transformers is a test-only dependency. Its DeepseekV3RMSNorm normalises in float32 whatever the input's dtype, so
the reference runs the same formula in the input's dtype (float64); its rotary angles are computed here in float64
and handed to the layer (`position_embeddings`), as its own rotary module computes them in float32; and it runs
with the "sdpa" attention, as its "eager" one takes the softmax in float32.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests._compare import assert_close, central_differences, method_program
from tests.conftest import backend_rng, import_backend

torch = pytest.importorskip("torch")

B, L, D, H, THETA = 2, 7, 32, 4, 10000.0
SIZES = {"kv_lora_rank": 8, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5}  # Dc, En, Er, Ev
Q_LORA_RANKS = (12, None)  # DeepSeek-V3's query latent, and V2-Lite's q_proj
TOLERANCE = 1e-10  # against transformers: the same float64 math, summed in other orders
EXACT = 1e-12  # a decode form against the full pass: float64, the same math reassociated
CHUNKS = ((0, 3), (3, 4), (4, 5), (5, 7))  # a prefill of 3 positions, then one at a time, then a chunk of 2
CAPACITY = 10


def _rms_norm_in_input_dtype(self, x):
    """DeepseekV3RMSNorm's formula, weight * x / sqrt(mean(x^2) + eps), in x's dtype (theirs casts to float32)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _cos_sin(positions: np.ndarray) -> tuple:
    """transformers' cos and sin (1, L, Er) in float64: angle_j(p) = p * theta^(-2j / Er), the halves repeated."""
    Er = SIZES["qk_rope_head_dim"]
    angles = positions[:, None] * THETA ** (-np.arange(0, Er, 2) / Er)  # (L, Er / 2)
    angles = np.concatenate([angles, angles], axis=-1)[None]  # (1, L, Er)
    return torch.from_numpy(np.cos(angles)), torch.from_numpy(np.sin(angles))


@pytest.fixture(scope="module", params=Q_LORA_RANKS, ids=("q_lora", "q_proj"))
def reference(request: pytest.FixtureRequest) -> dict:
    """transformers' DeepseekV3Attention with random weights (norm gains not 1) in float64: its state, an input,
    its output of the causal pass and the latents its cache holds (kv_nope after kv_a_layernorm, k_rot after
    RoPE)."""
    transformers = pytest.importorskip("transformers")
    deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    config = transformers.DeepseekV3Config(
        vocab_size=16, hidden_size=D, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=H, num_key_value_heads=H, q_lora_rank=request.param, **SIZES, rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": THETA}, attention_bias=False, attention_dropout=0.0)
    config._attn_implementation = "sdpa"  # float64 throughout (eager's softmax is float32)
    attn = deepseek.DeepseekV3Attention(config, layer_idx=0).double().eval()
    for norm in (attn.q_a_layernorm, attn.kv_a_layernorm):
        if norm is not None:
            norm.forward = types.MethodType(_rms_norm_in_input_dtype, norm)
    rng = np.random.default_rng(0)
    state = {name: rng.uniform(-0.4, 0.4, tuple(value.shape)) for name, value in attn.state_dict().items()}
    state |= {name: rng.uniform(0.5, 1.5, value.shape) for name, value in state.items() if "layernorm" in name}
    attn.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()})
    x = rng.standard_normal((B, L, D))
    hidden = np.where(np.tri(L, L, dtype=bool), 0.0, -np.inf)[None, None]  # (1, 1, L, L) additive causal mask
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        out, _ = attn(torch.from_numpy(x), _cos_sin(np.arange(L)), torch.from_numpy(hidden), cache=cache)
    layer = cache.layers[0]  # keys: kv_nope (B, 1, L, Dc); values: k_rot (B, 1, L, Er)
    return {"q_lora_rank": request.param, "state": state, "x": x, "out": out.numpy(),
            "c_kv": layer.keys[:, 0].numpy(), "k_rot": layer.values[:, 0].numpy()}


def _ours(M: ModuleType, state: dict[str, np.ndarray]):
    return M.MultiHeadLatentAttention.from_state_dict({name: M.asarray(value) for name, value in state.items()},
                                                      num_heads=H, rope_theta=THETA).eval()


def test_equals_transformers_deepseek_v3_attention(backend: ModuleType, reference: dict) -> None:
    module = _ours(backend, reference["state"])
    out, _ = method_program(backend, "__call__")(module, backend.asarray(reference["x"]), backend.causal_mask(L, L))
    assert_close(backend.to_numpy(out), reference["out"], TOLERANCE, "out")


def test_the_suites_oracle_equals_transformers_deepseek_v3_attention(reference: dict) -> None:
    # the conformance suite's float64 oracle (its own rows, RoPE and RMSNorm), which holds every module's mla rows
    from conformance.contract import oracle

    out, _ = oracle.multi_head_latent_attention(reference["state"], reference["x"], np.tri(L, L, dtype=bool),
                                                num_heads=H, rope_theta=THETA)
    assert_close(out, reference["out"], TOLERANCE, "the oracle's out")


def test_state_dict_holds_deepseek_v3s_names(backend: ModuleType, reference: dict) -> None:
    module = backend.MultiHeadLatentAttention(D, H, q_lora_rank=reference["q_lora_rank"], **SIZES, rng=backend_rng(
        backend, 0))
    state = {name: backend.to_numpy(value) for name, value in module.state_dict().items()}
    assert {name: value.shape for name, value in state.items()} == \
        {name: value.shape for name, value in reference["state"].items()}
    assert all(value.dtype == np.float32 for value in state.values())
    np.testing.assert_array_equal(state["kv_a_layernorm.weight"], 1)  # RMSNorm's gains start at ones
    again = backend.MultiHeadLatentAttention.from_state_dict(module.state_dict(), num_heads=H)
    assert all(np.array_equal(backend.to_numpy(value), state[name]) for name, value in again.state_dict().items())
    assert again.training and not again.eval().training and again.eval().train().training


def _decode(M: ModuleType, module, x: np.ndarray, absorbed: bool) -> tuple[np.ndarray, np.ndarray, object]:
    """out (B, L, D) and weights (B, H, L, capacity) of CHUNKS through the cache, and the last cache."""
    cache, outs, weights = module.init_cache((B,), CAPACITY), [], []
    for start, end in CHUNKS:
        out, w, cache = _step(M, absorbed, start)(module, M.asarray(x[:, start:end]), cache.c_kv, cache.k_rope)
        outs.append(M.to_numpy(out))
        weights.append(M.to_numpy(w))
        assert cache.length == end
    return np.concatenate(outs, axis=1), np.concatenate(weights, axis=2), cache


def _step(M: ModuleType, absorbed: bool, length: int):
    """extend from a cache of `length` positions, as a function of the module, x and the cache's arrays; JAX's
    under one jax.jit with the length static (eagerly, each primitive compiles apart, several times the cost)."""
    cache_type = importlib.import_module(f"{M.__name__}.latent").LatentCache

    def step(module, x, c_kv, k_rope, mask=None):
        return module.extend(x, cache_type(c_kv, k_rope, length), mask, absorbed=absorbed)

    if M.__name__ != "attention_jax":
        return step
    import jax

    return jax.jit(step)


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_both_decode_forms_equal_the_full_causal_pass(backend: ModuleType, reference: dict, absorbed: bool) -> None:
    module, x = _ours(backend, reference["state"]), reference["x"]
    full, full_weights = method_program(backend, "__call__")(module, backend.asarray(x), backend.causal_mask(L, L))
    out, weights, _ = _decode(backend, module, x, absorbed)
    assert_close(out, backend.to_numpy(full), EXACT, "out")
    assert_close(weights[..., :L], backend.to_numpy(full_weights), EXACT, "weights")
    np.testing.assert_array_equal(weights[..., L:], 0)  # positions not yet filled


def test_the_cache_holds_transformers_latents(backend: ModuleType, reference: dict) -> None:
    """c_kv after kv_a_layernorm, as transformers caches it; k_rope after RoPE, in DeepSeek's interleaved pairs
    (x_2j, x_2j+1), where transformers' cache holds the same pairs' turned entries as halves (its rotation
    returns [first of each pair, second of each pair])."""
    module = _ours(backend, reference["state"])
    *_, cache = _decode(backend, module, reference["x"], absorbed=True)
    c_kv, k_rope = backend.to_numpy(cache.c_kv), backend.to_numpy(cache.k_rope)
    assert c_kv.shape == (B, CAPACITY, SIZES["kv_lora_rank"])  # (..., capacity, Dc): no head axis
    assert k_rope.shape == (B, CAPACITY, SIZES["qk_rope_head_dim"])  # (..., capacity, Er): one key for every head
    assert_close(c_kv[:, :L], reference["c_kv"], TOLERANCE, "c_kv")
    halves = np.concatenate([k_rope[:, :L, 0::2], k_rope[:, :L, 1::2]], axis=-1)  # interleaved -> halves
    assert_close(halves, reference["k_rot"], TOLERANCE, "k_rope")
    np.testing.assert_array_equal(c_kv[:, L:], 0)


def test_a_mask_hides_keys_in_every_form(backend: ModuleType, reference: dict) -> None:
    """A mask on top of causality: the full pass with causal & mask equals either decode form given the mask's
    rows of each chunk (..., H, L, capacity)."""
    module, x = _ours(backend, reference["state"]), reference["x"]
    keep = np.random.default_rng(1).random((B, H, L, CAPACITY)) < 0.7
    keep[..., np.arange(L), np.arange(L)] = True  # every query sees itself
    full, _ = method_program(backend, "__call__")(module, backend.asarray(x),
                                                   backend.asarray(keep[..., :L] & np.tri(L, L, dtype=bool)))
    for absorbed in (False, True):
        cache, outs = module.init_cache((B,), CAPACITY), []
        for start, end in CHUNKS:
            out, _, cache = _step(backend, absorbed, start)(module, backend.asarray(x[:, start:end]), cache.c_kv,
                                                            cache.k_rope, backend.asarray(keep[:, :, start:end]))
            outs.append(backend.to_numpy(out))
        assert_close(np.concatenate(outs, axis=1), backend.to_numpy(full), EXACT, f"absorbed={absorbed}")


def _small() -> dict[str, np.ndarray]:
    """A float64 module small enough for central differences over every parameter."""
    numpy_module = import_backend("attention_np").MultiHeadLatentAttention(
        8, 2, q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3, rng=3,
        dtype=np.float64)
    state = {name: value + np.random.default_rng(4).uniform(-0.3, 0.3, value.shape) * ("layernorm" in name)
             for name, value in numpy_module.state_dict().items()}  # gains not 1
    return {name: np.array(value) for name, value in state.items()}


def _numerical_gradients(state: dict, x: np.ndarray, d_out: np.ndarray, mask: np.ndarray) -> dict:
    """Central differences of <out, d_out> in every parameter and x, through NumPy's forward pass."""
    M = import_backend("attention_np")

    def out(x_: np.ndarray, **changed: np.ndarray) -> np.ndarray:
        return M.MultiHeadLatentAttention.from_state_dict(state | changed, num_heads=2)(x_, mask)[0]

    found = {"x": central_differences(out, x, d_out, 1e-6)}
    for name, value in state.items():
        found[name] = central_differences(lambda w, name=name: out(x, **{name: w}), value, d_out, 1e-6)
    return found


def test_vjp_equals_central_differences(backend: ModuleType) -> None:
    """Every parameter's gradient and the input's, through the vjp: NumPy's composed by hand from the pieces'
    backward passes, JAX's jax.vjp, torch's autograd."""
    state = _small()
    rng = np.random.default_rng(5)
    x, d_out, mask = rng.standard_normal((1, 3, 8)), rng.standard_normal((1, 3, 8)), np.tri(3, 3, dtype=bool)
    module = backend.MultiHeadLatentAttention.from_state_dict({name: backend.asarray(value)
                                                               for name, value in state.items()}, num_heads=2)

    def gradients(module, x_, d_out_):
        return module.vjp(x_, backend.asarray(mask))[2](d_out_)

    if backend.__name__ == "attention_jax":
        import jax

        gradients = jax.jit(gradients)  # one program: see _step
    dx, grads = gradients(module, backend.asarray(x), backend.asarray(d_out))
    found = {"x": backend.to_numpy(dx)} | {name: backend.to_numpy(value) for name, value in grads.items()}
    expected = _numerical_gradients(state, x, d_out, mask)
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert_close(found[name], value, 1e-6, name)


def test_vjp_of_the_v2_lite_form_equals_central_differences() -> None:
    """NumPy's hand-composed vjp without the query latent (q_proj), where it takes the other branch."""
    M = import_backend("attention_np")
    mla = M.MultiHeadLatentAttention(8, 2, q_lora_rank=None, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2,
                                     v_head_dim=3, rng=6, dtype=np.float64)
    state = {name: np.array(value) for name, value in mla.state_dict().items()}
    rng = np.random.default_rng(7)
    x, d_out, mask = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 3, 8)), np.tri(3, 3, dtype=bool)
    out, weights, pullback = mla.vjp(x, mask)
    expected_out, expected_weights = mla(x, mask)
    assert_close(out, expected_out, EXACT, "out")  # scaled_dot_product_attention_vjp's forward, reassociated
    assert_close(weights, expected_weights, EXACT, "weights")
    dx, grads = pullback(d_out)
    expected = _numerical_gradients(state, x, d_out, mask)
    for name, value in ({"x": dx} | grads).items():
        assert_close(value, expected[name], 1e-6, name)


# the mistakes and the words their message must hold: the argument, and the shapes
def _module(M: ModuleType):
    return M.MultiHeadLatentAttention(D, H, q_lora_rank=12, **SIZES, rng=backend_rng(M, 0))


MISTAKES = {
    "x without D": (lambda M, m: m(M.asarray(np.zeros((B, L, D + 1), np.float32))), ["x", "(2, 7, 33)", "32"]),
    "mask too wide": (lambda M, m: m(M.asarray(np.zeros((B, L, D), np.float32)), M.asarray(np.ones((L, L + 1), bool))),
                      ["mask", "(7, 8)", "H, L, L"]),
    "odd rope width": (lambda M, m: M.MultiHeadLatentAttention(D, H, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6,
                                                               qk_rope_head_dim=3, v_head_dim=5),
                       ["qk_rope_head_dim", "3"]),
    "zero rank": (lambda M, m: M.MultiHeadLatentAttention(D, H, q_lora_rank=0, kv_lora_rank=8, qk_nope_head_dim=6,
                                                          qk_rope_head_dim=4, v_head_dim=5), ["q_lora_rank", "0"]),
    "entry mis-shaped": (lambda M, m: M.MultiHeadLatentAttention.from_state_dict(
        m.state_dict() | {"q_b_proj.weight": M.asarray(np.zeros((40, 13), np.float32))}, num_heads=H),
        ["q_b_proj.weight", "(40, 13)", "(40, 12)"]),
    "entry missing": (lambda M, m: M.MultiHeadLatentAttention.from_state_dict(
        {name: value for name, value in m.state_dict().items() if name != "kv_b_proj.weight"}, num_heads=H),
        ["kv_b_proj.weight"]),
    "extend: other batch": (lambda M, m: m.extend(M.asarray(np.zeros((3, 1, D), np.float32)), m.init_cache((B,), 4)),
                            ["x", "(3, 1, 32)", "(2,)"]),
    "extend: cache full": (lambda M, m: m.extend(M.asarray(np.zeros((B, 5, D), np.float32)), m.init_cache((B,), 4)),
                           ["capacity is 4", "5"]),
}


@pytest.mark.parametrize("mistake", MISTAKES.values(), ids=MISTAKES.keys())
def test_mistakes_raise_errors_naming_the_argument_and_shapes(backend: ModuleType, mistake) -> None:
    call, words = mistake
    module = _module(backend)
    with pytest.raises(ValueError) as raised:
        call(backend, module)
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_the_absorbed_step_forms_no_heads_keys_or_values() -> None:
    """The absorbed form reads kv_b_proj's weight and never calls it: with a kv_b_proj that refuses to be called,
    absorbed decoding runs and equals the expanded form, which does call it."""
    M = import_backend("attention_np")
    linear = importlib.import_module("attention_np.modules").Linear

    class Refused(linear):
        def __call__(self, x):
            raise AssertionError("kv_b_proj applied: keys and values formed per head")

    mla = M.MultiHeadLatentAttention(16, 2, q_lora_rank=8, **SIZES, rng=0, dtype=np.float64)
    refusing = mla._replace(kv_b_proj=Refused(mla.kv_b_proj.weight))
    x = np.random.default_rng(2).standard_normal((1, 4, 16))
    expected, _, _ = mla.extend(x, mla.init_cache((1,), 4))
    out, _, _ = refusing.extend(x, refusing.init_cache((1,), 4), absorbed=True)
    assert_close(out, expected, EXACT, "out")
    with pytest.raises(AssertionError, match="kv_b_proj applied"):
        refusing.extend(x, refusing.init_cache((1,), 4), absorbed=False)


# --- LatentTransformerBlock: DeepSeek-V3's decoder layer with a dense MLP ---------------------------------------

F = 24  # d_ff: the dense MLP's intermediate_size
LAYER_NAMES = {"self_attn.": "attn.", "input_layernorm.": "norm1.", "post_attention_layernorm.": "norm2.",
               "mlp.gate_proj.": "ffn.w_gate.", "mlp.up_proj.": "ffn.w_up.", "mlp.down_proj.": "ffn.w_down."}


def _ours_named(name: str) -> str:
    """transformers' DeepseekV3DecoderLayer state-dict name -> LatentTransformerBlock's."""
    prefix = next(prefix for prefix in LAYER_NAMES if name.startswith(prefix))
    return LAYER_NAMES[prefix] + name.removeprefix(prefix)


@pytest.fixture(scope="module", params=Q_LORA_RANKS, ids=("q_lora", "q_proj"))
def layer_reference(request: pytest.FixtureRequest) -> dict:
    """transformers' DeepseekV3DecoderLayer at layer 0 below first_k_dense_replace (its dense MLP, not the MoE),
    random weights (norm gains not 1), float64: the state under our names, an input and its causal pass."""
    transformers = pytest.importorskip("transformers")
    deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    config = transformers.DeepseekV3Config(
        vocab_size=16, hidden_size=D, intermediate_size=F, moe_intermediate_size=8, num_hidden_layers=1,
        first_k_dense_replace=1, hidden_act="silu", rms_norm_eps=1e-6, num_attention_heads=H, num_key_value_heads=H,
        q_lora_rank=request.param, **SIZES, rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": THETA}, attention_bias=False, attention_dropout=0.0)
    config._attn_implementation = "sdpa"  # float64 throughout (eager's softmax is float32)
    layer = deepseek.DeepseekV3DecoderLayer(config, layer_idx=0).double().eval()
    assert isinstance(layer.mlp, deepseek.DeepseekV3MLP)  # the dense MLP
    for norm in layer.modules():
        if isinstance(norm, deepseek.DeepseekV3RMSNorm):
            norm.forward = types.MethodType(_rms_norm_in_input_dtype, norm)
    rng = np.random.default_rng(3)
    state = {name: rng.uniform(-0.4, 0.4, tuple(value.shape)) for name, value in layer.state_dict().items()}
    state |= {name: rng.uniform(0.5, 1.5, value.shape) for name, value in state.items() if "layernorm" in name}
    layer.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()})
    x = rng.standard_normal((B, L, D))
    hidden = np.where(np.tri(L, L, dtype=bool), 0.0, -np.inf)[None, None]  # (1, 1, L, L) additive causal mask
    with torch.no_grad():
        out = layer(torch.from_numpy(x), attention_mask=torch.from_numpy(hidden), position_embeddings=_cos_sin(
            np.arange(L)))
    return {"q_lora_rank": request.param, "state": {_ours_named(name): value for name, value in state.items()},
            "x": x, "out": out.numpy()}


def _block(M: ModuleType, state: dict[str, np.ndarray]):
    return M.LatentTransformerBlock.from_state_dict({name: M.asarray(value) for name, value in state.items()},
                                                    num_heads=H, rope_theta=THETA).eval()


def test_block_equals_transformers_deepseek_v3_decoder_layer(backend: ModuleType, layer_reference: dict) -> None:
    block = _block(backend, layer_reference["state"])
    out, _ = method_program(backend, "__call__")(block, backend.asarray(layer_reference["x"]),
                                                 backend.causal_mask(L, L))
    assert_close(backend.to_numpy(out), layer_reference["out"], TOLERANCE, "out")


def test_block_is_its_pieces_composed(backend: ModuleType, layer_reference: dict) -> None:
    """x + MLA(RMSNorm_1(x)), then + W_down (silu(W_gate h) * W_up h) of RMSNorm_2: the RMSNorms and the MLP written
    out here in NumPy, the attention the backend's MultiHeadLatentAttention holding attn.*."""
    state, x = layer_reference["state"], layer_reference["x"]

    def rms(name: str, h: np.ndarray) -> np.ndarray:
        return state[f"{name}.weight"] * h / np.sqrt(np.mean(h**2, axis=-1, keepdims=True) + 1e-6)

    attn = _ours(backend, {name.removeprefix("attn."): value for name, value in state.items()
                           if name.startswith("attn.")})
    h, _ = method_program(backend, "__call__")(attn, backend.asarray(rms("norm1", x)), backend.causal_mask(L, L))
    x = x + backend.to_numpy(h)
    gate, up = (rms("norm2", x) @ state[f"ffn.{name}.weight"].T for name in ("w_gate", "w_up"))
    expected = x + (gate / (1 + np.exp(-gate)) * up) @ state["ffn.w_down.weight"].T  # silu(g) = g sigmoid(g)
    out, _ = method_program(backend, "__call__")(_block(backend, state), backend.asarray(layer_reference["x"]),
                                                 backend.causal_mask(L, L))
    assert_close(backend.to_numpy(out), expected, EXACT, "out")


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_block_decodes_through_its_cache_as_its_full_pass(backend: ModuleType, layer_reference: dict,
                                                          absorbed: bool) -> None:
    block, x = _block(backend, layer_reference["state"]), layer_reference["x"]
    out, weights, cache = _decode(backend, block, x, absorbed)
    assert_close(out, layer_reference["out"], TOLERANCE, "out")
    _, full_weights = method_program(backend, "__call__")(block, backend.asarray(x), backend.causal_mask(L, L))
    assert_close(weights[..., :L], backend.to_numpy(full_weights), EXACT, "weights")
    assert backend.to_numpy(cache.c_kv).shape == (B, CAPACITY, SIZES["kv_lora_rank"])  # the attention's latents


def test_block_state_dict_holds_the_layer_s_names(backend: ModuleType, layer_reference: dict) -> None:
    block = backend.LatentTransformerBlock(D, H, F, q_lora_rank=layer_reference["q_lora_rank"], **SIZES,
                                           rng=backend_rng(backend, 0))
    state = {name: backend.to_numpy(value) for name, value in block.state_dict().items()}
    assert {name: value.shape for name, value in state.items()} == \
        {name: value.shape for name, value in layer_reference["state"].items()}
    assert list(state)[:2] == ["attn.q_a_proj.weight" if layer_reference["q_lora_rank"] else "attn.q_proj.weight",
                               "attn.q_a_layernorm.weight" if layer_reference["q_lora_rank"]
                               else "attn.kv_a_proj_with_mqa.weight"]
    again = backend.LatentTransformerBlock.from_state_dict(block.state_dict(), num_heads=H)
    assert all(np.array_equal(backend.to_numpy(value), state[name]) for name, value in again.state_dict().items())


BLOCK_MISTAKES = {
    "x without D": (lambda M, m: m(M.asarray(np.zeros((B, L, D + 1), np.float32))), ["x", "(2, 7, 33)", "32"]),
    "extend: x without D": (lambda M, m: m.extend(M.asarray(np.zeros((B, 1, D + 1), np.float32)),
                                                  m.init_cache((B,), 4)), ["x", "(2, 1, 33)", "32"]),
    "zero d_ff": (lambda M, m: M.LatentTransformerBlock(D, H, 0, q_lora_rank=12, **SIZES),
                  ["d_ff", "0"]),
    "entry unexpected": (lambda M, m: M.LatentTransformerBlock.from_state_dict(
        m.state_dict() | {"ffn.bias": M.asarray(np.zeros((3,), np.float32))}, num_heads=H), ["unexpected ffn.bias"]),
    "entry mis-shaped": (lambda M, m: M.LatentTransformerBlock.from_state_dict(
        m.state_dict() | {"ffn.w_up.weight": M.asarray(np.zeros((F, D + 1), np.float32))}, num_heads=H),
        ["ffn.w_up.weight", "(24, 33)", "(24, 32)"]),
    "entry missing": (lambda M, m: M.LatentTransformerBlock.from_state_dict(
        {name: value for name, value in m.state_dict().items() if name != "norm2.weight"}, num_heads=H),
        ["norm2.weight"]),
}


@pytest.mark.parametrize("mistake", BLOCK_MISTAKES.values(), ids=BLOCK_MISTAKES.keys())
def test_block_mistakes_raise_errors_naming_the_argument_and_shapes(backend: ModuleType, mistake) -> None:
    call, words = mistake
    block = backend.LatentTransformerBlock(D, H, F, q_lora_rank=12, **SIZES, rng=backend_rng(backend, 0))
    with pytest.raises(ValueError) as raised:
        call(backend, block)
    assert all(word in str(raised.value) for word in words), str(raised.value)


# What a cache holds per token and layer, at DeepSeek-V3's attention sizes (its config.json), for MLA and for
# attention of the same heads (keys of E = En + Er, values of Ev) caching H, 8 or 1 key/value heads.
V3 = {"num_heads": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
KV_HEADS = {"MHA": None, "GQA (Hkv = 8)": 8, "MQA": 1}  # the key/value heads each cache holds (None: H)
BF16 = 2  # bytes a number: DeepSeek-V3 serves its cache in bfloat16
DOCS = Path(__file__).resolve().parent.parent / "docs" / "latent.md"
BEGIN, END = "<!-- generated: python -m tests.test_latent (cache) -->\n", "<!-- end generated (cache) -->"


def cache_numbers_per_token(attention: str, sizes: dict[str, int]) -> int:
    """The numbers a cache holds for one token of one layer: Hkv (E + Ev) for a key and a value of each cached
    head; MLA's Dc + Er (c_kv and k_rope), whatever H."""
    if attention == "MLA":
        return sizes["kv_lora_rank"] + sizes["qk_rope_head_dim"]
    Hkv = KV_HEADS[attention] or sizes["num_heads"]
    return Hkv * (sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"] + sizes["v_head_dim"])


def cache_table() -> str:
    """The docs' table: numbers and bfloat16 bytes per token per layer at DeepSeek-V3's sizes, and each against MLA."""
    mla = cache_numbers_per_token("MLA", V3)
    rows = [f"| {name} | {n:,} | {n * BF16:,} | {n / mla:.2f}x |"
            for name, n in ((name, cache_numbers_per_token(name, V3)) for name in (*KV_HEADS, "MLA"))]
    return "\n".join(["| attention | numbers per token per layer | bytes (bfloat16) | against MLA |",
                      "|---|---|---|---|", *rows]) + "\n"


def test_cache_numbers_are_those_of_an_allocated_cache() -> None:
    """The formula against init_cache's arrays: MLA's latent cache, and MultiHeadAttention's with H, 8 and 1
    key/value heads (its keys and values of one width d_k: E = Ev = d_k), float16 as a two-byte dtype."""
    M = import_backend("attention_np")
    capacity, d_k = 5, 8
    mla = M.MultiHeadLatentAttention(32, 16, q_lora_rank=8, **SIZES, rng=0)
    cache = mla.init_cache((1,), capacity, dtype=np.float16)
    assert (cache.c_kv.nbytes + cache.k_rope.nbytes) // capacity == cache_numbers_per_token("MLA", SIZES) * BF16
    same_width = {"num_heads": 16, "qk_nope_head_dim": d_k - 2, "qk_rope_head_dim": 2, "v_head_dim": d_k}  # E = Ev
    for name, Hkv in KV_HEADS.items():
        mha = M.MultiHeadAttention(16 * d_k, 16, num_kv_heads=Hkv, rng=0)
        cache = mha.init_cache((1,), capacity, dtype=np.float16)
        assert (cache.k.nbytes + cache.v.nbytes) // capacity == cache_numbers_per_token(name, same_width) * BF16


def test_the_docs_show_the_cache_table() -> None:
    """docs/latent.md's table is cache_table() (`python -m tests.test_latent` writes it), and its sentence's
    numbers are the table's."""
    text = DOCS.read_text()
    assert re.search(re.escape(BEGIN) + "(.*?)" + re.escape(END), text, re.DOTALL)[1] == cache_table()
    assert f"{cache_numbers_per_token('MLA', V3):,} numbers a position against " \
        f"{cache_numbers_per_token('MHA', V3):,}" in text


def test_the_recorded_decode_run_is_recomputed() -> None:
    """docs/mla.json (the performance page's table, `compare --variant mla`): its rows are every backend's two forms
    at the config's S, their MFLOP recomputed from the config, the forms' difference within the benchmark's check and
    the same on both rows of a backend, and its ratios those of its rows; only the times are the record's own."""
    from conformance import docs
    from conformance.bench import latent, timing

    record = docs.mla_record()
    config = latent.Config(**record["config"])
    rows = [latent.FormRow(**row) for row in record["rows"]]
    backends = {"attention_np": "numpy", "attention_jax": "jax", "attention_torch": "torch"}
    assert [(row.backend, row.framework, row.form, row.context, row.mflops) for row in rows] == [
        (name, framework, form, config.context, latent.flops(config, form) / 1e6)
        for name, framework in backends.items() for form in latent.FORMS]
    assert all(0 <= row.max_diff <= latent.ATOL for row in rows)
    assert [row.max_diff for row in rows[0::2]] == [row.max_diff for row in rows[1::2]]  # one per backend
    assert [timing.Ratio(**ratio) for ratio in record["ratios"]] == latent.ratios(rows)  # JSON keeps a float exactly
    assert all(ratio.measured == ratio.numerator_value / ratio.denominator_value for ratio in latent.ratios(rows))


if __name__ == "__main__" and sys.argv[1:] in ([], ["--write"]):  # python -m tests.test_latent: the docs' table
    DOCS.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END),
                           lambda _: BEGIN + cache_table() + END, DOCS.read_text(), flags=re.DOTALL))
