"""`python -m conformance docs`: the tables and counts that the documents show but the code holds (the registries
of the suite, the features, the rules; the measured matrix; the kernel example's counts; the low-precision
errors), each written between markers by one command and compared by the tests, so that no table mirrors the
code by hand and no typed number drifts:

    frameworks           the frameworks matrix: docs/frameworks.json (what `frameworks --json` measures), as markdown
    frameworks-versions  the frameworks' versions that the matrix was measured with
    kernel               the kernel example's counts: docs/checking.md's kernel module, checked by the suite
    low-precision        the errors in float16 and bfloat16, ours and the frameworks' (conformance/bench/precision.py)
    checks               the table of checks: every measure the suite reports, with the operations and dtypes that
                         its registries (conformance/run/suite.py GROUPS, MEASURES, FIXED_RUNS) give it, and what
                         it catches
    groups               the suite's groups (conformance/run/suite.py GROUPS, FIXED_RUNS, CONTRACT_RUNS)
    profiles             the profiles (conformance PROFILES)
    features             the features a module may declare it lacks (conformance/contract/features.py FEATURES)
    rules                the rules of the frameworks matrix (conformance/frameworks/disagreements.py RULES)
    adapter-layouts      the layouts `adapters.sdpa` takes (conformance/adapters.py LAYOUTS)
    adapter-masks        the mask polarities `adapters.sdpa` takes (conformance/adapters.py MASKS)
    serve                the serving benchmark's run recorded in docs/serve.json (`python -m conformance compare
                         --variant serve --json docs/serve.json` measures it; tests/test_serve.py recomputes every
                         cell that is not a time)
    mla                  latent attention's decode step recorded in docs/mla.json (`python -m conformance compare
                         --variant mla --json docs/mla.json`; tests/test_latent.py recomputes every cell that is
                         not a time or a difference)

A block sits between `<!-- generated: python -m conformance docs --write (NAME) -->` and
`<!-- end generated (NAME) -->`, in any of the documents (README.md, SPEC.md, docs/**/*.md); a name may appear in
several of them, at most once in each, and every occurrence is written and compared. `docs --write` measures (the
matrix: about as long as `frameworks`) and rewrites every block and docs/frameworks.json; `docs --check` measures
and says which blocks differ, and where (exit code 1).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from . import PROFILES, adapters
from .bench import precision
from .builtins import module_names
from .contract import fixed_cases
from .contract.features import FEATURES
from .contract.operations import OPERATIONS
from .frameworks import matrix
from .frameworks.registry import FRAMEWORKS

ROOT = Path(__file__).resolve().parent.parent  # a checkout: the docs are not in the wheel
README = ROOT / "README.md"
FRAMEWORKS_JSON = ROOT / "docs" / "frameworks.json"
SERVE_JSON = ROOT / "docs" / "serve.json"  # the serving benchmark's recorded run (compare --variant serve --json)
MLA_JSON = ROOT / "docs" / "mla.json"  # latent attention's decode step recorded (compare --variant mla --json)
CHECKING = Path("docs") / "checking.md"  # under the root: the page whose kernel module the `kernel` block counts

# the suite's row of the matrix: `check(module)` with these options, as docs/suite.md says: every fixed case of
# the fixed cases and one drawn case per group (the rows and their verdicts; more examples cost the tests more, not
# rows)
SUITE_OPTIONS: dict[str, Any] = {"max_examples": 1, "seed": 0}
# the kernel example's report: `python -m conformance check my_kernel` as its paragraph says, the fast profile
KERNEL_OPTIONS: dict[str, Any] = {"profile": "fast", "seed": 0}


# --- the documents and the blocks between markers ---------------------------------------------------------------

def documents(root: Path = ROOT) -> list[Path]:
    """The files a generated block may live in: README.md, SPEC.md and every docs/**/*.md under `root`."""
    return [path for path in (root / "README.md", root / "SPEC.md") if path.exists()] + sorted(
        (root / "docs").glob("**/*.md"))


def begin(name: str) -> str:
    return f"<!-- generated: python -m conformance docs --write ({name}) -->"


def end(name: str) -> str:
    return f"<!-- end generated ({name}) -->"


ANY_BEGIN = re.compile(re.escape(begin("NAME")).replace("NAME", "([^)]*)"))


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(begin(name)) + "(.*?)" + re.escape(end(name)), flags=re.DOTALL)


def names_in(text: str) -> list[str]:
    """The names of the blocks that `text` opens, in order (a name twice where it opens twice)."""
    return ANY_BEGIN.findall(text)


def shown(text: str, name: str) -> str:
    """The block `name` as `text` holds it; a KeyError where it has no such block, or more than one."""
    found = _pattern(name).findall(text)
    if len(found) != 1:
        raise KeyError(f"the text holds {len(found)} blocks {name!r}; expected one between {begin(name)!r} and "
                       f"{end(name)!r}")
    return _unwrapped(found[0])


def replaced(text: str, name: str, block: str) -> str:
    """`text` with the block `name` replaced by `block`."""
    shown(text, name)  # exactly one
    return _pattern(name).sub(lambda _: begin(name) + _wrapped(block) + end(name), text)


def _wrapped(block: str) -> str:
    """A table stands apart from its markers by blank lines (else markdown reads them into it); a phrase inline."""
    return f"\n\n{block}\n\n" if "\n" in block or block.startswith("|") else block


def _unwrapped(found: str) -> str:
    return found.strip("\n") if found.startswith("\n") else found


# --- frameworks: the recorded matrix ---------------------------------------------------------------------------

def frameworks_table(found: matrix.Matrix) -> str:
    return matrix.format_text(found, markdown=True)


def frameworks_versions(found: matrix.Matrix) -> str:
    return ", ".join(f"{name} {version}" for name, version in found.versions.items())


def measure_frameworks(*, jobs: int, done: Callable[[str], None] | None = None) -> matrix.Matrix:
    """Every built-in's rules and suite row, measured afresh (what docs/frameworks.json records)."""
    return matrix.run(module_names(), jobs=jobs, done=done, **SUITE_OPTIONS)


