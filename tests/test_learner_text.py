"""What a learner reads: short templates, no answer in their text, every given API in the guide.

* A template holds the exercise and little else: at most ``MAX_TEMPLATE_LINES`` lines (given
  machinery lives in given modules of the phase folder or in ``course/``).
* A template's own text (comments, docstrings, the TODO block and Hint 1) and the Hint 2 that
  ``tests.hint`` prints on request never echo a line of the reference code inside the
  ``# >>> solution`` fences (Hint 3 may come close to code). Exact echoes only: a paraphrase
  needs a reader, and the maintainers read every template.
* Each exercise's section of its guide has an "API you use" part naming, in backticks, every
  given function, class or constant its templates import from ``course/`` or from the phase
  folders' given modules, so a learner never opens ``solutions/`` to learn an API.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest
from exercises import EXERCISES, Exercise

from course import template_maker

ROOT = Path(__file__).resolve().parents[1]
MAX_TEMPLATE_LINES = 300
MIN_ECHO_CHARS = 18  # shorter code (``return out``) is too common to count as an echo

pytestmark = pytest.mark.harness


def _templates() -> list[Path]:
    return sorted(ROOT.glob("phase*_*/template_*.py"))


@pytest.mark.parametrize("template", _templates(), ids=lambda p: p.name)
def test_template_holds_the_exercise_and_little_else(template: Path) -> None:
    lines = len(template.read_text().splitlines())
    assert lines <= MAX_TEMPLATE_LINES, (
        f"{template.relative_to(ROOT)} has {lines} lines (at most {MAX_TEMPLATE_LINES}): move "
        "what is not the exercise (CLI, wiring, reports, loops) to a given module"
    )


def _norm(text: str) -> str:
    return re.sub(r"[\s`#]+", "", text)


def _fenced_code(source: str) -> list[tuple[int, str]]:
    """(line, code) of every substantial line inside a solution's fences."""
    found, inside = [], False
    for number, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(template_maker.SOLUTION_START):
            inside = True
        elif stripped.startswith(template_maker.SOLUTION_END):
            inside = False
        elif inside and stripped and not stripped.startswith("#"):
            code = stripped.split("  #")[0].strip()
            if len(_norm(code)) >= MIN_ECHO_CHARS:
                found.append((number, code))
    return found


def _prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and string: what a reader takes for explanation."""
    out = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            out.append((token.start[0], token.string))
    return out


@pytest.mark.parametrize(
    "solution", template_maker.solution_files(), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_no_answer_in_what_the_learner_reads(solution: Path) -> None:
    code = _fenced_code(solution.read_text())
    template = template_maker.make_template(solution)
    texts = [(number, _norm(text)) for number, text in _prose(template)]
    echoes = [
        f"template line {t_line} shows solution line {c_line}: {c}"
        for c_line, c in code
        for t_line, text in texts
        if _norm(c) in text
    ]
    for todo, hints in template_maker.later_hints(solution):
        second = " ".join(_hint_2(hints))
        echoes += [
            f"Hint 2 of TODO {todo.exercise} ({todo.goal}) spells solution line {c_line}: {c}"
            for c_line, c in code
            if _norm(c) in _norm(second)
        ]
    assert not echoes, (
        f"{solution.relative_to(ROOT)}: the template's text or Hint 2 gives the answer away; "
        "state the goal, the invariant and the idea instead:\n  " + "\n  ".join(echoes)
    )


def _hint_2(hints: list[str]) -> list[str]:
    """The lines of Hint 2 among a TODO's later hints (up to Hint 3)."""
    kept: list[str] = []
    for line in hints:
        if re.match(r"Hint (?:[3-9]|\d\d+)\s*:", line):
            break
        kept.append(line)
    return kept


def _given_imports(template: Path) -> set[str]:
    """Names a template imports from given code: ``course.*`` and phase-folder modules."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(template.read_text())):
        if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
            continue
        top = node.module.split(".")[0]
        given_phase = re.fullmatch(r"phase\d+_\w+", top) and ".template_" not in node.module
        if top == "course" or given_phase:
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _section(guide: str, anchor: str) -> str:
    """The text of the ``##`` section whose GitHub anchor is ``anchor``."""
    lines = guide.splitlines()
    start = None
    in_code = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("## "):
            continue
        title = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        if start is not None:
            return "\n".join(lines[start:i])
        if title == anchor:
            start = i
    return "\n".join(lines[start:]) if start is not None else ""


def _api_part(section: str) -> str:
    """The "API you use" part of a section: from its heading to the next heading as high."""
    match = re.search(r"^(?P<level>#{3,4}) API you use\s*$", section, re.MULTILINE)
    if match is None:
        return ""
    rest = section[match.end():]
    end = re.search(rf"^#{{2,{len(match['level'])}}} ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.id)
def test_the_guide_lists_every_given_api_the_exercise_uses(ex: Exercise) -> None:
    imported: set[str] = set()
    for module in ex.modules:
        template = ROOT / ex.phase / f"template_{module}.py"
        if template.exists():
            imported |= _given_imports(template)
    if not imported:
        return
    guide = (ROOT / ex.phase / "guidelines.md").read_text()
    section = _section(guide, ex.anchor)
    assert section, f"{ex.phase}/guidelines.md has no section #{ex.anchor}"
    api = _api_part(section)
    assert api, (
        f"{ex.phase}/guidelines.md#{ex.anchor} has no '### API you use' part; its templates "
        f"use {sorted(imported)}"
    )
    # a template shared by several exercises (1.2 and 1.4 both write template_trainer.py) may
    # list each given name under whichever of them uses it
    sharing = [other for other in EXERCISES if set(other.modules) & set(ex.modules)]
    tables = " ".join(_api_part(_section(guide, other.anchor)) for other in sharing)
    quoted = " ".join(re.findall(r"`([^`]+)`", tables))
    missing = sorted(name for name in imported if not re.search(rf"\b{re.escape(name)}\b", quoted))
    assert not missing, (
        f"{ex.phase}/guidelines.md#{ex.anchor}, API you use: add {missing} (name, signature, "
        "what it gives you): the templates of this exercise import them"
    )
