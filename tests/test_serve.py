"""examples/serve.py (its model and loop: conformance/bench/serving.py): continuous batching over the paged cache
(SPEC 3b) of a tiny Llama-style decoder in NumPy, float64. Every request's greedy tokens equal those of the request
decoded alone with a contiguous cache, though requests join late, their prompts prefilled in the same step as the
others' decode steps, a request waits while the pool cannot promise it its pages, and pages freed by finished
requests serve the next; a pool's pages in use never exceed ceil(length / page_size) per live request.
`compare --variant serve` (bench/batching.py) sets it against static batching with padding and recomputing: the
three give every request the same tokens; the run recorded in docs/serve.json (the docs' table) holds every cell
that is not a time when the stream is served afresh. Served by JAX blocks under one jax.jit of the layers, the
stream's decode steps run one compiled program."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from conformance import docs
from conformance.__main__ import main
from conformance.bench import batching, serving, timing
from tests._compare import REORDERED, assert_close
from tests.conftest import import_backend

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


def test_prompts_join_in_the_same_step_as_decode_steps():
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


def test_a_request_waits_while_the_pool_cannot_promise_its_whole_length():
    model, requests, _ = _served(2)
    tight = 9  # pages of 2: the first three requests promise 4 + 1 + 2 pages; the fourth (4 pages) must wait
    served = serving.serve(model, requests, slots=SLOTS, page_size=PAGE, num_pages=tight)
    assert served.tokens == _served(2)[2].tokens  # the same tokens, later
    whole = [math.ceil((len(r.prompt) + r.new_tokens) / PAGE) for r in requests]
    assert all(sum(whole[i] for i in step.requests if i >= 0) <= tight for step in served.steps)
    joined = {i: next(t for t, step in enumerate(served.steps) if i in step.requests) for i in range(len(requests))}
    held_back = [i for i, r in enumerate(requests) if any(
        -1 in served.steps[t].requests for t in range(r.arrival, joined[i]))]  # a free slot, yet it waited
    assert held_back, joined
    with pytest.raises(ValueError, match=r"too few free ones|all in use"):  # without the promise: out of pages
        promising_nothing = functools.partial(serving._join, num_pages=math.inf)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(serving, "_join", lambda *args, num_pages, **kwargs: promising_nothing(*args, **kwargs))
            serving.serve(model, requests, slots=SLOTS, page_size=PAGE, num_pages=tight)
    with pytest.raises(ValueError, match="request 0 needs 6 pages of 2 positions; the pool has 5"):
        serving.serve(model, requests, slots=SLOTS, page_size=PAGE, num_pages=5)  # it could never join


def test_jax_serves_the_stream_with_one_compiled_decode_step():
    """The stream served by JAX blocks (NumPy's weights) with the layers of every step under one jax.jit: the
    table, the lengths and new_lengths are data, so every chunk of one shape runs one compiled program: the decode
    chunks (every slot's last token, (B, 1), slots joining and leaving, pages reserved and released on the host
    between steps) all one; the joining prompts' chunk (their slots alone, the longest one's width) once per such
    shape. Each step's outputs equal NumPy's serving of the same stream."""
    jax = pytest.importorskip("jax")
    J = import_backend("attention_jax")
    model, requests, _ = _served(2)
    blocks = tuple(J.TransformerBlock.from_state_dict(block.state_dict(), num_heads=4, norm_first=True,
                                                      rope_theta=block.attn.rope_theta).eval()
                   for block in model.blocks)
    traces, outs = [], {"numpy": [], "jax": []}

    def traced(blocks, x, caches, new_lengths):
        traces.append(x.shape[:2])  # runs when JAX traces, not when the compiled program runs
        return serving.layers(blocks, x, caches, new_lengths)

    def recorded(name, layers):
        def run(blocks, x, caches, new_lengths):
            x, caches = layers(blocks, x, caches, new_lengths)
            outs[name].append(np.asarray(x))  # (B, L, D)
            return x, caches
        return run

    kwargs = {"slots": SLOTS, "page_size": PAGE, "num_pages": PAGES}
    expected = serving.serve(model, requests, layers=recorded("numpy", serving.layers), **kwargs)
    served = serving.serve(model._replace(blocks=blocks), requests, layers=recorded("jax", jax.jit(traced)), **kwargs)
    assert served == expected  # the tokens, each step's new lengths, positions and pages in use
    for t, (got, want) in enumerate(zip(outs["jax"], outs["numpy"], strict=True)):
        assert_close(got, want, REORDERED, f"step {t}'s outputs")
    shapes, decoding, seen = set(), 0, set()  # each step's chunks: the joining prompts' (b, L), every slot's (B, 1)
    for step in served.steps:
        joining = [n for i, n in zip(step.requests, step.new_lengths, strict=True) if i >= 0 and i not in seen]
        shapes |= {(len(joining), max(joining))} if joining else set()
        decoding += any(i >= 0 and i in seen for i in step.requests)
        shapes |= {(SLOTS, 1)} if any(i >= 0 and i in seen for i in step.requests) else set()
        seen |= set(step.requests)
    assert decoding >= len(STREAM) and traces.count((SLOTS, 1)) == 1  # every decode chunk: one program
    assert sorted(traces) == sorted(shapes)  # and one per prefill shape


# --- compare --variant serve (bench/batching.py) ----------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_static_and_recompute_generate_the_tokens_of_continuous_batching(num_kv_heads):
    model, requests, served = _served(num_kv_heads)
    assert serving.static(model, requests, slots=SLOTS) == served.tokens  # batches padded to their longest prompt
    assert serving.recompute(model, requests) == served.tokens  # no cache: a causal pass per new token


def test_static_steps_every_batch_until_its_longest_is_done():
    _, requests, _ = _served(2)
    # batches of 3 in arrival order: new tokens (5, 3, 1), (4, 2, 5), (3, 1): 5 + 5 + 3 steps
    assert batching.static_steps(requests, SLOTS) == 13


def test_memory_ratios_read_the_step_with_the_most_pages():
    # pages of 4: the peak step holds 3 pages (12 positions) for live requests of 5 and 6 positions (11 held);
    # a contiguous cache: 2 slots x the longest total, 3 + 6 = 9
    requests = [serving.Request(prompt=(1, 2), new_tokens=4), serving.Request(prompt=(1, 2, 3), new_tokens=6)]
    steps = [serving.Step(new_lengths=(2, 3), positions=(2, 3), pages_in_use=(2, 2)),
             serving.Step(new_lengths=(1, 1), positions=(5, 6), pages_in_use=(3, 3)),
             serving.Step(new_lengths=(0, 1), positions=(7,), pages_in_use=(2, 2))]
    held, contiguous = batching.memory_ratios(serving.Served(tokens=[], steps=steps), requests,
                                              batching.Config(slots=2, page_size=4))
    assert (held.numerator_value, held.denominator_value, held.met) == (12, 11, True)  # 12 / 11 = 1.09 <= 1.1
    assert (contiguous.numerator_value, contiguous.denominator_value, contiguous.bound) == (12, 18, None)


def test_serve_variant_runs_at_a_tiny_size_with_labelled_rows(tmp_path, capsys):
    path = tmp_path / "serve.json"
    assert main(["compare", "--variant", "serve", "--requests", "4", "--repeats", "1", "--json", str(path)]) == 0
    stdout = capsys.readouterr().out
    printed = [re.split(r"\s{2,}", line.strip()) for line in stdout.splitlines()]
    assert [line[0] for line in printed if line[0] in ("continuous", "static", "recompute")] == [
        "continuous", "static", "recompute"]
    assert {"tokens/s: continuous / static", "tokens/s: continuous / recompute", "positions: pages in use / held",
            "positions: pages in use / padded contiguous"} <= {line[0] for line in printed}, stdout
    document = json.loads(path.read_text())
    assert document["variant"] == "serve" and document["config"]["requests"] == 4
    generated = sum(r.new_tokens for r in batching.stream(batching.Config(requests=4)))
    assert [(row["method"], row["tokens"]) for row in document["rows"]] == [
        (method, generated) for method in ("continuous", "static", "recompute")]
    assert document["rows"][2]["steps"] == generated  # recompute: one pass per token
    assert [(r["numerator"], r["denominator"], r["bound"]) for r in document["ratios"]] == [
        ("continuous", "static", batching.SPEED_TARGET), ("continuous", "recompute", None),
        ("pages in use", "held", batching.MEMORY_TARGET), ("pages in use", "padded contiguous", None)]
    for ratio in document["ratios"]:
        assert math.isfinite(ratio["measured"]) and ratio["measured"] > 0  # no timing target is asserted: noisy


def test_the_recorded_run_is_the_stream_served_afresh():
    """docs/serve.json (the performance page's table): its tokens, steps and positions are those of the stream
    served now, and its ratios those of its rows; only the seconds are the record's own."""
    record = json.loads(docs.SERVE_JSON.read_text())
    config = batching.Config(**record["config"])
    model, requests = batching.model_of(config), batching.stream(config)
    served = batching._continuous(model, requests, config)
    generated = sum(r.new_tokens for r in requests)
    steps = {"continuous": len(served.steps), "static": batching.static_steps(requests, config.slots),
             "recompute": generated}
    assert [(row["method"], row["tokens"], row["steps"]) for row in record["rows"]] == [
        (method, generated, steps[method]) for method in ("continuous", "static", "recompute")]
    rows = [batching.MethodRow(**row) for row in record["rows"]]
    assert [row.tokens_per_s for row in rows] == pytest.approx([row.tokens / row.seconds for row in rows])
    fresh = batching.speed_ratios(rows) + batching.memory_ratios(served, requests, config)
    assert [timing.Ratio(**ratio) for ratio in record["ratios"]] == fresh  # JSON keeps a float exactly


def test_serve_stream_lengths_vary_tenfold():
    totals = [len(r.prompt) + r.new_tokens for r in batching.stream(batching.Config())]
    assert min(totals) >= 8 and max(totals) <= 80 and max(totals) >= 8 * min(totals)
