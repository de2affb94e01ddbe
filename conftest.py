"""Root conftest: declares ``--impl`` so pytest knows it however it is started.

Options must be known before pytest collects anything; a conftest inside tests/ is read too late
when pytest runs with no path arguments. The grading machinery is in tests/conftest.py; the
plugin that expands ``tests/test_phaseN.py`` into the phase's per-exercise graders is
tests/phase_collection.py; the scoreboard is tests/scoreboard.py, and how tests are shared among
parallel workers is tests/parallel_runs.py; the message printed before torch loads, naming the
first TODO of a selected exercise, is tests/preflight.py. Plugins can only be declared here, at
the root, and under pytest-xdist this is the only conftest the controlling process reads.
"""

from __future__ import annotations

import os

import pytest

# in import order: a plugin imported by another before its own turn is not assert-rewritten
pytest_plugins = ["parallel_runs", "scoreboard", "phase_collection", "preflight"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--impl",
        choices=("templates", "solutions"),
        default=os.environ.get("DTFS_IMPL", "templates"),
        help="grade the learner's templates (default) or the reference solutions",
    )
    # tests/test_lm_random_layouts.py: which randomized layouts of the language model to train
    parser.addoption("--lm-seed", type=int, default=None,
                     help="seed of the randomized LM layouts (default: the fixed CI seed)")
    parser.addoption("--lm-draws", type=int, default=None,
                     help="randomized LM layouts per world (default: the CI budget)")
    parser.addoption("--lm-worlds", default=None,
                     help="world sizes of the randomized LM layouts, e.g. 2,4,8 (default 2,4)")
