"""Figures for students, computed with attention_np and drawn with matplotlib (the optional extra `plot`).

    python -m conformance figure scaling [--output docs/scaling.png]

It lives with the benchmarks, not in the textbook package; matplotlib is imported only inside the function
that draws.

Shape legend: B batch (here: independent random draws), L query positions, S key/value positions,
E query/key width (= d_k), Ev value width.

The computations are small functions that return NumPy arrays, one entry per d_k, so tests can check the
trends without matplotlib; `plot_scaling` only draws them. Each d_k gets its own generator seeded with
(seed, d_k), and the scaled and unscaled curves see the same draws: a run is reproducible, and a curve
does not depend on which other widths are swept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attention_np.functional import scaled_dot_product_attention
from attention_np.gradients import scaled_dot_product_attention_vjp

D_K = tuple(2**n for n in range(2, 11))  # 4, 8, ..., 1024
L, S, EV, DRAWS = 64, 64, 64, 16
QUANTILES = (0.25, 0.5, 0.75)
CAPTION = ("Dividing the scores by √d_k keeps their spread near 1 at every width; without it the softmax "
           "turns one-hot as d_k grows and the gradient through it vanishes.")


def _scale(d_k: int, scaled: bool) -> float:
    """1 / sqrt(d_k), the scale of the paper, or 1.0: the raw dot products."""
    return 1 / math.sqrt(d_k) if scaled else 1.0


def _queries_keys(d_k: int, seed: int) -> tuple[np.random.Generator, np.ndarray, np.ndarray]:
    """A generator for (seed, d_k) and q (B, L, E), k (B, S, E) with standard normal entries."""
    rng = np.random.default_rng([seed, d_k])
    q = rng.standard_normal((DRAWS, L, d_k))  # (B, L, E)
    k = rng.standard_normal((DRAWS, S, d_k))  # (B, S, E)
    return rng, q, k


def score_std(d_ks: Sequence[int] = D_K, *, scaled: bool, seed: int = 0) -> np.ndarray:
    """std(Q K^T * scale) for each d_k: each score is a sum of d_k products of unit variance, so its
    standard deviation is sqrt(d_k) * scale, i.e. sqrt(d_k) unscaled and 1 scaled.

    Returns:
        (len(d_ks),) the standard deviation over every score of every draw.
    """
    stds = []
    for d_k in d_ks:
        _, q, k = _queries_keys(d_k, seed)
        scores = q @ np.swapaxes(k, -1, -2) * _scale(d_k, scaled)  # (B, L, E) x (B, E, S) -> (B, L, S)
        stds.append(math.sqrt(np.mean((scores - np.mean(scores)) ** 2)))
    return np.array(stds)


def max_weight(d_ks: Sequence[int] = D_K, *, scaled: bool, seed: int = 0) -> np.ndarray:
    """mean over queries of max_j P_ij, P = softmax(Q K^T * scale): 1/S for uniform weights, 1 for one-hot.

    Returns:
        (len(d_ks),) the mean largest weight per query, over every query of every draw.
    """
    means = []
    for d_k in d_ks:
        rng, q, k = _queries_keys(d_k, seed)
        v = rng.standard_normal((DRAWS, S, EV))  # (B, S, Ev)
        _, weights = scaled_dot_product_attention(q, k, v, scale=_scale(d_k, scaled))  # (B, L, S)
        means.append(np.mean(np.max(weights, axis=-1)))
    return np.array(means)


def score_gradient_norm(d_ks: Sequence[int] = D_K, *, scaled: bool, seed: int = 0,
                        quantiles: Sequence[float] = QUANTILES) -> np.ndarray:
    """Quantiles over queries of ||dL/dS_i||, the gradient reaching query i's row of scores through the
    softmax, dS = P * (dP - rowsum(dP * P)), for a random d_out (unit normal entries).

    The gradient comes from scaled_dot_product_attention_vjp (gradients.py): with a zero bias added to the
    scores, dbias is dS itself. The value width Ev is fixed, so dP = dO V^T has the same size at every d_k
    and only the softmax changes. A one-hot row has dS_i = 0; a row whose two top scores nearly tie keeps
    some gradient, so the median (the typical query) falls faster than the upper quantiles.

    Returns:
        (len(d_ks), len(quantiles)) the quantiles of the per-query norms, over every query of every draw.
    """
    rows = []
    for d_k in d_ks:
        rng, q, k = _queries_keys(d_k, seed)
        v = rng.standard_normal((DRAWS, S, EV))  # (B, S, Ev)
        bias = np.zeros((DRAWS, L, S))  # (B, L, S): one per draw, so dbias is not summed over draws
        _, _, pullback = scaled_dot_product_attention_vjp(q, k, v, bias=bias, scale=_scale(d_k, scaled))
        d_out = rng.standard_normal((DRAWS, L, EV))  # (B, L, Ev)
        _, _, _, d_scores = pullback(d_out)  # (B, L, S)
        norms = np.sqrt(np.sum(d_scores**2, axis=-1))  # (B, L, S) -> (B, L)
        rows.append(np.quantile(norms, quantiles))
    return np.array(rows)


def plot_scaling(path: str | Path = "docs/scaling.png", *, seed: int = 0) -> Path:
    """Why the scores are divided by sqrt(d_k): three panels against d_k = 4 .. 1024, with and without
    the scale. 1) the spread of the scores; 2) how one-hot the softmax is; 3) the gradient through it.
    The caption (CAPTION) sits under the panels. Writes a PNG and returns its path.
    """
    from matplotlib.figure import Figure  # the optional extra `plot`; no pyplot, so no global state

    d_k = np.array(D_K)
    styles = {False: dict(color="tab:red", marker="o", label="unscaled: Q Kᵀ"),
              True: dict(color="tab:blue", marker="s", label="scaled: Q Kᵀ / √d_k")}
    figure = Figure(figsize=(15, 4.9), layout="constrained")
    spread, saturation, gradient = figure.subplots(1, 3)

    # 1) the scores' standard deviation grows as sqrt(d_k) unless divided by it
    spread.plot(d_k, np.sqrt(d_k), color="gray", linewidth=7, alpha=0.35, label="√d_k")
    for scaled in (False, True):
        _curve(spread, d_k, score_std(D_K, scaled=scaled, seed=seed), "{:.1f}", **styles[scaled])
    spread.set_yscale("log", base=2)
    spread.set_yticks([0.5, 1, 2, 4, 8, 16, 32, 64], ["0.5", "1", "2", "4", "8", "16", "32", "64"])
    spread.set_ylim(0.7, 50)
    _axes(spread, "1) The scores' spread grows as √d_k", "std of the scores q·k")

    # 2) large scores make the softmax one-hot: its largest weight goes to 1
    saturation.axhline(1.0, color="gray", linestyle="--", label="one-hot (1)")
    saturation.axhline(1 / S, color="gray", linestyle=":", label=f"uniform (1/S = 1/{S})")
    for scaled in (False, True):
        _curve(saturation, d_k, max_weight(D_K, scaled=scaled, seed=seed), "{:.2f}", below=not scaled,
               **styles[scaled])
    saturation.set_ylim(0, 1.05)
    _axes(saturation, f"2) The softmax saturates (S = {S} keys)", "mean largest weight per query")

    # 3) a one-hot softmax passes (almost) no gradient back to the scores
    for scaled in (False, True):
        low, median, high = score_gradient_norm(D_K, scaled=scaled, seed=seed).T
        _curve(gradient, d_k, median, "{:.2g}", **styles[scaled] | dict(label=styles[scaled]["label"] + ", median"))
        gradient.fill_between(d_k, low, high, color=styles[scaled]["color"], alpha=0.15,
                              label="middle half of the queries (25-75 %)" if not scaled else None)
    gradient.set_yscale("log")
    _axes(gradient, "3) The gradient through the softmax vanishes", "‖∂loss/∂scores‖ per query")

    figure.suptitle("Why attention divides the scores by √d_k  (q, k entries ~ N(0, 1))", fontsize=14)
    figure.supxlabel(CAPTION, fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def _curve(axes: Any, x: np.ndarray, y: np.ndarray, number: str, *, below: bool = False, **style: Any) -> None:
    """A curve with its last value written next to its last point, above it or below it."""
    axes.plot(x, y, **style)
    axes.annotate(number.format(y[-1]), (x[-1], y[-1]), xytext=(-8, -16 if below else 7), textcoords="offset points",
                  ha="right", color=style["color"], fontsize=10, fontweight="bold")


def _axes(axes: Any, title: str, ylabel: str) -> None:
    """Title, labels, a log2 d_k axis with a tick per width, a grid and the legend."""
    axes.set_xscale("log", base=2)
    axes.set_xticks(D_K, [str(d) for d in D_K])
    axes.set(title=title, xlabel="d_k (query/key width)", ylabel=ylabel)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=9)


FIGURES: dict[str, Callable[..., Path]] = {"scaling": plot_scaling}
