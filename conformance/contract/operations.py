"""The operations the suite checks, declared once: everything the suite, the tables and the command line
need to know about an operation is an entry of OPERATIONS, and nothing else dispatches on the kind of a case.

Shape legend: B batch, H heads, L query positions, S key/value positions, E query/key width,
Ev value width, D = d_model, F = d_ff, ... leading batch axes.

Adding an operation is one entry here, its case type (conformance/contract/cases.py), its oracle
(conformance/contract/oracle.py), its strategy (conformance/contract/strategies.py) and its rows in
conformance/contract/fixed_cases.py.
Imports NumPy alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from attention_np.common import keywords

from ..frameworks.registry import framework_of
from . import oracle, oracle_gradients
from .cases import (
    RING_DEVICES,
    BlockCase,
    Case,
    DecodeCase,
    FlashCase,
    FlexCase,
    LinearCase,
    MhaCase,
    MlaCase,
    Paging,
    RingCase,
    SdpaCase,
    Streaming,
    VarlenCase,
    block_case,
    boundaries,
    page_tables,
    per_query_head,
)
from .features import Declaration, takes

Pair = tuple[np.ndarray, np.ndarray | None]  # (out, weights)


class Site(NamedTuple):
    """The keep / drop decisions that one call of a probe's case draws at one dropout site."""

    shape: tuple[int, ...]  # (..., *axes), in the order the site draws them (C order)
    axes: tuple[str, ...]  # the names of the last axes of `shape`, after the leading (batch) axes
    shown_through: tuple[str, np.ndarray] | None = None  # (another site, True at those of its decisions, of its
    # shape, that show or hide this site's): left out where the two sites are compared


class Probe(NamedTuple):
    """A case made from a drawn one whose output in training mode shows the keep / drop decisions of the
    dropout sites exactly (checks.dropout_independence): the drawn sizes, chosen values. Each decision it
    shows is exact; the block's probe shows its inner sites' only where a residual decision keeps them."""

    case: Any  # the operation's case
    sites: dict[str, Site]  # the sites it shows, in the order the operation draws them
    decisions: Callable[[np.ndarray, float], dict[str, np.ndarray] | None]  # (out, p) -> {site: True / 1 where
    # dropped, False / 0 where kept, NaN where out does not show it}; None where out holds a value that no keep /
    # drop decisions give
    per_call: float | None = None  # about the fewest decisions that one call shows in a family the check compares;
    # None: every decision of every site shows


class Operation(NamedTuple):
    """One operation of the contract (SPEC.md section 1)."""

    name: str  # the short name in reports and on the command line
    function: str  # the contract's name for it: a function or a class of the module
    case: type  # its case type (conformance/contract/cases.py)
    options: tuple[str, ...]  # the case's fields that are static options (hashable), not arrays
    inputs: tuple[str, ...]  # the case's arrays that carry positions: repeated for dropout draws
    differentiable: tuple[str, ...]  # the arguments a vjp differentiates ("state": every parameter)
    strategy: str  # its Hypothesis strategy, a name in conformance/contract/strategies.py (imported only to draw)
    oracle: Callable[[Any, str, bool], Pair]  # (case, precision, fused_bias) -> the expected (out, weights), eval
    call: Callable[..., Any]  # (module, arrays, rng, *, training, need_weights, **options) -> (out, weights)
    vjp: str  # the contract's name of the gradient interface, e.g. "MultiHeadAttention.vjp"
    pullback: Callable[..., Any]  # (module, arrays, rng, **options) -> {argument: gradient} at arrays["d_out"]
    visible: Callable[[Any], np.ndarray] | None  # (..., L, S): query i sees key j (in some head); None: not kept
    dropout_sigma: Callable[[Any, np.ndarray, float, int], np.ndarray] | None  # sd of the mean of n draws
    dropout_shows: Callable[[Any], bool]  # whether dropout can change the output at all
    dropout_probe: Callable[[Any, Declaration], Probe] | None  # (case, lacks) -> a probe of its dropout sites
    uses: Callable[[Any], set[str]]  # the case -> the arguments and options of conformance.contract.features it uses
    leave_out: Callable[[Any, Declaration], Any]  # (case, lacks) -> the case without them, or None (SPEC 11)
    blind: Callable[[Any], tuple[np.ndarray, np.ndarray] | None]  # the case -> (out rows, weights rows) where a
    # query sees no key ((..., L) and (..., [H,] L)), or None where every query sees one
    pair: Callable[[Any], Pair] = lambda result: result  # the call's result, as NumPy arrays -> (out, weights)
    second: str | None = "weights"  # what the second result is: the weights, or flash_attention's "lse" (..., L),
    # the same on every path (-inf where a query sees no key); None: the call returns out alone (linear_attention),
    # which `pair` gives as (out, None)
    devices: int = 1  # the devices its cases use at most (ring attention's P); with fewer, the operation is SKIP
    needs: str | None = None  # a feature of conformance.contract.features without which a module cannot run any of
    # its cases (flex: "mods"): a module that declares it lacking has the operation SKIP, as one without `function`
    oracle_vjp: Callable[[Any, np.ndarray, str, bool], dict[str, np.ndarray]] | None = None  # (case, d_out,
    # precision, fused_bias) -> the oracle's own gradients {argument: gradient} (conformance/contract/
    # oracle_gradients.py; fused_bias as for `oracle`); None: it has none
    packed: bool = False  # the positions come first, q (Tq, H, E) (varlen): `visible` is then (H, Tq, Tk) and the
    # rows of a gradient (T, heads), so a check swaps the last two axes of its rows


def arrays_and_options(case: Case) -> tuple[dict[str, Any], dict[str, Any]]:
    """The case's arrays (NumPy arrays, None or state dicts) and its static options. An option given as an
    array (sdpa's q_offset per sequence) is an array input: JAX traces it instead of compiling it in."""
    operation = operation_of(case)
    fields = case._asdict()
    static = [name for name in operation.options if not isinstance(fields[name], np.ndarray)]
    return ({name: value for name, value in fields.items() if name not in static},
            {name: fields[name] for name in static})


def keywords_used(case: Case) -> dict[str, Any]:
    """The case's keywords of SPEC.md section 2a that differ from their defaults (OPTIONAL_KEYWORDS): passed
    to the module only then, so a module without them still runs every case that does not use them."""
    fields = case._asdict()
    return {name: fields[name] for name, default in OPTIONAL_KEYWORDS.items()
            if name in fields and not _is_default(fields[name], default)}


def options_used(case: Case) -> dict[str, Any]:
    """The case's module options of SPEC.md section 5 that differ from the seed's (MODULE_OPTIONS): the
    layout of its state (num_kv_heads, bias, norm), activation "swiglu", rope_theta and attention "linear". A
    state dict carries its layout, which from_state_dict reads off the shapes, so only activation, rope_theta and
    attention reach the module as arguments; a module from before these options still runs every case that keeps
    the seed's."""
    fields, options = case._asdict(), operation_of(case).options  # sdpa's bias is an array, not this option
    return {name: fields[name] for name, seed in MODULE_OPTIONS.items() if name in options and fields[name] not in seed}


def _is_default(value: Any, default: Any) -> bool:
    """Whether a keyword's value is its default; an array (NumPy's, or the module's own inside a staged call)
    never is."""
    return value is default or (isinstance(value, int | float | tuple) and value == default)


def operation_of(case: Case) -> Operation:
    """The operation whose case type `case` is."""
    return _BY_CASE[type(case)]


def missing(module: ModuleType, names: tuple[str, ...]) -> list[str]:
    """The names (dotted for a method: "MultiHeadAttention.vjp") that `module` lacks."""
    def has(name: str) -> bool:
        owner: Any = module
        for part in name.split("."):
            if not hasattr(owner, part):
                return False
            owner = getattr(owner, part)
        return True
    return [name for name in names if not has(name)]


def features_used(case: Case) -> set[str]:
    """The features of conformance.contract.features that `case` uses: its operation's arguments and options, and the
    rules its inputs reach (masked_rows: a query that sees no key; non_finite: NaN or inf in an input, a -inf
    bias entry or sink aside (a hidden key, no sink); empty: an axis of length 0)."""
    arrays = {name: value for name, value in case._asdict().items() if isinstance(value, np.ndarray | dict)}
    hiding = [value for name, value in arrays.items() if name in ("bias", "sinks")]  # -inf hides, as the spec says
    inputs = [value for name, value in arrays.items() if name not in ("state", "bias", "sinks", "mask")]
    inputs += list(arrays.get("state", {}).values())
    try:
        blind = operation_of(case).blind(case) is not None
    except (ValueError, IndexError):  # an error row's mask may not broadcast: no query counts as blind
        blind = False
    reached = {"masked_rows": blind,
               "non_finite": any(not np.all(np.isfinite(x)) for x in inputs if x.dtype.kind == "f")
               or any(bool(np.any(np.isnan(x) | (x == np.inf))) for x in hiding),
               "empty": any(x.ndim >= 2 and x.shape[-2] == 0 for x in inputs)}  # L = 0 or S = 0
    return operation_of(case).uses(case) | {name for name, used in reached.items() if used}


def leave_out(case: Case, declaration: Declaration) -> Case | None:
    """`case` as a module that lacks the declared features runs it: their arguments at the defaults (grouped
    heads repeated per query head, the same attention), no dropout configured where the module lacks dropout,
    or None where the case needs a lacking module option (SPEC 11)."""
    return operation_of(case).leave_out(without_dropout(case, declaration), declaration) if declaration.lacks \
        else case


def without_dropout(case: Case, declaration: Declaration) -> Case:
    """The case with no dropout configured where the module lacks dropout (in eval mode nothing changes)."""
    return case._replace(dropout=0.0) if "dropout" in declaration else case


# A constructor's keyword arguments (an error row at stage "init"): the feature each needs, and when it does
INIT_FEATURES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "dropout": ("dropout", lambda value: value != 0), "num_kv_heads": ("num_kv_heads", lambda value: value is not None),
    "bias": ("bias_false", lambda value: value is False),
    "rope_theta": ("rope_theta", lambda value: value is not None),
    "norm": ("norm_rms", lambda value: value != "layer"),
    "attention": ("attention_linear", lambda value: value != "softmax"),
    "sinks": ("mha_sinks", lambda value: value is True),
    "position": ("position_alibi", lambda value: value is not None)}


def init_features_used(arguments: dict[str, Any]) -> set[str]:
    """The features a constructor call with these keyword arguments needs."""
    return {INIT_FEATURES[name][0] for name, value in arguments.items()
            if name in INIT_FEATURES and INIT_FEATURES[name][1](value)}


# --- scaled dot-product attention --------------------------------------------------------------------------

# The keywords of SPEC.md section 2a and their defaults (attention_np.common.keywords, the keyword set's home); a
# case passes one only where it differs.
OPTIONAL_KEYWORDS: dict[str, Any] = keywords.defaults(keywords.POSITIONS)
# The mods on sdpa and flash (programmable attention) and their defaults: passed only where given, so that a
# module without them runs every case that has none; the features they need (conformance.contract.features)
MOD_KEYWORDS: dict[str, None] = keywords.defaults(keywords.MODS)
MOD_FEATURES: dict[str, set[str]] = {"mask_mod": {"mods"}, "score_mod": {"mods", "score_mod"}}
# The keywords of one value per head (SPEC 2h sinks, 2i alibi_slopes) and their defaults: an operation takes those
# its options name (its case has the field, its strategy draws it), passed only where given (an array)
PER_HEAD_KEYWORDS: dict[str, None] = keywords.defaults(keywords.PER_HEAD)


