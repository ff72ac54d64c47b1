"""The latent-attention decode benchmark of `python -m conformance compare --variant mla`: one decode step of
MultiHeadLatentAttention (SPEC 3d) over a cache of S - 1 positions, in its expanded form against its absorbed one,
on every backend.

Shape legend: B batch (1), H heads, S positions the step attends (the cache's S - 1 and its own), D = d_model,
Dc = kv_lora_rank, En = qk_nope_head_dim, Er = qk_rope_head_dim, Ev = v_head_dim.

The module: MultiHeadLatentAttention(D=1024, H=16, q_lora_rank=None (DeepSeek-V2-Lite's q_proj), Dc=256, En=64,
Er=32, Ev=64) in float32, its weights drawn once by attention_np and loaded into every backend by from_state_dict;
S = 4096. The cache: an empty cache of capacity S filled with the latents of S - 1 random inputs, by extend in
chunks of 512 (absorbed, need_weights=False); the step: one more random input, `extend(x, cache, absorbed=...,
need_weights=False)`, the cache at length S - 1 each time (NumPy and torch write the same slot again; JAX returns
a new cache). JAX: extend jitted once per form, the module and the cache's arrays as arguments; the cache's length
is a Python int in LatentCache, static under jit, so the step is compiled for length S - 1 alone (one compile per
form; each other length would compile again).

What each form does per step: expanded up-projects every cached latent through kv_b_proj, (S, Dc) -> (S, H (En +
Ev)), then runs H heads of attention of width En + Er; absorbed folds W_UK into the query and W_UV into the output
and runs multi-query attention over the cache itself (key Dc + Er, value Dc), never forming the S keys of H heads.
`flops`: the matrix-product FLOPs of the attention's cache-dependent part, per step, each form (the projections of
the new row, the same in both, left out).

Before timing, the two forms' outputs must agree (max |absorbed - expanded| <= ATOL). The timing: each
(backend, form) runs TURN steps in a turn, the turns in order (numpy expanded, numpy absorbed, jax expanded, ...),
`repeats` rounds after one warm-up round, with Python's collector paused (timing.collector_paused); ms/token = the
turn's seconds / TURN, median over the rounds. Ratio: absorbed / expanded ms/token per backend, target <= 0.5 in
torch and JAX (NumPy's shown without one).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from ..frameworks.registry import framework_of
from .timing import Ratio, collector_paused, older_objects_frozen, ratio

FORMS = ("expanded", "absorbed")
TARGET = 0.5  # absorbed / expanded ms per token, torch and JAX
TARGETED = ("torch", "jax")  # the frameworks held to TARGET; NumPy's ratio is shown without one
CHUNK = 512  # the positions of one extend while the cache is filled
ATOL = 1e-3  # float32 outputs of the two forms over S positions (their sums run in another order)


class Config(NamedTuple):
    """The module's sizes, the context S, the steps of a turn and the rounds (the defaults: the command's)."""

    d_model: int = 1024
    num_heads: int = 16
    q_lora_rank: int | None = None
    kv_lora_rank: int = 256
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    context: int = 4096  # S: the step attends the cache's S - 1 positions and its own
    turn: int = 8  # steps of one turn
    repeats: int = 5
    seed: int = 0


class FormRow(NamedTuple):
    """One backend's form: ms per token (median over the rounds), the cache-dependent matrix-product FLOPs of a
    step (`flops`) and max |absorbed - expanded| over the step's output (the same on both rows)."""

    backend: str
    framework: str
    form: str
    context: int
    mflops: float
    ms_per_token: float
    max_diff: float


class Calls(NamedTuple):
    """How one backend runs a step of each form: step[form](x) -> out, and finish(out) waits for it."""

    step: dict[str, Callable[[Any], Any]]
    finish: Callable[[Any], Any]


def sizes(config: Config) -> dict[str, Any]:
    """MultiHeadLatentAttention's keyword sizes."""
    return {"q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
            "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
            "v_head_dim": config.v_head_dim}


def flops(config: Config, form: str) -> float:
    """The matrix-product FLOPs of one step's cache-dependent part (2 per multiply-add), S = context.
    expanded: kv_b_proj over the S latents, 2 S Dc H (En + Ev), then the heads' scores 2 H S (En + Er) and
    values 2 H S Ev; absorbed: the query's W_UK 2 H En Dc, scores 2 H S (Dc + Er), values 2 H S Dc, W_UV 2 H Dc Ev."""
    S, H, Dc = config.context, config.num_heads, config.kv_lora_rank
    En, Er, Ev = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    if form == "expanded":
        return 2 * S * Dc * H * (En + Ev) + 2 * H * S * (En + Er) + 2 * H * S * Ev
    return 2 * H * En * Dc + 2 * H * S * (Dc + Er) + 2 * H * S * Dc + 2 * H * Dc * Ev


def make_problem(config: Config) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The module's float32 state dict (attention_np's initial values, seeded), the cache's inputs (1, S - 1, D)
    and the step's input (1, 1, D)."""
    import attention_np

    mla = attention_np.MultiHeadLatentAttention(config.d_model, config.num_heads, **sizes(config), rng=config.seed,
                                                dtype=np.float32)
    rng = np.random.default_rng(config.seed + 1)
    x = rng.standard_normal((1, config.context, config.d_model)).astype(np.float32)  # (B, S, D)
    state = {name: np.array(value) for name, value in mla.state_dict().items()}  # writable copies (torch)
    return state, x[:, :-1], x[:, -1:]


