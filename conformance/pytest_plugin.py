"""pytest integration: `pytest --pyargs conformance --conformance-module NAME` runs the suite on NAME.

Registered as a pytest plugin by the distribution's entry point, so the options exist wherever the
package is installed; it imports nothing heavy until a conformance test runs.
"""

from __future__ import annotations

import pytest

from .run.profiles import PROFILES


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "attention conformance suite")
    group.addoption("--conformance-module", action="append", default=[], metavar="NAME",
                    help="an importable implementation of the attention contract to check (repeatable)")
    group.addoption("--conformance-profile", default="fast", choices=tuple(PROFILES),
                    help="fast (default) or thorough")
    group.addoption("--conformance-seed", type=int, default=0, help="Hypothesis seed (default 0)")
    group.addoption("--conformance-max-examples", type=int, default=None, metavar="N",
                    help="N examples for every check, instead of the profile's numbers")
    group.addoption("--conformance-devices", type=int, default=None, metavar="P",
                    help="P simulated devices for ring attention: JAX's CPU devices (set before JAX starts), "
                         "torch's peer processes")


def pytest_configure(config: pytest.Config) -> None:
    if devices := config.getoption("conformance_devices", None):
        from .frameworks.registry import simulate_jax_devices

        simulate_jax_devices(devices)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_module" in metafunc.fixturenames:
        names = metafunc.config.getoption("conformance_module")
        metafunc.parametrize("conformance_module", names or [None], ids=names or ["no-module"])
