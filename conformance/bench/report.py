"""`python -m conformance compare`: which backend is faster for my shapes, how far the readable (explicit)
path is from the fast one, and how the cost grows with the sequence length.

This module is the command line and what it prints: the table, the targets, the machine, the plot and the
JSON. What is timed and how (the candidates, the interleaving, the FLOPs, the rows) is bench/timing.py; the
variants (--variant) are declared in bench/variants.py, the decode benchmark (--decode) in bench/decode.py, the
serving benchmark (--variant serve) in bench/batching.py, latent attention's decode step (--variant mla) in
bench/latent.py, the complexity table (--complexity) in bench/complexity.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from ..cli import names_of, positive_int, positive_ints
from ..frameworks.registry import BUILT_IN, NUMPY, TORCH, framework_of
from . import batching, cluster, complexity, decode, latent, memory, ring, ring_torch, timing, variants
from .columns import columns

FOOTNOTE = """\
time: median of the repeats after one warm-up call; the candidates of one framework, operation and L run
  interleaved (A, B, A, B, ...). JAX: jit-compiled beforehand, timed to block_until_ready; torch: under
  inference_mode (on CUDA: synchronized).
GFLOP/s: matrix-product FLOPs / median time: sdpa 4 B H L S E; mha adds 4 projections of 2 B L D^2 (S = L);
  block adds the feed-forward network, 2 * 2 B L D F. TFLOP/s (1000 GFLOP/s) when any row ran on CUDA; the
  JSON rows keep gflops.
peak MiB: memory allocated by one call at its peak (temporaries and output; inputs and weights excluded).
  NumPy: tracemalloc; torch on CUDA: the allocator's peak; JAX on CUDA: XLA's compiled memory plan (temporaries
  + output; JAX's allocator keeps no peak that can be reset). "-": not measurable: torch and JAX on the CPU
  (XLA:CPU runs fused attention in a library whose scratch memory its plan does not see).
rel. error: max|a - b| / max|b| against attention_np's explicit path in float64, same inputs, weights and
  keywords (gqa: enable_gqa=True; window: is_causal=True with or without the window).
explicit: our backend with need_weights=True; the bare name is need_weights=False (the fast path).
torch built-in: F.scaled_dot_product_attention, nn.MultiheadAttention(batch_first=True) called with
  need_weights=False, nn.TransformerEncoderLayer(batch_first=True) in eval mode. numpy tutorial, jax plain,
  jax.nn.dot_product_attention: for mha and block, the plain projections and FFN of conformance/bench/baselines.py
  around that attention; "jax.nn.dot_product_attention cudnn" (bfloat16 on CUDA): with implementation="cudnn".
  bfloat16 skips the NumPy candidates (NumPy has no bfloat16 arithmetic).
--variant gqa: enable_gqa=True, H=32 query heads on Hkv=8; "torch built-in" is F.scaled_dot_product_attention(
  enable_gqa=True), "repeat_interleave" and "np.repeat" repeat k and v to H heads inside the timed call, "jax plain"
  is the grouped einsum formulation. --variant window: "window" is is_causal=True with window=(256, 0), "causal"
  is_causal=True alone, both fast paths; FLOPs counted as for full attention in both. --variant long: "flash" is
  flash_attention at its default tiles (block_q, block_k None), "gradient" flash_attention_vjp and its pullback (the
  forward and the backward pass), "causal" with is_causal=True; the untiled rows only where the float32 scores fit
  in 1 GiB; FLOPs counted as for full attention; errors against attention_np.flash_attention in float64.
--variant flex: "flex" is flex_attention with the mask's block mask (BLOCK_SIZE 128), "dense" the fast path
  (need_weights=False) with the mask as a boolean (L, S) array, "torch compiled flex" torch.compile(torch's
  flex_attention) with its own block mask, compiled in the warm-up call; "window" a causal sliding window of 256,
  "document" 8 equal documents; FLOPs counted as for full attention; errors against attention_np.flash_attention in
  float64 with the dense mask."""


DECODE_FOOTNOTE = """\
decode ms: the loop of T one-token extend calls after the prefill (need_weights=False), median over the repeats
  after one warm-up loop; tokens/s = T / those seconds. prefill ms: the one extend of P positions before it.
recompute s: the full causal pass block(x[:, :p], causal_mask(p, p), need_weights=False) for each new token,
  p = P+1 .. P+T: every 32nd p timed (and the last), median over the repeats, the rest interpolated linearly
  and summed (the trapezoid rule); speed-up = recompute / decode. The last pass equals the last step (1e-4).
jit traces: JAX's jitted extend traced (and compiled) once per input length: prefill (L=P) / step (L=1).
torch pieces: the same step from nn.Linear, nn.RMSNorm, a preallocated cache written in place and
  F.scaled_dot_product_attention(enable_gqa=True); max|diff|: its T outputs against ours, checked <= 1e-4
  before timing; its loops run interleaved with ours."""


SERVE_FOOTNOTE = """\
continuous: requests join free slots as the pool admits them and leave as they finish, every step, through paged
  caches of the positions of static's padded cache (the joining prompts one ragged chunk, the others' new tokens
  another). static: batches of slots requests in arrival order, each padded to its longest prompt, a contiguous
  cache, every request stepping until the batch's longest is done.
  recompute: no cache, one request at a time, a causal pass over the whole sequence per new token.
