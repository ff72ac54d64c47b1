"""`python -m conformance compare` (conformance/bench/report.py printing what bench/timing.py measures):
the table, the JSON rows, the plot, the targets and the baselines.

Tiny sizes and two repeats keep these fast; no test looks at a timing value, only that it was measured.
"""

from __future__ import annotations

import gc
import importlib
import io
import itertools
import json
import math
import pathlib
import re
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest

import attention_np
from conformance.__main__ import main
from conformance.bench import baselines, decode, latent, report, timing, variants
from conformance.bench.baselines import tutorial_attention
from conformance.frameworks.registry import framework_of
from tests._compare import assert_close

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW_KEYS = {"implementation", "framework", "device", "operation", "variant", "dtype", "B", "H", "E", "L", "S", "D",
            "F", "flops", "repeats", "time_ms", "gflops", "peak_mib", "rel_error"}  # as timing's docstring lists


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # the benchmark skips such a backend
        return False
    return True


def _expected_implementations() -> set[str]:
    labels = {"attention_np": ["numpy tutorial"], "attention_torch": ["torch built-in"],
              "attention_jax": ["jax plain", "jax.nn.dot_product_attention"]}
    return {name for backend, extra in labels.items() if _importable(backend)
            for name in (backend, f"{backend} explicit", *extra)}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict], pathlib.Path]:
    """One run of the command line on tiny sizes: (stdout, the JSON rows, the plot it drew, where matplotlib is
    installed)."""
    folder = tmp_path_factory.mktemp("compare")
    plot = ["--plot", str(folder / "compare.png")] if _importable("matplotlib") else []
    result = subprocess.run([sys.executable, "-m", "conformance", "compare", "--sizes", "8,16", "--repeats", "2",
                             "--json", str(folder / "rows.json"), *plot], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, json.loads((folder / "rows.json").read_text())["rows"], folder / "compare.png"


@pytest.mark.slow
def test_compare_prints_a_row_for_every_available_implementation(cli_run: tuple[str, list[dict], pathlib.Path]) -> None:
    stdout, _, _ = cli_run
    printed = {tuple(re.split(r"\s{2,}", line.strip())[:4]) for line in stdout.splitlines()}
    for name in _expected_implementations():
        for operation in timing.OPERATIONS:
            for L in ("8", "16"):
                assert (name, operation, "plain", L) in printed, f"no row for {name} {operation} L={L}:\n{stdout}"
    assert "GFLOP/s" in stdout and "peak MiB" in stdout and "rel. error" in stdout


@pytest.mark.slow
def test_json_rows_have_the_documented_keys(cli_run: tuple[str, list[dict], pathlib.Path]) -> None:
    _, rows, _ = cli_run
    assert len(rows) == len(_expected_implementations()) * len(timing.OPERATIONS) * 2
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["time_ms"] > 0 and math.isfinite(row["gflops"]) and row["dtype"] == "float32"
        assert row["variant"] == "plain"
        assert row["peak_mib"] is None or row["peak_mib"] >= 0
    assert set(ROW_KEYS) == set(timing.Row._fields)


@pytest.mark.slow
def test_every_candidate_agrees_with_the_float64_reference(cli_run: tuple[str, list[dict], pathlib.Path]) -> None:
    # the command line's run has compared every candidate, at L = 8 and 16, with the float64 reference (compare()
    # computes rel_error for each row it times): a second compare() here computed the same rows again
    _, rows, _ = cli_run
    assert {row["implementation"] for row in rows} == _expected_implementations()
    for row in rows:
        assert row["rel_error"] < 1e-4, row  # float32 against float64: a wiring mistake would be off by far more


def test_the_timed_operations_are_the_registrys_less_those_timed_elsewhere() -> None:
    # one list of operations (conformance/contract/operations.py): compare's table times the rest of it, in its order
    from conformance.contract import operations

    registry = tuple(operations.OPERATIONS)
    assert set(timing.TIMED_ELSEWHERE) <= set(registry)
    assert tuple(name for name in registry if name not in timing.TIMED_ELSEWHERE) == timing.OPERATIONS
    assert timing.OPERATIONS == ("sdpa", "mha", "block")  # what make_problem, our_call and flops know


def test_flops_on_a_hand_computed_case() -> None:
    # B=1, H=2, L=3, S=3, E=4, so D = 8 and F = 32:
    # sdpa  4 * 1 * 2 * 3 * 3 * 4 = 288
    # mha   288 + 4 * 2 * 1 * 3 * 8 * 8 = 288 + 1536 = 1824
    # block 1824 + 2 * 2 * 1 * 3 * 8 * 32 = 1824 + 3072 = 4896
    sizes = {"B": 1, "H": 2, "L": 3, "S": 3, "E": 4}
    assert timing.flops("sdpa", **sizes) == 288
    assert timing.flops("mha", **sizes) == 1824
    assert timing.flops("block", **sizes) == 4896


def test_tutorial_baseline_equals_attention_np_without_fully_masked_rows() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))  # (B, H, L, E), L = S = 5
    mask = rng.random((2, 1, 5, 5)) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    expected, _ = attention_np.scaled_dot_product_attention(q, k, v, mask)
    np.testing.assert_allclose(tutorial_attention(q, k, v, mask), expected, rtol=1e-12, atol=1e-14)


