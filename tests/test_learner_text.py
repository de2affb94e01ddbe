"""What a learner reads: short templates, no answer in their text, every given API in the guide.

* A template holds the exercise and little else: at most ``MAX_TEMPLATE_LINES`` lines (given
  machinery lives in given modules of the phase folder or in ``course/``).
* A template's own text (comments, docstrings, the TODO block and Hint 1) never echoes a line of
  the reference code inside the ``# >>> solution`` fences. Exact echoes only: a paraphrase needs
  a reader, and the maintainers read every template.
* No later hint (Hint 2, Hint 3, ... that ``tests.hint`` prints one rung at a time) is code a
  learner can paste. Hint 3 comes close to code in words and formulas, so the rule is sharper
  than for the template: with whitespace, backticks and quote style ignored, a hint may not
  contain (a) a line of fenced code, (b) a whole simple statement of the fenced code (an
  assignment, a return, a call on its own line...), or (c) an expression of the fenced code that
  holds at least ``MIN_OPERATIONS`` operations (calls, keyword arguments, arithmetic, boolean
  operations, comparisons, subscripts, conditionals, comprehensions), each at least
  ``MIN_ECHO_CHARS`` characters long, as written or as ``ast.unparse`` writes it. Naming a
  function with its plain arguments (``torch.maximum(lse_a, lse_b)``) passes; the call the
  solution makes, keywords included, does not.
* Each exercise's section of its guide has an "API you use" part naming, in backticks, every
  given function, class or constant its templates import from ``course/`` or from the phase
  folders' given modules, so a learner never opens ``solutions/`` to learn an API.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest
from exercises import EXERCISES, Exercise

from course import template_maker

ROOT = Path(__file__).resolve().parents[1]
MAX_TEMPLATE_LINES = 300
MIN_ECHO_CHARS = 18  # shorter code (``return out``) is too common to count as an echo
MIN_OPERATIONS = 2  # one call with plain arguments names a function; two operations are code
OPERATIONS = (
    ast.Call, ast.keyword, ast.BinOp, ast.BoolOp, ast.Compare, ast.Subscript, ast.IfExp,
    ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda,
)  # fmt: skip

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


def _norm_code(text: str) -> str:
    """Code or prose without whitespace, backticks and comment marks, one quote style."""
    return _norm(text).replace('"', "'")


def _operations(node: ast.AST) -> int:
    """How many operations an expression holds (a negated constant such as ``-1`` holds none)."""
    return sum(
        isinstance(sub, OPERATIONS)
        or (isinstance(sub, ast.UnaryOp) and not isinstance(sub.operand, ast.Constant))
        for sub in ast.walk(node)
    )


def _regions(source: str) -> list[tuple[int, str]]:
    """(first line, dedented code) of every ``# >>> solution`` region."""
    found, lines, start = [], source.splitlines(), None
    for number, line in enumerate(lines, 1):
        if line.strip() == template_maker.SOLUTION_START:
            start = number
        elif line.strip() == template_maker.SOLUTION_END and start is not None:
            found.append((start + 1, textwrap.dedent("\n".join(lines[start : number - 1]))))
            start = None
    return found


def _pasteable_pieces(source: str) -> list[tuple[int, str]]:
    """(line, code) of the pieces of fenced code no hint may spell: its lines, its simple
    statements and its expressions of at least ``MIN_OPERATIONS`` operations; each piece is
    given as written and as ``ast.unparse`` writes it (``(grad,) =`` or ``grad, =``)."""
    pieces = list(_fenced_code(source))
    for first, code in _regions(source):
        try:
            tree = ast.parse(code)
        except SyntaxError:  # a region that is not whole statements: its lines still count
            continue
        for node in ast.walk(tree):
            simple = isinstance(node, ast.stmt) and not hasattr(node, "body")
            if simple or (isinstance(node, ast.expr) and _operations(node) >= MIN_OPERATIONS):
                line = first + getattr(node, "lineno", 1) - 1
                for text in (ast.get_source_segment(code, node) or "", ast.unparse(node)):
                    if len(_norm(text)) >= MIN_ECHO_CHARS:
                        pieces.append((line, " ".join(text.split())))
    return pieces


