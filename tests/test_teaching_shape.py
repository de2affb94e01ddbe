"""Every exercise teaches by questions (issue 48): the ladders narrow, the guides ask, and every
question is graded.

* **Ladders.** Every TODO has at least ``MIN_LATER_RUNGS`` rungs after the template's Hint 1. The
  first of them asks (it holds a question); the middle ones settle one decision each; the last
  gives the answer in words. No rung holds code: no call with arguments, keyword argument, index
  expression or assignment of an expression (naming an API, ``dist.all_reduce``, is fine, and so
  is a worked example's number, ``numel = 10``).
* **Guides.** Every exercise section has its contract, its questions, "API you use" and "What the
  tests check" parts (headings that say so), and no "Pitfalls"-style part: the mistakes the
  graders name are read after passing, in the phase's ``after_you_pass.md``.
* **Questions.** Every question of a section's questions parts (each sentence that ends in "?")
  is listed in ``tests/phaseN/questions_exX_Y.py`` with the test that fails its
  wrong answer (tests/question_grading.py), and that test exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from exercises import EXERCISES, Exercise
from hint_ladder import TodoHints, exercise_todos
from question_grading import all_questions, registry_of
from test_learner_text import _section

ROOT = Path(__file__).resolve().parents[1]
MIN_LATER_RUNGS = 3

pytestmark = pytest.mark.harness

# Code in a rung: each pattern names what it catches, with what it lets through.
CODE_IN_WORDS = {
    # f(x, dim=1), torch.cat(outs, dim=2); not f(), rank(s), "the rank (in the group)"
    "a call with arguments": re.compile(r"(?<![\w.])[A-Za-z_][\w.]*\((?!\)|s\))[^)]*\)"),
    # x[0], state.inputs[microbatch]; not "a tensor [B, H]" (a space before the bracket)
    "an index expression": re.compile(r"(?<![\w.])[A-Za-z_][\w.]*\[[^\]]*\]"),
    # dim=0, group=group; not "==" or "a = b" with spaces (see the next)
    "a keyword argument": re.compile(r"(?<![\w.=!<>])[a-z_][a-z0-9_]*=(?!=)[\w\"'(\[-]"),
    # compute = (t1 - t0) + ..., out = ...; not "numel = 10" (a worked example's number)
    "an assignment": re.compile(
        r"(?<![\w.])[a-z_][a-z0-9_.]*[a-z0-9_]\s*[-+*/]?=\s*(?!=)(?!\d+(?:\.\d+)?\b)\S"
    ),
}


def code_in(text: str) -> list[str]:
    """What in ``text`` reads as code: "a call with arguments: `torch.cat(outs, dim=2)`", ..."""
    return [
        f"{what}: `{match.group(0)}`"
        for what, pattern in CODE_IN_WORDS.items()
        for match in pattern.finditer(text)
    ]


def _rung_text(lines: list[str]) -> str:
    return " ".join(line.strip() for line in lines)


def ladder_problems(todo: TodoHints) -> list[str]:
    where = f"TODO {todo.exercise} #{todo.number} ({todo.goal[:60]}, {todo.template})"
    levels = sorted(todo.rungs)
    problems = []
    if len(levels) < MIN_LATER_RUNGS:
        problems.append(
            f"{where}: {len(levels)} rung(s) after Hint 1 ({', '.join(map(str, levels))}); "
            f"at least {MIN_LATER_RUNGS}: one that asks, one or more that settle one decision "
            "each, one that gives the answer in words"
        )
    if levels and "?" not in _rung_text(todo.rungs[levels[0]]):
        problems.append(f"{where}: Hint {levels[0]} asks nothing: the first later rung asks")
    for level in levels:
        for found in code_in(_rung_text(todo.rungs[level])):
            problems.append(f"{where}: Hint {level} holds code, {found}; say it in words")
    return problems


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.id)
def test_every_todo_has_a_ladder_that_narrows_one_decision_at_a_time(ex: Exercise) -> None:
    todos = exercise_todos(ex.id)
    assert todos, f"exercise {ex.id} has no TODO"
    problems = [problem for todo in todos for problem in ladder_problems(todo)]
    assert not problems, "\n".join(problems)


def test_the_code_rule_catches_code_and_lets_words_pass() -> None:
    assert code_in("concatenate with torch.cat(outs, dim=2) at the end")
    assert code_in("read state.inputs[microbatch] back")
    assert code_in("compute = (t1 - t0) + (t3 - t2)")
    assert code_in("probs.mean(dim=0)")
    assert not code_in("call `dist.all_reduce` on the tp group, as rank(s) 0 and 1 do")
    assert not code_in("with numel = 10 and a world of 4: chunks of 3, 3, 2 and 2 elements")
    assert not code_in("a tensor [B, H] of logits; which group (dp or tp) sums it?")


# ----------------------------------------------------------------------------- guide sections

HEADING = re.compile(r"^(?P<level>#{3,4}) (?P<title>.+?)\s*$", re.MULTILINE)
NAMED_TRAPS = re.compile(r"pitfall|\btraps?\b|common mistakes|gotchas?", re.IGNORECASE)


def _parts(section: str) -> list[tuple[str, str]]:
    """(heading title, text up to the next heading) of every ### / #### part of a section."""
    marks = list(HEADING.finditer(_without_code(section)))
    return [
        (mark["title"], section[mark.end() : marks[i + 1].start() if i + 1 < len(marks) else None])
        for i, mark in enumerate(marks)
    ]