def recorded_column(column: dict[str, Any]) -> dict[str, Any]:
    """A column of docs/frameworks.json (matrix.to_json) without its timing: what a fresh measurement must equal."""
    return {name: value for name, value in column.items() if name != "seconds"}


# --- kernel: docs/checking.md's kernel module, checked ---------------------------------------------------------

PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", flags=re.DOTALL)  # a python block of a page: its code
KERNEL_FILE = re.compile(r"# (\w+)\.py: python -m conformance check \1\n")  # a python block that is a module


def kernel_source(text: str) -> tuple[str, str]:
    """(module name, code) of the python block of `text` (a page) that is a module to check."""
    for code in PYTHON_BLOCK.findall(text):
        if found := KERNEL_FILE.match(code):
            return found[1], code
    raise KeyError("the text has no python block starting '# NAME.py: python -m conformance check NAME'")


def kernel_module(text: str, directory: Path) -> ModuleType:
    """The page's kernel module, written to `directory` and imported from there."""
    name, code = kernel_source(text)
    (directory / f"{name}.py").write_text(code)
    sys.path.insert(0, str(directory))
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(directory))


def kernel_counts(report: Any) -> str:
    """What the page says of the kernel's report: the rows that pass and those that are SKIP."""
    passed, skipped = (sum(1 for row in report.rows if row.passed and not row.skipped),
                       sum(1 for row in report.rows if row.skipped))
    return f"{passed} rows pass, {skipped} are SKIP"


def check_kernel(text: str) -> Any:
    """The suite's report on the page's kernel module, with the fast profile (what its paragraph says)."""
    from . import check

    with tempfile.TemporaryDirectory() as directory:
        return check(kernel_module(text, Path(directory)), **KERNEL_OPTIONS)


# --- checks: the table of checks, from the suite's registries ---------------------------------------------------

class Guard(NamedTuple):
    """A row of the table of checks: measures (the report's check column) and what they catch. The row takes
    every operation whose groups report one of its measures (in `dtypes`, where given), but the operations that
    another row sharing a measure names (its `operations`)."""

    measures: tuple[str, ...]
    catches: str
    dtypes: tuple[str, ...] | None = None  # only the groups whose dtypes are among these
    operations: tuple[str, ...] | None = None  # only these operations (a row of their own)


