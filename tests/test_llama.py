"""A Llama decoder layer is our block with the Llama options: TransformerBlock(norm_first=True, norm="rms",
activation="swiglu", bias=False, num_kv_heads=Hkv, rope_theta=theta), checked against transformers'
LlamaDecoderLayer with the same weights, mapped by name, on every backend: the full causal pass and decoding
through the key/value cache.

transformers is a test-only dependency (the `test` extra). Its RMSNorm normalises in float32 whatever the
input's dtype (LlamaRMSNorm casts to float32 and back), so a float64 comparison agrees to float32's rounding,
about 1e-7 relative: the tolerance below is 1e-6. Its rotary angles are computed here in float64 and handed to
the layer (`position_embeddings`), as its own rotary module computes them in float32.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from tests._compare import assert_close, method_program
from tests.conftest import import_backend

torch = pytest.importorskip("torch")  # transformers is imported by the fixture: a few seconds, paid once

B, L, D, H, HKV, F, THETA, EPS = 2, 9, 32, 4, 2, 48, 500.0, 1e-5  # d_k = 8: four RoPE pairs
TOLERANCE = 1e-6  # float32 rounding inside transformers' RMSNorm (see above)

# our state-dict names -> transformers' names of the same weights
NAMES = {"attn.w_q.weight": "self_attn.q_proj.weight", "attn.w_k.weight": "self_attn.k_proj.weight",
         "attn.w_v.weight": "self_attn.v_proj.weight", "attn.w_o.weight": "self_attn.o_proj.weight",
         "ffn.w_gate.weight": "mlp.gate_proj.weight", "ffn.w_up.weight": "mlp.up_proj.weight",
         "ffn.w_down.weight": "mlp.down_proj.weight", "norm1.weight": "input_layernorm.weight",
         "norm2.weight": "post_attention_layernorm.weight"}


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Random weights (norm gains not 1), an input, and transformers' output of the causal pass, float64."""
    transformers = pytest.importorskip("transformers")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = transformers.LlamaConfig(
        hidden_size=D, intermediate_size=F, num_attention_heads=H, num_key_value_heads=HKV, rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": THETA}, attention_bias=False, mlp_bias=False,
        attention_dropout=0.0)
    config._attn_implementation = "eager"  # the plain softmax(q k^T / sqrt(d_k) + mask) v
    layer = llama.LlamaDecoderLayer(config, layer_idx=0).double().eval()
    rng = np.random.default_rng(0)
    theirs = {name: rng.uniform(-0.3, 0.3, tuple(value.shape)) for name, value in layer.state_dict().items()}
    theirs |= {name: rng.uniform(0.5, 1.5, D) for name in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    layer.load_state_dict({name: torch.from_numpy(value) for name, value in theirs.items()})
    x = rng.standard_normal((B, L, D))
    hidden = np.where(np.tri(L, L, dtype=bool), 0.0, -np.inf)[None, None]  # (1, 1, L, L) additive causal mask
    with torch.no_grad():
        out = layer(torch.from_numpy(x), attention_mask=torch.from_numpy(hidden),
                    position_ids=torch.arange(L)[None], position_embeddings=_cos_sin(L))
    out = out[0] if isinstance(out, tuple) else out
    return {ours: theirs[name] for ours, name in NAMES.items()}, x, out.numpy()


def _cos_sin(length: int) -> tuple:
    """Half-rotation cos and sin (1, length, d_k) in float64: angle_j(p) = p * theta^(-2j / d_k), repeated."""
    d_k = D // H
    angles = np.arange(length)[:, None] * THETA ** (-np.arange(0, d_k, 2) / d_k)  # (length, d_k / 2)
    angles = np.concatenate([angles, angles], axis=-1)[None]  # (1, length, d_k)
    return torch.from_numpy(np.cos(angles)), torch.from_numpy(np.sin(angles))


def _ours(M: ModuleType, state: dict[str, np.ndarray]):
    """The Llama layer as our block, loaded by name; SwiGLU, RMSNorm, no biases and Hkv come from the entries."""
    return M.TransformerBlock.from_state_dict({name: M.asarray(value) for name, value in state.items()},
                                              num_heads=H, dropout=0.0, norm_first=True, rope_theta=THETA,
                                              eps=EPS).eval()


def test_the_block_with_llama_options_is_a_llama_decoder_layer(backend: ModuleType, reference) -> None:
    state, x, expected = reference
    block = _ours(backend, state)
    out, _ = method_program(backend, "__call__")(block, backend.asarray(x), backend.causal_mask(L, L))
    assert_close(backend.to_numpy(out), expected, TOLERANCE, "out")


def test_decoding_through_the_cache_gives_the_llama_layer_rows(backend: ModuleType, reference) -> None:
    state, x, expected = reference
    block, extend = _ours(backend, state), method_program(backend, "extend")
    cache, outs, start = block.init_cache((B,), L + 2), [], 0
    for size in (4, 1, 3, 1):  # a prefill, a step, a chunk, a step
        out, _, cache = extend(block, backend.asarray(x[:, start:start + size]), cache)
        outs.append(backend.to_numpy(out))
        start += size
    assert_close(np.concatenate(outs, axis=-2), expected, TOLERANCE, "decoded rows")


def test_without_rope_the_layers_differ(reference) -> None:
    """The comparison can fail: the same block without its rotary embeddings is far from the Llama layer."""
    M = import_backend("attention_np")
    state, x, expected = reference
    block = M.TransformerBlock.from_state_dict(state, num_heads=H, dropout=0.0, norm_first=True, eps=EPS).eval()
    out, _ = block(x, M.causal_mask(L, L))
    assert np.max(np.abs(out - expected)) > 1e-2
