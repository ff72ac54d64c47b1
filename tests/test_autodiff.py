"""Transformations and gradients: JAX's jit, grad and vmap take the modules as arguments; torch's autograd
reaches every parameter; a fully masked query row gets finite, and exactly zero, gradients."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from tests._compare import REORDERED, assert_close
from tests.conftest import import_backend

D, H, F, B, L = 8, 2, 16, 2, 5  # d_model, heads, d_ff, batch, positions
KINDS = ("sdpa", "mha", "block")


def _state(kind: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A random float64 state dict of MHA or the block, in the torch names."""
    shapes = {f"w_{p}.{part}": (D, D) if part == "weight" else (D,)
              for p in "qkvo" for part in ("weight", "bias")}
    if kind == "block":
        shapes = {f"attn.{name}": shape for name, shape in shapes.items()}
        shapes |= {f"norm{i}.{part}": (D,) for i in (1, 2) for part in ("weight", "bias")}
        shapes |= {"ffn.0.weight": (F, D), "ffn.0.bias": (F,), "ffn.3.weight": (D, F), "ffn.3.bias": (D,)}
    rng = np.random.default_rng(seed)
    return {name: 0.5 * rng.standard_normal(shape) for name, shape in shapes.items()}


def _mask() -> np.ndarray:
    """(B, 1, L, L): causal, and query 2 of sequence 0 sees no key at all."""
    mask = np.broadcast_to(np.tril(np.ones((L, L), bool)), (B, 1, L, L)).copy()
    mask[0, 0, 2] = False
    return mask


def _model(M: ModuleType, kind: str, seed: int = 0) -> object:
    """The module of `kind` in eval mode (None for SDPA, which has no parameters)."""
    if kind == "sdpa":
        return None
    cls = M.MultiHeadAttention if kind == "mha" else M.TransformerBlock
    return cls.from_state_dict(_state(kind, seed), num_heads=H).eval()


def _apply(M: ModuleType, kind: str) -> Callable:
    """f(module, x, mask, rng) -> (out, weights) for SDPA (module ignored), MHA or the block."""
    def f(module, x, mask, rng=None):
        if kind == "sdpa":
            x = x[..., None, :, :]  # (..., L, D) -> (..., 1, L, D): one head, as the mask has
            return M.scaled_dot_product_attention(x, x, x, mask)
        return module(x, x, x, mask, rng=rng) if kind == "mha" else module(x, mask, rng=rng)
    return f


def _inputs(M: ModuleType, seed: int = 1) -> tuple:
    return M.asarray(np.random.default_rng(seed).standard_normal((B, L, D))), M.asarray(_mask())


# --- JAX ------------------------------------------------------------------------------------------

# _JIT_GRAD: the tests of grad's values and structure take jax.grad under jax.jit, one program: an eager grad
# compiles each primitive of the forward and backward passes apart, most of their CPU time. The forward each
# compares with runs eagerly, and test_fully_masked_row_gets_exactly_zero_gradient_for_its_query takes its grad
# eagerly.

@pytest.mark.parametrize("kind", KINDS)
def test_jax_jit_output_equals_eager(kind: str):
    M = import_backend("attention_jax")
    import jax

    f, module, (x, mask) = _apply(M, kind), _model(M, kind), _inputs(M)
    for a, b in zip(jax.jit(f)(module, x, mask), f(module, x, mask), strict=True):
        assert_close(np.asarray(a), np.asarray(b), REORDERED, f"jit {kind}")


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fast"])
def test_jax_jit_takes_a_float_mask_the_function_captures(need_weights: bool):
    # a concrete 0/1 float mask closed over by a jitted function: its comparisons are traced there, so its
    # values cannot be checked (as for a mask passed as an argument), and it hides what the bool mask hides
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import attention_jax

    x = jnp.asarray(np.random.default_rng(6).standard_normal((3, 4)))
    mask = jnp.tril(jnp.ones((3, 3)))
    jitted = jax.jit(lambda x: attention_jax.scaled_dot_product_attention(x, x, x, mask,
                                                                        need_weights=need_weights)[0])
    expected, _ = attention_jax.scaled_dot_product_attention(x, x, x, is_causal=True)
    assert_close(np.asarray(jitted(x)), np.asarray(expected), REORDERED, "captured float mask")


