"""Checks of attention_jax on simulated CPU device meshes, run by tests/test_ring_jax.py in a subprocess, as JAX
must see 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8) from its start.

- ring_attention on 1-D meshes of 2, 4 and 8 devices and on the 2-D mesh ("data", "seq") = (2, 4), the batch
  sharded over "data": out and lse against single-device flash_attention, out against
  scaled_dot_product_attention; gradients (ring_attention's own backward ring, a custom_vjp) against
  single-device jax.grad, with cotangents on out and lse, under jax.jit, sharded like the inputs;
  ring_attention_vjp's pullback under jax.jit against single-device flash_attention_vjp's; the error for a
  length the ring does not divide.
- The head-parallel (Megatron-style) modules on the 2-D mesh ("data", "model") = (2, 4) under jax.jit:
  MultiHeadAttention and TransformerBlock with their projections split over "model" equal the unsharded ones.

float64 throughout; prints one line per check ("name: max relative difference") and the time taken.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import attention_jax as A
from conformance.contract.tolerances import TOLERANCES

RTOL = TOLERANCES["float64"]["reordered"]  # the ring against single-device flash_attention, float64
TILES = dict(block_q=4, block_k=8)  # the tiles within each step; a shard of 2 rows (P = 8, causal) clips them

# name: (shapes of q, k, v, options); B = 2, H = 2 (GQA: 4 query heads, 2 key/value heads), E = 4, Ev = 6
SHAPES = ((2, 2, 32, 4), (2, 2, 32, 4), (2, 2, 32, 6))
CASES = {
    "plain": (SHAPES, {}),
    "causal": (SHAPES, {"is_causal": True}),
    "causal_offset": (SHAPES, {"is_causal": True, "q_offset": 3}),
    "causal_hidden_rows": (SHAPES, {"is_causal": True, "q_offset": -5}),  # queries 0..4 see no key: zeros, -inf
    "sliding_window": (SHAPES, {"is_causal": True, "window": (3, 0)}),
    "window": (SHAPES, {"window": (2, 2)}),
    "softcap": (SHAPES, {"softcap": 0.7, "scale": 2.0}),
    "gqa": (((2, 4, 32, 4), (2, 2, 32, 4), (2, 2, 32, 6)), {"enable_gqa": True, "is_causal": True}),
    "cross": (((2, 2, 16, 4), (2, 2, 48, 4), (2, 2, 48, 6)), {}),  # L != S
}
# the suite's ring operation checks rings of 1 to 4 devices against the oracle with every keyword, gradients
# included (tests/test_ring_suite.py runs it on 4 simulated devices); here the shardings, 8 devices and the mesh
RINGS = {2: ("cross",), 4: ("causal_hidden_rows", "gqa"), 8: ("causal", "sliding_window")}
GRADIENT_CASES = {8: ("window",)}  # 4 devices: check_vjp below; softcap: test_flash


def _inputs(shapes: tuple, seed: int = 0) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape)) for shape in shapes]


def _close(name: str, actual: jax.Array, expected: jax.Array) -> float:
    """Equal to RTOL (relative to expected's largest entry), -inf at the same places; the difference."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert np.array_equal(np.isneginf(actual), np.isneginf(expected)), f"{name}: -inf at other places"
    finite = np.isfinite(expected)
    assert np.all(np.isfinite(actual[finite])), f"{name}: NaN or inf where the reference is finite"
    scale = max(np.max(np.abs(expected[finite]), initial=0.0), 1.0)
    error = float(np.max(np.abs(actual[finite] - expected[finite]), initial=0.0) / scale)
    assert error <= RTOL, f"{name}: relative difference {error:.2e} > {RTOL:.0e}"
    return error


def _sharded(mesh: Mesh, spec: P, *arrays: jax.Array) -> list[jax.Array]:
    return [jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays]


class _Options(NamedTuple):
    """A case's keywords, a record so that jit can take them as a static argument (jax: static arguments are
    hashed); the defaults are ring_attention's and flash_attention's."""

    is_causal: bool = False
    scale: float | None = None
    q_offset: int = 0
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    enable_gqa: bool = False


def _loss(attention: callable, q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array,
          d_lse: jax.Array, options: _Options) -> jax.Array:
    """<out, d_out> + <lse, d_lse> over the rows that see a key: both results carry a cotangent."""
    out, lse = attention(q, k, v, **options._asdict())
    return jnp.sum(out * d_out) + jnp.sum(jnp.where(lse == -jnp.inf, 0.0, lse) * d_lse)


def check_ring(mesh: Mesh, axis: str, spec: P, names: tuple[str, ...], gradients: tuple[str, ...]) -> list[str]:
    """ring_attention on `mesh` against one device, for the named cases (and gradients for `gradients`)."""
    report, label = [], "x".join(str(n) for n in mesh.devices.shape)

    def ring(q, k, v, **options):
        return A.ring_attention(q, k, v, mesh=mesh, axis=axis, **TILES, **options)

    for name in names:
        shapes, options = CASES[name]
        q, k, v = _inputs(shapes)
        expected, expected_lse = A.flash_attention(q, k, v, **TILES, **options)
        reference, _ = A.scaled_dot_product_attention(q, k, v, need_weights=False, **options)
        out, lse = ring(*_sharded(mesh, spec, q, k, v), **options)
        lse_spec = P(*spec[:-1])
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim), f"{name}: {out.sharding}"
        assert lse.sharding.is_equivalent_to(NamedSharding(mesh, lse_spec), lse.ndim), f"{name}: {lse.sharding}"
        errors = (_close(f"{label} {name} out vs flash", out, expected),
                  _close(f"{label} {name} lse vs flash", lse, expected_lse),
                  _close(f"{label} {name} out vs sdpa", out, reference))
        report.append(f"{label} {name}: out {errors[0]:.1e}, lse {errors[1]:.1e}, vs sdpa {errors[2]:.1e}")
    for name in gradients:
        shapes, options = CASES[name]
        q, k, v = _inputs(shapes)
        out, lse = A.flash_attention(q, k, v, **options)
        d_out, d_lse = _inputs((out.shape, lse.shape), seed=1)
        expected = jax.grad(_loss, argnums=(1, 2, 3))(A.flash_attention, q, k, v, d_out, d_lse, _Options(**options))
        inputs = _sharded(mesh, spec, q, k, v)
        grad = jax.jit(jax.grad(_loss, argnums=(1, 2, 3)), static_argnums=(0, 6))
        actual = grad(ring, *inputs, d_out, d_lse, _Options(**options))
        errors = []
        for which, a, e, x in zip("qkv", actual, expected, inputs, strict=True):
            assert a.sharding.is_equivalent_to(x.sharding, x.ndim), f"{name} d{which}: {a.sharding} != {x.sharding}"
            errors.append(f"d{which} {_close(f'{label} {name} d{which}', a, e):.1e}")
        report.append(f"{label} {name} gradients: {', '.join(errors)}, sharded as the inputs")
    return report


