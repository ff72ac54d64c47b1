"""Keras 3's keras.layers.MultiHeadAttention, on the JAX backend, as the contract's MultiHeadAttention.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Importing this module sets KERAS_BACKEND=jax where it is not set yet; where Keras is already imported on
another backend, it refuses with ImportError. The module holds our state dict; each call runs one built layer
per layout (key_dim = value_dim = d_k, output to D) by stateless_call, with our arrays as its variables, so
it traces under jax.jit as any JAX code. Our nn.Linear weight (out, in) with out = h * d_k + j is its
EinsumDense kernel (D, H, d_k), the bias (H, d_k); w_o's weight (D, H * d_k) is its attention_output kernel
(H, d_k, D). bias=False is its use_bias=False. Our leading axes (...) are flattened into its batch and back.
It takes one attention_mask (B, L, S) for all heads, which keeps where True: ours, broadcast to (..., H, L,
S), gives head 0's, and one that differs between the heads is refused where its values can be seen (not
under jit). Dropout is its own Dropout layer on the attention weights; its seed generator's state (a raw
uint32 key) is our rng's key data, so the same key draws the same decisions. The weights are its attention
scores (return_attention_scores=True), (B, H, L, S) before dropout; they are asked for on every call, so that
need_weights=False takes the same path (without them, and without dropout, it calls
ops.dot_product_attention, JAX's jax.nn.dot_product_attention, whose softmax runs in float32). The
constructor draws its own initial values (Glorot uniform kernels, zero biases). No grouped heads, no RoPE.
"""

from __future__ import annotations

import functools
import math
import os
import secrets
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

# keras: the backend is chosen once, when keras is imported; KERAS_BACKEND=jax where nothing chose one yet
if "keras" in sys.modules:
    _BACKEND = sys.modules["keras"].backend.backend()
else:
    _BACKEND = os.environ.setdefault("KERAS_BACKEND", "jax")
if _BACKEND != "jax":
    raise ImportError(f"conformance.builtins.keras_mha needs Keras on the JAX backend, not {_BACKEND!r}: set "
                      "KERAS_BACKEND=jax (or leave it unset) before anything imports keras")

import jax
import jax.numpy as jnp
import keras

from attention_np.common import validation
from conformance import adapters
from conformance.contract.features import Declaration

TITLE = "keras.layers.MultiHeadAttention"  # the column of `python -m conformance frameworks`
LAYERS = {"w_q": "query", "w_k": "key", "w_v": "value", "w_o": "attention_output"}  # our Linear -> its EinsumDense
PARTS = {"weight": "kernel", "bias": "bias"}  # our entry -> its variable
SEED = "seed_generator_state"  # the variable of its Dropout's seed generator

asarray, to_numpy = adapters.arrays("jax")


def _keras_layout(name: str, x: jax.Array, d_k: int) -> jax.Array:
    """Our entry `name` (nn.Linear's layout) -> its variable: a kernel (D, H, d_k) or, for w_o, (H, d_k, D); a
    bias (H, d_k) or, for w_o, (D,)."""
    layer, part = name.split(".")
    if layer == "w_o":
        return x.T.reshape(-1, d_k, x.shape[0]) if part == "weight" else x  # (D, H d_k) -> (H, d_k, D)
    return x.T.reshape(x.shape[1], -1, d_k) if part == "weight" else x.reshape(-1, d_k)  # (H d_k, D) -> (D, H, d_k)


def _our_layout(name: str, x: jax.Array) -> jax.Array:
    """Its variable -> our entry `name`, the inverse of _keras_layout."""
    layer, part = name.split(".")
    if layer == "w_o":
        return x.reshape(-1, x.shape[-1]).T if part == "weight" else x  # (H, d_k, D) -> (D, H d_k)
    return x.reshape(x.shape[0], -1).T if part == "weight" else x.reshape(-1)  # (D, H, d_k) -> (H d_k, D)


def _our_name(variable: keras.Variable) -> str:
    """Our state-dict name of one of its weights ("attention_output/kernel" -> "w_o.weight")."""
    layer, part = variable.path.split("/")[-2:]
    return f"{_OURS[layer]}.{_OURS[part]}"


