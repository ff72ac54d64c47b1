"""`python -m conformance.bench.ring_torch`: the memory and the communication of attention_torch.ring_attention
on P = 1, 2, 4, 8 CPU processes (gloo on the loopback interface), at a fixed whole sequence.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width.

At H = 1, L = S = 16384, E = 64, float32, each process measures
- the growth of its peak resident memory (VmHWM, reset through /proc/self/clear_refs after its inputs are made
  and a warm-up has run) over one forward and backward pass, its results included, which should fall as 1/P:
  each rank holds L/P queries and visiting blocks of S/P keys and values, never the whole sequence, so its
  arrays are a fixed number of shards of (L/P) E 4 bytes. Each process first sets glibc's mmap threshold to
  64 KiB (mallopt): every larger allocation is then its own mapping, returned to the system when freed, so the
  resident memory follows the live tensors. By default glibc raises the threshold as large blocks are freed (up
  to 32 MiB), and after the warm-up the pass's arrays came from heap pages the warm-up had left resident,
  unseen: the growth then measured the heap's churn (16.6, 12.0, 6.7, 9.0 MiB at P = 1, 2, 4, 8, one run);
- the bytes it hands to isend per ring step (batch_isend_irecv counted as it is called), against the model
  2 (S/P) E dtype_size (a k and a v block) in the forward pass (P - 1 steps send); the backward pass sends the
  block P - 1 times and its dk, dv accumulators P times, (4P - 2) / P blocks per step on average.

With --overlap (`python -m conformance.bench.ring_torch --overlap`), at P = 2 and 4, full (not causal), each
rank times the medians over a few repeats, after a warm-up, of
- t_total: the forward pass ring_attention (its shape check, one small all_gather_object, included);
- t_compute: the same forward's compute alone, the ring's schedule of chunk-pair flash calls and merges
  (_schedule, _forward, _merge_into) run on the rank's own block, which stays in place: no exchange;
- t_comm: the communication alone, the forward's P - 1 exchanges of a k and v block (_start_exchange, _finish:
  batch_isend_irecv, waited for), no compute;
- t_wait: within t_total, the time the ring spent waiting for its exchanges after each step's compute (_finish
  timed), the communication the compute left exposed; t_check: the shape check alone (_check_shards, one
  all_gather_object), which t_total holds and neither t_compute nor t_comm does;
and from them the fraction of the communication the ring hides behind its compute,
(t_compute + t_comm - t_total) / t_comm (1: all of it, 0: none; negative or above 1 when the timings' noise
exceeds t_comm), and t_comm / t_total; from the waits, (t_comm - t_wait) / t_comm. A barrier starts every
timed call on all ranks together.

`launch` starts the processes (torch.multiprocessing, spawn) around one TCPStore the caller holds on port 0,
so that no two launches, parallel tests included, can clash on a port.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from attention_np.common.records import FlashOptions

L = 16384  # L = S, the whole sequence
E = 64
MIB = 2**20
PROCESSES = (1, 2, 4, 8)
OVERLAP_PROCESSES = (2, 4)
REPEATS = 5  # timed calls of each kind after the warm-up; their median
MMAP_THRESHOLD = 64 * 1024  # bytes: each allocation from this size up is its own mapping
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def launch(world_size: int, function: Callable, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """function(rank, world_size, *args) on `world_size` fresh processes joined in one gloo process group on
    127.0.0.1; their return values (JSON), by rank. function must be importable by name (a module's)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))  # port 0: the system picks a free one
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_entry, args=(world_size, store.port, timeout_s, directory, function, args), nprocs=world_size)
        results = []
        for rank in range(world_size):
            with open(os.path.join(directory, f"{rank}.json")) as file:
                results.append(json.load(file))
    return results


