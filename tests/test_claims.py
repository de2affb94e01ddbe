"""Every measured result a page quotes is the one its results file holds (course/results.py).

Guides and the README quote measurements through marked blocks rendered from the JSON files
benchmarks write with ``--record``; this fails when a page and its data disagree, or when a page
quotes a file or a key that does not exist. Fix: re-run the benchmark's recorded command (in the
file's ``command``), then ``uv run python -m course.results --write``.
"""

from __future__ import annotations

import pytest

from course import results

pytestmark = pytest.mark.harness


def test_pages_quote_their_results_files_exactly() -> None:
    problems = results.check()
    assert not problems, "\n".join(problems)


def test_every_quoted_results_file_says_how_it_was_made() -> None:
    for rel in sorted(results.quoted_files()):
        data = results.load_results(results.PROJECT_ROOT / rel)
        assert data["command"].startswith("uv run "), (
            f"{rel}: 'command' should be the command a reader re-runs, got {data['command']!r}"
        )
        assert data["tables"] or data["values"], f"{rel} records nothing"
