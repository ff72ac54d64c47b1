"""Ring attention on the CPU: `torchrun --nproc-per-node 4 examples/ring_attention_torch.py`.

Every rank builds the same whole sequence from one seed, keeps its contiguous shard, runs causal ring attention
and its gradient, and gathers the shards; rank 0 prints the largest differences from single-process
flash_attention on the whole sequence (float64: rounding, about 1e-15).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import attention_torch

B, H, L, E = 2, 4, 64, 16  # L = S, split into P shards of L/P


def main() -> None:
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(B, H, L, E, generator=generator, dtype=torch.float64) for _ in range(4))
    rows = slice(rank * L // P, (rank + 1) * L // P)  # this rank's positions

    # 1) this rank's shard, through the ring
    shards = [x[..., rows, :].clone().requires_grad_() for x in (q, k, v)]
    out, lse = attention_torch.ring_attention(*shards, is_causal=True, block_q=8, block_k=8)
    grads = torch.autograd.grad(out, shards, d_out[..., rows, :])

    # 2) gather the shards in rank order: (B, H, L/P, *) from each rank -> (B, H, L, *)
    gathered = [_gather(x) for x in (out, lse[..., None], *grads)]

    # 3) rank 0: against single-process flash_attention on the whole sequence
    if rank == 0:
        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        expected_out, expected_lse = attention_torch.flash_attention(*whole, is_causal=True)
        expected = [expected_out, expected_lse[..., None], *torch.autograd.grad(expected_out, whole, d_out)]
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), gathered, expected, strict=True):
            print(f"P={P} {name}: max |ring - flash_attention| = {(got - want).abs().max().item():.2e}")
    dist.destroy_process_group()


def _gather(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.detach().contiguous())
    return torch.cat(parts, dim=-2)


if __name__ == "__main__":
    main()