def test_tutorial_baseline_averages_the_values_on_a_fully_masked_row() -> None:
    # the documented difference: -1e9 everywhere makes the softmax flat, so the row is the mean of v,
    # where the spec (and attention_np) gives zeros
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 3, 2)) for _ in range(3))  # (H, L, E), L = S = 3
    mask = np.ones((3, 3), dtype=bool)
    mask[1] = False  # query 1 sees no key
    out = tutorial_attention(q, k, v, mask)
    np.testing.assert_allclose(out[0, 1], v[0].mean(axis=0), rtol=1e-12)
    np.testing.assert_array_equal(attention_np.scaled_dot_product_attention(q, k, v, mask)[0][0, 1], 0)


def test_measure_interleaves_the_candidates_so_each_follows_every_other_equally_often() -> None:
    calls: list[str] = []
    candidates = [timing.Candidate(name, operation="sdpa", run=lambda name=name: calls.append(name), peak=lambda: None)
                  for name in "ABC"]
    medians = timing.measure(candidates, repeats=4, warmup=1)
    assert calls[:3] == list("ABC")  # the warm-up
    timed = calls[3:]
    assert timed == list("ACBCAB" "ACBCAB")  # balanced_order(3) = [0, 2, 1, 2, 0, 1], twice: 4 calls each
    # as a cycle: A -> C, C -> B, B -> C, C -> A, A -> B, B -> A, each ordered pair once per pass
    assert sorted(itertools.pairwise(timed[:7])) == sorted(itertools.permutations("ABC", 2))
    assert len(medians) == 3 and all(seconds >= 0 for seconds in medians)


def test_measure_settles_before_each_call_for_at_most_ten_times_the_previous_call() -> None:
    # a call of 20 ms is followed by a wait of min(settle, 0.2 s); a call that returns at once by almost none
    starts: list[tuple[str, float]] = []
    ends: list[float] = []

    def run(name: str, seconds: float) -> None:
        starts.append((name, time.perf_counter()))
        if seconds:  # the quick call does not sleep: sleep(0) yields the core, for long on a busy machine
            time.sleep(seconds)
        ends.append(time.perf_counter())

    candidates = [timing.Candidate("slow", operation="sdpa", run=lambda: run("slow", 0.02), peak=lambda: None),
                  timing.Candidate("quick", operation="sdpa", run=lambda: run("quick", 0.0), peak=lambda: None)]
    timing.measure(candidates, repeats=2, warmup=0, settle=0.1)
    gaps = {(starts[i - 1][0], starts[i][0]): starts[i][1] - ends[i - 1] for i in range(1, len(starts))}
    quick = max(end - start for (name, start), end in zip(starts, ends, strict=True) if name == "quick")
    # the wait after the quick call is at most ten times that call; the slack is the scheduler's on a busy machine
    assert gaps[("slow", "quick")] >= 0.1 and gaps[("quick", "slow")] < 10 * quick + 0.03, (gaps, quick)
    assert variants.FLEX.settle > 0 and variants.PLAIN.settle == 0  # flex's NumPy thread pool, after OpenBLAS's


