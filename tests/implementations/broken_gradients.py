"""The NumPy backend with one realistic bug in its hand-derived backward pass: mutants of
attention_np/gradients.py, each made by one textual edit of the real source.

`BROKEN_GRADIENTS` maps a name to a module that implements the whole contract: the forward passes are
attention_np's own, the gradients come from the mutated copy of attention_np.gradients.
"""

from __future__ import annotations

import types
from pathlib import Path

import attention_np
import attention_np.gradients

SOURCE = Path(attention_np.gradients.__file__).read_text()

# name -> (the exact text in attention_np/gradients.py, its buggy replacement)
MUTATIONS: dict[str, tuple[str, str]] = {
    # the softmax Jacobian-vector product without its rowsum term: dS = P * dP
    "softmax_jvp_without_rowsum": ("weights * (d_weights - np.sum(d_weights * weights, axis=-1, keepdims=True))",
                                   "weights * d_weights"),
    # the key gradient without the scale of the scores
    "dk_not_scaled": ("dk = np.swapaxes(d_scores, -1, -2) @ q * scale", "dk = np.swapaxes(d_scores, -1, -2) @ q"),
    # a broadcast bias gets the full (..., L, S) gradient instead of its own shape
    "dbias_not_reduced": ("dbias = None if bias is None else _sum_to(d_scores, np.shape(bias))",
                          "dbias = None if bias is None else d_scores"),
    # LayerNorm's backward forgets what the variance takes from each entry
    "layer_norm_without_variance_term": ("- x_hat * np.mean(d_hat * x_hat, axis=-1, keepdims=True)) * inv_sigma",
                                         ") * inv_sigma"),
    # a Linear layer's weight gradient transposed: x^T dy instead of dy^T x
    "linear_weight_gradient_transposed": ('{"weight": dy_rows.T @ x_rows}', '{"weight": x_rows.T @ dy_rows}'),
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
    # pre-LN: the residual's gradient is dropped in the backward pass
    "pre_ln_residual_dropped": ("dh = dy + dh_norm2  # the residual passes dy on unchanged", "dh = dh_norm2"),
}


def _mutant(name: str, old: str, new: str) -> types.ModuleType:
    assert SOURCE.count(old) == 1, f"{name}: the text to mutate must occur once in attention_np/gradients.py"
    gradients = types.ModuleType(f"attention_np.gradients_{name}")
    gradients.__package__ = "attention_np"  # its relative imports resolve inside attention_np
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


BROKEN_GRADIENTS: dict[str, types.ModuleType] = {name: _mutant(name, *edit) for name, edit in MUTATIONS.items()}
