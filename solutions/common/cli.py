"""Command lines of the instructor commands: flags from a config dataclass, errors before start.

Every demo is run as ``torchrun ... -m solutions.<phase>.<module> --flag value``. Two things are
the same everywhere, so they live here once:

* a ``--flag`` for each field of the module's config dataclass (``snake_case`` ->
  ``--kebab-case``, booleans become on/off switches);
* bad arguments are refused *before* the process group exists: each rank checks them against
  torchrun's WORLD_SIZE, rank 0 prints why, and every rank exits with status 2. Failing later,
  inside a collective, would leave the other ranks waiting.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from solutions.common.distributed import env_int

ConfigT = TypeVar("ConfigT")


def parse_config(
    config_class: type[ConfigT], argv: Sequence[str] | None, description: str | None
) -> ConfigT:
    """Parse ``argv`` into ``config_class``, a dataclass whose defaults are the flags' defaults."""
    summary = (description or "").strip().split("\n\n")[0]
    parser = argparse.ArgumentParser(description=summary)
    defaults: Any = config_class()
    for field in dataclasses.fields(defaults):
        value = getattr(defaults, field.name)
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value, help=f"default: {value}")
    return config_class(**vars(parser.parse_args(argv)))


def refuse_before_start(validate: Callable[[int], object]) -> int | None:
    """Run ``validate(world_size)``; on ValueError print it on rank 0 and return exit code 2.

    Returns None when the arguments are fine. Call it before ``setup_distributed()``.
    """
    try:
        validate(env_int("WORLD_SIZE", 1))
    except ValueError as err:
        if env_int("RANK", 0) == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    return None