_OURS = {theirs: ours for table in (LAYERS, PARTS) for ours, theirs in table.items()}  # its names -> ours


def _new_layer(d_model: int, num_heads: int, bias: bool, dropout: float, dtype: str) -> keras.layers.MultiHeadAttention:
    with jax.ensure_compile_time_eval():  # jax: its variables hold arrays, also where a jit traces the first call
        layer = keras.layers.MultiHeadAttention(num_heads, d_model // num_heads, dropout=dropout, use_bias=bias,
                                                dtype=dtype, flash_attention=False, seed=0)
        layer.build((1, 1, d_model), (1, 1, d_model), (1, 1, d_model))
    return layer


_layer = functools.cache(_new_layer)  # one built layer per layout: stateless_call reads no state of its own


def _dtype(x: Any) -> tuple[str, bool]:
    return x.dtype.name, bool(jnp.issubdtype(x.dtype, jnp.floating))


def _refuse_layout(cls_name: str, num_heads: int, num_kv_heads: int, rope_theta: float | None) -> None:
    """It has one key/value head per query head and no rotary embeddings."""
    if num_kv_heads != num_heads:
        raise ValueError(f"{cls_name}: keras.layers.MultiHeadAttention has no grouped key/value heads; got "
                         f"num_kv_heads={num_kv_heads} for num_heads={num_heads} (w_k.weight and w_v.weight of "
                         f"{num_kv_heads} * d_k rows, not d_model)")
    if rope_theta is not None:
        raise ValueError(f"{cls_name}: keras.layers.MultiHeadAttention has no rotary embeddings; got "
                         f"rope_theta={rope_theta!r}")


def _kept(mask: Any) -> jax.Array:
    """True where a mask keeps a key: a boolean as it is (jax: strict promotion refuses bool != 0), else != 0."""
    return jnp.asarray(mask) if mask.dtype == bool else mask != jnp.zeros((), mask.dtype)


def _seed(rng: jax.Array) -> jax.Array:
    """A jax.random key, typed or raw, as its seed generator's state: the raw uint32 key data."""
    return jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng


