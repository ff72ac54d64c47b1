"""float16 and bfloat16: accepted wherever the framework has them, the output keeps the input dtype, and the
error against float64 is at most twice that of the framework's own implementation on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest

from conformance import docs
from conformance.bench import precision

CASES = [pytest.param(framework, operation, dtype, id=f"{framework}-{operation}-{dtype}")
         for (framework, operation), (_, dtypes) in precision.MEASURES.items() for dtype in dtypes]


@pytest.mark.parametrize(("framework", "operation", "dtype"), CASES)
def test_our_error_is_at_most_twice_the_frameworks_own_and_the_dtype_is_kept(framework: str, operation: str,
                                                                           dtype: str):
    pytest.importorskip({"NumPy": "numpy", "torch": "torch", "JAX": "jax"}[framework])
    measure, _ = precision.MEASURES[framework, operation]
    found = measure(dtype)
    assert found.kept_dtype
    assert found.explicit <= 2 * found.theirs, found
    assert found.fast is None or found.fast <= 2 * found.theirs, found


@pytest.mark.slow  # every measure once more, JAX's in two dtypes
def test_the_performance_page_shows_the_errors_measured_now():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    page = (docs.ROOT / "docs" / "performance.md").read_text()
    assert docs.shown(page, "low-precision") == precision.table(), "python -m conformance docs --write"


def test_bfloat16_arrays_convert_to_numpy_exactly(backend):
    # NumPy has no bfloat16: to_numpy gives ml_dtypes' bfloat16, value for value
    pytest.importorskip("ml_dtypes")
    if backend.__name__ == "attention_np":
        pytest.skip("NumPy has no bfloat16 arithmetic")
    values = np.array([1.0, -2.5, 3.140625, 1e-3], np.float32)
    if backend.__name__ == "attention_torch":
        import torch

        native = torch.tensor(values).to(torch.bfloat16)
    else:
        import jax.numpy as jnp

        native = jnp.asarray(values, jnp.bfloat16)
    converted = backend.to_numpy(native)
    assert converted.dtype.name == "bfloat16"
    assert np.array_equal(converted.astype(np.float32), values.astype(converted.dtype).astype(np.float32))
