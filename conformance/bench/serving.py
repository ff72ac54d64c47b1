"""Continuous batching over the paged cache, and what `compare --variant serve` sets it against.

A tiny Llama-style decoder (random weights from a seed) serves a stream of requests, each a prompt of token ids
and a number of tokens to generate, greedily, in a fixed number of slots (the batch B). At every step of `serve`:
  1) waiting requests that have arrived join the free slots, first come first served, as long as the pool holds
     the pages of every live request's whole length and of theirs (admission: no request is ever short of a page);
  2) each layer's paged cache reserves the pages of this step's positions;
  3) two chunks go through the layers: the joining requests' whole prompts (a ragged chunk of their slots), then
     every slot's last token (`new_lengths` 1 where the slot decodes, 0 elsewhere);
  4) each live request takes the argmax of the logits at its last new position;
  5) finished requests leave, and their pages go back to the pool for the next ones.
Every layer has its own pool (`init_paged_cache`). `generate_alone` decodes one request with a contiguous cache:
the reference each request's tokens must equal (tests/test_serve.py). examples/serve.py runs it; this module is
its one copy, inside the installed package so that the benchmark can import it.

Shape legend: B slots (the batch), L positions of a step's chunk, D = d_model, V the vocabulary.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import attention_np as M


class Model(NamedTuple):
    """Token embedding (V, D), the decoder layers, the final RMSNorm's weight (D,) and eps, the LM head (D, V)."""

    embedding: np.ndarray
    blocks: tuple[M.TransformerBlock, ...]
    norm: np.ndarray
    eps: float
    head: np.ndarray


class Request(NamedTuple):
    """A prompt of token ids, the number of tokens to generate, and the step at which the request arrives."""

    prompt: tuple[int, ...]
    new_tokens: int
    arrival: int = 0


class Slot(NamedTuple):
    """A live request in a slot: its index in the stream, the tokens the next step feeds (the prompt when it
    joins, then its last token) and the tokens generated so far."""

    request: int
    feed: tuple[int, ...]
    generated: tuple[int, ...]


class Step(NamedTuple):
    """One step: the new positions per slot (new_lengths; a joining slot's prompt, 1 for every other live slot), and
    what it left behind: the positions each live request holds (its prompt and every token but the last it
    generated), the pages in use in each layer's pool, and the request in each slot during the step (its index in
    the stream; -1 for a free slot)."""

    new_lengths: tuple[int, ...]
    positions: tuple[int, ...]
    pages_in_use: tuple[int, ...]
    requests: tuple[int, ...] = ()


class Served(NamedTuple):
    """Each request's generated tokens, in the stream's order, and a Step per step."""

    tokens: list[list[int]]
    steps: list[Step]


def tiny_llama(*, vocab: int, d_model: int, n_layers: int, num_heads: int, num_kv_heads: int, d_ff: int,
               rope_theta: float = 10000.0, rng: int = 0, dtype: type = np.float64) -> Model:
    """A Llama-style decoder of random weights from the seed `rng`, in eval mode."""
    generator = np.random.default_rng(rng)
    blocks = tuple(M.TransformerBlock(d_model, num_heads, d_ff, norm_first=True, norm="rms", activation="swiglu",
                                      bias=False, num_kv_heads=num_kv_heads, rope_theta=rope_theta,
                                      rng=int(generator.integers(2**31)), dtype=dtype).eval()
                   for _ in range(n_layers))
    embedding = generator.standard_normal((vocab, d_model)).astype(dtype)  # (V, D)
    head = generator.standard_normal((d_model, vocab)).astype(dtype) / math.sqrt(d_model)  # (D, V)
    return Model(embedding, blocks, norm=np.ones(d_model, dtype), eps=1e-5, head=head)


def layers(blocks: tuple, x: np.ndarray, caches: list, new_lengths: np.ndarray | None) -> tuple[np.ndarray, list]:
    """A chunk x (B, L, D) through the decoder layers, each extending its own cache: x (B, L, D) and the caches.
    serve and logits take another function of these arguments (`layers=`): a compiled one (tests/test_serve.py
    runs a stream of JAX blocks under one jax.jit of this one)."""
    extended = []
    for block, cache in zip(blocks, caches, strict=True):
        x, _, cache = block.extend(x, cache, new_lengths=new_lengths, need_weights=False)  # (B, L, D)
        extended.append(cache)
    return x, extended


def logits(model: Model, tokens: np.ndarray, caches: list, new_lengths: np.ndarray | None = None, *,
           layers: Callable = layers) -> tuple[np.ndarray, list]:
    """The logits (B, V) at each sequence's last new position of a chunk of tokens (B, L) after the positions in the
    caches (one per layer), and the caches holding the chunk too; new_lengths (B,): sequence b's first
    new_lengths[b] tokens (None: all L). The head runs on those B positions only: greedy decoding reads no other."""
    x, extended = layers(model.blocks, model.embedding[tokens], caches, new_lengths)  # (B, L) -> (B, L, D)
    x = np.asarray(x)  # another backend's blocks: the head in NumPy
    B, L, _ = x.shape
    last = np.full(B, L - 1) if new_lengths is None else np.maximum(new_lengths - 1, 0)  # (B,); a free slot: 0
    return _head(model, x[np.arange(B), last][:, None])[:, 0], extended  # (B, 1, D) -> (B, V)


