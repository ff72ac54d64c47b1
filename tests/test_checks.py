"""The suite's own helpers: comparisons, tolerances, failure snippets and the framework adapters."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import pathlib
import re
import subprocess
import sys
import types
from collections.abc import Callable

import numpy as np
import pytest

import attention_np
from conformance.contract import cases, fixed_cases, operations
from conformance.contract.features import Declaration
from conformance.contract.tolerances import TOLERANCES, relative_error, shown
from conformance.frameworks.registry import framework_of
from conformance.run import checks, gradient_checks, suite
from conformance.run.snippets import reproduce
from tests.implementations.broken import BROKEN


def test_relative_error_is_max_abs_error_over_max_abs_reference():
    # |[1.0, 2.5] - [1.0, 2.0]| = [0, 0.5]; max |reference| = 2 -> 0.5 / 2 = 0.25
    assert relative_error(np.array([1.0, 2.5]), np.array([1.0, 2.0])) == 0.25


def test_relative_error_counts_matching_nan_and_infinity_as_exact():
    reference = np.array([np.nan, np.inf, 1.0])
    assert relative_error(reference.copy(), reference) == 0.0


@pytest.mark.parametrize(("actual", "expected"), [
    (np.array([np.nan, 1.0]), np.array([0.0, 1.0])),  # NaN where the reference has a number
    (np.array([0.0, 1.0]), np.array([np.nan, 1.0])),  # a number where the reference has NaN
    (np.zeros(3), np.zeros(2)),  # shapes differ
])
def test_relative_error_is_infinite_for_results_wrong_in_kind(actual, expected):
    assert relative_error(actual, expected) == math.inf


def test_compare_names_wrong_shape_dtype_nan_and_missing():
    expected = np.zeros((2, 3))
    assert "shape (3, 2)" in checks.compare("out", np.zeros((3, 2)), expected, "float64").detail
    assert "dtype float32" in checks.compare("out", np.zeros((2, 3), np.float32), expected, "float64").detail
    assert "NaN" in checks.compare("out", np.full((2, 3), np.nan), expected, "float64").detail
    assert checks.compare("weights", None, expected, "float64").error == math.inf


def test_float32_tolerance_grows_with_the_oracles_own_float32_loss():
    # logits in the hundreds: softmax loses about |logit| x 6e-8 in float32, so the case's own
    # tolerance (ten times the oracle's loss) must be positive, and zero in float64
    rng = np.random.default_rng(0)
    case = cases.SdpaCase(q=15 * rng.standard_normal((3, 4)),
                          k=15 * rng.standard_normal((5, 4)),
                          v=rng.standard_normal((5, 2)),
                          mask=None,
                          bias=None,
                          is_causal=False,
                          scale=None)
    runner = checks.Runner(attention_np)
    assert checks.against_oracle(runner, case, "float32")["values"].tolerance > 0
    assert checks.against_oracle(runner, case, "float64")["values"].tolerance == 0


def test_half_precision_rows_run_where_the_framework_has_the_dtype():
    # NumPy has float16 and no bfloat16: its report holds float16 rows and no bfloat16 row
    rows = suite.check(attention_np, operations=["sdpa"], max_examples=1).rows
    assert {row.dtype for row in rows if row.check == "values"} == {"float32", "float64", "float16"}


def test_snippet_rebuilds_the_case_and_reruns_the_check():
    case = fixed_cases.named("sdpa", "one_query_one_key").build()
    code = reproduce("attention_np", "against_oracle", case, "float64")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {})
    assert printed.getvalue() == f"{checks.against_oracle(checks.Runner(attention_np), case, 'float64')}\n"


def test_framework_is_read_off_the_arrays_a_module_makes():
    assert framework_of(attention_np).name == "numpy"
    torch = pytest.importorskip("torch")
    import attention_torch

    assert framework_of(attention_torch).name == "torch"
    with framework_of(attention_torch).rngs[0].given(0) as rng:  # the usual form: a torch.Generator
        assert isinstance(rng, torch.Generator)


def test_torch_global_rng_form_seeds_the_global_rng_and_restores_it():
    torch = pytest.importorskip("torch")
    import attention_torch

    form = framework_of(attention_torch).rngs[1]
    before = torch.random.get_rng_state()
    with form.given(3) as rng:
        assert rng is None  # the module draws from the global RNG, seeded with 3
        assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("case", [cases.sdpa_case(), cases.mha_case(H=4), cases.block_case()],
                         ids=["sdpa", "mha", "block"])
def test_independent_dropout_is_within_its_bound(case):
    assert checks.dropout_independence(checks.Runner(attention_np), case, "float32")["independent"].error <= 1


SMALL_BLOCK = cases.block_case(L=1, D=4, H=4, F=4, activation="relu")  # the block's probe is cheapest at L = 1


@pytest.mark.parametrize(("name", "case", "shown_by"), [
    ("dropout_shared_by_heads", cases.mha_case(H=2), "pairs along the heads, both dropped with a Generator"),
    ("seed_restarted_at_every_site", SMALL_BLOCK, "feed-forward branch both dropped with an int seed"),
    ("attention_and_activation_one_stream", SMALL_BLOCK, "attention weights and activation both dropped"),
    ("attention_and_residual_one_stream", SMALL_BLOCK, "attention weights and attention branch both dropped"),
])
def test_decisions_that_are_one_drop_together_at_p_not_p_squared(name, case, shown_by):
    # two decisions that are one are both dropped at rate p = 0.5, not p^2 = 0.25; over at least 2000 pairs
    # sigma = sqrt(0.25 * 0.75 / 2000) <= 0.0097, so the measure is at least 0.25 / (6 * 0.0097) = 4.3
    measure = checks.dropout_independence(checks.Runner(BROKEN[name]), case, "float32")["independent"]
    assert measure.error >= 4.3 and shown_by in measure.detail


@pytest.mark.parametrize("lacks", [(), ("mask",)], ids=["every site", "lacking masks"])
def test_block_probe_compares_every_two_of_its_sites(lacks):
    # the four sites in the order the block draws them; a module without masks shows no attention weights
    case = cases.block_case(H=2, F=4, activation="swiglu")
    probe = operations.operation_of(case).dropout_probe(case, Declaration(lacks=lacks))
    out, _ = checks.Runner(attention_np).run(checks._tiled(probe.case._replace(dropout=0.5), 64), "float32",
                                             training=True, seed=1)
    decisions = probe.decisions(out.astype(np.float64), 0.5)
    sites = ["attention weights", "attention branch", "activation", "feed-forward branch"][len(lacks):]
    assert list(decisions) == list(probe.sites) == sites
    compared = {what for what, _, _, count in checks._drop_rates(decisions, probe, 0.5) if " and " in what}
    assert compared == {f"{one} and {other} both dropped" for one, other in itertools.combinations(sites, 2)}


@pytest.mark.slow
def test_a_module_that_raises_fails_with_the_exception_named():
    class Raising:
        __name__ = "raising"
        asarray, to_numpy = staticmethod(np.asarray), staticmethod(np.asarray)

        @staticmethod
        def scaled_dot_product_attention(*args, **kwargs):
            raise RuntimeError("not implemented")

    report = suite.check(Raising(), operations=["sdpa"], max_examples=2, shrink=False)
    assert not report.passed
    assert any("raised RuntimeError: not implemented" in (row.failure or "") for row in report.rows)


@pytest.mark.slow
def test_a_nondeterministic_module_is_reported_not_raised():
    # correct only every other call: a failure that does not repeat on the same case
    calls = [0]

    class Flaky:
        __name__ = "flaky"
        asarray, to_numpy = staticmethod(np.asarray), staticmethod(np.asarray)

        @staticmethod
        def scaled_dot_product_attention(q, k, v, mask=None, **options):
            calls[0] += 1
            out, weights = attention_np.scaled_dot_product_attention(q, k, v, mask, **options)
            return (out + calls[0] % 2, weights)

    report = suite.check(Flaky(), operations=["sdpa"], max_examples=5)
    assert not report.passed
    _assert_each_verdict_follows_from_its_numbers(report)


def _assert_each_verdict_follows_from_its_numbers(report: suite.Report) -> None:
    for row in report.rows:
        assert row.passed == (row.worst <= row.tolerance), f"{row.check} {row.dtype}: {row.worst} {row.tolerance}"
        assert row.passed or row.failure, f"{row.check} {row.dtype} failed without saying why"


def _wrapping(name: str, change) -> object:
    """A module that is attention_np with scaled_dot_product_attention changed by `change(call, *args)`."""
    class Module:
        __name__ = name
        asarray, to_numpy = staticmethod(np.asarray), staticmethod(np.asarray)

        @staticmethod
        def scaled_dot_product_attention(*args, **options):
            return change(lambda *a: attention_np.scaled_dot_product_attention(*a, **options), *args)

    return Module()


@pytest.mark.slow
def test_a_flaky_failure_fails_every_measure_it_broke():
    # wrong on roughly one call in three: whichever measures a failing call broke fail their rows, with the
    # case that broke them, even where Hypothesis's replay of the failure passed
    calls = [0]

    def sometimes_off(call, q, k, v, mask=None):
        calls[0] += 1
        out, weights = call(q, k, v, mask)
        return (out + 1.0 if calls[0] % 3 == 0 else out), weights

    report = suite.check(_wrapping("sometimes_off", sometimes_off), operations=["sdpa"], max_examples=10)
    assert not report.passed
    _assert_each_verdict_follows_from_its_numbers(report)


@pytest.mark.parametrize(("change", "to_numpy", "message"), [
    (lambda call, *args: (*call(*args), None), None, "scaled_dot_product_attention returned a 3-tuple, expected"),
    (lambda call, *args: call(*args)[0], None, "scaled_dot_product_attention returned a ndarray, expected a pair"),
    # a torch-like module whose to_numpy knows only its own arrays, given NumPy's back
    (lambda call, *args: call(*args), lambda x: x.numpy(), "to_numpy cannot convert the ndarray the module returned"),
    (lambda call, *args: call(*args), lambda x: np.asarray(x).tolist(), "to_numpy gave a list, not a NumPy array"),
], ids=["three", "bare_out", "foreign_arrays", "to_numpy_lists"])
@pytest.mark.slow
def test_a_result_outside_the_contract_fails_the_call_row_saying_what_came_back(change, to_numpy, message):
    module = _wrapping("odd_result", change)
    if to_numpy is not None:
        module.to_numpy = staticmethod(to_numpy)
    report = suite.check(module, operations=["sdpa"], max_examples=2, shrink=False)
    calls = [row for row in report.rows if row.check == "call"]
    assert calls and not any(row.passed for row in calls)
    assert all(message in row.failure and "raised" not in row.failure.splitlines()[0] for row in calls)


@pytest.mark.slow
def test_a_module_that_writes_into_its_inputs_fails_the_call_row_naming_them():
    # it unmasks every key in place, then attends: right numbers, but the caller's mask is changed
    def unmasking(call, q, k, v, mask=None):
        if mask is not None:
            np.asarray(mask)[...] = True
        return call(q, k, v, mask)

    report = suite.check(_wrapping("unmasking", unmasking), operations=["sdpa"], max_examples=20, shrink=False)
    calls = [row for row in report.rows if row.check == "call"]
    assert calls and not any(row.passed for row in calls)
    assert all("the call changed its inputs in place: mask" in row.failure for row in calls)


def test_relative_error_against_an_all_zero_reference_is_the_absolute_error():
    # max |[0, 1e-3] - 0| = 1e-3, where dividing by max |0| would give a meaningless huge number
    assert relative_error(np.array([0.0, 1e-3]), np.zeros(2)) == 1e-3


def test_snippet_of_a_jax_float64_case_reruns_with_the_suites_precision():
    jax = pytest.importorskip("jax")

    case = fixed_cases.named("sdpa", "causal_and_mask_hide_a_row").build()  # a bool mask: its literal must build on
    # every NumPy
    assert case.mask.dtype == bool
    code = reproduce("attention_jax", "against_oracle", case, "float64")
    assert "dtype='bool'" in code
    printed, before = io.StringIO(), jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)  # as in a fresh session
    try:
        with contextlib.redirect_stdout(printed):
            exec(code, {})
    finally:
        jax.config.update("jax_enable_x64", before)
    assert "values" in printed.getvalue() and "inf" not in printed.getvalue()


# --- gradients with the keywords of SPEC 2a --------------------------------------------------------------

def _differenced_vjp(received: list[dict], *, drop: tuple[str, ...] = ()) -> Callable:
    """scaled_dot_product_attention_vjp for einsum_attention, its pullback by central differences of the
    forward pass, entry by entry (exact to about 1e-9: enough for the gradient check); it records the
    keywords it is given, and differentiates without those in `drop` (a backward pass that forgets one). With a
    score function the pullback also gives its parameters' gradients (d_score_mod), none of those in `drop`."""
    from tests.implementations import einsum_attention

    def vjp(q, k, v, mask=None, *, bias=None, **options):
        received.append(options)
        score_mod = options.get("score_mod")
        parameters = {name: np.asarray(value, float) for name, value in getattr(score_mod, "parameters", {}).items()
                      if f"score_mod.{name}" not in drop}

        def forward(q, k, v, bias, *values):
            kept = {name: value for name, value in options.items() if name not in drop}
            if values:
                kept["score_mod"] = score_mod.replace(**dict(zip(parameters, values, strict=True)))
            return einsum_attention.scaled_dot_product_attention(q, k, v, mask, bias=bias, **kept)[0]

        def pullback(d_out):
            inputs = [q, k, v, bias, *parameters.values()]
            grads = []
            for a, x in enumerate(inputs):
                if x is None:
                    grads.append(None)
                    continue
                grad = np.zeros_like(x)
                for index in zip(*np.nonzero(np.isfinite(x)), strict=True):  # a -inf bias entry has none
                    shifted = [[y if b != a else y.copy() for b, y in enumerate(inputs)] for _ in (1, -1)]
                    shifted[0][a][index] += 1e-6
                    shifted[1][a][index] -= 1e-6
                    grad[index] = np.sum(d_out * (forward(*shifted[0]) - forward(*shifted[1]))) / 2e-6
                grads.append(grad)
            if score_mod is None:
                return tuple(grads)
            return (*grads[:4], dict(zip(parameters, grads[4:], strict=True)))

        return (*einsum_attention.scaled_dot_product_attention(q, k, v, mask, bias=bias, **options), pullback)

    return vjp


