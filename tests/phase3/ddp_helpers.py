"""Shared pieces of the 3.4 grader (tests/phase3/grade_3_4_ddp.py): the code under test, the
small models, the torch references, and a recorder of the bucket all-reduces.

The recorder wraps ``dist.all_reduce`` (the Python entry point the exercise calls) for the length
of a ``with`` block and keeps, per call, when it was made (on an :class:`EventRecorder`, beside
the "gradient ready" events of test hooks), a copy of the bucket as it was handed over, and
whether it was asynchronous. torch's own DDP talks through its C++ Reducer, which the wrapper
does not see: it can run beside ours as the reference.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
from grading import impl, load, world
from learner_calls import at_learner_call
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from course.events import EventRecorder
from course.world import RankFailed

PHASE = "phase3_multi_node"
TOLERANCE = 1e-12  # float64: our sums and torch's may differ in the last bits (world 3)


def fail(message: str) -> NoReturn:
    """A teacher's remark, without the grader's traceback."""
    pytest.fail(message, pytrace=False)


def ddp_module() -> ModuleType:
    """``phase3_multi_node/ddp`` as ``--impl`` chose it."""
    return load(PHASE, "ddp")


def buckets_module() -> ModuleType:
    return load(PHASE, "ddp_buckets")


def raise_unwritten_todo(module: ModuleType) -> None:
    """Raise the first ``NotImplementedError("TODO ...")`` still in ``module``'s source, as its
    function would: a program that runs the module in its own worlds (a benchmark) reports an
    unwritten TODO as a failed run, which the harness could not tell from a wrong result."""
    import ast
    import inspect

    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if (
            isinstance(node, ast.Raise)
            and isinstance(node.exc, ast.Call)
            and isinstance(node.exc.func, ast.Name)
            and node.exc.func.id == "NotImplementedError"
            and node.exc.args
            and isinstance(node.exc.args[0], ast.Constant)
        ):
            raise NotImplementedError(node.exc.args[0].value)


def program(name: str) -> ModuleType:
    """A demo or benchmark module (no template; it runs ``--impl``'s exercise)."""
    return importlib.import_module(f"solutions.{PHASE}.{name}")


def impl_flag() -> list[str]:
    return ["--impl", impl()]


def small_world(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """A world of 2-4 ranks; a hang is reported after the world timeout (20 s by default), a
    deadlock 2-4 s after it sets in; an error raised in given code is reported at the
    learner's call that caused it."""
    try:
        return world(fn, world_size, *args)
    except RankFailed as exc:
        at_learner_call(exc, "3.4")
        raise


def first_problems(problems: list[str], header: str, limit: int = 5) -> None:
    unique = list(dict.fromkeys(problems))
    if unique:
        more = f"\n  ... and {len(unique) - limit} more" if len(unique) > limit else ""
        fail(header + "\n  " + "\n  ".join(unique[:limit]) + more)


# ----------------------------------------------------------------------------- models


def chain_mlp(seed: int, widths: tuple[int, ...] = (10, 30, 20, 5)) -> nn.Sequential:
    """Linear/Tanh layers in float64: gradients become ready from the last layer back."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).double()


class FeaturesNet(nn.Module):
    """A frozen layer, a weight used twice (``decoder.weight`` is ``hidden.weight``), a layer
    never used (``unused``), and one used only where ``use_extra`` (``extra``)."""

    def __init__(self, seed: int, use_extra: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(6, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.hidden = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.decoder = nn.Linear(8, 8)
        self.decoder.weight = self.hidden.weight  # tied: one parameter, used twice
        self.use_extra = use_extra
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.hidden(h))
        if self.use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.decoder(h)


class HeadFirst(nn.Module):
    """Registers its last layer first: its gradients are ready before the first bucket's."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.head = nn.Linear(30, 5)
        self.body = nn.Linear(10, 30)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def batch(
    step: int, samples: int, features: int, classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(samples, features, generator=g, dtype=torch.float64)
    return x, torch.randint(classes, (samples,), generator=g)


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = len(tensor) // world_size
    return tensor[rank * per : (rank + 1) * per]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The parameter that differs most, and by how much."""
    diffs = {n: float((got[n] - want[n]).abs().max()) for n in want}
    name = max(diffs, key=lambda n: diffs[n])
    return name, diffs[name]


# ----------------------------------------------------------------------------- torch's buckets


class BucketLog:
    """State of :func:`logging_allreduce_hook`: the parameter names of each bucket it saw."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.buckets: list[tuple[int, list[str]]] = []


def logging_allreduce_hook(
    state: BucketLog, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: note the bucket's index and parameters, then all-reduce."""
    state.buckets.append((bucket.index(), [state.names[id(p)] for p in bucket.parameters()]))
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


# DDP checks the hook's annotations against the real classes (they are strings here)
logging_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


# ----------------------------------------------------------------------------- the recorder


class DeferredWork:
    """Stands for an async all-reduce that runs only when someone waits for it."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._run: Callable[[], Any] | None = run

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if self._run is not None:
            self._run()
            self._run = None
        return True

    def is_completed(self) -> bool:
        return self._run is None


class RecordedWork:
    """An all-reduce's work that records a "wait" event (with its call number) when waited for."""

    def __init__(self, work: Any, events: EventRecorder, call: int) -> None:
        self._work, self._events, self._call = work, events, call

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        now = self._events.clock()
        self._events.record("wait", now, now, call=self._call)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@dataclass
class AllReduceRecorder:
    """``with AllReduceRecorder(events) as calls:`` records every ``dist.all_reduce``.

    ``deferred=True`` makes async all-reduces run at ``wait()`` (deterministically late), so
    code that reads a bucket without waiting reads its local, unreduced contents.
    """

    events: EventRecorder
    deferred: bool = False
    contents: list[torch.Tensor] = field(default_factory=list)
    async_flags: list[bool] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)
    pointers: list[int] = field(default_factory=list)
    _saved: Any = None

    def __enter__(self) -> AllReduceRecorder:
        self._saved = original = dist.all_reduce

        def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            now = self.events.clock()
            call = len(self.contents)
            self.events.record("all_reduce", now, now, call=call)
            self.contents.append(tensor.detach().clone())
            self.pointers.append(tensor.data_ptr())
            asynchronous = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            self.async_flags.append(asynchronous)
            self.groups.append(kwargs.get("group", args[1] if len(args) > 1 else None))
            if self.deferred and asynchronous:
                blocking = {k: v for k, v in kwargs.items() if k != "async_op"}
                work: Any = DeferredWork(lambda: original(tensor, *args[:2], **blocking))
            else:
                work = original(tensor, *args, **kwargs)
            return RecordedWork(work, self.events, call) if asynchronous else work

        dist.all_reduce = recorded
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._saved


def reset_problems(ddp: Any, backward: int) -> list[str]:
    """What ``_finish_reduction`` left unreset after ``backward`` (the state of DDPBase that
    ``_mark_ready`` changes: every bucket's pending count and work, the next bucket)."""
    problems = []
    for bucket in ddp.buckets:
        if bucket.pending != len(bucket.params):
            problems.append(
                f"after backward {backward}, bucket {bucket.index}'s pending count is "
                f"{bucket.pending}, not its {len(bucket.params)} parameters: the next backward "
                "would launch it before its gradients are in (or never). _finish_reduction "
                "must set every bucket's pending count back to the number of its parameters"
            )
            break
    if any(bucket.work is not None for bucket in ddp.buckets):
        problems.append(
            f"after backward {backward}, a bucket still keeps this backward's work: "
            "_finish_reduction must forget it (bucket.work = None) once it has waited for it"
        )
    if ddp._next_bucket != 0:
        problems.append(
            f"after backward {backward}, self._next_bucket is {ddp._next_bucket}, not 0: the "
            "next backward would start launching from there; _finish_reduction must reset it"
        )
    return problems


def record_grad_events(model: nn.Module, events: EventRecorder) -> dict[str, torch.Tensor]:
    """Hooks (registered before DDP's, so they run first) that record "grad" events with the
    parameter's position and keep a copy of each local gradient as it becomes ready."""
    grads: dict[str, torch.Tensor] = {}
    for position, (name, p) in enumerate(model.named_parameters()):
        if not p.requires_grad:
            continue

        def hook(param: torch.Tensor, name: str = name, position: int = position) -> None:
            now = events.clock()
            events.record("grad", now, now, param=position)
            assert param.grad is not None
            grads[name] = param.grad.detach().clone()

        p.register_post_accumulate_grad_hook(hook)
    return grads


@contextlib.contextmanager
def raises_in_rank() -> Iterator[list[str]]:
    """Collect the message of a RuntimeError raised inside the block (empty if none)."""
    caught: list[str] = []
    try:
        yield caught
    except NotImplementedError:
        raise  # an unwritten TODO: let the harness report it
    except RuntimeError as err:
        caught.append(str(err))