def _head(model: Model, x: np.ndarray) -> np.ndarray:
    """The logits (B, L, V) of the last layer's outputs (B, L, D): the final RMSNorm, then the LM head."""
    # RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight
    x = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + model.eps) * model.norm  # (B, L, D)
    return x @ model.head  # (B, L, D) x (D, V) -> (B, L, V)


def generate_alone(model: Model, prompt: tuple[int, ...], n: int) -> list[int]:
    """n tokens after `prompt`, greedily, one request with a contiguous cache: the reference for `serve`."""
    caches = [block.init_cache((1,), capacity=len(prompt) + n) for block in model.blocks]
    feed, generated = np.array([prompt]), []  # (1, L)
    while len(generated) < n:
        scores, caches = logits(model, feed, caches)  # (1, V)
        generated.append(int(np.argmax(scores[0])))
        feed = np.array([[generated[-1]]])  # (1, 1)
    return generated


def serve(model: Model, requests: list[Request], *, slots: int, page_size: int, num_pages: int,
          layers: Callable = layers) -> Served:
    """Every request's tokens, served by continuous batching in `slots` slots over paged caches of num_pages pages
    of page_size positions (one pool per layer), and what each step left in the pools; `layers` runs each step's
    chunks through the layers (see `layers`)."""
    whole = [-(-(len(r.prompt) + r.new_tokens) // page_size) for r in requests]  # ceil: each request's pages
    if whole and max(whole) > num_pages:
        i = whole.index(max(whole))
        raise ValueError(f"request {i} needs {whole[i]} pages of {page_size} positions; the pool has {num_pages}: "
                         "it could never join")
    max_pages = max(whole, default=1)
    caches = [block.init_paged_cache(slots, num_pages, page_size, max_pages) for block in model.blocks]
    waiting = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
    live: list[Slot | None] = [None] * slots
    tokens: list[list[int]] = [[] for _ in requests]
    steps: list[Step] = []
    while waiting or any(s is not None for s in live):
        live = _join(live, waiting, requests, now=len(steps), whole=whole, num_pages=num_pages)
        new_lengths = np.array([0 if s is None else len(s.feed) for s in live])  # (B,)
        in_slots = tuple(-1 if s is None else s.request for s in live)
        live, caches = _step(model, live, caches, new_lengths, layers)
        live, caches, done = _leave(live, caches, requests)
        for slot in done:
            tokens[slot.request] = list(slot.generated)
        steps.append(_record(new_lengths, live, caches, requests)._replace(requests=in_slots))
    return Served(tokens, steps)


def _join(live: list[Slot | None], waiting: deque, requests: list[Request], *, now: int, whole: list[int],
          num_pages: int) -> list[Slot | None]:
    """The slots with the arrived waiting requests, first come first served, in the free ones, while the pool of
    num_pages holds the pages of every live request's whole length (prompt and new tokens; whole[i] pages for
    request i) and of the next one's: pages are taken as the positions come, but promised at admission."""
    live = list(live)
    promised = sum(whole[s.request] for s in live if s is not None)
    for b, slot in enumerate(live):
        if slot is None and waiting and requests[waiting[0]].arrival <= now:
            if promised + whole[waiting[0]] > num_pages:
                break  # first come first served: the next request waits for pages
            i = waiting.popleft()
            live[b], promised = Slot(request=i, feed=tuple(requests[i].prompt), generated=()), promised + whole[i]
    return live


def _step(model: Model, live: list[Slot | None], caches: list, new_lengths: np.ndarray,
          layers: Callable) -> tuple[list[Slot | None], list]:
    """One step of the live slots, new_lengths (B,) their feeds, as two chunks, so that no one-token row is padded to a
    prompt's length: the joining prompts, a ragged chunk of their slots alone (b, L); then every slot's last token,
    a chunk (B, 1) of every slot (new length 1 where the slot decodes, 0 elsewhere: a compiled step keeps one
    shape). Each slot's next token."""
    caches = [cache.reserve(new_lengths) for cache in caches]
    scores = np.zeros((len(live), model.head.shape[1]), model.head.dtype)  # (B, V)
    joining = np.array([b for b, s in enumerate(live) if s is not None and not s.generated], np.int64)
    if joining.size:
        chunk = np.zeros((joining.size, new_lengths[joining].max()), np.int64)  # (b, L), padding token 0
        for i, b in enumerate(joining.tolist()):
            chunk[i, :new_lengths[b]] = live[b].feed
        scores[joining], parts = logits(model, chunk, [_rows_of(cache, joining) for cache in caches],
                                        new_lengths[joining], layers=layers)
        caches = [_with_rows(cache, joining, part, new_lengths) for cache, part in zip(caches, parts, strict=True)]
    decoding = np.array([s is not None and bool(s.generated) for s in live])  # (B,)
    if decoding.any():
        chunk = np.array([[s.feed[0] if d else 0] for s, d in zip(live, decoding, strict=True)])  # (B, 1)
        decoded, caches = logits(model, chunk, caches, decoding.astype(new_lengths.dtype), layers=layers)
        scores[decoding] = decoded[decoding]
    after = [None if s is None else _advance(s, scores[b]) for b, s in enumerate(live)]
    return after, caches


def _rows_of(cache: M.PagedKVCache, rows: np.ndarray) -> M.PagedKVCache:
    """The paged cache of some of its sequences (indices `rows`): their rows of the block table and lengths, the
    same pool."""
    return cache._replace(block_table=cache.block_table[rows], length=cache.length[rows])


def _with_rows(cache: M.PagedKVCache, rows: np.ndarray, part: M.PagedKVCache, added: np.ndarray) -> M.PagedKVCache:
    """The cache after `part` (from _rows_of(cache, rows)) took added[rows] positions of those sequences: its pool,
    and their lengths grown (in the cache's own array type: any backend's cache)."""
    grown = np.zeros(len(added), np.asarray(cache.length).dtype)
    grown[rows] = added[rows]
    return cache._replace(k=part.k, v=part.v, length=cache.length + grown)


def _advance(slot: Slot, scores: np.ndarray) -> Slot:
    """The slot after a step: its greedy token, argmax over the logits (V,), generated and fed next."""
    token = int(np.argmax(scores))
    return slot._replace(feed=(token,), generated=(*slot.generated, token))


def _leave(live: list[Slot | None], caches: list,
           requests: list[Request]) -> tuple[list[Slot | None], list, list[Slot]]:
    """The slots without the finished requests, the caches with their pages released, and the finished slots."""
    done = [b for b, s in enumerate(live) if s is not None and len(s.generated) == requests[s.request].new_tokens]
    left = [None if b in done else s for b, s in enumerate(live)]
    return left, [cache.release(np.array(done, np.int64)) for cache in caches], [live[b] for b in done]


def _record(new_lengths: np.ndarray, live: list[Slot | None], caches: list, requests: list[Request]) -> Step:
    """The step's record: the positions of the live requests counted from their tokens, the pages from the tables."""
    positions = [len(requests[s.request].prompt) + len(s.generated) - 1 for s in live if s is not None]
    in_use = [int((cache.block_table != -1).sum()) for cache in caches]  # -1: no page
    return Step(new_lengths=tuple(new_lengths.tolist()), positions=tuple(positions), pages_in_use=tuple(in_use))


# --- what continuous batching is measured against ---------------------------------------------------------------


def static(model: Model, requests: list[Request], *, slots: int) -> list[list[int]]:
    """Every request's tokens by static batching with padding: batches of `slots` requests in arrival order (each
    batch starts once the one before has finished; arrival steps are not waited on), each served by `_padded`."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    tokens: list[list[int]] = [[] for _ in requests]
    for first in range(0, len(order), slots):
        batch = order[first:first + slots]
        for i, generated in zip(batch, _padded(model, [requests[i] for i in batch]), strict=True):
            tokens[i] = generated
    return tokens


def _padded(model: Model, batch: list[Request]) -> list[list[int]]:
    """One static batch: the prompts padded to the longest (token 0, past each prompt's length), a contiguous
    cache per layer of the longest prompt plus the most new tokens, and every request stepping until the
    batch's longest is done; each request keeps its first new_tokens."""
    B, P = len(batch), max(len(r.prompt) for r in batch)
    steps = max(r.new_tokens for r in batch)
    caches = [block.init_cache((B,), capacity=P + steps) for block in model.blocks]
    feed = np.zeros((B, P), np.int64)  # (B, L): the prompts, padded
    for b, r in enumerate(batch):
        feed[b, :len(r.prompt)] = r.prompt
    new_lengths = np.array([len(r.prompt) for r in batch])  # (B,)
    generated = np.zeros((B, steps), np.int64)
    for t in range(steps):
        scores, caches = logits(model, feed, caches, new_lengths)  # (B, V)
        generated[:, t] = np.argmax(scores, axis=-1)  # (B, V) -> (B,)
        feed, new_lengths = generated[:, t:t + 1], np.ones(B, np.int64)  # (B, 1): every slot steps
    return [generated[b, :r.new_tokens].tolist() for b, r in enumerate(batch)]


def recompute(model: Model, requests: list[Request]) -> list[list[int]]:
    """Every request's tokens without a cache, one request at a time: each new token runs the whole sequence so
    far through the layers (a causal pass of its p positions)."""
    return [_recomputed(model, r.prompt, r.new_tokens) for r in requests]


def _recomputed(model: Model, prompt: tuple[int, ...], n: int) -> list[int]:
    sequence = list(prompt)
    while len(sequence) < len(prompt) + n:
        p = len(sequence)
        x = model.embedding[np.array([sequence])]  # (1, L) -> (1, L, D), L = p
        for block in model.blocks:
            x = block(x, M.causal_mask(p, p), need_weights=False)[0]  # (1, L, D)
        sequence.append(int(np.argmax(_head(model, x[:, -1:])[0, -1])))  # (1, 1, V) -> the greedy token
    return sequence[len(prompt):]