def per_head_used(case: Case) -> dict[str, Any]:
    """The case's keywords of one value per head (sinks, alibi_slopes) that are given: passed to the module only
    then."""
    fields = case._asdict()
    return {name: fields[name] for name in PER_HEAD_KEYWORDS if fields.get(name) is not None}


def per_head_lacks(module: ModuleType) -> Declaration:
    """The features of the keywords of one value per head (sinks, alibi_slopes) that a function of `module` does not
    take where its operation's options name them (no such keyword and no **keywords in its signature), each with the
    reason "not in the signature of ring_attention": a ring or flex kernel written before sinks keeps passing the
    rows it can run, as features.from_signatures reads sdpa's keywords off one function."""
    lacks: dict[str, str] = {}
    for name in PER_HEAD_KEYWORDS:
        for operation in OPERATIONS.values():
            function = getattr(module, operation.function, None)
            if name in operation.options and callable(function) and not takes(function, name):
                lacks.setdefault(keywords.KEYWORDS[name].feature, f"not in the signature of {operation.function}")
    return Declaration(lacks)


def _per_head(arrays: dict, options: dict) -> dict[str, Any]:
    """The keywords of one value per head that are given (arrays), taken out of the options where a None one
    travels as a static option."""
    given = {name: options.pop(name) if name in options else arrays.get(name) for name in PER_HEAD_KEYWORDS}
    return {name: value for name, value in given.items() if value is not None}


def mods_used(case: Case) -> dict[str, Any]:
    """The case's mods (mask_mod, score_mod) that are given: passed to the module only then."""
    fields = case._asdict()
    return {name: fields[name] for name in MOD_KEYWORDS if fields.get(name) is not None}


def _sdpa_oracle(case: SdpaCase, precision: str, fused_bias: bool) -> Pair:  # sdpa has no Linear: no bias to fuse
    return oracle.sdpa(case.q, case.k, case.v, case.mask, bias=case.bias, is_causal=case.is_causal,
                       scale=case.scale, q_offset=case.q_offset, window=case.window, key_lengths=case.key_lengths,
                       softcap=case.softcap, enable_gqa=case.enable_gqa, mask_mod=case.mask_mod,
                       score_mod=case.score_mod, dtype=precision, **per_head_used(case))


def _sdpa_oracle_vjp(case: SdpaCase | FlashCase, d_out: np.ndarray, precision: str,
                     fused_bias: bool) -> dict[str, np.ndarray]:  # sdpa has no Linear: no bias to fuse
    """The gradients of sdpa's out (flash_attention's too: its pullback takes d_out alone, and recomputes P from
    the log-sum-exp it keeps), eval mode."""
    return oracle_gradients.sdpa_vjp(case.q, case.k, case.v, d_out, case.mask, bias=case.bias,
                                     is_causal=case.is_causal, scale=case.scale, q_offset=case.q_offset,
                                     window=case.window, key_lengths=case.key_lengths, softcap=case.softcap,
                                     enable_gqa=case.enable_gqa, mask_mod=case.mask_mod, score_mod=case.score_mod,
                                     dtype=precision, from_lse=isinstance(case, FlashCase), **per_head_used(case))


def _sdpa_keywords(arrays: dict, options: dict) -> tuple[dict, dict]:
    """The options without the section 2a keywords and the mods, and those keywords (static or arrays) that
    differ from their defaults, and the mods given: only they reach the module."""
    given = {name: options.pop(name) if name in options else arrays.get(name) for name in OPTIONAL_KEYWORDS}
    mods = {name: options.pop(name, None) for name in MOD_KEYWORDS}
    return options, {name: value for name, value in given.items()
                     if not _is_default(value, OPTIONAL_KEYWORDS[name])} | {
        name: value for name, value in mods.items() if value is not None} | _per_head(arrays, options)


def _sdpa_call(module: ModuleType, arrays: dict, rng: Any, *, training: bool, need_weights: bool,
               dropout: float, **options: Any) -> Any:
    options, keywords = _sdpa_keywords(arrays, options)
    return module.scaled_dot_product_attention(arrays["q"], arrays["k"], arrays["v"], arrays["mask"],
                                               bias=arrays["bias"], dropout_p=dropout if training else 0.0,
                                               need_weights=need_weights, rng=rng, **options, **keywords)


def _sdpa_pullback(module: ModuleType, arrays: dict, rng: Any, *, dropout: float, **options: Any) -> dict:
    options, keywords = _sdpa_keywords(arrays, options)
    _, _, pullback = module.scaled_dot_product_attention_vjp(arrays["q"], arrays["k"], arrays["v"], arrays["mask"],
                                                             bias=arrays["bias"], **options, **keywords)
    return _gradients(pullback(arrays["d_out"]), keywords)


def _gradients(grads: tuple, keywords: dict) -> dict:
    """(dq, dk, dv, dbias), with sinks d_sinks after dbias, and with a score function its parameters' gradients
    d_score_mod (a dict, the last element) by "score_mod.<parameter>"."""
    names = ("q", "k", "v", "bias") + (("sinks",) if "sinks" in keywords else ())
    if "score_mod" not in keywords:
        return dict(zip(names, grads, strict=True))
    *grads, d_score_mod = grads
    named = dict(zip(names, grads, strict=True))
    return named | {f"score_mod.{name}": grad for name, grad in dict(d_score_mod).items()}


def _sdpa_visible(case: SdpaCase) -> np.ndarray:
    """Which keys each query sees, by the spec: mask, -inf bias, and the positions' rules (causal, window,
    key lengths); (..., L, S)."""
    L, S = case.q.shape[-2], case.k.shape[-2]
    visible = np.ones((*_batch(case), L, S), dtype=bool)
    if case.mask is not None:
        visible = visible & (case.mask != 0)
    if case.bias is not None:
        visible = visible & (case.bias != -np.inf)
    offset = np.reshape(case.q_offset, (*np.shape(case.q_offset), 1, 1))  # (...) -> (..., 1, 1)
    position, j = offset + np.arange(L)[:, None], np.arange(S)  # (..., L, 1), (S,)
    if case.is_causal:
        visible = visible & (j <= position)
    if case.window is not None:
        left, right = case.window
        visible = visible & (left is None or j >= position - left) & (right is None or j <= position + right)
    if case.key_lengths is not None:
        visible = visible & (j < np.reshape(case.key_lengths, (*np.shape(case.key_lengths), 1, 1)))
    if getattr(case, "mask_mod", None) is not None:  # (B, H, L, S): mods come with four axes (ring has none)
        visible = visible & _mask_grid(case.mask_mod, visible.shape)
    return visible


def _sdpa_uses(case: SdpaCase) -> set[str]:
    """mask, bias, is_causal, scale (given), the keywords of SPEC 2a that differ from their defaults, sinks and
    alibi_slopes where given, and dropout where one is configured (the dropout groups, an error row)."""
    given = {"mask": case.mask is not None, "bias": case.bias is not None, "is_causal": case.is_causal,
             "scale": case.scale is not None, "dropout": case.dropout != 0}
    mods = set().union(*(MOD_FEATURES[name] for name in mods_used(case)))
    return {name for name, used in given.items() if used} | set(keywords_used(case)) | mods | set(per_head_used(case))


SDPA_DEFAULTS = keywords.defaults(("mask", "bias", "is_causal", "scale")) | OPTIONAL_KEYWORDS | PER_HEAD_KEYWORDS


def _sdpa_leave_out(case: SdpaCase | FlashCase | FlexCase, declaration: Declaration) -> Any:
    """The lacking arguments at their defaults; with enable_gqa lacking, k and v repeated per query head; without
    mods no mask or score function (nor a block mask), without score_mod no score function."""
    if case.enable_gqa and "enable_gqa" in declaration:
        case = case._replace(**dict(zip(("k", "v"), per_query_head(case), strict=True)))
    fields = case._asdict()
    mods = {name: None for name, features in MOD_FEATURES.items()
            if name in fields and features & set(declaration.lacks)}
    mods |= {"block_size": None, "with_mask_mod": False} if "block_size" in fields and "mods" in declaration else {}
    return case._replace(**{name: default for name, default in SDPA_DEFAULTS.items()
                            if name in declaration and name in fields}, **mods)


def _sdpa_blind(case: SdpaCase) -> tuple[np.ndarray, np.ndarray] | None:
    """The queries that see no key (..., L), for out and weights alike."""
    blind = ~np.any(_sdpa_visible(case), axis=-1)  # (..., L)
    return (blind, blind) if np.any(blind) else None


def _sdpa_dropout_sigma(case: SdpaCase, weights: np.ndarray, p: float, draws: int) -> np.ndarray:
    """The standard deviation of the mean of `draws` inverted-dropout outputs, per entry (..., L, Ev)."""
    return np.sqrt(p / (1 - p) * (weights**2) @ (per_query_head(case)[1] ** 2) / draws)


def _sdpa_dropout_probe(case: SdpaCase, declaration: Declaration) -> Probe:
    """q = 0, no mask, no bias, not causal: every weight is 1 / S; v = I (Ev = S): out_ls = keep_ls / (S (1 - p)),
    0 exactly where weight (l, s) was dropped."""
    (L, S), batch = (case.q.shape[-2], case.k.shape[-2]), _batch(case)
    v = np.broadcast_to(np.eye(S), (*case.v.shape[:-2], S, S)).copy()  # (..., S, S)
    probe = case._replace(q=np.zeros_like(case.q), v=v, mask=None, bias=None, is_causal=False,
                          **OPTIONAL_KEYWORDS | MOD_KEYWORDS | PER_HEAD_KEYWORDS
                          | {"enable_gqa": case.enable_gqa})  # the heads as drawn
    return Probe(probe, sites={"attention weights": Site((*batch, L, S), ("queries", "keys"))},
                 decisions=lambda out, p: _dropped({"attention weights": out}, 1 / (S * (1 - p))))


def _batch(case: SdpaCase | MhaCase) -> tuple[int, ...]:
    """The leading axes of the scores (..., H with enable_gqa)."""
    k, v = per_query_head(case) if isinstance(case, SdpaCase | FlashCase | RingCase) else (case.k, case.v)
    return np.broadcast_shapes(case.q.shape[:-2], k.shape[:-2], v.shape[:-2])


def _dropped(outputs: dict[str, np.ndarray], kept: float) -> dict[str, np.ndarray] | None:
    """{site: True where its output is 0}, if every output is 0 or `kept` (to 1e-4); None otherwise."""
    dropped = {site: out == 0 for site, out in outputs.items()}
    ok = all(np.all(dropped[site] | (np.abs(out - kept) <= 1e-4 * kept)) for site, out in outputs.items())
    return dropped if ok else None


# --- tiled attention (flash_attention) ---------------------------------------------------------------------