MODS_EXAMPLES = [row.name for row in fixed_cases.rows("sdpa", "example") if row.name.startswith("mods_")]


@pytest.mark.parametrize("name", MODS_EXAMPLES)
def test_gradient_check_holds_the_score_functions_parameters_to_the_oracle(name: str) -> None:
    # a vjp that differentiates the right function passes, its d_score_mod included; one that forgets a parameter's
    # gradient fails (a missing gradient is inf)
    case = fixed_cases.named("sdpa", name).build()
    measures = gradient_checks.gradients(checks.Runner(_with_vjp(_differenced_vjp([]))), case, "float64")
    assert all(measure.error <= 1 for measure in measures.values()), measures
    if getattr(case.score_mod, "parameters", {}):
        forgotten = tuple(f"score_mod.{parameter}" for parameter in case.score_mod.parameters)
        module = _with_vjp(_differenced_vjp([], drop=forgotten))
        assert gradient_checks.gradients(checks.Runner(module), case, "float64")["gradients"].error > 1


POSITIONED_EXAMPLES = ["causal_bottom_right", "sliding_window_causal", "offset_per_sequence",
                       "key_lengths_zero_for_one_sequence", "softcap_saturated_with_neg_inf_bias"]


def _with_vjp(vjp: Callable) -> types.SimpleNamespace:
    from tests.implementations import einsum_attention

    module = types.SimpleNamespace(**{name: getattr(einsum_attention, name) for name in einsum_attention.__all__})
    module.__name__ = "einsum_with_differenced_vjp"
    module.scaled_dot_product_attention_vjp = vjp
    return module


