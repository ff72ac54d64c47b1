"""`python -m conformance compare --complexity` (conformance/bench/complexity.py): its rows, slopes, table, crossover,
JSON and plot at a tiny size, NumPy only; the fit and the crossover on made-up times. No timing value is asserted."""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

from conformance.__main__ import main
from conformance.bench import complexity
from conformance.bench.complexity import FORMS, Row

LABELS = [form.label for form in FORMS]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, pathlib.Path]:
    """One run of the command at n = 8, 16, one repeat, NumPy only: (stdout, the JSON, the plot's path)."""
    folder = tmp_path_factory.mktemp("complexity")
    capture = folder / "stdout.txt"
    with capture.open("w") as stdout, pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdout", stdout)
        code = main(["compare", "--complexity", "--sizes", "8,16", "--repeats", "1", "--backends", "numpy",
                     "--json", str(folder / "rows.json"), "--plot", str(folder / "complexity.png")])
    assert code == 0, capture.read_text()
    return capture.read_text(), json.loads((folder / "rows.json").read_text()), folder / "complexity.png"


def test_every_form_has_a_row_at_every_size(tiny_run: tuple[str, dict, pathlib.Path]) -> None:
    stdout, document, _ = tiny_run
    printed = {tuple(re.split(r"\s{2,}", line.strip())[:3]) for line in stdout.splitlines()}
    assert {("attention_np", label, n) for label in LABELS for n in ("8", "16")} <= printed, stdout
    rows = document["rows"]
    assert len(rows) == len(LABELS) * 2 and set(rows[0]) == set(Row._fields)
    for row in rows:
        assert row["time_ms"] > 0 and row["rel_error"] < 1e-4, row  # float32 against float64: wiring, not noise


def test_the_table_prints_the_tutorials_columns_and_a_slope_per_form(tiny_run: tuple[str, dict, pathlib.Path]) -> None:
    stdout, document, _ = tiny_run
    header = "row  tutorial: time  sequential  our form  sequential steps  numpy slope  fitted over n"
    assert header in re.sub(r" {2,}", "  ", stdout), stdout
    for label in LABELS:  # the tutorial's row, its time and steps, ours, the slope fitted over 8..16
        line = next(line for line in stdout.splitlines() if f"  {label}  " in line and "O(" in line)
        assert re.search(r"  -?\d+\.\d\d  8\.\.16$", line), line
    assert {(fit["form"], fit["sizes"] == [8, 16]) for fit in document["fits"]} == {(label, True) for label in LABELS}
    assert all(math.isfinite(fit["slope"]) for fit in document["fits"])
    assert [found["backend"] for found in document["crossovers"]] == ["attention_np"]
    assert "attention_np: linear chunked" in stdout


def test_the_plot_is_written(tiny_run: tuple[str, dict, pathlib.Path]) -> None:
    assert tiny_run[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _rows(times: dict[str, dict[int, float]]) -> list[Row]:
    return [Row("attention_np", framework="numpy", form=form, n=n, repeats=1, time_ms=ms, rel_error=None)
            for form, line in times.items() for n, ms in line.items()]


def test_slope_of_an_exact_power_law_fitted_over_the_upper_sizes() -> None:
    # time = n^2 / 1000 ms from n = 1024 on, and a flat 5 ms below (overheads): the fit sees only n >= FIT_FROM
    times = {n: (n * n / 1000 if n >= complexity.FIT_FROM else 5.0) for n in (256, 512, 1024, 2048, 4096)}
    (fit,) = complexity.fits(_rows({"softmax flash": times}))
    assert fit.sizes == (1024, 2048, 4096) and fit.slope == pytest.approx(2.0)


def test_crossover_interpolated_in_log_space_by_hand() -> None:
    # chunked / fastest softmax: 2 at n = 64, 1/2 at n = 256, so log ratio goes +log 2 -> -log 2 and its zero lies
    # halfway between log 64 and log 256: n = sqrt(64 * 256) = 128. At n = 256 explicit (2 ms) beats flash (3 ms).
    rows = _rows({"linear chunked": {64: 2.0, 256: 1.0}, "softmax flash": {64: 1.0, 256: 3.0},
                  "softmax explicit": {64: 1.5, 256: 2.0}, "recurrent loop": {64: 0.1, 256: 0.1}})
    (found,) = complexity.crossovers(rows)
    assert found.n == pytest.approx(128.0) and found.where == "between 64 and 256"
    assert found.rival == "softmax explicit"  # the loop, linear attention, is no rival


def test_crossover_outside_the_sizes_is_named_not_invented() -> None:
    faster = complexity.crossovers(_rows({"linear chunked": {64: 1.0, 128: 1.0}, "softmax fast": {64: 2.0, 128: 4.0}}))
    slower = complexity.crossovers(_rows({"linear chunked": {64: 3.0, 128: 5.0}, "softmax fast": {64: 2.0, 128: 4.0}}))
    assert (faster[0].n, faster[0].where) == (None, "at 64, the smallest n")
    assert (slower[0].n, slower[0].where, slower[0].rival) == (None, "up to 128", None)


def test_memory_caps_stop_the_quadratic_forms_first() -> None:
    # float32: the (L, S) scores 4 n^2 bytes are 256 MiB at n = 8192 and 1 GiB at 16384; the prefix states
    # 4 n E Ev = 16384 n bytes are 256 MiB at n = 16384 and 512 MiB at 32768
    def capped(n: int) -> list[str]:
        return [form.label for form in FORMS if form.largest is not None and form.largest(n) > complexity.MEMORY_LIMIT]

    assert capped(8192) == []
    assert capped(16384) == ["softmax explicit", "softmax fast"]
    assert capped(32768) == ["softmax explicit", "softmax fast", "linear parallel"]