def _without_code(text: str) -> str:
    """``text`` with fenced code blocks blanked (same length), so '#' in code is no heading."""
    return re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)


def guide_section(ex: Exercise) -> str:
    guide = (ROOT / ex.phase / "guidelines.md").read_text()
    section = _section(guide, ex.anchor)
    assert section, f"{ex.phase}/guidelines.md has no section #{ex.anchor}"
    return section


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.id)
def test_every_exercise_section_states_its_contract_asks_and_says_what_is_checked(
    ex: Exercise,
) -> None:
    titles = [title for title, _ in _parts(guide_section(ex))]
    where = f"{ex.phase}/guidelines.md#{ex.anchor}"
    missing = [
        what
        for what, test in (
            ("a part whose heading says 'contract'", lambda t: "contract" in t.lower()),
            ("a part whose heading says 'question'", lambda t: "question" in t.lower()),
            ("'API you use'", lambda t: t == "API you use"),
            ("'What the tests check'", lambda t: t.startswith("What the tests check")),
        )
        if not any(test(title) for title in titles)
    ]
    assert not missing, f"{where} lacks {'; '.join(missing)} (its headings: {titles})"
    traps = [title for title in titles if NAMED_TRAPS.search(title)]
    assert not traps, (
        f"{where} has {traps}: the mistakes the graders name belong in "
        f"{ex.phase}/after_you_pass.md, read after passing"
    )


def question_units(ex: Exercise) -> list[str]:
    """Each question (a sentence ending in '?') of the section's questions parts."""
    units = []
    for title, text in _parts(guide_section(ex)):
        if "question" not in title.lower():
            continue
        for block in re.split(r"\n\s*\n|\n(?=\s*(?:[*-]|\d+\.) )", _without_code(text)):
            flat = " ".join(block.split())
            units += [q for q in re.split(r"(?<=[.?!:;])\s+(?=[^a-z\s])", flat) if q.endswith("?")]
    return units


def _squash(text: str) -> str:
    return " ".join(text.replace("`", "").split()).lower()


def _test_exists(caught_by: str) -> bool:
    path, _, name = caught_by.partition("::")
    name = name.split("[")[0]
    file = ROOT / path
    if not name or not file.exists():
        return False
    tree = ast.parse(file.read_text())
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
        for node in ast.walk(tree)
    )


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.id)
def test_every_question_of_the_guide_is_graded(ex: Exercise) -> None:
    units = question_units(ex)
    where = f"{ex.phase}/guidelines.md#{ex.anchor}"
    assert units, f"{where}: its questions parts ask nothing"
    listed = all_questions().get(ex.id, [])
    registry = registry_of(ex.id)
    ungraded = [unit for unit in units if not any(_squash(q.asks) in _squash(unit) for q in listed)]
    assert not ungraded, (
        f"{where}: {len(ungraded)} question(s) no test is listed for in {registry}: "
        + " | ".join(unit[:120] for unit in ungraded)
    )
    stale = [q.asks for q in listed if not any(_squash(q.asks) in _squash(u) for u in units)]
    assert not stale, f"{registry} lists questions {where} no longer asks: {stale}"
    absent = [q.caught_by for q in listed if not _test_exists(q.caught_by)]
    assert not absent, f"{registry} names tests that do not exist: {absent}"
