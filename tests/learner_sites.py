"""Where a judged failure points: the learner's function that the verdict is about.

A grader that compares values (``pytest.fail``: "4.7 loss_share: rank 1 returned 0.42 ...")
knows which function it judged but has no traceback into it; the learner still needs the file
and line to open. This module finds, in the exercise's templates (or the reference's modules
under ``--impl solutions``), the functions that hold a ``# TODO <id>:`` block, and
:func:`judged_site` names the one a verdict's first lines mention, when exactly one is: never a
guess between two (issue 41: 6 of 65 first failures named the learner's line, all of them raised
errors). :func:`todo_site` does the same for an unwritten TODO that a rank raised and the
grader's harness code raised again: the raise's own line, not the harness's.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from exercises import BY_ID, Exercise

ROOT = Path(__file__).resolve().parents[1]
HEAD_LINES = 3  # a verdict's header and its first remark name the function judged


def module_path(ex: Exercise, module: str, impl: str) -> Path:
    if impl == "solutions":
        return ROOT / "solutions" / ex.phase / f"{module}.py"
    return ROOT / ex.phase / f"template_{module}.py"


@cache
def _todo_functions(path: Path, exercise_id: str, mtime: float) -> tuple[tuple[str, int], ...]:
    """(qualname, line of ``def``) of every function of ``path`` holding ``# TODO <id>:``."""
    del mtime  # part of the cache key: a learner's edit is read again
    try:
        text = path.read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError):
        return ()
    lines = text.splitlines()
    marker = f"# TODO {exercise_id}:"
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, [*scope, child.name])
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = lines[child.lineno - 1 : child.end_lineno]
                if any(marker in line for line in body):
                    found.append((".".join([*scope, child.name]), child.lineno))
                visit(child, [*scope, child.name])

    visit(tree, [])
    return tuple(found)


def judged_site(message: str, ex: Exercise, impl: str) -> str:
    """``phase4_production/template_lm_parallel.py:123 in loss_share`` when the verdict's first
    lines name exactly one of the exercise's functions (by its name as a word); "" otherwise,
    and when the verdict already points at a line of the code under test."""
    if re.search(r"(template_\w+|solutions/[\w/]+)\.py:\d+", message):
        return ""
    head = "\n".join(message.splitlines()[:HEAD_LINES])
    named: dict[str, str] = {}
    for module in ex.modules:
        path = module_path(ex, module, impl)
        mtime = path.stat().st_mtime if path.exists() else 0.0
        for qualname, line in _todo_functions(path, ex.id, mtime):
            name = qualname.rsplit(".", 1)[-1]
            if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", head):
                named[qualname] = f"{path.relative_to(ROOT)}:{line} in {qualname}"
    return next(iter(named.values())) if len(named) == 1 else ""


def todo_site(todo: str) -> str:
    """``template:line in function`` of the ``raise NotImplementedError`` whose message is
    ``todo`` (it may follow words such as ``4.7 needs``): a TODO raised on a rank and re-raised by
    a grader's harness code still points at the learner's line; "" when none matches."""
    from scoreboard import open_todos

    found = re.search(r"TODO (\d+\.\d+):", todo)
    ex = BY_ID.get(found[1]) if found else None
    if ex is None or found is None:
        return ""
    message = todo[found.start() :]
    for path, line, where, _, text in open_todos(ex):
        if text == message:
            return f"{path.relative_to(ROOT)}:{line} in {where}"
    return ""