@pytest.mark.parametrize("kind", ["mha", "block"])
def test_jax_jit_in_training_mode_draws_the_same_dropout_as_eager(kind: str):
    M = import_backend("attention_jax")
    import jax

    f, (x, mask) = _apply(M, kind), _inputs(M)
    module = _model(M, kind).train()
    rng = jax.random.key(0)
    jitted, eager = jax.jit(f)(module, x, mask, rng)[0], f(module, x, mask, rng)[0]
    assert_close(np.asarray(jitted), np.asarray(eager), REORDERED, f"jit {kind} training")
    assert not np.allclose(np.asarray(eager), np.asarray(f(module.eval(), x, mask)[0]))  # dropout was on


@pytest.mark.parametrize("kind", ["mha", "block"])
def test_jax_grad_wrt_a_module_is_a_module_with_the_same_names(kind: str):
    M = import_backend("attention_jax")
    import jax

    f, module, (x, mask) = _apply(M, kind), _model(M, kind), _inputs(M)
    grad = jax.jit(jax.grad(lambda m: (f(m, x, mask)[0] ** 2).sum()))(module)  # one program (see _JIT_GRAD)
    assert type(grad) is type(module)
    assert list(grad.state_dict()) == list(module.state_dict())
    for name, value in grad.state_dict().items():
        assert value.shape == module.state_dict()[name].shape, name
        assert np.all(np.isfinite(np.asarray(value))), f"{name}: non-finite gradient with a masked row"


@pytest.mark.parametrize("kind", KINDS)
def test_jax_grad_matches_a_central_difference(kind: str):
    M = import_backend("attention_jax")
    import jax

    f, module, (x, mask) = _apply(M, kind), _model(M, kind), _inputs(M)
    c = M.asarray(np.random.default_rng(2).standard_normal((B, L, D)))

    def loss(m, x):
        out = f(m, x, mask)[0]  # SDPA's carries a head axis: (B, 1, L, D)
        return (out * c.reshape(out.shape)).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(module, x)  # one program (see _JIT_GRAD)
    # along a random direction u over every parameter and the input, (loss(p + h u) - loss(p - h u)) / 2h
    # equals <grad, u> up to O(h^2) plus float64 rounding / h: about 1e-9 relative here, so 1e-7 has
    # margin, while a wrong gradient term is off by order 1
    leaves, tree = jax.tree.flatten((module, x))
    rng = np.random.default_rng(3)
    u = [M.asarray(rng.standard_normal(leaf.shape)) for leaf in leaves]
    h = 1e-5
    moved = [jax.tree.unflatten(tree, [leaf + s * h * d for leaf, d in zip(leaves, u, strict=True)])
             for s in (1, -1)]
    numeric = (loss(*moved[0]) - loss(*moved[1])) / (2 * h)
    analytic = sum((g * d).sum() for g, d in zip(jax.tree.leaves(grads), u, strict=True))
    assert_close(np.asarray(numeric), np.asarray(analytic), 1e-7, f"{kind} directional derivative")


@pytest.mark.parametrize("kind", KINDS)
def test_jax_vmap_over_the_batch_equals_the_batched_call(kind: str):
    M = import_backend("attention_jax")
    import jax

    f, module, (x, mask) = _apply(M, kind), _model(M, kind), _inputs(M)
    mapped = jax.vmap(f, in_axes=(None, 0, 0))(module, x, mask)  # one sequence (L, D) at a time
    for a, b in zip(mapped, f(module, x, mask), strict=True):
        assert_close(np.asarray(a), np.asarray(b), REORDERED, f"vmap {kind}")


@pytest.mark.parametrize("kind", ["mha", "block"])
def test_jax_vmap_over_stacked_modules_runs_each_module(kind: str):
    M = import_backend("attention_jax")
    import jax
    import jax.numpy as jnp

    f, (x, mask) = _apply(M, kind), _inputs(M)
    first, second = _model(M, kind, seed=0), _model(M, kind, seed=1)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), first, second)  # one module, leaves (2, ...)
    out = jax.vmap(f, in_axes=(0, 0, 0))(stacked, x, mask)[0]  # module b on sequence b
    for b, module in enumerate((first, second)):
        assert_close(np.asarray(out[b]), np.asarray(f(module, x[b], mask[b])[0]), REORDERED, f"module {b}")


