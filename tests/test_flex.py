"""flex_attention on every backend against torch's own FlexAttention (torch.nn.attention.flex_attention, eager,
CPU, float64): every entry of the catalogue and compositions of them, over tiles that do and do not divide L and
S, values, log-sum-exp and gradients (the score functions' parameters included) within 1e-12; grouped-query
heads; queries that see no key; the work the block mask saves (empty tiles never computed, the mask function
evaluated on partial tiles only); a user's own mods in the framework's functions.

torch's flex_attention refuses a backward pass on the CPU (`_validate_device`): its compiled kernels have none
there. Its eager pass, which the references below use, is torch's dense math (`sdpa_dense` and
`sdpa_dense_backward` of torch._higher_order_ops.flex_attention), which has one, so the gradient references lift
that guard for the duration of a test. Eager flex_attention first traces the mods with dynamo (half a second a
call); the references without gradients call the same dense pass on the mods as they are
(`_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`), which gives the traced call's values bit for bit
(test_torch_reference_is_the_same_without_dynamos_trace); the gradients of a score function's parameters need
the trace, which lifts the tensors the mods hold, and those references alone trace.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import pytest

from attention_np.common import mods
from attention_np.common.block_mask import EMPTY, FULL, PARTIAL
from tests._compare import REORDERED, assert_close, converted

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

RTOL = REORDERED  # float64: the same math computed another way (1e-12)
B, H, HKV, L, S, E, EV = 2, 4, 2, 9, 11, 4, 3
ODD_TILES = ((2, 3), (4, 7))  # (block_q, block_k) that divide neither L nor S: every case runs in both
EDGE_TILES = ((1, 1), (128, 128))  # one query and one key per tile; one tile for everything: some cases
SEGMENTS = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 2, 3, 3, 3]])  # (B, S)


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


# every catalogue entry once (with its parameters in each form), then compositions: (mask_mod, score_mod)
CASES: dict[str, tuple[Any, Any]] = {
    "none": (None, None),
    "noop": (mods.noop_mask, None),
    "causal": (mods.causal(), None),
    "causal_offset": (mods.causal(q_offset=np.array([2, 0])), None),
    "sliding_window": (mods.sliding_window(2, 1), None),
    "sliding_window_left": (mods.sliding_window(3, None, q_offset=1), None),
    "key_lengths": (mods.key_lengths(np.array([5, 11])), None),
    "key_lengths_per_head": (mods.key_lengths(np.array([[3, 0, 7, 11], [1, 2, 9, 4]])), None),
    "document": (mods.document(SEGMENTS[:, :L], SEGMENTS), None),
    "document_shared": (mods.document(SEGMENTS[0, :L], SEGMENTS[0]), None),
    "prefix_lm": (mods.prefix_lm(np.array([3, 6])), None),
    "chunked": (mods.chunked(4), None),
    "dilated": (mods.dilated(3, 2), None),
    "alibi": (None, mods.alibi(2.0 ** -np.arange(1, H + 1))),
    "softcap": (None, mods.softcap(0.8)),
    "relative_bias": (None, mods.relative_bias(_random(H, 7, seed=9))),
    "and": (mods.and_masks(mods.causal(), mods.document(SEGMENTS[:, :L], SEGMENTS)), mods.softcap(1.5)),
    "or": (mods.or_masks(mods.chunked(3), mods.dilated(2, 3)), mods.alibi(np.full(H, 0.3))),
    "nested": (mods.and_masks(mods.or_masks(mods.prefix_lm(2), mods.sliding_window(1, 1)), mods.key_lengths(8)),
               mods.relative_bias(_random(H, 3, seed=10))),
    "empty_or": (mods.or_masks(), None),  # no key visible anywhere: zeros, lse -inf
}


# the cases whose gradients the tests compare with torch's (a grouped-heads one too): their references take the
# gradients in the same call of torch's flex_attention as out and lse
GRADIENT_CASES = ("none", "causal", "document", "alibi", "softcap", "relative_bias", "and", "or", "nested", "empty_or")
GROUPED_GRADIENT_CASES = ("nested",)


def _inputs(kv_heads: int = H) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _random(B, H, L, E), _random(B, kv_heads, S, E, seed=1), _random(B, kv_heads, S, EV, seed=2)


class Reference(NamedTuple):
    """What torch's flex_attention gives for one case: out and lse, and, where a d_out was given, the gradients
    of sum(out * d_out) with respect to q, k, v (grads) and the score function's parameters (d_parameters)."""

    out: np.ndarray
    lse: np.ndarray
    grads: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    d_parameters: dict[str, np.ndarray] | None = None


