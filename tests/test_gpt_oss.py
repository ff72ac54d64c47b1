"""A gpt-oss-style block is our block with gpt-oss's options: TransformerBlock(norm_first=True, norm="rms",
bias=True, num_kv_heads=Hkv, rope_theta=theta, sinks=True), and on alternate layers window=(W - 1, 0), gpt-oss's
sliding_window W. Checked on every backend, float64, against transformers' GptOssAttention (eager: the sink
column joins the softmax) with the masks of transformers' own mask functions (masking_utils: a sliding layer's
key j is seen by query i iff j <= i and j > i - W, so W counts the query itself), layer_types alternating; the
full pass of a stack of two blocks, one full and one sliding, and decoding through the cache.

The feed-forward network is activation="swiglu_oss", gpt-oss's clamped SwiGLU: the reference is transformers'
GptOssExperts with one expert and the router forced (gpt-oss's MLP is a mixture of experts; the block is one
dense expert, SPEC 4), its interleaved gate_up_proj mapped onto ffn.w_gate and ffn.w_up here, in the test. The
reference composes transformers' attention and expert with an RMSNorm written out in float64 (transformers'
GptOssRMSNorm normalises in float32 whatever the input dtype, which would hide a 1e-10 comparison). The
gradients of the sliding block's parameters are transformers' autograd of the stack.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from tests._compare import assert_close, method_program

torch = pytest.importorskip("torch")  # transformers is imported by the fixture: a few seconds, paid once

B, L, D, H, HKV, F, W, THETA, EPS = 2, 9, 16, 4, 2, 24, 3, 500.0, 1e-5  # d_k = 4: two RoPE pairs
RTOL = 1e-10
LAYER_TYPES = ("full_attention", "sliding_attention")
WINDOWS = {"full_attention": None, "sliding_attention": (W - 1, 0)}  # gpt-oss's W keys, the query's own among them

# our attention's state-dict names -> GptOssAttention's
ATTENTION = {"attn.sinks": "sinks"} | {f"attn.w_{name}.{part}": f"{name}_proj.{part}"
                                       for name in "qkvo" for part in ("weight", "bias")}


def _rms(x: torch.Tensor, weight: np.ndarray) -> torch.Tensor:
    """RMSNorm in float64: x / sqrt(mean(x^2) + eps) * weight."""
    return x / torch.sqrt((x**2).mean(dim=-1, keepdim=True) + EPS) * torch.from_numpy(weight)


def _expert(experts: object, x: torch.Tensor) -> torch.Tensor:
    """transformers' GptOssExperts with its one expert, the router forced: every token to expert 0, weight 1."""
    tokens = x.reshape(-1, D)  # (B * L, D)
    chosen, weight = torch.zeros((len(tokens), 1), dtype=torch.long), torch.ones((len(tokens), 1), dtype=x.dtype)
    return experts(tokens, chosen, weight).reshape(x.shape)


def _states(rng: np.random.Generator, layers: list, experts: list) -> list[dict[str, np.ndarray]]:
    """Our blocks' states: the attention's and the expert's drawn for transformers' layers and copied by name
    (the expert's gate_up_proj (1, D, 2F) interleaves its columns: gate ::2, up 1::2; large enough that many
    gate and up values pass the clamp's limit), the norms' gains drawn here."""
    states = []
    for layer, expert in zip(layers, experts, strict=True):
        theirs = {name: rng.uniform(-0.5, 0.5, tuple(value.shape)) for name, value in layer.state_dict().items()}
        theirs["sinks"] = rng.uniform(-1.0, 1.0, H)
        layer.load_state_dict({name: torch.from_numpy(value) for name, value in theirs.items()})
        state = {ours: theirs[name] for ours, name in ATTENTION.items()}
        state |= {f"norm{i}.weight": rng.uniform(0.5, 1.5, D) for i in (1, 2)}
        mlp = {"gate_up_proj": rng.uniform(-3.0, 3.0, (1, D, 2 * F)),
               "gate_up_proj_bias": rng.uniform(-1.0, 1.0, (1, 2 * F)),
               "down_proj": rng.uniform(-0.5, 0.5, (1, F, D)), "down_proj_bias": rng.uniform(-0.5, 0.5, (1, D))}
        expert.load_state_dict({name: torch.from_numpy(value) for name, value in mlp.items()})
        for name, columns in (("w_gate", slice(0, None, 2)), ("w_up", slice(1, None, 2))):
            state[f"ffn.{name}.weight"] = mlp["gate_up_proj"][0, :, columns].T  # (D, F) -> (F, D)
            state[f"ffn.{name}.bias"] = mlp["gate_up_proj_bias"][0, columns]
        state["ffn.w_down.weight"], state["ffn.w_down.bias"] = mlp["down_proj"][0].T, mlp["down_proj_bias"][0]
        states.append(state)
    return states


