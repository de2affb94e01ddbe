"""Pick the implementation a program runs: the learner's templates or the reference solutions.

Tests choose with ``pytest --impl``; demos, benchmarks and notebook workers choose with their own
``--impl`` flag, so a learner can run their own code under torchrun for every exercise:

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.pipeline_demo \
        --impl templates

``phaseN_x/template_mod.py`` pairs with ``solutions/phaseN_x/mod.py`` (see template_maker.py).
"""

from __future__ import annotations

import importlib
from types import ModuleType

IMPLS = ("solutions", "templates")


class ImplementationError(ImportError):
    """The chosen implementation of a module could not be imported."""


def module_name(phase: str, module: str, impl: str) -> str:
    """``solutions.<phase>.<module>`` or ``<phase>.template_<module>``."""
    if impl not in IMPLS:
        raise ValueError(f"--impl {impl!r} is unknown: choose one of {', '.join(IMPLS)}")
    return f"solutions.{phase}.{module}" if impl == "solutions" else f"{phase}.template_{module}"


def load_impl(phase: str, module: str, impl: str) -> ModuleType:
    """Import ``module`` of ``phase`` as ``impl`` ("solutions" or "templates") chose it."""
    name = module_name(phase, module, impl)
    try:
        return importlib.import_module(name)
    except Exception as exc:
        where = name.replace(".", "/") + ".py"
        raise ImplementationError(f"could not import {where}: {type(exc).__name__}: {exc}") from exc
