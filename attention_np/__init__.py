"""Attention in NumPy: the textbook backend, explicit and vectorised."""

from attention_np.common import mods
from attention_np.common.block_mask import BlockMask
from attention_np.common.mods import and_masks, noop_mask, or_masks

from .arrays import asarray, load_state_dict, save_state_dict, to_numpy
from .distributed import ring_attention, ring_attention_vjp
from .flash import flash_attention, flash_attention_vjp
from .flex import create_block_mask, flex_attention, flex_attention_vjp
from .functional import apply_rope, scaled_dot_product_attention
from .gradients import scaled_dot_product_attention_vjp
from .latent import LatentTransformerBlock, MultiHeadLatentAttention
from .linear import linear_attention, linear_attention_state, linear_attention_step, linear_attention_vjp
from .modules import MultiHeadAttention, TransformerBlock
from .primitives import alibi_slopes, causal_mask, padding_mask, window_mask
from .varlen import varlen_attention, varlen_attention_vjp

__all__ = [
    "BlockMask",
    "LatentTransformerBlock",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "TransformerBlock",
    "alibi_slopes",
    "and_masks",
    "apply_rope",
    "asarray",
    "causal_mask",
    "create_block_mask",
    "flash_attention",
    "flash_attention_vjp",
    "flex_attention",
    "flex_attention_vjp",
    "linear_attention",
    "linear_attention_state",
    "linear_attention_step",
    "linear_attention_vjp",
    "load_state_dict",
    "mods",
    "noop_mask",
    "or_masks",
    "padding_mask",
    "ring_attention",
    "ring_attention_vjp",
    "save_state_dict",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_vjp",
    "to_numpy",
    "varlen_attention",
    "varlen_attention_vjp",
    "window_mask",
]
