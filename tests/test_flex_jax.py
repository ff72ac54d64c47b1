"""attention_jax.flex_attention under JAX's transformations: jit, grad (through flex_attention itself, against
its vjp and against a dense oracle written here), vmap over a leading axis, the learned ALiBi slopes' gradient;
the mask function evaluated on partial tiles only (recorded at run time, as JAX traces a tile once); one
program for any number of tiles, and one compile for new parameter values of a score function; flash_attention with
a block mask (its empty tiles skipped, its full ones without the mask function, the keyword rules on top); the
ALiBi slopes learned through scaled_dot_product_attention, flash_attention and the modules' vjps; the mods on the
cached path, and linear attention's refusal of them.

The oracle is dense JAX: every score (B, H, L, S) at once, mods evaluated on the whole grid, softmax over the
visible keys, differentiated by plain autodiff, so it shares none of the kernel's tiles, loops or custom_vjp.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from attention_np.common import mods, validation
from attention_np.common.block_mask import EMPTY, FULL, PARTIAL
from tests._compare import REORDERED, assert_close

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jax_core = pytest.importorskip("jax.extend.core")
M = pytest.importorskip("attention_jax")

RTOL = REORDERED  # float64: the same math computed tile by tile (1e-12)
B, H, HKV, L, S, E, EV = 2, 4, 2, 9, 11, 4, 3
SCALE = 0.7
SEGMENTS = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2])  # (S,): three documents
MASK = mods.and_masks(mods.causal(), mods.document(SEGMENTS[:L], SEGMENTS))
ALIBI = mods.alibi(2.0 ** -np.arange(1, H + 1))


def _random(*shape: int, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def _inputs(kv_heads: int = H) -> tuple[jax.Array, jax.Array, jax.Array]:
    return _random(B, H, L, E, seed=0), _random(B, kv_heads, S, E, seed=1), _random(B, kv_heads, S, EV, seed=2)


def _dense(q: jax.Array, k: jax.Array, v: jax.Array, mask_mod: Any, score_mod: Any) -> tuple[jax.Array, jax.Array]:
    """The oracle: out (..., H, L, Ev) and lse (..., H, L) from every score at once; k and v repeated to H heads."""
    k, v = (jnp.repeat(x, H // x.shape[-3], axis=-3) for x in (k, v))
    b, h = jnp.arange(B).reshape(B, 1, 1, 1), jnp.arange(H).reshape(1, H, 1, 1)
    i, j = jnp.arange(L).reshape(1, 1, L, 1), jnp.arange(S).reshape(1, 1, 1, S)
    scores = jnp.einsum("bhle,bhse->bhls", q, k) * SCALE  # (B, H, L, S)
    scores = scores if score_mod is None else score_mod(scores, b, h, i, j)
    visible = jnp.broadcast_to(mask_mod(b, h, i, j), scores.shape)
    scores = jnp.where(visible, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(top == -jnp.inf, 0.0, top)  # a query that sees nothing
    total = jnp.sum(jnp.exp(scores - top), axis=-1, keepdims=True)
    seen = total != 0
    weights = jnp.exp(scores - top) / jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)[..., 0]
    return jnp.einsum("bhls,bhsv->bhlv", weights, v), lse


def _block_mask(tiles: tuple[int, int] = (2, 3)) -> Any:
    return M.create_block_mask(MASK, B, H, L, S, BLOCK_SIZE=tiles)


def test_jit_equals_eager():
    q, k, v = _inputs()
    block_mask = _block_mask()
    eager = M.flex_attention(q, k, v, ALIBI, block_mask, SCALE, return_lse=True)
    jitted = jax.jit(lambda q, k, v: M.flex_attention(q, k, v, ALIBI, block_mask, SCALE, return_lse=True))(q, k, v)
    for what, a, b in zip(("out", "lse"), jitted, eager, strict=True):
        assert_close(np.asarray(a), np.asarray(b), RTOL, what)


def test_a_block_mask_made_inside_jit_is_the_eager_one():
    # a block mask is data known before the program runs: made inside a traced function, its mask function
    # still runs on concrete arrays (jax.ensure_compile_time_eval), so that flex_attention can be jitted whole
    q, k, v = _inputs()

    @jax.jit
    def attention(q, k, v):
        return M.flex_attention(q, k, v, block_mask=M.create_block_mask(MASK, B, H, L, S, BLOCK_SIZE=(2, 3)),
                                scale=SCALE)

    eager = M.flex_attention(q, k, v, block_mask=M.create_block_mask(MASK, B, H, L, S, BLOCK_SIZE=(2, 3)), scale=SCALE)
    assert_close(np.asarray(attention(q, k, v)), np.asarray(eager), RTOL, "jitted whole")


def test_values_equal_the_dense_oracle():
    q, k, v = _inputs()
    out, lse = M.flex_attention(q, k, v, ALIBI, _block_mask(), SCALE, return_lse=True)
    expected_out, expected_lse = _dense(q, k, v, MASK, ALIBI)
    assert_close(np.asarray(out), np.asarray(expected_out), RTOL, "out")
    assert_close(np.asarray(lse), np.asarray(expected_lse), RTOL, "lse")


def test_grad_through_flex_attention_equals_its_vjp():
    """jax.grad of a loss through flex_attention takes the custom_vjp's backward, as flex_attention_vjp does;
    with the ALiBi slopes through ScoreMod.replace."""
    q, k, v = _inputs(kv_heads=HKV)
    block_mask, d_out = _block_mask(), _random(B, H, L, EV, seed=3)

    def loss(q, k, v, slopes):
        out = M.flex_attention(q, k, v, ALIBI.replace(slopes=slopes), block_mask, SCALE, enable_gqa=True)
        return jnp.sum(out * d_out)

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(ALIBI.parameters["slopes"]))
    _, _, pullback = M.flex_attention_vjp(q, k, v, ALIBI, block_mask, SCALE, enable_gqa=True)
    dq, dk, dv, d_parameters = pullback(d_out)
    for what, a, b in zip(("dq", "dk", "dv", "dslopes"), grads, (dq, dk, dv, d_parameters["slopes"]), strict=True):
        assert_close(np.asarray(a), np.asarray(b), RTOL, what)


def test_grad_of_out_and_lse_equals_the_dense_oracle():
    """A loss of out and lse (lse's cotangent enters as D - d_lse) under jit(grad), against plain autodiff of the
    dense oracle; relative_bias's table is the parameter."""
    q, k, v = _inputs()
    bias = mods.relative_bias(np.asarray(_random(H, 5, seed=4)))
    d_out, d_lse = _random(B, H, L, EV, seed=5), _random(B, H, L, seed=6)
    block_mask = _block_mask((4, 7))

    def loss(attend, q, k, v, table):
        out, lse = attend(q, k, v, bias.replace(table=table))
        return jnp.sum(out * d_out) + jnp.sum(jnp.where(lse == -jnp.inf, 0.0, lse) * d_lse)

    def ours(q, k, v, score_mod):
        return M.flex_attention(q, k, v, score_mod, block_mask, SCALE, return_lse=True)

    def oracle(q, k, v, score_mod):
        return _dense(q, k, v, MASK, score_mod)

    arguments = (q, k, v, jnp.asarray(bias.parameters["table"]))
    grads = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2, 3)))(*arguments)
    expected = jax.grad(lambda *a: loss(oracle, *a), argnums=(0, 1, 2, 3))(*arguments)
    for what, a, b in zip(("dq", "dk", "dv", "dtable"), grads, expected, strict=True):
        assert_close(np.asarray(a), np.asarray(b), RTOL, what)


