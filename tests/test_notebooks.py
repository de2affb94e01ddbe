"""Every notebook in notebooks/ runs from top to bottom.

Notebooks draw their figures from the real implementations, so a change that breaks a worker
function or a plot breaks here first. Each runs with ``DTFS_NOTEBOOK_SMALL=1`` (notebooks read it
to shrink their worlds and sweeps) and matplotlib's Agg backend, in a fresh ``python3`` kernel
started from the notebook's folder. A failing cell fails the test with that cell's error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported by the test that runs them: nbformat costs about 3 s to import
    # (jsonschema's format checkers), paid by every test worker and fork server that collects
    # this module otherwise
    import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_SECONDS = 240

pytestmark = pytest.mark.harness


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "notebooks/ holds no .ipynb file: nothing would be checked"


@pytest.mark.timeout(600)
@pytest.mark.long_running
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_small(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTFS_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    pythonpath = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + (os.pathsep + pythonpath if pythonpath else ""))
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_SECONDS,
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute()
    except CellTimeoutError as err:
        pytest.fail(
            f"{path.name}: a cell ran longer than {CELL_TIMEOUT_SECONDS} s with "
            f"DTFS_NOTEBOOK_SMALL=1:\n{str(err)[:1500]}",
            pytrace=False,
        )
    except CellExecutionError as err:
        index = next((i for i, cell in enumerate(notebook.cells) if _has_error(cell)), None)
        where = f"cell {index}" if index is not None else "a cell"
        pytest.fail(
            f"{path.name}: {where} failed with {err.ename}: {err.evalue}\n"
            f"{_source_head(notebook, index)}",
            pytrace=False,
        )


def _has_error(cell: nbformat.NotebookNode) -> bool:
    return any(output.get("output_type") == "error" for output in cell.get("outputs", []))


def _source_head(notebook: nbformat.NotebookNode, index: int | None) -> str:
    if index is None:
        return ""
    lines = notebook.cells[index].source.splitlines()[:6]
    return "  cell starts:\n" + "\n".join(f"    {line}" for line in lines)
