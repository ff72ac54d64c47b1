"""Backward passes: the vector-Jacobian products of attention, multi-head attention and the transformer
block, in PyTorch.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

The same functions as the NumPy backend's, whose backward passes are derived by hand; here autograd
differentiates the forward code itself, so nothing is written twice. Modules are differentiated
without dropout: in eval mode, or with dropout 0. Autograd records the forward pass wherever the vjp is
called, also inside torch.no_grad() and torch.inference_mode(): it leaves them for its own work, and copies
the inference tensors among the inputs and parameters (made in inference mode), which cannot join a graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from attention_np.common import validation

from .functional import _dtypes, scaled_dot_product_attention
from .primitives import _named_parameters, _parameters, _replaced

Grads = dict[str, torch.Tensor]


def scaled_dot_product_attention_vjp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int | torch.Tensor = 0,
    window: tuple[int | None, int | None] | None = None,
    key_lengths: torch.Tensor | None = None,
    softcap: float | None = None,
    enable_gqa: bool = False,
    mask_mod: Callable[..., Any] | None = None,
    score_mod: Callable[..., Any] | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dP * P)),  dQ = dS K * scale,  dK = dS^T Q * scale,
    dbias = dS, for O = P V and P = softmax(S) over the visible keys, S = Q K^T * scale + bias.
    With softcap, S = c tanh(R / c) + bias, R = Q K^T * scale: dR = dS * (1 - tanh^2(R / c)), and dQ, dK
    take dR in place of dS (dbias is still dS). q_offset, window and key_lengths take no gradient. With
    enable_gqa, k and v are broadcast over each group of query heads, so dK and dV are summed over the group.
    With score_mod, S = score_mod(R) + bias: dR = score_mod's vjp at dS, and its parameters' gradients. With
    sinks, d sink = -sum_i p_i rowsum(dP * P)_i, p_i the sink's share of row i's denominator.

    torch's autograd differentiates through score_mod (any function of torch operations); a ScoreMod's
    parameters are differentiated through ScoreMod.replace.

    Args:
        q, k, v, mask, bias, is_causal, scale, q_offset, window, key_lengths, softcap, enable_gqa: as for
            scaled_dot_product_attention (no dropout).
        mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
            needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
        score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and before
            bias; needs four axes as mask_mod.
        sinks: one logit per head, broadcasting to (..., H), as for scaled_dot_product_attention.
        alibi_slopes: ALiBi's slopes, (H,) or (B, H), as for scaled_dot_product_attention; constants: they take
            no gradient (their bias -slope_h * |p_i - j| joins S as bias does, dS unchanged).

    Returns:
        out (..., L, Ev), weights (..., L, S) and pullback(d_out (..., L, Ev)) -> (dq, dk, dv, dbias),
        dbias None when bias is None; with a score_mod (dq, dk, dv, dbias, d_score_mod), d_score_mod a dict
        {parameter name: gradient} of score_mod.parameters (empty without); with sinks, d_sinks (sinks' shape)
        follows dbias: (dq, dk, dv, dbias, d_sinks) or (dq, dk, dv, dbias, d_sinks, d_score_mod).
    """
    names = list(_named_parameters(score_mod))
    with _recording():
        inputs = [_leaf(x) for x in (q, k, v, bias) if x is not None]
        sunk = [] if sinks is None else [_leaf(torch.as_tensor(sinks, device=q.device))]  # torch: a leaf too
        parameters = [_leaf(x) for x in _parameters(score_mod, q)]  # torch: leaves that ScoreMod.replace holds
        out, weights = scaled_dot_product_attention(*inputs[:3], mask, bias=None if bias is None else inputs[3],
                                                    is_causal=is_causal, scale=scale, q_offset=q_offset,
                                                    window=window, key_lengths=key_lengths, softcap=softcap,
                                                    enable_gqa=enable_gqa, mask_mod=mask_mod,
                                                    score_mod=_replaced(score_mod, names, parameters),
                                                    sinks=sunk[0] if sunk else None,
                                                    alibi_slopes=alibi_slopes)  # a constant: no gradient

    def pullback(d_out: torch.Tensor) -> tuple:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        grads = _grad(out, [*inputs, *sunk, *parameters], d_out)
        (dq, dk, dv, *dbias), d_sinks = grads[:len(inputs)], grads[len(inputs):len(inputs) + len(sunk)]
        d_parameters = grads[len(inputs) + len(sunk):]
        found = (dq, dk, dv, dbias[0] if dbias else None, *d_sinks)
        return found if score_mod is None else (*found, dict(zip(names, d_parameters, strict=True)))

    return out.detach(), weights.detach(), pullback