@pytest.mark.parametrize("name", POSITIONED_EXAMPLES)
def test_gradient_check_passes_the_keywords_of_spec_2a_to_the_vjp(name: str) -> None:
    # a vjp that differentiates the right function passes; q_offset and key_lengths reach it as given
    # (an array q_offset as an array input), and no gradient is asked of them
    received: list[dict] = []
    case = fixed_cases.named("sdpa", name).build()
    measures = gradient_checks.gradients(checks.Runner(_with_vjp(_differenced_vjp(received))), case, "float64")
    assert all(measure.error <= 1 for measure in measures.values()), measures
    used = operations.keywords_used(case)
    assert used and all(set(used) <= set(options) for options in received)
    for keyword, value in used.items():
        assert np.array_equal(received[0][keyword], value)


@pytest.mark.parametrize(("name", "forgotten"), [("sliding_window_causal", "window"),
                                                 ("causal_bottom_right", "q_offset"),
                                                 ("key_lengths_zero_for_one_sequence", "key_lengths"),
                                                 ("softcap_saturated_with_neg_inf_bias", "softcap")])
def test_gradient_check_rejects_a_backward_pass_that_forgets_a_keyword(name: str, forgotten: str) -> None:
    case = fixed_cases.named("sdpa", name).build()
    module = _with_vjp(_differenced_vjp([], drop=(forgotten,)))
    measures = gradient_checks.gradients(checks.Runner(module), case, "float64")
    assert measures["gradients"].error > 1 or measures["masked_rows"].error > 1, measures


