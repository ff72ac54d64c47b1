"""The serving benchmark of `python -m conformance compare --variant serve`: continuous batching through the paged
cache against static batching with padding and against recomputing without a cache, on one stream (NumPy).

Shape legend: B slots (the batch), L positions of a step's chunk, D = d_model, V the vocabulary.

The model: serving.tiny_llama (random weights from a seed, float64 so that every method's greedy tokens agree
exactly), small enough for seconds on 2 cores. The stream: `requests` requests, each a total length drawn
log-uniformly from shortest .. longest (8 .. 80 by default: a 10x range, most requests short and a few long, as
lengths run in served traffic), its first half the prompt (random tokens) and the rest the tokens to generate;
all waiting at step 0, so that no method waits on arrivals.

- continuous: serving.serve, `continuous_slots` slots over a pool of pages per layer of the same positions as
  static's padded contiguous cache (slots x the longest total): requests join as the pool admits them (the pages
  of their whole length promised) and leave every step; a step runs the joining prompts as one ragged chunk and
  the others' last tokens as another.
- static: serving.static, batches of `slots` requests in arrival order, each padded to its longest prompt, a
  contiguous cache, every request stepping until the batch's longest is done.
- recompute: serving.recompute, one request at a time, each new token a causal pass over the whole sequence.

tokens/s = the generated tokens (the same in all three) / the median seconds over the repeats, the three run in
turns (continuous, static, recompute, then again) with Python's collector paused, so that the machine's drift hits
each alike. Before timing, the three must give every request the same tokens. Memory (from continuous's step
records): at the step whose pool holds the most pages, those pages' positions (pages x page_size) against the
positions the live requests hold then; and against a padded contiguous cache, slots x the longest total.
Targets: continuous / static >= 3 (tokens/s); pages' positions / positions held <= 1.1.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from . import serving
from .timing import Ratio, collector_paused, ratio

SPEED_TARGET, MEMORY_TARGET = 3.0, 1.1  # continuous / static tokens/s >= 3; pages' positions / held <= 1.1


class Config(NamedTuple):
    """The stream, the slots and pages, the model's sizes, the repeats (the defaults: the command's)."""

    requests: int = 48
    shortest: int = 8
    longest: int = 80
    slots: int = 8  # static's batch; its padded contiguous cache, slots x the longest total, is continuous's pool
    continuous_slots: int = 16  # continuous's batch, as many as the pool admits (serving.serve)
    page_size: int = 4
    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    d_ff: int = 128
    repeats: int = 3
    seed: int = 0


class MethodRow(NamedTuple):
    """One method's median over the repeats: the generated tokens, the steps (calls of the layers on a chunk;
    recompute: its causal passes), the seconds, tokens/s."""

    method: str
    tokens: int
    steps: int
    seconds: float
    tokens_per_s: float


def stream(config: Config) -> list[serving.Request]:
    """The requests: totals log-uniform in shortest .. longest, half prompt, half generated, all at step 0."""
    rng = np.random.default_rng(config.seed)
    totals = np.exp(rng.uniform(math.log(config.shortest), math.log(config.longest + 1), config.requests))
    found = []
    for total in totals.astype(int).tolist():
        prompt = total // 2
        found.append(serving.Request(prompt=tuple(rng.integers(config.vocab, size=prompt).tolist()),
                                     new_tokens=total - prompt, arrival=0))
    return found


def model_of(config: Config) -> serving.Model:
    return serving.tiny_llama(vocab=config.vocab, d_model=config.d_model, n_layers=config.n_layers,
                              num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, d_ff=config.d_ff,
                              rng=config.seed)


def methods(model: serving.Model, requests: list[serving.Request],
            config: Config) -> dict[str, Callable[[], list[list[int]]]]:
    """Each method's call, from the model and the stream to every request's tokens."""
    return {"continuous": lambda: _continuous(model, requests, config).tokens,
            "static": lambda: serving.static(model, requests, slots=config.slots),
            "recompute": lambda: serving.recompute(model, requests)}


def run(config: Config) -> tuple[list[MethodRow], list[Ratio], serving.Served]:
    """The three methods checked equal, then timed in turns; their rows, the ratios and continuous's record."""
    model, requests = model_of(config), stream(config)
    calls = methods(model, requests, config)
    # 1) every method gives every request the same tokens (and is warmed up)
    tokens = {name: call() for name, call in calls.items()}
    for name, found in tokens.items():
        if found != tokens["continuous"]:
            raise AssertionError(f"{name} generates other tokens than continuous batching: "
                                 f"{_first_difference(found, tokens['continuous'])}")
    # 2) the repeats in turns
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(config.repeats):
        for name, call in calls.items():
            with collector_paused():
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
    generated = sum(r.new_tokens for r in requests)
    served = _continuous(model, requests, config)
    steps = {"continuous": len(served.steps), "static": static_steps(requests, config.slots), "recompute": generated}
    rows = [MethodRow(name, tokens=generated, steps=steps[name], seconds=statistics.median(found),
                      tokens_per_s=generated / statistics.median(found)) for name, found in seconds.items()]
    return rows, speed_ratios(rows) + memory_ratios(served, requests, config), served


