"""The partial contract (SPEC.md section 11): the features of the contract that a module may declare it lacks,
declared once, and the declaration a module makes.

A kernel author's module often has scaled_dot_product_attention alone, returns no weights, or takes no
boolean mask. It says so in one module-level name, and the suite checks the rest:

    from conformance import Declaration
    CONFORMANCE = Declaration(lacks={"weights": "a fused kernel", "dropout": "inference only"})

Each lacking feature turns the rows that need it into SKIP with the reason, and keeps the cases that use it
away from the module; only a contradiction of the spec is a FAIL. `FEATURES` says, for each feature, what the
contract asks and what the suite does without it; the suite's code reads the names of this table only.
Imports nothing but the standard library and attention_np.common.keywords, the keyword set's home, whose
table gives sdpa's keywords their rows here.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Mapping
from types import MappingProxyType, ModuleType
from typing import NamedTuple

from attention_np.common.keywords import KEYWORDS

DECLARATION = "CONFORMANCE"  # the module-level name the suite reads


class Feature(NamedTuple):
    """One feature of the contract, as SPEC.md section 11's table has it."""

    name: str
    kind: str  # "result", "training", "argument", "option", "rule", "dtype" or "errors": how the suite leaves it out
    asks: str  # what the contract asks, in words
    without: str  # what the suite does for a module that lacks it