steps: calls of the layers on a chunk (recompute: its passes). tokens/s: the generated tokens / the median seconds;
  the three run in turns, after a check that they generate the same tokens for every request.
positions: at the step whose pool holds the most pages, pages in use x page_size against the positions the live
  requests hold then (held), and against a padded contiguous cache of slots x the longest total."""


MLA_FOOTNOTE = """\
ms/token: one extend of one position over the cache of S - 1 (need_weights=False); each (backend, form) runs turns of
  the config's steps, all in turn, rounds after a warm-up round; the median over the rounds. MFLOP: the step's
  matrix products that grow with S (expanded: kv_b_proj over the S latents and H heads of attention; absorbed:
  multi-query attention over the latents, the weights folded into the query and the output).
max|diff|: the absorbed step's output against the expanded one's, checked <= 1e-3 before timing."""


# --- the tables, the machine and the plot --------------------------------------------------------------


def format_table(rows: Sequence[timing.Row]) -> str:
    """One line per row, grouped by operation and L; the rate in TFLOP/s when any row ran on CUDA (GPU rates
    run to hundreds of thousands of GFLOP/s), in GFLOP/s otherwise."""
    on_gpu = any(row.device == "cuda" for row in rows)
    unit, per_unit, decimals = ("TFLOP/s", 1000, 2) if on_gpu else ("GFLOP/s", 1, 1)
    header = ("implementation", "operation", "variant", "L", "time ms", unit, "peak MiB", "rel. error")
    lines, last = [header], None
    for row in rows:
        if last is not None and (row.operation, row.L) != last:
            lines.append(())
        last = (row.operation, row.L)
        peak = "-" if row.peak_mib is None else f"{row.peak_mib:.1f}"
        rate = f"{row.gflops / per_unit:.{decimals}f}"
        lines.append((row.implementation, row.operation, row.variant, str(row.L), f"{row.time_ms:.2f}", rate, peak,
                      f"{row.rel_error:.1e}"))
    return columns(lines, right=(3, 4, 5, 6, 7))


def format_decode(rows: Sequence[decode.DecodeRow]) -> str:
    """One line per backend: prefill, decode (ms/token and tokens/s), the estimated recompute and the
    speed-up, JAX's traces and the torch pieces (timed in turns with ours: bench/decode.py)."""
    header = ("backend", "prefill ms", "decode ms", "ms/token", "tokens/s", "recompute s", "speed-up",
              "jit traces", "in turns: ours / pieces ms/token", "max|diff|")
    lines = [header]
    for row in rows:
        T = row.tokens_per_s * row.decode_ms / 1e3  # the steps
        traces = "-" if row.step_compiles is None else f"{row.prefill_compiles} / {row.step_compiles}"
        pieces = "-" if row.pieces_ms is None else f"{row.turns_ms / T:.3f} / {row.pieces_ms / T:.3f}"
        error = "-" if row.pieces_error is None else f"{row.pieces_error:.1e}"
        lines.append((row.backend, f"{row.prefill_ms:.1f}", f"{row.decode_ms:.1f}", f"{row.decode_ms / T:.3f}",
                      f"{row.tokens_per_s:.0f}", f"{row.recompute_ms / 1e3:.2f}", f"{row.speedup:.1f}", traces,
                      pieces, error))
    return columns(lines, right=tuple(range(1, 10)))