def _continuous(model: serving.Model, requests: list[serving.Request], config: Config) -> serving.Served:
    """serving.serve in continuous_slots slots over pools of the positions of static's padded contiguous cache (the
    same memory): the requests the pool admits run together."""
    longest = max(len(r.prompt) + r.new_tokens for r in requests)
    return serving.serve(model, requests, slots=config.continuous_slots, page_size=config.page_size,
                         num_pages=config.slots * -(-longest // config.page_size))  # ceil


def static_steps(requests: list[serving.Request], slots: int) -> int:
    """The steps of static batching: each batch of `slots` (in arrival order) takes as many as its most new tokens
    (the prefill gives the first)."""
    order = sorted(requests, key=lambda r: r.arrival)
    return sum(max(r.new_tokens for r in order[first:first + slots]) for first in range(0, len(order), slots))


def _first_difference(found: list[list[int]], expected: list[list[int]]) -> str:
    i = next(i for i, (a, b) in enumerate(zip(found, expected, strict=True)) if a != b)
    return f"request {i}: {found[i]} against {expected[i]}"


def speed_ratios(rows: list[MethodRow]) -> list[Ratio]:
    """continuous / static (target >= SPEED_TARGET) and continuous / recompute (no target), in tokens/s."""
    rate = {row.method: row.tokens_per_s for row in rows}
    return [ratio("tokens/s", "continuous", rate["continuous"], other, rate[other], ">=", bound)
            for other, bound in (("static", SPEED_TARGET), ("recompute", None))]


def memory_ratios(served: serving.Served, requests: list[serving.Request], config: Config) -> list[Ratio]:
    """At the step whose pool (layer 0's; every layer's holds the same) has the most pages in use: their positions
    against the positions the live requests hold (target <= MEMORY_TARGET), and against the padded contiguous
    cache, slots x the longest total (no target)."""
    peak = max(served.steps, key=lambda step: step.pages_in_use[0])
    pages = peak.pages_in_use[0] * config.page_size
    contiguous = config.slots * max(len(r.prompt) + r.new_tokens for r in requests)
    return [ratio("positions", "pages in use", pages, "held", sum(peak.positions), "<=", MEMORY_TARGET),
            ratio("positions", "pages in use", pages, "padded contiguous", contiguous, "<=", None)]


def describe(config: Config, requests: list[serving.Request] | None = None) -> str:
    """The configuration, one line."""
    requests = requests or stream(config)
    totals = [len(r.prompt) + r.new_tokens for r in requests]
    return (f"serve: NumPy float64, tiny Llama (V={config.vocab}, D={config.d_model}, {config.n_layers} layers, "
            f"H={config.num_heads} on Hkv={config.num_kv_heads}, F={config.d_ff}); {config.requests} requests of "
            f"{min(totals)}..{max(totals)} tokens (log-uniform in {config.shortest}..{config.longest}, half prompt), "
            f"{sum(r.new_tokens for r in requests)} generated; static: {config.slots} slots, a padded contiguous "
            f"cache; continuous: up to {config.continuous_slots} slots over pages of {config.page_size} in as many "
            f"positions; "
            f"{config.repeats} repeats in turns, medians")