@pytest.fixture(scope="module")
def gpt_oss() -> dict[str, object]:
    """Two layers' states (full, then sliding), an input, and the stack's output: each layer
    x = x + Attn(RMS_1(x)), x = x + FFN(RMS_2(x)), Attn transformers' GptOssAttention under the mask of its layer
    type made by transformers' mask functions."""
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    masking = pytest.importorskip("transformers.masking_utils")
    config = transformers.GptOssConfig(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV, head_dim=D // H, attention_bias=True,
        attention_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": THETA},
        layer_types=list(LAYER_TYPES), num_hidden_layers=2, sliding_window=W, intermediate_size=F,
        num_local_experts=1, num_experts_per_tok=1)
    config._attn_implementation = "eager"  # eager_attention_forward: the mask below, the sink in the softmax
    layers = [modeling.GptOssAttention(config, layer_idx=i).double().eval() for i in range(2)]
    assert [layer.sliding_window for layer in layers] == [None, W]
    experts = [modeling.GptOssExperts(config).double() for _ in range(2)]
    assert (experts[0].alpha, experts[0].limit) == (1.702, 7.0)
    rng = np.random.default_rng(5)
    states, x = _states(rng, layers, experts), rng.standard_normal((B, L, D))
    d_out = rng.standard_normal((B, L, D))
    angles = np.arange(L)[:, None] * THETA ** (-np.arange(0, D // H, 2) / (D // H))  # (L, d_k / 2), float64
    cos_sin = (torch.from_numpy(np.cos(angles))[None], torch.from_numpy(np.sin(angles))[None])
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    seen = {"full_attention": masking.causal_mask_function(0, 0, i, j),
            "sliding_attention": masking.sliding_window_causal_mask_function(W)(0, 0, i, j)}  # (L, L)
    h, inputs = torch.from_numpy(x), []
    for layer, expert, state, kind in zip(layers, experts, states, LAYER_TYPES, strict=True):
        inputs.append(h.detach().numpy())
        hidden = torch.where(seen[kind], 0.0, -torch.inf).double()[None, None]  # additive, as transformers'
        attended, _ = layer(_rms(h, state["norm1.weight"]), position_embeddings=cos_sin, attention_mask=hidden)
        h = h + attended
        h = h + _expert(expert, _rms(h, state["norm2.weight"]))
    (h * torch.from_numpy(d_out)).sum().backward()
    sliding, expert = layers[1], experts[1]  # the second block's parameters: the gradients of sum(out * d_out)
    gate_up, gate_up_bias = expert.gate_up_proj.grad[0].numpy(), expert.gate_up_proj_bias.grad[0].numpy()
    grads = {"attn.sinks": sliding.sinks.grad.numpy(), "attn.w_q.weight": sliding.q_proj.weight.grad.numpy(),
             "ffn.w_gate.weight": gate_up[:, ::2].T, "ffn.w_gate.bias": gate_up_bias[::2],
             "ffn.w_up.weight": gate_up[:, 1::2].T, "ffn.w_up.bias": gate_up_bias[1::2],
             "ffn.w_down.weight": expert.down_proj.grad[0].numpy().T}
    return {"states": states, "x": x, "inputs": inputs, "out": h.detach().numpy(), "d_out": d_out, "grads": grads,
            "seen": {kind: mask.numpy() for kind, mask in seen.items()}}


def _blocks(M: ModuleType, states: list[dict[str, np.ndarray]]) -> list:
    return [M.TransformerBlock.from_state_dict({name: M.asarray(value) for name, value in state.items()},
                                               num_heads=H, dropout=0.0, norm_first=True, activation="swiglu_oss",
                                               rope_theta=THETA, eps=EPS, window=WINDOWS[kind]).eval()
            for state, kind in zip(states, LAYER_TYPES, strict=True)]


def test_the_window_counts_the_query_itself(gpt_oss: dict) -> None:
    """gpt-oss's sliding window W: query i sees keys i - W < j <= i, W of them with its own; our (W - 1, 0)."""
    i, j = np.arange(L)[:, None], np.arange(L)
    assert np.array_equal(gpt_oss["seen"]["sliding_attention"], (j <= i) & (j >= i - (W - 1)))
    assert gpt_oss["seen"]["sliding_attention"].sum(axis=1).max() == W


def test_the_sliding_block_weights_only_the_window(backend: ModuleType, gpt_oss: dict) -> None:
    _, sliding = _blocks(backend, gpt_oss["states"])
    _, weights = sliding(backend.asarray(gpt_oss["x"]), is_causal=True)  # (B, H, L, L)
    visible = backend.to_numpy(weights) != 0
    assert np.array_equal(visible, np.broadcast_to(gpt_oss["seen"]["sliding_attention"], visible.shape))


def test_a_full_and_a_sliding_block_are_gpt_oss_layers(backend: ModuleType, gpt_oss: dict) -> None:
    x = backend.asarray(gpt_oss["x"])
    call = method_program(backend, "__call__", is_causal=True)
    for block in _blocks(backend, gpt_oss["states"]):
        x, _ = call(block, x)
    assert_close(backend.to_numpy(x), gpt_oss["out"], RTOL, "two blocks")


def test_the_sliding_blocks_gradients_are_gpt_oss(backend: ModuleType, gpt_oss: dict) -> None:
    """vjp through the window and the clamped SwiGLU (NumPy's by hand): transformers' autograd of the stack."""
    _, sliding = _blocks(backend, gpt_oss["states"])
    _, _, pullback = sliding.vjp(backend.asarray(gpt_oss["inputs"][1]), is_causal=True)
    _, grads = pullback(backend.asarray(gpt_oss["d_out"]))
    for name, expected in gpt_oss["grads"].items():
        assert_close(backend.to_numpy(grads[name]), expected, RTOL, f"d {name}")


@pytest.mark.parametrize("chunk", [1, 4])
def test_decoding_with_the_window_is_the_full_pass(backend: ModuleType, gpt_oss: dict, chunk: int) -> None:
    """Each block keeps its whole cache; the sliding one hides the keys before its window (a chunk of 4 > W:
    its queries' windows differ)."""
    blocks, x = _blocks(backend, gpt_oss["states"]), backend.asarray(gpt_oss["x"])
    caches, outs = [block.init_cache((B,), L) for block in blocks], []
    step = method_program(backend, "extend", need_weights=False)
    for start in range(0, L, chunk):
        h = x[:, start:start + chunk]
        for n, block in enumerate(blocks):
            h, _, caches[n] = step(block, h, caches[n])
        outs.append(backend.to_numpy(h))
    assert_close(np.concatenate(outs, axis=1), gpt_oss["out"], RTOL, f"decoding in chunks of {chunk}")


def test_paged_decoding_with_the_window_is_the_full_pass(backend: ModuleType, gpt_oss: dict) -> None:
    blocks, x = _blocks(backend, gpt_oss["states"]), backend.asarray(gpt_oss["x"])
    caches, outs = [block.init_paged_cache(B, 10, 2, 5) for block in blocks], []  # pages of 2 positions
    for i in range(L):
        h = x[:, i:i + 1]
        for n, block in enumerate(blocks):
            store = caches[n].reserve(backend.asarray(np.array([1, 1])))
            h, _, caches[n] = block.extend(h, store, need_weights=False)
        outs.append(backend.to_numpy(h))
    assert_close(np.concatenate(outs, axis=1), gpt_oss["out"], RTOL, "paged decoding")


def test_the_window_is_and_ed_with_a_mask(backend: ModuleType, gpt_oss: dict) -> None:
    """A 0 / 1 float causal mask in place of is_causal: the same two blocks."""
    x, mask = backend.asarray(gpt_oss["x"]), backend.asarray(np.tri(L, L))
    for block in _blocks(backend, gpt_oss["states"]):
        x, _ = block(x, mask)
    assert_close(backend.to_numpy(x), gpt_oss["out"], RTOL, "two blocks under a mask")


def test_a_bad_window_or_cache_raises(backend: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"window must be None or a pair \(left, right\)"):
        backend.TransformerBlock(D, H, F, 0.0, window=(-1, 0))
    with pytest.raises(ValueError, match="window=\\(2, 0\\) needs attention='softmax'"):
        backend.TransformerBlock(D, H, F, 0.0, attention="linear", window=(2, 0))
    block = backend.TransformerBlock(D, H, F, 0.0, window=(2, 0))
    with pytest.raises(ValueError, match=r"extends a KVCache or a PagedKVCache .* got StreamingKVCache"):
        block.extend(backend.asarray(np.zeros((1, 1, D), np.float32)), block.init_cache((1,), 8, window=4))
