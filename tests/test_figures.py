"""The scaling figure's numbers show what its panels claim; the command writes a PNG."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from conformance.bench import figures

ROOT = pathlib.Path(__file__).resolve().parents[1]
SWEEP = (4, 64, 1024)


def test_unscaled_score_std_grows_as_sqrt_d_k() -> None:
    # each score is a sum of d_k products of independent unit normals: variance d_k
    std = figures.score_std(SWEEP, scaled=False)
    np.testing.assert_allclose(std / np.sqrt(SWEEP), 1.0, rtol=0.1)
    assert std[-1] / std[0] == pytest.approx(math.sqrt(1024 / 4), rel=0.1)  # 16 times wider


def test_scaled_score_std_stays_near_one() -> None:
    # divided by sqrt(d_k): variance d_k / d_k = 1 at every width
    np.testing.assert_allclose(figures.score_std(SWEEP, scaled=True), 1.0, rtol=0.05)


def test_unscaled_max_weight_rises_toward_one_and_scaled_does_not() -> None:
    unscaled, scaled = (figures.max_weight(SWEEP, scaled=s) for s in (False, True))
    assert np.all(np.diff(unscaled) > 0) and unscaled[-1] > 0.9, unscaled
    assert np.ptp(scaled) < 0.05 and np.all(scaled < 0.2), scaled  # uniform is 1/64, one-hot is 1
    assert np.all(scaled > 1 / figures.S)


def test_unscaled_gradient_vanishes_and_scaled_stays_within_a_small_factor() -> None:
    unscaled, scaled = (figures.score_gradient_norm(SWEEP, scaled=s) for s in (False, True))
    median = 1  # column of figures.QUANTILES = (0.25, 0.5, 0.75)
    assert unscaled[0, median] / unscaled[-1, median] > 100, unscaled  # orders of magnitude
    assert np.max(scaled) / np.min(scaled) < 2, scaled  # every quantile at every width
    assert np.all(np.diff(unscaled[:, median]) < 0), unscaled


def test_numbers_are_reproducible_and_independent_of_the_sweep() -> None:
    # each d_k draws from its own generator seeded with (seed, d_k)
    alone = figures.score_gradient_norm((64,), scaled=False)
    np.testing.assert_array_equal(alone[0], figures.score_gradient_norm(SWEEP, scaled=False)[1])
    assert not np.array_equal(alone, figures.score_gradient_norm((64,), scaled=False, seed=1))


@pytest.mark.slow
def test_figure_command_writes_a_png(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "figures" / "scaling.png"
    result = subprocess.run([sys.executable, "-m", "conformance", "figure", "scaling", "--output", str(path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert str(path) in result.stdout


@pytest.mark.slow
def test_figures_import_matplotlib_only_when_they_draw() -> None:
    code = ("import sys\nimport conformance.bench.figures\n"
            "conformance.bench.figures.score_std((4,), scaled=True)\n"
            "print('loaded:', [name for name in sys.modules if name.partition('.')[0] == 'matplotlib'])")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "loaded: []", result.stdout
