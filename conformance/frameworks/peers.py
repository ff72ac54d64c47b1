"""torch's devices for the suite's ring operation: this process and P - 1 peer processes, joined in one gloo
process group on the loopback interface, so that a module's ring_attention runs on real ranks that exchange
their blocks, as it does under torchrun.

This process is rank 0. For each call it sends every rank the same job (a function, by its qualified name, and
its arguments) with torch.distributed.broadcast_object_list; every rank runs job(rank, *arguments), in inference
mode where rank 0 is in it, and the results (or the exception a rank raised) come back to rank 0 with
gather_object. Every rank runs every job, so the collectives a job makes (a process group of the first P ranks,
the ring's own exchanges) are made by all the ranks they involve, in the same order.

`started` holds the peers for a `with` block (the suite's ring operation) and stops them at its end.
Imports torch only when peers start.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
from collections.abc import Callable, Iterator
from typing import Any

TIMEOUT = datetime.timedelta(seconds=300)  # a collective waits this long for a rank before it raises
LOOPBACK = "lo"  # the interface gloo binds to, unless GLOO_SOCKET_IFNAME names another

_groups: dict[int, Any] = {}  # P -> the process group of ranks 0..P-1 (None: the whole world)


@contextlib.contextmanager
def started(world_size: int) -> Iterator[int]:
    """Start world_size - 1 peer processes (spawned, each with one torch thread) and join them with this process
    in a gloo process group; yields world_size, the devices of the ring. Yields 1 (no peers) for a world of
    one, or where this process already belongs to a process group (under torchrun, say)."""
    import torch.distributed as dist

    if world_size <= 1 or dist.is_initialized():
        yield 1
        return
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = saved or LOOPBACK  # read by gloo whenever it makes a group
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    # port 0: the system picks a free one, so no two runs (parallel tests) can clash
    context = multiprocessing.get_context("spawn")
    peers = [context.Process(target=_serve, args=(rank, world_size, store.port), daemon=True)
             for rank in range(1, world_size)]
    for peer in peers:
        peer.start()
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=world_size, timeout=TIMEOUT)
        try:
            yield world_size
        finally:
            dist.broadcast_object_list([None], src=0)  # no more jobs
            dist.destroy_process_group()
            _groups.clear()
    finally:
        for peer in peers:
            peer.join(timeout=30)
            if peer.is_alive():
                peer.terminate()
        if saved is None:
            del os.environ["GLOO_SOCKET_IFNAME"]


def run(job: Callable[..., Any], *arguments: Any) -> list[Any]:
    """job(rank, *arguments) on every rank (within `started`); the ranks' results, by rank. An exception raised on
    any rank is raised here: rank 0's own where it raised one, else the lowest rank's."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("no peer processes: run torch's ring within conformance.frameworks.peers.started(P)")
    dist.broadcast_object_list([(job, arguments, torch.is_inference_mode_enabled())], src=0)
    own = _outcome(0, job, arguments, torch.is_inference_mode_enabled())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.gather_object(own, gathered, dst=0)
    if own[0] == "error":
        raise own[1]
    for rank, (kind, value) in enumerate(gathered):
        if kind == "error":
            raise RuntimeError(f"rank {rank} of the ring raised {type(value).__name__}: {value}") from value
    return [value for _, value in gathered]


def group(devices: int) -> Any:
    """The process group of ranks 0..P-1 (None, the default group, for the whole world). Every rank must ask for
    the same groups in the same order: new_group is a collective of the whole world."""
    import torch.distributed as dist

    if devices > dist.get_world_size():
        raise RuntimeError(f"ring attention on P = {devices} ranks, but the peers' world has {dist.get_world_size()}")
    if devices not in _groups:
        _groups[devices] = None if devices == dist.get_world_size() else dist.new_group(list(range(devices)))
    return _groups[devices]


def _outcome(rank: int, job: Callable[..., Any], arguments: tuple, inference: bool) -> tuple[str, Any]:
    """("result", job(rank, *arguments)) or ("error", the exception it raised)."""
    import torch

    try:
        with torch.inference_mode(inference):
            return "result", job(rank, *arguments)
    except Exception as error:  # sent to rank 0, which raises it
        return "error", error


def _serve(rank: int, world_size: int, port: int) -> None:
    """A peer: join the group, then run every job rank 0 sends until it sends None."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the peers share the cores with the suite
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    while True:
        request: list[Any] = [None]
        dist.broadcast_object_list(request, src=0)
        if request[0] is None:
            break
        dist.gather_object(_outcome(rank, *request[0]), None, dst=0)
    dist.destroy_process_group()
