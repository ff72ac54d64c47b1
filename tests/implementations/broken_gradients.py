"""The NumPy backend with one realistic bug in its hand-derived backward pass: mutants of
attention_np/gradients.py and attention_np/flex.py, each made by one textual edit of the real source.

`BROKEN_GRADIENTS` maps a name to a module that implements the whole contract: the forward passes are
attention_np's own, the gradients come from the mutated copy of attention_np.gradients (or, for flex_attention_vjp,
of attention_np.flex).
"""

from __future__ import annotations

import itertools
import types
from pathlib import Path

import ml_dtypes

import attention_np
import attention_np.flex
import attention_np.gradients

SOURCE = Path(attention_np.gradients.__file__).read_text()
FLEX_SOURCE = Path(attention_np.flex.__file__).read_text()

# name -> (the exact text in attention_np/gradients.py, its buggy replacement)
MUTATIONS: dict[str, tuple[str, str]] = {
    # the softmax Jacobian-vector product without its rowsum term: dS = P * dP
    "softmax_jvp_without_rowsum": ("p * (d_weights - np.sum(d_weights * p, axis=-1, keepdims=True))",
                                   "p * d_weights"),
    # the key gradient without the scale of the scores
    "dk_not_scaled": ("dk = np.swapaxes(d_scores, -1, -2) @ q_w * scale", "dk = np.swapaxes(d_scores, -1, -2) @ q_w"),
    # a broadcast bias gets the full (..., L, S) gradient instead of its own shape
    "dbias_not_reduced": ("dbias = None if bias is None else _sum_to(d_scores, np.shape(bias))",
                          "dbias = None if bias is None else d_scores"),
    # LayerNorm's backward forgets what the variance takes from each entry
    "layer_norm_without_variance_term": ("- x_hat * np.mean(d_hat * x_hat, axis=-1, keepdims=True)) * inv_sigma",
                                         ") * inv_sigma"),
    # a Linear layer's weight gradient transposed: x^T dy instead of dy^T x
    "linear_weight_gradient_transposed": ("d_weight = (dy_rows.T @ x_rows)", "d_weight = (x_rows.T @ dy_rows)"),
    # GELU's derivative without the h * phi(h) term
    "gelu_derivative_cdf_only": ("return cdf + h * np.exp(-(h**2) / 2) / math.sqrt(2 * math.pi)", "return cdf"),
    # post-LN self-attention: only the query path's gradient flows back to x
    "self_attention_gradients_not_summed": ("return dh1 + dq + dk + dv, grads", "return dh1 + dq, grads"),
    # grouped-query attention: a key/value head's gradient averaged over its group of query heads, not summed
    "gqa_group_gradient_averaged": ("dk, dv = (np.sum(d, axis=-3) for d in (dk, dv))",
                                    "dk, dv = (np.mean(d, axis=-3) for d in (dk, dv))"),
    # SwiGLU: silu'(g) taken as sigmoid(g), without its second term g sigmoid(g) (1 - sigmoid(g))
    "silu_derivative_sigmoid_only": ("dh * u * sigmoid * (1 + g * (1 - sigmoid))", "dh * u * sigmoid"),
    # RMSNorm's backward forgets what the mean square takes from each entry
    "rms_norm_without_mean_square_term": ("(d_hat - x_hat * np.mean(d_hat * x_hat, axis=-1, keepdims=True)) * inv_rms",
                                          "d_hat * inv_rms"),
    # RoPE's adjoint turned forward again (R instead of R^T): the gradient of a turned query or key is wrong
    "rope_gradient_turned_forward": ("apply_rope(d, -np.arange(d.shape[-2]), theta=mha.rope_theta)",
                                     "apply_rope(d, np.arange(d.shape[-2]), theta=mha.rope_theta)"),
    # softcap's vjp without tanh's derivative: dR = dC, not dC * (1 - tanh^2(R / c))
    "softcap_derivative_forgotten": ("d_scores, _ = capping.vjp(d_scores, raw, None, None, None, None)",
                                     "d_scores, _ = d_scores, {}"),
    # P kept for the backward pass in bfloat16 below float64 (the forward's out is right): dV = P^T dO and
    # dS = P * (dP - rowsum(dP * P)) then lose bfloat16's rounding in a float32 or float16 run; float64 untouched
    "weights_kept_in_bfloat16_for_the_backward": (
        "    score_mod = None if mods is None else mods.score_mod\n",
        "    score_mod = None if mods is None else mods.score_mod\n"
        "    weights = weights if weights.dtype == np.float64 else \\\n"
        "        weights.astype(ml_dtypes.bfloat16).astype(weights.dtype)\n"),
    # the sum over the queries of dV = P^T dO taken in the reverse order on every other call, as a kernel whose
    # atomic adds land in another order each time: equal in exact arithmetic, other bits from call to call
    "value_gradient_order_changes_between_calls": (
        "        dv = np.swapaxes(p, -1, -2) @ d_o  # (..., S, L) x (..., L, Ev) -> (..., S, Ev)\n",
        "        turn = next(CALLS) % 2 == 1\n"
        "        dv = np.swapaxes(p[..., ::-1, :] if turn else p, -1, -2) @ (\n"
        "            d_o[..., ::-1, :] if turn else d_o)  # (..., S, L) x (..., L, Ev) -> (..., S, Ev)\n"),
    # pre-LN: the residual's gradient is dropped in the backward pass
    "pre_ln_residual_dropped": ("dh = dy + dh_norm2  # the residual passes dy on unchanged", "dh = dh_norm2"),
}