_DRAWN = "drawn cases do without it; fixed cases that use it are skipped"
FEATURES: Mapping[str, Feature] = MappingProxyType({feature.name: feature for feature in (
    Feature("weights", kind="result", asks="need_weights=True returns the attention weights, before dropout",
            without="the weights a call returns are not compared: weights_rows and dropout's weights rows are skipped"),
    Feature("dropout", kind="training",
            asks="dropout (dropout_p, a module's dropout) in training mode, drawn from rng",
            without="the dropout groups are skipped; value checks configure no dropout; its error rows are skipped"),
    *(Feature(name, kind="argument", asks=keyword.asks, without=_DRAWN)  # sdpa's keywords, but for the mods
      for name, keyword in KEYWORDS.items() if keyword.feature == name and name != "score_mod"),
    Feature("mods", kind="argument",
            asks="programmable attention: flex_attention with mask and score functions and create_block_mask's "
                 "block mask (the catalogue of attention_np.common.mods), and mask_mod= and score_mod= on sdpa and "
                 "flash (flash's block_mask= too)",
            without="the flex operation is SKIP, as for a module without flex_attention; drawn sdpa and flash cases "
                    "take no mods; fixed cases that use them are skipped"),
    Feature("score_mod", kind="argument",
            asks=KEYWORDS["score_mod"].asks,
            without="drawn flex, sdpa and flash cases take no score function; fixed cases that use one are skipped"),
    Feature("update_rules", kind="argument",
            asks='linear_attention\'s update rules "gated", "delta" and "gated_delta" (update_rule, decay, beta; '
                 'causal), in its vjp (d_decay, d_beta) and its recurrent step',
            without='drawn linear cases under another rule than "linear" are passed over; fixed cases that use one '
                    'are skipped; read from the module too: a linear_attention without update_rule lacks it'),
    Feature("mha_is_causal", kind="argument",
            asks="MultiHeadAttention's call and vjp with is_causal=True (each head's query i sees keys j <= i)",
            without="drawn mha cases with causal heads are passed over; fixed cases that use them are skipped; read "
                    "from the module too: a MultiHeadAttention whose __call__ or vjp takes no is_causal lacks it"),
    Feature("mask_per_head", kind="argument", asks="modules' masks that differ between the heads, (..., H, L, S)",
            without="drawn module cases give every head the first head's mask; fixed cases that use it are skipped"),
    *(Feature(name, kind="option", asks=f"modules with {what}",
              without="drawn module cases keep the seed's layout; fixed cases that use it are skipped")
      for name, what in (
        ("num_kv_heads", "num_kv_heads below num_heads (grouped-query attention)"),
        ("bias_false", "bias=False (Linears without biases)"),
        ("rope_theta", "rope_theta (rotary position embeddings)"),
        ("attention_linear", 'attention="linear" (MultiHeadAttention with linear attention in each head)'),
        ("mha_sinks", "sinks=True (MultiHeadAttention's learned sink logit per head, the state's sinks (H,))"),
        ("position_alibi", 'position="alibi" (MultiHeadAttention with ALiBi\'s slopes alibi_slopes(H) on each head)'),
        ("norm_rms", 'norm="rms" (a block with RMSNorm)'), ("gelu", 'activation="gelu" (a block with GELU)'),
        ("swiglu", 'activation="swiglu" (a block with a SwiGLU feed-forward network)'))),
    Feature("mha_cache", kind="argument",
            asks="MultiHeadAttention's own cache: init_cache, and extend(x_q, x_kv, cache), decoding with the keys "
                 "and values of another input (cross-attention)",
            without="drawn decode cases attend to their own input through the block's extend; fixed cases that use "
                    "it are skipped; read from the module too: a TransformerBlock with extend beside a "
                    "MultiHeadAttention without one lacks it"),
    Feature("cache_lengths", kind="argument",
            asks="a key/value cache with a length per sequence: extend(..., new_lengths=), ragged chunks whose "
                 "padding rows give zeros",
            without="drawn decode cases take every row of each chunk; fixed cases that use it are skipped; read from "
                    "the module too: a TransformerBlock.extend without new_lengths lacks it"),
    Feature("paged_cache", kind="argument",
            asks="the paged cache: init_paged_cache, a block table of pages shuffled and reused, NaN in the unused "
                 "slots reaching no output",
            without="drawn decode cases decode through init_cache's contiguous cache; fixed cases that use it are "
                    "skipped; read from the module too: a TransformerBlock without init_paged_cache lacks it"),
    Feature("streaming_cache", kind="argument",
            asks="the streaming cache: init_cache(..., sink_tokens=, window=, rope_positions=), the first positions "
                 "and a ring of the last ones in fixed slots, decoding past them as one pass with the streaming mask",
            without="drawn decode cases decode through init_cache's contiguous cache; fixed cases that use it are "
                    "skipped; read from the module too: a TransformerBlock.init_cache without window lacks it"),
    Feature("linear_cache", kind="argument",
            asks='decoding with attention="linear": init_cache gives linear attention\'s recurrent state (a '
                 "LinearCache: S and z per key/value head), extend carries it, chunk by chunk the causal pass",
            without='drawn decode cases with attention="linear" are passed over; fixed cases that use it are '
                    "skipped; read from the module too: a TransformerBlock.from_state_dict without attention lacks "
                    "it"),
    Feature("masked_rows", kind="rule",
            asks="a query that sees no key gets an output row (sdpa) and a weights row of zeros",
            without="the rows of such queries are left out of every comparison (modules: a position where a head "
                    "sees no key; with no keys, S = 0, every query); the edge cases and the gradient rule about them "
                    "are skipped"),
    Feature("non_finite", kind="rule",
            asks="NaN and inf in the inputs reach exactly the rows that see them (SPEC 10)",
            without="the edge cases with NaN or inf inputs are skipped"),
    Feature("empty", kind="rule", asks="L = 0 or S = 0 gives empty outputs and zeros",
            without="the edge cases with an empty axis are skipped"),
    *(Feature(dtype, kind="dtype", asks=f"inputs in {dtype}",
              without=f"the rows in {dtype} are skipped, the round trip's and apply_rope's cases in it too, and the "
                      f"error rows whose message names {dtype}" + without)
      for dtype, without in (("float16", " or whose arrays hold it"), ("bfloat16", " or whose arrays hold it"),
                             ("float64", "; the pinned examples run in the module's first dtype, the other error "
                                         "rows with their float64 arrays in float32"))),
    Feature("exceptions", kind="errors",
            asks="bad input raises the exception type of SPEC 7, its message naming the arguments and shapes",
            without="a bad call must still raise, but any exception will do"),
)})