def format_serve(rows: Sequence[batching.MethodRow], ratios: Sequence[timing.Ratio]) -> str:
    """One line per method (tokens, steps, seconds, tokens/s), then one per ratio with its target and verdict."""
    methods = [("method", "tokens", "steps", "seconds", "tokens/s")]
    methods += [(row.method, str(row.tokens), str(row.steps), f"{row.seconds:.3f}", f"{row.tokens_per_s:.0f}")
                for row in rows]
    return columns(methods, right=(1, 2, 3, 4)) + "\n\n" + format_ratios(ratios, values=0, measured=2)


def format_mla(rows: Sequence[latent.FormRow], ratios: Sequence[timing.Ratio]) -> str:
    """One line per backend and form (ms/token, MFLOP, max|diff|), then one per ratio with its target and verdict."""
    forms = [("backend", "form", "S", "MFLOP", "ms/token", "max|diff|")]
    forms += [(row.backend, row.form, str(row.context), f"{row.mflops:.1f}", f"{row.ms_per_token:.3f}",
               f"{row.max_diff:.1e}") for row in rows]
    return columns(forms, right=(2, 3, 4, 5)) + "\n\n" + format_ratios(ratios, values=3, measured=3)


def format_ratios(ratios: Sequence[timing.Ratio], *, values: int, measured: int) -> str:
    """One line per ratio: what is compared, its two values and the ratio (to `values` and `measured` decimals),
    its target and MET or MISSED ("-" without a target)."""
    lines = [("compared", "values", "measured", "target", "verdict")]
    for ratio in ratios:
        target = "-" if ratio.bound is None else f"{ratio.relation} {ratio.bound:g}"
        lines.append((f"{ratio.compared}: {ratio.numerator} / {ratio.denominator}",
                      f"{ratio.numerator_value:.{values}f} / {ratio.denominator_value:.{values}f}",
                      f"{ratio.measured:.{measured}f}", target, {None: "-", True: "MET", False: "MISSED"}[ratio.met]))
    return columns(lines, right=(1, 2))


def format_targets(rows: Sequence[timing.TargetRow]) -> str:
    """One line per target: what is compared, the two values, the value measured, its target and MET or
    MISSED ("-" for a ratio shown without a target)."""
    header = ("framework", "operation", "variant", "L", "compared", "values", "measured", "target", "verdict")
    lines = [header]
    for row in rows:
        comparison = timing.COMPARISONS[row.compared]
        names = f" {comparison.symbol} ".join(_display(name, row.operation)
                                              for name in (row.numerator, row.denominator))
        values = f"{row.numerator_value:.2f} {comparison.symbol} {row.denominator_value:.2f} {comparison.unit}"
        target = "-" if row.bound is None else f"{row.relation} {comparison.shown.format(row.bound)}"
        verdict = {None: "-", True: "MET", False: "MISSED"}[row.met]
        lines.append((row.framework, row.operation, row.variant, str(row.L), names, values,
                      comparison.shown.format(row.measured), target, verdict))
    return columns(lines, right=(3, 5, 6))


