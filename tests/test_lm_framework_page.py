"""The language-model framework's page (solutions/phase4_production/lm/README.md, issue 50).

The framework is a program, not an exercise: its config, planner and measurements have a page
of their own, and exercise 4.7's section ends where the exercise ends, with a pointer to it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from exercises import BY_ID
from test_learner_text import _section

from solutions.phase4_production.lm.config_keys import key_rows, key_table

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "solutions" / "phase4_production" / "lm" / "README.md"

pytestmark = pytest.mark.harness


def test_the_page_lists_every_config_key_as_the_schema_has_it() -> None:
    text = PAGE.read_text()
    assert key_table() in text, (
        f"{PAGE.relative_to(ROOT)}'s table of keys differs from the schema: paste the output of "
        "`uv run python -m solutions.phase4_production.lm.config_keys` in its place"
    )
    assert len(key_rows()) > 30, "the schema's keys were not all found"


def test_the_page_covers_what_an_instructor_comes_for() -> None:
    text = PAGE.read_text()
    for heading in ("## Run it", "## The config: every key", "## The framework: one config",
                    "## Measured: the layouts side by side", "## A worked example",
                    "## Measured: one rank on a GPU"):  # fmt: skip
        assert heading in text, f"{PAGE.relative_to(ROOT)} has no part {heading!r}"
    for flag in ("--config", "--set", "--plan-only", "--world", "--metrics", "sharding=auto",
                 "--nnodes=2", "checkpoint.every"):  # fmt: skip
        assert flag in text, f"{PAGE.relative_to(ROOT)} never shows {flag}"


def test_the_exercise_section_ends_with_the_exercise_and_a_pointer() -> None:
    ex = BY_ID["4.7"]
    section = _section((ROOT / ex.phase / "guidelines.md").read_text(), ex.anchor)
    after = section.split("### Check yourself, after you pass", 1)[1]
    assert "lm/README.md" in after, "4.7's section does not point at the framework's page"
    assert len(after.splitlines()) < 40, (
        f"4.7's section runs {len(after.splitlines())} lines past 'Check yourself': what is not "
        "the exercise belongs on the framework's page"
    )
    assert "## Measured" not in after and "planner" not in after.split("### Beyond")[0]