def test_learned_alibi_slopes_gradient_under_jax_grad():
    """d loss / d slopes through ScoreMod.replace under jax.grad, against the dense oracle's."""
    q, k, v = _inputs()
    d_out, block_mask = _random(B, H, L, EV, seed=7), _block_mask()

    def loss(attend, slopes):
        return jnp.sum(attend(ALIBI.replace(slopes=slopes)) * d_out)

    slopes = jnp.asarray(ALIBI.parameters["slopes"])
    grad = jax.grad(lambda s: loss(lambda mod: M.flex_attention(q, k, v, mod, block_mask, SCALE), s))(slopes)
    expected = jax.grad(lambda s: loss(lambda mod: _dense(q, k, v, MASK, mod)[0], s))(slopes)
    assert grad.shape == (H,)
    assert_close(np.asarray(grad), np.asarray(expected), RTOL, "dslopes")


def test_vmap_over_a_leading_axis_equals_a_loop():
    q, k, v = (jnp.stack([x, 2 * x]) for x in _inputs())  # (2, B, H, *, *)
    block_mask = _block_mask()
    out = jax.vmap(lambda q, k, v: M.flex_attention(q, k, v, ALIBI, block_mask, SCALE))(q, k, v)
    for n in range(2):
        expected = M.flex_attention(q[n], k[n], v[n], ALIBI, block_mask, SCALE)
        assert_close(np.asarray(out[n]), np.asarray(expected), RTOL, f"vmapped entry {n}")