def machine(backends: dict[str, ModuleType]) -> list[str]:
    """The machine and the framework versions, one line each (NumPy always: the reference runs in it)."""
    frameworks = {framework.name: framework for framework in (NUMPY, *map(framework_of, backends.values()))}
    return [f"machine: {os.cpu_count()} CPUs, {platform.machine()} {platform.system()}, "
            f"Python {platform.python_version()}", *(framework.describe() for framework in frameworks.values())]


def plot(rows: Sequence[timing.Row], path: str) -> None:
    """PNG, one line of panels per operation: time vs L on log-log axes, each line's fitted slope in the
    legend (2 is quadratic, drawn as a grey guide), the relative error vs L in the same styles, and where any
    peak was measured (NumPy's), the peak memory vs L, slopes likewise (1 is linear: tiles; 2: the scores)."""
    Figure = _figure_class()
    operations = list(dict.fromkeys(row.operation for row in rows))
    peaks = any(row.peak_mib is not None for row in rows)
    figure = Figure(figsize=(13 + 6 * peaks, 4.5 * len(operations)), layout="constrained")
    axes = figure.subplots(len(operations), 2 + peaks, squeeze=False)
    for (time_axis, error_axis, *memory_axis), operation in zip(axes, operations, strict=True):
        mine = [row for row in rows if row.operation == operation]
        variant = mine[0].variant  # one run, one variant
        sizes, starts = sorted({row.L for row in mine}), []
        for name in dict.fromkeys(row.implementation for row in mine):
            line = [row for row in mine if row.implementation == name]
            lengths, ms = np.array([row.L for row in line]), np.array([row.time_ms for row in line])
            style = _style(name, line[0].framework)
            time_axis.loglog(lengths, ms, label=name + _slope(lengths, ms), **style)
            error_axis.loglog(lengths, [max(row.rel_error, 1e-17) for row in line], **style)
            starts.append(ms[0])
            measured = [row for row in line if row.peak_mib]
            if memory_axis and measured:
                lengths, mib = np.array([row.L for row in measured]), np.array([row.peak_mib for row in measured])
                memory_axis[0].loglog(lengths, mib, label=name + _slope(lengths, mib), **style)
        time_axis.loglog(sizes, np.median(starts) * (np.array(sizes) / sizes[0]) ** 2, color="grey", alpha=0.4, lw=3,
                         zorder=0, label="L^2 (slope 2)")
        errors = [max(row.rel_error, 1e-17) for row in mine]
        error_axis.set_ylim(10 ** math.floor(math.log10(min(errors))), 10 ** math.ceil(math.log10(max(errors))))
        for axis in (time_axis, error_axis, *memory_axis):
            axis.set_xticks(sizes, [str(size) for size in sizes])
            axis.minorticks_off()
            axis.grid(True, which="major", alpha=0.3)
        time_axis.legend(fontsize=7, loc="upper left")
        time_axis.set(title=f"{operation} ({variant} variant): median time", xlabel="L = S", ylabel="ms")
        error_axis.set(title=f"{operation} ({variant}): relative error vs the float64 reference (styles as on "
                             "the left)",
                       xlabel="L = S", ylabel="max|a - b| / max|b| (0 drawn at 1e-17)")
        if memory_axis:
            memory_axis[0].legend(fontsize=7, loc="upper left")
            memory_axis[0].set(title=f"{operation} ({variant}): peak memory of one call (NumPy, tracemalloc)",
                               xlabel="L = S", ylabel="MiB")
    figure.savefig(path, dpi=110)


def _slope(lengths: np.ndarray, values: np.ndarray) -> str:
    """" (slope s)": the exponent of a power law fitted on log-log axes, where there are two points or more."""
    return f" (slope {np.polyfit(np.log(lengths), np.log(values), 1)[0]:.2f})" if len(lengths) > 1 else ""


