"""Reading torchrun's environment without importing torch (so a program's ``--help`` is instant).

torchrun's agent exports RANK, WORLD_SIZE, LOCAL_RANK, ... to every worker (course/world.py's
``torchrun_env`` lists them). Programs read them before any process group exists, some before
torch loads; this module holds that one reader.
"""

from __future__ import annotations

import os


def env_int(name: str, default: int | None = None) -> int:
    """An integer from the environment, with a message that says who should have set it."""
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"{name} is not set: start this program with torchrun, e.g. "
                "`uv run torchrun --standalone --nproc_per_node=2 -m <module>`"
            )
        return default
    try:
        return int(value)
    except ValueError as err:
        raise RuntimeError(f"{name}={value!r} is not an integer") from err