def run(config: Config, backends: dict[str, ModuleType]) -> tuple[list[FormRow], list[Ratio]]:
    """The two forms checked equal on every backend, then timed in turns; their rows and the ratios."""
    state, prompt, step = make_problem(config)
    prepared: dict[str, tuple[str, Calls, Any]] = {}
    with older_objects_frozen(), contextlib.ExitStack() as stack:
        for name, module in backends.items():
            framework = framework_of(module)
            convert = framework.converter("float32", "cpu")
            if framework.no_autograd:
                stack.enter_context(framework.no_autograd())
            calls = PREPARE[framework.name](module, {key: convert(value) for key, value in state.items()},
                                            convert(prompt), config)
            prepared[name] = (framework.name, calls, convert(step))
        # 1) the forms agree (and are warmed up, JAX compiled)
        diffs = {name: _max_diff(*(np.asarray(calls.finish(calls.step[form](x))) for form in FORMS))
                 for name, (_, calls, x) in prepared.items()}
        for name, diff in diffs.items():
            if diff > ATOL:
                raise AssertionError(f"{name}: the absorbed step differs from the expanded one by {diff:.2e} > {ATOL}")
        # 2) the rounds, every (backend, form) a turn of `turn` steps
        seconds: dict[tuple[str, str], list[float]] = {(name, form): [] for name in prepared for form in FORMS}
        for _ in range(config.repeats + 1):  # the first round warms up
            for (name, form), found in seconds.items():
                _, calls, x = prepared[name]
                found.append(_turn(calls, form, x, config.turn))
    rows = [FormRow(name, framework=prepared[name][0], form=form, context=config.context,
                    mflops=flops(config, form) / 1e6, ms_per_token=1e3 * statistics.median(found[1:]),
                    max_diff=diffs[name]) for (name, form), found in seconds.items()]
    return rows, ratios(rows)


def ratios(rows: list[FormRow]) -> list[Ratio]:
    """absorbed / expanded ms per token, one per backend (target <= TARGET in TARGETED)."""
    ms = {(row.backend, row.form): row.ms_per_token for row in rows}
    frameworks = {row.backend: row.framework for row in rows}
    return [ratio("ms/token", f"{backend} absorbed", ms[backend, "absorbed"], f"{backend} expanded",
                  ms[backend, "expanded"], "<=", TARGET if framework in TARGETED else None)
            for backend, framework in frameworks.items()]


def _turn(calls: Calls, form: str, x: Any, steps: int) -> float:
    """Seconds per step over `steps` steps of `form`."""
    with collector_paused():
        start = time.perf_counter()
        for _ in range(steps):
            calls.finish(calls.step[form](x))
        return (time.perf_counter() - start) / steps


def _max_diff(expanded: np.ndarray, absorbed: np.ndarray) -> float:
    return float(np.max(np.abs(absorbed.astype(np.float64) - expanded.astype(np.float64))))


def describe(config: Config) -> str:
    """The configuration, one line."""
    q = "q_proj" if config.q_lora_rank is None else f"Dq={config.q_lora_rank}"
    return (f"mla: float32, B=1, MultiHeadLatentAttention(D={config.d_model}, H={config.num_heads}, {q}, "
            f"Dc={config.kv_lora_rank}, En={config.qk_nope_head_dim}, Er={config.qk_rope_head_dim}, "
            f"Ev={config.v_head_dim}); one decode step over S={config.context} positions (a cache of "
            f"{config.context - 1}), expanded against absorbed; turns of {config.turn} steps, {config.repeats} "
            f"rounds after a warm-up, medians; JAX: jitted once per form at that cache length")


# --- each framework's calls ----------------------------------------------------------------------------


def _filled(mla: Any, prompt: Any, config: Config) -> Any:
    """A cache of capacity S holding the S - 1 prompt positions, filled CHUNK at a time."""
    cache = mla.init_cache((1,), config.context)
    for start in range(0, prompt.shape[-2], CHUNK):
        _, _, cache = mla.extend(prompt[:, start:start + CHUNK], cache, absorbed=True, need_weights=False)
    return cache


def _eager(module: ModuleType, state: dict[str, Any], prompt: Any, config: Config) -> Calls:
    """NumPy and torch: extend called on the filled cache (length S - 1) each time."""
    mla = module.MultiHeadLatentAttention.from_state_dict(state, num_heads=config.num_heads)
    cache = _filled(mla, prompt, config)
    return Calls(step={form: lambda x, absorbed=form == "absorbed": mla.extend(x, cache, absorbed=absorbed,
                                                                               need_weights=False)[0]
                       for form in FORMS}, finish=lambda out: out)


def _jax(module: ModuleType, state: dict[str, Any], prompt: Any, config: Config) -> Calls:
    """JAX: extend jitted per form, the module and the cache's arrays as arguments, the length S - 1 fixed."""
    import jax

    mla = module.MultiHeadLatentAttention.from_state_dict(state, num_heads=config.num_heads)
    cache = _filled(mla, prompt, config)

    def step(absorbed: bool) -> Callable[[Any], Any]:
        def extend(mla: Any, x: Any, c_kv: Any, k_rope: Any) -> Any:
            # jax: the length is a Python int (static): the step is compiled for this length alone
            return mla.extend(x, cache._replace(c_kv=c_kv, k_rope=k_rope), absorbed=absorbed, need_weights=False)[0]

        compiled = jax.jit(extend)
        return lambda x: compiled(mla, x, cache.c_kv, cache.k_rope)

    return Calls(step={form: step(form == "absorbed") for form in FORMS}, finish=jax.block_until_ready)


PREPARE = {"numpy": _eager, "jax": _jax, "torch": _eager}
