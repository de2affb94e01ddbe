"""What tests use to reach the code under test: the chosen implementation and small worlds.

``--impl templates`` (the default) grades the learner's ``phaseN_*/template_*.py``;
``--impl solutions`` grades the reference in ``solutions/``. Test modules never import either
directly: they call :func:`load`, here and inside the ranks of a world, so one switch decides.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from exercises import BY_ID

IMPL_ENV = "DTFS_IMPL"
IMPLS = ("templates", "solutions")

_blocked_reason: str | None = None  # set by conftest.py while a test of a hung exercise runs


def block_worlds(reason: str | None) -> None:
    """Make :func:`world` skip with ``reason`` instead of starting ranks (None: start them).

    conftest.py calls this before each test: once a world of an exercise has hung, the exercise's
    other worlds would most likely hang on the same line, each costing a full timeout.
    """
    global _blocked_reason
    _blocked_reason = reason


class LoadError(Exception):
    """The module under test could not be imported (a syntax error in a template, say)."""


def impl() -> str:
    value = os.environ.get(IMPL_ENV, "templates")
    if value not in IMPLS:
        raise LoadError(f"{IMPL_ENV}={value!r}: choose one of {', '.join(IMPLS)}")
    return value


def module_name(phase: str, module: str) -> str:
    if impl() == "solutions":
        return f"solutions.{phase}.{module}"
    return f"{phase}.template_{module}"


def load(phase: str, module: str) -> ModuleType:
    """Import the implementation of ``module`` chosen by ``--impl``."""
    name = module_name(phase, module)
    try:
        return importlib.import_module(name)
    except Exception as exc:
        where = name.replace(".", "/") + ".py"
        raise LoadError(f"could not import {where}: {type(exc).__name__}: {exc}") from exc


def exercise(exercise_id: str) -> Callable[[Any], Any]:
    """Mark a test as grading one exercise: ``@exercise("1.2")``; select with ``-m ex1_2``."""
    ex = BY_ID[exercise_id]

    def mark(test: Any) -> Any:
        test = pytest.mark.exercise(exercise_id)(test)
        return getattr(pytest.mark, ex.marker)(test)

    return mark


def world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    nodes: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks with the same ``--impl`` as the tests.

    ``timeout`` defaults to :func:`course.world.world_timeout`; ``nodes`` lays the ranks
    out as simulated nodes (see :func:`course.world.run_world`). Skips, before any rank
    starts, when an earlier world of the same exercise hung (see :func:`block_worlds`).
    """
    from course.world import run_world  # here, not at the top: tests/conftest.py imports this
    # module, and the first message of tests/preflight.py comes before torch loads

    if _blocked_reason is not None:
        pytest.skip(_blocked_reason)
    merged = {IMPL_ENV: impl(), **(env or {})}
    return run_world(fn, world_size, args, kwargs, env=merged, timeout=timeout, nodes=nodes)


def raised_in(exc: BaseException, files: Collection[str]) -> str | None:
    """The innermost function of the learner's modules that a rank's error came through:
    ``files`` are their file names (``"expert_parallel.py"`` stands for the solution and for
    ``template_expert_parallel.py``); None when no frame is theirs or ``exc`` is no rank's."""
    from course.world import RankFailed

    if not isinstance(exc, RankFailed):
        return None
    for frame in reversed(exc.frames):
        path = Path(frame.filename)
        in_phase = path.parent.name.startswith("phase")
        if in_phase and path.name.removeprefix("template_") in files:
            return frame.function
    return None


def learner_line(exc: BaseException) -> str:
    """`` (at phase3_multi_node/template_zero.py:88 in step)``: where the learner's code sent
    ``exc`` on its way, for a grader that turns a caught exception into its own message; "" when
    it came through none of the course's modules.

    The innermost line inside a function that holds an exercise's ``# TODO`` block wins
    (:func:`learner_todo_line`): a shape error raised deep in given code (``from_weights``) or
    torch is the learner's call's doing, and that call is the line to open (issue 49). Without
    such a frame, the innermost line of the course's modules (a template, a solution, or the
    given code beside them)."""
    course = _course_frames(exc)
    if not course:
        return ""
    rel, frame = course[0]
    return learner_todo_line(exc) or f" (at {rel}:{frame.lineno} in {frame.name})"


def learner_todo_line(exc: BaseException) -> str:
    """`` (at <file>:<line> in <function>)`` of the innermost frame of ``exc`` inside a function
    holding a ``# TODO <id>:`` block (a learner's function, or the reference's); "" if none."""
    root = Path(__file__).resolve().parents[1]
    for rel, frame in _course_frames(exc):
        path = root / rel
        try:
            spans = _todo_spans(path, path.stat().st_mtime)
        except OSError:
            continue
        if frame.lineno is not None and any(a <= frame.lineno <= b for a, b in spans):
            return f" (at {rel}:{frame.lineno} in {frame.name})"
    return ""