def test_a_timed_region_of_a_frozen_run_still_starts_after_collecting_the_garbage_made_since() -> None:
    # older_objects_frozen (compare's, targets' and decode's whole run) freezes what is alive at its start, so that
    # collector_paused's collection walks only newer objects: a cycle made inside is still collected before the
    # region; the objects are handed back at the end, and a freeze made by the caller is left as it was
    class Cycle:
        pass

    def cycle() -> weakref.ref:
        made = Cycle()
        made.itself = made
        return weakref.ref(made)

    gc.unfreeze()  # what tests/conftest.py froze before this file's first test: a run starts unfrozen here
    assert gc.get_freeze_count() == 0
    with timing.older_objects_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        made = cycle()
        with timing.collector_paused():
            assert made() is None and not gc.isenabled()
        with timing.older_objects_frozen():  # nested: the enclosing run's freeze holds
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0 and gc.isenabled()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_balanced_order_puts_every_ordered_pair_side_by_side_once(n: int) -> None:
    order = timing.balanced_order(n)
    pairs = list(zip(order, order[1:] + order[:1], strict=True))  # cyclic: the last is followed by the first
    expected = [(0, 0)] if n == 1 else list(itertools.permutations(range(n), 2))
    assert sorted(pairs) == sorted(expected)


def test_measure_stops_at_the_repeats_asked_for() -> None:
    counts = {name: 0 for name in "ABCD"}
    candidates = [timing.Candidate(name, operation="sdpa",
                                   run=lambda name=name: counts.__setitem__(name, counts[name] + 1),
                                   peak=lambda: None) for name in counts]
    timing.measure(candidates, repeats=5, warmup=0)  # balanced_order(4) has 3 of each: a partial pass
    assert counts == dict.fromkeys("ABCD", 5)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stderr", "enabled", "drawn"), [(_Terminal, True, True), (_Terminal, False, False),
                                                          (io.StringIO, True, False)],
                         ids=["terminal", "quiet", "captured-or-piped"])
def test_progress_bar_is_drawn_on_stderr_only_where_it_is_a_terminal(
        monkeypatch: pytest.MonkeyPatch, stderr: type, enabled: bool, drawn: bool) -> None:
    if drawn:
        pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", stderr())
    assert list(timing._progress([("sdpa L=8", 8), ("sdpa L=16", 16)], enabled)) == [8, 16]
    assert ("sdpa L=16" in sys.stderr.getvalue()) == drawn
    assert ("2/2" in sys.stderr.getvalue()) == drawn


@pytest.mark.slow
def test_plot_writes_a_png(cli_run: tuple[str, list[dict], pathlib.Path]) -> None:
    pytest.importorskip("matplotlib")
    assert cli_run[2].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")  # compare --plot, in the command's run


def test_plot_without_matplotlib_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure now fails
    assert main(["compare", "--sizes", "8", "--plot", "never.png"]) == 2
    assert "pip install 'attention-reference[plot]'" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture) -> None:
    backends, _ = timing.installed_backends()
    if any(framework_of(module).sees_gpu() for module in backends.values()):
        pytest.skip("a GPU is visible here")
    assert main(["compare", "--sizes", "8", "--device", "cuda"]) == 2
    assert "--device cuda" in capsys.readouterr().err


@pytest.mark.slow  # runs every candidate of the benchmark
def test_targets_compute_every_ratio() -> None:
    rows = timing.targets(variant=variants.PLAIN, L=64, repeats=2)
    kinds = {framework_of(module).name for module in timing.installed_backends()[0].values()}
    expected = [(kind, operation) for kind in dict.fromkeys(t.framework for t in variants.TARGETS) if kind in kinds
                for operation in timing.OPERATIONS for t in variants.TARGETS
                if t.framework == kind and operation in t.operations]
    assert [(row.framework, row.operation) for row in rows] == expected
    for row in rows:
        assert math.isfinite(row.measured) and row.measured > 0, row
        assert row.met == (row.measured <= row.bound if row.relation == "<=" else row.measured >= row.bound)
    jax_rows = [row for row in rows if row.framework == "jax"]
    assert all(row.denominator in ("jax plain", "jax.nn.dot_product_attention") for row in jax_rows)
    assert "MET" in report.format_targets(rows) or "MISSED" in report.format_targets(rows)


def _sdpa_row(implementation: str, framework: str, device: str, *, time_ms: float) -> timing.Row:
    """A row as compare() makes it, for sdpa at B=2, H=8, L=S=1024, E=64."""
    count = timing.flops("sdpa", B=2, H=8, L=1024, S=1024, E=64)
    return timing.Row(implementation,
                      framework=framework,
                      device=device,
                      operation="sdpa",
                      dtype="float32",
                      B=2,
                      H=8,
                      E=64,
                      L=1024,
                      S=1024,
                      D=512,
                      F=2048,
                      flops=count,
                      repeats=2,
                      time_ms=time_ms,
                      gflops=count / (time_ms / 1e3) / 1e9,
                      peak_mib=None,
                      rel_error=1e-7)


