"""The complexity table of `python -m conformance compare --complexity`, measured: softmax attention, linear
attention and the recurrent form (the RNN row) timed against the sequence length n on every backend, each
form's log-log slope fitted, and the n where chunked linear attention overtakes softmax attention.

Shape legend: B batch (1), H heads (1), L query positions, S key/value positions (L = S = n), E query/key width
(64), Ev value width (64), d = E = Ev the tutorial's width.

The tutorial's table (time, sequential steps): RNN O(n d^2), O(n); self-attention O(n^2 d), O(1); linear attention
O(n d^2), O(1). Every form here is causal: the RNN row is autoregressive, so the others compute the same causal
outputs. The forms, one declaration each in FORMS:

- softmax explicit: scaled_dot_product_attention(is_causal=True, need_weights=True), its (L, S) weights returned;
  softmax fast: the same with need_weights=False; both only where the (B, H, L, S) float32 scores fit in
  MEMORY_LIMIT. softmax flash: flash_attention(is_causal=True) in tiles of TILES, at every n.
- linear parallel: linear_attention(is_causal=True, chunk=None), the prefix sums, only where its (B, H, L, E, Ev)
  float32 prefix states fit in MEMORY_LIMIT; linear chunked: chunk=CHUNK, at every n.
- recurrent loop: linear_attention_state, then linear_attention_step n times in a Python loop over positions split
  before the clock starts (views in NumPy and torch); JAX: the step jitted once (its shapes do not depend on n, so
  one trace serves every n), the loop finished by block_until_ready; torch: under inference_mode, as every torch
  candidate. The whole loop is timed, no prefix scaled, up to n = LOOP_UP_TO (a step's cost does not depend on n:
  the loop at 32768 adds minutes to the run and nothing to the slope).
- gated chunked, gated loop, delta chunked, delta loop: the same chunked form and loop with update_rule "gated"
  (a decay g per head and position) and "delta" (a rate beta per head and position), ONNX LinearAttention's
  rules, on the rules' own inputs (`rule_inputs`: unit keys and the identity feature map, so that the delta
  rule's state stays bounded at every n, as DeltaNet normalises its keys).

NumPy's BLAS and torch run on one thread (`one_thread`). The candidates of one backend at one n are timed
interleaved (timing.measure: one warm-up call, then the repeats in a balanced order), medians reported. Each
form's slope is the least-squares line through (log n, log time) over the sizes n >= FIT_FROM it ran at (its two
largest where fewer than two are). The crossover is the n where chunked linear attention's time first falls below
the fastest softmax form's at the same n, interpolated linearly in (log n, log time ratio) between the two measured
sizes around it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from ..frameworks.registry import FRAMEWORKS, framework_of
from . import timing
from .columns import columns

E = EV = 64  # d
B, H = 1, 1
SIZES = tuple(2**p for p in range(6, 16))  # 64 .. 32768: the 256 .. 32768, and below it the crossover
CHUNK = 64  # linear attention's chunk: the fastest of 32, 64, 128, 256 in NumPy at n = 1024 and 4096
TILES = {"block_q": 256, "block_k": 512}  # flash_attention's, as compare --variant long
MEMORY_LIMIT = 2**28  # bytes (256 MiB): a capped form's largest array; keeps the default run to minutes on 2 cores
FIT_FROM = 1024  # slopes are fitted over n >= FIT_FROM: below it per-call overheads flatten every line
LOOP_UP_TO = 8192  # the step loop's largest n: each step costs the same at every n; 1.7-3.8 s a loop at 32768
ERROR_UP_TO = 4096  # errors against the float64 reference are measured up to this n ("-" above)
RULE_OPTIONS = {"feature_map": "identity"}  # the gated and delta forms' phi: keys of unit length (rule_inputs)
ORIGINAL = {"RNN": ("O(n d^2)", "O(n)"), "self-attention": ("O(n^2 d)", "O(1)"),
            "linear attention": ("O(n d^2)", "O(1)")}  # the tutorial's row: (time, sequential steps)


class Form(NamedTuple):
    """One way to compute causal attention, declared once: the table, the caps, the run and the reference read it."""

    label: str
    row: str  # its row of the tutorial's table, a key of ORIGINAL
    steps: str  # the sequential steps of our implementation: a chain of n / C dependent steps is "n / C"
    largest: Callable[[int], int] | None  # n -> bytes of its largest array that grows faster than n; None: O(n)
    prepare: Callable[[ModuleType, str, tuple], Callable[[], Any]]  # (module, framework, (q, k, v)) -> run()
    reference: str  # "softmax" or "linear": the float64 output it must equal
    style: dict[str, Any]  # its line in the plot
    up_to: int | None = None  # the largest n it runs at (a cap on time, not memory); None: every n
    rule: str = "linear"  # linear attention's update rule; its inputs are rule_inputs(rule, ...)


def _call(compute: Callable[..., Any]) -> Callable[[ModuleType, str, dict], Callable[[], Any]]:
    """A one-call form: compute(module, q, k, v, **gates), timed as compare times our calls (JAX: jitted ahead)."""

    def prepare(module: ModuleType, framework: str, inputs: dict) -> Callable[[], Any]:
        names = tuple(inputs)
        call = lambda _, *arrays: compute(module, **dict(zip(names, arrays, strict=True)))  # noqa: E731
        return FRAMEWORKS[framework].timed(call, (None, *inputs.values()), "cpu")[0]

    return prepare


def _rule_options(rule: str) -> dict[str, Any]:
    """linear attention's keywords of an update rule: none for "linear" (its defaults), else the rule and
    RULE_OPTIONS."""
    return {} if rule == "linear" else {"update_rule": rule, **RULE_OPTIONS}


def _rule_call(rule: str) -> Callable[[ModuleType, str, dict], Callable[[], Any]]:
    """The chunked form of an update rule, chunks of CHUNK, on rule_inputs(rule, ...)."""
    return _call(lambda M, q, k, v, **gates: M.linear_attention(q, k, v, is_causal=True, chunk=CHUNK,
                                                                **_rule_options(rule), **gates))


def _loop(rule: str) -> Callable[[ModuleType, str, dict], Callable[[], Any]]:
    """The recurrent form of an update rule: n steps from zeros on rule_inputs(rule, ...), returning the n outputs,
    each (B, H, Ev)."""

    def prepare(module: ModuleType, framework: str, inputs: dict) -> Callable[[], Any]:
        q, k, v = inputs["q"], inputs["k"], inputs["v"]  # (B, H, L, E), (B, H, S, E), (B, H, S, Ev)
        gates = {name: x for name, x in inputs.items() if name in ("decay", "beta")}  # (B, H, S, 1) each
        positions = [(q[..., t, :], k[..., t, :], v[..., t, :], {name: x[..., t, :] for name, x in gates.items()})
                     for t in range(q.shape[-2])]  # n of (B, H, E), (.., E), (.., Ev) and the gates (B, H, 1)
        step = functools.partial(module.linear_attention_step, **_rule_options(rule))
        if framework == "jax":
            import jax

            step = jax.jit(step)  # jax: one trace for every n, the loop stays in Python

        def loop(_: None) -> list[Any]:
            state = module.linear_attention_state((B, H), E, EV, update_rule=rule)  # S (B, H, E, Ev), z: zeros
            outputs = []
            for q_t, k_t, v_t, gates_t in positions:
                out_t, state = step(q_t, k_t, v_t, state, **gates_t)  # (B, H, Ev)
                outputs.append(out_t)
            return outputs

        if framework == "jax":
            import jax

            return lambda: jax.block_until_ready(loop(None))
        return FRAMEWORKS[framework].timed(loop, (None,), "cpu")[0]

    return prepare


FORMS = (
    Form("softmax explicit",
         row="self-attention",
         steps="1",
         largest=lambda n: 4 * B * H * n * n,
         prepare=_call(lambda M, q, k, v: M.scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=True)),
         reference="softmax",
         style={"color": "tab:red", "linestyle": "--", "marker": "s"}),
    Form("softmax fast",
         row="self-attention",
         steps="1",
         largest=lambda n: 4 * B * H * n * n,
         prepare=_call(lambda M, q, k, v: M.scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=False)),
         reference="softmax",
         style={"color": "tab:orange", "linestyle": "-", "marker": "o"}),
    Form("softmax flash",
         row="self-attention",
         steps=f"n / {TILES['block_k']}",
         largest=None,
         prepare=_call(lambda M, q, k, v: M.flash_attention(q, k, v, is_causal=True, **TILES)),
         reference="softmax",
         style={"color": "tab:purple", "linestyle": "-", "marker": "D"}),
    Form("linear parallel",
         row="linear attention",
         steps="1",
         largest=lambda n: 4 * B * H * n * E * EV,
         prepare=_call(lambda M, q, k, v: M.linear_attention(q, k, v, is_causal=True)),
         reference="linear",
         style={"color": "tab:cyan", "linestyle": "--", "marker": "v"}),
    Form("linear chunked",
         row="linear attention",
         steps=f"n / {CHUNK}",
         largest=None,
         prepare=_call(lambda M, q, k, v: M.linear_attention(q, k, v, is_causal=True, chunk=CHUNK)),
         reference="linear",
         style={"color": "tab:blue", "linestyle": "-", "marker": "o"}),
    Form("recurrent loop",
         row="RNN",
         steps="n",
         largest=None,
         prepare=_loop("linear"),
         reference="linear",
         style={"color": "tab:green", "linestyle": "-.", "marker": "^"},
         up_to=LOOP_UP_TO),
    *(form
      for rule, color in (("gated", "tab:brown"), ("delta", "tab:pink"))
      for form in (
          Form(f"{rule} chunked",
               row="linear attention",
               steps=f"n / {CHUNK}",
               largest=None,
               prepare=_rule_call(rule),
               reference="linear",
               style={"color": color, "linestyle": "-", "marker": "x"},
               rule=rule),
          Form(f"{rule} loop",
               row="RNN",
               steps="n",
               largest=None,
               prepare=_loop(rule),
               reference="linear",
               style={"color": color, "linestyle": "-.", "marker": "+"},
               up_to=LOOP_UP_TO,
               rule=rule))),
)
CHALLENGER = "linear chunked"  # the crossover: where it first beats the fastest softmax form


class Row(NamedTuple):
    backend: str
    framework: str
    form: str
    n: int
    repeats: int
    time_ms: float
    rel_error: float | None  # max|a - b| / max|b| against the float64 reference; None above ERROR_UP_TO


class Fit(NamedTuple):
    backend: str
    form: str
    slope: float | None  # None: fewer than two sizes ran
    sizes: tuple[int, ...]  # the n it was fitted over


class Crossover(NamedTuple):
    backend: str
    n: float | None  # None: no crossing inside the sizes (see `where`)
    where: str  # "between a and b", "at a, the smallest n" (faster from the start) or "up to b" (never faster)
    rival: str | None  # the fastest softmax form at the n just after the crossing


def run(backends: dict[str, ModuleType], *, sizes: Sequence[int] = SIZES, repeats: int = 3) -> list[Row]:
    """Every form that fits on every backend and size; the forms of one backend at one n timed interleaved."""
    rows = []
    with timing.pinned(backends), one_thread(backends):
        for n in sizes:
            forms = [form for form in FORMS if runs(form, n)]
            inputs = {rule: rule_inputs(rule, _inputs(n), seed=n) for rule in {form.rule for form in forms}}
            references = ({(form.reference, form.rule): _reference(form.reference, form.rule, inputs[form.rule])
                           for form in forms} if n <= ERROR_UP_TO else {})
            for name, module in backends.items():
                framework = framework_of(module)
                converted = {rule: {key: framework.converter("float32", "cpu")(x) for key, x in arrays.items()}
                             for rule, arrays in inputs.items()}
                candidates = [timing.Candidate(form.label, operation="sdpa",
                                               run=form.prepare(module, framework.name, converted[form.rule]),
                                               peak=lambda: None, framework=framework.name) for form in forms]
                seconds = timing.measure(candidates, repeats=repeats)
                for form, candidate, median in zip(forms, candidates, seconds, strict=True):
                    error = (_error(candidate.run(), references[(form.reference, form.rule)], framework.name)
                             if references else None)
                    rows.append(Row(name,
                                    framework=framework.name,
                                    form=form.label,
                                    n=n,
                                    repeats=repeats,
                                    time_ms=1e3 * median,
                                    rel_error=error))
    return rows


@contextlib.contextmanager
def one_thread(backends: dict[str, ModuleType]) -> Iterator[None]:
    """NumPy's BLAS and torch's intra-op pool on one thread for the run, restored after. On the 2 shared cores of
    the README's machine a second thread made torch's small operations 5 to 10 times slower and erratic (each
    waits at a barrier for a thread another process holds: the chunked form took 2 to 28 ms at n = 1024), which
    bends a slope more than any cost of the form. flash_attention's own tile workers (NumPy) and XLA's pool stay
    as they are."""
    import threadpoolctl

    torch = None
    if any(framework_of(module).name == "torch" for module in backends.values()):
        import torch
    threads = torch.get_num_threads() if torch else None
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        if torch:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            if torch:
                torch.set_num_threads(threads)


def runs(form: Form, n: int) -> bool:
    """Whether `form` runs at n: its largest array within MEMORY_LIMIT, n within its cap."""
    return (form.largest is None or form.largest(n) <= MEMORY_LIMIT) and (form.up_to is None or n <= form.up_to)


def _inputs(n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """q, k, v (B, H, n, E) in float32, held as float64 so the reference sees exactly the benchmark's inputs."""
    rng = np.random.default_rng(seed)
    return tuple(timing.rounded(rng.standard_normal((B, H, n, width)), "float32") for width in (E, E, EV))