def check_vjp(mesh: Mesh, axis: str, spec: P, name: str) -> list[str]:
    """ring_attention_vjp and its pullback called in one jitted function equal flash_attention_vjp on one device."""
    shapes, options = CASES[name]
    q, k, v = _inputs(shapes)
    expected_out, _, flash_pullback = A.flash_attention_vjp(q, k, v, **options)
    d_out = _inputs((expected_out.shape,), seed=1)[0]
    expected = flash_pullback(d_out)[:3]

    @jax.jit
    def ring_vjp(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array) -> tuple:
        out, _, pullback = A.ring_attention_vjp(q, k, v, mesh=mesh, axis=axis, **TILES, **options)
        return out, *pullback(d_out)

    out, *grads = ring_vjp(*_sharded(mesh, spec, q, k, v), d_out)
    label = f"{'x'.join(str(n) for n in mesh.devices.shape)} {name} ring_attention_vjp"
    errors = [f"out {_close(f'{label} out', out, expected_out):.1e}"]
    errors += [f"d{x} {_close(f'{label} d{x}', g, e):.1e}" for x, g, e in zip("qkv", grads, expected, strict=True)]
    return [f"{label} under jit: {', '.join(errors)}"]


def check_errors(mesh: Mesh) -> list[str]:
    """A length the ring does not divide: ValueError naming the length, the divisor and the axis."""
    for shapes, options, expected in ((((1, 30, 4), (1, 32, 4), (1, 32, 4)), {}, ("L = 30", "4", "'seq'")),
                                      (((1, 32, 4), (1, 36, 4), (1, 36, 4)), {"is_causal": True},
                                       ("S = 36", "8", "'seq'", "zig-zag"))):
        try:
            A.ring_attention(*_inputs(shapes), mesh=mesh, axis="seq", **options)
        except ValueError as error:
            assert all(part in str(error) for part in expected), str(error)
        else:
            raise AssertionError(f"no ValueError for {shapes} {options}")
    return ["errors: L = 30 and causal S = 36 on 4 devices raise ValueError"]


