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


# ----------------------------------------------------------------------------- answers, programs


def solutions_layout_problems(root: Path) -> list[str]:
    """What breaks "a solutions phase folder holds the answers; programs live in packages named
    for what they are" under ``root`` (a checkout): a top-level module that answers no template,
    a template without its answer, an answer that imports a program (``demos/ddp.py``, the
    demo of the answer ``ddp.py``, may share its stem: its package says what it is)."""
    problems = []
    for folder in sorted((root / "solutions").glob("phase*_*")):
        phase = folder.name
        wanted = {p.name.removeprefix("template_") for p in (root / phase).glob("template_*.py")}
        top = {p.name for p in folder.glob("*.py")} - {"__init__.py"}
        for name in sorted(top - wanted):
            problems.append(
                f"solutions/{phase}/{name} answers no template (no {phase}/template_{name}): a "
                "program belongs in a package named for what it is (benchmarks/, demos/, lm/, "
                "...), given code outside solutions/"
            )
        for name in sorted(wanted - top):
            problems.append(f"{phase}/template_{name} has no answer solutions/{phase}/{name}")
        for name in sorted(top & wanted):
            for line, module in imported_modules(folder / name):
                pieces = module.split(".")
                if len(pieces) >= 4 and pieces[0] == "solutions" and pieces[2] != "__init__":
                    package = root / "solutions" / pieces[1] / pieces[2]
                    if package.is_dir():
                        problems.append(
                            f"solutions/{phase}/{name}:{line} imports the program {module}: "
                            "programs import answers, never the other way"
                        )
    return problems


def test_answers_stand_apart_from_programs() -> None:
    problems = solutions_layout_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_the_layout_check_finds_a_program_dropped_among_the_answers(tmp_path: Path) -> None:
    """The check itself, on a small tree: a benchmark at a phase folder's top level, an answer
    that imports a program and a template without its answer are each named."""
    (tmp_path / "phase1_data_parallel").mkdir()
    for name in ("all_reduce", "sampler"):
        (tmp_path / "phase1_data_parallel" / f"template_{name}.py").write_text("")
    answers = tmp_path / "solutions" / "phase1_data_parallel"
    (answers / "benchmarks").mkdir(parents=True)
    (answers / "benchmarks" / "__init__.py").write_text("")
    (answers / "benchmarks" / "speed.py").write_text("")
    (answers / "all_reduce.py").write_text(
        "from solutions.phase1_data_parallel.benchmarks.speed import x\n"
    )
    (answers / "benchmark_all_reduce.py").write_text("")
    problems = "\n".join(solutions_layout_problems(tmp_path))
    assert "solutions/phase1_data_parallel/benchmark_all_reduce.py answers no template" in problems
    assert "all_reduce.py:1 imports the program solutions.phase1_data_parallel.benchmarks" in problems
    assert "template_sampler.py has no answer" in problems


COMMAND_MODULE = re.compile(r"-m\s+((?:solutions|course|tests)(?:\.\w+)+)")


def command_sources() -> list[Path]:
    """Where people copy commands from: the README, the guides, CI, the deployment files, the
    notebooks and the results files' recorded commands."""
    found = [ROOT / "README.md", *ROOT.glob("phase*_*/guidelines.md"), *ROOT.glob(".ci/*"),
             *ROOT.glob("phase*_*/after_you_pass.md"),
             *ROOT.glob("solutions/phase*_*/*/README.md"),
             *ROOT.glob(".ci/gpu-runs/README.md"), *ROOT.glob("notebooks/*.ipynb"),
             *ROOT.glob("phase*_*/results/*.json"),
             *(p for p in ROOT.glob("solutions/**/deployment/**/*") if p.is_file())]  # fmt: skip
    return sorted(p for p in found if p.is_file())


def module_runs(dotted: str) -> bool:
    """``python -m dotted`` finds a module that does something when run: a file with a
    ``__main__`` guard (a module without one imports and exits 0, silently), or a package with
    a ``__main__.py``."""
    path = ROOT.joinpath(*dotted.split("."))
    file = path.with_suffix(".py")
    if file.is_file():
        return '__name__ == "__main__"' in file.read_text()
    return (path / "__main__.py").is_file()


def test_every_command_runs_a_module_that_exists() -> None:
    """``python -m``/``torchrun -m`` in every place a reader copies a command from names a
    module at its current path (after the house move the old paths are gone, not aliased) that
    runs something (the README once ran an answer module, which exits at once)."""
    missing = [
        f"{rel(path)}: -m {module}"
        for path in command_sources()
        for module in COMMAND_MODULE.findall(path.read_text(errors="replace"))
        if not module_runs(module)
    ]
    assert not missing, "commands that run no program: " + "; ".join(sorted(set(missing)))
