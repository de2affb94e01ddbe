"""What each grader's namers know: per function, its realistic mistakes, the factor or group each
is off by, and the graded case that tells it from the others (issue 49).

A namer (a function from what a check measured to the words of its failure) may name a cause
only when the measurement singles it out. That holds only if the graded cases separate every
pair of the function's known mistakes: on dp2 x cp2 with top-2 experts a mistake off by k and
one off by cp leave the same numbers, and a namer matching ratios names the one it knows. So
each exercise whose graders name causes writes its knowledge down here, in
``tests/phaseN/mistakes_exX_Y.py`` (``TABLES``, one :class:`NamerTable` per judged function), as
something tests/test_mistake_tables.py can run:

* ``right()`` is what the grader measures from a right answer, on every case it grades;
* ``plant(key)`` is what it measures from the mistake ``key`` (the namer's own reproduction of
  the mistake, or the mistake computed independently: better, it checks the namer too);
* ``name(measured)`` is the namer: the words of the failure, None when nothing is wrong;
* ``neighbours(key)`` are the mistakes one factor or one group away from ``key`` (generated from
  the function's factor list, not written by hand), as (label, measurement) pairs.

The test then asks, for every table: the right answer says nothing; each known mistake gets its
own words and no other mistake's; each neighbour that measures differently from every known
mistake gets no known mistake's words (an honest description or list, never a borrowed name);
every ``separated_by`` names a case the grader really grades. An exercise whose graders name no
cause says why in ``NO_NAMER`` instead of ``TABLES``.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class KnownMistake:
    """One realistic mistake of one function, and how the grading tells it from the others."""

    key: str  # short id, what the table's plant() takes
    off_by: str  # the factor or group it is off by: "a factor k", "dp for dp x cp"
    separated_by: str  # the graded case whose measurement tells it from every other mistake
    says: str  # words the namer's message holds when it names this mistake (a substring)


@dataclass(frozen=True)
class NamerTable:
    """A judged function's known mistakes, with the means to plant and name each."""

    exercise: str  # "4.7"
    function: str  # the learner's function: "balance_loss_share"
    factors: tuple[str, ...]  # what a realistic mistake can be off by in this function
    cases: tuple[str, ...]  # the graded cases the measurement spans (labels the grader uses)
    mistakes: tuple[KnownMistake, ...]
    right: Callable[[], Any]
    plant: Callable[[str], Any]
    name: Callable[[Any], str | None]
    neighbours: Callable[[str], Sequence[tuple[str, Any]]] = field(default=lambda key: ())

    def markdown(self) -> str:
        """The table as a reader sees it (``python -m tests.mistake_tables``)."""
        rows = [
            f"**{self.exercise} `{self.function}`**: can be off by {', '.join(self.factors)}; "
            f"graded on {', '.join(self.cases)}",
            "",
            "| mistake | off by | separated by |",
            "|---|---|---|",
        ]
        rows += [f"| {m.key} | {m.off_by} | {m.separated_by} |" for m in self.mistakes]
        return "\n".join(rows)


def same_measurement(a: Any, b: Any, tol: float = 1e-9) -> bool:
    """Equal measurements: tensors of equal shape, dtype and values (relative ``tol``), numbers,
    and sequences and mappings of them, compared recursively."""
    import torch  # lazily: collection stays light

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.numel() == 0:
            return True
        if a.is_floating_point() or a.is_complex():
            x, y = a.double(), b.double()
            equal = (x == y) | (torch.isnan(x) & torch.isnan(y))  # infinities and NaNs too
            diff = (x - y).abs().masked_fill(equal, 0.0)
            if torch.isnan(diff).any():
                return False
            finite = torch.cat([x.abs().flatten(), y.abs().flatten()])
            finite = finite[torch.isfinite(finite)]
            scale = float(finite.max()) if finite.numel() else 0.0  # relative to the largest
            return bool((diff <= tol * scale).all())
        return bool(torch.equal(a, b))
    if isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
            return False
        if a == b or (math.isnan(a) and math.isnan(b)):
            return True
        if math.isinf(a) or math.isinf(b):
            return False  # inf is no number's neighbour (an unequal inf was caught above)
        return abs(a - b) <= tol * max(abs(a), abs(b))  # relative: 5e-16 is not 5e-13
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_measurement(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(
            same_measurement(x, y, tol) for x, y in zip(a, b, strict=True)
        )
    return bool(a == b)


def settings_one_away(
    mistake: Mapping[str, Any],
    known: Iterable[Mapping[str, Any]],
    right: Mapping[str, Any],
    factors: Mapping[str, Sequence[Any]],
) -> list[dict[str, Any]]:
    """A mistake's neighbours, generated from its function's factor list: every setting that
    sets one factor of ``mistake`` to another value, other than the right answer and the
    ``known`` mistakes, each once (whole settings: one value per factor)."""
    taken = [{**right, **k} for k in known]
    out: list[dict[str, Any]] = []
    for factor, values in factors.items():
        for value in values:
            setting = {**right, **mistake, factor: value}
            if setting != dict(right) and setting not in taken and setting not in out:
                out.append(setting)
    return out


def one_factor_away(
    mistake: Mapping[str, Any],
    known: Iterable[Mapping[str, Any]],
    right: Mapping[str, Any],
    factors: Mapping[str, Sequence[Any]],
    measure: Callable[[dict[str, Any]], Any],
) -> list[tuple[str, Any]]:
    """:func:`settings_one_away`, each labelled by the factors it changes and measured
    (``measure`` takes only the changed factors)."""
    out: list[tuple[str, Any]] = []
    for setting in settings_one_away(mistake, known, right, factors):
        changed = {f: v for f, v in setting.items() if v != right[f]}
        out.append((", ".join(f"{f}: {v}" for f, v in changed.items()), measure(changed)))
    return out


def table_path(exercise: str) -> Path:
    """``tests/phase2/mistakes_ex2_6.py`` for ``"2.6"``."""
    return ROOT / f"tests/phase{exercise.split('.')[0]}/mistakes_ex{exercise.replace('.', '_')}.py"


def load_table_module(exercise: str) -> ModuleType | None:
    """The exercise's mistakes module, or None when it has none yet."""
    path = table_path(exercise)
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"_mistakes_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it is made
    spec.loader.exec_module(module)
    return module


def tables_of(exercise: str) -> tuple[NamerTable, ...]:
    module = load_table_module(exercise)
    return tuple(getattr(module, "TABLES", ())) if module is not None else ()


def main() -> None:
    """Print every exercise's tables (or why it has none) as markdown."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from exercises import EXERCISES

    for exercise in EXERCISES:
        module = load_table_module(exercise.id)
        if module is None:
            print(f"## {exercise.id}: no table yet\n")
            continue
        print(f"## {exercise.id} {exercise.title}\n")
        if getattr(module, "NO_NAMER", None):
            print(f"No namer: {module.NO_NAMER}\n")
        for table in getattr(module, "TABLES", ()):
            print(table.markdown() + "\n")


if __name__ == "__main__":
    main()