def test_low_precision_computes_in_float32():
    q, k, v = (x.astype(jnp.float16) for x in _inputs())
    out, lse = M.flex_attention(q, k, v, ALIBI, _block_mask(), SCALE, return_lse=True)
    assert (out.dtype, lse.dtype) == (jnp.float16, jnp.float32)
    expected, _ = _dense(*(x.astype(jnp.float32) for x in (q, k, v)), MASK, ALIBI)
    assert_close(np.asarray(out, np.float64), np.asarray(expected), 2e-3, "float16 out")  # float16's rounding


class _Recorder:
    """A mask (or score) function that records, at run time (jax.debug.callback), the tiles it is evaluated on."""

    def __init__(self, inner: Any, block_size: tuple[int, int]) -> None:
        self.inner, self.block_size, self.tiles = inner, block_size, set()

    def _record(self, q_idx: np.ndarray, kv_idx: np.ndarray) -> None:
        self.tiles |= {(int(i), int(j)) for i in np.ravel(q_idx) // self.block_size[0]
                       for j in np.ravel(kv_idx) // self.block_size[1]}

    def __call__(self, *arguments: Any) -> Any:
        jax.debug.callback(self._record, arguments[-2], arguments[-1])
        return self.inner(*arguments)


def _assert_called_by_kind(block_mask: Any, mask_mod: Any, score_mod: Any) -> None:
    """The recorders' tiles by the block mask's kinds: the mask function on the partial tiles alone, the score
    function on every tile computed (partial and full), none on an empty one; the case has tiles of each kind."""
    kinds = block_mask.batch_kinds()
    partial, empty, full = ({(int(i), int(j)) for i, j in zip(*np.nonzero(kinds == kind), strict=True)}
                            for kind in (PARTIAL, EMPTY, FULL))
    assert partial and empty and full, "the case has tiles of every kind"
    assert mask_mod.tiles == partial, "the mask function runs on the partial tiles, and on them only"
    assert score_mod.tiles == partial | full, "the score function runs on every tile computed, no empty one"


def test_the_mask_function_runs_on_partial_tiles_only():
    q, k, v = _inputs()
    mask_mod, score_mod = _Recorder(MASK, (2, 3)), _Recorder(ALIBI, (2, 3))
    block_mask = M.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=(2, 3))
    mask_mod.tiles.clear()
    jax.block_until_ready(M.flex_attention(q, k, v, score_mod, block_mask, SCALE))
    jax.effects_barrier()
    _assert_called_by_kind(block_mask, mask_mod, score_mod)


def _equations(jaxpr: Any) -> int:
    """The equations of a jaxpr and of every jaxpr inside it (loop bodies, branches, jitted calls)."""
    count = 0
    for equation in jaxpr.eqns:
        count += 1
        for value in equation.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                if isinstance(inner, jax_core.ClosedJaxpr):
                    count += _equations(inner.jaxpr)
                elif isinstance(inner, jax_core.Jaxpr):
                    count += _equations(inner)
    return count