def _course_frames(exc: BaseException) -> list[tuple[Path, _Frame]]:
    """(path relative to the repository, frame) of ``exc``'s frames in the course's modules (a
    phase folder or solutions/), innermost first; a frame's name is its qualified name."""
    root = Path(__file__).resolve().parents[1]
    found: list[tuple[Path, _Frame]] = []
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        try:
            rel = Path(code.co_filename).resolve().relative_to(root)
        except ValueError:
            rel = None
        if rel is not None and (rel.parts[0].startswith("phase") or rel.parts[0] == "solutions"):
            found.append((rel, _Frame(tb.tb_lineno, getattr(code, "co_qualname", code.co_name))))
        tb = tb.tb_next
    return found[::-1]


@dataclass(frozen=True)
class _Frame:
    lineno: int
    name: str


@functools.cache
def _todo_spans(path: Path, mtime: float) -> tuple[tuple[int, int], ...]:
    """(first, last) line of every function of ``path`` holding a ``# TODO <id>:`` block (the
    learner's functions); ``mtime`` is part of the cache key, so an edit is read again."""
    import ast
    import re

    del mtime
    try:
        text = path.read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError):
        return ()
    lines = text.splitlines()
    marker = re.compile(r"#\s*TODO \d+\.\d+:")
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = lines[node.lineno - 1 : node.end_lineno]
            if any(marker.search(line) for line in body):
                spans.append((node.lineno, node.end_lineno or node.lineno))
    return tuple(spans)


def defined_at(function: Any) -> str:
    """`` (phase3_multi_node/template_zero_fsdp.py:69 in Prefetcher.before)``: where the code
    under test defines ``function``, for a judged failure (values, counts, order) that no
    traceback points at; "" when it cannot be found."""
    import inspect

    root = Path(__file__).resolve().parents[1]
    try:
        target = inspect.unwrap(function)
        path = Path(inspect.getsourcefile(target) or "").resolve()
        line = inspect.getsourcelines(target)[1]
        return f" ({path.relative_to(root)}:{line} in {target.__qualname__})"
    except (TypeError, OSError, ValueError):
        return ""


def current_test() -> str:
    """The name of the running test, without its parameters."""
    running = os.environ.get("PYTEST_CURRENT_TEST", "")
    return running.split("::")[-1].split("[")[0].split(" ")[0]


def step_aside_unless_mine(
    exc: BaseException, owners: Mapping[str, str], files: Collection[str]
) -> None:
    """Skip the running test when ``exc``, a shared world's error that several tests re-raise,
    came from a function of the learner's that another test grades: ``owners`` maps function
    names to the name of the test that reports their errors (the others step aside, so the
    error shows once, under a test named for what broke)."""
    function = raised_in(exc, files)
    owner = owners.get(function or "")
    if owner is not None and owner != current_test():
        pytest.skip(f"blocked by the error the ranks raised in {function}, reported by {owner}")


def ranks_agree(values: Sequence[Any]) -> bool:
    """True when every rank returned an equal value (tensors compared exactly)."""
    import torch

    first = values[0]
    for other in values[1:]:
        if isinstance(first, torch.Tensor):
            if not torch.equal(first, other):
                return False
        elif first != other:
            return False
    return True


def assert_bitwise_equal(
    got: Mapping[str, Any], want: Mapping[str, Any], what: str, advice: str
) -> None:
    """Fail, as a teacher's remark, unless every tensor of ``want`` is in ``got`` and
    ``torch.equal`` to it (resumed runs against uninterrupted ones); ``advice`` says what a resume
    must restore."""
    import torch

    for name, ref in want.items():
        if name not in got:
            pytest.fail(f"{what}: the final model has no {name!r}", pytrace=False)
        if not torch.equal(got[name], ref):
            diff = (got[name].double() - ref.double()).abs().max().item()
            pytest.fail(
                f"{what}: {name} differs from the uninterrupted run by up to {diff:.3e}; {advice}",
                pytrace=False,
            )


def without_cuda_on_cpu_ranks(worker: Callable[..., Any]) -> Callable[..., Any]:
    """A rank's worker that runs torch's ``powerSGD_hook`` on CPU tensors, made to work on a GPU
    machine too: that hook synchronizes CUDA whenever CUDA is available, even when its tensors are
    on the CPU (powerSGD_hook.py: ``if torch.cuda.is_available(): torch.cuda.synchronize(device)``)
    and then raises "Expected a cuda device, but got: cpu". In a world that computes on the CPU
    (gloo: more ranks than GPUs) CUDA is reported absent while the worker runs; a rank on a GPU and
    a machine without CUDA are left as they are."""
    import functools
    from unittest import mock

    @functools.wraps(worker)
    def run(*args: Any, **kwargs: Any) -> Any:
        import torch

        from course.distributed import current_info

        if not torch.cuda.is_available() or current_info().device.type == "cuda":
            return worker(*args, **kwargs)
        with mock.patch.object(torch.cuda, "is_available", lambda: False):
            return worker(*args, **kwargs)

    return run