def _entry(rank: int, world_size: int, port: int, timeout_s: float, directory: str, function: Callable,
           args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the loopback interface
    torch.set_num_threads(1)  # the processes share the cores
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = function(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(directory, f"{rank}.json"), "w") as file:
        json.dump(result, file)


class RingRow(NamedTuple):
    processes: int
    is_causal: bool  # the zig-zag layout: chunks moved at entry and exit, and not counted in the bytes per step
    peak_mib: float  # the largest over the ranks: growth of the peak resident memory, forward and backward
    least_peak_mib: float  # the smallest over the ranks
    shard_mib: float  # one rank's shard of q, (L/P) E 4 bytes: the ring's arrays are a fixed number of them
    peak_total_mib: float  # the largest VmHWM over the ranks, the interpreter and torch included
    bytes_per_step: int  # sent by one rank in one forward step
    model_bytes: int  # 2 (S/P) E dtype_size
    backward_bytes_per_step: int  # sent by one rank in the backward pass over its P steps, per step


def measure(processes: Sequence[int] = PROCESSES, *, length: int = L, width: int = E, block: int = 128,
            causal: Sequence[bool] = (False, True)) -> list[RingRow]:
    """One row per process count and is_causal."""
    rows = []
    for is_causal, P in ((c, P) for c in causal for P in processes):
        results = launch(P, _measure_rank, length, width, block, is_causal, timeout_s=600.0)
        forward = results[0]["forward_bytes"]  # one entry per ring exchange: P - 1 of them
        peaks = [r["peak"] / MIB for r in results]
        rows.append(RingRow(processes=P,
                            is_causal=is_causal,
                            peak_mib=max(peaks),
                            least_peak_mib=min(peaks),
                            shard_mib=(length // P) * width * 4 / MIB,
                            peak_total_mib=max(r["total"] for r in results) / MIB,
                            bytes_per_step=max(forward, default=0),
                            model_bytes=2 * (length // P) * width * 4 if P > 1 else 0,
                            backward_bytes_per_step=sum(results[0]["backward_bytes"]) // P))
    return rows


def _measure_rank(rank: int, world_size: int, length: int, width: int, block: int, is_causal: bool) -> dict:
    """One rank's peak RSS growth over a forward and backward pass, and the bytes it sends per step."""
    if ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:  # before the inputs are made
        raise OSError("glibc's mallopt(M_MMAP_THRESHOLD) failed: the resident memory would miss reused heap pages")
    import torch
    import torch.distributed as dist

    import attention_torch
    from attention_torch import distributed as ring_torch

    sent: list[int] = []
    batch = dist.batch_isend_irecv

    def counted(ops: list) -> list:  # the bytes of every tensor handed to isend, one entry per ring exchange
        if all(op.tag < ring_torch.LAYOUT_TAG for op in ops):  # the layout's moves at entry and exit apart
            sent.append(sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend))
        return batch(ops)

    dist.batch_isend_irecv = counted  # the module looks it up on dist at each call
    shard = length // world_size
    generator = torch.Generator().manual_seed(rank)
    q, k, v, d_out = (torch.randn(1, 1, shard, width, generator=generator) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    tiles = dict(block_q=block, block_k=block, is_causal=is_causal)
    out, lse = attention_torch.ring_attention(q, k, v, **tiles)  # warm-up at full size: the kernels, the
    torch.autograd.grad(out, (q, k, v), d_out)  # transport's buffers and the allocator's heap
    del out, lse
    dist.barrier()
    sent.clear()
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # the peak resident memory from here on
    before = _status("VmRSS:")
    out, lse = attention_torch.ring_attention(q, k, v, **tiles)
    forward_bytes = list(sent)
    sent.clear()
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    peak = _status("VmHWM:") - before
    del out, lse, grads  # alive to here: the results are shards too, part of the peak
    dist.batch_isend_irecv = batch
    return {"peak": peak, "total": _status("VmHWM:"), "forward_bytes": forward_bytes,
            "backward_bytes": sent}


def _status(key: str) -> int:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def format_rows(rows: Sequence[RingRow], length: int = L, width: int = E) -> str:
    """The table: per process count the peak growth, and beside it the 1/P check (P x growth and growth / shard,
    flat where the memory falls as 1/P); the bytes per step against the model."""
    header = ("P", "causal", "peak RSS growth MiB (max over ranks)", "min", "x P", "/ shard (L/P) E 4", "VmHWM MiB",
              "bytes sent / step (fwd)", "model 2 (S/P) E 4", "bytes sent / step (bwd)")
    lines = [header] + [(str(r.processes), str(r.is_causal), f"{r.peak_mib:.1f}", f"{r.least_peak_mib:.1f}",
                         f"{r.peak_mib * r.processes:.1f}", f"{r.peak_mib / r.shard_mib:.1f}",
                         f"{r.peak_total_mib:.0f}", str(r.bytes_per_step), str(r.model_bytes),
                         str(r.backward_bytes_per_step)) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    title = (f"ring_attention, L = S = {length}, E = {width}, H = 1, float32, forward and backward, gloo on the CPU; "
             f"glibc mmap threshold {MMAP_THRESHOLD // 1024} KiB")
    note = "1/P: where the memory per process falls as 1/P, its 'x P' and '/ shard' stay flat as P doubles"
    return "\n".join([title, *("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True))
                               for line in lines), note])


class OverlapRow(NamedTuple):
    processes: int
    rank: int
    total_ms: float  # median over the repeats: the forward pass ring_attention
    compute_ms: float  # the same forward's flash calls and merges, no exchange
    comm_ms: float  # its P - 1 exchanges of the k and v block, no compute
    hidden: float  # (t_compute + t_comm - t_total) / t_comm, not clipped
    comm_share: float  # t_comm / t_total
    wait_ms: float  # median: the forward pass's waits for its exchanges, after each step's compute
    hidden_wait: float  # (t_comm - t_wait) / t_comm: the same fraction from the waits, not clipped
    check_ms: float  # median: ring_attention's shape check alone (one all_gather_object), part of t_total


def measure_overlap(processes: Sequence[int] = OVERLAP_PROCESSES, *, length: int = L, width: int = E,
                    block: int = 128, repeats: int = REPEATS) -> list[OverlapRow]:
    """One row per process count and rank: how much of the ring's communication its compute hides."""
    rows = []
    for P in processes:
        for rank, times in enumerate(launch(P, _overlap_rank, length, width, block, repeats, timeout_s=600.0)):
            total, compute, comm, wait, check = (statistics.median(times[name]) * 1e3
                                                 for name in ("total", "compute", "comm", "wait", "check"))
            rows.append(OverlapRow(processes=P,
                                   rank=rank,
                                   total_ms=total,
                                   compute_ms=compute,
                                   comm_ms=comm,
                                   hidden=(compute + comm - total) / comm,
                                   comm_share=comm / total,
                                   wait_ms=wait,
                                   hidden_wait=(comm - wait) / comm,
                                   check_ms=check))
    return rows


def _overlap_rank(rank: int, world_size: int, length: int, width: int, block: int, repeats: int) -> dict:
    """One rank's seconds per call, per repeat: the forward pass, its compute alone, its communication alone, and
    the time the forward pass spent in its waits for the exchanges (_finish, timed)."""
    import torch
    import torch.distributed as dist

    import attention_torch
    from attention_torch import distributed as ring_torch

    shard = length // world_size
    generator = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 1, shard, width, generator=generator) for _ in range(3))  # (B, H, L/P, E)
    options = FlashOptions(is_causal=False, scale=None, q_offset=0, window=None, key_lengths=None, softcap=None,
                           enable_gqa=False, block_q=block, block_k=block)  # ring_attention's, at its defaults
    layout = ring_torch._layout(world_size, shard, shard, False)
    calls = {"total": lambda: attention_torch.ring_attention(q, k, v, block_q=block, block_k=block),
             "compute": lambda: _ring_compute([q], [k], [v], layout, options, rank),
             "comm": lambda: _ring_exchanges((k, v), world_size),
             "check": lambda: ring_torch._check_shards(q, k, v, None)}  # part of t_total: one all_gather_object
    finish, waited = ring_torch._finish, []

    def timed_finish(exchange: tuple) -> tuple:  # how long each wait for an exchange took
        start = time.perf_counter()
        received = finish(exchange)
        waited.append(time.perf_counter() - start)
        return received

    ring_torch._finish = timed_finish  # the ring looks it up in its module at each step
    times: dict[str, list[float]] = {name: [] for name in (*calls, "wait")}
    with torch.no_grad():
        for repeat in range(repeats + 1):  # repeat 0: the warm-up, not kept
            for name, call in calls.items():
                dist.barrier()
                waited.clear()
                start = time.perf_counter()
                call()
                if repeat:
                    times[name].append(time.perf_counter() - start)
                if repeat and name == "total":
                    times["wait"].append(sum(waited))  # the ring's waits after its steps' compute
    ring_torch._finish = finish
    return times


def _ring_compute(q: list, k: list, v: list, layout: Any, options: FlashOptions, rank: int) -> list:
    """_ring_forward without its exchanges: every step's chunk pairs attend to this rank's own block, in place."""
    import torch

    from attention_torch import distributed as ring_torch

    p = ring_torch._problem(q[0], k[0], v[0], None, None, options)  # the grouping and the working dtype
    out = [torch.zeros((*p.batch, layout.rows_q, p.v.shape[-1]), dtype=p.work) for _ in q]
    lse = [torch.full((*p.batch, layout.rows_q), -math.inf, dtype=p.work) for _ in q]
    n, block = len(k), (*k, *v)
    for pairs in ring_torch._schedule(layout, rank, options):
        for a, b, step in pairs:
            _, _, part = ring_torch._forward(q[a], block[b], block[n + b], None, None, step)
            ring_torch._merge_into(out[a], lse[a], part.out, part.lse)
    return out


def _ring_exchanges(block: tuple, world_size: int) -> tuple:
    """_ring_forward's P - 1 exchanges of the block (k and v) without its compute, into two alternating buffers."""
    from attention_torch import distributed as ring_torch

    spares: list = [None, None]
    for t in range(world_size - 1):
        block = ring_torch._finish(ring_torch._start_exchange(block, spares, t % 2, None, ring_torch.KV_TAG))
    return block


def format_overlap(rows: Sequence[OverlapRow], length: int = L, width: int = E, block: int = 128,
                   repeats: int = REPEATS) -> str:
    """The table: per process count and rank the three medians, the hidden fraction and the communication's share."""
    header = ("P", "rank", "t_total ms", "t_compute ms", "t_comm ms", "hidden (c + m - t) / m", "t_comm / t_total",
              "t_wait ms", "hidden (m - w) / m", "t_check ms")
    lines = [header] + [(str(r.processes), str(r.rank), f"{r.total_ms:.1f}", f"{r.compute_ms:.1f}",
                         f"{r.comm_ms:.2f}", f"{r.hidden:.2f}", f"{r.comm_share:.4f}", f"{r.wait_ms:.2f}",
                         f"{r.hidden_wait:.2f}", f"{r.check_ms:.2f}") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    title = (f"ring_attention forward, L = S = {length}, E = {width}, H = 1, float32, block_q = block_k = {block}, "
             f"gloo on the CPU, one torch thread per process; medians of {repeats} after a warm-up")
    note = ("hidden: 1 when the compute hides all the communication, 0 when none; not clipped (noise can exceed "
            "t_comm); t_wait: the forward pass's time in its waits for the exchanges, after each step's compute; "
            "t_check: its shape check (all_gather_object) alone, inside t_total")
    return "\n".join([title, *("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True))
                               for line in lines), note])


if __name__ == "__main__":
    from conformance.bench import ring_torch  # torch.multiprocessing pickles functions by their module's name

    if sys.argv[1:] == ["--overlap"]:
        print(ring_torch.format_overlap(ring_torch.measure_overlap()))
    elif sys.argv[1:]:
        sys.exit("usage: python -m conformance.bench.ring_torch [--overlap]")
    else:
        print(ring_torch.format_rows(ring_torch.measure()))