def _scores_near_1e4() -> dict[str, cases.SdpaCase]:
    """Two cases whose scores are near -1.15e4, where the float64 oracle rounds each score by about eps 1.15e4
    = 2.6e-12, 2.6e-6 of the step h = 1e-6. shifted_bias: the suite's own failure on attention_np's correct
    gradients (thorough profile, seed 0, shrunk), q (B, L, E) = (2, 1, 1), a bias of -1.15e4 on the 3 keys,
    batch 0 seeing key 0 and batch 1 keys 1 and 2. capped: q and k of 15 x N(0, 1) at scale 10 (q k^T * scale in
    the thousands), softcap 50 (+-50 but for a tanh' below 1e-8), then a bias of -11500 + N(0, 1)."""
    rng = np.random.default_rng(1)
    return {
        "shifted_bias": cases.SdpaCase(
            q=np.array([[[0.1257302210933933]], [[-0.1321048632913019]]]),
            k=np.array([[[0.6404226504432821], [0.10490011715303971], [-0.535669373161111]],
                        [[0.36159505490948474], [1.3040000451301372], [0.9470809631292422]]]),
            v=np.array([[[-0.7037352358069926], [-1.2654214710460525], [-0.6232744625373522]],
                        [[0.0413259793472436], [-2.3250307746388343], [-0.21879166393254573]]]),
            mask=np.array([[[True, False, False]], [[False, True, True]]]),
            bias=np.array([-11487.361467346524, -11487.619302430909, -11486.846774917174]), is_causal=False,
            scale=None),
        "capped": cases.SdpaCase(
            q=15 * rng.standard_normal((2, 2)), k=15 * rng.standard_normal((3, 2)), v=rng.standard_normal((3, 1)),
            mask=None, bias=rng.standard_normal((2, 3)) - 11500.0, is_causal=False, scale=10.0, softcap=50.0),
    }