def _flash_oracle(case: FlashCase | RingCase, precision: str, fused_bias: bool) -> Pair:
    """sdpa's out, and each row's log-sum-exp in place of the weights (ring attention's too: the devices and
    the tiles change nothing but rounding)."""
    return oracle.log_sum_exp(case.q, case.k, case.v, case.mask, bias=case.bias, is_causal=case.is_causal,
                              scale=case.scale, q_offset=case.q_offset, window=case.window,
                              key_lengths=case.key_lengths, softcap=case.softcap, enable_gqa=case.enable_gqa,
                              mask_mod=getattr(case, "mask_mod", None), score_mod=getattr(case, "score_mod", None),
                              dtype=precision, **per_head_used(case))  # ring cases have no mods


def _flash_call(module: ModuleType, arrays: dict, rng: Any, *, training: bool, need_weights: bool,
                dropout: float, **options: Any) -> Any:
    """(out, lse): flash_attention has no dropout and one path, so training and need_weights change nothing. A
    bias, like the keywords of SPEC 2a and the mods, is passed only where the case has one (a kernel may lack
    it)."""
    options, keywords = _flash_keywords(module, arrays, options)
    return module.flash_attention(arrays["q"], arrays["k"], arrays["v"], arrays["mask"], **options, **keywords)


def _flash_pullback(module: ModuleType, arrays: dict, rng: Any, *, dropout: float, **options: Any) -> dict:
    options, keywords = _flash_keywords(module, arrays, options)
    _, _, pullback = module.flash_attention_vjp(arrays["q"], arrays["k"], arrays["v"], arrays["mask"], **options,
                                                **keywords)
    return _gradients(pullback(arrays["d_out"]), keywords)


def _flash_keywords(module: ModuleType, arrays: dict, options: dict) -> tuple[dict, dict]:
    """As _sdpa_keywords, with the bias among the keywords passed only where given, and the tiles: block_q and
    block_k, or with a block size the block mask made of mask_mod in its place (block_q and block_k passed too
    only where they differ from its BLOCK_SIZE, mask_mod only with with_mask_mod: the error rows)."""
    block_q, block_k = options.pop("block_q"), options.pop("block_k")
    block_size, with_mask_mod = options.pop("block_size", None), options.pop("with_mask_mod", False)
    options, keywords = _sdpa_keywords(arrays, options)
    keywords |= {} if arrays["bias"] is None else {"bias": arrays["bias"]}
    if block_size is None or "mask_mod" not in keywords:
        return options, keywords | {"block_q": block_q, "block_k": block_k}
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    B, H, L, S = max(q.shape[0], k.shape[0], v.shape[0]), q.shape[1], q.shape[2], k.shape[2]  # q (B, H, L, E)
    mask_mod = keywords.pop("mask_mod")
    keywords["block_mask"] = module.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=block_size)
    keywords |= {"mask_mod": mask_mod} if with_mask_mod else {}
    return options, keywords | ({} if (block_q, block_k) == tuple(block_size) else
                                {"block_q": block_q, "block_k": block_k})


# --- ring attention (ring_attention) -----------------------------------------------------------------------

def _ring_call(module: ModuleType, arrays: dict, rng: Any, *, training: bool, need_weights: bool, dropout: float,
               devices: int, **options: Any) -> Any:
    """(out, lse) over P of the framework's devices, whole arrays in and out (frameworks.ring_job): one path, no
    dropout. Ring attention takes no mask, bias or key lengths (the case's are None)."""
    options, keywords = _sdpa_keywords(arrays, options)
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    return framework_of(module).ring(module, devices, {"q": q, "k": k, "v": v}, options | keywords, (-2, -1))


def _ring_pullback(module: ModuleType, arrays: dict, rng: Any, *, dropout: float, devices: int,
                   **options: Any) -> dict:
    """ring_attention_vjp's pullback at d_out, run on the P devices as the forward pass is."""
    options, keywords = _sdpa_keywords(arrays, options)
    inputs = {name: arrays[name] for name in ("q", "k", "v", "d_out")}
    sunk = "sinks" in keywords  # d_sinks follows dv, the whole sequence's (no sequence axis: None)
    grads = framework_of(module).ring(module, devices, inputs, options | keywords, (-2, -2, -2) + ((None,) * sunk))
    return dict(zip(("q", "k", "v") + (("sinks",) * sunk), grads, strict=True))


# --- linear attention (linear_attention) ---------------------------------------------------------------------

def _linear_oracle(case: LinearCase, precision: str, fused_bias: bool) -> Pair:
    """The double sum over the keys each query sees, or the update rule's recurrence one position at a time (the
    form and the chunk change nothing but rounding); no second result."""
    return oracle.linear_attention(case.q, case.k, case.v, feature_map=case.feature_map, is_causal=case.is_causal,
                                   key_lengths=case.key_lengths, eps=case.eps, update_rule=case.update_rule,
                                   decay=case.decay, beta=case.beta, dtype=precision), None


def _linear_oracle_vjp(case: LinearCase, d_out: np.ndarray, precision: str,
                       fused_bias: bool) -> dict[str, np.ndarray]:
    return oracle_gradients.linear_attention_vjp(case.q, case.k, case.v, d_out, feature_map=case.feature_map,
                                                 is_causal=case.is_causal, key_lengths=case.key_lengths, eps=case.eps,
                                                 update_rule=case.update_rule, decay=case.decay, beta=case.beta,
                                                 dtype=precision)


def _linear_call(module: ModuleType, arrays: dict, rng: Any, *, training: bool, need_weights: bool, dropout: float,
                 **options: Any) -> Any:
    """out alone: linear_attention has no dropout, no weights and one path, so training and need_weights change
    nothing; key_lengths is an array input (None where not given); the update rule, decay and beta only where a
    case leaves "linear" (a module from before the rules runs every other case)."""
    return module.linear_attention(arrays["q"], arrays["k"], arrays["v"], key_lengths=arrays["key_lengths"],
                                   **_linear_rule(arrays, options))


def _linear_pullback(module: ModuleType, arrays: dict, rng: Any, *, dropout: float, **options: Any) -> dict:
    """dq, dk, dv, then d_decay and d_beta where the case gives them (the pullback's order, SPEC 2e)."""
    _, pullback = module.linear_attention_vjp(arrays["q"], arrays["k"], arrays["v"],
                                              key_lengths=arrays["key_lengths"], **_linear_rule(arrays, options))
    names = ("q", "k", "v", *(name for name in ("decay", "beta") if arrays[name] is not None))
    return dict(zip(names, pullback(arrays["d_out"]), strict=True))


def _linear_rule(arrays: dict, options: dict) -> dict[str, Any]:
    """The call's keywords: the options, with update_rule, decay and beta only where the rule is not "linear"."""
    keywords = {name: value for name, value in options.items() if name != "update_rule"}
    rule = options.get("update_rule", "linear")
    return keywords if rule == "linear" else keywords | {"update_rule": rule, "decay": arrays["decay"],
                                                         "beta": arrays["beta"]}


def _linear_visible(case: LinearCase) -> np.ndarray:
    """Which keys each query sees, by SPEC 2e: j <= i with is_causal, j < key_lengths; (..., L, S)."""
    L, S = case.q.shape[-2], case.k.shape[-2]
    batch = np.broadcast_shapes(case.q.shape[:-2], case.k.shape[:-2], case.v.shape[:-2])
    i, j = np.arange(L)[:, None], np.arange(S)  # (L, 1), (S,)
    visible = np.broadcast_to((j <= i) | (not case.is_causal), (*batch, L, S))
    if case.key_lengths is not None:
        visible = visible & (j < np.reshape(case.key_lengths, (*np.shape(case.key_lengths), 1, 1)))
    return visible


def _linear_blind(case: LinearCase) -> tuple[np.ndarray, np.ndarray] | None:
    """The queries that see no key (..., L): their out rows are 0 / (0 + eps) = 0 (no weights rows)."""
    blind = ~np.any(_linear_visible(case), axis=-1)  # (..., L)
    return (blind, blind) if np.any(blind) else None


LINEAR_DEFAULTS = {"is_causal": False, "key_lengths": None}  # the features of its arguments (contract.features)


def _linear_uses(case: LinearCase) -> set[str]:
    """is_causal and key_lengths where given, update_rules where the rule is not "linear" (feature_map, eps and
    chunk are linear attention's own)."""
    given = {name for name, default in LINEAR_DEFAULTS.items() if not _is_default(getattr(case, name), default)}
    return given | ({"update_rules"} if case.update_rule != "linear" else set())


def _linear_leave_out(case: LinearCase, declaration: Declaration) -> LinearCase | None:
    """The lacking arguments at their defaults; None where the case's rule is one the module lacks (update_rules,
    or is_causal, which every rule but "linear" needs: another rule gives other numbers)."""
    if case.update_rule != "linear" and ("update_rules" in declaration or "is_causal" in declaration):
        return None
    return case._replace(**{name: default for name, default in LINEAR_DEFAULTS.items() if name in declaration})


# --- packed sequences (varlen_attention) ---------------------------------------------------------------------

def _varlen_oracle(case: VarlenCase, precision: str, fused_bias: bool) -> Pair:
    """Each sequence's sdpa, aligned bottom-right (the tiles change nothing but rounding); no second result."""
    return oracle.varlen_attention(case.q, case.k, case.v, *boundaries(case), is_causal=case.is_causal,
                                   window=case.window, softcap=case.softcap, scale=case.scale,
                                   enable_gqa=case.enable_gqa, dtype=precision), None


def _varlen_oracle_vjp(case: VarlenCase, d_out: np.ndarray, precision: str,
                       fused_bias: bool) -> dict[str, np.ndarray]:
    return oracle_gradients.varlen_attention_vjp(case.q, case.k, case.v, d_out, *boundaries(case),
                                                 is_causal=case.is_causal, window=case.window, softcap=case.softcap,
                                                 scale=case.scale, enable_gqa=case.enable_gqa, dtype=precision)


def _varlen_arguments(arrays: dict, options: dict) -> tuple[list, dict]:
    """q, k, v and the boundaries (arrays, or static tuples as NumPy arrays), and the keywords: max_seqlen_q and
    max_seqlen_k always, the others only where they differ from their defaults (a module without them runs every
    case that does not use them)."""
    bounds = [arrays[name] if name in arrays else np.asarray(options.pop(name), np.int32)
              for name in ("cu_seqlens_q", "cu_seqlens_k")]
    keywords = {name: options[name] for name in ("max_seqlen_q", "max_seqlen_k")}
    keywords |= {name: options[name] for name, default in VARLEN_DEFAULTS.items()
                 if name in options and not _is_default(options[name], default)}
    return [arrays["q"], arrays["k"], arrays["v"], *bounds], keywords


def _varlen_call(module: ModuleType, arrays: dict, rng: Any, *, training: bool, need_weights: bool, dropout: float,
                 **options: Any) -> Any:
    """out alone: varlen_attention has no dropout, no weights and one path, so training and need_weights change
    nothing."""
    inputs, keywords = _varlen_arguments(arrays, options)
    return module.varlen_attention(*inputs, **keywords)


