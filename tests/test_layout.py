"""The learner's world and the answers stay apart, and imports run one way.

* A template imports given code only: the support package ``course/``, given modules in the phase
  folders, and other templates. Nothing a learner needs to read lives in ``solutions/``.
* Given modules (``course/`` and the phase folders' non-template modules) never import an answer
  (``solutions.*``) or a learner's template; they reach an implementation through
  ``course.impl.load_impl``, chosen by ``--impl``.
* Imports run from later phases to earlier ones, never back; ``course/`` imports no phase.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PHASE = re.compile(r"phase(?P<n>\d+)_\w+")

pytestmark = pytest.mark.harness


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, nested ones included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # ``from phase4_production import rng_state`` imports a module, too
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def templates() -> list[Path]:
    return sorted(ROOT.glob("phase*_*/template_*.py"))


def given_modules() -> list[Path]:
    phase_given = [
        path for path in ROOT.glob("phase*_*/*.py") if not path.name.startswith("template_")
    ]
    return sorted([*ROOT.glob("course/*.py"), *phase_given])


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_templates_import_nothing_from_solutions() -> None:
    found = [
        f"{rel(path)}:{line} imports {module}"
        for path in templates()
        for line, module in imported_modules(path)
        if module == "solutions" or module.startswith("solutions.")
    ]
    assert not found, (
        "a template may import course/, given modules of the phase folders and other templates, "
        f"never the reference answers: {found}. Move what it needs out of solutions/."
    )


def test_given_modules_import_no_answers_and_no_templates() -> None:
    found = [
        f"{rel(path)}:{line} imports {module}"
        for path in given_modules()
        for line, module in imported_modules(path)
        if module.split(".")[0] == "solutions" or ".template_" in module
    ]
    assert not found, (
        "given modules are complete without any answer: they reach an implementation through "
        f"course.impl.load_impl(phase, module, impl), chosen by --impl. Found: {found}"
    )


def phase_number(name: str) -> int | None:
    match = PHASE.match(name)
    return int(match["n"]) if match else None


@pytest.mark.parametrize("top", ["course", "phase1_data_parallel", "phase2_advanced",
                                 "phase3_multi_node", "phase4_production", "solutions"])
def test_imports_run_from_later_phases_to_earlier(top: str) -> None:
    backwards = []
    for path in sorted((ROOT / top).rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        own = phase_number(parts[1] if parts[0] == "solutions" and len(parts) > 2 else parts[0])
        for line, module in imported_modules(path):
            pieces = module.split(".")
            target = phase_number(pieces[1] if pieces[0] == "solutions" and len(pieces) > 1
                                  else pieces[0])
            if target is None:
                continue
            if own is None or target > own:
                backwards.append(f"{rel(path)}:{line} imports {module}")
    assert not backwards, (
        "imports run from later phases to earlier ones (and course/ imports no phase): "
        f"{backwards}"
    )
