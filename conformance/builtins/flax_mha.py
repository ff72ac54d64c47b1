"""Flax NNX's nnx.MultiHeadAttention as the contract's MultiHeadAttention.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The module holds our state dict and, on each call, a layer built from it (nnx.merge of the layer's graph with
the arrays, traced under jax.jit as any others). Our nn.Linear weight (out, in) with out = h * d_k + j is its
LinearGeneral kernel (D, heads, d_k), the bias (heads, d_k); w_o's weight (D, H * d_k) is its output kernel
(H, d_k, D). num_kv_heads below num_heads is its own grouped-query attention (query head h reads key/value
head h // G, as ours); bias=False is its use_bias=False. Our leading axes (...) are flattened into its batch
and back; our mask, broadcast to (..., H, L, S) and made boolean, is its mask, which keeps where True.
Dropout is its own, on the attention weights, drawn from our key by nnx.Rngs(dropout=rng) with
broadcast_dropout=False (its default shares one keep / drop decision across the batch and the heads, which
SPEC 6 forbids). The weights are those it sows (sow_weights=True), (B, H, L, S) before dropout; it is asked
to sow them on every call, so that need_weights=False takes the same path (without sowing, and without
dropout, it calls jax.nn.dot_product_attention, whose softmax runs in float32). The constructor draws the
layer's own initial values (LeCun normal kernels, zero biases). No RoPE.
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attention_np.common import validation
from conformance import adapters
from conformance.contract.features import Declaration

TITLE = "flax.nnx.MultiHeadAttention"  # the column of `python -m conformance frameworks`
LAYERS = {"w_q": "query", "w_k": "key", "w_v": "value", "w_o": "out"}  # our Linear -> its LinearGeneral
PARTS = {"weight": "kernel", "bias": "bias"}  # our entry -> its parameter

asarray, to_numpy = adapters.arrays("jax")


def _flax_layout(name: str, x: jax.Array, d_k: int) -> jax.Array:
    """Our entry `name` (nn.Linear's layout) -> its parameter: a kernel (D, heads, d_k) or, for w_o, (H, d_k, D);
    a bias (heads, d_k) or, for w_o, (D,)."""
    layer, part = name.split(".")
    if layer == "w_o":
        return x.T.reshape(-1, d_k, x.shape[0]) if part == "weight" else x  # (D, H d_k) -> (H, d_k, D)
    return x.T.reshape(x.shape[1], -1, d_k) if part == "weight" else x.reshape(-1, d_k)  # (h d_k, D) -> (D, h, d_k)


def _our_layout(name: str, x: jax.Array) -> jax.Array:
    """Its parameter -> our entry `name`, the inverse of _flax_layout."""
    layer, part = name.split(".")
    if layer == "w_o":
        return x.reshape(-1, x.shape[-1]).T if part == "weight" else x  # (H, d_k, D) -> (D, H d_k)
    return x.reshape(x.shape[0], -1).T if part == "weight" else x.reshape(-1)  # (D, h, d_k) -> (h d_k, D)


def _layer(d_model: int, num_heads: int, num_kv_heads: int, bias: bool, dropout: float, rngs: nnx.Rngs,
           dtype: Any = jnp.float32) -> nnx.MultiHeadAttention:
    return nnx.MultiHeadAttention(num_heads, d_model, num_kv_heads=num_kv_heads, use_bias=bias, dropout_rate=dropout,
                                  broadcast_dropout=False, decode=False, keep_rngs=False, param_dtype=dtype, rngs=rngs)


@functools.cache
def _graph(d_model: int, num_heads: int, num_kv_heads: int, bias: bool, dropout: float) -> nnx.GraphDef:
    """The layer's structure, without its parameters (built once per layout, abstractly)."""
    return nnx.graphdef(nnx.eval_shape(lambda: _layer(d_model, num_heads, num_kv_heads, bias, dropout, nnx.Rngs(0))))


def _dtype(x: Any) -> tuple[str, bool]:
    return x.dtype.name, bool(jnp.issubdtype(x.dtype, jnp.floating))


def _refuse_rope(cls_name: str, rope_theta: float | None) -> None:
    """It has no rotary embeddings."""
    if rope_theta is not None:
        raise ValueError(f"{cls_name}: nnx.MultiHeadAttention has no rotary embeddings; got rope_theta={rope_theta!r}")


def _kept(mask: Any) -> jax.Array:
    """True where a mask keeps a key: a boolean as it is (jax: strict promotion refuses bool != 0), else != 0."""
    return jnp.asarray(mask) if mask.dtype == bool else mask != jnp.zeros((), mask.dtype)


class MultiHeadAttention:
    """nnx.MultiHeadAttention with our state dict; immutable: eval() and train() return a new module."""

    def __init__(self, d_model: int = 512, num_heads: int = 8, dropout: float = 0.1, *,
                 num_kv_heads: int | None = None, bias: bool = True, rope_theta: float | None = None, rng: Any = None,
                 dtype: Any = None) -> None:
        """The layer's own initial values, drawn from rng (a jax.random key; None: seeded from the OS), in dtype
        (float32 by default)."""
        validation.module_sizes(d_model, num_heads)
        num_kv_heads = validation.kv_heads(num_heads, num_kv_heads)
        validation.probability("dropout", dropout)
        _refuse_rope(type(self).__name__, rope_theta)
        rngs = nnx.Rngs(params=jax.random.key(secrets.randbits(63)) if rng is None else rng)
        layer = _layer(d_model, num_heads, num_kv_heads, bias, dropout, rngs, jnp.float32 if dtype is None else dtype)
        params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
        state = {f"{ours}.{part}": _our_layout(f"{ours}.{part}", params[theirs][PARTS[part]])
                 for ours, theirs in LAYERS.items() for part in PARTS if PARTS[part] in params[theirs]}
        self._hold(state, num_heads, dropout, training=True)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, num_heads: int, dropout: float = 0.1,
                        rope_theta: float | None = None) -> MultiHeadAttention:
        """A module holding `state` (NumPy or JAX arrays; computes in their dtype), in training mode."""
        state = {name: asarray(x) for name, x in state.items()}
        shapes = {name: x.shape for name, x in state.items()}
        layout = validation.mha_layout(shapes, num_heads)  # d_model, num_kv_heads and bias, from the shapes
        validation.probability("dropout", dropout)
        validation.state(cls.__name__, shapes, validation.mha_state_shapes(num_heads=num_heads, **layout._asdict()))
        dtypes = {name: _dtype(x) for name, x in state.items()}
        validation.same_floating_dtype(dtypes, f"{cls.__name__}.from_state_dict: ")
        _refuse_rope(cls.__name__, rope_theta)
        mha = cls.__new__(cls)
        mha._hold(state, num_heads, dropout, training=True)
        return mha

    def _hold(self, state: dict[str, jax.Array], num_heads: int, dropout: float, *, training: bool) -> None:
        self._state, self.num_heads, self.dropout, self.training = state, num_heads, dropout, training
        D = state["w_q.weight"].shape[1]
        self.d_model, self.d_k, self.num_kv_heads = D, D // num_heads, state["w_k.weight"].shape[0] // (D // num_heads)

    def _with(self, state: dict[str, jax.Array] | None = None, *, training: bool | None = None) -> MultiHeadAttention:
        mha = type(self).__new__(type(self))
        mha._hold(self._state if state is None else state, self.num_heads, self.dropout,
                  training=self.training if training is None else training)
        return mha

    def state_dict(self) -> dict[str, jax.Array]:
        return dict(self._state)

    def eval(self) -> MultiHeadAttention:
        return self._with(training=False)

    def train(self) -> MultiHeadAttention:
        return self._with(training=True)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None, *,
                 need_weights: bool = True, rng: Any = None) -> tuple[jax.Array, jax.Array | None]:
        """Args: q (..., L, D), k and v (..., S, D); mask broadcasting to (..., H, L, S), 0 / False hides a key;
        rng a jax.random key (required while dropout is active). Returns out (..., L, D) and the weights
        (..., H, L, S) before dropout, or None."""
        batch = self._checked(q, k, v, mask)
        (L, D), S, H = q.shape[-2:], k.shape[-2], self.num_heads
        dropout_p = self.dropout if self.training else 0.0
        validation.dropout_rng(dropout_p, rng, type(self).__name__)

        # 1) our leading axes (...) flattened into its batch
        B = math.prod(batch)
        q, k, v = (jnp.broadcast_to(x, (*batch, *x.shape[-2:])).reshape(B, *x.shape[-2:]) for x in (q, k, v))
        keep = None if mask is None else jnp.broadcast_to(_kept(mask), (*batch, H, L, S)).reshape(B, H, L, S)

        # 2) the layer, holding our parameters in its layout; it sows the weights, before dropout
        layer = nnx.merge(_graph(D, H, self.num_kv_heads, "w_q.bias" in self._state, self.dropout),
                          self._flax_params())
        out, sown = nnx.capture(layer, nnx.Intermediate)(
            q, k, v, mask=keep, deterministic=dropout_p == 0.0, sow_weights=True,
            rngs=None if dropout_p == 0.0 else nnx.Rngs(dropout=rng))  # (B, L, D)
        (weights,) = nnx.to_pure_dict(sown)["attention_weights"]  # (B, H, L, S)

        # 3) back to our leading axes
        return out.reshape(*batch, L, D), weights.reshape(*batch, H, L, S) if need_weights else None

    def vjp(self, q: jax.Array, k: jax.Array, v: jax.Array,
            mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array, Callable]:
        """out, weights and pullback(d_out) -> (dq, dk, dv, {state-dict name: gradient}), without dropout."""
        validation.no_dropout(type(self).__name__, self.dropout if self.training else 0.0)

        def call(q: jax.Array, k: jax.Array, v: jax.Array, **state: jax.Array) -> tuple[jax.Array, jax.Array]:
            return self._with(state)(q, k, v, mask)

        out, weights, pullback = adapters.autodiff(call, {"q": q, "k": k, "v": v} | self._state,
                                                   ("q", "k", "v", *self._state))

        def pull(d_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
            grads = pullback(d_out)
            return grads["q"], grads["k"], grads["v"], {name: grads[name] for name in self._state}

        return out, weights, pull

    def _flax_params(self) -> dict[str, dict[str, jax.Array]]:
        """Our state as its parameters: {layer: {kernel, bias}}."""
        params: dict[str, dict[str, jax.Array]] = {theirs: {} for theirs in LAYERS.values()}
        for name, x in self._state.items():
            ours, part = name.split(".")
            params[LAYERS[ours]][PARTS[part]] = _flax_layout(name, x, self.d_k)
        return params

    def _checked(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> tuple[int, ...]:
        """The contract's checks of the inputs (SPEC 7); returns the leading axes (...)."""
        for name, x, letter in (("q", q, "L"), ("k", k, "S"), ("v", v, "S")):
            validation.module_input(name, x.shape, self.d_model, letter)
        validation.same_floating_dtype({"q": _dtype(q), "k": _dtype(k), "v": _dtype(v),
                                    "parameters": _dtype(self._state["w_q.weight"])})
        batch = validation.attention_batch(q.shape, k.shape, v.shape)
        if mask is not None:
            validation.broadcasts_to("mask", mask.shape, (*batch, self.num_heads, q.shape[-2], k.shape[-2]),
                                 "..., H, L, S")
            floating = _dtype(mask)[1]
            seen = floating and not isinstance(mask, jax.core.Tracer)  # jax: no values inside jit
            validation.binary_mask(floating, bool(jnp.all((mask == 0) | (mask == 1))) if seen else None)
        return batch


CONFORMANCE = Declaration({
    "rope_theta": "it has no rotary position embeddings",
    "attention_linear": "softmax attention only: its attention_fn defaults to nnx.dot_product_attention; Flax has "
                        "no linear attention to pass there",
    "masked_rows": "a head in which a query sees no key gives it uniform weights 1 / S and the mean of the "
                   "values (hidden scores are filled with the dtype's minimum, not dropped)",
    "non_finite": "a row whose visible scores are all -inf (from infinite inputs) puts its weight on its hidden "
                  "keys (filled with the dtype's minimum), not NaN"})
