"""The paged key/value cache (SPEC 3b) on every backend: decoding through pages equals decoding with the
contiguous cache of a length per sequence, whatever the block table (pages shuffled, a pool shared by every
sequence, pages freed by one sequence and reused by another); NaN in every unused slot of the pool changes no
output bit; reading the pages a tile at a time changes nothing, whatever the tile; the pages are reserved before
extend writes them, and the errors say so; JAX serves every block table with one compiled step, and torch's decode
step compiles whole (fullgraph), one graph for every step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close
from tests.conftest import import_backend
from tests.test_cache import LLAMA, D, _module, _random

B, PAGE, PAGES, MAX_PAGES = 3, 2, 12, 5  # three sequences of up to 10 positions in a pool of 12 pages of 2
STEPS = ((2, 2, 0), (1, 2, 2), (0, 1, 1), (2, 1, 2), (2, 0, 1))  # each step's new positions per sequence (ragged
# chunks of two widths: JAX compiles a step per width)
SHUFFLED = np.array([[7, 2, 10, 0, 5], [11, 4, 1, -1, -1], [3, 8, 6, 9, -1]])  # every sequence's pages, any order


@functools.cache  # one program per backend, shared by the tests: JAX compiles it once per shape
def _extend(M: ModuleType) -> Callable:
    """block.extend(x, cache, new_lengths, mask) (JAX's under one jax.jit: the table and the lengths are data)."""
    def call(block, x, cache, new_lengths, mask=None):
        return block.extend(x, cache, mask, new_lengths=new_lengths)

    if M.__name__ != "attention_jax":
        return call
    import jax

    return jax.jit(call)


def _decode(M: ModuleType, block, cache, steps=STEPS, seed: int = 0, masked: bool = False,
            extend: Callable | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """STEPS through `cache` (paged: each step's pages reserved first) by `extend` (_extend's by default): the
    outputs and weights of every step; with `masked`, each step hides a drawn third of the keys, (B, 1, L,
    capacity) at their positions."""
    extend, outs, weights = extend or _extend(M), [], []
    for t, lengths in enumerate(steps):
        new = M.asarray(np.array(lengths, np.int32))
        if hasattr(cache, "block_table"):
            cache = cache.reserve(new)
        mask = np.random.default_rng(t).random((B, 1, max(lengths), PAGE * MAX_PAGES)) > 1 / 3 if masked else None
        out, w, cache = extend(block, M.asarray(_random(B, max(lengths), D, seed=seed + t)), cache, new,
                               None if mask is None else M.asarray(mask))
        outs.append(M.to_numpy(out))
        weights.append(M.to_numpy(w))
    return outs, weights


def _paged(M: ModuleType, block, table: np.ndarray | None = None, fill: float = 0.0):
    """An empty paged cache of the block, its pool filled with `fill` (NaN: every slot not yet written), its
    block table `table` where given (pages already placed, lengths 0)."""
    cache = block.init_paged_cache(B, PAGES, PAGE, MAX_PAGES, dtype=_float64(M))
    cache = cache._replace(k=M.asarray(np.full(cache.k.shape, fill)), v=M.asarray(np.full(cache.v.shape, fill)))
    if table is not None:
        cache = cache._replace(block_table=M.asarray(table.astype(np.int32 if M.__name__ == "attention_jax"
                                                                   else np.int64)))
    return cache


@pytest.mark.parametrize(("table", "masked"), [(None, False), (SHUFFLED, False), (SHUFFLED, True)],
                         ids=["in_order", "shuffled", "shuffled_masked"])
def test_decoding_through_pages_equals_the_contiguous_cache(backend: ModuleType, table, masked):
    block = _module(backend, "block", **LLAMA)  # RoPE at each sequence's positions, one key/value head
    paged_outs, paged_weights = _decode(backend, block, _paged(backend, block, table), masked=masked)
    contiguous = block.init_cache((B,), PAGE * MAX_PAGES)
    outs, weights = _decode(backend, block, contiguous._replace(length=backend.asarray(np.zeros(B, np.int32))),
                            masked=masked)
    for t, (got, expected) in enumerate(zip(paged_outs, outs, strict=True)):
        assert_close(got, expected, REORDERED, f"step {t}")
        assert_close(paged_weights[t], weights[t], REORDERED, f"step {t}'s weights")


@pytest.mark.parametrize("tile", [1, 6], ids=["a_page_a_tile", "three_pages_a_tile"])
def test_reading_several_pages_at_a_time_changes_nothing(backend: ModuleType, tile: int,
                                                         monkeypatch: pytest.MonkeyPatch):
    """Attention reads the pages a tile at a time (pages.TILE positions): one page per tile, or three with the
    table's last tile cut short (5 blocks), give what the contiguous cache gives. JAX reads pages.TILE when it
    traces: a fresh jax.jit here, so that the shared one, traced with another TILE, is not reused."""
    from attention_np.common import pages

    monkeypatch.setattr(pages, "TILE", tile)
    block = _module(backend, "block", **LLAMA)
    fresh = _extend.__wrapped__(backend)  # traced with this TILE
    paged_outs, paged_weights = _decode(backend, block, _paged(backend, block, SHUFFLED), masked=True, extend=fresh)
    contiguous = block.init_cache((B,), PAGE * MAX_PAGES)
    outs, weights = _decode(backend, block, contiguous._replace(length=backend.asarray(np.zeros(B, np.int32))),
                            masked=True)
    for t, (got, expected) in enumerate(zip(paged_outs, outs, strict=True)):
        assert_close(got, expected, REORDERED, f"step {t}")
        assert_close(paged_weights[t], weights[t], REORDERED, f"step {t}'s weights")


def test_nan_in_every_unused_slot_changes_no_output_bit(backend: ModuleType):
    block = _module(backend, "block", **LLAMA)
    clean = _decode(backend, block, _paged(backend, block, SHUFFLED, fill=0.0))
    dirty = _decode(backend, block, _paged(backend, block, SHUFFLED, fill=np.nan))
    for part, (got, expected) in enumerate(zip(dirty, clean, strict=True)):
        for t in range(len(STEPS)):
            np.testing.assert_array_equal(got[t], expected[t], err_msg=f"{('out', 'weights')[part]} of step {t}")


def test_a_page_freed_by_one_sequence_serves_another(backend: ModuleType):
    # sequence 0 finishes and releases its pages; a new request takes its slot and, the pool being small, pages
    # sequence 0 wrote; it decodes as if alone
    block = _module(backend, "block", **LLAMA)
    cache = block.init_paged_cache(B, 6, PAGE, MAX_PAGES, dtype=_float64(backend))
    extend = _extend(backend)
    first = backend.asarray(np.array([2, 2, 2], np.int32))
    for seed in (1, 2):  # four positions each: the six pages in use
        cache = cache.reserve(first)
        _, _, cache = extend(block, backend.asarray(_random(B, 2, D, seed=seed)), cache, first)
    freed = set(backend.to_numpy(cache.block_table)[0].tolist()) - {-1}
    cache = cache.release(np.array([0]))
    assert backend.to_numpy(cache.length).tolist() == [0, 4, 4]
    prompt = _random(1, 2, D, seed=3)
    x = np.concatenate([prompt, np.zeros((B - 1, 2, D))])
    again = backend.asarray(np.array([2, 0, 0], np.int32))
    cache = cache.reserve(again)
    assert set(backend.to_numpy(cache.block_table)[0].tolist()) - {-1} <= freed  # reused
    out, _, _ = extend(block, backend.asarray(x), cache, again)
    reference = _module(import_backend("attention_np"), "block", **LLAMA)  # the same state, one causal pass
    alone, _ = reference(prompt, np.tril(np.ones((2, 2), bool)))
    assert_close(backend.to_numpy(out)[0], alone[0], REORDERED, "the new request")


def _float64(M: ModuleType):
    return __import__("torch").float64 if M.__name__ == "attention_torch" else np.float64


def test_writing_without_a_reserved_page_and_an_exhausted_pool_raise(backend: ModuleType):
    block = _module(backend, "block")
    cache = block.init_paged_cache(2, 3, PAGE, 2, dtype=_float64(backend))
    x = backend.asarray(_random(2, 3, D))
    new = backend.asarray(np.array([3, 1], np.int32))
    with pytest.raises(ValueError, match=r"sequence 0 has no page for its positions 0 \.\. 2 .*cache\.reserve"):
        block.extend(x, cache, new_lengths=new)
    with pytest.raises(ValueError, match=r"the pool's 3 pages are all in use"):
        cache.reserve(backend.asarray(np.array([3, 3], np.int32)))
    with pytest.raises(ValueError, match=r"sequence 0 needs 3 pages of 2 positions, more than the block table's "
                                         r"max_pages = 2"):
        cache.reserve(backend.asarray(np.array([5, 0], np.int32)))


def test_mods_and_dropout_are_refused_not_ignored(backend: ModuleType):
    from attention_np.common import mods

    block = _module(backend, "block")
    cache = block.init_paged_cache(2, 4, PAGE, 2, dtype=_float64(backend))
    x = backend.asarray(_random(2, 1, D))
    with pytest.raises(ValueError, match="takes no mask_mod"):
        block.extend(x, cache.reserve(backend.asarray(np.array([1, 1], np.int32))), mask_mod=mods.causal())


@pytest.mark.slow  # dynamo traces the step (5 s on 2 cores, the first time in a process)
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
def test_torch_paged_decode_step_compiles_whole(need_weights: bool, monkeypatch: pytest.MonkeyPatch):
    """torch.compile(fullgraph=True) of a decode step through pages (a graph break raises) makes one graph for
    every step (a recompile raises), the block table and the lengths being data, with no operation whose shape
    is a value (nonzero) nor a value read on the host (item); it equals the eager step: outputs, weights, the
    pool (NaN in every unused slot: a padding row writes nothing new) and the lengths. The steps pause a sequence
    (a padding row) and free a finished one's pages for a new request. Tiles of 3 pages: the compiled step reads
    both tiles of the table, the eager one the first only, which holds every sequence's positions."""
    torch = pytest.importorskip("torch")
    from torch._dynamo.backends.registry import lookup_backend

    from attention_np.common import pages

    monkeypatch.setattr(pages, "TILE", 6)
    M = import_backend("attention_torch")
    block = _module(M, "block", **LLAMA)
    graphs = []

    def step(x, cache, new_lengths):
        return block.extend(x, cache, new_lengths=new_lengths, need_weights=need_weights)

    def aot_eager(graph, inputs):  # dynamo's graph, kept, then AOTAutograd's (the in-place writes functionalized)
        graphs.append(graph)
        return lookup_backend("aot_eager")(graph, inputs)

    compiled = torch.compile(step, fullgraph=True, backend=aot_eager)  # inductor: 13-23 s to compile on 2 cores
    prompts = M.asarray(np.array([2, 2, 1]))
    with torch.no_grad():  # decoding
        cache = _paged(M, block, SHUFFLED, fill=np.nan).reserve(prompts)
        _, _, cache = step(M.asarray(_random(B, 2, D)), cache, prompts)  # the prompts, eagerly
        eager = cache._replace(k=cache.k.clone(), v=cache.v.clone())
        for t, lengths in enumerate(((1, 1, 1), (1, 0, 1), (1, 1, 1), (0, 1, 1))):
            if t == 2:  # sequence 0 is done: its pages freed, a new request in its slot
                cache, eager = cache.release([0]), eager.release([0])
            new = M.asarray(np.array(lengths))
            cache, eager = cache.reserve(new), eager.reserve(new)
            x = M.asarray(_random(B, 1, D, seed=t + 1))
            with torch.compiler.set_stance("fail_on_recompile" if t else "default"):  # one graph for every step
                out, weights, cache = compiled(x, cache, new)
            expected, expected_weights, eager = step(x, eager, new)
            assert_close(out.numpy(), expected.numpy(), REORDERED, f"the compiled step {t}")
            if need_weights:
                assert_close(weights.numpy(), expected_weights.numpy(), REORDERED, f"the compiled step {t}'s weights")
            for name in ("k", "v"):
                assert_close(getattr(cache, name).numpy(), getattr(eager, name).numpy(), REORDERED, f"pool {name}")
            assert cache.length.tolist() == eager.length.tolist()
    assert cache.block_table[0].tolist() == [0, -1, -1, -1, -1]  # the new request took the lowest free page
    assert cache.length.max() <= 6  # every position in the first tile
    names = [getattr(node.target, "__name__", node.target) for node in graphs[0].graph.nodes]  # ops and methods
    read = [name for name in names if name in ("nonzero", "item", "tolist", "_local_scalar_dense")]
    assert len(graphs) == 1 and read == [], read


@pytest.mark.slow  # JAX compiles
def test_jax_serves_every_block_table_with_one_compiled_step():
    jax = pytest.importorskip("jax")
    M = import_backend("attention_jax")
    block = _module(M, "block", **LLAMA)
    traces = []

    def step(block, x, cache, new_lengths):
        traces.append(1)  # runs when JAX traces, not when the compiled program runs
        return block.extend(x, cache, new_lengths=new_lengths)

    step = jax.jit(step)
    for table in (None, SHUFFLED):
        cache = _paged(M, block, table)
        for t, lengths in enumerate(((2, 1, 0), (1, 2, 2))):
            new = M.asarray(np.array(lengths, np.int32))
            _, _, cache = step(block, M.asarray(_random(B, 2, D, seed=t)), cache.reserve(new), new)
    assert len(traces) == 1
