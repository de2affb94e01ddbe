"""``notebooks/ring_allreduce.ipynb`` says nothing about its results that its outputs contradict.

The notebook prints every conclusion it draws, computed from the run's own data by the
``*_lines`` functions of ``solutions/phase3_multi_node/ring_study/notebook.py``. This test reads the
committed outputs, parses the data the notebook printed (the recorded grid of chunks, the busbw
table, the fitted alpha-beta table), computes the conclusions again from it, and fails when a
printed conclusion differs: a notebook re-executed on another machine stays consistent, and an
edit that prints a claim the data does not support is caught. The prose cells must state no
measured outcome (no crossover, peak or winner) and no index formula of exercise 3.1.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from solutions.phase3_multi_node.benchmarks.collectives import Fit, Row, crossovers
from solutions.phase3_multi_node.ring_study import notebook as rn

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "ring_allreduce.ipynb"
UNITS = {"B": 1, "KiB": 1024, "MiB": 2**20}

pytestmark = pytest.mark.harness

if TYPE_CHECKING:  # imported where the notebook is read: about 3 s to import (tests/test_notebooks.py)
    import nbformat


def _cells() -> list[nbformat.NotebookNode]:
    import nbformat

    return list(nbformat.read(NOTEBOOK, as_version=4).cells)


def _output(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")


def _cell_with(code: str) -> nbformat.NotebookNode:
    found = [c for c in _cells() if c.cell_type == "code" and code in c.source]
    assert len(found) == 1, f"expected one code cell containing {code!r}, found {len(found)}"
    assert _output(found[0]), f"the cell with {code!r} has no committed output: re-execute it"
    return found[0]


def _size(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def _table(text: str, first_column: str) -> list[list[str]]:
    """The data rows of the markdown table in ``text`` whose header starts with ``first_column``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _rows() -> list[Row]:
    out = _output(_cell_with("measure_curves("))
    return [
        Row(int(r[0]), int(_size(r[1])), r[2], float(r[3]) / 1e3, 0)
        for r in _table(out, "world | size")
    ]


def _fits() -> list[Fit]:
    out = _output(_cell_with("measure_curves("))
    return [
        Fit(int(r[0]), r[1], float(r[2]) * 1e-6, float(r[3]) * 1e-9)
        for r in _table(out, "world | algorithm")
    ]


def test_the_grid_checks_follow_from_the_recorded_grid() -> None:
    out = _output(_cell_with("record_ring(world=N"))
    grid = [
        [int(c) for c in match[1].split(",")]
        for match in re.finditer(r"rank \d+ sent chunks \[([\d, ]+)\]", out)
    ]
    assert grid, f"no recorded grid in the output:\n{out}"
    printed = _output(_cell_with("grid_lines(grid)"))
    for line in rn.grid_lines(grid):
        assert line in printed, f"the grid says {line!r}; the notebook printed:\n{printed}"


def test_the_busbw_statements_follow_from_the_printed_table() -> None:
    rows = _rows()
    printed = _output(_cell_with("measure_curves("))
    for line in rn.curve_lines(rows):
        assert line in printed, f"the table says {line!r}; the notebook printed:\n{printed}"


def test_the_fitted_constants_and_winners_follow_from_the_printed_fits() -> None:
    fits, rows = _fits(), _rows()
    printed = _output(_cell_with("measure_curves("))
    for line in rn.alpha_lines(fits):  # alphas printed to 0.1 us: allow the last digit
        world, low, high = re.findall(r"\d+", line)[:3]
        match = re.search(rf"world {world}: fitted alpha from (\d+) to (\d+) us", printed)
        assert match, f"no fitted-alpha line for world {world} in:\n{printed}"
        assert abs(int(match[1]) - int(low)) <= 1 and abs(int(match[2]) - int(high)) <= 1, line
    sizes = sorted({r.nbytes for r in rows})
    winners = _output(_cell_with("model_lines("))
    for line in rn.model_lines(fits, sizes[0], sizes[-1], "solutions"):
        assert line in winners, f"the fits say {line!r}; the notebook printed:\n{winners}"


def test_the_printed_crossovers_follow_from_the_printed_fits() -> None:
    fits = _fits()
    world = max(f.world for f in fits)
    printed = [
        line
        for line in _output(_cell_with("model_lines(")).splitlines()
        if line.startswith(f"world {world}:") and (" vs " in line or "faster below" in line)
    ]
    expected = [
        line
        for line in crossovers(fits, 2, "solutions")
        if line.startswith(f"world {world}:") and "ring" in line
    ]
    assert len(printed) == len(expected), (printed, expected)
    number = re.compile(r"([\d.]+) (KiB|MiB|B)")
    for got, want in zip(printed, expected, strict=True):
        assert number.sub("N", got) == number.sub("N", want), (got, want)
        for a, b in zip(number.findall(got), number.findall(want), strict=True):
            assert _size(" ".join(a)) == pytest.approx(_size(" ".join(b)), rel=0.05), (got, want)


def test_the_prose_states_no_measured_outcome_and_no_index_formula() -> None:
    banned = [
        r"\(r\s*-\s*1\s*-\s*s\)",
        r"\(r\s*-\s*s\)",
        r"\(r\s*-\s*2\s*-\s*s\)",
        r"tree wins",
        r"peaks? around",
        r"no crossover",
        r"is predicted faster",
    ]
    for cell in _cells():
        if cell.cell_type != "markdown":
            continue
        for pattern in banned:
            assert not re.search(pattern, cell.source, re.IGNORECASE), (
                f"a prose cell says {pattern!r}: print such a statement from the data instead\n"
                f"{cell.source[:300]}"
            )