def _rates(table: str) -> list[str]:
    """The rate column (the sixth) of each line of a format_table table, its header first."""
    return [re.split(r"\s{2,}", line.strip())[5] for line in table.splitlines() if line]


def test_table_gives_the_rate_in_tflops_when_a_row_ran_on_cuda() -> None:
    # 4 B H L S E = 4 * 2 * 8 * 1024 * 1024 * 64 = 2**32 FLOPs per call
    # torch on the GPU, 0.016 ms: 2**32 / 16e-6 s = 268435.456 GFLOP/s = 268.44 TFLOP/s
    # NumPy on the CPU, 40 ms: 2**32 / 0.04 s = 107.374 GFLOP/s = 0.11 TFLOP/s
    rows = [_sdpa_row("attention_np", "numpy", "cpu", time_ms=40.0),
            _sdpa_row("attention_torch", "torch", "cuda", time_ms=0.016)]
    table = report.format_table(rows)
    assert _rates(table) == ["TFLOP/s", "0.11", "268.44"]
    assert "GFLOP/s" not in table
    assert rows[1].gflops == pytest.approx(268435.456)  # the row (and its JSON) keeps GFLOP/s


def test_table_gives_the_rate_in_gflops_when_every_row_ran_on_the_cpu() -> None:
    rows = [_sdpa_row("attention_np", "numpy", "cpu", time_ms=40.0),
            _sdpa_row("attention_torch", "torch", "cpu", time_ms=0.016)]
    assert _rates(report.format_table(rows)) == ["GFLOP/s", "107.4", "268435.5"]


@pytest.mark.parametrize(("fused", "labels"), [
    (False, {"jax plain", "jax.nn.dot_product_attention"}),
    (True, {"jax plain", "jax.nn.dot_product_attention", "jax.nn.dot_product_attention cudnn"}),
], ids=["cpu-or-float32", "cuda-bfloat16"])
def test_jax_baselines_add_cudnn_only_where_the_fast_path_uses_it(fused: bool, labels: set[str]) -> None:
    # built, not run: the cuDNN kernel needs a GPU (tests/test_gpu.py and scripts/gpu-check.sh run it)
    pytest.importorskip("jax")
    assert set(baselines.calls("jax", "sdpa", {}, num_heads=2, fused=fused)) == labels


def test_jax_builtin_baseline_passes_its_implementation_on() -> None:
    jax = pytest.importorskip("jax")

    q, k, v = (np.random.default_rng(1).standard_normal((1, 2, 5, 4)) for _ in range(3))
    with jax.numpy_dtype_promotion("standard"):
        xla = baselines.jax_builtin_attention(q, k, v, implementation="xla")
        with pytest.raises(ValueError, match="Unsupported implementation option: nonsense"):
            baselines.jax_builtin_attention(q, k, v, implementation="nonsense")
    # its softmax runs in float32 also for float64 inputs (SPEC section 9): float32's tolerance
    assert_close(np.asarray(xla), attention_np.scaled_dot_product_attention(q, k, v)[0], 1e-4, "xla")


# --- variants ------------------------------------------------------------------------------------------

_VARIANT_LABELS = {
    "gqa": {"attention_np": ["attention_np", "attention_np explicit", "attention_np np.repeat"],
            "attention_jax": ["attention_jax", "attention_jax explicit", "jax plain", "jax.nn.dot_product_attention"],
            "attention_torch": ["attention_torch", "attention_torch explicit", "torch built-in",
                                "torch built-in repeat_interleave"]},
    "window": {backend: [f"{backend} window", f"{backend} causal"]
               for backend in ("attention_np", "attention_jax", "attention_torch")},
    "long": {backend: [f"{backend}{path}" for path in (" flash", " flash gradient", "", " flash causal",
                                                        " flash causal gradient", " causal")]
             + (["torch built-in", "torch built-in causal"] if backend == "attention_torch" else [])
             for backend in ("attention_np", "attention_jax", "attention_torch")},
    "flex": {backend: [f"{backend} {path} {mask}" for mask in ("window", "document") for path in ("flex", "dense")]
             + (["torch compiled flex window", "torch compiled flex document"] if backend == "attention_torch" else [])
             for backend in ("attention_np", "attention_jax", "attention_torch")},
}