def multi_head_attention_vjp(mha: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             mask: torch.Tensor | None = None, *, is_causal: bool = False,
                             mask_mod: Callable[..., Any] | None = None, score_mod: Callable[..., Any] | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """Backward through MultiHead(Q, K, V): the output projection, the heads' merge, attention per head,
    the input projections, in reverse.

    Args:
        mha, q, k, v, mask, is_causal: the module and its call's arguments.
        mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
            needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
        score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and before
            bias; needs four axes as mask_mod.

    Returns:
        out (..., L, D), weights (..., H, L, S) and pullback(d_out (..., L, D)) -> (dq, dk, dv, dparams),
        dparams {state-dict name: gradient}, and the score function's parameters' under "score_mod.<name>".
    """
    validation.no_dropout(type(mha).__name__, _active_dropout(mha))
    with _recording():
        inputs, params = [_leaf(x) for x in (q, k, v)], _leaves(mha)
        score_mod, learned = _learned(score_mod, q)
        out, weights = torch.func.functional_call(mha, params, (*inputs, mask),
                                                  {"is_causal": is_causal, "mask_mod": mask_mod,
                                                   "score_mod": score_mod})
    params = {**params, **learned}

    def pullback(d_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Grads]:
        validation.cotangent("d_out", d_out.shape, out.shape, _dtypes(d_out=d_out, out=out))
        dq, dk, dv, *grads = _grad(out, [*inputs, *params.values()], d_out)
        return dq, dk, dv, dict(zip(params, grads, strict=True))

    return out.detach(), None if weights is None else weights.detach(), pullback  # None: attention="linear"


def transformer_block_vjp(block: Any, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                          is_causal: bool = False, mask_mod: Callable[..., Any] | None = None,
                          score_mod: Callable[..., Any] | None = None) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """Backward through the block (post-LN or pre-LN); self-attention's three input gradients add up.

    Args:
        block, x, mask, is_causal: the block and its call's arguments.
        mask_mod: (b, h, q_idx, kv_idx) -> bool, True where the query sees the key (attention_np.common.mods);
            needs q, k, v of four axes (B, H, L, E); and-ed with mask and the keyword rules.
        score_mod: (score, b, h, q_idx, kv_idx) -> the score the softmax uses, applied after softcap and before
            bias; needs four axes as mask_mod.

    Returns:
        y (..., L, D), weights (..., H, L, L) and pullback(d_out (..., L, D)) -> (dx, dparams), dparams
        {state-dict name: gradient}, and the score function's parameters' under "score_mod.<name>".
    """
    validation.no_dropout(type(block).__name__, _active_dropout(block))
    with _recording():
        x, params = _leaf(x), _leaves(block)
        score_mod, learned = _learned(score_mod, x)
        y, weights = torch.func.functional_call(block, params, (x, mask),
                                                {"is_causal": is_causal, "mask_mod": mask_mod,
                                                 "score_mod": score_mod})
    params = {**params, **learned}

    def pullback(d_out: torch.Tensor) -> tuple[torch.Tensor, Grads]:
        validation.cotangent("d_out", d_out.shape, y.shape, _dtypes(d_out=d_out, out=y))
        dx, *grads = _grad(y, [x, *params.values()], d_out)
        return dx, dict(zip(params, grads, strict=True))

    return y.detach(), None if weights is None else weights.detach(), pullback  # None: attention="linear"


def _learned(score_mod: Callable[..., Any] | None,
             x: torch.Tensor) -> tuple[Callable[..., Any] | None, dict[str, torch.Tensor]]:
    """score_mod holding its parameters as new leaves (called while _recording()), and those leaves by the name
    the modules' vjps give their gradients: "score_mod.<name>"."""
    names = list(_named_parameters(score_mod))
    leaves = [_leaf(value) for value in _parameters(score_mod, x)]
    return _replaced(score_mod, names, leaves), {f"score_mod.{name}": leaf for name, leaf in zip(names, leaves,
                                                                                                  strict=True)}


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    """torch: autograd records what runs inside, even where the caller is in torch.no_grad() or
    torch.inference_mode()."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """x as a new leaf of the autograd graph, so gradients stop there; an inference tensor (made under
    torch.inference_mode()) as a copy, which can join a graph. Called while _recording()."""
    x = torch.as_tensor(x).detach()
    return (x.clone() if x.is_inference() else x).requires_grad_()


def _leaves(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters as new leaves, by state-dict name: the vjp differentiates every parameter,
    also one frozen with requires_grad=False, and leaves the module's own autograd state alone."""
    return {name: _leaf(param) for name, param in module.named_parameters()}


def _active_dropout(module: torch.nn.Module) -> float:
    """The largest dropout probability in effect anywhere in `module`. torch: a submodule can be in
    training mode while its parent is in eval mode."""
    return max((m.dropout for m in module.modules() if m.training and isinstance(getattr(m, "dropout", None), float)),
               default=0.0)


def _grad(out: torch.Tensor, inputs: Sequence[torch.Tensor], d_out: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of <out, d_out> with respect to inputs; zeros for an input out does not depend on.
    The graph is kept, so a pullback can be called again; outside inference mode, so that the gradients are
    ordinary tensors, usable in autograd later, also when the pullback is called in inference mode."""
    with _recording():
        grads = torch.autograd.grad(out, inputs, d_out, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)]
