"""A model of ring attention on real clusters: the step time against the devices P and the length L, and the
length above which communication hides behind compute.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width.

Each of P devices holds L / P queries and S / P keys and values (S = L). At each of the P steps of the ring
it attends its queries to the key/value block it holds while it sends that block on and receives the next:

    compute per step   t_c = 4 B H (L / P)^2 E / (F u)          the two matmuls, full attention
    bytes per step     m   = 2 B Hkv (L / P) E b                k and v blocks, b bytes a value
    transfer per step  t_m = m / W
    step time          max(t_c, t_m)          (the transfer of the next block overlaps this block's compute)
    attention time     P max(t_c, t_m)

F is the device's dense matmul rate, u the fraction a kernel reaches, W the bandwidth of the ring's slowest
link. Communication hides once t_c >= t_m, that is once

    L >= L* = P (Hkv / H) b F u / (2 W)

and L* grows as P: every block halves when P doubles, while the compute per block falls by four. Causal
attention in the zig-zag layout does half the work per step (t_c / 2), which doubles L*. The figures below are
an H100 SXM's (bf16 dense 989 TFLOP/s, NVLink 4 at 450 GB/s each way within a node of 8, InfiniBand NDR at
400 Gb/s = 50 GB/s per GPU between nodes); a ring over more than one node is bound by InfiniBand.
"""

from __future__ import annotations

from typing import NamedTuple

H100_FLOPS = 989e12  # bf16 dense, per GPU
UTILISATION = 0.5  # the fraction of it a flash kernel reaches
NVLINK = 450e9  # bytes/s each way, within a node
INFINIBAND = 50e9  # bytes/s per GPU between nodes (NDR, 400 Gb/s)
NODE = 8  # GPUs that NVLink joins
DEVICES = (8, 16, 64, 256, 1024)
LENGTHS = (2**14, 2**16, 2**18, 2**20, 2**22)


class Step(NamedTuple):
    P: int
    L: int
    compute_s: float  # t_c
    transfer_s: float  # t_m
    bytes: int  # m, per device per step

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.transfer_s)

    @property
    def hidden(self) -> bool:
        return self.compute_s >= self.transfer_s


def bandwidth(P: int) -> float:
    """The ring's slowest link: NVLink within one node, InfiniBand once the ring leaves it."""
    return NVLINK if P <= NODE else INFINIBAND


def step(P: int, L: int, *, B: int = 1, H: int = 32, Hkv: int = 8, E: int = 128, bytes_per_value: int = 2,
         flops: float = H100_FLOPS, utilisation: float = UTILISATION, causal: bool = False) -> Step:
    """One ring step of full (or causal, zig-zag) attention at P devices and total length L."""
    block = L / P
    compute = 4 * B * H * block * block * E / (flops * utilisation) / (2 if causal else 1)
    sent = int(2 * B * Hkv * block * E * bytes_per_value)
    return Step(P=P, L=L, compute_s=compute, transfer_s=sent / bandwidth(P), bytes=sent)


def crossover(P: int, *, H: int = 32, Hkv: int = 8, bytes_per_value: int = 2, flops: float = H100_FLOPS,
              utilisation: float = UTILISATION, causal: bool = False) -> float:
    """L* = P (Hkv / H) b F u / (2 W): the total length above which the transfer hides behind the compute."""
    return P * (Hkv / H) * bytes_per_value * flops * utilisation / (2 * bandwidth(P)) * (2 if causal else 1)


def table() -> list[Step]:
    return [step(P, L) for P in DEVICES for L in LENGTHS]


def format_table(steps: list[Step]) -> str:
    lines = [f"{'P':>5} {'L':>8} {'compute ms':>11} {'transfer ms':>12} {'MiB/step':>9}  hidden"]
    for s in steps:
        lines.append(f"{s.P:>5} {s.L:>8} {1e3 * s.compute_s:>11.3f} {1e3 * s.transfer_s:>12.3f} "
                     f"{s.bytes / 2**20:>9.1f}  {'yes' if s.hidden else 'no'}")
    lines += ["", "L* (communication hidden above it), full / causal:"]
    lines += [f"  P = {P:>4}: {crossover(P):>9.0f} / {crossover(P, causal=True):>9.0f}" for P in DEVICES]
    return "\n".join(lines)


def plot(path: str) -> None:
    """The step time (max of compute and transfer) against L for each P, the transfer dashed, L* marked."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), layout="constrained")
    axis = figure.subplots()
    lengths = [2**n for n in range(12, 24)]
    for P in DEVICES:
        steps = [step(P, L) for L in lengths if L >= P]
        line, = axis.loglog([s.L for s in steps], [1e3 * s.step_s for s in steps], label=f"P = {P}")
        axis.loglog([s.L for s in steps], [1e3 * s.transfer_s for s in steps], linestyle=":", color=line.get_color())
        axis.axvline(crossover(P), color=line.get_color(), alpha=0.3)
    axis.set(xlabel="total length L (S = L)", ylabel="ms per ring step",
             title="ring attention on H100s (B=1, H=32, Hkv=8, E=128, bf16): step = max(compute, transfer); "
                   "dotted: transfer; vertical: L*")
    axis.title.set_fontsize(8)
    axis.legend(fontsize=8)
    axis.grid(True, alpha=0.3)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    print(format_table(table()))