def _varlen_pullback(module: ModuleType, arrays: dict, rng: Any, *, dropout: float, **options: Any) -> dict:
    inputs, keywords = _varlen_arguments(arrays, options)
    _, pullback = module.varlen_attention_vjp(*inputs, **keywords)
    return dict(zip(("q", "k", "v"), pullback(arrays["d_out"]), strict=True))


def _varlen_seen(case: VarlenCase) -> np.ndarray:
    """Which keys each query sees, by SPEC 2g, (Tq, Tk): its own sequence's keys, and with is_causal and window
    those around p_i = i + cu_seqlens_k[n + 1] - cu_seqlens_q[n + 1]; none past the last boundary. (An error
    row's float boundaries are read as integers.)"""
    cu_q, cu_k = (bounds.astype(np.int64) for bounds in boundaries(case))
    seen = np.zeros((case.q.shape[0], case.k.shape[0]), bool)
    left, right = case.window or (None, None)
    for n in range(len(cu_q) - 1):
        i, j = np.arange(cu_q[n], cu_q[n + 1])[:, None], np.arange(cu_k[n], cu_k[n + 1])  # (L_n, 1), (S_n,)
        position = i + cu_k[n + 1] - cu_q[n + 1]  # (L_n, 1): bottom-right
        seen[cu_q[n]:cu_q[n + 1], cu_k[n]:cu_k[n + 1]] = (
            (not case.is_causal or j <= position) & (left is None or j >= position - left)
            & (right is None or j <= position + right))
    return seen


def _varlen_visible(case: VarlenCase) -> np.ndarray:
    """(H, Tq, Tk): the same keys in every head (`packed`: the gradient check swaps its rows to (T, heads))."""
    seen = _varlen_seen(case)  # (Tq, Tk)
    return np.broadcast_to(seen, (case.q.shape[1], *seen.shape))


def _varlen_blind(case: VarlenCase) -> tuple[np.ndarray, None] | None:
    """The queries that see no key, (Tq, H) as out's rows: an empty key sequence, a query past the last boundary,
    is_causal or a window that leave it nothing."""
    blind = ~np.any(_varlen_seen(case), axis=-1)  # (Tq,)
    return (np.broadcast_to(blind[:, None], case.q.shape[:2]), None) if np.any(blind) else None


VARLEN_DEFAULTS = {"is_causal": False, "window": None, "softcap": None, "scale": None, "enable_gqa": False,
                   "block_size": None}  # its keywords besides the bounds; all but block_size are sdpa's features


def _varlen_uses(case: VarlenCase) -> set[str]:
    """The features of SPEC 2a's keywords it passes, and empty where a sequence has no queries or no keys."""
    cu_q, cu_k = boundaries(case)
    given = {name for name, default in VARLEN_DEFAULTS.items()
             if name != "block_size" and not _is_default(getattr(case, name), default)}
    return given | ({"empty"} if np.any(np.diff(cu_q) == 0) or np.any(np.diff(cu_k) == 0) else set())


def _varlen_leave_out(case: VarlenCase, declaration: Declaration) -> VarlenCase:
    """The lacking keywords at their defaults; with enable_gqa lacking, k and v repeated per query head."""
    if case.enable_gqa and "enable_gqa" in declaration:
        group = case.q.shape[1] // case.k.shape[1]
        case = case._replace(k=np.repeat(case.k, group, axis=1), v=np.repeat(case.v, group, axis=1))
    return case._replace(**{name: default for name, default in VARLEN_DEFAULTS.items() if name in declaration})


# --- multi-head attention ----------------------------------------------------------------------------------

# The module options of SPEC.md section 5 and the values the seed layout has: the layout options are the state
# dict's shapes (from_state_dict infers them: they are the oracle's, never the module's, arguments).
MODULE_OPTIONS: dict[str, tuple[Any, ...]] = {"num_kv_heads": (None,), "bias": (True,), "norm": ("layer",),
                                               "activation": ("relu", "gelu"), "rope_theta": (None,),
                                               "attention": ("softmax",), "position": (None,)}
LAYOUT_OPTIONS = ("num_kv_heads", "bias", "norm")
LATER_OPTIONS = ("rope_theta", "attention", "position")  # added after the seed: passed only where a case leaves the
# seed's


def _from_state(options: dict[str, Any]) -> dict[str, Any]:
    """The options from_state_dict takes: all but the layout, which the state's shapes carry, and the later
    options (rope_theta, attention) only where a case leaves the seed's value (a module from before them runs the
    other cases)."""
    return {name: value for name, value in options.items()
            if name not in LAYOUT_OPTIONS and not (name in LATER_OPTIONS and value in MODULE_OPTIONS[name])}


def _mha_oracle(case: MhaCase, precision: str, fused_bias: bool) -> Pair:
    """The heads' out mixed, and their weights (None where linear heads form none)."""
    return oracle.multi_head_attention(case.state, case.q, case.k, case.v, case.mask, num_heads=case.num_heads,
                                       num_kv_heads=case.num_kv_heads, rope_theta=case.rope_theta,
                                       attention=case.attention, is_causal=case.is_causal, position=case.position,
                                       dtype=precision, fused_bias=fused_bias)


def _mha_oracle_vjp(case: MhaCase, d_out: np.ndarray, precision: str, fused_bias: bool) -> dict[str, np.ndarray]:
    return oracle_gradients.multi_head_attention_vjp(case.state, case.q, case.k, case.v, d_out, case.mask,
                                                     num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                                                     rope_theta=case.rope_theta, attention=case.attention,
                                                     is_causal=case.is_causal, position=case.position,
                                                     dtype=precision, fused_bias=fused_bias)


def _mha_call(module: ModuleType, arrays: dict, rng: Any, *, training: bool, need_weights: bool,
              is_causal: bool = False, **options: Any) -> Any:
    """The module built from the state, called; is_causal passed only where given (a module from before it runs
    every other case)."""
    mha = module.MultiHeadAttention.from_state_dict(arrays["state"], **_from_state(options))
    mha = mha.train() if training else mha.eval()
    return mha(arrays["q"], arrays["k"], arrays["v"], arrays["mask"], need_weights=need_weights, rng=rng,
               **({"is_causal": True} if is_causal else {}))


def _mha_pullback(module: ModuleType, arrays: dict, rng: Any, is_causal: bool = False, **options: Any) -> dict:
    mha = module.MultiHeadAttention.from_state_dict(arrays["state"], **_from_state(options))
    _, _, pullback = mha.eval().vjp(arrays["q"], arrays["k"], arrays["v"], arrays["mask"],
                                    **({"is_causal": True} if is_causal else {}))
    dq, dk, dv, dparams = pullback(arrays["d_out"])
    return {"q": dq, "k": dk, "v": dv} | dict(dparams)


def _mha_visible(case: MhaCase) -> np.ndarray:
    """(..., L, S): whether key j is visible to query i in at least one head (j <= i with is_causal)."""
    L, S = case.q.shape[-2], case.k.shape[-2]
    batch = np.broadcast_shapes(case.q.shape[:-2], case.k.shape[:-2], case.v.shape[:-2])
    causal = np.tri(L, S, dtype=bool) | (not case.is_causal)  # (L, S)
    if case.mask is None:
        return np.broadcast_to(causal, (*batch, L, S))
    return np.any(np.broadcast_to(case.mask != 0, (*batch, case.num_heads, L, S)), axis=-3) & causal


# A module case's features (conformance.contract.features) by its fields: the options beyond the seed's layout, a mask,
# a configured dropout
MODULE_FEATURES: dict[str, Callable[[Any], bool]] = {
    "dropout": lambda case: case.dropout != 0,
    "num_kv_heads": lambda case: case.num_kv_heads not in (None, case.num_heads),
    "bias_false": lambda case: not case.bias,
    "rope_theta": lambda case: case.rope_theta is not None,
    "mha_is_causal": lambda case: getattr(case, "is_causal", False) is True,  # an mha case's (linear heads')
    "attention_linear": lambda case: getattr(case, "attention", "softmax") != "softmax",
    "mha_sinks": lambda case: isinstance(case, MhaCase) and "sinks" in case.state,  # sinks=True's (H,)
    "position_alibi": lambda case: getattr(case, "position", None) == "alibi",
    "norm_rms": lambda case: getattr(case, "norm", "layer") == "rms",
    "gelu": lambda case: getattr(case, "activation", "relu") == "gelu",
    "swiglu": lambda case: getattr(case, "activation", "relu") == "swiglu"  # or a state of its layout, which a
    or "ffn.w_gate.weight" in (getattr(case, "state", None) or {}),  # module without SwiGLU cannot even refuse aright
    "mask": lambda case: getattr(case, "mask", None) is not None,
    "mask_per_head": lambda case: _head_masks(getattr(case, "mask", None)),
    "mha_cache": lambda case: getattr(case, "x_kv", None) is not None,  # decoding cross-attention
    "cache_lengths": lambda case: getattr(case, "new_lengths", None) is not None,  # ragged chunks
    "paged_cache": lambda case: getattr(case, "paging", None) is not None,
    "streaming_cache": lambda case: getattr(case, "streaming", None) is not None,
    "linear_cache": lambda case: isinstance(case, DecodeCase) and case.attention != "softmax",  # decoding through
    # linear attention's recurrent state
}


def _head_masks(mask: np.ndarray | None) -> bool:
    """Whether a module's mask (broadcasting to (..., H, L, S)) differs between the heads."""
    return mask is not None and mask.ndim >= 3 and bool(np.any(mask != mask[..., :1, :, :]))


def _module_uses(case: MhaCase | BlockCase | DecodeCase) -> set[str]:
    return {name for name, used in MODULE_FEATURES.items() if used(case)}


def _module_leave_out(case: MhaCase | BlockCase | DecodeCase, declaration: Declaration) -> Any:
    """No mask where the module lacks masks; a decode case's block on its own input where the module lacks
    MultiHeadAttention's cache, every row of each chunk where it lacks a length per sequence, the contiguous cache
    where it lacks the paged one, and one that holds the whole sequence where it lacks the streaming one; None where
    the case needs a lacking option (its state is drawn in that layout)."""
    options = [name for name in declaration.lacks if name in MODULE_FEATURES and name not in _MODULE_ARGUMENTS]
    if any(MODULE_FEATURES[name](case) for name in options):
        return None
    for name, default in (("mha_cache", {"x_kv": None}), ("cache_lengths", {"new_lengths": None}),
                          ("paged_cache", {"paging": None})):  # a decode case's: contiguous, every row taken
        if name in declaration and MODULE_FEATURES[name](case):
            case = case._replace(**default)
    if "streaming_cache" in declaration and MODULE_FEATURES["streaming_cache"](case):
        case = case._replace(streaming=None, capacity=max(case.capacity, case.x.shape[-2]))
    if "mask" not in case._fields or case.mask is None:
        return case
    if "mask" in declaration:
        return case._replace(mask=None)
    if "mask_per_head" in declaration and _head_masks(case.mask):
        return case._replace(mask=case.mask[..., :1, :, :])  # every head the first head's mask
    return case


_MODULE_ARGUMENTS = ("mask", "mask_per_head", "dropout", "mha_cache", "cache_lengths",
                     "paged_cache", "streaming_cache")  # what a module case can do without (the rest: options)


