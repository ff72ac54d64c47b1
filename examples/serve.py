"""Continuous batching over the paged cache: `python examples/serve.py`.

A tiny Llama-style decoder serves a stream of requests in a fixed number of slots through paged caches; the model
and the serving loop live in conformance/bench/serving.py (one copy, which `compare --variant serve` times too),
re-exported here: Model, Request, Slot, Step, Served, tiny_llama, logits, generate_alone, serve.
"""

from __future__ import annotations

import time

import numpy as np

from conformance.bench.serving import (  # noqa: F401 (re-exported: tests/test_serve.py reads them from here)
    Model,
    Request,
    Served,
    Slot,
    Step,
    generate_alone,
    logits,
    serve,
    tiny_llama,
)


def _stream(rng: np.random.Generator, n: int, *, vocab: int) -> list[Request]:
    """n requests of random prompts (1 to 32 tokens) and lengths (1 to 32), arriving over the first n steps."""
    return [Request(prompt=tuple(rng.integers(vocab, size=int(rng.integers(1, 33))).tolist()),
                    new_tokens=int(rng.integers(1, 33)), arrival=int(rng.integers(n))) for _ in range(n)]


if __name__ == "__main__":
    SLOTS, PAGE, PAGES = 8, 8, 64
    model = tiny_llama(vocab=256, d_model=64, n_layers=2, num_heads=4, num_kv_heads=2, d_ff=128)
    requests = _stream(np.random.default_rng(1), 24, vocab=256)
    start = time.perf_counter()
    served = serve(model, requests, slots=SLOTS, page_size=PAGE, num_pages=PAGES)
    seconds = time.perf_counter() - start
    generated = sum(len(t) for t in served.tokens)
    contiguous = SLOTS * max(-(-(len(r.prompt) + r.new_tokens) // PAGE) for r in requests)  # every slot the longest
    print(f"{len(requests)} requests, {generated} tokens in {len(served.steps)} steps: "
          f"{generated / seconds:.0f} tokens/s; pages in use per layer at most "
          f"{max(max(s.pages_in_use) for s in served.steps)} of {PAGES} (a contiguous cache: {contiguous})")