def _torch_reference(q, k, v, mask_mod, score_mod, *, scale=0.7, enable_gqa=False, d_out=None,
                     traced: bool | None = None) -> Reference:
    """torch's own flex_attention: out and lse and, given d_out, the gradients of sum(out * d_out) with respect
    to q, k, v and the score function's parameters, from one call. `traced` (default: where the gradients of a
    score function's parameters are asked for, which need it; see the module's docstring) runs torch's dynamo
    over the mods first, as eager flex_attention does by default, most of a call's cost."""
    tensors = [torch.tensor(x, requires_grad=d_out is not None) for x in (q, k, v)]
    parameters = {name: torch.tensor(np.asarray(value, dtype=np.float64), requires_grad=True)
                  for name, value in getattr(score_mod, "parameters", {}).items()} if d_out is not None else {}
    traced = bool(parameters) if traced is None else traced
    if parameters:
        score_mod = score_mod.replace(**parameters)
    block_mask = None if mask_mod is None else flex.create_block_mask(mask_mod, B, H, L, S, device="cpu",
                                                                      BLOCK_SIZE=4)
    guard = flex._validate_device
    # eager flex_attention still runs its operation through dynamo, which, once a later call brings other sizes or
    # closure values, retraces them as symbols: array-api-compat's clip and softcap's float then fail inside torch
    static = torch._dynamo.config.patch(automatic_dynamic_shapes=False, specialize_float=True)
    untraced = flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    with warnings.catch_warnings(), static:
        warnings.simplefilter("ignore")  # eager flex_attention's advice to compile it
        try:
            flex._validate_device = lambda *args: None  # the eager pass has a backward on the CPU: see above
            flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = not traced  # the same dense pass, without dynamo's trace
            out, lse = flex.flex_attention(*tensors, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                           enable_gqa=enable_gqa, return_lse=True)
        finally:
            flex._validate_device = guard
            flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = untraced
    values = {"out": out.detach().numpy(), "lse": lse.detach().numpy()}
    if d_out is None:
        return Reference(**values)
    grads = torch.autograd.grad(out, [*tensors, *parameters.values()], torch.tensor(d_out), allow_unused=True)
    grads = [np.zeros(x.shape) if g is None else g.numpy() for g, x in zip(grads, [*tensors, *parameters.values()],
                                                                           strict=True)]
    return Reference(**values, grads=tuple(grads[:3]), d_parameters=dict(zip(parameters, grads[3:], strict=True)))


def _reference_of(name: str, *, enable_gqa: bool = False) -> Reference:
    """_torch_reference of CASES[name] on _inputs(), with the gradients (d_out seed 3) for the names of
    GRADIENT_CASES (GROUPED_GRADIENT_CASES with enable_gqa), computed once per process: the inputs are fixed by the
    name, and every backend, tile size and function (tests/test_mods_attention.py's too) compares with the same
    reference."""
    return _cached_reference(name, enable_gqa)  # one key however enable_gqa is passed (functools.cache keys
    # _reference_of(name) and _reference_of(name, enable_gqa=False) apart)