def rule_inputs(rule: str, inputs: tuple[np.ndarray, ...], seed: int = 0) -> dict[str, np.ndarray]:
    """q, k, v and the gates of an update rule, float32 values held as float64: "linear" takes the inputs as they
    are; "gated" and "delta" (read through RULE_OPTIONS' identity map) take keys of unit length, and a decay
    g = log(a), a uniform in 0.9 .. 0.999 ("gated"), or a rate beta uniform in 0.1 .. 0.9 ("delta"), (B, H, S, 1)
    each: the delta rule's state then moves by (I - beta k k^T), whose eigenvalues lie in [0.1, 1], and stays
    bounded at every n."""
    q, k, v = inputs  # (B, H, n, E), (B, H, n, E), (B, H, n, Ev)
    if rule == "linear":
        return {"q": q, "k": k, "v": v}
    rng = np.random.default_rng(seed)
    k = timing.rounded(k / np.linalg.norm(k, axis=-1, keepdims=True), "float32")
    gate = (("decay", np.log(rng.uniform(0.9, 0.999, (*k.shape[:-1], 1)))) if rule == "gated" else
            ("beta", rng.uniform(0.1, 0.9, (*k.shape[:-1], 1))))
    return {"q": q, "k": k, "v": v, gate[0]: timing.rounded(gate[1], "float32")}


