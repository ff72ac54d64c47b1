"""The frameworks' built-ins as modules of the contract (conformance/builtins): the kernel wrappers pass every
sdpa row that applies to them, each module computes what our backends compute where the spec and the built-in
agree, and its declaration names real features with the measured reason. A built-in whose framework is not
installed is skipped."""

from __future__ import annotations

import contextlib
import importlib
import types

import numpy as np
import pytest

from conformance import check
from conformance.builtins import BUILT_INS, module_names
from conformance.contract.cases import mha_case, random_mask, sdpa_case
from conformance.contract.features import FEATURES, declaration_of
from conformance.run.checks import Runner, expected
from tests._compare import assert_close


def _builtin(name: str) -> types.ModuleType:
    """The built-in's module, or a skip when its framework is missing."""
    try:
        return importlib.import_module(f"conformance.builtins.{name}")
    except ImportError as error:
        pytest.skip(f"{name}: {error}")


@contextlib.contextmanager
def _their_promotion(name: str):
    """The JAX built-ins' own code needs JAX's default promotion, which tests/conftest.py makes strict for
    ours: jax.nn mixes float32 into float64, Keras broadcasts its biases by rank."""
    if name not in ("jax_sdpa", "flax_mha", "keras_mha"):
        yield
        return
    import jax

    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def _failures(report) -> str:
    return "\n\n".join(row.failure for row in report.rows if row.failure)


@pytest.mark.slow  # the suite's sdpa part
@pytest.mark.parametrize("name", ["torch_sdpa", "jax_sdpa"])
def test_a_wrapped_kernel_passes_every_sdpa_row_that_applies(name: str):
    module = _builtin(name)
    with _their_promotion(name):
        report = check(module, operations=("sdpa",))
    assert report.passed, _failures(report)
    skipped = [row for row in report.rows if row.skipped]
    assert skipped and all(row.skipped.startswith(("lacks ", "no ")) for row in skipped)
    assert any(row.check == "values" and row.examples > 1 and not row.skipped for row in report.rows)


@pytest.mark.parametrize("name", BUILT_INS)
def test_every_declaration_names_features_and_says_why(name: str):
    declaration = declaration_of(_builtin(name))
    assert declaration.lacks and set(declaration.lacks) <= set(FEATURES)
    assert all(why for why in declaration.lacks.values()), declaration


@pytest.mark.parametrize("name", [name for name in BUILT_INS if name.endswith("sdpa")])
def test_a_kernel_equals_the_oracle_where_the_spec_and_it_agree(name: str):
    module, case = _builtin(name), sdpa_case((2, 2), 3, 5, mask=random_mask(2, 2, 3, 5), is_causal=True)
    with _their_promotion(name), Runner(module).framework.pinned():
        out, _ = Runner(module).run(case, "float32")
    assert_close(out, expected(case)[0], 1e-5, name)


@pytest.mark.parametrize("name", [name for name in BUILT_INS if name.endswith("mha")])
def test_a_layer_holding_our_state_equals_the_oracle(name: str):
    # one mask for both heads, every query seeing a key: where every built-in agrees with the spec
    module, case = _builtin(name), mha_case((2,), 3, 5, mask=random_mask(2, 1, 3, 5))._replace(dropout=0.0)
    with _their_promotion(name), Runner(module).framework.pinned():
        out, weights = Runner(module).run(case, "float64")
    want_out, want_weights = expected(case)
    assert_close(out, want_out, 1e-9, name)
    if weights is not None:  # nn.MultiheadAttention's are averaged over the heads
        want = want_weights if weights.shape == want_weights.shape else want_weights.mean(axis=-3)
        assert_close(weights, want, 1e-9, f"{name} weights")


def test_the_fast_encoder_layer_runs_torch_s_fused_kernel(monkeypatch: pytest.MonkeyPatch):
    torch = pytest.importorskip("torch")
    from conformance.builtins import torch_encoder_layer_fast
    from conformance.contract.cases import block_case

    fused = torch._transformer_encoder_layer_fwd
    calls = []
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *args: calls.append(1) or fused(*args))
    case = block_case((2,), 4, mask=random_mask(2, 1, 4, 4))._replace(dropout=0.0)  # H = 2: even
    out, _ = Runner(torch_encoder_layer_fast).run(case, "float64")
    assert calls and np.isfinite(out).all()
    assert_close(out, expected(case)[0], 1e-9, "fast path")


def test_the_keras_module_refuses_another_backend(monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("keras")
    import sys

    import keras

    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    monkeypatch.delitem(sys.modules, "conformance.builtins.keras_mha", raising=False)
    with pytest.raises(ImportError, match="needs Keras on the JAX backend, not 'torch'"):
        importlib.import_module("conformance.builtins.keras_mha")
    monkeypatch.delitem(sys.modules, "conformance.builtins.keras_mha", raising=False)


def test_the_built_ins_are_importable_by_name():
    assert module_names() == [f"conformance.builtins.{name}" for name in BUILT_INS]