# our own lines by what follows the backend's name: solid the fast path (or the variant's subject, the window),
# dashed the explicit path, dash-dotted full causal attention beside the window; anything else is a baseline
_OUR_LINES = {"": {"linestyle": "-", "marker": "o"}, "window": {"linestyle": "-", "marker": "o"},
              "flash": {"linestyle": "-", "marker": "o"}, "flash causal": {"linestyle": "-.", "marker": "o"},
              "flash gradient": {"linestyle": "--", "marker": "v"}, "flash causal gradient": {"linestyle": "--",
                                                                                            "marker": "v"},
              "explicit": {"linestyle": "--", "marker": "s", "markersize": 4},
              "causal": {"linestyle": "-.", "marker": "D", "markersize": 4}}


def _style(name: str, framework: str) -> dict[str, Any]:
    """A colour per framework; our paths as _OUR_LINES says, a baseline dotted."""
    color = {"numpy": "tab:blue", "torch": "tab:red", "jax": "tab:green"}.get(framework, "tab:grey")
    if name.startswith("jax.nn.dot_product_attention"):
        color = "tab:olive" if name == "jax.nn.dot_product_attention" else "tab:cyan"
    backend, _, path = name.partition(" ")
    if backend in BUILT_IN and path in _OUR_LINES:
        return {"color": color, **_OUR_LINES[path]}
    return {"color": color, "linestyle": ":", "marker": "^"}


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure  # a bare Figure: no pyplot, no global backend change
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'attention-reference[plot]'") from None
    return Figure


def _display(name: str, operation: str) -> str:
    """A label as the targets show it: "torch built-in" names the built-in of that operation."""
    return f"torch {TORCH.built_ins[operation]}" if name == "torch built-in" else name


# --- the command line ----------------------------------------------------------------------------------