def _reference(kind: str, rule: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The causal output in float64 by attention_np: flash_attention for softmax (no (L, S) weights kept),
    the chunked form for linear attention (with the form's update rule)."""
    import attention_np

    if kind == "softmax":
        return attention_np.flash_attention(**inputs, is_causal=True, block_q=512, block_k=1024)[0]
    return attention_np.linear_attention(**inputs, is_causal=True, chunk=256, **_rule_options(rule))


def _error(result: Any, reference: np.ndarray, framework: str) -> float:
    to_float64 = FRAMEWORKS[framework].to_float64
    if isinstance(result, list):  # the loop's n outputs (B, H, Ev) -> (B, H, L, Ev)
        out = np.stack([to_float64(out_t) for out_t in result], axis=-2)
    else:
        out = to_float64(result[0] if isinstance(result, tuple) else result)
    return float(np.max(np.abs(out - reference)) / np.max(np.abs(reference)))


# --- the slopes and the crossover --------------------------------------------------------------------------


def fits(rows: Sequence[Row]) -> list[Fit]:
    """Each backend's and form's log-log slope: time ~ n^slope, least squares over n >= FIT_FROM (the two largest
    sizes where fewer than two are that large)."""
    found = []
    for backend, form in dict.fromkeys((row.backend, row.form) for row in rows):
        mine = sorted((row.n, row.time_ms) for row in rows if (row.backend, row.form) == (backend, form))
        upper = [point for point in mine if point[0] >= FIT_FROM]
        chosen = upper if len(upper) >= 2 else mine[-2:]
        n, ms = np.log([p[0] for p in chosen]), np.log([p[1] for p in chosen])
        slope = float(np.polyfit(n, ms, 1)[0]) if len(chosen) >= 2 else None
        found.append(Fit(backend, form=form, slope=slope, sizes=tuple(p[0] for p in chosen)))
    return found


def crossovers(rows: Sequence[Row]) -> list[Crossover]:
    """Per backend, the n where CHALLENGER first takes less time than the fastest softmax form at that n: between
    the sizes a < b around the first sign change of log(challenger / softmax), the zero of the line through
    (log a, log ratio_a) and (log b, log ratio_b)."""
    found = []
    softmax = {form.label for form in FORMS if form.reference == "softmax"}
    for backend in dict.fromkeys(row.backend for row in rows):
        mine = [row for row in rows if row.backend == backend]
        points = []  # (n, log(challenger / fastest softmax), that softmax form)
        for n in sorted({row.n for row in mine}):
            ours = [row.time_ms for row in mine if row.n == n and row.form == CHALLENGER]
            theirs = min((row for row in mine if row.n == n and row.form in softmax), key=lambda row: row.time_ms,
                         default=None)
            if ours and theirs is not None:
                points.append((n, math.log(ours[0] / theirs.time_ms), theirs.form))
        found.append(_crossing(backend, points))
    return found


def _crossing(backend: str, points: list[tuple[int, float, str]]) -> Crossover:
    if not points:
        return Crossover(backend, n=None, where="no sizes", rival=None)
    if points[0][1] < 0:
        return Crossover(backend, n=None, where=f"at {points[0][0]}, the smallest n", rival=points[0][2])
    for (a, ratio_a, _), (b, ratio_b, rival) in itertools.pairwise(points):
        if ratio_b < 0:  # ratio_a >= 0 > ratio_b: log n = log a + (log b - log a) * ratio_a / (ratio_a - ratio_b)
            n = math.exp(math.log(a) + (math.log(b) - math.log(a)) * ratio_a / (ratio_a - ratio_b))
            return Crossover(backend, n=n, where=f"between {a} and {b}", rival=rival)
    return Crossover(backend, n=None, where=f"up to {points[-1][0]}", rival=None)


# --- what is printed and drawn -----------------------------------------------------------------------------


def describe(sizes: Sequence[int], repeats: int) -> str:
    """The configuration, one line."""
    return (f"complexity: float32, B={B}, H={H}, d = E = Ev = {E}, causal (the RNN row is autoregressive), "
            f"n = {','.join(map(str, sizes))}; {repeats} repeats per form, interleaved, medians; chunk {CHUNK}, "
            f"flash tiles {TILES['block_q']} x {TILES['block_k']}; softmax explicit and fast where the (L, S) "
            f"float32 scores fit in {MEMORY_LIMIT // 2**20} MiB, linear parallel where its (L, E, Ev) prefix "
            f"states do, the recurrent loop up to n = {LOOP_UP_TO}; NumPy's BLAS and torch on one thread")


def format_rows(rows: Sequence[Row]) -> str:
    """The medians: one line per backend, form and n."""
    lines = [("backend", "form", "n", "time ms", "rel. error")]
    for row in rows:
        error = "-" if row.rel_error is None else f"{row.rel_error:.1e}"
        lines.append((row.backend, row.form, str(row.n), f"{row.time_ms:.3f}", error))
    return columns(lines, right=(2, 3, 4))


def format_table(rows: Sequence[Row]) -> str:
    """The tutorial's table beside the measured one: a line per form, in the tutorial's order of rows, its slope
    on every backend."""
    slopes = {(fit.backend, fit.form): fit for fit in fits(rows)}
    backends = {row.backend: row.framework for row in rows}
    header = ("row", "tutorial: time", "sequential", "our form", "sequential steps",
              *(f"{framework} slope" for framework in backends.values()), "fitted over n")
    lines = [header]
    for form in sorted(FORMS, key=lambda form: list(ORIGINAL).index(form.row)):
        fitted = [slopes.get((backend, form.label)) for backend in backends]
        if not any(fitted):
            continue
        time, sequential = ORIGINAL[form.row]
        shown = ["-" if fit is None or fit.slope is None else f"{fit.slope:.2f}" for fit in fitted]
        spans = {f"{fit.sizes[0]}..{fit.sizes[-1]}" for fit in fitted if fit is not None and fit.sizes}
        lines.append((form.row, time, sequential, form.label, form.steps, *shown, ", ".join(sorted(spans))))
    return columns(lines, right=tuple(range(5, 5 + len(backends))))


def format_crossovers(rows: Sequence[Row]) -> str:
    """One line per backend: where chunked linear attention first beats the fastest softmax form."""
    lines = []
    for found in crossovers(rows):
        if found.n is not None:
            at = f"first takes less time than the fastest softmax form at n = {found.n:.0f} ({found.where}; there: "
            lines.append(f"{found.backend}: {CHALLENGER} {at}{found.rival})")
        elif found.rival is not None:
            lines.append(f"{found.backend}: {CHALLENGER} takes less time than every softmax form from the start "
                         f"({found.where})")
        else:
            lines.append(f"{found.backend}: {CHALLENGER} never takes less time than the fastest softmax form "
                         f"({found.where})")
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str) -> None:
    """PNG, a panel per backend: time against n on log-log axes, a line per form with its fitted slope in the
    legend, n and n^2 as grey guides, the crossover marked with a vertical line."""
    from matplotlib.figure import Figure  # a bare Figure: no pyplot, no global backend change

    backends = list(dict.fromkeys(row.backend for row in rows))
    slopes = {(fit.backend, fit.form): fit.slope for fit in fits(rows)}
    where = {found.backend: found for found in crossovers(rows)}
    figure = Figure(figsize=(6 * len(backends), 5), layout="constrained")
    axes = figure.subplots(1, len(backends), squeeze=False)[0]
    for axis, backend in zip(axes, backends, strict=True):
        mine = [row for row in rows if row.backend == backend]
        sizes = sorted({row.n for row in mine})
        for form in FORMS:
            line = sorted((row.n, row.time_ms) for row in mine if row.form == form.label)
            if line:
                slope = slopes[(backend, form.label)]
                label = form.label + ("" if slope is None else f" (slope {slope:.2f})")
                axis.loglog(*zip(*line, strict=True), label=label, markersize=4, **form.style)
        start = min(row.time_ms for row in mine if row.n == sizes[0])
        for power, name, style in ((1, "n (slope 1)", ":"), (2, "n^2 (slope 2)", "-")):
            axis.loglog(sizes, start * (np.array(sizes) / sizes[0]) ** power, color="grey", alpha=0.4, lw=3,
                        linestyle=style, zorder=0, label=name)
        crossing = where[backend]
        if crossing.n is not None:
            axis.axvline(crossing.n, color="black", linestyle=":", lw=1,
                         label=f"crossover n = {crossing.n:.0f}")
        axis.set_xticks(sizes, [str(size) for size in sizes], rotation=45)
        axis.minorticks_off()
        axis.grid(True, which="major", alpha=0.3)
        axis.legend(fontsize=7, loc="upper left")
        axis.set(title=f"{backend}: causal, d = {E}, B = H = 1", xlabel="n = L = S", ylabel="median ms")
    figure.savefig(path, dpi=110)