def test_the_program_does_not_grow_with_the_number_of_tiles():
    """The tiles to compute are index arrays that loops read: 20 tiles of 2 x 3, 6 of 4 x 7 and 4 of 5 x 6 (each
    padding L and S) trace to as many equations, forward and backward."""
    q, k, v = _inputs()

    def size(tiles: tuple[int, int]) -> int:
        block_mask = _block_mask(tiles)
        return _equations(jax.make_jaxpr(lambda q, k, v: M.flex_attention_vjp(
            q, k, v, ALIBI, block_mask, SCALE)[2](q[..., :EV]))(q, k, v).jaxpr)

    assert size((2, 3)) == size((4, 7)) == size((5, 6))


def test_new_parameter_values_reuse_the_compiled_program():
    """The plan is static (the block mask and the score function's rule by identity), the parameters are
    arguments: a second call with other slopes traces nothing again, so the mask function is not called."""
    calls = []

    def counted(b, h, q_idx, kv_idx):
        calls.append(1)  # once per trace: the compiled program does not call Python
        return MASK(b, h, q_idx, kv_idx)

    q, k, v = _inputs()
    block_mask = M.create_block_mask(counted, B, H, L, S, BLOCK_SIZE=(2, 3))
    calls.clear()
    first = M.flex_attention(q, k, v, ALIBI, block_mask, SCALE)
    traced = len(calls)
    second = M.flex_attention(q, k, v, ALIBI.replace(slopes=np.full(H, 0.1)), block_mask, SCALE)
    assert traced > 0 and len(calls) == traced, "the second call compiled nothing"
    assert not np.allclose(np.asarray(first), np.asarray(second)), "the new slopes were used"


