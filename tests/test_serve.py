"""examples/serve.py: continuous batching over the paged cache (SPEC 3b) of a tiny Llama-style decoder in NumPy,
float64. Every request's greedy tokens equal those of the request decoded alone with a contiguous cache, though
requests join late, their prompts prefilled in the same ragged chunk as the others' decode steps, and pages freed
by finished requests serve the next; a pool's pages in use never exceed ceil(length / page_size) per live request."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

SLOTS, PAGE, PAGES = 3, 2, 14
STREAM = (  # (prompt, new tokens, arrival step): prompts of 1-6 tokens, 1-5 new, four arriving late
    ((3, 1, 4, 1, 5, 9), 5, 0),
    ((2,), 3, 0),
    ((6, 5, 3), 1, 0),
    ((5, 8, 9, 7), 4, 0),
    ((9, 3, 2, 3, 8), 2, 2),
    ((4, 6), 5, 3),
    ((2, 6, 4, 3, 3, 8), 3, 7),
    ((1,), 1, 14),  # after the others have finished: idle steps before it, all padding
)


@functools.cache
def _serve() -> ModuleType:
    """examples/serve.py as a module (examples/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "serve.py"
    spec = importlib.util.spec_from_file_location("serve_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _served(num_kv_heads: int):
    """The model, the requests and what serve returned: V=32, D=16, 2 layers, 4 heads."""
    S = _serve()
    model = S.tiny_llama(vocab=32, d_model=16, n_layers=2, num_heads=4, num_kv_heads=num_kv_heads, d_ff=32, rng=0)
    requests = [S.Request(prompt=p, new_tokens=n, arrival=t) for p, n, t in STREAM]
    return model, requests, S.serve(model, requests, slots=SLOTS, page_size=PAGE, num_pages=PAGES)


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_every_request_equals_its_generation_alone(num_kv_heads):
    model, requests, served = _served(num_kv_heads)
    alone = [_serve().generate_alone(model, r.prompt, r.new_tokens) for r in requests]
    assert served.tokens == alone
    assert [len(t) for t in served.tokens] == [r.new_tokens for r in requests]


def test_prompts_join_in_the_same_chunk_as_decode_steps():
    steps = _served(2)[2].steps
    assert any(_prefill_beside_decode(before, now) for before, now in itertools.pairwise(steps)), \
        [s.new_lengths for s in steps]
    assert steps[0].new_lengths == tuple(len(p) for p, _, _ in STREAM[:SLOTS])  # the first three, in slot order
    assert (0,) * SLOTS in [s.new_lengths for s in steps]  # idle steps before the last request, all padding
    assert len(steps) == STREAM[-1][2] + 1  # the last one joins at its arrival, generating one token


def _prefill_beside_decode(before, now) -> bool:
    """A step that prefills a prompt (a new length > 1) beside a slot, live the step before, decoding one token."""
    decodes = any(b > 0 and n == 1 for b, n in zip(before.new_lengths, now.new_lengths, strict=True))
    return max(now.new_lengths) > 1 and decodes


def test_pages_in_use_never_exceed_what_live_requests_hold():
    _, requests, served = _served(2)
    # without releasing finished requests' pages the stream would not fit: it needs more pages than the pool has
    assert sum(math.ceil((len(r.prompt) + r.new_tokens - 1) / PAGE) for r in requests) > PAGES
    for step in served.steps:
        held = sum(math.ceil(p / PAGE) for p in step.positions)  # ceil(length / page_size) per live request
        assert all(in_use <= held for in_use in step.pages_in_use), step
    assert served.steps[-1].pages_in_use == (0, 0)  # every page back in the pool at the end