BACKENDS = {"numpy": "attention_np", "jax": "attention_jax", "torch": "attention_torch"}  # --backends' short names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m conformance compare`."""
    parser.add_argument("--sizes", type=positive_ints, default=None, metavar="L,L,...",
                        help=f"sequence lengths L = S (default {','.join(map(str, timing.SIZES))}; long: "
                             f"{','.join(map(str, variants.LONG.sizes))})")
    parser.add_argument("--operations", type=names_of("operations", lambda: timing.OPERATIONS), default=None,
                        metavar="OP,...",
                        help="any of sdpa,mha,block (default: all three; gqa and window: sdpa only)")
    parser.add_argument("--variant", choices=(*variants.VARIANTS, "serve", "mla"), default="plain",
                        help="plain (default); gqa: grouped-query attention, H=32 query heads on 8 key/value "
                             "heads; window: is_causal with window=(256, 0) beside full causal (B=1); long: "
                             "flash_attention, its gradient and the untiled paths, B=1, H=1, up to L=32768; flex: "
                             "flex_attention with block masks (a causal window of 256, 8 documents) against the "
                             "dense mask and torch's compiled flex_attention, B=1, L=S=4096 (CPU); serve: "
                             "continuous batching through the paged cache against static batching with padding "
                             "and recomputing, one stream, a tiny Llama in NumPy (bench/batching.py; takes "
                             "--requests, --repeats (default 3), --json); mla: multi-head latent attention's decode "
                             "step over 4096 positions, absorbed against expanded, every backend (bench/latent.py; "
                             "takes --repeats (default 5), --json)")
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32",
                        help="float32 (default), float64, or bfloat16 (torch and JAX only)")
    parser.add_argument("--repeats", type=positive_int, default=None, metavar="N",
                        help="timed calls per candidate (default 10; --decode: timed loops and passes, default 5)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: torch and JAX on the GPU where they see one (NumPy stays on the CPU)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help='also write {"machine": [lines], "rows": [{key: value}]} as JSON')
    parser.add_argument("--plot", default=None, metavar="PATH.png",
                        help="time and error vs L; needs matplotlib: pip install 'attention-reference[plot]'")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--targets", action="store_true",
                        help="only the performance targets of the variant (plain: float32, B=2, H=8, L=S=1024, "
                             "E=64; gqa: H=32, Hkv=8; window: its ratios at L=S=4096, no targets; flex: "
                             "L=S=4096, every backend and torch's compiled flex_attention interleaved); ignores "
                             "--sizes, --operations and --dtype")
    parser.add_argument("--decode", action="store_true",
                        help="the decode benchmark (bench/decode.py): one Llama-style block, a prefill of --prefill "
                             "positions, then --tokens one-token steps with the cache, against recomputing the "
                             "full causal pass per token; torch also against a step from torch.nn pieces "
                             "(float32, CPU; ignores --sizes, --operations, --variant, --dtype, --device, --plot)")
    parser.add_argument("--memory", action="store_true",
                        help="the memory targets of tiled attention (bench/memory.py): flash_attention and its "
                             f"gradient at B=1, H=1, L=S={memory.L}, E={memory.E}, float32, each backend measured "
                             f"its own way; with --variant flex: flex_attention at H={memory.FLEX_HEADS} with the "
                             "document mask (ignores the other options)")
    parser.add_argument("--ring", action="store_true",
                        help="ring attention (SPEC 2d): JAX's memory per device and bytes per hop on 8 simulated "
                             "devices, torch's in 1, 2 and 4 gloo processes, and the model for H100 clusters "
                             "(--plot: the model's figure); ignores the other options")
    parser.add_argument("--complexity", action="store_true",
                        help="the tutorial's complexity table measured (bench/complexity.py): causal softmax "
                             "attention (explicit, fast, flash_attention), linear attention (parallel, chunked) "
                             "and the recurrent step loop against n (default 64..32768), d=64, B=1, H=1, float32; "
                             "log-log slopes and the crossover n per backend (takes --sizes, --repeats (default 3), "
                             "--backends, --plot, --json)")
    parser.add_argument("--backends", type=names_of("backends", lambda: BUILT_IN, aliases=BACKENDS), default=None,
                        metavar="NAME,...",
                        help="--complexity: any of numpy,jax,torch (default: every installed backend)")
    parser.add_argument("--requests", type=positive_int, default=batching.Config().requests, metavar="N",
                        help=f"--variant serve: the requests of the stream (default {batching.Config().requests})")
    parser.add_argument("--prefill", type=positive_int, default=decode.PREFILL, metavar="N",
                        help=f"--decode: the prompt's positions P (default {decode.PREFILL})")
    parser.add_argument("--tokens", type=positive_int, default=decode.TOKENS, metavar="N",
                        help=f"--decode: the decode steps T (default {decode.TOKENS})")