@functools.cache
def _cached_reference(name: str, enable_gqa: bool) -> Reference:
    q, k, v = _inputs(kv_heads=HKV if enable_gqa else H)
    gradients = name in (GROUPED_GRADIENT_CASES if enable_gqa else GRADIENT_CASES)
    d_out = _random(B, H, L, EV, seed=3) if gradients else None
    return _torch_reference(q, k, v, *CASES[name], enable_gqa=enable_gqa, d_out=d_out)


def test_torch_reference_is_the_same_without_dynamos_trace():
    # the references with the gradients of a score function's parameters are traced calls (the default of eager
    # flex_attention): the untraced call that the other references are gives their out and lse bit for bit, with
    # masks, score functions and grouped heads
    cases = [(name, False) for name in GRADIENT_CASES] + [(name, True) for name in GROUPED_GRADIENT_CASES]
    cases = [(name, enable_gqa) for name, enable_gqa in cases if getattr(CASES[name][1], "parameters", None)]
    assert len(cases) == 5  # alibi, relative_bias, or, nested, and nested with grouped heads
    for name, enable_gqa in cases:
        q, k, v = _inputs(kv_heads=HKV if enable_gqa else H)
        traced = _reference_of(name, enable_gqa=enable_gqa)
        untraced = _torch_reference(q, k, v, *CASES[name], enable_gqa=enable_gqa, traced=False)
        np.testing.assert_array_equal(untraced.out, traced.out, f"{name} out")
        np.testing.assert_array_equal(untraced.lse, traced.lse, f"{name} lse")
    # and the gradients of q, k, v where no parameter asks for the trace: "and" (a mask and a score function),
    # whose reference is untraced, against the traced call
    untraced = _reference_of("and")
    traced = _torch_reference(*_inputs(), *CASES["and"], d_out=_random(B, H, L, EV, seed=3), traced=True)
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), (untraced.out, untraced.lse, *untraced.grads),
                          (traced.out, traced.lse, *traced.grads), strict=True):
        np.testing.assert_array_equal(a, b, f"and {what}")


def _gradients_of(name: str, *, enable_gqa: bool = False) -> tuple[tuple, dict[str, np.ndarray]]:
    """(dq, dk, dv) and the parameters' gradients of _reference_of(name)."""
    reference = _reference_of(name, enable_gqa=enable_gqa)
    assert reference.grads is not None, f"{name}: its reference takes no gradients (GRADIENT_CASES)"
    return reference.grads, reference.d_parameters


def _ours(M: ModuleType, q, k, v, mask_mod, score_mod, tiles, **options) -> tuple[np.ndarray, np.ndarray]:
    block_mask = None if mask_mod is None else M.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=tiles)
    out, lse = M.flex_attention(*(M.asarray(x) for x in (q, k, v)), score_mod=score_mod, block_mask=block_mask,
                                return_lse=True, **{name: converted(M, x) for name, x in options.items()})
    return M.to_numpy(out), M.to_numpy(lse)


def _one_tiling_in_jax(M: ModuleType, tiles: tuple[int, int]) -> None:
    """JAX compiles a program for each case and tiling (a second or so each); its tile loop is one program for
    every tiling (tests/test_flex_jax.py holds it to that), so JAX runs the cases in one odd tiling, (4, 7)."""
    if M.__name__ == "attention_jax" and tiles != ODD_TILES[-1]:
        pytest.skip("JAX: one odd tiling, (4, 7)")


@pytest.mark.parametrize(("name", "tiles"), [(name, tiles) for name in CASES for tiles in ODD_TILES]
                         + [(name, tiles) for name in ("causal", "document", "and", "nested", "empty_or")
                            for tiles in EDGE_TILES])