# --- torch ----------------------------------------------------------------------------------------

def test_torch_gradients_reach_every_parameter_and_are_finite_with_a_masked_row():
    M = import_backend("attention_torch")
    import torch

    block = _model(M, "block").train()  # training mode, so dropout's backward runs too
    x, mask = _inputs(M)
    x.requires_grad_(True)
    out, _ = block(x, mask, rng=torch.Generator().manual_seed(0))
    (out * torch.as_tensor(np.random.default_rng(2).standard_normal((B, L, D)))).sum().backward()
    for name, parameter in block.named_parameters():
        assert parameter.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(parameter.grad).all(), f"{name}: non-finite gradient"
        assert parameter.grad.abs().sum() > 0, f"{name}: zero gradient"
    assert torch.isfinite(x.grad).all()


def test_torch_and_jax_gradients_agree():
    # the same loss on the same state: autograd and jax.grad compute the same derivatives in float64
    torch_M, jax_M = import_backend("attention_torch"), import_backend("attention_jax")
    import jax
    import torch

    c = np.random.default_rng(2).standard_normal((B, L, D))
    torch_block = _model(torch_M, "block")
    x, mask = _inputs(torch_M)
    (torch_block(x, mask)[0] * torch.as_tensor(c)).sum().backward()
    jax_block = _model(jax_M, "block")
    x, mask = _inputs(jax_M)
    grad = jax.jit(jax.grad(lambda m: (m(x, mask)[0] * c).sum()))(jax_block).state_dict()  # see _JIT_GRAD
    # measured against the largest gradient: attn.w_k.bias has gradient 0 in exact arithmetic (it adds
    # q . b_k to a whole row of scores, which the softmax ignores), so its computed values are rounding
    scale = max(parameter.grad.abs().max().item() for parameter in torch_block.parameters())
    for name, parameter in torch_block.named_parameters():
        error = np.max(np.abs(np.asarray(grad[name]) - parameter.grad.numpy()))
        assert error <= 1e-10 * scale, f"{name}: error {error:.3g} > 1e-10 * {scale:.3g}"


# --- both -----------------------------------------------------------------------------------------

def _sdpa_gradients(M: ModuleType, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray,
                    c_out: np.ndarray, c_weights: np.ndarray) -> list[np.ndarray]:
    """Gradients of sum(out * c_out) + sum(weights * c_weights) w.r.t. q, k, v, as NumPy arrays."""
    if M.__name__ == "attention_jax":
        import jax

        def loss(q, k, v):
            out, weights = M.scaled_dot_product_attention(q, k, v, M.asarray(mask))
            return (out * c_out).sum() + (weights * c_weights).sum()

        return [np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2))(*(M.asarray(a) for a in (q, k, v)))]
    import torch

    q, k, v = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out, weights = M.scaled_dot_product_attention(q, k, v, M.asarray(mask))
    ((out * torch.as_tensor(c_out)).sum() + (weights * torch.as_tensor(c_weights)).sum()).backward()
    return [a.grad.numpy() for a in (q, k, v)]


@pytest.mark.parametrize("name", ["attention_jax", "attention_torch"])
def test_fully_masked_row_gets_exactly_zero_gradient_for_its_query(name: str):
    # row 1 sees no key: its out and weights are constants (zeros), so its query gets no gradient,
    # exactly, and no NaN leaks into q, k or v from the 0 / 0 the masked softmax avoids
    M = import_backend(name)
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 2))
    mask = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], bool)
    grad_q, grad_k, grad_v = _sdpa_gradients(M, q, k, v, mask, rng.standard_normal((3, 2)),
                                             rng.standard_normal((3, 5)))
    for grad in (grad_q, grad_k, grad_v):
        assert np.all(np.isfinite(grad))
    assert np.all(grad_q[1] == 0.0)
    assert np.any(grad_q[[0, 2]] != 0.0)