def _module_blind(case: MhaCase | BlockCase | DecodeCase) -> tuple[np.ndarray, np.ndarray] | None:
    """The queries that see no key in some head: (..., L) for out (the heads mix), (..., H, L) for weights. With no
    keys (S = 0) every query is one."""
    q, k = (case.q, case.k) if isinstance(case, MhaCase) else (case.x, case.x)
    visible = np.ones((q.shape[-2], k.shape[-2]), bool) if case.mask is None else case.mask != 0  # (..., [H,] L, S)
    blind = ~np.any(visible, axis=-1)  # (..., [H,] L) as stored
    if not np.any(blind):
        return None
    weights_rows = np.broadcast_to(blind, (*q.shape[:-2], case.num_heads, q.shape[-2]))  # (..., H, L)
    return np.any(weights_rows, axis=-2), weights_rows


def _mha_dropout_sigma(case: MhaCase, weights: np.ndarray, p: float, draws: int) -> np.ndarray:
    """As for sdpa, per head on the projected values (query head h on key/value head h // (H / Hkv)), then
    through |W_o|; (..., L, D)."""
    state, H, D = case.state, case.num_heads, case.q.shape[-1]
    Hkv = H if case.num_kv_heads is None else case.num_kv_heads
    v = case.v @ state["w_v.weight"].T + state.get("w_v.bias", 0.0)  # (..., S, Hkv * d_k)
    *lead, S, _ = v.shape
    v = np.swapaxes(v.reshape(*lead, S, Hkv, D // H), -2, -3)  # (..., Hkv, S, d_k)
    v = np.take(v, np.arange(H) // (H // Hkv), axis=-3)  # (..., Hkv, S, d_k) -> (..., H, S, d_k)
    sigma = np.sqrt(p / (1 - p) * (weights**2) @ (v**2) / draws)  # (..., H, L, d_k)
    sigma = np.swapaxes(sigma, -2, -3).reshape(*sigma.shape[:-3], sigma.shape[-2], D)  # (..., L, D)
    return sigma @ np.abs(state["w_o.weight"]).T  # sd of a sum is at most the sum of |coefficient| x sd


def _mha_dropout_probe(case: MhaCase, declaration: Declaration) -> Probe:
    """One key (S = 1: every weight is 1), no mask, v = 1, w_v and w_o the identity with zero biases: the
    d_k features of head h at query l are keep_hl / (1 - p), so out[..., l, h d_k] shows head h's decision. No
    sinks (their share would take from the one key's weight); ALiBi's bias on one key changes no weight."""
    (L, D), H = case.q.shape[-2:], case.num_heads
    rows = {"w_v": case.state["w_v.weight"].shape[0], "w_o": D}  # w_v: the first Hkv * d_k rows of I
    identities = {f"{name}.{part}": np.eye(D)[:rows[name]] if part == "weight" else np.zeros(rows[name])
                  for name in ("w_v", "w_o") for part in ("weight", "bias") if f"{name}.{part}" in case.state}
    one_key = (*case.k.shape[:-2], 1, D)
    state = {name: value for name, value in case.state.items() if name != "sinks"} | identities
    probe = case._replace(state=state, q=np.zeros_like(case.q), k=np.zeros(one_key),
                          v=np.ones(one_key), mask=None)

    def decisions(out: np.ndarray, p: float) -> dict[str, np.ndarray] | None:
        heads = np.swapaxes(out[..., :: D // H], -1, -2)  # (..., L, D) -> (..., L, H) -> (..., H, L)
        return _dropped({"attention weights": heads}, 1 / (1 - p))

    return Probe(probe, sites={"attention weights": Site((*_batch(case), H, L), ("heads", "queries"))},
                 decisions=decisions)


# --- the transformer block ---------------------------------------------------------------------------------

def _block_oracle(case: BlockCase, precision: str, fused_bias: bool) -> Pair:
    return oracle.transformer_block(case.state, case.x, case.mask, num_heads=case.num_heads,
                                    norm_first=case.norm_first, activation=case.activation, eps=case.eps,
                                    norm=case.norm, num_kv_heads=case.num_kv_heads, rope_theta=case.rope_theta,
                                    dtype=precision, fused_bias=fused_bias)


def _block_oracle_vjp(case: BlockCase, d_out: np.ndarray, precision: str, fused_bias: bool) -> dict[str, np.ndarray]:
    return oracle_gradients.transformer_block_vjp(case.state, case.x, d_out, case.mask, num_heads=case.num_heads,
                                                  norm_first=case.norm_first, activation=case.activation,
                                                  eps=case.eps, norm=case.norm, num_kv_heads=case.num_kv_heads,
                                                  rope_theta=case.rope_theta, dtype=precision,
                                                  fused_bias=fused_bias)


def _block_call(module: ModuleType, arrays: dict, rng: Any, *, training: bool, need_weights: bool,
                **options: Any) -> Any:
    block = module.TransformerBlock.from_state_dict(arrays["state"], **_from_state(options))
    block = block.train() if training else block.eval()
    return block(arrays["x"], arrays["mask"], need_weights=need_weights, rng=rng)


def _block_pullback(module: ModuleType, arrays: dict, rng: Any, **options: Any) -> dict:
    block = module.TransformerBlock.from_state_dict(arrays["state"], **_from_state(options))
    _, _, pullback = block.eval().vjp(arrays["x"], arrays["mask"])
    dx, dparams = pullback(arrays["d_out"])
    return {"x": dx} | dict(dparams)


# The block's probe: at most so many heads' and activation features' decisions shown, so that (1 - p) out, at
# most 4 / (1 - p) 2^(heads + features + 1), stays a whole number that float32 holds exactly
SHOWN_HEADS, SHOWN_FEATURES = 8, 12
HIDDEN = 8.0  # every activation in the block's probe: relu(8) = gelu(8) = 8 and silu(32) * 0.25 (to float32)


def _block_dropout_probe(case: BlockCase, declaration: Declaration) -> Probe:
    """Pre-LN, x = 0; each query sees itself alone (mask = I: a kept weight is s = 1 / (1 - p)), q = 0, v = 1;
    the first feed-forward Linears 0 with biases that make every activation 8; w_o and the last feed-forward
    Linear 0 but at feature 0, biases 1 and 2. Then

        (1 - p) out = K_1 (1 + 4 s M_W) + K_2 (2 + 4 s 2^H M_A),   M_W, M_A only at feature 0:

    K_1, K_2 the decisions of the two residual sites at every (l, feature) (1 kept, 0 dropped); H the heads shown
    (at most SHOWN_HEADS), M_W = sum_h k_hll 2^h the attention weights' decisions on the diagonal (shown where
    K_1 keeps feature 0 of query l), M_A = sum_f a_lf 2^f the activation's (where K_2 keeps feature 0 of position
    l). The weights' other decisions, and all of them for a module that lacks masks, are not shown. A case
    without biases is probed with them: the sites are the same whatever the Linears hold."""
    L, D = case.x.shape[-2:]
    if not case.bias:
        case = block_case(case.x.shape[:-2], L, D, case.num_heads, _d_ff(case), activation=case.activation,
                          norm=case.norm, num_kv_heads=case.num_kv_heads)._replace(dropout=case.dropout, eps=case.eps,
                                                                                    rope_theta=case.rope_theta)
    H, F, batch = case.num_heads, _d_ff(case), case.x.shape[:-2]
    heads = 0 if "mask" in declaration else min(H, SHOWN_HEADS)  # the heads whose decisions show
    features = min(F, SHOWN_FEATURES)
    probe = case._replace(state=case.state | _block_probe_state(case, heads, features), norm_first=True,
                          x=np.zeros_like(case.x), mask=None if heads == 0 else np.eye(L, dtype=bool))
    feature_0 = np.zeros((*batch, L, D), dtype=bool)
    feature_0[..., 0] = True  # the residual decisions that show or hide the inner sites'
    sites = {"attention weights": Site((*batch, H, L, L), ("heads", "queries", "keys"),
                                       shown_through=("attention branch", feature_0)),
             "attention branch": Site((*batch, L, D), ("positions", "features")),
             "activation": Site((*batch, L, F), ("positions", "hidden features"),
                                shown_through=("feed-forward branch", feature_0)),
             "feed-forward branch": Site((*batch, L, D), ("positions", "features"))}
    if heads == 0:
        del sites["attention weights"]
    # the sparsest families, per draw and in units of B / 2 decisions (a site's pairs are half its decisions): the
    # weights' pairs (H L / 2 shown, a quarter of their pairs both), the activation's (L F / 2), the weights and the
    # activation (min(H L, F) / 4 entries both shown) and the weights and the attention branch (about D - 1)
    sparsest = [heads * L / 2, L * features / 2, min(heads * L, features), 2 * (D - 1)] if heads else [L * features / 2]
    shown = min(count for count in sparsest if count > 0)
    return Probe(probe, sites=sites, decisions=lambda out, p: _block_decisions(out, p, (H, heads), (F, features)),
                 per_call=math.prod(batch) * shown / 2)


def _block_probe_state(case: BlockCase, heads: int, features: int) -> dict[str, np.ndarray]:
    """The Linears of _block_dropout_probe (the norms and w_k as drawn: they meet only zero weights)."""
    state, D, H = case.state, case.x.shape[-1], case.num_heads
    codes_w = np.zeros((D, D))
    codes_w[0, np.arange(heads) * (D // H)] = 4.0 * 2.0 ** np.arange(heads)  # head h's first feature -> 4 2^h
    codes_a = np.zeros_like(state[f"{_ffn_down(case)}.weight"])  # (D, F)
    codes_a[0, :features] = 4.0 * 2.0**heads * 2.0 ** np.arange(features) / HIDDEN  # activation f -> 4 2^(H + f)
    attention = {"attn.w_q.weight": np.zeros((D, D)), "attn.w_q.bias": np.zeros(D),
                 "attn.w_v.weight": np.zeros_like(state["attn.w_v.weight"]),
                 "attn.w_v.bias": np.ones(state["attn.w_v.weight"].shape[0]),
                 "attn.w_o.weight": codes_w, "attn.w_o.bias": np.ones(D)}
    up = ({"ffn.w_gate": 32.0, "ffn.w_up": HIDDEN / 32.0} if case.activation == "swiglu" else {"ffn.0": HIDDEN})
    hidden = {f"{name}.{part}": np.zeros_like(state[f"{name}.weight"]) if part == "weight" else
              np.full(state[f"{name}.weight"].shape[0], value)
              for name, value in up.items() for part in ("weight", "bias")}  # every activation HIDDEN
    down = {f"{_ffn_down(case)}.weight": codes_a, f"{_ffn_down(case)}.bias": np.full(D, 2.0)}
    return attention | hidden | down


def _block_decisions(out: np.ndarray, p: float, heads: tuple[int, int],
                     features: tuple[int, int]) -> dict[str, np.ndarray] | None:
    """The four sites' decisions from the probe's out (..., L, D) (_block_dropout_probe): 1 dropped, 0 kept,
    NaN not shown; None where a value fits no decisions. heads, features: (H, shown), (F, shown)."""
    (H, shown_heads), (F, shown_features), L = heads, features, out.shape[-2]
    # 1) (1 - p) out = low + 4 s N, low = K_1 + 2 K_2 in 0..3 (one fits: 4 s > 3), N = K_1 M_W + K_2 2^H M_A
    fits = (out[..., None] * (1 - p) - np.arange(4)) * (1 - p) / 4  # (..., L, D) -> (..., L, D, 4): N for each low
    whole = np.round(fits)
    fitting = (np.abs(fits - whole) <= 1e-3) & (whole >= 0)
    if not np.all(np.sum(fitting, axis=-1) == 1):
        return None
    low = np.argmax(fitting, axis=-1)  # (..., L, D)
    code = np.take_along_axis(whole, low[..., None], axis=-1)[..., 0].astype(np.int64)  # N, (..., L, D)
    kept_1, kept_2 = low % 2 == 1, low >= 2  # (..., L, D)
    # 2) N at feature 0 only: its low bits the weights' M_W where K_1 keeps, its high bits M_A where K_2 keeps
    m_w, m_a = code[..., 0] % 2**shown_heads, code[..., 0] >> shown_heads  # (..., L)
    if (np.any(code[..., 1:] != 0) or np.any(m_w[~kept_1[..., 0]] != 0) or np.any(m_a[~kept_2[..., 0]] != 0)
            or np.any(m_a >= 2**shown_features)):
        return None
    weights = np.full((*out.shape[:-2], H, L, L), np.nan)  # (..., H, L, L)
    bits = (m_w[..., None, :] >> np.arange(shown_heads)[:, None]) & 1  # (..., L) -> (..., H', L)
    weights[..., :shown_heads, np.arange(L), np.arange(L)] = np.where(kept_1[..., None, :, 0], 1.0 - bits, np.nan)
    activation = np.full((*out.shape[:-1], F), np.nan)  # (..., L, F)
    bits = (m_a[..., None] >> np.arange(shown_features)) & 1  # (..., L) -> (..., L, F')
    activation[..., :shown_features] = np.where(kept_2[..., 0, None], 1.0 - bits, np.nan)
    decisions = {"attention weights": weights, "attention branch": 1.0 - kept_1, "activation": activation,
                 "feed-forward branch": 1.0 - kept_2}
    return decisions if shown_heads else {site: x for site, x in decisions.items() if site != "attention weights"}


def _block_dropout_shows(case: BlockCase) -> bool:
    """Not in a post-LN LayerNorm block of width 1: LayerNorm over one feature returns its bias."""
    return case.norm_first or case.x.shape[-1] > 1 or case.norm == "rms"


def _d_ff(case: BlockCase) -> int:
    return case.state["ffn.w_gate.weight" if case.activation == "swiglu" else "ffn.0.weight"].shape[0]


def _ffn_down(case: BlockCase) -> str:
    """The last feed-forward Linear's name, (D, F)."""
    return "ffn.w_down" if case.activation == "swiglu" else "ffn.3"


# --- decoding through a key/value cache ---------------------------------------------------------------------

def _decode_oracle(case: DecodeCase, precision: str, fused_bias: bool) -> Pair:
    """One pass over the whole sequence with causal_mask(L, L) & the mask (SPEC 3a's invariant): of the block, or
    with x_kv of its attention, queries of x and keys and values of x_kv; the weights padded with zeros to the
    capacity. With new_lengths, that of each sequence alone (`_each_alone`); through a streaming cache, the
    streaming rule's (`_streamed`); with attention "linear", one causal pass of the linear heads, no weights."""
    if case.attention != "softmax":
        return _linear_decoded(case, precision, fused_bias)
    if case.new_lengths is not None:
        return _each_alone(case, precision, fused_bias)
    if case.streaming is not None:
        return _streamed(case, precision, fused_bias)
    L = case.x.shape[-2]
    mask = _decode_mask(case)  # (..., [H,] L, L)
    if case.x_kv is None:
        out, weights = oracle.transformer_block(case.state, case.x, mask, num_heads=case.num_heads,
                                                norm_first=case.norm_first, activation=case.activation, eps=case.eps,
                                                norm=case.norm, num_kv_heads=case.num_kv_heads,
                                                rope_theta=case.rope_theta, dtype=precision,
                                                fused_bias=fused_bias)  # (..., L, D), (..., H, L, L)
    else:
        out, weights = oracle.multi_head_attention(_attention_state(case.state), case.x, case.x_kv, case.x_kv, mask,
                                                   num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                                                   rope_theta=case.rope_theta, dtype=precision,
                                                   fused_bias=fused_bias)  # (..., L, D), (..., H, L, L)
    unfilled = np.zeros((*weights.shape[:-1], case.capacity - L), weights.dtype)
    return out, np.concatenate([weights, unfilled], axis=-1)  # (..., H, L, capacity)


def _linear_decoded(case: DecodeCase, precision: str, fused_bias: bool) -> Pair:
    """SPEC 3a's invariant through a LinearCache: one pass over the whole sequence with is_causal=True, of the block
    (`block(x, is_causal=True)`) or with x_kv of its attention; linear heads take no mask and form no weights."""
    if case.x_kv is None:
        return oracle.transformer_block(case.state, case.x, None, num_heads=case.num_heads,
                                        norm_first=case.norm_first, activation=case.activation, eps=case.eps,
                                        norm=case.norm, num_kv_heads=case.num_kv_heads, rope_theta=case.rope_theta,
                                        attention=case.attention, is_causal=True, dtype=precision,
                                        fused_bias=fused_bias)  # (..., L, D), None
    return oracle.multi_head_attention(_attention_state(case.state), case.x, case.x_kv, case.x_kv, None,
                                       num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                                       rope_theta=case.rope_theta, attention=case.attention, is_causal=True,
                                       dtype=precision, fused_bias=fused_bias)  # (..., L, D), None


def _streamed(case: DecodeCase, precision: str, fused_bias: bool) -> Pair:
    """SPEC 3c: one pass over the whole sequence with the streaming mask, query i at position p_i seeing key j where
    j < s or p_i - w < j <= p_i, its weights row read into the cache's order: column c holds position c below s,
    else c + e_i (e_i = max(0, p_i + 1 - (s + w)), the window positions evicted), 0 where that is no key it sees.
    With RoPE at the places in the cache (rope_positions "cache"), query i alone over the keys it sees, in that
    order, the query last: a pass over them turns each at its column and the query at its own, p_i - e_i."""
    s, w, rope_positions = case.streaming
    N = case.x.shape[-2]
    p, column = np.arange(N)[:, None], np.arange(s + w)  # (N, 1), (s + w,)
    at = np.where(column < s, column, column + np.maximum(p + 1 - (s + w), 0))  # (N, s + w): each column's position
    seen = at <= p  # (N, s + w)
    if rope_positions == "cache" and case.rope_theta is not None:
        return _streamed_at_places(case, at, seen, precision, fused_bias)
    j = np.arange(N)  # (N,)
    visible = (j <= p) & ((j < s) | (j > p - w))  # (N, N)
    whole = case._replace(streaming=None, mask=visible, capacity=N)  # one pass with that mask (causal already)
    out, weights = _decode_oracle(whole, precision, fused_bias)  # (..., L, D), (..., H, L, L)
    in_order = np.take_along_axis(weights, np.broadcast_to(np.minimum(at, N - 1), (*weights.shape[:-1], s + w)), -1)
    return out, np.where(seen, in_order, 0.0)  # (..., H, L, s + w)


def _streamed_at_places(case: DecodeCase, at: np.ndarray, seen: np.ndarray, precision: str, fused_bias: bool) -> Pair:
    """Each query alone (`_streamed`): a causal pass over the positions it sees, at[i, :n_i] in the cache's order,
    its own last, its weights padded to the s + w columns; its row the pass's last."""
    outs, weights = [], []
    for i, row in enumerate(at):
        keys = row[seen[i]]  # (n_i,): the sinks it has seen, then its window oldest first, ending at p_i = i
        alone = case._replace(x=case.x[..., keys, :], x_kv=None if case.x_kv is None else case.x_kv[..., keys, :],
                              streaming=None, capacity=at.shape[1])
        out, w = _decode_oracle(alone, precision, fused_bias)  # (..., n_i, D), (..., H, n_i, s + w)
        outs.append(out[..., -1, :])
        weights.append(w[..., -1, :])
    return np.stack(outs, axis=-2), np.stack(weights, axis=-2)  # (..., L, D), (..., H, L, s + w)


def _each_alone(case: DecodeCase, precision: str, fused_bias: bool) -> Pair:
    """Each sequence alone, a decode case of its own rows (the first new_lengths of each chunk) in one chunk,
    scattered back to them (its weights at the keys' positions in the sequence); a padding row's out and weights
    are zeros. Whatever cache the case decodes through (contiguous or paged), its outputs are these."""
    batch, (L, D) = case.x.shape[:-2], case.x.shape[-2:]
    x = case.x.reshape(-1, L, D)  # (B, L, D): the batch flattened, as new_lengths is
    x_kv = None if case.x_kv is None else case.x_kv.reshape(-1, L, D)
    out = np.zeros(x.shape)  # (B, L, D)
    weights = np.zeros((len(x), case.num_heads, L, case.capacity))  # (B, H, L, capacity)
    for b, rows in enumerate(_own_rows(case)):
        if rows.size:
            alone = case._replace(x=x[b:b + 1, rows], x_kv=None if x_kv is None else x_kv[b:b + 1, rows],
                                  chunks=(rows.size,), capacity=rows.size, new_lengths=None, paging=None, mask=None)
            out_b, weights_b = _decode_oracle(alone, precision, fused_bias)  # (1, L_b, D), (1, H, L_b, L_b)
            out[b, rows], weights[b][:, rows, :rows.size] = out_b[0], weights_b[0]
    return out.reshape(*batch, L, D), weights.reshape(*batch, *weights.shape[1:])


def _own_rows(case: DecodeCase) -> list[np.ndarray]:
    """Each sequence's own rows of x (the batch flattened), in order: the first new_lengths[c][b] rows of each
    chunk c."""
    starts = np.cumsum((0, *case.chunks[:-1]))
    return [np.concatenate([start + np.arange(new[b]) for start, new in zip(starts, case.new_lengths, strict=True)])
            .astype(int) for b in range(len(case.new_lengths[0]))]


def _decode_mask(case: DecodeCase) -> np.ndarray:
    """What one pass over the whole sequence hides: causal_mask(L, L) and the mask's first L columns,
    (..., [H,] L, L)."""
    L = case.x.shape[-2]
    causal = np.tri(L, L, dtype=bool)  # (L, L)
    return causal if case.mask is None else causal & (case.mask[..., :L] != 0)  # (..., [H,] L or 1, L)


def _attention_state(state: dict) -> dict:
    """A block's attention entries attn.* as a MultiHeadAttention's state."""
    return {name.removeprefix("attn."): value for name, value in state.items() if name.startswith("attn.")}


_ATTENTION_OPTIONS = ("num_heads", "dropout", "rope_theta", "attention")  # the block's options that its attention
# takes


def _decoder(module: ModuleType, arrays: dict, options: dict[str, Any]) -> Any:
    """The block (TransformerBlock.from_state_dict), or with x_kv its attention alone
    (MultiHeadAttention.from_state_dict of the state's attn.* entries)."""
    options = _from_state(options)
    if arrays["x_kv"] is None:
        return module.TransformerBlock.from_state_dict(arrays["state"], **options)
    return module.MultiHeadAttention.from_state_dict(_attention_state(arrays["state"]),
                                                     **{name: options[name] for name in _ATTENTION_OPTIONS
                                                        if name in options})


def _chunk_rows(mask: Any, start: int, size: int) -> Any:
    """The mask's rows (..., [H,] L_c, capacity) of positions start .. start + size - 1; a mask that broadcasts
    over the rows (one row, or rank 1) as it is."""
    if mask is None or len(mask.shape) < 2 or mask.shape[-2] == 1:
        return mask
    return mask[..., start:start + size, :]


def _decode_call(module: ModuleType, arrays: dict, rng: Any, *, training: bool, need_weights: bool,
                 chunks: tuple[int, ...], capacity: int, cache_batch: tuple[int, ...] | None, cache_dtype: str | None,
                 new_lengths: tuple[tuple[int, ...], ...] | None = None, paging: Paging | None = None,
                 streaming: Streaming | None = None, **options: Any) -> Any:
    """init_cache (for x's batch shape, in the block's dtype, unless an error row asks for others; with streaming,
    its sink_tokens and window, and rope_positions where it is not the default), or with paging init_paged_cache
    with NaN in every slot, then extend once per chunk (x's rows, x_kv's too where given, the mask's rows where
    given, and the chunk's new_lengths where given; with paging, the chunk's block table set first): the chunks'
    outputs and weights, in order."""
    decoder = _decoder(module, arrays, options)
    decoder = decoder.train() if training else decoder.eval()
    x, x_kv, mask = arrays["x"], arrays["x_kv"], arrays["mask"]
    batch = tuple(x.shape[:-2]) if cache_batch is None else cache_batch
    dtype = {} if cache_dtype is None else {"dtype": module.asarray(np.zeros(1, cache_dtype)).dtype}
    if paging is None:
        cache, tables = decoder.init_cache(batch, capacity, **dtype, **_streaming_options(streaming)), None
    else:
        cache = decoder.init_paged_cache(batch[0], paging.num_pages, paging.page_size, paging.max_pages, **dtype)
        cache = cache._replace(k=cache.k * math.nan, v=cache.v * math.nan)  # every slot unused: NaN reaches nothing
        tables = page_tables(paging, new_lengths or tuple((size,) * batch[0] for size in chunks))
    outs, weights, start = [], [], 0
    for c, size in enumerate(chunks):
        inputs = [x[..., start:start + size, :]] + ([] if x_kv is None else [x_kv[..., start:start + size, :]])
        given = {} if mask is None else {"mask": _chunk_rows(mask, start, size)}  # a module without masks runs
        # every case without one
        if new_lengths is not None:
            given["new_lengths"] = module.asarray(np.reshape(np.array(new_lengths[c], np.int32), batch))
        if tables is not None:
            cache = _paged_step(module, cache, *tables[c])
        out, w, cache = decoder.extend(*inputs, cache, need_weights=need_weights, rng=rng, **given)
        outs.append(out)
        weights.append(w)
        start += size
    return outs, weights


def _streaming_options(streaming: Streaming | None) -> dict[str, Any]:
    """init_cache's keywords of a streaming cache: sink_tokens and window, rope_positions where it is not the
    default; none without one (a module without the streaming cache runs every other case)."""
    if streaming is None:
        return {}
    return {"sink_tokens": streaming.sink_tokens, "window": streaming.window} | (
        {} if streaming.rope_positions == "original" else {"rope_positions": streaming.rope_positions})


def _paged_step(module: ModuleType, cache: Any, table: np.ndarray, released: np.ndarray) -> Any:
    """The paged cache with this step's block table, and the released sequences' lengths 0 (as cache.release
    does, in array operations: JAX stages the whole call, where release's bookkeeping on the host cannot run)."""
    cache = cache._replace(block_table=module.asarray(table))
    if released.any():
        cache = cache._replace(length=cache.length * module.asarray((~released).astype(np.int32)))
    return cache


def _decode_blind(case: DecodeCase) -> tuple[np.ndarray, np.ndarray] | None:
    """The queries that see no key in some head, the mask hiding every key up to their own position: as for the
    block, of the mask one pass over the whole sequence has."""
    return _module_blind(case._replace(mask=None if case.mask is None else _decode_mask(case)))


def _decode_pair(result: tuple[list, list]) -> Pair:
    """The chunks' outputs (..., L_c, D) and weights (..., H, L_c, capacity), joined along the positions."""
    outs, weights = result
    joined = None if any(w is None for w in weights) else np.concatenate(weights, axis=-2)
    return np.concatenate(outs, axis=-2), joined


# --- programmable attention (flex_attention) -----------------------------------------------------------------

def _flex_oracle(case: FlexCase, precision: str, fused_bias: bool) -> Pair:
    """out and each row's log-sum-exp, the mods evaluated one query at a time (the block mask's tiles change
    nothing but rounding)."""
    return oracle.flex_attention(case.q, case.k, case.v, mask_mod=case.mask_mod, score_mod=case.score_mod,
                                 scale=case.scale, enable_gqa=case.enable_gqa, dtype=precision,
                                 **per_head_used(case))


def _flex_block_mask(module: ModuleType, q: Any, k: Any, mask_mod: Any, block_size: tuple[int, int],
                     mask_for: tuple[int, int, int, int] | None) -> Any:
    """create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=block_size) for the scores (B, H, L, S) of q and k (or
    those of mask_for); None without a mask function."""
    if mask_mod is None:
        return None
    B, H, L, S = mask_for or (q.shape[0], q.shape[-3], q.shape[-2], k.shape[-2])  # q (B, H, L, E), k (.., S, E)
    return module.create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=block_size)


def _flex_call(module: ModuleType, arrays: dict, rng: Any, *, training: bool, need_weights: bool, dropout: float,
               mask_mod: Any, score_mod: Any, block_size: tuple[int, int], scale: float | None, enable_gqa: bool,
               mask_for: tuple[int, int, int, int] | None, **options: Any) -> Any:
    """(out, lse): flex_attention has no dropout and one path, so training and need_weights change nothing; sinks
    (the options' None, or an array) passed only where given."""
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    block_mask = _flex_block_mask(module, q, k, mask_mod, block_size, mask_for)
    return module.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                                 **_flex_keywords(scale, enable_gqa), **_per_head(arrays, options))


def _flex_pullback(module: ModuleType, arrays: dict, rng: Any, *, dropout: float, mask_mod: Any, score_mod: Any,
                   block_size: tuple[int, int], scale: float | None, enable_gqa: bool,
                   mask_for: tuple[int, int, int, int] | None, **options: Any) -> dict:
    """dq, dk, dv, with sinks d_sinks, and the score function's parameters' gradients, by "score_mod.<parameter>"."""
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    block_mask = _flex_block_mask(module, q, k, mask_mod, block_size, mask_for)
    heads = _per_head(arrays, options)
    _, _, pullback = module.flex_attention_vjp(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                               **_flex_keywords(scale, enable_gqa), **heads)
    *grads, d_score_mod = pullback(arrays["d_out"])
    named = dict(zip(("q", "k", "v") + (("sinks",) * ("sinks" in heads)), grads, strict=True))
    return named | {f"score_mod.{name}": grad for name, grad in d_score_mod.items()}


def _flex_visible(case: FlexCase) -> np.ndarray:
    """Which keys each query sees by the mask function, (B, H, L, S): mask_mod on the whole grid of index arrays
    (every key without one)."""
    *lead, L, _ = case.q.shape
    B, H, S = (lead[0] if lead else 1), (lead[-1] if len(lead) > 1 else 1), case.k.shape[-2]
    if case.mask_mod is None:
        return np.ones((B, H, L, S), bool)
    return _mask_grid(case.mask_mod, (B, H, L, S))


def _mask_grid(mask_mod: Callable[..., Any], shape: tuple[int, ...]) -> np.ndarray:
    """mask_mod on the whole grid of index arrays of the scores (B, H, L, S), != 0."""
    b, h, i, j = (np.arange(n).reshape([n if axis == place else 1 for axis in range(4)])
                  for place, n in enumerate(shape))  # (B, 1, 1, 1), (1, H, 1, 1), (1, 1, L, 1), (1, 1, 1, S)
    return np.broadcast_to(np.asarray(mask_mod(b, h, i, j)) != 0, shape)


def _flex_blind(case: FlexCase) -> tuple[np.ndarray, np.ndarray] | None:
    """The queries that see no key (B, H, L), for out and lse alike."""
    blind = ~np.any(_flex_visible(case), axis=-1)  # (B, H, L)
    return (blind, blind) if np.any(blind) else None


def _flex_uses(case: FlexCase) -> set[str]:
    """mods, always (a mask or score function, or the block mask's tiles), score_mod where one is given, scale
    and enable_gqa where they differ from their defaults, and sinks where given."""
    given = {"score_mod": case.score_mod is not None, "scale": case.scale is not None, "enable_gqa": case.enable_gqa}
    return {"mods"} | {name for name, used in given.items() if used} | set(per_head_used(case))


def _flex_leave_out(case: FlexCase, declaration: Declaration) -> FlexCase | None:
    """None where the module lacks mods (the operation is SKIP); else sdpa's rule on the keywords flex_attention
    shares with it: no score function without score_mod, the default scale without scale, k and v repeated per
    query head without enable_gqa."""
    return None if "mods" in declaration else _sdpa_leave_out(case, declaration)


def _flex_keywords(scale: float | None, enable_gqa: bool) -> dict[str, Any]:
    """scale and enable_gqa where they differ from their defaults: a module without them runs every other case."""
    return {name: value for name, value in (("scale", scale), ("enable_gqa", enable_gqa))
            if not _is_default(value, SDPA_DEFAULTS[name])}


# --- multi-head latent attention (MultiHeadLatentAttention) ---------------------------------------------------

def _mla_oracle(case: MlaCase, precision: str, fused_bias: bool) -> Pair:  # no biases: nothing to fuse
    """One call: the oracle's MLA with the case's mask. Decoding: one pass over the whole sequence with
    causal_mask(L, L) & the mask's first L columns (SPEC 3d: either form equals the full causal pass), the weights
    padded with zeros to the capacity."""
    out, weights = oracle.multi_head_latent_attention(case.state, case.x, _mla_mask(case), num_heads=case.num_heads,
                                                      rope_theta=case.rope_theta, dtype=precision)
    if case.chunks is None:
        return out, weights  # (..., L, D), (..., H, L, L)
    unfilled = np.zeros((*weights.shape[:-1], case.capacity - case.x.shape[-2]), weights.dtype)
    return out, np.concatenate([weights, unfilled], axis=-1)  # (..., H, L, capacity)


def _mla_mask(case: MlaCase) -> np.ndarray | None:
    """What the one pass hides: the case's mask for one call; for decoding causal_mask(L, L) and the mask's first L
    columns, (..., [H,] L, L)."""
    if case.chunks is None:
        return case.mask
    L = case.x.shape[-2]
    causal = np.tri(L, L, dtype=bool)  # (L, L)
    return causal if case.mask is None else causal & (case.mask[..., :L] != 0)


def _mla_module(module: ModuleType, arrays: dict, num_heads: int, rope_theta: float) -> Any:
    return module.MultiHeadLatentAttention.from_state_dict(arrays["state"], num_heads=num_heads,
                                                           rope_theta=rope_theta)


def _mla_call(module: ModuleType, arrays: dict, rng: Any, *, training: bool, need_weights: bool, num_heads: int,
              rope_theta: float, chunks: tuple[int, ...] | None, capacity: int | None, absorbed: bool,
              dropout: float) -> tuple[list, list]:
    """([out], [weights]) of one call, or init_cache for x's batch shape then extend once per chunk (its rows of x
    and of the mask, in the form asked for): the chunks' outputs and weights, in order (_decode_pair joins them)."""
    mla = _mla_module(module, arrays, num_heads, rope_theta)
    mla = mla.train() if training else mla.eval()  # MLA has no dropout: the flag changes nothing
    x, mask = arrays["x"], arrays["mask"]
    if chunks is None:
        out, weights = mla(x, mask, need_weights=need_weights, rng=rng)
        return [out], [weights]
    cache, outs, weights, start = mla.init_cache(tuple(x.shape[:-2]), capacity), [], [], 0
    for size in chunks:
        given = {} if mask is None else {"mask": _chunk_rows(mask, start, size)}
        out, w, cache = mla.extend(x[..., start:start + size, :], cache, absorbed=absorbed, need_weights=need_weights,
                                   **given)
        outs.append(out)
        weights.append(w)
        start += size
    return outs, weights


def _mla_pullback(module: ModuleType, arrays: dict, rng: Any, *, num_heads: int, rope_theta: float,
                  chunks: tuple[int, ...] | None, capacity: int | None, absorbed: bool, dropout: float) -> dict:
    """dx and every parameter's gradient, by its state-dict name (one call; a gradient group draws no chunks)."""
    mla = _mla_module(module, arrays, num_heads, rope_theta)
    _, _, pullback = mla.eval().vjp(arrays["x"], arrays["mask"])
    dx, dparams = pullback(arrays["d_out"])
    return {"x": dx} | dict(dparams)


def _mla_uses(case: MlaCase) -> set[str]:
    """mask where one is given, mask_per_head where it differs between the heads (no module options: MLA's sizes
    are its state's shapes, its RoPE is not optional)."""
    return {name for name, used in (("mask", case.mask is not None), ("mask_per_head", _head_masks(case.mask)))
            if used}


def _mla_leave_out(case: MlaCase, declaration: Declaration) -> MlaCase:
    """No mask where the module lacks masks (a decode case stays causal); every head the first head's mask where it
    lacks masks per head."""
    if case.mask is None:
        return case
    if "mask" in declaration:
        return case._replace(mask=None)
    if "mask_per_head" in declaration and _head_masks(case.mask):
        return case._replace(mask=case.mask[..., :1, :, :])
    return case


def _mla_blind(case: MlaCase) -> tuple[np.ndarray, np.ndarray] | None:
    """The queries that see no key in some head: (..., L) for out (the heads mix), (..., H, L) for weights."""
    mask, L = _mla_mask(case), case.x.shape[-2]
    if mask is None:
        return None
    blind = ~np.any(mask != 0, axis=-1)  # (..., [H,] L) as stored
    if not np.any(blind):
        return None
    weights_rows = np.broadcast_to(blind, (*case.x.shape[:-2], case.num_heads, L))  # (..., H, L)
    return np.any(weights_rows, axis=-2), weights_rows


# --- the registry ------------------------------------------------------------------------------------------

OPERATIONS: dict[str, Operation] = {operation.name: operation for operation in (
    Operation(
        name="sdpa", function="scaled_dot_product_attention", case=SdpaCase,
        options=("is_causal", "scale", "dropout", "q_offset", "window", "softcap", "enable_gqa", "mask_mod",
                 "score_mod", "sinks", "alibi_slopes"),
        inputs=("q", "k", "v"), differentiable=("q", "k", "v", "bias", "sinks", "score_mod"), strategy="sdpa_cases",
        oracle=_sdpa_oracle, call=_sdpa_call, vjp="scaled_dot_product_attention_vjp", pullback=_sdpa_pullback,
        visible=_sdpa_visible, dropout_sigma=_sdpa_dropout_sigma, dropout_shows=lambda case: True,
        dropout_probe=_sdpa_dropout_probe, uses=_sdpa_uses, leave_out=_sdpa_leave_out, blind=_sdpa_blind,
        oracle_vjp=_sdpa_oracle_vjp),
    Operation(
        name="flash", function="flash_attention", case=FlashCase,
        options=("is_causal", "scale", "dropout", "q_offset", "window", "softcap", "enable_gqa", "mask_mod",
                 "score_mod", "sinks", "alibi_slopes", "block_q", "block_k", "block_size", "with_mask_mod"),
        inputs=("q", "k", "v"), differentiable=("q", "k", "v", "bias", "sinks", "score_mod"), strategy="flash_cases",
        oracle=_flash_oracle, call=_flash_call, vjp="flash_attention_vjp", pullback=_flash_pullback,
        visible=_sdpa_visible, dropout_sigma=None, dropout_shows=lambda case: False, dropout_probe=None,
        uses=_sdpa_uses, leave_out=_sdpa_leave_out, blind=_sdpa_blind, second="lse", oracle_vjp=_sdpa_oracle_vjp),
    Operation(
        name="ring", function="ring_attention", case=RingCase,
        options=("is_causal", "scale", "dropout", "q_offset", "window", "softcap", "enable_gqa", "sinks",
                 "alibi_slopes", "block_q", "block_k", "devices"),
        inputs=("q", "k", "v"), differentiable=("q", "k", "v", "sinks"), strategy="ring_cases",
        oracle=_flash_oracle, call=_ring_call, vjp="ring_attention_vjp", pullback=_ring_pullback,
        visible=_sdpa_visible, dropout_sigma=None, dropout_shows=lambda case: False, dropout_probe=None,
        uses=_sdpa_uses, leave_out=_sdpa_leave_out, blind=_sdpa_blind, second="lse", devices=max(RING_DEVICES)),
    Operation(
        name="linear", function="linear_attention", case=LinearCase,
        options=("feature_map", "is_causal", "eps", "chunk", "dropout", "update_rule"),
        inputs=("q", "k", "v"), differentiable=("q", "k", "v", "decay", "beta"), strategy="linear_cases",
        oracle=_linear_oracle, call=_linear_call, vjp="linear_attention_vjp", pullback=_linear_pullback,
        visible=_linear_visible, dropout_sigma=None, dropout_shows=lambda case: False, dropout_probe=None,
        uses=_linear_uses, leave_out=_linear_leave_out, blind=_linear_blind, pair=lambda out: (out, None),
        second=None, oracle_vjp=_linear_oracle_vjp),
    Operation(
        name="mha", function="MultiHeadAttention", case=MhaCase,
        options=("num_heads", "dropout", "num_kv_heads", "bias", "rope_theta", "attention", "is_causal", "position"),
        inputs=("q", "k", "v"), differentiable=("q", "k", "v", "state"), strategy="mha_cases",
        oracle=_mha_oracle, call=_mha_call, vjp="MultiHeadAttention.vjp", pullback=_mha_pullback,
        visible=_mha_visible, dropout_sigma=_mha_dropout_sigma, dropout_shows=lambda case: True,
        dropout_probe=_mha_dropout_probe, uses=_module_uses, leave_out=_module_leave_out, blind=_module_blind,
        oracle_vjp=_mha_oracle_vjp),
    Operation(
        name="block", function="TransformerBlock", case=BlockCase,
        options=("num_heads", "dropout", "norm_first", "activation", "eps", "norm", "num_kv_heads", "bias",
                 "rope_theta"),
        inputs=("x",), differentiable=("x", "state"), strategy="block_cases",
        oracle=_block_oracle, call=_block_call, vjp="TransformerBlock.vjp", pullback=_block_pullback,
        visible=None, dropout_sigma=None, dropout_shows=_block_dropout_shows, dropout_probe=_block_dropout_probe,
        uses=_module_uses, leave_out=_module_leave_out, blind=_module_blind, oracle_vjp=_block_oracle_vjp),
    Operation(
        name="decode", function="TransformerBlock.extend", case=DecodeCase,
        options=("num_heads", "dropout", "norm_first", "activation", "eps", "chunks", "capacity", "norm",
                 "num_kv_heads", "bias", "rope_theta", "cache_batch", "cache_dtype", "new_lengths", "paging",
                 "streaming", "attention"),
        inputs=("x",), differentiable=(), strategy="decode_cases",
        oracle=_decode_oracle, call=_decode_call, vjp="", pullback=None,
        visible=None, dropout_sigma=None, dropout_shows=lambda case: False, dropout_probe=None,
        uses=_module_uses, leave_out=_module_leave_out, blind=_decode_blind, pair=_decode_pair),
    Operation(
        name="flex", function="flex_attention", case=FlexCase,
        options=("mask_mod", "score_mod", "block_size", "scale", "enable_gqa", "dropout", "mask_for", "sinks",
                 "alibi_slopes"),
        inputs=("q", "k", "v"), differentiable=("q", "k", "v", "sinks", "score_mod"), strategy="flex_cases",
        oracle=_flex_oracle, call=_flex_call, vjp="flex_attention_vjp", pullback=_flex_pullback,
        visible=_flex_visible, dropout_sigma=None, dropout_shows=lambda case: False, dropout_probe=None,
        uses=_flex_uses, leave_out=_flex_leave_out, blind=_flex_blind, second="lse", needs="mods"),
    Operation(
        name="varlen", function="varlen_attention", case=VarlenCase,
        options=("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "is_causal", "window", "softcap",
                 "scale", "enable_gqa", "block_size", "dropout"),
        inputs=("q", "k", "v"), differentiable=("q", "k", "v"), strategy="varlen_cases",
        oracle=_varlen_oracle, call=_varlen_call, vjp="varlen_attention_vjp", pullback=_varlen_pullback,
        visible=_varlen_visible, dropout_sigma=None, dropout_shows=lambda case: False, dropout_probe=None,
        uses=_varlen_uses, leave_out=_varlen_leave_out, blind=_varlen_blind, pair=lambda out: (out, None),
        second=None, oracle_vjp=_varlen_oracle_vjp, packed=True),
    Operation(
        name="mla", function="MultiHeadLatentAttention", case=MlaCase,
        options=("num_heads", "rope_theta", "chunks", "capacity", "absorbed", "dropout"),
        inputs=("x",), differentiable=("x", "state"), strategy="mla_cases",
        oracle=_mla_oracle, call=_mla_call, vjp="MultiHeadLatentAttention.vjp", pullback=_mla_pullback,
        visible=None, dropout_sigma=None, dropout_shows=lambda case: False, dropout_probe=None,
        uses=_mla_uses, leave_out=_mla_leave_out, blind=_mla_blind, pair=_decode_pair),
)}
CONTRACT = ("asarray", "to_numpy")  # what every operation needs besides its own name

_BY_CASE = {operation.case: operation for operation in OPERATIONS.values()}