# name -> (the exact text in attention_np/flex.py, its buggy replacement): flex_attention_vjp's tiled backward
FLEX_MUTATIONS: dict[str, tuple[str, str]] = {
    # the softmax's vjp without D = rowsum(dO * O): dR = P * dP
    "flex_softmax_jvp_without_rowsum": ("d_new = weights * (d_weights - D[:, :, rows])", "d_new = weights * d_weights"),
    # the score function's derivative skipped: dS = dR, as if score_mod were the identity
    "flex_score_mod_derivative_skipped": ("d_scores, d_theta = _score_mod_vjp(p, d_new, tile)",
                                          "d_scores, d_theta = d_new, _score_mod_vjp(p, d_new, tile)[1]"),
    # the key gradient without the scale of the scores
    "flex_dk_not_scaled": ("dk[:, :, cols] += np.swapaxes(d_scores, -1, -2) @ p.q[:, :, rows] * p.scale",
                           "dk[:, :, cols] += np.swapaxes(d_scores, -1, -2) @ p.q[:, :, rows]"),
    # a parameter's gradient kept from the last tile alone instead of summed over the tiles
    "flex_parameter_gradient_not_summed": ("d_parameters[name] += gradient", "d_parameters[name] = gradient"),
}


def _flex_mutant(name: str, old: str, new: str) -> types.ModuleType:
    assert FLEX_SOURCE.count(old) == 1, f"{name}: the text to mutate must occur once in attention_np/flex.py"
    flex = types.ModuleType(f"attention_np.flex_{name}")
    flex.__package__ = "attention_np"
    exec(compile(FLEX_SOURCE.replace(old, new), f"<{name}>", "exec"), flex.__dict__)
    module = types.ModuleType(f"broken_gradients.{name}")
    module.__dict__.update({name: getattr(attention_np, name) for name in attention_np.__all__})
    module.flex_attention_vjp = flex.flex_attention_vjp
    return module


def _mutant(name: str, old: str, new: str) -> types.ModuleType:
    assert SOURCE.count(old) == 1, f"{name}: the text to mutate must occur once in attention_np/gradients.py"
    gradients = types.ModuleType(f"attention_np.gradients_{name}")
    gradients.__package__ = "attention_np"  # its relative imports resolve inside attention_np
    gradients.ml_dtypes = ml_dtypes  # the names a mutation may use: bfloat16, a count of the calls
    gradients.CALLS = itertools.count()
    exec(compile(SOURCE.replace(old, new), f"<{name}>", "exec"), gradients.__dict__)

    class MultiHeadAttention(attention_np.MultiHeadAttention):
        def vjp(self, q, k, v, mask=None):
            return gradients.multi_head_attention_vjp(self, q, k, v, mask)

    class TransformerBlock(attention_np.TransformerBlock):
        def vjp(self, x, mask=None):
            return gradients.transformer_block_vjp(self, x, mask)

    module = types.ModuleType(f"broken_gradients.{name}")
    module.__dict__.update({name: getattr(attention_np, name) for name in attention_np.__all__})
    module.scaled_dot_product_attention_vjp = gradients.scaled_dot_product_attention_vjp
    module.MultiHeadAttention, module.TransformerBlock = MultiHeadAttention, TransformerBlock
    return module


BROKEN_GRADIENTS: dict[str, types.ModuleType] = {name: _mutant(name, *edit) for name, edit in MUTATIONS.items()} | {
    name: _flex_mutant(name, *edit) for name, edit in FLEX_MUTATIONS.items()}