def reported(profile: str = "thorough") -> list[tuple[str, str, tuple[str, ...]]]:
    """(measure, operation, dtypes) for everything `check` can report on a module that has the whole contract, in
    `profile` (the thorough one runs every group): each group's measures (MEASURES, those that need something of the
    operation or the framework only where it has it), each table's row per operation that has its cases, "call" and
    "deterministic" from every group."""
    from .contract import fixed_cases
    from .run import suite  # Hypothesis is imported only here

    found = []
    for group in (group for operation in OPERATIONS for group in suite.groups_of(operation, profile, None)):
        operation = OPERATIONS[group.operation]
        found += [(measure, group.operation, group.dtypes_in(profile, None)) for measure in suite.MEASURES[group.check]
                  if REPORTED_WHERE.get(measure, lambda _: True)(operation)]
        found += [(measure, group.operation, ("all",)) for measure in suite.ANY_GROUP]
    for fixed in suite.FIXED_RUNS:
        found += [(fixed.check, name, (fixed.dtype,)) for name in OPERATIONS if fixed_cases.rows(name, fixed.use)]
    found += [(fixed.check, name, (fixed.dtype,)) for name, fixed in suite.CONTRACT_RUNS.items()]
    return list(dict.fromkeys(found))


# measures that a check reports only where the operation has what they need (conformance/run/checks.py dropout,
# conformance/run/gradient_checks.py; tests/test_error_checks.py holds this to a report)
REPORTED_WHERE: dict[str, Callable[[Any], bool]] = {
    "mean": lambda operation: operation.dropout_sigma is not None,  # the spread of dropout's mean is known
    "masked_rows": lambda operation: operation.visible is not None,  # which keys a query sees is known
}
# measures that a check reports only where the module's framework has what they need
FRAMEWORK_MEASURES: dict[str, Callable[[Any], bool]] = {
    "no_autograd": lambda framework: framework.no_autograd is not None}


def guard_rows() -> list[tuple[Guard, list[str], list[str]]]:
    """(guard, its operations, its dtypes) for each of GUARDS, read off `reported()`."""
    cells = reported()
    named: dict[str, set[str]] = {}  # measure -> the operations that rows of their own take
    for guard in (guard for guard in GUARDS if guard.operations):
        for measure in guard.measures:
            named.setdefault(measure, set()).update(guard.operations)
    rows = []
    for guard in GUARDS:
        mine = [(operation, dtypes) for measure, operation, dtypes in cells if measure in guard.measures
                and (guard.dtypes is None or set(dtypes) <= set(guard.dtypes))
                and (operation in guard.operations if guard.operations else
                     not any(operation in named.get(measure, ()) for measure in guard.measures))]
        operations = list(dict.fromkeys(operation for operation, _ in mine))
        dtypes = list(dict.fromkeys(dtype for _, found in mine for dtype in found))
        rows.append((guard, operations, dtypes))
    return rows


def uncovered() -> list[tuple[str, str, tuple[str, ...]]]:
    """What `check` can report that no row of the table (or more than one) covers."""
    rows = guard_rows()
    return [(measure, operation, dtypes) for measure, operation, dtypes in reported()
            if sum(measure in guard.measures and operation in operations and set(dtypes) <= set(found)
                   for guard, operations, found in rows) != 1]


def checks_table() -> str:
    lines = ["| check | operations | dtypes | what it guards against |", "|---|---|---|---|"]
    for guard, operations, dtypes in guard_rows():
        only = [framework.name for framework in FRAMEWORKS.values()
                if all(FRAMEWORK_MEASURES.get(measure, lambda _: True)(framework) for measure in guard.measures)]
        where = f" ({', '.join(only)})" if len(only) < len(FRAMEWORKS) else ""
        lines.append(f"| {', '.join(f'`{m}`' for m in guard.measures)} | {', '.join(operations)}{where} | "
                     f"{', '.join(dtypes) or '-'} | {guard.catches} |")
    return "\n".join(lines)


