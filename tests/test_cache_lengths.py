"""A length per sequence in the key/value cache (SPEC 3a): a batch of prompts of different lengths prefilled in
one call (new_lengths, no left padding), then ragged chunks and single steps; each sequence's outputs equal one
causal pass over that sequence alone, its padding rows are zeros, its RoPE positions its own; the errors of a
ragged chunk; JAX serves every new_lengths with one compiled step."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close, method_program
from tests.conftest import import_backend
from tests.test_cache import LLAMA, D, H, _module, _random

PROMPTS = (5, 2, 0)  # the prompts' lengths: one of them empty
CHUNKS = ((1, 2, 2), (1, 1, 1))  # then a ragged chunk of two rows, and one step for every sequence
CAPACITY = 9
OPTIONS = {"plain": {}, "llama": LLAMA}  # LLAMA: RoPE (each sequence at its own positions), one key/value head
ATTENTION = ("num_kv_heads", "rope_theta")  # the options of LLAMA that MultiHeadAttention takes


def _extend(M: ModuleType, kind: str) -> Callable:
    """extend(module, x, cache, new_lengths) of self-attention (MultiHeadAttention's x_kv is x); JAX's under one
    jax.jit (eagerly each primitive compiles apart at every shape, tests/_compare.py's method_program)."""
    def call(module, x, cache, new_lengths):
        x_kv = (x,) if kind == "mha" else ()
        return module.extend(x, *x_kv, cache, new_lengths=new_lengths)

    if M.__name__ != "attention_jax":
        return call
    import jax

    return jax.jit(call)


def _steps(M: ModuleType, module, kind: str) -> tuple[list[np.ndarray], list[np.ndarray], object]:
    """The prompts in one call, then CHUNKS: each call's inputs (B, rows, D) and outputs, and the cache."""
    B, cache, extend = len(PROMPTS), module.init_cache((len(PROMPTS),), CAPACITY), _extend(M, kind)
    inputs, outs = [], []
    for seed, lengths in enumerate((PROMPTS, *CHUNKS)):
        x = _random(B, max(lengths), D, seed=10 + seed)
        out, _, cache = extend(module, M.asarray(x), cache, M.asarray(np.array(lengths, np.int32)))
        inputs.append(x)
        outs.append(M.to_numpy(out))
    return inputs, outs, cache


def _alone(M: ModuleType, module, kind: str, x: np.ndarray) -> np.ndarray:
    """One causal pass over one sequence x (1, n, D), the reference: the module's own __call__."""
    n, x = x.shape[1], M.asarray(x)
    args = (x, x, x) if kind == "mha" else (x,)
    return M.to_numpy(method_program(M, "__call__")(module, *args, M.causal_mask(n, n))[0])[0]


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("kind", ["mha", "block"])
def test_each_sequence_equals_its_own_causal_pass_and_padding_rows_are_zeros(backend: ModuleType, kind, options):
    options = {name: value for name, value in options.items() if kind == "block" or name in ATTENTION}
    module = _module(backend, kind, **options)
    inputs, outs, cache = _steps(backend, module, kind)
    for b in range(len(PROMPTS)):
        lengths = [lengths[b] for lengths in (PROMPTS, *CHUNKS)]
        sequence = np.concatenate([x[b, :n] for x, n in zip(inputs, lengths, strict=True)])[None]  # (1, n, D)
        got = np.concatenate([out[b, :n] for out, n in zip(outs, lengths, strict=True)])
        assert_close(got, _alone(backend, module, kind, sequence), REORDERED, f"sequence {b}")
        for out, n in zip(outs, lengths, strict=True):
            np.testing.assert_array_equal(out[b, n:], 0)  # its padding rows
    np.testing.assert_array_equal(backend.to_numpy(cache.length), np.sum([PROMPTS, *CHUNKS], axis=0))


def test_the_weights_of_a_padding_row_and_past_each_sequence_are_zeros(backend: ModuleType):
    mha = _module(backend, "mha")
    x = backend.asarray(_random(3, 3, D))
    _, weights, _ = _extend(backend, "mha")(mha, x, mha.init_cache((3,), 5),
                                            backend.asarray(np.array([3, 1, 0], np.int32)))
    weights = backend.to_numpy(weights)  # (B, H, L, capacity)
    assert weights.shape == (3, H, 3, 5)
    np.testing.assert_array_equal(weights[1, :, 1:], 0)  # sequence 1's padding rows
    np.testing.assert_array_equal(weights[2], 0)  # sequence 2 took no row
    np.testing.assert_array_equal(weights[1, :, 0, 1:], 0)  # its one query sees its one key alone
    np.testing.assert_allclose(weights[1, :, 0, 0], 1, rtol=0, atol=1e-15)
    assert_close(weights[0, :, :, 3:], np.zeros((H, 3, 2)), REORDERED, "past sequence 0")


@pytest.mark.parametrize(("lengths", "error", "words"), [
    ((4, 1), ValueError, ("new_lengths", "0 .. L = 3", "4")),
    ((-1, 1), ValueError, ("new_lengths", "-1")),
    ((1.0, 1.0), TypeError, ("new_lengths", "float")),
    ((1, 1, 1), ValueError, ("new_lengths", "(2,)", "(3,)")),
], ids=["past_the_chunk", "negative", "floating", "not_one_per_sequence"])
def test_new_lengths_outside_the_chunk_or_not_one_integer_per_sequence_raise(backend: ModuleType, lengths, error,
                                                                             words):
    mha = _module(backend, "mha")
    x = backend.asarray(_random(2, 3, D))
    with pytest.raises(error) as raised:
        mha.extend(x, x, mha.init_cache((2,), 8), new_lengths=backend.asarray(np.array(lengths)))
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_a_sequence_past_the_capacity_raises_naming_it(backend: ModuleType):
    block = _module(backend, "block")
    x = backend.asarray(_random(2, 4, D))
    _, _, cache = _extend(backend, "block")(block, x, block.init_cache((2,), 6),
                                            backend.asarray(np.array([1, 4], np.int32)))
    with pytest.raises(ValueError, match=r"sequence \(1,\): its capacity is 6 positions, 4 are filled, and extend "
                                         r"asks for 3 more"):
        block.extend(x[:, :3], cache, new_lengths=backend.asarray(np.array([3, 3])))


@pytest.mark.slow  # JAX compiles
def test_jax_serves_every_new_lengths_with_one_compiled_step():
    jax = pytest.importorskip("jax")
    M = import_backend("attention_jax")
    block = _module(M, "block", **LLAMA)
    traces = []

    def step(block, x, cache, new_lengths):
        traces.append(1)  # runs when JAX traces, not when the compiled program runs
        return block.extend(x, cache, new_lengths=new_lengths)

    step = jax.jit(step)
    x = M.asarray(_random(3, 2, D))
    zeros = M.asarray(np.zeros(3, np.int32))  # a length per sequence from the start: the step's one pytree
    cache = block.init_cache((3,), CAPACITY)._replace(length=zeros)
    outs = []
    for lengths in ((2, 1, 0), (0, 2, 1), (1, 1, 2)):
        out, _, cache = step(block, x, cache, M.asarray(np.array(lengths, np.int32)))
        outs.append((M.to_numpy(out), lengths))
    assert len(traces) == 1
    np.testing.assert_array_equal(M.to_numpy(cache.length), [3, 4, 3])
    reference = _module(import_backend("attention_np"), "block", **LLAMA)  # the same state in NumPy
    expected_cache = reference.init_cache((3,), CAPACITY)
    for out, lengths in outs:  # the compiled steps equal NumPy's
        expected, _, expected_cache = reference.extend(M.to_numpy(x), expected_cache, new_lengths=np.array(lengths))
        assert_close(out, expected, REORDERED, f"the compiled step {lengths}")