def test_equals_torch_flex_attention(backend, name, tiles):
    _one_tiling_in_jax(backend, tiles)
    mask_mod, score_mod = CASES[name]
    q, k, v = _inputs()
    expected = _reference_of(name)
    out, lse = _ours(backend, q, k, v, mask_mod, score_mod, tiles if mask_mod is not None else 128, scale=0.7)
    assert_close(out, expected.out, RTOL, f"{name} out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected.lse), f"{name}: lse -inf where no key")
    finite = np.isfinite(expected.lse)
    assert_close(lse[finite], expected.lse[finite], RTOL, f"{name} lse")


@pytest.mark.parametrize("name", ["causal", "document", "alibi", "and", "nested"])
def test_grouped_query_heads_equal_torch(backend, name):
    mask_mod, score_mod = CASES[name]
    q, k, v = _inputs(kv_heads=HKV)
    expected_out = _reference_of(name, enable_gqa=True).out
    out, _ = _ours(backend, q, k, v, mask_mod, score_mod, (2, 3), scale=0.7, enable_gqa=True)
    assert_close(out, expected_out, RTOL, name)


@pytest.mark.parametrize("tiles", [(2, 3), (4, 7)])
@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_gradients_equal_torch(backend, name, tiles):
    _one_tiling_in_jax(backend, tiles)
    mask_mod, score_mod = CASES[name]
    q, k, v = _inputs()
    d_out = _random(B, H, L, EV, seed=3)
    (dq, dk, dv), d_parameters = _gradients_of(name)
    block_mask = None if mask_mod is None else backend.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=tiles)
    _, _, pullback = backend.flex_attention_vjp(*(backend.asarray(x) for x in (q, k, v)), score_mod=score_mod,
                                                block_mask=block_mask, scale=0.7)
    ours = pullback(backend.asarray(d_out))
    for what, actual, expected in zip(("dq", "dk", "dv"), ours[:3], (dq, dk, dv), strict=True):
        assert_close(backend.to_numpy(actual), expected, RTOL, f"{name} {what}")
    assert set(ours[3]) == set(d_parameters), f"{name}: the score function's parameters"
    for parameter, expected in d_parameters.items():
        assert_close(backend.to_numpy(ours[3][parameter]), expected, RTOL, f"{name} d{parameter}")


def test_grouped_query_gradients_equal_torch(backend):
    mask_mod, score_mod = CASES["nested"]
    q, k, v = _inputs(kv_heads=HKV)
    d_out = _random(B, H, L, EV, seed=3)
    (dq, dk, dv), d_parameters = _gradients_of("nested", enable_gqa=True)
    block_mask = backend.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=(2, 3))
    _, _, pullback = backend.flex_attention_vjp(*(backend.asarray(x) for x in (q, k, v)), score_mod=score_mod,
                                                block_mask=block_mask, scale=0.7, enable_gqa=True)
    ours = pullback(backend.asarray(d_out))
    for what, actual, expected in zip(("dq", "dk", "dv"), ours[:3], (dq, dk, dv), strict=True):
        assert_close(backend.to_numpy(actual), expected, RTOL, what)
    assert_close(backend.to_numpy(ours[3]["table"]), d_parameters["table"], RTOL, "dtable")


def test_a_query_that_sees_no_key_gets_zeros_and_lse_minus_inf(backend):
    q, k, v = _inputs()
    hidden = mods.key_lengths(np.array([[3, 0, 7, 11], [1, 2, 9, 4]]))  # batch 0, head 1 sees nothing
    out, lse = _ours(backend, q, k, v, hidden, None, (4, 4), scale=0.7)
    np.testing.assert_array_equal(out[0, 1], 0.0)
    np.testing.assert_array_equal(lse[0, 1], -np.inf)
    assert np.all(np.isfinite(lse[1]))


def test_a_score_of_minus_inf_hides_the_key(backend):
    q, k, v = _inputs()
    hide_odd = mods.ScoreMod("hide odd keys", lambda score, b, h, q_idx, kv_idx:
                             score + _minus_inf_where(kv_idx % 2 == 1, score),
                             derivative=lambda d_new, score, *indices: (d_new, {}))
    expected = _ours(backend, q, k, v, mods.and_masks(lambda b, h, q_idx, kv_idx: kv_idx % 2 == 0), None, (4, 4),
                     scale=0.7)
    out, lse = _ours(backend, q, k, v, None, hide_odd, 128, scale=0.7)
    assert_close(out, expected[0], RTOL, "out")
    assert_close(lse, expected[1], RTOL, "lse")