BOTH, HALF = ("float32", "float64"), ("float16", "bfloat16")
GUARDS: tuple[Guard, ...] = (
    Guard(("values",), dtypes=BOTH,
          catches="any wrong number: transposed or swapped weights, inverted mask, wrong softmax axis, wrong scale,"
                  " dropped causal flag, wrong LayerNorm variance or eps, tanh-GELU, pre/post-LN mix-ups, missing "
                  "residuals, split heads interleaved; a tiled softmax that forgets to rescale (lengths up to 65 "
                  "drawn, S = 129 pinned); hidden scores filled with a constant (-1e4) instead of left out, found "
                  "by rows whose visible scores lie tens of thousands below zero; a row maximum taken before a bias"
                  " in the thousands; an RMSNorm that removes the mean, SwiGLU's gate and up swapped, grouped "
                  "key/value heads read as `h % Hkv`; SPEC 2a's keywords misread (a window off by one, key lengths "
                  "applied to the queries, a softcap after the bias that lets a -inf bias through, grouped heads "
                  "read as `h % Hkv` instead of `h // G`); MHA's linear heads (`attention=\"linear\"`) with phi = elu"
                  " instead of elu + 1, returning weights they do not form, or bidirectional where the call is "
                  "causal; also a wrong output shape or dtype, "
                  "and NaN where the oracle has a number (fully masked rows)"),
    Guard(("fast_path",), dtypes=BOTH,
          catches="a fused path (`need_weights=False`) that breaks a rule the explicit path keeps (a rank-1 mask or"
                  " a `q_offset` dropped): it is held to the oracle too, and must return `None` for the weights"),
    Guard(("weights_rows",), dtypes=BOTH,
          catches="weights that are not a distribution over the visible keys (rows sum to 1, fully masked rows to "
                  "0)"),
    Guard(("values", "fast_path", "weights_rows"), dtypes=HALF,
          catches="half precision computed in half precision: scores, softmax or value product in float16 instead "
                  "of float32 (SPEC.md section 2), held to what float32 arithmetic with half-precision storage "
                  "loses, in each of them that the framework has"),
    Guard(("permutation",),
          catches="masks or bias applied to the wrong key, keys and values misaligned; the block's self-attention "
                  "not equivariant"),
    Guard(("causal_prefix",),
          catches="causal attention that lets a position see later ones (bottom-right alignment, a leaky mask)"),
    Guard(("single_key",),
          catches="a query that sees one key must return exactly its value; no visible key must return zeros"),
    Guard(("reproducible", "varies"),
          catches="dropout that ignores the rng, or stays active / inactive in the wrong mode, on either path "
                  "(`need_weights` True or False)"),
    Guard(("rng_forms",),
          catches="an rng form the backend allows (NumPy: a Generator and an int seed; JAX: `jax.random.key` and "
                  "`jax.random.PRNGKey`; torch: a Generator and the global RNG after `torch.manual_seed`) that does"
                  " not reproduce from its seed, or does not change with another"),
    Guard(("mean",),
          catches="dropout without the 1 / (1 - p) rescale, or left out on the path without the weights: on both "
                  "paths the mean over 400 draws must lie within 6 sigma of the eval output"),
    Guard(("independent",),
          catches="dropout decisions that are not independent: one mask shared by the heads or the batch elements, "
                  "or two sites replaying one stream (an int seed handed to each): over 2000 pairs and more, every "
                  "two heads, batch elements, positions and every two of the block's four sites (attention weights, "
                  "activation, the two residual branches; the same entries in the order drawn) must drop together "
                  "at rate p^2 within 6 sigma, with every rng form"),
    Guard(("weights",),
          catches="weights returned after dropout instead of before"),
    Guard(("gradients",),
          catches="a wrong backward pass (a ring's dK, dV accumulators one hop short of home, its weights "
                  "recomputed against a block's own lse): every input's and parameter's directional derivative "
                  "(from the module's `vjp`) against central differences of the oracle, with every keyword of SPEC "
                  "2a (a grouped head's gradient averaged over its group instead of summed is caught); modules "
                  "without `vjp` are reported as skipped"),
    Guard(("gradient_values",),
          catches="a backward pass that loses more than a plain low-precision one: each gradient of the `vjp` in "
                  "float32, float16 and bfloat16 against the oracle's own float64 vjp, within ten times what that vjp "
                  "loses computed plainly in the dtype (P kept in bfloat16 for a float32 run is caught)"),
    Guard(("values", "lse"), operations=("flash",),
          catches="a tiled kernel's bugs (`flash_attention`, SPEC 2c), drawn with tiles of 1 to 7 against every "
                  "keyword: running sums not rescaled when the maximum grows, a last partial tile dropped, a partly"
                  " hidden tile skipped as if wholly hidden, the log-sum-exp without the maximum added back; `lse` "
                  "must be `-inf` exactly where a query sees no key"),
    Guard(("values", "lse"), operations=("ring",),
          catches="a ring's bugs (`ring_attention`, SPEC 2d) on P of 1 to 4 of the framework's devices, drawn with "
                  "chunks of 1 to 3 rows against every keyword: chunk pairs attended at local instead of global "
                  "positions, a step short (the last visiting block never attended), partial results added without "
                  "their log-sum-exp weights, the larger partial lse kept instead of their logaddexp, the zig-zag "
                  "layout not undone (`tests/implementations/broken_ring.py`); NumPy simulates the devices, JAX and"
                  " torch need 4 (`--devices 4`: JAX's CPU devices, torch's peer processes in a gloo group), else "
                  "the operation is SKIP"),
    Guard(("values",), operations=("linear",),
          catches="a linear attention's bugs (`linear_attention`, SPEC 2e) against a double sum over the keys each "
                  "query sees, drawn with every feature map, causal or not, chunks of 1 to 7 that do not divide L, "
                  "key lengths and eps up to 1: a prefix sum one key too far, the normaliser forgotten, a chunk's "
                  "own keys in the state it reads (counted twice), eps in the numerator, sums computed in float16 "
                  "(in half precision L = S = 512 with large q and k, where they overflow) "
                  "(`tests/implementations/broken_linear.py`); the update rules (gated, delta, gated_delta, with a "
                  "decay per head or per key dimension and a beta) against ONNX's recurrence one position at a time: "
                  "the chunked delta rules without the UT transform, a chunk's state handed on undecayed, the decay "
                  "after the update, beta on the key (`tests/implementations/broken_linear_rules.py`)"),
    Guard(("values", "lse"), operations=("flex",),
          catches="programmable attention's bugs (`flex_attention` with `create_block_mask`), drawn with the "
                  "catalogue's mask and score functions (parameters drawn, `and_masks` / `or_masks` of two or three), "
                  "tiles of 1 to 7 and grouped heads, against an oracle that calls the mods one query at a time: "
                  "q_idx and kv_idx swapped, a partial tile taken as full, the score function applied after the mask "
                  "(a softcap brings hidden keys back) or to unscaled scores, a block mask read off each tile's first "
                  "query row, ALiBi's distance of the wrong sign (`tests/implementations/broken_flex.py`)"),
    Guard(("values",), operations=("varlen",),
          catches="packed attention's bugs (`varlen_attention`, SPEC 2g) against a loop over the sequences, each one's "
                  "attention with q_offset = S_n - L_n, drawn with 0 to 4 sequences of 0 to 5 queries and keys apart "
                  "(empty ones, positions past the last boundary), grouped heads, every keyword and tiles of 2 or 3: "
                  "the last sequence dropped, causal aligned top-left inside each sequence, a query that sees the "
                  "first key of the next sequence (`tests/implementations/broken_varlen.py`)"),
    Guard(("steps",), operations=("linear",),
          catches="a recurrent form that breaks the invariant: `linear_attention_state` and `linear_attention_step`"
                  " through a causal sequence must give the causal forward's outputs, under every update rule (a "
                  "step that reads its state before adding the current key; the decay after the update, the delta "
                  "rule's beta on the key)"),
    Guard(("state_kept",), operations=("linear",),
          catches="a recurrent step that writes into the state it is given (`S += phi(k_t) v_t^T` in place) and "
                  "returns it: every output is right, but the caller's state has changed; each step's state must "
                  "hold after the call the bits a copy taken before it holds (JAX's arrays cannot change)"),
    Guard(("masked_rows",),
          catches="NaN or leaked gradient where no attention reaches: a query that sees no key, a key nobody sees, "
                  "must get exactly zero gradient"),
    Guard(("no_autograd",),
          catches="a `vjp` that fails, or gives other gradients, where the framework's autograd is off "
                  "(`torch.inference_mode()`)"),
    Guard(("errors",),
          catches="a silent wrong result or an unclear error: the fixed bad inputs (shapes, masks, dtypes, sizes,"
                  " state dicts, cotangents, negative windows, softcap <= 0, float or non-broadcasting `q_offset` "
                  "and `key_lengths`, query heads not a multiple of the key/value heads, sequences the ring's "
                  "devices do not divide) must raise the same exception type, naming the argument, on both paths "
                  "(SPEC.md section 10)"),
    Guard(("edge_cases",),
          catches="fully masked rows, heads and batch elements, no keys, no queries, a single key, logits in the "
                  "thousands (also across a ring's devices), visible scores below -1e9 (a masked fill with The "
                  "Annotated Transformer's constant), NaN and inf where visible and where hidden, key lengths 0, a "
                  "softcap with a -inf bias: the fixed cases on both paths, against the oracle and the "
                  "hand-derived rules each carries"),
    Guard(("call",),
          catches="a module that raises, returns something other than `(out, weights)`, or writes into the arrays "
                  "it is given (q, k, v, mask, bias, parameters), which must hold the same bits after every call"),
    Guard(("deterministic",),
          catches="a module that gives different results for the same inputs: a failing case that passes when run "
                  "again, or a `vjp` whose pullback gives other bits on the same call twice"),
    Guard(("round_trip",),
          catches="`asarray` or `to_numpy` that changes a dtype or a bit: every dtype of the module's framework "
                  "must come back as it went in"),
    Guard(("helpers",),
          catches="`causal_mask` (also with `q_offset`), `window_mask` or `padding_mask` off by one, of the wrong "
                  "shape or dtype: against the oracle's own construction"),
    Guard(("values", "fast_path", "weights_rows"), operations=("decode",),
          catches="a key/value cache that breaks the invariant: a block fed chunk by chunk through `init_cache` and"
                  " `extend` must give the rows of one causal pass (a cache whose length is not advanced, a query "
                  "placed at the chunk's start instead of after the cache, RoPE at the chunk's positions instead of"
                  " the sequence's, unfilled positions with weight); with ragged chunks and paged caches of shuffled "
                  "pages whose unused slots hold NaN, each sequence's rows against that sequence alone (a block table "
                  "read with the wrong page size, a padding slot read, RoPE at sequence 0's positions: "
                  "`tests/implementations/broken_paged.py`); through a streaming cache decoding past its slots, one "
                  "pass with the streaming mask, the weights in the cache's order (sinks evicted by the ring, the "
                  "ring read in slot order: `tests/implementations/broken_streaming.py`); with linear heads through "
                  "their recurrent state (a `LinearCache`), one causal pass and no weights (a chunk that starts from "
                  "zeros, a normaliser z not carried: `tests/implementations/broken_linear_decode.py`)"),
    Guard(("rope",),
          catches="`apply_rope` with the wrong layout (interleaved pairs for the half rotation), angle or dtype, "
                  "or angles computed in float16 (float16 and bfloat16 cases at positions near 4096): against the "
                  "oracle's rotation of each pair as a complex number"),
)