@pytest.mark.parametrize("name", ["shifted_bias", "capped"])
def test_gradient_check_resolves_the_rounding_of_scores_near_1e4(name: str) -> None:
    # attention_np's correct gradients measured 1.84 (shifted_bias) and 34.1 (capped, where the oracle's central
    # difference of dk is exactly 0: k's step moves a capped score by less than a rounding of -11500) units of
    # what the comparison resolves before the oracle's rounding of its scores was counted (SPEC 9); a backward
    # pass without the softmax's rowsum term is still off by thousands of units
    from tests.implementations.broken_gradients import BROKEN_GRADIENTS

    case = _scores_near_1e4()[name]
    measures = gradient_checks.gradients(checks.Runner(attention_np), case, "float64")
    assert measures["gradients"].error <= 1, measures
    wrong = checks.Runner(BROKEN_GRADIENTS["softmax_jvp_without_rowsum"])
    assert gradient_checks.gradients(wrong, case, "float64")["gradients"].error > 100


def test_linear_heads_form_no_weights_and_no_weights_rows_measure():
    # attention="linear": the oracle's weights are None, so against_oracle reports no weights_rows for the case
    # (never a 0 that claims the weights were checked), and a module that returns weights anyway fails values
    case = fixed_cases.named("mha", "linear_grouped_rope_cross_attention").build()
    measures = checks.against_oracle(checks.Runner(attention_np), case, "float64")
    assert "weights_rows" not in measures and measures["values"].error <= 1e-9

    class WeightsAnyway:  # MultiHeadAttention, with uniform weights made up for linear heads
        @staticmethod
        def from_state_dict(state, **options):
            mha = attention_np.MultiHeadAttention.from_state_dict(state, **options)

            def call(q, k, v, mask=None, *, need_weights=True, rng=None):
                out, weights = mha(q, k, v, mask, need_weights=need_weights, rng=rng)
                H, (L, S) = mha.num_heads, (q.shape[-2], k.shape[-2])
                return out, np.full((*out.shape[:-2], H, L, S), 1 / S) if need_weights else weights

            return types.SimpleNamespace(eval=lambda: call, train=lambda: call)

    module = types.SimpleNamespace(__name__="weights_anyway", asarray=np.asarray, to_numpy=np.asarray,
                                   MultiHeadAttention=WeightsAnyway)
    values = checks.against_oracle(checks.Runner(module), case, "float64")["values"]
    assert values.error == math.inf and "returned where the case forms none" in values.detail


