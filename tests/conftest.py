"""Shared fixtures: each test that takes `backend` runs once per installed backend.

XLA compiles the tests' tiny JAX programs for compile time, as the suite does (`_quick_jax_compiles`).

JAX runs with 64-bit types enabled and "highest" matmul precision, as the conformance suite does, so
float64 comparisons mean float64 on every backend; and with rank promotion raising and strict dtype
promotion, so the JAX backend is shown to need neither implicit broadcasting by rank nor promotion.
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import os
from types import ModuleType
from typing import Any

import pytest
import threadpoolctl

from conformance.frameworks.registry import JAX_CPU_COMPILER_OPTIONS

BACKENDS = ("attention_np", "attention_jax", "attention_torch")
QUICK_COMPILES_FROM = (0, 10)  # the jaxlib whose XLA knows every flag below: an unknown one aborts the process


def _quick_jax_compiles() -> None:
    """The tests' JAX programs are tiny, so compiling them costs far more than running them: XLA compiles
    them for compile time, with the suite's own options (conformance/frameworks/registry.py), here as XLA_FLAGS,
    which XLA reads once, when JAX starts, so before any test imports it. Results change within rounding
    (float64: 5e-16 at most)."""
    try:
        version = tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return
    if version >= QUICK_COMPILES_FROM:
        flags = " ".join(f"--{name}={str(value).lower()}" for name, value in JAX_CPU_COMPILER_OPTIONS.items())
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


_quick_jax_compiles()


def _one_thread_per_worker() -> None:
    """Under pytest-xdist (one worker per core), each worker's BLAS and torch, and the processes it starts, keep
    to one thread: two workers with a pool of two threads each on two cores spin against each other (the
    tests of flash, gradients, edge cases and flex took 12 % more CPU time, and as much more wall time, with the
    pools than without; the whole test command 3 %)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"  # read by the processes a test starts (NumPy is loaded here already)
    threadpoolctl.threadpool_limits(1)  # this worker's BLAS, loaded already
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


_one_thread_per_worker()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that run JAX are slow: XLA compiles each program a test runs (a second or more on 2 cores), the
    larger part of the whole run, so `pytest -m "not slow"`, the everyday loop, leaves them out. A test runs JAX
    when its id names it: the JAX backend's parameter, or JAX in the test's or its file's name."""
    for item in items:
        if "jax" in item.nodeid.lower():
            item.add_marker(pytest.mark.slow)


_FROZEN_BEFORE: list[str] = []  # the test file whose first test last froze what was alive


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before each test file's first test, what is alive (the frameworks' modules, JAX's compiled programs, the
    earlier files' caches) goes out of the cyclic collector's sight after a last collection (gc.freeze): a full
    collection then walks only the objects made since, where it walked every object of JAX, torch and Hypothesis
    again and again in a worker that holds more of them with every file (measured on gradients, linear_cache,
    mods_attention, serve and sinks: 3.4 s of CPU in full collections, 1.6 s frozen per file, of about 72 s).
    Objects made later are collected as before."""
    path = str(item.path)
    if not _FROZEN_BEFORE or _FROZEN_BEFORE[-1] != path:
        _FROZEN_BEFORE[:] = [path]
        gc.collect()
        gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    try:
        import jax
    except ImportError:
        return
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_numpy_rank_promotion", "raise")  # no implicit broadcasting by rank
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # no implicit dtype promotion


def import_backend(name: str) -> ModuleType:
    """The backend module, or a skip when its framework is not installed."""
    framework = {"attention_jax": "jax", "attention_torch": "torch"}.get(name)
    if framework is not None:
        pytest.importorskip(framework)
    return importlib.import_module(name)


def backend_rng(M: ModuleType, seed: int) -> object:
    """The backend's rng for `seed`: an int seed (NumPy), a key (JAX), a seeded Generator (torch)."""
    if M.__name__ == "attention_jax":
        import jax

        return jax.random.key(seed)
    if M.__name__ == "attention_torch":
        import torch

        return torch.Generator().manual_seed(seed)
    return seed


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> ModuleType:
    return import_backend(request.param)


def skip_without_devices(runner: Any, operation: str) -> None:
    """Skip a case of an operation that uses more devices than the runner's framework has in this process (the
    ring's on JAX and torch): tests/test_ring_suite.py runs the suite's rows on 4 simulated devices."""
    from conformance.contract.operations import OPERATIONS

    needed = OPERATIONS[operation].devices
    if needed > 1:
        with runner.framework.ring_devices(None) as available:
            if available < needed:
                pytest.skip(f"{operation} uses {needed} devices; {runner.framework.name} has {available} here")
