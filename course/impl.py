"""Pick the implementation a program runs: the learner's templates or the reference solutions.

Tests choose with ``pytest --impl``; demos, benchmarks and notebook workers choose with their own
``--impl`` flag, so a learner can run their own code under torchrun for every exercise:

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.pipeline_demo \
        --impl templates

``phaseN_x/template_mod.py`` pairs with ``solutions/phaseN_x/mod.py`` (see template_maker.py).
"""

from __future__ import annotations

import importlib
import inspect
import re
from types import ModuleType

IMPLS = ("solutions", "templates")
_TODO_RAISE = re.compile(r'raise NotImplementedError\(\s*"(?P<text>TODO (?P<id>\d+\.\d+):[^"]*)')


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


def unwritten_todo(phase: str, module: str, impl: str) -> str | None:
    """One line naming the first TODO still unwritten in ``module`` under ``impl``, or None.

    Read from the module's source (a template keeps its ``raise NotImplementedError("TODO
    x.y: ...")`` until it is written), so nothing runs and no world is started for it: a
    benchmark or ``tests.bench`` says which TODO it needs instead of failing inside a world.
    """
    if impl == "solutions":
        return None
    source = inspect.getsource(load_impl(phase, module, impl))
    match = _TODO_RAISE.search(source)
    if match is None:
        return None
    line = source[: match.start()].count("\n") + 1
    where = module_name(phase, module, impl).replace(".", "/") + f".py:{line}"
    goal = match["text"].split(":", 1)[1].strip()
    return f"TODO {match['id']} not written ({where}): {goal}"