def _in_turn(*measures: dict[str, checks.Measure]) -> Callable:
    """A check that returns measures[0] on its first case, measures[1] on its second, the last from then on."""
    calls = [0]

    def check(runner: checks.Runner, case: object, dtype: str) -> dict[str, checks.Measure]:
        calls[0] += 1
        return measures[min(calls[0], len(measures)) - 1]
    return check


def test_every_printed_verdict_follows_from_the_printed_numbers():
    # in `check`'s text table, the main job's side-by-side table and the JSON, a row that ran passes exactly when
    # its printed worst is at most its printed tolerance: the tolerance its worst case (by error / tolerance) was
    # held to. A float32 case may have its own, looser than the table's 1e-4 (ten times the oracle's loss): here
    # values passes a case at 1e-3 within its own 2e-2, then fails one at 5e-4 over 1e-4 (the row's largest
    # error and largest tolerance, 1e-3 and 2e-2, would read as a pass); fast_path's worst case, 1.5e-2 within
    # its own 2e-2, reads as a failure against 1e-4
    group = suite.Group("sdpa", _in_turn(
        {"values": checks.Measure(1e-3, tolerance=2e-2), "fast_path": checks.Measure(1.5e-2, tolerance=2e-2)},
        {"values": checks.Measure(5e-4), "fast_path": checks.Measure(5e-5)}), dtypes=suite.FLOAT32, examples=2)
    rows = suite._run_group(checks.Runner(attention_np), group, "float32", examples=2, seed_=0, shrink=False,
                            tell=lambda what: None)
    assert [(row.check, row.worst, row.tolerance, row.passed) for row in rows] == [
        ("values", 5e-4, TOLERANCES["float32"]["values"], False), ("fast_path", 1.5e-2, 2e-2, True)]
    real = suite.check(attention_np, operations=("linear",), measures=("values",), max_examples=3, shrink=False)
    for report in (suite.Report(rows, seed=0, profile="fast", settings=[]), real):
        ran = [row.passed for row in report.rows if not row.skipped]
        text = [line.split() for line in suite.format_rows(report).splitlines()[1:] if "SKIP" not in line]
        assert [line[7] == "PASS" for line in text] == [float(line[5]) <= float(line[6]) for line in text] == ran
        cells = re.findall(r"(\S+) (<=|>) (\S+) (PASS|FAIL)", suite.format_side_by_side([report]))
        assert [verdict == "PASS" for *_, verdict in cells] == \
            [float(worst) <= float(tolerance) for worst, _, tolerance, _ in cells] == ran
        found = [row for row in json.loads(json.dumps(report.to_json()))["rows"] if not row["skipped"]]
        assert [row["passed"] for row in found] == [float(row["worst"]) <= row["tolerance"] for row in found] == ran