# Megatron-style head parallelism: (module attribute, parameter) -> its PartitionSpec; every other leaf
# (the norms, w_o's and ffn.3's biases) is replicated. Column-parallel: w_q, w_k, w_v and ffn.0 (linear1) by
# output rows, so each device holds whole heads; row-parallel: w_o and ffn.3 (linear2) by input columns.
MEGATRON = {
    **{(name, "weight"): P("model", None) for name in ("w_q", "w_k", "w_v", "linear1")},
    **{(name, "bias"): P("model") for name in ("w_q", "w_k", "w_v", "linear1")},
    ("w_o", "weight"): P(None, "model"),
    ("linear2", "weight"): P(None, "model"),
}


def _megatron(module: A.MultiHeadAttention | A.TransformerBlock, mesh: Mesh) -> object:
    """The module with each parameter put on `mesh` with its NamedSharding (MEGATRON, else replicated)."""
    def put(path: tuple, leaf: jax.Array) -> jax.Array:
        names = tuple(key.name for key in path if isinstance(key, jax.tree_util.GetAttrKey))[-2:]
        return jax.device_put(leaf, NamedSharding(mesh, MEGATRON.get(names, P())))
    return jax.tree_util.tree_map_with_path(put, module)


def check_head_parallel(mesh: Mesh) -> list[str]:
    """MultiHeadAttention and TransformerBlock (H = 4, D = 16) with Megatron-sharded parameters under jit
    equal the unsharded modules; the output is sharded over "data", and the compiled program reduces over
    "model" (the row-parallel products' all-reduce)."""
    rng, report = np.random.default_rng(2), []
    x = jnp.asarray(rng.standard_normal((2, 8, 16)))  # (B, L, D)
    modules = {"MultiHeadAttention": A.MultiHeadAttention(16, 4, rng=jax.random.key(0), dtype=jnp.float64),
               "TransformerBlock": A.TransformerBlock(16, 4, 32, rng=jax.random.key(1), dtype=jnp.float64)}
    calls = {"MultiHeadAttention": lambda m, x: m(x, x, x, need_weights=False)[0],
             "TransformerBlock": lambda m, x: m(x, need_weights=False)[0]}
    for name, module in modules.items():
        module = module.eval()
        expected = calls[name](module, x)
        sharded, xs = _megatron(module, mesh), jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        assert sharded.state_dict().keys() == module.state_dict().keys()
        compiled = jax.jit(calls[name]).lower(sharded, xs).compile()
        out = compiled(sharded, xs)
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, None)), 3), out.sharding
        assert "all-reduce" in compiled.as_text(), f"{name}: no all-reduce over the model axis"
        error = _close(f"head-parallel {name}", out, expected)
        report.append(f"head-parallel {name} (data, model) = (2, 4): {error:.1e}, output over 'data'")
    return report


def main() -> None:
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    devices = jax.devices()
    assert len(devices) >= 8, f"8 devices needed (XLA_FLAGS=--xla_force_host_platform_device_count=8); {devices}"
    start, report = time.perf_counter(), []
    for size, names in RINGS.items():
        mesh = Mesh(np.array(devices[:size]), ("seq",))
        report += check_ring(mesh, "seq", P(None, None, "seq", None), names, GRADIENT_CASES.get(size, ()))
    report += check_vjp(Mesh(np.array(devices[:4]), ("seq",)), "seq", P(None, None, "seq", None), "cross")
    grid = Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "seq"))
    report += check_ring(grid, "seq", P("data", None, "seq", None), ("causal", "window"), ("causal",))
    report += check_errors(Mesh(np.array(devices[:4]), ("seq",)))
    report += check_head_parallel(Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "model")))
    print("\n".join(report))
    print(f"time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
