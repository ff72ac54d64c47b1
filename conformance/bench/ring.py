"""Ring attention's memory per device and its communication, from XLA's compiled plan (compiled, not run).

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width.

At B = 1, H = 1, L = S = 65536, E = 64, float32, jitted attention_jax.ring_attention on a 1-D mesh of P = 1, 2,
4, 8 simulated CPU devices, causal (zig-zag) and not:
- memory_rows(): compile().memory_analysis() per device: the temporaries (temp_size_in_bytes) and the
  arguments and outputs (q, k, v shards in; out, lse shards out), which should fall as about 1 / P; for the
  call "forward" (out, lse) and "gradient" (jax.grad of sum(out) in q, k, v; its outputs dq, dk, dv).
- communication_rows(): the collective-permutes of the compiled HLO (compiled.as_text()), each with its
  shape's bytes: the ring's hops (source_target_pairs d -> d + 1, one for k and one for v per hop, P - 1
  hops) against the model 2 x block x E x 4 bytes per hop (block = S / P keys), and the zig-zag layout's
  permutes at entry (q, k, v) and exit (out, lse).
JAX fixes its device count when it starts, so without 8 devices in this process the rows come from a fresh
one with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from typing import Any, NamedTuple

L = 65536  # L = S: the shards dominate each device's memory (at 8192 a fixed tile overhead still shows)
E = 64
DEVICES = (1, 2, 4, 8)
CALLS = ("forward", "gradient")  # memory_rows: ring_attention itself, and jax.grad of sum(out) through it
MIB = 2**20
FLAG = "--xla_force_host_platform_device_count=8"
_PERMUTE = re.compile(r"= (\w+)\[([\d,]*)\]\S* collective-permute\(.*"  # dtype, shape, pairs, op_name
                      r"source_target_pairs=\{([\d,{}]*)\}.*op_name=\"([^\"]*)\"")
_BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4}


class MemoryRow(NamedTuple):
    devices: int  # P
    is_causal: bool
    call: str  # "forward" (out, lse) or "gradient" (dq, dk, dv of sum(out))
    temp_mib: float  # per device
    argument_mib: float
    output_mib: float

    @property
    def temp_times_devices(self) -> float:  # constant when the temporaries fall as 1 / P
        return self.temp_mib * self.devices


class CommunicationRow(NamedTuple):
    devices: int
    is_causal: bool
    role: str  # "ring hop" (k or v to the next device) or "layout" (the zig-zag permutes)
    count: int  # collective-permutes of this role and size in the HLO; the hops' loop body runs P - 1 times
    bytes_each: int
    model_bytes_per_hop: int  # 2 x block x E x 4, block = S / P


def memory_rows() -> list[MemoryRow]:
    return [MemoryRow(*row) for row in _rows("memory")]


def communication_rows() -> list[CommunicationRow]:
    return [CommunicationRow(*row) for row in _rows("communication")]


def _rows(kind: str) -> list[list[Any]]:
    """The rows measured here with 8 devices, else in a fresh process that has them."""
    if "jax" in sys.modules and len(sys.modules["jax"].devices()) >= max(DEVICES):
        return _MEASURES[kind]()
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()}
    done = subprocess.run([sys.executable, "-m", "conformance.bench.ring", kind], capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"conformance.bench.ring {kind} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def _compiled(P: int, is_causal: bool, call: str = "forward") -> Any:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as Spec

    import attention_jax as A

    mesh = Mesh(np.array(jax.devices()[:P]), ("seq",))
    x = jax.ShapeDtypeStruct((1, 1, L, E), jnp.float32, sharding=NamedSharding(mesh, Spec(None, None, "seq", None)))

    def attention(q: Any, k: Any, v: Any) -> Any:
        return A.ring_attention(q, k, v, mesh=mesh, axis="seq", is_causal=is_causal)

    calls = {"forward": attention,
             "gradient": jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v)[0]), argnums=(0, 1, 2))}
    return jax.jit(calls[call]).lower(x, x, x).compile()


def _memory() -> list[list[Any]]:
    rows = []
    for call in CALLS:
        for P in DEVICES:
            for is_causal in (False, True):
                stats = _compiled(P, is_causal, call).memory_analysis()
                rows.append([P, is_causal, call, stats.temp_size_in_bytes / MIB, stats.argument_size_in_bytes / MIB,
                             stats.output_size_in_bytes / MIB])
    return rows


def _communication() -> list[list[Any]]:
    rows = []
    for P in DEVICES[1:]:
        ring = ",".join(f"{{{d},{(d + 1) % P}}}" for d in range(P))  # the hop d -> d + 1
        for is_causal in (False, True):
            found: dict[tuple[str, int], int] = {}
            for dtype, dims, pairs, op_name in _PERMUTE.findall(_compiled(P, is_causal).as_text()):
                size = math.prod(int(n) for n in dims.split(",") if n) * _BYTES[dtype]
                hop = pairs.replace(" ", "") == ring and "/while/body/" in op_name  # in the loop over the steps
                role = "ring hop" if hop else "layout"
                found[role, size] = found.get((role, size), 0) + 1
            rows += [[P, is_causal, role, count, size, 2 * (L // P) * E * 4]
                     for (role, size), count in sorted(found.items())]
    return rows


_MEASURES = {"memory": _memory, "communication": _communication}


def format_tables(memory: list[MemoryRow], communication: list[CommunicationRow]) -> str:
    lines = [f"ring_attention, L = S = {L}, E = {E}, H = 1, float32, per device (MiB)",
             f"{'call':>8} {'P':>2} {'causal':>6} {'temp':>8} {'temp x P':>9} {'args':>7} {'outputs':>8}"]
    lines += [f"{r.call:>8} {r.devices:>2} {r.is_causal!s:>6} {r.temp_mib:>8.2f} {r.temp_times_devices:>9.2f} "
              f"{r.argument_mib:>7.2f} {r.output_mib:>8.2f}" for r in memory]
    lines += ["", "collective-permutes in the compiled HLO (bytes)",
              f"{'P':>2} {'causal':>6} {'role':>9} {'count':>5} {'bytes each':>10} {'model per hop':>13}"]
    lines += [f"{r.devices:>2} {r.is_causal!s:>6} {r.role:>9} {r.count:>5} {r.bytes_each:>10} "
              f"{r.model_bytes_per_hop if r.role == 'ring hop' else '':>13}" for r in communication]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv:  # the subprocess: one kind of rows, as JSON on the last line
        print(json.dumps(_MEASURES[argv[0]]()))
        return
    print(format_tables(memory_rows(), communication_rows()))


if __name__ == "__main__":
    main(sys.argv[1:])