def _minus_inf_where(condition: Any, score: Any) -> Any:
    """0 where condition is False and -inf where it is True, in score's namespace and dtype."""
    from array_api_compat import array_namespace

    xp = array_namespace(score)
    return xp.where(condition, xp.asarray(-np.inf, dtype=score.dtype), xp.asarray(0.0, dtype=score.dtype))


class _Recorder:
    """A mask function (or score function) that records the index ranges of every tile it is evaluated on."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []

    def __call__(self, *arguments: Any) -> Any:
        q_idx, kv_idx = arguments[-2:]
        self.calls.append((np.asarray(_numpy(q_idx)).ravel(), np.asarray(_numpy(kv_idx)).ravel()))
        return self.inner(*arguments)


def _numpy(x: Any) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else np.asarray(x)


@pytest.mark.parametrize("backend_name", ["attention_np", "attention_torch"])  # JAX traces a tile, not each one
def test_the_mask_function_is_evaluated_on_partial_tiles_only(backend_name):
    from tests.conftest import import_backend

    M = import_backend(backend_name)
    q, k, v = _inputs()
    mask_mod = _Recorder(mods.and_masks(mods.causal(), mods.document(SEGMENTS[0, :L], SEGMENTS[0])))
    score_mod = _Recorder(mods.alibi(np.full(H, 0.5)))
    block_mask = M.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=(2, 3))
    mask_mod.calls.clear()
    M.flex_attention(*(M.asarray(x) for x in (q, k, v)), score_mod=score_mod, block_mask=block_mask)

    def touched(recorder: _Recorder) -> set[tuple[int, int]]:
        return {(int(i), int(j)) for q_idx, kv_idx in recorder.calls for i in q_idx // 2 for j in kv_idx // 3}

    kinds = block_mask.batch_kinds()  # (rows, columns): what a kernel computing the whole batch at once reads
    partial, empty, full = ({(int(i), int(j)) for i, j in zip(*np.nonzero(kinds == kind), strict=True)}
                            for kind in (PARTIAL, EMPTY, FULL))
    assert partial and empty and full, "the case has tiles of every kind"
    assert partial and empty and full, "the case has tiles of every kind"
    assert touched(mask_mod) == partial, "the mask function runs on the partial tiles, and on them only"
    assert touched(score_mod) == partial | full, "the score function runs on every tile computed, no empty one"


def test_a_user_mod_in_the_framework_own_functions(backend):
    """A mod written with the backend's own functions runs there: torch.where, jnp.where, np.where."""
    q, k, v = _inputs()
    where = {"attention_np": np.where, "attention_torch": torch.where}.get(backend.__name__)
    if where is None:
        import jax.numpy as jnp

        where = jnp.where

    def soft_causal(score, b, h, q_idx, kv_idx):  # halves the scores of future keys instead of hiding them
        return where(kv_idx <= q_idx, score, score * 0.5)

    out, _ = _ours(backend, q, k, v, None, soft_causal, 128, scale=0.7)
    assert_close(out, _soft_causal_reference(), RTOL, "soft causal")


@functools.cache
def _soft_causal_reference() -> np.ndarray:
    """torch's flex_attention's out with soft_causal written in torch's functions, computed once for every
    backend."""
    return _torch_reference(*_inputs(), None, lambda score, b, h, q_idx, kv_idx:
                            torch.where(kv_idx <= q_idx, score, score * 0.5)).out


def test_numpy_vjp_names_the_missing_derivative():
    import attention_np as M

    q, k, v = _inputs()
    with pytest.raises(ValueError, match="score_mod"):
        _, _, pullback = M.flex_attention_vjp(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score * 2)
        pullback(_random(B, H, L, EV))