# --- the registries as tables -----------------------------------------------------------------------------------

def _names(names: tuple[str, ...] | list[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def groups_table() -> str:
    """conformance/run/suite.py's groups (one row each), then its tables of fixed cases (one row per operation that has
    cases of their use) and the rows every module gets (CONTRACT_RUNS)."""
    from .contract import fixed_cases
    from .run import suite  # Hypothesis is imported only here

    lines = ["| operation | check | measures | dtypes | cases (fast profile) | drawn with | needs |",
             "|---|---|---|---|---|---|---|"]
    for group in suite.GROUPS:
        cases = f"{group.examples}" + (" + the fixed examples (float64)" if group.pinned else "")
        dtypes = ", ".join(group.dtypes) + ("" if group.fast_dtypes is None else
                                            f" (fast profile: {', '.join(group.fast_dtypes) or 'none'})")
        drawn = ", ".join(f"`{name}={value!r}`" for name, value in (group.draw or {}).items()) or "-"
        needs = _names(group.needs + (("vjp",) if group.gradient else ())) or "-"
        measures = [_measure(measure) for measure in suite.MEASURES[group.check]
                    if REPORTED_WHERE.get(measure, lambda _: True)(OPERATIONS[group.operation])]
        lines.append(f"| {group.operation} | `{group.check.__name__}` | {', '.join(measures)} | "
                     f"{dtypes} | {cases} | {drawn} | {needs} |")
    for fixed in suite.FIXED_RUNS:
        operations = [name for name in OPERATIONS if fixed_cases.rows(name, fixed.use)]
        lines.append(f"| {', '.join(operations)} | `{fixed.run.__name__}` | `{fixed.check}` | {fixed.dtype} | "
                     f"the fixed cases' {fixed.use} rows | - | - |")
    for operation, fixed in suite.CONTRACT_RUNS.items():
        lines.append(f"| {operation} | - | `{fixed.check}` | {fixed.dtype} | its fixed cases | - | - |")
    return "\n".join(lines)


def _measure(name: str) -> str:
    """`name`, with the frameworks that report it where not every framework does."""
    only = [framework.name for framework in FRAMEWORKS.values() if FRAMEWORK_MEASURES.get(name, lambda _: True)(
        framework)]
    return f"`{name}`" + (f" ({', '.join(only)})" if len(only) < len(FRAMEWORKS) else "")


def profiles_table() -> str:
    lines = ["| profile | cases of each group |", "|---|---|"]
    lines += [f"| `{name}` | {'' if times == 1 else f'{times} x '}the group's examples"
              + (" (in the dtypes the group names for it)" if name == "fast" else "") + " |"
              for name, times in PROFILES.items()]
    return "\n".join(lines)


def features_table() -> str:
    lines = ["| feature | kind | the contract asks | for a module that lacks it |", "|---|---|---|---|"]
    lines += [f"| `{feature.name}` | {feature.kind} | {feature.asks} | {feature.without} |"
              for feature in FEATURES.values()]
    return "\n".join(lines)


def rules_table() -> str:
    """conformance/frameworks/disagreements.py's RULES: each with the first paragraph of its probe's docstring."""
    from .frameworks import disagreements as rules  # Hypothesis is imported only here

    lines = ["| rule | the spec | probed on (the first the module has) | the probe |", "|---|---|---|---|"]
    for rule in rules.RULES:
        probe = " ".join(inspect.getdoc(rule.probe).split("\n\n")[0].split())
        lines.append(f"| {rule.name} | {rule.spec} | {', '.join(rule.operations)} | {probe} |")
    return "\n".join(lines)


# q, k, v and the output; masks and bias; `q_offset` and `key_lengths` arrays, as each layout gives them to the
# kernel (tests/test_docs.py holds the keys to adapters.LAYOUTS)
LAYOUT_SHAPES: dict[str, tuple[str, str, str]] = {
    "BHLE": ("`(B, H, L, E)`", "`(B, H, L, S)`", "`(B, H)`"),
    "BLHE": ("`(B, L, H, E)` (FlashAttention's, jax.nn's)", "`(B, H, L, S)`", "`(B, H)`"),
    "NLE": ("`(N, L, E)`, N = B * H: the heads folded into the batch (no `enable_gqa`)", "`(N, L, S)`", "`(N,)`"),
}


def error_rows_table() -> str:
    """Every error row of the suite (conformance/contract/fixed_cases.py): the exception its bad call must raise
    and the words its message must contain, so that an implementer sees each of them."""
    lines = ["| operation | row | raised at | exception | the message contains |", "|---|---|---|---|---|"]
    for row in (row for row in fixed_cases.ROWS if row.use == "error"):
        words = ", ".join(f"`{word}`".replace("|", "\\|") for word in row.contains) or "-"
        lines.append(f"| {row.operation} | `{row.name}` | {row.stage} | `{row.error.__name__}` | {words} |")
    return "\n".join(lines)


def adapter_layouts_table() -> str:
    lines = ["| `layout` | q, k, v and the output as the kernel takes them | masks, bias | `q_offset`, "
             "`key_lengths` arrays |", "|---|---|---|---|"]
    lines += [f'| `"{layout}"` | {" | ".join(LAYOUT_SHAPES[layout])} |' for layout in adapters.LAYOUTS]
    return "\n".join(lines)


def adapter_masks_table() -> str:
    lines = ["| `mask` | the kernel's mask argument |", "|---|---|"]
    lines += [f'| `"{name}"` | {what} |' for name, what in adapters.MASKS.items()]
    return "\n".join(lines)


# --- serve: the serving benchmark's recorded run ---------------------------------------------------------------

def serve_record() -> dict[str, Any]:
    """docs/serve.json: what `compare --variant serve --json` wrote (machine, config, rows, ratios)."""
    return json.loads(SERVE_JSON.read_text())


def serve_table() -> str:
    """The recorded run as the command printed it: the machine, the stream, the methods and the ratios."""
    from .bench import batching, timing
    from .bench.report import format_serve

    record = serve_record()
    rows = [batching.MethodRow(**row) for row in record["rows"]]
    ratios = [timing.Ratio(**ratio) for ratio in record["ratios"]]
    lines = [*record["machine"], batching.describe(batching.Config(**record["config"])), "",
             format_serve(rows, ratios)]
    return "```\n" + "\n".join(lines) + "\n```"


# --- mla: latent attention's decode step, recorded -------------------------------------------------------------

def mla_record() -> dict[str, Any]:
    """docs/mla.json: what `compare --variant mla --json` wrote (machine, config, rows, ratios)."""
    return json.loads(MLA_JSON.read_text())


def mla_table() -> str:
    """The recorded run as the command printed it: the machine, the configuration, the forms and the ratios."""
    from .bench import latent, timing
    from .bench.report import format_mla

    record = mla_record()
    rows = [latent.FormRow(**row) for row in record["rows"]]
    ratios = [timing.Ratio(**ratio) for ratio in record["ratios"]]
    lines = [*record["machine"], latent.describe(latent.Config(**record["config"])), "", format_mla(rows, ratios)]
    return "```\n" + "\n".join(lines) + "\n```"


# --- the command ------------------------------------------------------------------------------------------------

BLOCKS = ("frameworks", "frameworks-versions", "kernel", "low-precision", "checks", "groups", "profiles", "features",
          "rules", "error-rows", "adapter-layouts", "adapter-masks", "serve", "mla")
# the blocks read off the registries (and the serving benchmark's record) alone, without measuring anything
REGISTRY_TABLES: dict[str, Callable[[], str]] = {
    "checks": checks_table, "groups": groups_table, "profiles": profiles_table, "features": features_table,
    "rules": rules_table, "error-rows": error_rows_table, "adapter-layouts": adapter_layouts_table,
    "adapter-masks": adapter_masks_table, "serve": serve_table, "mla": mla_table}


def generated(found: matrix.Matrix, kernel_report: Any, low_precision: str) -> dict[str, str]:
    """Every block, from the measured matrix, the kernel's report, the low-precision errors and the registries."""
    return {"frameworks": frameworks_table(found), "frameworks-versions": frameworks_versions(found),
            "kernel": kernel_counts(kernel_report), "low-precision": low_precision,
            **{name: table() for name, table in REGISTRY_TABLES.items()}}


def differences(text: str, blocks: dict[str, str]) -> list[str]:
    """The names of the blocks that `text` holds whose text is not the generated one."""
    return [name for name in names_in(text) if name in blocks and shown(text, name) != blocks[name]]


def unknown(text: str) -> list[str]:
    """The names of blocks that `text` opens but the command does not generate, or opens more than once."""
    names = names_in(text)
    return [name for name in dict.fromkeys(names) if name not in BLOCKS or names.count(name) > 1]


def run(*, write: bool, jobs: int, done: Callable[[str], None] | None = None, root: Path = ROOT,
        record: Path | None = None) -> list[str]:
    """Measure every block; with `write`, rewrite every document's blocks and docs/frameworks.json. Returns where
    a block differed ("docs/checking.md: kernel", the document relative to `root`) and "docs/frameworks.json"
    where the record did. A ValueError where a document holds a block the command does not know."""
    record = record or root / "docs" / "frameworks.json"
    texts = {path: path.read_text() for path in documents(root)}
    if strange := {str(path.relative_to(root)): unknown(text) for path, text in texts.items() if unknown(text)}:
        raise ValueError(f"blocks the command does not generate, or twice in one document: {strange}; the blocks "
                         f"are {BLOCKS}")
    found = measure_frameworks(jobs=jobs, done=done)
    fresh = json.dumps(matrix.to_json(found), indent=1) + "\n"
    old = json.loads(record.read_text()) if record.exists() else None
    blocks = generated(found, check_kernel((root / CHECKING).read_text()), precision.table())
    changed = [f"{path.relative_to(root)}: {name}" for path, text in texts.items()
               for name in differences(text, blocks)]
    if old is None or _without_timing(old) != _without_timing(json.loads(fresh)):
        changed.append(str(record.relative_to(root)) if record.is_relative_to(root) else str(record))
    if write:
        for path, text in texts.items():
            for name in names_in(text):
                text = replaced(text, name, blocks[name])
            if text != texts[path]:
                path.write_text(text)
        record.write_text(fresh)
    return changed


def _without_timing(found: dict[str, Any]) -> dict[str, Any]:
    return found | {"columns": [recorded_column(column) for column in found["columns"]]}