@pytest.mark.parametrize(("worst", "tolerance", "printed"), [
    (1.0004e-4, 1e-4, ("1.0004e-04", "1.0000e-04")),  # over by 4e-8: more digits, not 1.0e-04 twice
    (9.996e-5, 1e-4, ("1.0e-04", "1.0e-04")),  # within: equal as printed still reads as within
    (2.0049e-3, 2e-3, ("2.005e-03", "2.000e-03")), (2.04e-3, 2.05e-3, ("2.0e-03", "2.1e-03")),
    (math.inf, 0.0, ("inf", "0.0e+00")), (math.nan, 1e-9, ("nan", "1.0e-09")),
])
def test_printed_numbers_compare_as_the_numbers_do(worst, tolerance, printed):
    assert shown(worst, tolerance) == printed


def test_tests_read_the_float64_tolerance_of_reordered_math_from_the_table():
    # one home, conformance/contract/tolerances.json: a test holding float64 results of the same math computed
    # another way to 1e-12 reads REORDERED (tests/_compare.py), never a 1e-12 of its own: not in a tolerance it
    # names, nor in a call of tests/_compare.py's assert_close
    tests = pathlib.Path(__file__).parent
    own = [f"{path.relative_to(tests)}:{number}" for path in sorted(tests.rglob("*.py"))
           for number, line in enumerate(path.read_text().splitlines(), 1)
           if re.match(r"\s*\w*(TOL|tol)\w*\s*=\s*1e-12\b", line)
           or re.search(r"(?<![\w.])assert_close\(.*\b1e-12\b", line)]
    assert not own, own


def test_timed_check_reports_wall_and_cpu_seconds():
    # the main job prints each backend's CPU seconds from these (scripts/budget.sh reads them): the check's own,
    # within what this process spent around the call (a clock started with the process would count far more)
    before = suite.cpu_seconds()
    report, timing = suite.timed_check("attention_np", operations=("decode",), contract=False)
    around = suite.cpu_seconds() - before
    assert report.passed and 0 < timing.cpu <= around and timing.wall > 0
    joined = suite._joined([(report, timing), (report, suite.Timing(1.0, 2.0))])[1]
    assert joined == suite.Timing(timing.wall + 1.0, timing.cpu + 2.0)


def test_a_worker_of_the_main_job_exits_without_the_interpreters_teardown():
    # reports_in_parts' workers skip the teardown that frees every module and object one by one (seconds of CPU
    # after JAX's programs); the exit handlers registered later, as the frameworks' are, still run first
    code = ("from conformance.run import suite\nsuite._start_worker()\nimport atexit\n"
            "class Loud:\n    def __del__(self):\n        print('torn down', flush=True)\n"
            "kept = Loud()\natexit.register(print, 'a later exit handler ran')\nprint('end')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["end", "a later exit handler ran"], result.stdout


def test_the_modules_low_precision_gradients_run_in_float16_in_the_fast_profile_and_every_dtype_in_the_thorough():
    # their JAX compiles, each module's vjp per shape and dtype, would take more of the main job's CPU than it has
    low = gradient_checks.gradients_low_precision
    for operation in ("mha", "block"):
        for profile, max_examples, dtypes in (("fast", None, ("float16",)), ("thorough", 2, ("float16",)),
                                              ("thorough", None, ("float32", "float16", "bfloat16"))):
            found = [group for group in suite.groups_of(operation, profile, max_examples) if group.check is low]
            assert [group.dtypes_in(profile, max_examples) for group in found] == [dtypes], (operation, profile)
    report = suite.check("attention_np", operations=["mha"], measures=["gradient_values"], max_examples=1)
    assert {(row.check, row.dtype) for row in report.rows if not row.skipped} == {
        ("gradient_values", "float16"), ("deterministic", "float16")}, report.rows
    assert "float32" not in {row.dtype for row in report.rows}, report.rows  # not even as a skipped row
    for operation in ("sdpa", "flash", "linear"):
        found = [group for group in suite.groups_of(operation, "fast", None) if group.check is low]
        assert [group.dtypes_in("fast", None) for group in found] == [("float32", "float16", "bfloat16")]
