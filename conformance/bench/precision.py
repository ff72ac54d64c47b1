"""Attention in float16 and bfloat16: the error of ours against float64, on both paths, beside the framework's own
implementation on the same rounded inputs (docs/performance.md's "Low precision" table, written by
`python -m conformance docs --write`; tests/test_low_precision.py holds ours to at most twice the framework's).

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width, D = d_model, F = d_ff.

The error is max |ours - exact| / max |exact|, exact being attention_np in float64 on the inputs rounded to the
low dtype (so only the arithmetic's error is measured, not the inputs' rounding). Frameworks are imported inside
the functions that use them, so this module imports with NumPy alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import attention_np

from .baselines import random_state, torch_encoder_layer

B, H, L, E = 2, 4, 48, 16  # S = L
D, F = 64, 128  # the block's d_model and d_ff
DTYPES = ("float16", "bfloat16")


class Errors(NamedTuple):
    """One row: our error on each path, the baseline's, and whether our outputs kept the input dtype."""

    explicit: float  # need_weights=True
    fast: float | None  # need_weights=False (None: a module, one path)
    theirs: float
    baseline: str  # what `theirs` is
    kept_dtype: bool  # out (and the weights) in the input's dtype


def inputs(seed: int = 0) -> tuple[np.ndarray, ...]:
    """q, k, v (B, H, L, E) in float64 and a mask (B, 1, L, L) in which every query sees a key (the frameworks'
    built-ins differ on fully masked rows, SPEC 8)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, H, L, E)) for _ in range(3))
    mask = rng.random((B, 1, L, L)) > 0.2
    mask[..., 0] = True
    return q, k, v, mask


def error(actual: Any, expected: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(actual, np.float64) - expected)) / np.max(np.abs(expected)))


def _exact(q: Any, k: Any, v: Any, mask: np.ndarray) -> np.ndarray:
    return attention_np.scaled_dot_product_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), mask)[0]


def _ours(paths: list[tuple[Any, Any]], dtype: Any, exact: np.ndarray,
          as_array: Callable[[Any], Any] = np.asarray) -> tuple[float, float, bool]:
    """The explicit and the fast path's errors, and whether both kept `dtype`, from their (out, weights)."""
    kept = all(out.dtype == dtype and (weights is None or weights.dtype == dtype) for out, weights in paths)
    explicit, fast = (error(as_array(out), exact) for out, _ in paths)
    return explicit, fast, kept


def torch_sdpa(dtype: str) -> Errors:
    import torch

    import attention_torch

    q, k, v, mask = inputs()
    q, k, v = (torch.tensor(x).to(getattr(torch, dtype)) for x in (q, k, v))
    exact = _exact(*(x.double().numpy() for x in (q, k, v)), mask)
    mask = torch.tensor(mask)
    paths = [attention_torch.scaled_dot_product_attention(q, k, v, mask, need_weights=need) for need in (True, False)]
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    explicit, fast, kept = _ours(paths, q.dtype, exact, lambda out: out.double().numpy())
    return Errors(explicit, fast, theirs=error(theirs.double().numpy(), exact),
                  baseline="`F.scaled_dot_product_attention`", kept_dtype=kept)


def jax_sdpa(dtype: str) -> Errors:
    import jax
    import jax.numpy as jnp

    import attention_jax

    q, k, v, mask = inputs()
    q, k, v = (jnp.asarray(x, getattr(jnp, dtype)) for x in (q, k, v))
    exact = _exact(q, k, v, mask)
    paths = [attention_jax.scaled_dot_product_attention(q, k, v, mask, need_weights=need) for need in (True, False)]
    with jax.numpy_dtype_promotion("standard"):  # jax's own function mixes float32 into low precision itself
        theirs = jax.nn.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), mask=mask)  # (B, L, H, E)
    explicit, fast, kept = _ours(paths, q.dtype, exact)
    return Errors(explicit, fast, theirs=error(jnp.swapaxes(theirs, 1, 2), exact),
                  baseline="`jax.nn.dot_product_attention`", kept_dtype=kept)


def numpy_sdpa(dtype: str) -> Errors:
    """NumPy has no attention of its own: the baseline is the tutorial's formulation computed in float16."""
    q, k, v, mask = inputs()
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    exact = _exact(q, k, v, mask)
    scores = q @ np.swapaxes(k, -1, -2) / np.float16(np.sqrt(E))  # (B, H, L, E) x (B, H, E, S) -> (B, H, L, S)
    scores = np.exp(np.where(mask, scores, np.float16(-6e4)) - scores.max(axis=-1, keepdims=True))
    plain = (scores / scores.sum(axis=-1, keepdims=True)) @ v  # (B, H, L, S) x (B, H, S, E) -> (B, H, L, E)
    paths = [attention_np.scaled_dot_product_attention(q, k, v, mask, need_weights=need) for need in (True, False)]
    explicit, fast, kept = _ours(paths, q.dtype, exact)
    return Errors(explicit, fast, theirs=error(plain, exact), baseline="the tutorial's formulation in float16",
                  kept_dtype=kept)


def torch_block(dtype: str) -> Errors:
    """Our TransformerBlock (post-LN, ReLU, D=64, F=128) against nn.TransformerEncoderLayer holding its state."""
    import torch

    import attention_torch

    state = random_state("block", D, F, np.random.default_rng(1), np.float64)
    low = {name: torch.tensor(value).to(getattr(torch, dtype)) for name, value in state.items()}
    x = torch.tensor(np.random.default_rng(2).standard_normal((B, L, D))).to(getattr(torch, dtype))
    rounded = {name: value.double().numpy() for name, value in low.items()}
    exact = attention_np.TransformerBlock.from_state_dict(rounded, num_heads=H).eval()(x.double().numpy())[0]
    ours = attention_torch.TransformerBlock.from_state_dict(low, num_heads=H).eval()(x)[0]
    layer = torch_encoder_layer(rounded, num_heads=H, dtype=np.float64).to(getattr(torch, dtype))
    with torch.no_grad():
        theirs = layer(x)
    return Errors(error(ours.detach().double().numpy(), exact), None, theirs=error(theirs.double().numpy(), exact),
                  baseline="`nn.TransformerEncoderLayer`", kept_dtype=ours.dtype == x.dtype)


# (framework, operation) -> the measure and the dtypes it has (NumPy has no bfloat16 arithmetic)
MEASURES: dict[tuple[str, str], tuple[Callable[[str], Errors], tuple[str, ...]]] = {
    ("NumPy", "sdpa"): (numpy_sdpa, ("float16",)),
    ("torch", "sdpa"): (torch_sdpa, DTYPES),
    ("JAX", "sdpa"): (jax_sdpa, DTYPES),
    ("torch", "block"): (torch_block, DTYPES),
}


def table() -> str:
    """The markdown table of every measure in MEASURES, each dtype a row."""
    lines = ["| dtype | operation | ours (explicit) | ours (fast path) | the framework's own |",
             "|---|---|---|---|---|"]
    for dtype in DTYPES:
        for (framework, operation), (measure, dtypes) in MEASURES.items():
            if dtype in dtypes:
                found = measure(dtype)
                fast = "" if found.fast is None else f"{found.fast:.1e}"
                lines.append(f"| {dtype} | {framework} {operation} | {found.explicit:.1e} | {fast} | "
                             f"{found.theirs:.1e} ({found.baseline}) |")
    return "\n".join(lines)
