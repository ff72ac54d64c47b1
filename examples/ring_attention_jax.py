"""Ring attention over every device JAX sees: the GPUs of a machine, or simulated CPU devices.

    python examples/ring_attention_jax.py                      # the devices JAX finds (a GPU machine: its GPUs)
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/ring_attention_jax.py   # 8 on the CPU

The sequence is sharded over a one-axis mesh of all devices; ring_attention (causal, the zig-zag layout) and its
gradient are compared with flash_attention on one device, and timed.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import attention_jax as M


def main() -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("seq",))
    L = 1024 * 2 * len(devices)  # the zig-zag layout cuts the sequence into 2P chunks
    q, k, v = (jax.random.normal(jax.random.key(seed), (1, 8, L, 64), jnp.float32) for seed in range(3))
    sharded = [jax.device_put(x, NamedSharding(mesh, P(None, None, "seq", None))) for x in (q, k, v)]

    ring = jax.jit(lambda q, k, v: M.ring_attention(q, k, v, mesh=mesh, axis="seq", is_causal=True)[0])
    one = jax.jit(lambda q, k, v: M.flash_attention(q, k, v, is_causal=True)[0])
    grad_ring = jax.jit(jax.grad(lambda q, k, v: ring(q, k, v).sum(), argnums=(0, 1, 2)))
    grad_one = jax.jit(jax.grad(lambda q, k, v: one(q, k, v).sum(), argnums=(0, 1, 2)))

    out, expected = ring(*sharded), one(q, k, v)
    error = float(jnp.max(jnp.abs(out - expected)) / jnp.max(jnp.abs(expected)))
    grad_error = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                     for a, b in zip(grad_ring(*sharded), grad_one(q, k, v), strict=True))
    start = time.perf_counter()
    jax.block_until_ready(ring(*sharded))
    seconds = time.perf_counter() - start
    print(f"{len(devices)} x {devices[0].platform}, L = S = {L}, H = 8, E = 64, causal, float32")
    print(f"ring_attention vs one device's flash_attention: out {error:.1e}, gradients {grad_error:.1e} (relative)")
    print(f"ring_attention: {1e3 * seconds:.1f} ms, out sharded as {out.sharding.spec}")
    assert error < 1e-4 and grad_error < 1e-4


if __name__ == "__main__":
    main()