@pytest.mark.parametrize("name", ["plain", "gqa", "window", "long", "flex", "serve", "mla"])
def test_cli_parses_each_variant(name: str) -> None:
    from conformance.__main__ import build_parser

    assert build_parser().parse_args(["compare", "--variant", name]).variant == name
    assert build_parser().parse_args(["compare"]).variant == "plain"  # today's run, unchanged


def test_cli_refuses_an_unknown_variant_and_an_operation_the_variant_lacks(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["compare", "--variant", "nonsense"])
    assert exit.value.code == 2
    assert main(["compare", "--variant", "gqa", "--operations", "mha", "--sizes", "8"]) == 2
    assert "--variant gqa times sdpa only" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["gqa", "window", "long",
                                  pytest.param("flex", marks=pytest.mark.slow)])  # flex: torch compiles its kernel
def test_variant_runs_at_a_tiny_size_with_labelled_rows_and_json(name: str, tmp_path: pathlib.Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "rows.json"
    assert main(["compare", "--variant", name, "--sizes", "8", "--repeats", "1", "--quiet",
                 "--json", str(path)]) == 0
    stdout = capsys.readouterr().out
    printed = {tuple(re.split(r"\s{2,}", line.strip())[:4]) for line in stdout.splitlines()}
    expected = {label for backend, labels in _VARIANT_LABELS[name].items() if _importable(backend) for label in labels}
    operation = variants.VARIANTS[name].operations[0]
    assert {(label, operation, name, "8") for label in expected} <= printed, stdout
    document = json.loads(path.read_text())
    assert document["variant"] == name
    assert {row["implementation"] for row in document["rows"]} == expected
    for row in document["rows"]:
        assert row["variant"] == name and set(row) == ROW_KEYS
        assert row["rel_error"] < 1e-4, row  # against attention_np's explicit path with the variant's keywords
    # window, long: the ratios side by side, printed and in the JSON; gqa has none outside --targets
    ratios = [(r["numerator"], r["denominator"]) for r in document["ratios"]]
    present = [backend for backend in _VARIANT_LABELS[name] if _importable(backend)]
    assert ratios == {"gqa": [], "window": [(f"{backend} window", f"{backend} causal") for backend in present],
                      "long": [(f"{backend} flash{label}", f"{backend}{label}") for backend in present
                               for label in ("", " causal")],
                      "flex": [(target.numerator, target.denominators[0]) for target in variants.FLEX.targets
                               if {target.numerator, *target.denominators} <= expected]}[name]
    assert ("side by side" in stdout) == (name != "gqa")


def test_gqa_rows_hold_every_target_with_the_right_sizes() -> None:
    assert {name for target in variants.GQA.targets for name in (target.numerator, *target.denominators)} <= {
        label for labels in _VARIANT_LABELS["gqa"].values() for label in labels}
    problem = variants.gqa_problem("sdpa", B=1, H=4, L=3, E=2, dtype="float32")
    q, k, v = problem.inputs
    assert q.shape == (1, 4, 3, 2) and k.shape == v.shape == (1, 1, 3, 2)  # Hkv = H / 4


def test_gqa_target_rows_from_fake_medians() -> None:
    # the targets' size, B=2, H=32, L=S=1024, E=64; the repeated copies of k and v, (B, H, S, E) float32 each:
    # 2 * 2 * 32 * 1024 * 64 * 4 bytes = 33554432 bytes = 32 MiB, so the memory bound is 0.99 * 32 = 31.68 MiB
    problem = timing.Problem("sdpa", B=2, H=32, L=1024, E=64, inputs=(), state={})
    assert variants.repeated_kv_mib(problem) == 32.0
    measured = {"time": {"attention_torch": 10.5, "torch built-in": 10.0,  # 10.5 / 10 = 1.05 <= 1.10
                         "attention_jax": 30.0, "jax plain": 20.0, "jax.nn.dot_product_attention": 25.0,  # 1.5
                         "attention_np": 50.0, "attention_np np.repeat": 60.0},  # 50 / 60 = 0.833 <= 1.00
                "peak": {"attention_np": 272.0, "attention_np np.repeat": 304.0}}  # 304 - 272 = 32 >= 31.68
    rows = [timing.target_row(target, problem, "gqa", measured) for target in variants.GQA.targets]
    got = [(row.framework, row.compared, row.denominator, round(row.measured, 3), row.bound, row.met) for row in rows]
    assert got == [("torch", "time ratio", "torch built-in", 1.05, 1.10, True),
                   ("jax", "time ratio", "jax plain", 1.5, 1.10, False),  # the faster JAX baseline counts
                   ("numpy", "time ratio", "attention_np np.repeat", 0.833, 1.00, True),
                   ("numpy", "peak difference", "attention_np", 32.0, pytest.approx(31.68), True)]
    assert all(row.variant == "gqa" and row.L == 1024 for row in rows)
    measured["peak"]["attention_np np.repeat"] = 300.5  # 28.5 MiB saved: less than the copies
    missed = timing.target_row(variants.GQA.targets[3], problem, "gqa", measured)
    assert (missed.measured, missed.met) == (28.5, False)
    table = report.format_targets(rows)
    assert "attention_np np.repeat - attention_np" in table and "304.00 - 272.00 MiB" in table
    assert ">= 31.7 MiB" in table and table.count("MET") == 3 and table.count("MISSED") == 1


def test_long_targets_name_candidates_the_variant_makes() -> None:
    labels = {label for labels in _VARIANT_LABELS["long"].values() for label in labels}
    assert {name for target in variants.LONG.targets for name in (target.numerator, *target.denominators)} <= labels
    assert variants.LONG.target_dims == {"B": 1, "H": 8, "E": 64} and variants.LONG.target_L == 4096
    assert max(variants.LONG.sizes) == 32768
    # the gradient runs the forward and the backward pass: "backward at most 3 times the forward" is <= 4
    assert {target.bound for target in variants.LONG.targets if target.numerator.endswith("gradient")} == {4.0}
    # above SCORES_LIMIT: flash_attention alone
    problem = timing.Problem("sdpa", B=1, H=1, L=32768, E=64, inputs=(), state={})
    assert set(variants.long_calls("attention_np", attention_np, problem, {}, fused=False)) == {
        "attention_np flash", "attention_np flash gradient", "attention_np flash causal",
        "attention_np flash causal gradient"}


def test_targets_time_the_frameworks_a_target_compares_across_together() -> None:
    def candidate(name: str, framework: str) -> timing.Candidate:
        return timing.Candidate(name, operation="sdpa", run=lambda: None, peak=lambda: None, framework=framework)

    candidates = [candidate("attention_np flash", "numpy"), candidate("jax plain", "jax"),
                  candidate("attention_np", "numpy"), candidate("torch built-in", "torch")]
    numpy_only = [variants.Target("numpy", numerator="attention_np flash", denominators=("attention_np",),
                                  relation="<=", bound=1.0)]
    across = [*numpy_only, variants.Target("numpy", numerator="attention_np flash", denominators=("torch built-in",),
                                           relation="<=", bound=1.5)]
    names = [[c.name for c in group] for group in timing.timed_together(candidates, numpy_only)]
    assert names == [["attention_np flash", "attention_np"], ["jax plain"], ["torch built-in"]]
    names = [[c.name for c in group] for group in timing.timed_together(candidates, across)]
    assert names == [["attention_np flash", "attention_np", "torch built-in"], ["jax plain"]]


def test_long_candidates_run_flash_attention_at_its_default_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # the figures quoted for flash_attention are those a user gets from flash_attention(q, k, v)
    calls = []

    def record(*arrays, **keywords):
        calls.append(keywords)
        return arrays[0], None, lambda d_out: (d_out,)

    monkeypatch.setattr(attention_np, "flash_attention", record)
    monkeypatch.setattr(attention_np, "flash_attention_vjp", record)
    # above SCORES_LIMIT: flash_attention alone
    problem = timing.Problem("sdpa", B=1, H=1, L=32768, E=64, inputs=(), state={})
    for call, _, options in variants.long_calls("attention_np", attention_np, problem, {}, fused=False).values():
        call(None, 1, 2, 3)
        assert calls.pop() == dict(options)


@pytest.mark.slow  # torch's rows start a process each
def test_memory_rows_at_a_small_length_meet_the_bounds() -> None:
    from conformance.bench import memory

    backends = {name: importlib.import_module(name) for name in ("attention_np", "attention_jax",
                                                                  "attention_torch") if _importable(name)}
    rows = memory.measure(backends, length=1024, causal=(True,), untiled=False)  # a process per torch row
    assert {(row.backend, row.call, row.is_causal) for row in rows} == {
        (name, call, True) for name in backends for call in ("forward", "gradient")}
    assert all(row.met for row in rows if row.bound is not None), memory.format_rows(rows, 1024)
    assert "MET" in memory.format_rows(rows, 1024)


def test_flex_variant_declares_its_rows_and_targets() -> None:
    # per mask, each backend's flex_attention ("flex") and its dense-mask fast path ("dense"), and torch's compiled
    # flex_attention, which the cross-framework targets divide by; every target names rows the variant makes
    problem = variants.flex_problem("flex", B=1, H=2, L=16, E=4, dtype="float32")
    backends = [name for name in ("attention_np", "attention_jax", "attention_torch") if _importable(name)]
    calls = {name: variants.flex_calls(name, importlib.import_module(name), problem, {}, fused=False)
             for name in backends}
    masks = ("window", "document")
    assert tuple(variants.FLEX_MASKS) == masks
    compiled = {f"torch compiled flex {mask}" for mask in masks if "attention_torch" in backends}
    assert {label for found in calls.values() for label in found} == {
        f"{name} {path} {mask}" for name in backends for path in ("flex", "dense") for mask in masks} | compiled
    assert {(t.framework, t.numerator, t.denominators, t.bound) for t in variants.FLEX.targets} == {
        (framework, f"{name} flex {mask}", (denominator, ), bound)
        for framework, name in variants.OURS for mask in masks
        for denominator, bound in ((f"{name} dense {mask}", 0.3),
                                   (f"torch compiled flex {mask}", 1.10 if framework == "torch" else 2.0))}
    assert variants.FLEX.ratios == variants.FLEX.targets  # printed side by side by every run, not --targets alone
    assert (variants.FLEX.dims, variants.FLEX.target_L, variants.FLEX.operations) == (
        {"B": 1, "H": 8, "E": 64}, 4096, ("flex",))
    # the masks by hand at L = 16: 8 documents of 2 positions; the window of 256 covers every earlier key
    assert np.array_equal(variants.dense_mask("document", 16), np.kron(np.eye(8, dtype=bool), np.ones((2, 2), bool)))
    assert np.array_equal(variants.dense_mask("window", 16), np.tri(16, dtype=bool))
    assert variants.dense_mask("window", 300)[299].tolist() == [False] * 43 + [True] * 257  # keys 43 .. 299
    # NumPy's rows compute the reference's attention (float32 against flash_attention in float64, dense mask)
    inputs = [x.astype(np.float32) for x in problem.inputs]
    for label, (call, params, options) in calls["attention_np"].items():
        out = call(params, *inputs)
        assert_close(out[0] if isinstance(out, tuple) else out, variants.flex_reference(problem, options), 1e-5, label)


@pytest.mark.slow  # NumPy's call at L = 32768 takes seconds; torch's row starts a process, JAX's compiles
def test_flex_memory_rows_meet_the_bound() -> None:
    # NumPy at the size the performance page quotes (B=1, H=8, L=S=32768), where one copy of q, k, v or out
    # (B H L E float32 = 64 MiB each) breaks the 64 MiB (np.repeat's copies of k and v measured 146 MiB); the
    # measurement of every backend at a small length
    from conformance.bench import memory

    rows = memory.measure_flex({"attention_np": attention_np})
    assert rows[0].met, memory.format_rows(rows)
    backends = {name: importlib.import_module(name) for name in ("attention_np", "attention_jax",
                                                                  "attention_torch") if _importable(name)}
    rows = memory.measure_flex(backends, length=1024, heads=2)
    assert [row.backend for row in rows] == list(backends)
    assert all(row.bound == 64 and row.met for row in rows), memory.format_rows(rows, 1024)


def test_a_ratio_without_a_bound_has_no_verdict() -> None:
    problem = timing.Problem("sdpa", B=1, H=8, L=4096, E=64, inputs=(), state={})
    row = timing.target_row(variants.WINDOW_RATIOS[0], problem, "window",
                            {"time": {"attention_np window": 30.0, "attention_np causal": 120.0}})
    assert (row.measured, row.bound, row.met) == (0.25, None, None)
    assert report.format_targets([row]).splitlines()[1].split()[-3:] == ["0.250", "-", "-"]


# --- compare --decode (bench/decode.py) ---------------------------------------------------------------


@pytest.mark.slow  # three backends' prefill, steps and full passes, JAX's compiles
def test_decode_runs_at_a_tiny_size_with_a_row_per_backend(tmp_path: pathlib.Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "decode.json"
    assert main(["compare", "--decode", "--prefill", "8", "--tokens", "4", "--repeats", "1",
                 "--json", str(path)]) == 0
    stdout = capsys.readouterr().out
    document = json.loads(path.read_text())
    rows = {row["backend"]: row for row in document["rows"]}
    installed = [name for name in ("attention_np", "attention_jax", "attention_torch") if _importable(name)]
    assert list(rows) == installed and document["variant"] == "decode"
    assert all(any(line.startswith(name) for line in stdout.splitlines()) for name in installed), stdout
    # p = 9 and 12: the first new position and the last (every 32nd of four)
    assert all(row["sampled"] == [9, 12] for row in rows.values())
    if "attention_jax" in rows:  # one trace of the prefill (L = 8), one for all four steps (L = 1)
        assert (rows["attention_jax"]["prefill_compiles"], rows["attention_jax"]["step_compiles"]) == (1, 1)
        assert "attention_jax 1 (target 1): MET" in stdout
    if "attention_torch" in rows:  # the pieces' outputs were compared with ours before timing
        assert rows["attention_torch"]["pieces_error"] <= decode.ATOL
    assert f"rope_theta={decode.ROPE_THETA}" in stdout  # RoPE on (Llama's theta): the pieces turn q and k too
    expected = [(f"{name} recompute", f"{name} decode") for name in installed]
    expected += [("attention_torch decode", "torch pieces decode")] * ("attention_torch" in rows)
    targets = document["targets"]
    assert [(row["numerator"], row["denominator"]) for row in targets] == expected
    for value in [row["measured"] for row in targets] + [row["speedup"] for row in rows.values()]:
        assert math.isfinite(value) and value > 0  # no timing target is asserted: timings are noisy


def test_decode_recompute_sum_is_exact_for_a_linear_cost() -> None:
    # every 32nd p timed, the rest interpolated: for t(p) = p ms over p = 1025 .. 1280 the sum is
    # 256 * (1025 + 1280) / 2 = 295040 ms exactly
    sampled = decode.sampled_positions(1024, 256, 32)
    assert sampled == (1025, 1057, 1089, 1121, 1153, 1185, 1217, 1249, 1280)
    assert decode.summed(sampled, sampled, 1024, 256) == 295040


# --- the ring model (bench/cluster.py) -------------------------------------------------------------------


def test_ring_model_crossover_by_hand() -> None:
    from conformance.bench import cluster

    # P = 8 on NVLink: L* = P (Hkv / H) b F u / (2 W) = 8 * (8 / 32) * 2 * 989e12 * 0.5 / (2 * 450e9) = 2197.8
    assert cluster.crossover(8) == pytest.approx(8 * 0.25 * 2 * 989e12 * 0.5 / 900e9)
    assert cluster.crossover(8) == pytest.approx(2197.8, rel=1e-4)
    assert cluster.crossover(16) / cluster.crossover(8) == pytest.approx(2 * 450 / 50)  # InfiniBand beyond a node
    for P in cluster.DEVICES:  # at L*, the compute of a step equals its transfer
        at = cluster.step(P, round(cluster.crossover(P) / P) * P)
        assert at.compute_s == pytest.approx(at.transfer_s, rel=0.01)
    step = cluster.step(8, 65536)  # 2 B Hkv (L / P) E b bytes: 2 * 8 * 8192 * 128 * 2 = 32 MiB
    assert step.bytes == 32 * 2**20 and step.hidden
    assert "L* (communication hidden above it)" in cluster.format_table(cluster.table())


def test_cli_parses_ring() -> None:
    from conformance.__main__ import build_parser

    assert build_parser().parse_args(["compare", "--ring"]).ring


def test_mla_variant_runs_at_a_tiny_size_with_both_forms_and_their_ratios() -> None:
    """`compare --variant mla`'s run (bench/latent.py) on every installed backend at a tiny size: two rows per
    backend, the forms checked equal before timing, the ratios absorbed / expanded with the target in torch and
    JAX alone, and the table printed as the docs show it."""
    config = latent.Config(d_model=16, num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                           v_head_dim=4, context=24, turn=1, repeats=1)
    backends, _ = timing.installed_backends()
    with timing.pinned(backends):
        rows, ratios = latent.run(config, backends)
    assert [(row.backend, row.form) for row in rows] == [(name, form) for name in backends for form in latent.FORMS]
    assert all(row.max_diff <= latent.ATOL and row.ms_per_token > 0 for row in rows)
    assert [(r.numerator, r.denominator, r.bound) for r in ratios] == [
        (f"{name} absorbed", f"{name} expanded", None if name == "attention_np" else latent.TARGET)
        for name in backends]
    table = report.format_mla(rows, ratios)
    assert all(f"ms/token: {name} absorbed / {name} expanded" in table for name in backends)