# Features renamed after the options they cover (a feature is what the contract offers, named as its option is);
# a Declaration reads the old names, with a DeprecationWarning, until the next release
RENAMED: MappingProxyType[str, str] = MappingProxyType({
    "no_bias": "bias_false", "rope": "rope_theta", "linear_attention": "attention_linear", "rms_norm": "norm_rms"})


class Declaration:
    """What a module lacks of the contract: the names of FEATURES, each with why (optional). The suite reads it
    from the module's CONFORMANCE; a module without one lacks nothing.

    Declaration(lacks=("weights", "dropout")) or Declaration(lacks={"weights": "a fused kernel"}); two
    declarations join with |."""

    lacks: Mapping[str, str]  # feature -> why ("" where not given), read-only

    def __init__(self, lacks: Iterable[str] | Mapping[str, str] = ()) -> None:
        reasons = dict(lacks) if isinstance(lacks, Mapping) else dict.fromkeys(lacks, "")
        if renamed := sorted(name for name in reasons if name in RENAMED):
            warnings.warn(f"Declaration: the features {renamed} are now {[RENAMED[name] for name in renamed]}; the "
                          "old names are read until the next release", DeprecationWarning, stacklevel=2)
            reasons = {RENAMED.get(name, name): why for name, why in reasons.items()}
        unknown = sorted(name for name in reasons if name not in FEATURES)
        if unknown:
            raise ValueError(f"Declaration: unknown features {unknown}; the features are {sorted(FEATURES)}")
        self.lacks = MappingProxyType(dict(sorted(reasons.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Declaration) and dict(self.lacks) == dict(other.lacks)

    __hash__ = None  # type: ignore[assignment]  # equal by value, as the dict it holds

    def __contains__(self, feature: str) -> bool:
        return RENAMED.get(feature, feature) in self.lacks

    def __or__(self, other: Declaration) -> Declaration:
        return Declaration({**self.lacks, **{name: why or self.lacks.get(name, "")
                                             for name, why in other.lacks.items()}})

    def reason(self, *features: str) -> str | None:
        """Why a row that needs these features is skipped ("lacks weights: a fused kernel"), or None when the
        module has them all."""
        lacking = [RENAMED.get(name, name) for name in features if name in self]
        return "; ".join(f"lacks {name}" + (f": {self.lacks[name]}" if self.lacks[name] else "")
                         for name in lacking) or None

    def __repr__(self) -> str:
        return f"Declaration({dict(self.lacks)!r})"


def declaration_of(module: ModuleType) -> Declaration:
    """What the module lacks: what its signatures say (`from_signatures`, `from_linear`) and its classes' methods
    (`from_methods`), joined with its declaration (CONFORMANCE), whose reasons win; a module whose functions take
    every keyword, whose classes have every method and that declares nothing lacks nothing."""
    declared = getattr(module, DECLARATION, None)
    if declared is not None and not isinstance(declared, Declaration):
        raise TypeError(f"{module.__name__}.{DECLARATION} must be a conformance.Declaration, got "
                        f"{type(declared).__name__}")
    return (from_signatures(module) | from_methods(module) | from_linear(module) | from_module_options(module)
            | (declared or Declaration()))


def from_methods(module: ModuleType) -> Declaration:
    """Where the module's TransformerBlock decodes (has extend): mha_cache where its MultiHeadAttention does not
    (the reason "no MultiHeadAttention.extend"), cache_lengths where the block's extend takes no new_lengths,
    paged_cache where the block has no init_paged_cache, streaming_cache where its init_cache takes no window, and
    linear_cache where its from_state_dict takes no attention (no block of linear heads to decode); nothing
    otherwise (a module without TransformerBlock.extend has no decode operation to leave the features out of)."""
    block, attention = (getattr(module, name, None) for name in ("TransformerBlock", "MultiHeadAttention"))
    extend = getattr(block, "extend", None)
    if not callable(extend):
        return Declaration()
    lacks = {}
    if not callable(getattr(attention, "extend", None)):
        lacks["mha_cache"] = "no MultiHeadAttention.extend"
    if not takes(extend, "new_lengths"):
        lacks["cache_lengths"] = "no new_lengths in TransformerBlock.extend"
    if not callable(getattr(block, "init_paged_cache", None)):
        lacks["paged_cache"] = "no TransformerBlock.init_paged_cache"
    if not takes(getattr(block, "init_cache", None), "window"):
        lacks["streaming_cache"] = "no window in TransformerBlock.init_cache"
    if not takes(getattr(block, "from_state_dict", None), "attention"):
        lacks["linear_cache"] = "no attention in TransformerBlock.from_state_dict"
    return Declaration(lacks)


def from_linear(module: ModuleType) -> Declaration:
    """What the suite's later draws of linear attention need, read off the signatures: update_rules where the
    module's linear_attention takes no update_rule, mha_is_causal where its MultiHeadAttention's __call__ or vjp
    takes no is_causal (a module written before keeps passing the rows it ran); nothing otherwise."""
    lacks = {}
    function = getattr(module, "linear_attention", None)
    if callable(function) and not takes(function, "update_rule"):
        lacks["update_rules"] = "no update_rule in linear_attention"
    attention = getattr(module, "MultiHeadAttention", None)
    calls = [getattr(attention, name, None) for name in ("__call__", "vjp")]
    if attention is not None and not all(takes(call, "is_causal") for call in calls if callable(call)):
        lacks["mha_is_causal"] = "no is_causal in MultiHeadAttention.__call__ or vjp"
    return Declaration(lacks)


def from_module_options(module: ModuleType) -> Declaration:
    """The module options read off MultiHeadAttention's signatures: mha_sinks where its constructor takes no sinks,
    position_alibi where its from_state_dict takes no position (a module written before keeps passing the rows it
    ran); nothing otherwise, or without a MultiHeadAttention."""
    attention = getattr(module, "MultiHeadAttention", None)
    if attention is None:
        return Declaration()
    lacks = {}
    if not takes(attention, "sinks"):
        lacks["mha_sinks"] = "no sinks in MultiHeadAttention's constructor"
    if not takes(getattr(attention, "from_state_dict", None), "position"):
        lacks["position_alibi"] = "no position in MultiHeadAttention.from_state_dict"
    return Declaration(lacks)


def takes(function: object, name: str) -> bool:
    """Whether `function` takes the keyword `name` (or **keywords); True where its signature cannot be read."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


SIGNED = ("scaled_dot_product_attention", "flash_attention", "varlen_attention")  # the function whose signature
# tells, the first there


def from_signatures(module: ModuleType) -> Declaration:
    """The features of the keywords of the set (KEYWORDS) that the module's scaled_dot_product_attention (or, without
    one, flash_attention, or without both varlen_attention) does not take, each with the reason "not in the signature
    of ...": a kernel written before a keyword joined the contract keeps passing the rows it can run. Nothing where
    the function takes **keywords, where none of them is there, or where its signature cannot be read."""
    name = next((name for name in SIGNED if callable(getattr(module, name, None))), None)
    if name is None:
        return Declaration()
    try:
        parameters = inspect.signature(getattr(module, name)).parameters
    except (TypeError, ValueError):  # a builtin or extension function without a readable signature
        return Declaration()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return Declaration()
    return Declaration({keyword.feature: f"not in the signature of {name}" for keyword_name, keyword in KEYWORDS.items()
                        if keyword_name not in parameters})
