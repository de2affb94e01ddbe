"""``notebooks/lm_layouts.ipynb`` says nothing about its results that the results files contradict.

The notebook runs nothing: it draws the language model's recorded results
(``phase4_production/results/lm_*.json``) and prints every conclusion it draws, computed from
those files by the ``*_lines`` functions of ``solutions/phase4_production/lm/layouts_notebook.py``.
This test reads the committed outputs and

* computes the conclusions again from the files: a printed line that differs (a file
  re-recorded without re-executing the notebook, or an edit that prints a claim the data does not
  support) fails;
* checks those conclusions against what the recording programs themselves stated in the files'
  values and columns (rank correlations, ratios, verdicts, what fits), so the module's
  arithmetic cannot drift from the benchmarks';
* checks that the module reads its numbers from the files (a changed file changes the lines);
* checks that the prose cells state no number and no measured outcome: numbers are printed.

It does not run the notebook (tests/test_notebooks.py does).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from solutions.phase4_production.lm import layouts_notebook as ln

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "lm_layouts.ipynb"

pytestmark = pytest.mark.harness

# the code each printing cell calls -> the lines it must print, exactly, in this order
PRINTED: dict[str, Callable[[], list[str]]] = {
    "ln.throughput_lines()": lambda: ln.throughput_lines() + ln.gpu_lines(),
    "ln.memory_lines()": ln.memory_lines,
    "ln.planner_lines()": ln.planner_lines,
    "ln.traffic_lines()": ln.traffic_lines,
    "ln.example_lines()": ln.example_lines,
}


def cells() -> list[dict[str, Any]]:
    return list(json.loads(NOTEBOOK.read_text())["cells"])


def source(cell: dict[str, Any]) -> str:
    text = cell["source"]
    return text if isinstance(text, str) else "".join(text)


def printed(cell: dict[str, Any]) -> str:
    return "".join(
        "".join(output.get("text", ""))
        for output in cell.get("outputs", [])
        if output.get("output_type") == "stream" and output.get("name") == "stdout"
    )


def output_of(code: str) -> str:
    found = [c for c in cells() if c["cell_type"] == "code" and code in source(c)]
    assert len(found) == 1, f"expected one code cell calling {code!r}, found {len(found)}"
    out = printed(found[0])
    assert out, f"{NOTEBOOK.name}: the cell calling {code!r} has no committed output: re-execute it"
    return out


@pytest.mark.parametrize("code", list(PRINTED))
def test_the_printed_conclusions_follow_from_the_results_files(code: str) -> None:
    got = output_of(code).splitlines()
    want = PRINTED[code]()
    assert got == want, (
        f"{NOTEBOOK.name}: the cell calling {code} printed lines the results files do not give "
        "now (re-record, then re-execute the notebook; or print only what the functions return)"
        f":\nprinted:\n  " + "\n  ".join(got) + "\nfrom the files:\n  " + "\n  ".join(want)
    )


def test_the_notebook_names_the_recorded_runs() -> None:
    out = output_of("ln.load(name)")
    for name in ("lm_layouts", "lm_planner_w4", "lm_planner_w8", "lm_70b", "lm_gpu"):
        data = ln.load(name)
        assert f"{name}.json: recorded {data['recorded']}" in out, name
        assert data["command"] in out, name


# ----------------------------------------------------------------------------- the recorders' word


def test_the_planner_lines_agree_with_what_planner_check_recorded() -> None:
    claims = _planner_claims()
    for world, (measured_range, correlation, choice) in zip((4, 8), claims, strict=True):
        values = ln.load(f"lm_planner_w{world}")["values"]
        assert measured_range == values["time_ratios"], (world, measured_range, values)
        assert correlation == values["rank_correlation"], (world, correlation, values)
        assert choice == values["first_choice"], (world, choice, values)
        steps = ln.planner_steps(world)
        fastest = min(steps, key=lambda s: s.measured_ms).layout
        assert fastest == ln._layout(values["fastest"]), (world, fastest, values["fastest"])
        band = ln.time_band(world)
        inside = all(band[0] <= s.ratio <= band[1] for s in steps)
        assert (values["time_band_met"] == "met") == inside, (world, band, values)


def _planner_claims() -> list[tuple[str, str, str]]:
    claims = []
    lines = ln.planner_lines()
    for world in (4, 8):
        ratio = next(line for line in lines if line.startswith(f"world {world}: measured"))
        choice = next(line for line in lines if line.startswith(f"world {world}: the planner"))
        match = re.search(r"measured / predicted (\S+);.* orders ([\d.]+)$", ratio)
        pick = re.search(r"first choice (.+) measured [\d.]+ ms", choice)
        assert match and pick, (ratio, choice)
        claims.append((match[1], match[2], pick[1]))
    return claims


def test_the_library_ratios_are_the_benchmarks_round_by_round_ones() -> None:
    values = ln.load("lm_layouts")["values"]
    for v in ln.versus():
        key = v.layout.replace(" ", "_").replace("(", "").replace(")", "").replace("-", "_")
        key = f"vs_library_{key.lower()}"
        assert f"{v.ratio:.2f}x" == values[key], (v, values[key])
        assert v.verdict == values[f"{key}_verdict"], (v, values[f"{key}_verdict"])
    series = ln.throughputs()
    for t in series:  # the whiskers bracket the median
        assert t.slowest <= t.tokens_per_second <= t.fastest, t


def test_the_gpu_ratios_are_the_recorded_ones() -> None:
    table = ln.rows(ln.load("lm_gpu"), "throughput")
    lines = ln.gpu_lines()[1:]
    assert len(lines) == len(table)
    for row, line in zip(table, lines, strict=True):
        assert f"{row['vs PyTorch fp32']} PyTorch's float32 step" in line, (row, line)


def test_the_memory_lines_agree_with_the_recorded_columns() -> None:
    for world in (4, 8):
        for m, row in zip(ln.planned_memory(world), ln.rows(ln.load(f"lm_planner_w{world}"),
                                                            "check"), strict=True):
            assert row["states MiB predicted / measured"] == (
                f"{m.states_predicted:.2f} / {m.states_measured:.2f}"
            ), row
    for h in ln.held():
        assert abs(h.params + h.grads + h.optimizer - h.states) <= 0.02, h  # parts rounded apart


def test_the_traffic_lines_agree_with_the_recorded_bytes_off() -> None:
    values = ln.load("lm_layouts")["values"]
    line = ln.traffic_lines()[0]
    assert line.endswith(f"total bytes off {values['bytes_off']}"), line
    if values["bytes_off"] == "0":
        assert all(a.formula == a.measured for a in ln.traffic()), ln.traffic()


def test_the_example_lines_agree_with_the_worked_examples_own_verdicts() -> None:
    data = ln.load("lm_70b")
    gb = ln.device_gb()
    fits_column = f"fits {gb:g} GB"
    table = ln.rows(data, "layouts")
    worked = [c for c in ln.candidates() if c.source == "worked"]
    for row, c in zip(table, worked, strict=True):
        assert (row[fits_column] == "yes") == (c.total_gb <= gb), (row, c)
    assert f"{gb:g} GB" in data["tables"]["layouts"]["note"], "the device's memory in the note"
    values = data["values"]
    planned = [c for c in ln.candidates() if c.source == "planner"]
    assert planned[0].layout == values["planned_first"]
    assert f"{round(planned[0].total_gb)} GB" == values["planned_first_gb"]
    dp = next(c for c in worked if c.layout == "dp1024")
    assert f"{round(dp.total_gb):,} GB" == values["dp1024_gb"]


# ----------------------------------------------------------------------------- read, not typed


def test_the_lines_are_read_from_the_files(tmp_path: Path) -> None:
    """Another planner measurement and another device in copies of the files: the lines
    follow them."""
    results = tmp_path / "results"
    shutil.copytree(ln.RESULTS, results)
    path = results / "lm_planner_w4.json"
    data = json.loads(path.read_text())
    data["tables"]["check"]["rows"][-1][4] = "1.40x"
    path.write_text(json.dumps(data))
    world4 = ln.planner_lines(worlds=(4,), results=results)[0]
    assert "-1.40x; inside" in world4 and "band: 7 of 8 layouts" in world4, world4
    path = results / "lm_70b.json"
    data = json.loads(path.read_text())
    columns = data["tables"]["layouts"]["columns"]
    columns[[c.startswith("fits ") for c in columns].index(True)] = "fits 40 GB"
    path.write_text(json.dumps(data))
    example = ln.example_lines(results)
    assert example[0].endswith("40 GB per GPU"), example
    assert "fit 40 GB" in example[1], example


# ----------------------------------------------------------------------------- the prose

# Prose explains how to read a plot; a result is printed. These name a result in words.
OUTCOME = (
    r"\b(?:is|are|was|were|runs?|ran) (?:faster|slower)\b",
    r"\bfaster than\b",
    r"\bslower than\b",
    r"\boutperform",
    r"\bbeats?\b",
    r"\bwins?\b",
    r"\b(?:inside|within) the band\b",
    r"\bevery layout fits\b",
    r"\b(?:does|do) not fit\b",
    r"\bagrees? (?:closely|well)\b",
    r"\bmatch(?:es)? exactly\b",
    r"\b(?:billion|million|thousand|percent)\b",
)


def prose(cell: dict[str, Any]) -> str:
    """A markdown cell without its code spans, its section numbers and the exercises it names
    (``exercise 3.5``): what remains may hold no digit."""
    text = re.sub(r"`[^`]*`", "", source(cell))
    text = re.sub(r"^#+\s*\d+\.\s", "", text, flags=re.M)
    text = re.sub(r"^\d+\.\s", "", text, flags=re.M)  # a numbered list
    return re.sub(r"\b[Ee]xercises? \d\.\d+\b", "", text)


def test_the_prose_states_no_number_and_no_outcome() -> None:
    markdown = [c for c in cells() if c["cell_type"] == "markdown"]
    assert markdown, f"{NOTEBOOK.name} has no prose cell"
    for cell in markdown:
        text = prose(cell)
        digits = re.findall(r"\S*\d\S*", text)
        assert not digits, (
            f"{NOTEBOOK.name}: a prose cell states {digits}: print numbers from the data "
            f"(layouts_notebook's *_lines) instead\n{source(cell)[:300]}"
        )
        for pattern in OUTCOME:
            assert not re.search(pattern, text, re.IGNORECASE), (
                f"{NOTEBOOK.name}: a prose cell says {pattern!r}: print such a statement from "
                f"the data instead\n{source(cell)[:300]}"
            )


def test_the_prose_check_catches_a_number_and_an_outcome() -> None:
    """The check itself: a typed measurement and an outcome in words are both found."""
    for text in ("The course runs 39,700 tokens/s.", "Data parallel is faster than ZeRO."):
        cell = {"cell_type": "markdown", "source": text}
        caught = re.findall(r"\S*\d\S*", prose(cell)) or any(
            re.search(p, prose(cell), re.IGNORECASE) for p in OUTCOME
        )
        assert caught, text
    kept = {"cell_type": "markdown",
            "source": "## 3. The planner\n\nExercise 4.7, as exercise 3.5 does, in `w4.json`"}
    assert not re.findall(r"\S*\d\S*", prose(kept)), prose(kept)