def main(args: argparse.Namespace) -> int:
    """Run `python -m conformance compare` with parsed arguments; 0 unless it could not run (the verdicts
    of --targets do not set the exit code: timings are noisy)."""
    if args.decode:
        return decode_main(args)
    if args.variant == "serve":  # not a timing.Variant of attention calls: a stream served three ways
        return serve_main(args)
    if args.variant == "mla":  # one decode step of MultiHeadLatentAttention in two forms
        return mla_main(args)
    if args.memory:
        return memory_main(args.variant)
    if args.ring:
        return ring_main(args.plot)
    if args.plot:  # before anything is timed
        try:
            _figure_class()
        except ImportError as error:
            print(f"compare: {error}", file=sys.stderr)
            return 2
    if args.complexity:
        return complexity_main(args)
    args.repeats = args.repeats or 10
    variant = variants.VARIANTS[args.variant]
    operations = args.operations or variant.operations
    if not set(operations) <= set(variant.operations):
        print(f"compare: --variant {variant.name} times {','.join(variant.operations)} only", file=sys.stderr)
        return 2
    backends, skipped = timing.installed_backends()
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    try:
        devices = timing.placement(backends, args.device)
    except ValueError as error:
        print(f"compare: {error}", file=sys.stderr)
        return 2
    progress = not args.quiet  # drawn only where stderr is a terminal
    ratios: list[timing.TargetRow] = []
    with timing.pinned(backends) as settings:
        print("\n".join(machine(backends)))
        print("; ".join(settings) or "no precision settings")
        print("placement: " + ", ".join(f"{kind} on {device}" for kind, device in devices.items()))
        if args.targets:
            print(f"targets ({variant.name}): float32, {variant.describe(**(variant.target_dims or variant.dims))}, "
                  f"L=S={variant.target_L}, "
                  f"need_weights=False; {args.repeats} interleaved repeats, medians\n")
            result: Sequence[Any] = timing.targets(repeats=args.repeats, device=args.device, variant=variant,
                                                      backends=backends, progress=progress)
            print(format_targets(result))
        else:
            print(f"{args.dtype}, {variant.describe(**variant.dims)}, L = S ({variant.name}); {args.repeats} repeats "
                  "per candidate, interleaved, medians\n")
            result = timing.compare(sizes=args.sizes or variant.sizes, operations=operations, dtype=args.dtype,
                                       repeats=args.repeats, device=args.device, variant=variant, backends=backends,
                                       progress=progress)
            print(format_table(result) + "\n\n" + FOOTNOTE)
            ratios = timing.ratios(result, variant)
            if ratios:
                print("\nside by side, from the table's medians:\n" + format_targets(ratios))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine(backends), "variant": variant.name,
                       "rows": [row._asdict() for row in result], "ratios": [row._asdict() for row in ratios]},
                      file, indent=1)
    if args.plot and not args.targets:
        plot(result, args.plot)
        print(f"\nplot written to {args.plot}")
    return 0


def memory_main(variant: str = "plain") -> int:
    """`compare --memory`: flash_attention's memory against the targets (with --variant flex, flex_attention's);
    0 unless it could not run."""
    backends, skipped = timing.installed_backends()
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    with timing.pinned(backends):
        print("\n".join(machine(backends)))
        if variant == "flex":
            print(f"flex_attention at B=1, H={memory.FLEX_HEADS}, L=S={memory.L}, E={memory.E}, float32, "
                  f"{variants.DOCUMENTS} equal documents, block mask of BLOCK_SIZE {variants.FLEX_BLOCK}\n")
            print(memory.format_rows(memory.measure_flex(backends)))
        else:
            print(f"flash_attention at B=1, H=1, L=S={memory.L}, E={memory.E}, float32, its default tiles\n")
            print(memory.format_rows(memory.measure(backends)))
    return 0


def ring_main(plot_path: str | None) -> int:
    """`compare --ring`: ring attention measured on simulated devices and processes, and modelled on clusters."""
    backends, _ = timing.installed_backends()
    print("\n".join(machine(backends)) + "\n")
    if "attention_jax" in backends:
        print(ring.format_tables(ring.memory_rows(), ring.communication_rows()) + "\n")
    if "attention_torch" in backends:
        print(ring_torch.format_rows(ring_torch.measure()) + "\n")
    print("the model (conformance/bench/cluster.py): H100s, B=1, H=32, Hkv=8, E=128, bf16\n"
          + cluster.format_table(cluster.table()))
    if plot_path:
        cluster.plot(plot_path)
        print(f"\nplot written to {plot_path}")
    return 0


