"""Multi-head latent attention (MLA, DeepSeek-V2 and V3), as a PyTorch nn.Module.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

MLA's own widths: Dq = q_lora_rank (the queries' latent), Dc = kv_lora_rank (the keys' and values' latent),
En = qk_nope_head_dim and Er = qk_rope_head_dim (a head's query/key width E = En + Er), Ev = v_head_dim.

DeepSeek-V2 (arXiv:2405.04434, section 2.1), rows of the inputs h (..., L, D), in the paper's names and the
parameters' (DeepSeek-V3's checkpoints):

    c_Q = RMSNorm(h W_DQ^T)                        (..., L, Dq)             q_a_proj, q_a_layernorm
    [q_C,h, q_R,h] = (c_Q W_UQ^T)_h                (..., H, L, En + Er)     q_b_proj (q_proj: h W_Q^T, no c_Q)
    [c_KV, k_R] = h W_DKV^T                        (..., L, Dc + Er)        kv_a_proj_with_mqa
    c_KV = RMSNorm(c_KV)                           (..., L, Dc)             kv_a_layernorm
    q_R, k_R = RoPE(q_R), RoPE(k_R)                k_R one key for all the heads (interleaved pairs)
    [k_C,h, v_C,h] = (c_KV W_UKV^T)_h              (..., H, S, En + Ev)     kv_b_proj
    o_h = softmax([q_C,h, q_R,h] [k_C,h, k_R]^T / sqrt(En + Er)) v_C,h   (..., H, L, Ev)
    out = [o_1, ..., o_H] W_O^T                    (..., L, D)              o_proj

A cache holds c_KV and k_R alone, Dc + Er numbers a position where multi-head attention holds 2 H E. A step
reads it in one of two forms. Expanded: up-project the cached latents through kv_b_proj (W_UKV) and attend as
above. Absorbed: W_UKV's rows per head are W_UK,h (En, Dc) and W_UV,h (Ev, Dc), so

    q_C,h k_C,h^T = q_C,h (c_KV W_UK,h^T)^T = (q_C,h W_UK,h) c_KV^T        W_UK folded into the query
    o_h = P_h (c_KV W_UV,h^T) = (P_h c_KV) W_UV,h^T                        W_UV folded into the output

and attention runs on the cache itself: multi-query attention of the queries [q_C,h W_UK,h, q_R,h] (Dc + Er)
against one key head [c_KV, k_R] and one value head c_KV, with the scale of the heads' own width, 1 / sqrt(En + Er).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from attention_np.common import validation

from .arrays import asarray
from .functional import Rng, _dtypes, _rngs, _rope_table, _turned, scaled_dot_product_attention
from .gradients import _grad, _leaf, _leaves, _recording
from .modules import Linear, RMSNorm, _feed_forward, _load

EPS = 1e-6  # DeepSeek's RMSNorm eps: DeepseekV3RMSNorm's default, which q_a_layernorm and kv_a_layernorm keep
NORMS = ("q_a_layernorm", "kv_a_layernorm")  # the children that are RMSNorms; the others are Linears


class LatentCache(NamedTuple):
    """The latents of the positions seen so far: c_kv (..., capacity, Dc), after kv_a_layernorm, and k_rope
    (..., capacity, Er), after RoPE, filled at positions 0 .. length - 1. torch: preallocated tensors that extend
    writes into in place and returns with the longer length."""

    c_kv: torch.Tensor
    k_rope: torch.Tensor
    length: int


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3): the keys and values of H heads up-projected from one
    latent c_KV of Dc per position, and a RoPE part of the key shared by the heads; no biases, no dropout."""

    # torch: the submodules registered in this order, DeepSeek-V3's; those a form lacks are None, as there
    _children = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                 "kv_b_proj", "o_proj")

    def __init__(self, d_model: int, num_heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope_theta: float = 10000.0,
                 rng: Rng = None, dtype: torch.dtype | None = None) -> None:
        """DeepSeek-V3's attention with these sizes, its parameters drawn afresh.

        Args:
            d_model: D, the inputs' and outputs' width.
            num_heads: H.
            q_lora_rank: Dq, the queries' latent (q_a_proj, q_a_layernorm, q_b_proj); None: DeepSeek-V2-Lite's
                q_proj (H (En + Er), D) instead.
            kv_lora_rank: Dc, the keys' and values' latent: what the cache holds per position, with k_rope.
            qk_nope_head_dim: En, each head's query/key entries without position.
            qk_rope_head_dim: Er, even, each head's query entries turned by RoPE, and the one key part of all heads.
            v_head_dim: Ev, each head's value width.
            rope_theta: RoPE's base (interleaved pairs, as DeepSeek's).
            rng: randomness for the initial parameters, drawn as nn.Linear draws them (RMSNorm weights ones).
            dtype: the parameters' dtype (float32 by default).
        """
        super().__init__()
        sizes = validation.latent_sizes(d_model, num_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                                        qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                                        v_head_dim=v_head_dim)
        rope_theta = validation.latent_theta(rope_theta)
        shapes = {name.removesuffix(".weight"): shape for name, shape in validation.latent_state_shapes(sizes).items()}
        linears = [name for name in shapes if name not in NORMS]
        parts = {name: Linear.initialized(shapes[name][1], shapes[name][0], rng, dtype, bias=False)
                 for name, rng in zip(linears, _rngs(rng, len(linears)), strict=True)}
        parts |= {name: RMSNorm.initialized(shapes[name][0], EPS, dtype) for name in NORMS if name in shapes}
        for name in self._children:
            setattr(self, name, parts.get(name))
        self.num_heads, self.qk_nope_head_dim = sizes.num_heads, sizes.qk_nope_head_dim
        self.qk_rope_head_dim, self.v_head_dim, self.rope_theta = sizes.qk_rope_head_dim, sizes.v_head_dim, rope_theta

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, num_heads: int,
                        rope_theta: float = 10000.0) -> MultiHeadLatentAttention:
        """A module holding `state` (NumPy or native arrays; computes in their dtype), its sizes read off the
        shapes; DeepSeek-V3's names (q_proj for a state without q_a_proj)."""
        state = {name: asarray(value) for name, value in state.items()}
        shapes = {name: value.shape for name, value in state.items()}
        sizes = validation.latent_layout(shapes, num_heads)
        rope_theta = validation.latent_theta(rope_theta)
        validation.state(cls.__name__, shapes, validation.latent_state_shapes(sizes))
        validation.same_floating_dtype(_dtypes(**state), f"{cls.__name__}.from_state_dict: ")
        with torch.device("meta"):  # torch: no memory or random draws for values about to be replaced
            module = cls(**sizes._asdict(), rope_theta=rope_theta)
        return _load(module, state)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, need_weights: bool = True,
                 rng: Rng = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MLA(h) = Concat(o_1, ..., o_H) W_O^T, o_h = softmax(q_h k_h^T / sqrt(En + Er)) v_C,h, q_h = (q_C,h, q_R,h)
        and k_h = (k_C,h, k_R) joined, position i at i (the module docstring's equations).

        Args:
            x: inputs (..., L, D).
            mask: broadcasts to (..., H, L, L); an entry equal to 0 / False hides that key (causal_mask(L, L)
                for a decoder).
            need_weights: return the weights; with False the second result is None.
            rng: unused: MLA has no dropout (DeepSeek's attention_dropout is 0); taken as MultiHeadAttention does.

        Returns:
            out (..., L, D) and weights (..., H, L, L) per head (or None).
        """
        self._check_input(x, mask)
        positions = torch.arange(x.shape[-2], device=x.device)  # (L,): position i at i
        q_nope, q_rope = self._queries(x, positions)  # (..., H, L, En), (..., H, L, Er)
        c_kv, k_rope = self._latents(x, positions)  # (..., S, Dc), (..., S, Er), S = L
        out, weights = self._expanded(q_nope, q_rope, c_kv, k_rope, mask, need_weights=need_weights)
        return self.o_proj(self._merge_heads(out)), weights  # (..., H, L, Ev) -> (..., L, H Ev) -> (..., L, D)

    def vjp(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, Callable]:
        """out, weights and pullback(d_out) -> (dx, {state-dict name: gradient}): __call__'s steps in reverse
        (torch: autograd through forward, the parameters as new leaves)."""
        self._check_input(x, mask)
        with _recording():
            x_, params = _leaf(x), _leaves(self)
            out, weights = torch.func.functional_call(self, params, (x_, mask))

        def pullback(d_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
            dx, *grads = _grad(out, [x_, *params.values()], d_out)
            return dx, dict(zip(params, grads, strict=True))

        return out.detach(), weights.detach(), pullback

    def init_cache(self, batch_shape: tuple[int, ...], capacity: int, *,
                   dtype: torch.dtype | None = None) -> LatentCache:
        """An empty latent cache for inputs with leading axes `batch_shape` and up to `capacity` positions:
        c_kv (*batch_shape, capacity, Dc) and k_rope (*batch_shape, capacity, Er) of zeros, length 0, in `dtype`
        (the parameters' by default)."""
        batch_shape = validation.cache_size(batch_shape, capacity)
        dtype = self.o_proj.weight.dtype if dtype is None else dtype
        device, Dc = self.o_proj.weight.device, self.kv_a_layernorm.weight.shape[0]
        return LatentCache(c_kv=torch.zeros((*batch_shape, capacity, Dc), dtype=dtype, device=device),
                           k_rope=torch.zeros((*batch_shape, capacity, self.qk_rope_head_dim), dtype=dtype,
                                              device=device), length=0)

    def extend(self, x: torch.Tensor, cache: LatentCache, mask: torch.Tensor | None = None, *, absorbed: bool = False,
               need_weights: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, LatentCache]:
        """Attention of L new positions over the cache and themselves, causal: the new rows stand at positions
        length .. length + L - 1, their latents join the cache there, and each query sees the positions up to its
        own. Equal to __call__ with causal_mask over the whole sequence, in either form.

        Args:
            x: the new positions' inputs (..., L, D).
            cache: from init_cache, or the cache the last extend returned.
            mask: broadcasts to (..., H, L, capacity); an entry equal to 0 / False hides that key too.
            absorbed: False: the cached latents up-projected through kv_b_proj (the keys and values of every
                head); True: W_UK folded into the queries and W_UV into the output, attention as multi-query
                attention over the latents themselves (key Dc + Er, value Dc).
            need_weights: return the weights; with False the second result is None.

        Returns:
            out (..., L, D), weights (..., H, L, capacity) (zero past the new length, or None), and the cache
            holding length + L positions.
        """
        L = self._check_extend(x, cache, mask)
        start, end = cache.length, cache.length + L
        positions = torch.arange(start, end, device=x.device)  # (L,)

        # 1) the new rows' queries and latents; the latents join the cache at start .. end - 1, in place
        q_nope, q_rope = self._queries(x, positions)  # (..., H, L, En), (..., H, L, Er)
        cache.c_kv[..., start:end, :], cache.k_rope[..., start:end, :] = self._latents(x, positions)

        # 2) attend over the filled positions, causal from start, in the form asked for
        if mask is not None and mask.shape[-1] > 1:
            mask = mask[..., :end]  # (..., H, L, capacity) -> (..., H, L, end)
        attend = self._absorbed if absorbed else self._expanded
        out, weights = attend(q_nope, q_rope, cache.c_kv[..., :end, :], cache.k_rope[..., :end, :], mask,
                              is_causal=True, q_offset=start, need_weights=need_weights)  # (..., H, L, Ev)
        if need_weights:  # the positions not yet filled get 0
            weights = torch.cat([weights, weights.new_zeros((*weights.shape[:-1], cache.c_kv.shape[-2] - end))],
                                dim=-1)  # (..., H, L, capacity)

        # 3) concatenate the heads and mix them
        out = self.o_proj(self._merge_heads(out))  # (..., H, L, Ev) -> (..., L, D)
        return out, weights, LatentCache(cache.c_kv, cache.k_rope, length=end)

    @property
    def scale(self) -> float:
        """1 / sqrt(En + Er): a head's query/key width, in both forms (not the absorbed query's Dc + Er)."""
        return 1 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)

    def _queries(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_C (..., H, L, En) and q_R (..., H, L, Er), turned at `positions` (L,)."""
        if self.q_proj is None:  # c_Q = RMSNorm(h W_DQ^T), q = c_Q W_UQ^T
            c_q = self.q_a_layernorm(self.q_a_proj(x))  # (..., L, D) -> (..., L, Dq)
            q = self.q_b_proj(c_q)  # (..., L, Dq) -> (..., L, H E)
        else:  # V2-Lite: q = h W_Q^T
            q = self.q_proj(x)  # (..., L, D) -> (..., L, H E)
        q = self._split_heads(q)  # (..., L, H E) -> (..., H, L, E)
        En = self.qk_nope_head_dim
        return q[..., :En], self._rope(q[..., En:], positions)  # (..., H, L, En), (..., H, L, Er)

    def _latents(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_KV (..., L, Dc) after kv_a_layernorm and k_R (..., L, Er) after RoPE at `positions` (L,): what the
        cache holds."""
        kv = self.kv_a_proj_with_mqa(x)  # [c_KV, k_R] = h W_DKV^T: (..., L, D) -> (..., L, Dc + Er)
        Dc = self.kv_a_layernorm.weight.shape[0]
        c_kv = self.kv_a_layernorm(kv[..., :Dc])  # (..., L, Dc)
        return c_kv, self._rope(kv[..., Dc:], positions)  # (..., L, Dc), (..., L, Er)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., L, Er) turned by RoPE at positions (L,), DeepSeek's interleaved pairs (x_2j, x_2j+1)."""
        work = torch.promote_types(x.dtype, torch.float32)
        cos, sin = _rope_table(positions, x.shape[-1], self.rope_theta, work, True)  # (L, Er) each
        return _turned(x, cos, sin, True)

    def _expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
                  mask: torch.Tensor | None, **rules: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The heads' attention with the keys and values up-projected from the latents: o (..., H, L, Ev) and
        the weights (..., H, L, S); `rules`: scaled_dot_product_attention's keywords (causal, q_offset)."""
        En, H = self.qk_nope_head_dim, self.num_heads
        kv = self._split_heads(self.kv_b_proj(c_kv))  # [k_C, v_C] = c_KV W_UKV^T: (..., S, Dc) -> (..., H, S, En + Ev)
        k_nope, v = kv[..., :En], kv[..., En:]  # (..., H, S, En), (..., H, S, Ev)
        k_rope = k_rope[..., None, :, :].expand(*k_rope.shape[:-2], H, *k_rope.shape[-2:])  # one k_R
        q = torch.cat([q_nope, q_rope], dim=-1)  # q_h = [q_C,h, q_R,h]: (..., H, L, E)
        k = torch.cat([k_nope, k_rope], dim=-1)  # k_h = [k_C,h, k_R]: (..., H, S, E)
        return scaled_dot_product_attention(q, k, v, mask, scale=self.scale, **rules)  # (..., H, L, Ev)

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
                  mask: torch.Tensor | None, **rules: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The same heads' attention on the latents themselves, W_UK folded into the query and W_UV into the
        output: multi-query attention, one key head [c_KV, k_R] (Dc + Er) and one value head c_KV (Dc), the key's
        first Dc columns."""
        En, Dc = self.qk_nope_head_dim, c_kv.shape[-1]
        w_ukv = self.kv_b_proj.weight.reshape(self.num_heads, -1, Dc)  # (H (En + Ev), Dc) -> (H, En + Ev, Dc)
        w_uk, w_uv = w_ukv[:, :En, :], w_ukv[:, En:, :]  # W_UK,h (H, En, Dc), W_UV,h (H, Ev, Dc)
        q_latent = q_nope @ w_uk  # q_C,h W_UK,h: (..., H, L, En) x (H, En, Dc) -> (..., H, L, Dc)
        q = torch.cat([q_latent, q_rope], dim=-1)  # (..., H, L, Dc + Er)
        k = torch.cat([c_kv, k_rope], dim=-1)[..., None, :, :]  # one key head: (..., 1, S, Dc + Er)
        # the key serves as the value: P_h [c_KV, k_R] holds P_h c_KV in its first Dc columns; one width for both
        # keeps torch's CPU kernel on its fast path (with Dc != Dc + Er it takes its general one, 20x slower)
        o_joined, weights = scaled_dot_product_attention(q, k, k, mask, scale=self.scale, enable_gqa=True,
                                                         **rules)  # P_h [c_KV, k_R]: (..., H, L, Dc + Er)
        o_latent = o_joined[..., :Dc]  # P_h c_KV: (..., H, L, Dc)
        return o_latent @ w_uv.transpose(-1, -2), weights  # (..., H, L, Dc) x (H, Dc, Ev) -> (..., H, L, Ev)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., L, H W) -> (..., H, L, W)."""
        *lead, length, width = x.shape
        return x.reshape(*lead, length, self.num_heads, width // self.num_heads).transpose(-2, -3)

    def _merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        *lead, heads, length, width = x.shape
        return x.transpose(-2, -3).reshape(*lead, length, heads * width)  # (..., H, L, Ev) -> (..., L, H Ev)

    def _check_input(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        validation.module_input("x", x.shape, self.o_proj.weight.shape[0], "L")
        validation.same_floating_dtype(_dtypes(x=x, parameters=self.o_proj.weight))
        if mask is not None:
            L = x.shape[-2]
            validation.broadcasts_to("mask", mask.shape, (*x.shape[:-2], self.num_heads, L, L), "..., H, L, L")

    def _check_extend(self, x: torch.Tensor, cache: LatentCache, mask: torch.Tensor | None) -> int:
        """The checks of extend: x (..., L, D) against the cache and the parameters; returns L."""
        L = validation.latent_cache_input(x.shape, cache.c_kv.shape, self.o_proj.weight.shape[0])
        validation.same_floating_dtype(_dtypes(x=x, cache=cache.c_kv, parameters=self.o_proj.weight))
        capacity = cache.c_kv.shape[-2]
        if mask is not None:
            validation.broadcasts_to("mask", mask.shape, (*x.shape[:-2], self.num_heads, L, capacity),
                                     "..., H, L, capacity")
        validation.cache_room(capacity, cache.length, L)
        return L


class LatentTransformerBlock(nn.Module):
    """DeepSeek-V3's decoder layer with a dense MLP (DeepseekV3DecoderLayer below first_k_dense_replace; the MoE
    layers are out of scope): pre-norm RMSNorms, multi-head latent attention and a SwiGLU feed-forward network, no
    biases, no dropout. State-dict names: attn.* (MultiHeadLatentAttention's), norm1, norm2 (input_layernorm,
    post_attention_layernorm), ffn.w_gate, ffn.w_up, ffn.w_down (mlp.gate_proj, up_proj, down_proj)."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope_theta: float = 10000.0,
                 eps: float = EPS, rng: Rng = None, dtype: torch.dtype | None = None) -> None:
        """The layer with these sizes, its parameters drawn afresh.

        Args:
            d_model: D, the inputs' and outputs' width.
            num_heads: H.
            d_ff: F, the feed-forward network's hidden width (DeepSeek-V3's intermediate_size).
            q_lora_rank: Dq, or None for q_proj (MultiHeadLatentAttention's).
            kv_lora_rank: Dc, what the cache holds per position, with k_rope.
            qk_nope_head_dim: En.
            qk_rope_head_dim: Er, even.
            v_head_dim: Ev.
            rope_theta: RoPE's base (interleaved pairs).
            eps: inside norm1's and norm2's square root (DeepSeek-V3's rms_norm_eps, 1e-6).
            rng: randomness for the initial parameters, drawn as nn.Linear draws them (RMSNorm weights ones).
            dtype: the parameters' dtype (float32 by default).
        """
        super().__init__()
        d_ff = validation.latent_d_ff(d_ff)
        rngs = _rngs(rng, 4)
        attn = MultiHeadLatentAttention(d_model, num_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                                        qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                                        v_head_dim=v_head_dim, rope_theta=rope_theta, rng=rngs[0], dtype=dtype)
        norm1, norm2 = (RMSNorm.initialized(d_model, eps, dtype) for _ in range(2))
        ffn = _feed_forward(d_model, d_ff, "swiglu", 0.0, False, rngs[1:], dtype)
        self.attn, self.norm1, self.norm2, self.ffn = attn, norm1, norm2, ffn  # torch: registered in state-dict order

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, num_heads: int, rope_theta: float = 10000.0,
                        eps: float = EPS) -> LatentTransformerBlock:
        """A layer holding `state` (NumPy or native arrays; computes in their dtype), its sizes read off the
        shapes."""
        state = {name: asarray(value) for name, value in state.items()}
        shapes = {name: value.shape for name, value in state.items()}
        sizes, d_ff = validation.latent_block_layout(shapes, num_heads)
        validation.state(cls.__name__, shapes, validation.latent_block_state_shapes(sizes, d_ff))
        validation.same_floating_dtype(_dtypes(**state), f"{cls.__name__}.from_state_dict: ")
        with torch.device("meta"):  # torch: no memory or random draws for values about to be replaced
            module = cls(**sizes._asdict(), d_ff=d_ff, rope_theta=rope_theta, eps=eps)
        return _load(module, state)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, need_weights: bool = True,
                 rng: Rng = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x = x + MLA(RMSNorm_1(x)),   x = x + FFN(RMSNorm_2(x)),   FFN(h) = W_down (silu(W_gate h) * W_up h).

        Args:
            x: inputs (..., L, D).
            mask: broadcasts to (..., H, L, L); an entry equal to 0 / False hides that key (causal_mask(L, L)
                for a decoder).
            need_weights: return the attention weights; with False the second result is None.
            rng: unused: no dropout; taken as TransformerBlock does.

        Returns:
            x (..., L, D) and the attention weights (..., H, L, L) per head (or None).
        """
        self._check_input(x)
        h, weights = self.attn(self.norm1(x), mask, need_weights=need_weights)  # (..., L, D)
        x = x + h
        return x + self.ffn(self.norm2(x)), weights  # (..., L, D) -> (..., L, F) -> (..., L, D)

    def init_cache(self, batch_shape: tuple[int, ...], capacity: int, *, dtype: Any = None) -> LatentCache:
        """An empty latent cache of the layer's attention (MultiHeadLatentAttention.init_cache)."""
        return self.attn.init_cache(batch_shape, capacity, dtype=dtype)

    def extend(self, x: torch.Tensor, cache: LatentCache, mask: torch.Tensor | None = None, *, absorbed: bool = False,
               need_weights: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, LatentCache]:
        """The layer on L new positions after those in the cache: as __call__ with causal_mask over the whole
        sequence, the attention through MultiHeadLatentAttention.extend in the form asked for.

        Args:
            x: the new positions' inputs (..., L, D).
            cache: from init_cache, or the cache the last extend returned.
            mask: broadcasts to (..., H, L, capacity); an entry equal to 0 / False hides that key too.
            absorbed: the attention's decode form, as MultiHeadLatentAttention.extend's.
            need_weights: return the attention weights; with False the second result is None.

        Returns:
            x (..., L, D), the attention weights (..., H, L, capacity) (or None), and the cache holding the new
            positions too.
        """
        self._check_input(x)
        h, weights, cache = self.attn.extend(self.norm1(x), cache, mask, absorbed=absorbed,
                                             need_weights=need_weights)  # (..., L, D)
        x = x + h
        return x + self.ffn(self.norm2(x)), weights, cache  # (..., L, D)

    def _check_input(self, x: torch.Tensor) -> None:
        validation.module_input("x", x.shape, self.norm1.weight.shape[0], "L")
        validation.same_floating_dtype(_dtypes(x=x, parameters=self.norm1.weight))
