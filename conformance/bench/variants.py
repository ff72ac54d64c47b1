"""The variants of `python -m conformance compare --variant NAME`, each declared once as a `timing.Variant`:
its problem maker, its candidates and its targets; VARIANTS is the table the command line reads.

Shape legend: B batch, H (query) heads, Hkv key/value heads, G = H / Hkv query heads per key/value head,
L query positions, S key/value positions (S = L), E query/key width.

- plain (the default): sdpa, mha and block, float32, B=2, H=8, E=64: each backend's fast and explicit paths
  beside its framework's built-in and the plain formulations of bench/baselines.py.
- gqa: grouped-query attention, float32, B=2, H=32, Hkv=8, E=64, sdpa with enable_gqa=True: our fast and
  explicit paths beside F.scaled_dot_product_attention(enable_gqa=True) and the same with k and v
  repeat_interleave'd to H heads, jax.nn.dot_product_attention (N=H query heads, K=Hkv key/value heads) and
  a plain grouped JAX formulation (both jitted), and our NumPy fast path given np.repeat'ed k and v (the
  repeat inside the timed call). Targets: ours / the framework's built-in (or best plain) time, and NumPy's
  memory: the repeat's peak minus ours at least the two repeated copies, 2 B H S E float32 values (to 1 %).
- window: a sliding window, float32, B=1 (one batch keeps L=S=4096's (B, H, L, S) float32 scores at 512 MiB),
  H=8, E=64: each backend's fast path with is_causal=True and window=(256, 0) beside full causal attention
  (is_causal=True alone); no targets, the two times side by side (`ratios`). FLOPs are counted as for full
  attention (4 B H L S E) in both rows, so their rates compare as their times do.
- flex: programmable attention on the CPU, float32, B=1, H=8, E=64, L=S=4096, two masks (FLEX_MASKS): a causal
  sliding window of 256 and 8 equal documents. Per backend "flex" (flex_attention with the block mask, BLOCK_SIZE
  128) and "dense" (scaled_dot_product_attention's fast path with the mask as a boolean (L, S) array), and torch's
  own flex_attention compiled by inductor ("torch compiled flex", its own block mask); the block masks, the dense
  masks and the compilation (the warm-up call) are made outside the timed calls. Targets (`ratios` too, so that
  one run prints them side by side): flex <= 0.3 x dense in each backend, NumPy's and JAX's flex <= 2 x torch
  compiled, the torch backend's <= 1.10 x it. FLOPs counted as for full attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from attention_np.common import mods

from ..frameworks.registry import framework_of
from . import baselines, timing
from .timing import OPERATIONS, Call, Problem, Target

GROUP = 4  # G: query heads per key/value head (H=32 on Hkv=8)
GQA_OPTIONS = (("enable_gqa", True),)
WINDOW = (256, 0)
WINDOW_OPTIONS = {"window": (("is_causal", True), ("window", WINDOW)), "causal": (("is_causal", True),)}
OURS = (("numpy", "attention_np"), ("jax", "attention_jax"), ("torch", "attention_torch"))  # framework, backend


# --- plain ---


# The NumPy targets compare attention itself with the tutorial's formulation of it (matmul, divide,
# masked_fill, softmax, matmul); around MHA and the block the projections and the FFN, the same BLAS
# calls in both, dilute the ratio, so those rows are shown without a target.
TARGETS = (
    Target("torch", numerator="attention_torch", denominators=("torch built-in",), relation="<=", bound=1.10),
    Target("jax", numerator="attention_jax", denominators=("jax plain", "jax.nn.dot_product_attention"),
           relation="<=", bound=1.10),
    Target("numpy", numerator="numpy tutorial", denominators=("attention_np",), relation=">=", bound=1.3,
           operations=("sdpa",)),
    Target("numpy", numerator="attention_np explicit", denominators=("numpy tutorial",), relation="<=", bound=1.0,
           operations=("sdpa",)),
)


def plain_calls(name: str, module: ModuleType, problem: Problem, state: dict[str, Any],
                *, fused: bool) -> dict[str, Call]:
    """The plain variant: the backend with need_weights=False and True ("explicit"), then its framework's
    baselines (bench/baselines.py). fused: on CUDA in bfloat16."""
    ours = {name: timing.our_call(module, problem, state, need_weights=False),
            f"{name} explicit": timing.our_call(module, problem, state, need_weights=True)}
    theirs = baselines.calls(framework_of(module).name, problem.operation, state, num_heads=problem.H, fused=fused)
    return {label: (call, params, ()) for label, (call, params) in (ours | theirs).items()}


PLAIN = timing.Variant("plain",
                       operations=OPERATIONS,
                       dims={"B": 2, "H": 8, "E": 64},
                       problem=timing.make_problem,
                       calls=plain_calls,
                       targets=TARGETS,
                       describe=lambda B, H, E: f"B={B}, H={H}, E={E} (D={H * E}, F={4 * H * E})")


# --- gqa ---------------------------------------------------------------------------------------------------


def gqa_problem(operation: str, *, B: int, H: int, L: int, E: int, dtype: str, seed: int = 0) -> Problem:
    """q (B, H, L, E), k and v (B, Hkv, S, E) with Hkv = H / GROUP and S = L, rounded to `dtype`."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, L, E))  # (B, H, L, E)
    k, v = (rng.standard_normal((B, H // GROUP, L, E)) for _ in "kv")  # (B, Hkv, S, E)
    return Problem(operation, B=B, H=H, L=L, E=E, inputs=tuple(timing.rounded(x, dtype) for x in (q, k, v)), state={})


def gqa_calls(name: str, module: ModuleType, problem: Problem, state: dict[str, Any],
              *, fused: bool) -> dict[str, Call]:
    """Our backend with enable_gqa=True, both paths, then its framework's grouped-query baselines."""
    ours = {name: timing.our_call(module, problem, state, need_weights=False, enable_gqa=True),
            f"{name} explicit": timing.our_call(module, problem, state, need_weights=True, enable_gqa=True)}
    theirs = _GQA_BASELINES[framework_of(module).name](name, module, fused)
    return {label: (call, params, GQA_OPTIONS) for label, (call, params) in (ours | theirs).items()}


def _numpy_gqa(name: str, module: ModuleType, fused: bool) -> dict[str, tuple[Any, None]]:
    def repeated(_: None, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Any:
        G = q.shape[-3] // k.shape[-3]
        k, v = (np.repeat(x, G, axis=-3) for x in (k, v))  # (B, Hkv, S, E) -> (B, H, S, E): head h gets h // G
        return module.scaled_dot_product_attention(q, k, v, need_weights=False)

    return {f"{name} np.repeat": (repeated, None)}


def _jax_gqa(name: str, module: ModuleType, fused: bool) -> dict[str, tuple[Any, None]]:
    # jax.nn.dot_product_attention takes K < N key/value heads itself; jitted by the framework's timing
    found = {"jax plain": (lambda _, q, k, v: baselines.jax_plain_grouped_attention(q, k, v), None),
             "jax.nn.dot_product_attention": (lambda _, q, k, v: baselines.jax_builtin_attention(q, k, v), None)}
    if fused:
        found["jax.nn.dot_product_attention cudnn"] = (
            lambda _, q, k, v: baselines.jax_builtin_attention(q, k, v, implementation="cudnn"), None)
    return found


def _torch_gqa(name: str, module: ModuleType, fused: bool) -> dict[str, tuple[Any, None]]:
    import torch.nn.functional as F

    return {"torch built-in": (lambda _, q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), None),
            "torch built-in repeat_interleave": (lambda _, q, k, v: baselines.torch_repeated_attention(q, k, v), None)}


_GQA_BASELINES = {"numpy": _numpy_gqa, "jax": _jax_gqa, "torch": _torch_gqa}


def repeated_kv_mib(problem: Problem) -> float:
    """MiB of the copies np.repeat makes: k and v at (B, H, S, E), 4 bytes a float32 value, 2 B H S E * 4 bytes
    (the (B, Hkv, S, E) originals are inputs, which no peak counts)."""
    return 2 * problem.B * problem.H * problem.L * problem.E * 4 / 2**20


GQA_TARGETS = (
    Target("torch", numerator="attention_torch", denominators=("torch built-in",), relation="<=", bound=1.10,
           operations=("sdpa",)),
    Target("jax", numerator="attention_jax", denominators=("jax plain", "jax.nn.dot_product_attention"),
           relation="<=", bound=1.10, operations=("sdpa",)),
    Target("numpy", numerator="attention_np", denominators=("attention_np np.repeat",), relation="<=", bound=1.00,
           operations=("sdpa",)),
    # the repeat's peak minus ours: at least the copies it makes, but for 1 %: tracemalloc counts Python's objects
    # too, and at its peak the enable_gqa call holds about a kilobyte more of them (one more frame, its keywords)
    Target("numpy",
           numerator="attention_np np.repeat",
           denominators=("attention_np",),
           relation=">=",
           bound=0.99,
           operations=("sdpa",),
           compared="peak difference",
           scale=repeated_kv_mib),
)

GQA = timing.Variant(
    "gqa",
    operations=("sdpa",),
    dims={"B": 2, "H": 32, "E": 64},
    problem=gqa_problem,
    calls=gqa_calls,
    targets=GQA_TARGETS,
    describe=lambda B, H, E: f"B={B}, H={H} query heads on Hkv={H // GROUP} key/value heads, E={E}, enable_gqa=True")


# --- window ------------------------------------------------------------------------------------------------


def window_calls(name: str, module: ModuleType, problem: Problem, state: dict[str, Any],
                 *, fused: bool) -> dict[str, Call]:
    """Our fast path with the sliding window ("window") and with full causal attention ("causal")."""
    return {f"{name} {label}": (*timing.our_call(module, problem, state, need_weights=False, **dict(options)), options)
            for label, options in WINDOW_OPTIONS.items()}


WINDOW_RATIOS = tuple(Target(framework, numerator=f"{name} window", denominators=(f"{name} causal",), relation="<=",
                             bound=None, operations=("sdpa",))
                      for framework, name in OURS)

WINDOW_VARIANT = timing.Variant(
    "window",
    operations=("sdpa",),
    dims={"B": 1, "H": 8, "E": 64},
    problem=timing.make_problem,
    calls=window_calls,
    targets=WINDOW_RATIOS,
    describe=lambda B, H, E: f"B={B}, H={H}, E={E}, is_causal=True with window={WINDOW} against full causal",
    target_L=4096,
    ratios=WINDOW_RATIOS)

# --- long: tiled attention ---------------------------------------------------------------------------------

SCORES_LIMIT = 2**30  # bytes: the untiled candidates run where the (B, H, L, S) float32 scores fit in 1 GiB
CAUSAL = (("is_causal", True),)


def long_calls(name: str, module: ModuleType, problem: Problem, state: dict[str, Any],
               *, fused: bool) -> dict[str, Call]:
    """Our flash_attention, full and causal, and its gradient (flash_attention_vjp, then the pullback with q as
    the cotangent: the forward and backward passes, as jax.grad runs them), each at its default tiles, as a user
    calls it; beside, where the scores fit in SCORES_LIMIT, our fast path and torch's
    F.scaled_dot_product_attention, full and causal."""
    found: dict[str, Call] = {}
    for label, options in (("", ()), (" causal", CAUSAL)):
        keywords = dict(options)  # no block_q, block_k: the defaults

        def forward(_: None, q: Any, k: Any, v: Any, keywords: dict = keywords) -> Any:
            return module.flash_attention(q, k, v, **keywords)

        def gradient(_: None, q: Any, k: Any, v: Any, keywords: dict = keywords) -> Any:
            out, _lse, pullback = module.flash_attention_vjp(q, k, v, **keywords)
            return out, pullback(q)  # out first: its error against the reference is the row's

        found[f"{name} flash{label}"] = (forward, None, options)
        found[f"{name} flash{label} gradient"] = (gradient, None, options)
        if 4 * problem.B * problem.H * problem.L**2 <= SCORES_LIMIT:
            found[f"{name}{label}"] = (*timing.our_call(module, problem, state, need_weights=False, **dict(options)),
                                       options)
            if framework_of(module).name == "torch":
                found[f"torch built-in{label}"] = (_torch_sdpa(dict(options)), None, options)
    return found


def _torch_sdpa(options: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    return lambda _, q, k, v: F.scaled_dot_product_attention(q, k, v, **options)


def long_reference(problem: Problem, options: timing.Options) -> np.ndarray:
    """attention_np.flash_attention in float64 (large tiles): the explicit path's (B, H, L, S) weights in float64
    would not fit at L = 32768."""
    import attention_np

    return attention_np.flash_attention(*problem.inputs, block_q=512, block_k=1024, **dict(options))[0]


LONG_TARGETS = (
    Target("numpy", numerator="attention_np flash", denominators=("torch built-in",), relation="<=", bound=1.5,
           operations=("sdpa",)),
    Target("numpy", numerator="attention_np flash causal", denominators=("torch built-in causal",), relation="<=",
           bound=1.5, operations=("sdpa",)),
    Target("jax", numerator="attention_jax flash", denominators=("attention_jax",), relation="<=", bound=1.3,
           operations=("sdpa",)),
    Target("jax", numerator="attention_jax flash causal", denominators=("attention_jax causal",), relation="<=",
           bound=1.3, operations=("sdpa",)),
    # the gradient runs the forward and the backward pass: backward <= 3 forward is gradient <= 4 forward
    *(Target(framework, numerator=f"{name} flash{label} gradient", denominators=(f"{name} flash{label}",),
             relation="<=", bound=4.0, operations=("sdpa",))
      for framework, name in OURS for label in ("", " causal")),
)
LONG_RATIOS = tuple(Target(framework, numerator=f"{name} flash{label}", denominators=(f"{name}{label}",),
                           relation="<=", bound=None, operations=("sdpa",))
                    for framework, name in OURS for label in ("", " causal"))

LONG = timing.Variant(
    "long",
    operations=("sdpa",),
    dims={"B": 1, "H": 1, "E": 64},
    problem=timing.make_problem,
    calls=long_calls,
    targets=LONG_TARGETS,
    describe=lambda B, H, E: f"B={B}, H={H}, E={E}: flash_attention (default tiles) beside the untiled fast "
                             "paths where the scores fit in 1 GiB",
    target_L=4096,
    ratios=LONG_RATIOS,
    target_dims={"B": 1, "H": 8, "E": 64},
    sizes=(1024, 2048, 4096, 8192, 16384, 32768),
    reference=long_reference)

# --- flex: programmable attention --------------------------------------------------------------------------

FLEX_BLOCK = 128  # BLOCK_SIZE of every block mask: torch's default
FLEX_WINDOW = 256  # the causal sliding window's reach: query i sees keys i - 256 .. i
DOCUMENTS = 8  # equal documents packed into one sequence


def _window(L: int) -> mods.MaskMod:
    return mods.sliding_window(FLEX_WINDOW, 0)


def _document(L: int) -> mods.MaskMod:
    return mods.document(document_ids(L))


def document_ids(L: int) -> np.ndarray:
    """(L,) the document of each position: DOCUMENTS runs of L / DOCUMENTS positions (as equal as L allows)."""
    return np.arange(L) * DOCUMENTS // L


FLEX_MASKS = {"window": _window, "document": _document}  # name -> L -> the mask function, from the catalogue


def flex_problem(operation: str, *, B: int, H: int, L: int, E: int, dtype: str, seed: int = 0) -> Problem:
    """q, k, v (B, H, L, E), S = L, rounded to `dtype`, for the operation "flex"."""
    return timing.make_problem("sdpa", B=B, H=H, L=L, E=E, dtype=dtype, seed=seed)._replace(operation=operation)


def dense_mask(name: str, L: int) -> np.ndarray:
    """(L, S) booleans: the mask function of FLEX_MASKS[name] on the whole grid, True where a query sees a key."""
    i, j = np.arange(L).reshape(1, 1, L, 1), np.arange(L).reshape(1, 1, 1, L)
    zero = np.zeros((1, 1, 1, 1), dtype=np.int64)  # b, h: the masks are the same for every batch element and head
    return np.broadcast_to(FLEX_MASKS[name](L)(zero, zero, i, j), (1, 1, L, L))[0, 0]


def flex_calls(name: str, module: ModuleType, problem: Problem, state: dict[str, Any],
               *, fused: bool) -> dict[str, Call]:
    """Per mask: our flex_attention with its block mask, our fast path with the dense mask (passed as the call's
    params), and for torch, torch's compiled flex_attention; each computes the mask's attention ("mask", name)."""
    found: dict[str, Call] = {}
    L = problem.L
    for mask, make in FLEX_MASKS.items():
        block_mask = module.create_block_mask(make(L), None, None, L, L, BLOCK_SIZE=FLEX_BLOCK)

        def flex(_: None, q: Any, k: Any, v: Any, block_mask: Any = block_mask) -> Any:
            return module.flex_attention(q, k, v, block_mask=block_mask)

        def dense(mask: Any, q: Any, k: Any, v: Any) -> Any:
            return module.scaled_dot_product_attention(q, k, v, mask, need_weights=False)

        options = (("mask", mask),)
        found[f"{name} flex {mask}"] = (flex, None, options)
        found[f"{name} dense {mask}"] = (dense, module.asarray(dense_mask(mask, L)), options)
        if framework_of(module).name == "torch":
            found[f"torch compiled flex {mask}"] = (torch_compiled_flex(mask, L), None, options)
    return found


def torch_compiled_flex(mask: str, L: int) -> Callable[..., Any]:
    """torch's own flex_attention, compiled (inductor, the CPU's C compiler), with its own block mask of the mask
    written in torch (the same rule as FLEX_MASKS[mask]); compiled at its first call, the benchmark's warm-up."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    documents = torch.from_numpy(document_ids(L))
    rules = {"window": lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx <= FLEX_WINDOW),
             "document": lambda b, h, q_idx, kv_idx: documents[q_idx] == documents[kv_idx]}
    block_mask = create_block_mask(rules[mask], None, None, L, L, device="cpu", BLOCK_SIZE=FLEX_BLOCK)
    compiled = _torch_compiled()
    return lambda _, q, k, v: compiled(q, k, v, block_mask=block_mask)


@functools.cache
def _torch_compiled() -> Callable[..., Any]:
    """torch.compile(flex_attention), once: static shapes, so that every L gets its own kernel. Each mask and L is
    one more compilation of the same function, and dynamo compiles one function at most recompile_limit times (8
    in torch 2.13) before it runs it eagerly: --sizes of at most four lengths keep every row compiled."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_reference(problem: Problem, options: timing.Options) -> np.ndarray:
    """attention_np.flash_attention in float64 with the dense mask (options: ("mask", name)): written apart from
    every flex_attention, and within memory at L = 4096, where the explicit path's float64 weights take 1 GiB."""
    import attention_np

    mask = dense_mask(dict(options)["mask"], problem.L)
    return attention_np.flash_attention(*problem.inputs, mask, block_q=512, block_k=1024)[0]


FLEX_TARGETS = tuple(
    target
    for mask in FLEX_MASKS
    for framework, name in OURS
    for target in (
        Target(framework, numerator=f"{name} flex {mask}", denominators=(f"{name} dense {mask}",), relation="<=",
               bound=0.3, operations=("flex",)),
        Target(framework, numerator=f"{name} flex {mask}", denominators=(f"torch compiled flex {mask}",),
               relation="<=", bound=1.10 if framework == "torch" else 2.0, operations=("flex",)),
    ))

FLEX = timing.Variant(
    "flex",
    operations=("flex",),
    dims={"B": 1, "H": 8, "E": 64},
    problem=flex_problem,
    calls=flex_calls,
    targets=FLEX_TARGETS,
    describe=lambda B, H, E: f"B={B}, H={H}, E={E}, CPU: flex_attention with a block mask (BLOCK_SIZE "
                             f"{FLEX_BLOCK}) against the dense boolean mask and torch's compiled flex_attention; "
                             f"masks: a causal window of {FLEX_WINDOW}, {DOCUMENTS} equal documents",
    target_L=4096,
    ratios=FLEX_TARGETS,
    sizes=(4096,),
    reference=flex_reference,
    # NumPy's flex runs its tiles on a thread pool, which OpenBLAS's idle threads, spinning for a while after the
    # dense candidate's products, starved: 53 ms after it against 32 ms after a pause of 0.5 s (L = 4096)
    settle=0.5)

VARIANTS = {variant.name: variant for variant in (PLAIN, GQA, WINDOW_VARIANT, LONG, FLEX)}