def test_grad_through_flex_attention_keeps_no_scores():
    """jax.grad through flex_attention takes the custom_vjp's backward, which recomputes the tiles: XLA's plan of
    temporaries stays far below one (B, H, L, S) array of scores, which the same gradient of dense attention
    holds (so the measure sees such an array)."""
    batch, heads, length, width = 1, 2, 2048, 16
    q, k, v = (_random(batch, heads, length, width, seed=n).astype(jnp.float32) for n in range(3))
    scores_mib = batch * heads * length * length * 4 / 2**20  # float32: 32 MiB
    block_mask = M.create_block_mask(mods.document(np.repeat(np.arange(4), length // 4)), None, None, length,
                                     length)
    slopes = jnp.ones(heads, jnp.float32)

    def flex(q, k, v, slopes):
        return jnp.sum(M.flex_attention(q, k, v, mods.alibi(np.ones(heads)).replace(slopes=slopes), block_mask))

    def dense(q, k, v, slopes):
        return jnp.sum(jax.nn.softmax(jnp.einsum("bhle,bhse->bhls", q, k), axis=-1) @ v)

    def temporaries(loss):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, k, v, slopes).compile()
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    assert temporaries(dense) > scores_mib
    assert temporaries(flex) < scores_mib / 8, f"{temporaries(flex):.1f} MiB of temporaries"


def test_the_forward_pass_holds_no_copy_of_q_or_out():
    """The query loop writes each tile's rows into out in place and groups q one tile at a time: XLA's plan of
    temporaries stays far below one array of out's size (stacking the tiles' outputs, or a grouped view of the whole
    of q carried into the loop, each held one: compare --variant flex --memory measured 65.9 MiB at L = 32768)."""
    batch, heads, length, width = 1, 8, 4096, 64
    x = jax.ShapeDtypeStruct((batch, heads, length, width), jnp.float32)
    out_mib = batch * heads * length * width * 4 / 2**20  # 8 MiB; the tiles' own temporaries are about 2 MiB
    block_mask = M.create_block_mask(mods.document(np.repeat(np.arange(8), length // 8)), None, None, length,
                                     length)
    compiled = jax.jit(lambda q, k, v: M.flex_attention(q, k, v, block_mask=block_mask)).lower(x, x, x).compile()
    temporaries = compiled.memory_analysis().temp_size_in_bytes / 2**20
    assert temporaries < out_mib / 2, f"{temporaries:.2f} MiB of temporaries beside an out of {out_mib:.0f} MiB"


# --- the mods on flash_attention and scaled_dot_product_attention -------------------------------------------

@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_flash_with_a_block_mask_skips_empty_tiles_and_masks_partial_ones_only(direction):
    """flash_attention's tiles are the block mask's: an empty tile is never computed (the score function never
    sees it), a full one runs no mask function, in the forward pass and in the backward pass alike."""
    q, k, v = _inputs()
    mask_mod, score_mod = _Recorder(MASK, (2, 3)), _Recorder(ALIBI, (2, 3))
    block_mask = M.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=(2, 3))
    mask_mod.tiles.clear()  # create_block_mask's own calls apart
    out, _, pullback = M.flash_attention_vjp(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=SCALE)
    jax.block_until_ready(out)
    jax.effects_barrier()
    if direction == "backward":  # the backward pass's own records only
        mask_mod.tiles.clear()
        score_mod.tiles.clear()
        jax.block_until_ready(pullback(jnp.ones_like(out)))
        jax.effects_barrier()
    _assert_called_by_kind(block_mask, mask_mod, score_mod)


def test_flash_with_a_block_mask_and_the_keyword_rules_equals_the_dense_oracle():
    """A block mask's tiles and the tiles is_causal, window and key_lengths leave, both: the loops run over the
    block mask's non-empty tiles within the structure's range; out and the gradients as the dense oracle's with
    the keyword rules written as mask functions."""
    q, k, v = _inputs()
    d_out = _random(B, H, L, EV, seed=3)
    keywords = {"is_causal": True, "q_offset": 2, "window": (3, None), "key_lengths": jnp.array([[9], [11]])}
    as_mask = mods.and_masks(MASK, mods.causal(2), mods.sliding_window(3, None, q_offset=2),
                             mods.key_lengths(np.array([9, 11])))
    block_mask = M.create_block_mask(MASK, B, H, L, S, BLOCK_SIZE=(2, 3))
    out, _, pullback = M.flash_attention_vjp(q, k, v, score_mod=ALIBI, block_mask=block_mask, scale=SCALE,
                                             **keywords)
    expected, pull_expected = jax.vjp(lambda q, k, v: _dense(q, k, v, as_mask, ALIBI)[0], q, k, v)
    assert_close(np.asarray(out), np.asarray(expected), RTOL, "out")
    for what, actual, wanted in zip(("dq", "dk", "dv"), pullback(d_out)[:3], pull_expected(d_out), strict=True):
        assert_close(np.asarray(actual), np.asarray(wanted), RTOL, what)


@pytest.mark.parametrize("function", ["sdpa", "flash"])
def test_learned_alibi_slopes_through_sdpa_and_flash_under_jax_grad(function):
    """jax.grad reaches a ScoreMod's parameters given as JAX arrays through scaled_dot_product_attention and
    flash_attention (ScoreMod.replace inside the differentiated function), as the dense oracle's."""
    q, k, v = _inputs()
    d_out = _random(B, H, L, EV, seed=3)
    slopes = jnp.asarray(ALIBI.parameters["slopes"])

    def loss(slopes: jax.Array) -> jax.Array:
        score_mod = ALIBI.replace(slopes=slopes)
        if function == "sdpa":
            out, _ = M.scaled_dot_product_attention(q, k, v, mask_mod=MASK, score_mod=score_mod, scale=SCALE)
        else:
            out, _ = M.flash_attention(q, k, v, mask_mod=MASK, score_mod=score_mod, scale=SCALE, block_q=2,
                                       block_k=3)
        return jnp.sum(out * d_out)

    expected = jax.grad(lambda slopes: jnp.sum(_dense(q, k, v, MASK, ALIBI.replace(slopes=slopes))[0] * d_out))
    assert_close(np.asarray(jax.grad(loss)(slopes)), np.asarray(expected(slopes)), RTOL, "d slopes")


def _modules(D: int, heads: int) -> tuple[Any, Any]:
    """A MultiHeadAttention and a TransformerBlock of random float64 parameters, in eval mode."""
    shapes = validation.block_state_shapes(D, 2 * D, num_heads=heads)
    state = {name: _random(*shape, seed=10 + n) for n, (name, shape) in enumerate(shapes.items())}
    mha = M.MultiHeadAttention.from_state_dict({name.removeprefix("attn."): value for name, value in state.items()
                                                if name.startswith("attn.")}, num_heads=heads, dropout=0.0)
    return mha.eval(), M.TransformerBlock.from_state_dict(state, num_heads=heads, dropout=0.0).eval()


@pytest.mark.parametrize("name", ["mha", "block"])
def test_module_vjps_give_the_score_functions_parameters_gradients(name):
    """MultiHeadAttention.vjp and TransformerBlock.vjp with score_mod=alibi: the slopes' gradient under
    "score_mod.slopes", beside the state dict's, as jax.grad through the module given the slopes
    (ScoreMod.replace). Both jitted: eager JAX compiles each operation (seconds)."""
    mha, block = _modules(D := 8, 2)
    module = mha if name == "mha" else block
    x, d_out = _random(B, L, D, seed=4), _random(B, L, D, seed=5)
    alibi, causal = mods.alibi(np.array([0.5, 0.25])), mods.causal()
    mods_ = {"mask_mod": causal, "score_mod": alibi}

    def attend(x: jax.Array, **options: Any) -> tuple:
        return mha(x, x, x, **options) if name == "mha" else block(x, **options)

    def module_vjp(x: jax.Array) -> dict[str, jax.Array]:
        _, _, pullback = mha.vjp(x, x, x, **mods_) if name == "mha" else block.vjp(x, **mods_)
        return pullback(d_out)[-1]

    def loss(slopes: jax.Array) -> jax.Array:
        return jnp.sum(attend(x, mask_mod=causal, score_mod=alibi.replace(slopes=slopes))[0] * d_out)

    grads = jax.jit(module_vjp)(x)
    assert set(grads) == set(module.state_dict()) | {"score_mod.slopes"}
    expected = jax.jit(jax.grad(loss))(jnp.asarray(alibi.parameters["slopes"]))
    assert_close(np.asarray(grads["score_mod.slopes"]), np.asarray(expected), RTOL, f"{name} d slopes")


def test_the_cached_path_takes_the_mods():
    """extend over an empty cache with score_mod=alibi: q_idx over the new queries, kv_idx over the cache, so the
    first chunk equals the module's call with the causal mask function (the cache's unfilled keys hidden by
    extend's causal rule). Jitted, as in use."""
    mha, _ = _modules(D := 8, 2)
    x, alibi = _random(B, L, D, seed=4), mods.alibi(np.array([0.5, 0.25]))
    out = jax.jit(lambda x: mha.extend(x, x, mha.init_cache((B,), L + 3), score_mod=alibi)[0])(x)
    expected = jax.jit(lambda x: mha(x, x, x, mask_mod=mods.causal(), score_mod=alibi)[0])(x)
    assert_close(np.asarray(out), np.asarray(expected), RTOL, "extend")


def test_linear_attention_refuses_the_mods():
    """attention="linear" forms no scores: a mask_mod or a score_mod is an error that names it."""
    mha = M.MultiHeadAttention(d_model=8, num_heads=2, dropout=0.0, attention="linear")
    x = jnp.ones((B, L, 8), mha.w_q.weight.dtype)
    for name, mod in (("mask_mod", mods.causal()), ("score_mod", ALIBI)):
        with pytest.raises(ValueError, match=f"{name} must be None with attention='linear'"):
            mha(x, x, x, **{name: mod})
