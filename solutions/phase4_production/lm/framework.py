"""The language-model framework: one YAML config picks every strategy, or the planner does.

Trains the language model of exercise 4.7 on the Python documentation (``lm.trainer.run``) with
the layout and strategies a config names (``lm/config.py``: model, parallel degrees, ZeRO stage,
pipeline schedule, communication, sharding ``manual`` or ``auto``, precision, training,
checkpoints that resume at any layout), checked
against the world size before any process group exists::

    uv run torchrun --standalone --nproc_per_node=4 -m solutions.phase4_production.lm.framework
    uv run torchrun --standalone --nproc_per_node=4 -m solutions.phase4_production.lm.framework \\
        --set sharding=auto
    uv run python -m solutions.phase4_production.lm.framework --plan-only --world 8

With ``sharding: auto`` the planner (``lm/planner.py``) ranks every legal layout of the world
from rates measured on the machine (compute in one process, the links in the running world; rank
0's rates are broadcast so that every rank plans the same) and the run takes its first choice.
``--plan-only`` prints the ranked table and stops; outside torchrun it plans for ``--world``
ranks (an even number, default 4: the links are measured by pairs), measuring the links in a
world of its own (at most 8 ranks). Measuring has a deadline of its own
(``lm.rates.rates_timeout``, 120 s or ``DTFS_RATES_TIMEOUT``): on a machine too busy to measure
in time the run ends with one line that says so, the load and the fix.

``--metrics FILE`` writes one JSON object per optimizer step (rank 0; step, loss and its parts,
tokens, grad norm, lr, seconds, layout: ``lm.metrics.step_record``), so that two runs compare
exactly; a resumed run keeps the lines up to its checkpoint and appends. Rank 0 says each phase
as it starts (building the layout, measuring, loading the corpus) and then shows the steps on
stderr (a bar on a terminal, a line every 10 s otherwise). Whatever is refused (a bad key, a key
given twice, an empty config file, a ``--world`` below 2, odd or ignored, a checkpoint folder
or a metrics file that cannot be written) is one ``error:`` line before any process group
exists, printed so that torchrun cannot swallow it (``course.cli.say_refusal``). A folder that
holds checkpoints is resumed from even with ``checkpoint.every: 0`` (which saves none), and the
run says so.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from course.cli import RankZeroParser, run_main
from course.config_files import available_configs
from course.impl import IMPLS
from solutions.phase4_production.lm.configs import CONFIG_DIR, DEFAULT_CONFIG

PLAN_WORLD = 4  # what --plan-only plans for outside torchrun without --world
PAGE = "solutions/phase4_production/lm/README.md"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, read without torch (``--help`` answers at once)."""
    names = ", ".join(available_configs(CONFIG_DIR, "lm-*.yaml"))
    parser = RankZeroParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog=f"Every config key, its default and what it refuses: {PAGE}.",
    )
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        metavar="NAME|FILE",
        help=f"the YAML config: one of {names} (in solutions/phase4_production/lm/configs/) "
        "or a path; it holds the model, the parallel layout or sharding: auto, the ZeRO stage, "
        f"the schedule, the communication, precision, training and checkpoints "
        f"(default {DEFAULT_CONFIG})",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override config keys after the file is read, dotted by section, e.g. --set "
        "sharding=auto parallel.tp=2 train.lr=0.01 (repeatable; a key given twice is refused)",
    )
    parser.add_argument(
        "--plan-only",
        action="store_true",
        help="measure this machine, print the planner's ranked layouts and stop",
    )
    parser.add_argument(
        "--world",
        type=int,
        default=None,
        help=f"--plan-only outside torchrun: plan for this many ranks (even; default "
        f"{PLAN_WORLD})",
    )
    parser.add_argument(
        "--metrics",
        default=None,
        metavar="FILE",
        help="write one JSON line per optimizer step to FILE (rank 0)",
    )
    parser.add_argument(
        "--impl",
        choices=IMPLS,
        default="solutions",
        help="whose 4.7 composition runs: the reference solutions or your templates",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from solutions.phase4_production.lm import framework_run  # torch loads here, not for --help

    return framework_run.main(args)


def __getattr__(name: str) -> Any:
    """The run's functions (``validate``, ``choose``, ``rates_in_world``, ...) live in
    ``framework_run``, which imports torch; reached from here, they load on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    from solutions.phase4_production.lm import framework_run

    return getattr(framework_run, name)


if __name__ == "__main__":
    run_main(main)