def complexity_main(args: argparse.Namespace) -> int:
    """`compare --complexity`: the forms' medians, the tutorial's table beside the measured slopes, the crossover
    per backend; 0 unless it could not run."""
    backends, skipped = timing.installed_backends()
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if args.backends:
        missing = [name for name in args.backends if name not in backends]
        if missing:
            print(f"compare: --backends {','.join(missing)}: not installed here", file=sys.stderr)
            return 2
        backends = {name: backends[name] for name in args.backends}
    sizes, repeats = args.sizes or complexity.SIZES, args.repeats or 3
    print("\n".join(machine(backends)))
    print(complexity.describe(sizes, repeats) + "\n")
    rows = complexity.run(backends, sizes=sizes, repeats=repeats)
    print(complexity.format_rows(rows) + "\n")
    print(f"the tutorial's table beside the measured one: time ~ n^slope, least squares on log-log axes over "
          f"n >= {complexity.FIT_FROM} (the two largest n where fewer ran)\n" + complexity.format_table(rows) + "\n")
    print(complexity.format_crossovers(rows))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine(backends), "variant": "complexity", "sizes": list(sizes),
                       "rows": [row._asdict() for row in rows],
                       "fits": [fit._asdict() for fit in complexity.fits(rows)],
                       "crossovers": [found._asdict() for found in complexity.crossovers(rows)]}, file, indent=1)
    if args.plot:
        complexity.plot(rows, args.plot)
        print(f"\nplot written to {args.plot}")
    return 0


def decode_main(args: argparse.Namespace) -> int:
    """`compare --decode`: the decode table, its targets and the JAX step's compile count; 0 unless it could
    not run (the verdicts do not set the exit code)."""
    backends, skipped = timing.installed_backends()
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    config = decode.Config(prefill=args.prefill, tokens=args.tokens, repeats=args.repeats or 5)
    with timing.pinned(backends) as settings:
        print("\n".join(machine(backends)))
        print("; ".join(settings) or "no precision settings")
        print(decode.describe(config) + "\n")
        rows, targets = decode.run(config, backends)
    print(format_decode(rows) + "\n\n" + DECODE_FOOTNOTE + "\n")
    print("targets: speed-up over recomputing >= 20 (recompute / decode); torch: ours / pieces <= 1.2\n"
          + format_targets(targets))
    compiled = decode.compiles_met(rows)
    if compiled is not None:
        counts = ", ".join(f"{row.backend} {row.step_compiles}" for row in rows if row.step_compiles is not None)
        print(f"\njax compiles of the decode step over all {args.tokens} steps: {counts} (target 1): "
              + ("MET" if compiled else "MISSED"))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine(backends), "variant": "decode", "config": config._asdict(),
                       "rows": [row._asdict() for row in rows], "targets": [row._asdict() for row in targets]},
                      file, indent=1)
    return 0


def serve_main(args: argparse.Namespace) -> int:
    """`compare --variant serve`: tokens/s of continuous batching, static batching and recomputing on one stream,
    their ratios and the pages' memory, side by side from one run; 0 (the verdicts do not set the exit code)."""
    config = batching.Config(requests=args.requests, repeats=args.repeats or batching.Config().repeats)
    print("\n".join(machine({})))
    print(batching.describe(config) + "\n")
    rows, ratios, _ = batching.run(config)
    print(format_serve(rows, ratios) + "\n\n" + SERVE_FOOTNOTE)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine({}), "variant": "serve",
                       "config": config._asdict(), "rows": [row._asdict() for row in rows],
                       "ratios": [ratio._asdict() for ratio in ratios]}, file, indent=1)
    return 0


def mla_main(args: argparse.Namespace) -> int:
    """`compare --variant mla`: latent attention's decode step, absorbed against expanded, on every backend, in
    turns; the ratios and their verdicts; 0 (the verdicts do not set the exit code)."""
    backends, skipped = timing.installed_backends()
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    config = latent.Config(repeats=args.repeats or latent.Config().repeats)
    with timing.pinned(backends) as settings:
        print("\n".join(machine(backends)))
        print("; ".join(settings) or "no precision settings")
        print(latent.describe(config) + "\n")
        rows, ratios = latent.run(config, backends)
    print(format_mla(rows, ratios) + "\n\n" + MLA_FOOTNOTE)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine(backends), "variant": "mla", "config": config._asdict(),
                       "rows": [row._asdict() for row in rows], "ratios": [ratio._asdict() for ratio in ratios]},
                      file, indent=1)
    return 0