class MultiHeadAttention:
    """keras.layers.MultiHeadAttention with our state dict; immutable: eval() and train() return a new module."""

    def __init__(self, d_model: int = 512, num_heads: int = 8, dropout: float = 0.1, *,
                 num_kv_heads: int | None = None, bias: bool = True, rope_theta: float | None = None, rng: Any = None,
                 dtype: Any = None) -> None:
        """Its own initial values (Glorot uniform kernels, zero biases), drawn from rng (a jax.random key; None:
        seeded from the OS), in dtype (float32 by default)."""
        validation.module_sizes(d_model, num_heads)
        _refuse_layout(type(self).__name__, num_heads, validation.kv_heads(num_heads, num_kv_heads), rope_theta)
        validation.probability("dropout", dropout)
        layer = _new_layer(d_model, num_heads, bias, dropout, jnp.dtype(jnp.float32 if dtype is None else dtype).name)
        rng = jax.random.key(secrets.randbits(63)) if rng is None else rng
        # keras: a seeded initializer draws the same values for every kernel of one shape, so one seed each
        variables, state = layer.trainable_variables, {}
        for variable, seed in zip(variables, jax.random.randint(rng, (len(variables),), 0, 2**31 - 1), strict=True):
            name = _our_name(variable)
            value = (keras.initializers.GlorotUniform(seed=int(seed))(variable.shape, variable.dtype)
                     if name.endswith(".weight") else variable.value)  # the biases: zeros
            state[name] = _our_layout(name, value)
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
        _refuse_layout(cls.__name__, num_heads, layout.num_kv_heads, rope_theta)
        mha = cls.__new__(cls)
        mha._hold(state, num_heads, dropout, training=True)
        return mha

    def _hold(self, state: dict[str, jax.Array], num_heads: int, dropout: float, *, training: bool) -> None:
        self._state, self.num_heads, self.dropout, self.training = state, num_heads, dropout, training
        self.d_model = state["w_q.weight"].shape[1]
        self.d_k = self.d_model // num_heads

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
        """Args: q (..., L, D), k and v (..., S, D); mask broadcasting to (..., H, L, S), the same for every
        head, 0 / False hides a key; rng a jax.random key (required while dropout is active). Returns out
        (..., L, D) and the weights (..., H, L, S) before dropout, or None."""
        batch = self._checked(q, k, v, mask)
        (L, D), S, H = q.shape[-2:], k.shape[-2], self.num_heads
        dropout_p = self.dropout if self.training else 0.0
        validation.dropout_rng(dropout_p, rng, type(self).__name__)

        # 1) our leading axes (...) flattened into its batch; one mask for every head, head 0's
        B = math.prod(batch)
        q, k, v = (jnp.broadcast_to(x, (*batch, *x.shape[-2:])).reshape(B, *x.shape[-2:]) for x in (q, k, v))
        keep = None if mask is None else jnp.broadcast_to(_kept(mask), (*batch, H, L, S))[..., 0, :, :].reshape(B, L, S)

        # 2) the layer with our parameters as its variables, and our key as its dropout's seed
        layer = _layer(D, H, "w_q.bias" in self._state, self.dropout, self._state["w_q.weight"].dtype.name)
        trainable = [_keras_layout(_our_name(variable), self._state[_our_name(variable)], self.d_k)
                     for variable in layer.trainable_variables]
        seeds = [_seed(rng) if dropout_p and variable.path.endswith(SEED) else variable.value
                 for variable in layer.non_trainable_variables]
        with warnings.catch_warnings():  # keras: S = 1 (a softmax over one key) is a case of the contract
            warnings.filterwarnings("ignore", "You are using a softmax over axis", UserWarning)
            (out, weights), _ = layer.stateless_call(trainable, seeds, q, v, k, attention_mask=keep,
                                                     return_attention_scores=True, training=dropout_p > 0.0)

        # 3) back to our leading axes: out (B, L, D), weights (B, H, L, S)
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

    def _checked(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> tuple[int, ...]:
        """The contract's checks of the inputs (SPEC 7), and a mask the same for every head; returns the
        leading axes (...)."""
        for name, x, letter in (("q", q, "L"), ("k", k, "S"), ("v", v, "S")):
            validation.module_input(name, x.shape, self.d_model, letter)
        validation.same_floating_dtype({"q": _dtype(q), "k": _dtype(k), "v": _dtype(v),
                                    "parameters": _dtype(self._state["w_q.weight"])})
        batch = validation.attention_batch(q.shape, k.shape, v.shape)
        if mask is not None:
            validation.broadcasts_to("mask", mask.shape, (*batch, self.num_heads, q.shape[-2], k.shape[-2]),
                                 "..., H, L, S")
            seen = not isinstance(mask, jax.core.Tracer)  # jax: no values inside jit
            floating = _dtype(mask)[1]
            validation.binary_mask(floating, bool(jnp.all((mask == 0) | (mask == 1))) if floating and seen else None)
            if seen and mask.ndim >= 3 and bool(jnp.any(_kept(mask) != _kept(mask)[..., :1, :, :])):
                raise ValueError(f"keras.layers.MultiHeadAttention takes one mask for every head; mask of shape "
                                 f"{tuple(mask.shape)} differs between its heads (axis -3)")
        return batch


CONFORMANCE = Declaration({
    "mask_per_head": "it takes one attention_mask (B, L, S) for every head",
    "num_kv_heads": "it has one key/value head per query head (grouped heads are keras.layers.GroupQueryAttention)",
    "rope_theta": "it has no rotary position embeddings",
    "attention_linear": "softmax attention only: no argument of keras.layers.MultiHeadAttention chooses another kind "
                        "of head",
    "non_finite": "a row whose visible scores are all -inf (from infinite inputs) gets the zeros of a fully masked "
                  "row (hidden scores are filled with -1e9, their weights then zeroed), not NaN"})