def hint_echoes(solution: Path) -> list[str]:
    """One line per piece of fenced code that a later hint of ``solution`` spells, naming the
    hint, its TODO and the solution's line; the longest piece only where pieces nest."""
    found = {
        _norm_code(code): (line, code) for line, code in _pasteable_pieces(solution.read_text())
    }
    echoes = []
    for todo, hints in template_maker.later_hints(solution):
        for level, text in _by_level(hints):
            hint = _norm_code(text)
            spelled = {key: found[key] for key in found if key in hint}
            echoes += [
                f"Hint {level} of TODO {todo.exercise} ({todo.goal}) spells solution line "
                f"{line}: {code}"
                for key, (line, code) in sorted(spelled.items(), key=lambda item: item[1])
                if not any(key != other and key in other for other in spelled)
            ]
    return echoes


def _by_level(hints: list[str]) -> list[tuple[int, str]]:
    """(level, text) of each later hint, its continuation lines joined."""
    found: list[tuple[int, str]] = []
    for line in hints:
        start = re.match(r"Hint (?P<level>\d+)\s*:", line)
        if start:
            found.append((int(start["level"]), line))
        elif found:
            found[-1] = (found[-1][0], f"{found[-1][1]} {line}")
    return found


@pytest.mark.parametrize(
    "solution", template_maker.solution_files(), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_no_answer_in_the_template_text(solution: Path) -> None:
    code = _fenced_code(solution.read_text())
    template = template_maker.make_template(solution)
    texts = [(number, _norm(text)) for number, text in _prose(template)]
    echoes = [
        f"template line {t_line} shows solution line {c_line}: {c}"
        for c_line, c in code
        for t_line, text in texts
        if _norm(c) in text
    ]
    assert not echoes, (
        f"{solution.relative_to(ROOT)}: the template's text gives the answer away; state the "
        "goal, the invariant and the idea instead:\n  " + "\n  ".join(echoes)
    )


@pytest.mark.parametrize(
    "solution", template_maker.solution_files(), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_no_hint_is_a_line_to_paste(solution: Path) -> None:
    echoes = hint_echoes(solution)
    assert not echoes, (
        f"{solution.relative_to(ROOT)}: a hint spells the reference code; say it in words and "
        "formulas (name the functions to use, the quantities and their relations), not as a "
        "statement or call that can be pasted:\n  " + "\n  ".join(echoes)
    )


_SAMPLE = """
def chunk_sizes(numel: int, n: int) -> list[int]:
    # TODO 9.9: cut numel into n sizes that differ by at most one.
    # Invariant: the sizes sum to numel.
    # Hint 1: one integer division.
    # Hint 2: the common size and the remainder come from one division.
    # Hint 3: {hint}
    # See guidelines.md#99-sample
    # >>> solution
    base, extra = divmod(numel, n)
    return [base + (1 if i < extra else 0) for i in range(n)]
    # <<< solution
"""


@pytest.mark.parametrize(
    ("hint", "caught"),
    [
        ("base, extra = divmod(numel, n); then the sizes.", "base, extra = divmod(numel, n)"),
        ("each size is `base + (1 if i < extra else 0)`.", "base + (1 if i < extra else 0)"),
        ("return [base + (1 if i < extra else 0) for i in range(n)]", "return [base"),
        ("divmod of numel by n gives (base, extra); size i is base + 1 when i < extra.", None),
        ("divmod(numel, n), then one size per index: naming a call passes.", None),
    ],
)
def test_the_hint_rule_catches_pasteable_code_and_lets_words_pass(
    tmp_path: Path, hint: str, caught: str | None
) -> None:
    solution = tmp_path / "sample.py"
    solution.write_text(_SAMPLE.format(hint=hint))
    echoes = hint_echoes(solution)
    if caught is None:
        assert not echoes, f"words and formulas flagged as code: {echoes}"
    else:
        assert any(caught in echo and echo.startswith("Hint 3 of TODO 9.9") for echo in echoes), (
            f"the rule missed {caught!r} in Hint 3: {echoes}"
        )


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
    rest = section[match.end() :]
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
