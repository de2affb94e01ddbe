"""Cases for the scoreboard's "Next" (tests/test_harness.py runs them in a pytest of their own):
one test of 2.6 stops at an unwritten TODO, another fails for a function already written.

Not collected by ``uv run pytest`` (the name does not start with ``test_``): they fail on purpose.
"""

from __future__ import annotations

import pytest
from grading import exercise

WRITTEN_SITE = "phase2_advanced/template_tensor_parallel_ops.py:60 in f.forward"


@exercise("2.6")
def test_stops_at_an_unwritten_todo() -> None:
    raise NotImplementedError("TODO 2.6: the row-parallel layer; see guidelines.md#26")


@exercise("2.6")
def test_a_written_function_fails() -> None:
    pytest.fail(f"2.6 f's forward: every rank returned twice its input\n  at {WRITTEN_SITE}")
