"""What the 3.8 grader runs inside its ranks, and the single-process references it compares with.

One world per expert-parallel size runs several cases (k, capacity factor, tokens per rank, a
router that leaves an expert without tokens) one after the other and records, per case and rank,
everything the grader checks: the routing (experts, weights, kept choices), the output and the
load-balancing loss, the gradients after backward (tokens, router, this rank's experts), every
``all_to_all_single`` (its splits, checked against the peers' before the collective runs, so a
receiver that assumed equal splits is named instead of crashing gloo) and every other message.
The parent computes the same cases on one process with ``solutions/.../moe_reference.py`` (a
plain loop over tokens, sharing no code with the exercise) and compares.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from grading import load

from course.comm_counter import CommCounter
from phase3_multi_node.moe_experts import (
    DenseMoE,
    LocalExperts,
    MoEConfig,
    build_moe,
    experts_of_rank,
)
from phase3_multi_node.moe_layout import ExpertLayout
from solutions.phase3_multi_node.references.moe import ReferenceRank, capacity_of, reference_group

PHASE = "phase3_multi_node"
HIDDEN, FFN = 4, 8
SEED = 7
AUX_COEF = 0.1  # large enough that the router's gradient from the aux loss shows
TOLERANCE = 1e-12
ELEMENT = 8  # float64


def routing_module() -> Any:
    return load(PHASE, "moe_routing")


def ep_module() -> Any:
    return load(PHASE, "expert_parallel")


# ----------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One MoE layer and the tokens of each rank of its expert-parallel group.

    With ``idle`` experts, every token's feature 0 is 1 and those experts' router rows are
    (-20, 0, ...): their logit is -20, far below any other expert's, so no token chooses them."""

    name: str
    ep: int
    num_experts: int
    k: int
    capacity_factor: float
    tokens: tuple[int, ...]  # tokens per group rank
    idle: tuple[int, ...] = ()
    seed: int = SEED

    @property
    def config(self) -> MoEConfig:
        return MoEConfig(HIDDEN, FFN, self.num_experts, self.k, self.capacity_factor)

    @property
    def label(self) -> str:
        return f"3.8 ep={self.ep}, {self.name}"


EP2_CASES = (
    Case("k=1, capacity factor 0.75", 2, 4, 1, 0.75, (5, 8)),
    Case("k=2, capacity factor 0.75", 2, 4, 2, 0.75, (5, 8)),
    Case("k=2, nothing dropped", 2, 4, 2, 4.0, (7, 4)),
    Case("k=2, expert 3 gets no token", 2, 4, 2, 2.0, (6, 5), idle=(3,)),
    Case("k=1, rank 1's experts get no token", 2, 4, 1, 2.0, (4, 6), idle=(2, 3)),
)
EP4_CASES = (
    Case("k=1, capacity factor 1.0", 4, 8, 1, 1.0, (5, 8, 3, 6)),
    Case("k=2, capacity factor 0.75", 4, 8, 2, 0.75, (5, 8, 3, 6)),
    # expert 7 is kept idle by its router row; expert 3 gets no token by chance
    Case("k=2, experts 3 and 7 get no token", 4, 8, 2, 1.5, (3, 5, 4, 2), idle=(7,)),
)
CASES = {2: EP2_CASES, 4: EP4_CASES}


def case_model(case: Case) -> DenseMoE:
    dense = build_moe(case.config, seed=case.seed, dtype=torch.float64)
    with torch.no_grad():
        for e in case.idle:
            dense.router.weight[e] = 0.0
            dense.router.weight[e, 0] = -20.0
    return dense


def case_tokens(case: Case, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case.seed + 10 * rank + case.k)
    tokens = torch.randn(case.tokens[rank], HIDDEN, generator=g, dtype=torch.float64)
    if case.idle:  # see Case: the idle experts' logits are then the lowest by far
        tokens[:, 0] = 1.0
    return tokens


def case_probe(case: Case, rank: int) -> torch.Tensor:
    """What each rank's loss weighs its outputs with: loss = (output * probe).sum() + aux."""
    g = torch.Generator().manual_seed(77 + rank)
    return torch.randn(case.tokens[rank], HIDDEN, generator=g, dtype=torch.float64)


# ----------------------------------------------------------------------------- the all-to-alls


class SplitsMismatch(ValueError):
    """Raised on every rank of an all-to-all whose senders and receivers disagree on the rows."""


LEARNER_FILES = ("expert_parallel.py", "moe_routing.py")  # solutions/ or template_<name>


def learner_site() -> str:
    """`` (called at <file>:<line> in <function>)``: the innermost line of the learner's modules
    on this stack, which a check deep inside a wrapper names (the report shows the wrapper's
    frames last)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.parent.name == PHASE and path.name.removeprefix("template_") in LEARNER_FILES:
            where = f"{path.parent.name}/{path.name}"
            if path.parent.parent.name == "solutions":
                where = f"solutions/{where}"
            return f" (called at {where}:{frame.f_lineno} in {frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]
    return ""


@dataclass
class A2ACall:
    """One ``all_to_all_single`` as this rank made it (rows, not bytes, per peer)."""

    group_ranks: tuple[int, ...] | None
    me: int
    send: list[int]
    recv: list[int]
    row_bytes: int
    dtype: str
    explicit_recv: bool

    @property
    def bytes_to_others(self) -> int:
        return sum(rows for j, rows in enumerate(self.send) if j != self.me) * self.row_bytes


def _equal(rows: int, n: int) -> list[int] | None:
    return [rows // n] * n if rows % n == 0 else None


class SplitsLedger:
    """``with SplitsLedger() as ledger, CommCounter() as counter:``: records every
    ``all_to_all_single`` and, before it runs, checks on the call's group that what each rank
    sends to each other rank is what that rank expects from it (uncounted: it uses the
    unwrapped ``all_gather_into_tensor``). Enter it before the CommCounter."""

    def __init__(self) -> None:
        self.calls: list[A2ACall] = []
        self._saved: list[tuple[Any, Any]] = []
        # this rank's kept rows per destination rank, from the last exchange of per-expert
        # counts (an int64 all-to-all of equal splits): what the row splits must follow
        self.rows_per_peer: list[int] | None = None

    def __enter__(self) -> SplitsLedger:
        original = c10d.all_to_all_single
        gather = inspect.unwrap(c10d.all_gather_into_tensor)
        signature = inspect.signature(inspect.unwrap(original))

        @functools.wraps(original)  # a CommCounter around it then reads the real signature
        def ledger(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            out, inp, group = bound["output"], bound["input"], bound.get("group")
            n, me = dist.get_world_size(group), dist.get_rank(group)
            recv_given = bound.get("output_split_sizes")
            send_given = bound.get("input_split_sizes")
            recv = list(map(int, recv_given)) if recv_given else _equal(out.shape[0], n)
            send = list(map(int, send_given)) if send_given else _equal(inp.shape[0], n)
            if recv is not None and send is not None and len(recv) == len(send) == n:
                self._verify(gather, group, n, send, recv, bool(recv_given), inp)
            row_bytes = math.prod(inp.shape[1:]) * inp.element_size()
            ranks = (
                None
                if group is None or group is dist.group.WORLD
                else tuple(dist.get_process_group_ranks(group))
            )
            self.calls.append(
                A2ACall(
                    ranks, me, send or [], recv or [], row_bytes, str(inp.dtype), bool(recv_given)
                )
            )
            result = original(*args, **kwargs)
            if (
                inp.dtype == torch.long
                and inp.dim() == 1
                and inp.numel() % n == 0
                and not (bound.get("async_op"))
            ):
                self.rows_per_peer = inp.detach().view(n, -1).sum(dim=1).tolist()
            return result

        for module in (dist, c10d):
            self._saved.append((module, module.all_to_all_single))
            setattr(module, "all_to_all_single", ledger)  # noqa: B010  (mypy: dist's stub)
        return self

    def _verify(
        self,
        gather: Callable[..., Any],
        group: Any,
        n: int,
        send: list[int],
        recv: list[int],
        explicit: bool,
        inp: torch.Tensor,
    ) -> None:
        counted = self.rows_per_peer if self.rows_per_peer and len(self.rows_per_peer) == n else []
        mine = torch.tensor(
            [*send, *recv, int(explicit), *(counted or [-1] * n)],
            dtype=torch.long,
            device=inp.device,
        )
        table = torch.empty(n * mine.numel(), dtype=torch.long, device=inp.device)
        gather(table, mine, group=group)
        rows = table.view(n, -1).cpu()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
        counts = rows[:, 2 * n + 1 :]  # counts[i, j]: rows rank i keeps for rank j's experts
        for j in range(n):
            sent_to_j = rows[:, j].tolist()
            expected_by_j = rows[j, n : 2 * n].tolist()
            if sent_to_j != expected_by_j and inp.dtype != torch.long and bool((counts >= 0).all()):
                blame = _blame(rows, counts, n, j, ranks)
                if blame:
                    raise SplitsMismatch(
                        f"all_to_all_single #{len(self.calls) + 1} (the token rows, {inp.dtype}) "
                        f"on group {tuple(ranks)}: rank {ranks[j]} expects {expected_by_j} rows "
                        f"from ranks {tuple(ranks)}, but they send it {sent_to_j}. {blame}"
                        + learner_site()
                    )
            if sent_to_j != expected_by_j:
                what = "the counts" if inp.dtype == torch.long else "the token rows"
                even = max(expected_by_j) - min(expected_by_j) <= 1
                assumed = (
                    f" (rank {ranks[j]} passed no output_split_sizes: it assumed equal splits, "
                    "but the routing is uneven)"
                    if not rows[j, 2 * n]
                    else " (an even split of its rows: the receiver assumed equal splits, but "
                    "the routing is uneven)"
                    if even
                    else ""
                )
                raise SplitsMismatch(
                    f"all_to_all_single #{len(self.calls) + 1} ({what}, {inp.dtype}) on group "
                    f"{tuple(ranks)}: rank {ranks[j]} expects {expected_by_j} rows from ranks "
                    f"{tuple(ranks)}, but they send it {sent_to_j}{assumed}. A receiver cannot "
                    "guess: exchange the per-expert counts first and pass the received "
                    "counts, summed per rank, as output_split_sizes" + learner_site()
                )

    def __exit__(self, *exc: object) -> None:
        for module, function in reversed(self._saved):
            setattr(module, "all_to_all_single", function)  # noqa: B010
        self._saved.clear()


def _blame(rows: torch.Tensor, counts: torch.Tensor, n: int, j: int, ranks: list[int]) -> str:
    """Which side of a row all-to-all disagrees with the counts every rank exchanged before it
    (``counts[i, j]``: the rows rank i keeps for rank j's experts), or "" when neither fits. The
    rows go out along ``counts`` in dispatch and come back along its transpose in combine."""
    sent_to_j = rows[:, j].tolist()
    expected_by_j = rows[j, n : 2 * n].tolist()
    for table, phase in ((counts, "dispatch"), (counts.t(), "combine")):
        want = table[:, j].tolist()
        if expected_by_j == want and sent_to_j != want:
            wrong = [ranks[i] for i in range(n) if sent_to_j[i] != want[i]]
            return (
                f"The receiver is right: the counts exchanged before say ranks {tuple(ranks)} "
                f"hold {want} rows for it. The senders {wrong} are not ({phase}): "
                + (
                    "a rank's input_split_sizes are its kept rows per destination rank, its "
                    "per-expert counts summed over the experts of each destination (experts "
                    "are laid out rank by rank: rank r holds experts r*E/ep .. (r+1)*E/ep - 1)"
                    if phase == "dispatch"
                    else "combine sends each rank back exactly the rows it received from it: "
                    "its split sizes are dispatch's, swapped (input = dispatch's output splits)"
                )
            )
        if sent_to_j == want and expected_by_j != want:
            return (
                f"The senders are right (the counts exchanged before say {want} rows); rank "
                f"{ranks[j]}, the receiver, is not ({phase}): "
                + (
                    "its output_split_sizes are the rows each rank keeps for its experts, the "
                    "received counts summed per source rank"
                    if phase == "dispatch"
                    else "combine receives back exactly the rows it sent in dispatch: its "
                    "output split sizes are dispatch's input splits"
                )
            )
    return ""


# ----------------------------------------------------------------------------- inside the ranks


@dataclass
class CaseRun:
    """What one rank saw and did in one case."""

    experts: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    output: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    x_grad: torch.Tensor | None = None
    received: torch.Tensor | None = None  # the rows dispatch delivered to this rank's experts
    router_grad: torch.Tensor | None = None
    expert_grads: dict[int, dict[str, torch.Tensor | None]] = field(default_factory=dict)
    forward_a2a: list[A2ACall] = field(default_factory=list)
    backward_a2a: list[A2ACall] = field(default_factory=list)
    forward_ops: list[tuple[str, tuple[int, ...] | None]] = field(default_factory=list)
    backward_ops: list[tuple[str, tuple[int, ...] | None]] = field(default_factory=list)


def _grads(layer: Any) -> dict[int, dict[str, torch.Tensor | None]]:
    """This rank's experts' gradients by global expert index (the layer is an ``MoELayer``)."""
    grads: dict[int, dict[str, torch.Tensor | None]] = {}
    local_experts: LocalExperts = layer.experts
    for local, expert in enumerate(local_experts.experts):
        e = local_experts.first + local
        grads[e] = {
            name: None if p.grad is None else p.grad.detach().clone()
            for name, p in expert.named_parameters()
        }
    return grads


def _ops(counter: CommCounter) -> list[tuple[str, tuple[int, ...] | None]]:
    return [(r.op, r.group_ranks) for r in counter.records]


def run_case(case: Case, group: Any = None, rank: int | None = None) -> CaseRun:
    """One case on this rank (a member of ``group``, the expert-parallel group)."""
    ep_mod = ep_module()
    me = dist.get_rank(group) if rank is None else rank
    layer = ep_mod.MoELayer(case_model(case), group)
    x = case_tokens(case, me).requires_grad_()
    run = CaseRun()

    def delivered(_module: Any, args: tuple[Any, ...]) -> None:
        run.received = args[0].detach().clone()

    layer.experts.register_forward_pre_hook(delivered)
    with SplitsLedger() as ledger, CommCounter() as counter:
        output, aux = layer(x)
    run.forward_a2a, run.forward_ops = list(ledger.calls), _ops(counter)
    last = layer.last
    run.experts = last.routing.experts.detach().clone()
    run.weights = last.routing.weights.detach().clone()
    run.probs = last.routing.probs.detach().clone()
    run.keep = last.keep.detach().clone()
    run.output, run.aux = output.detach().clone(), aux.detach().clone()
    loss = (output * case_probe(case, me)).sum() + AUX_COEF * aux
    with SplitsLedger() as ledger, CommCounter() as counter:
        loss.backward()
    run.backward_a2a, run.backward_ops = list(ledger.calls), _ops(counter)
    run.x_grad = None if x.grad is None else x.grad.clone()
    grad = layer.router.weight.grad
    run.router_grad = None if grad is None else grad.clone()
    run.expert_grads = _grads(layer)
    return run


def run_cases(ep: int) -> list[CaseRun]:
    """Every case of this expert-parallel size, in order, on this rank of a world of ep."""
    runs = []
    for case in CASES[ep]:
        try:
            runs.append(run_case(case))
        except NotImplementedError:
            raise  # an unwritten TODO: the harness reports it as such
        except Exception as exc:
            # the learner's own error, traceback and all (its frames name their file and line);
            # the case it happened in comes as a note below the message
            exc.add_note(f"(in the case {case.label})")
            raise
    dist.barrier()
    return runs


# ----------------------------------------------------------------------------- the 2-D world

LAYOUT_EP, LAYOUT_DP = 2, 2
CASE_2D = Case("ep=2 x dp=2, k=2, capacity factor 1.0", 2, 4, 2, 1.0, (5, 8, 6, 3))


@dataclass
class Run2D:
    ep_ranks: tuple[int, ...] = ()
    dp_ranks: tuple[int, ...] = ()
    experts: tuple[int, ...] = ()
    pre_router_grad: torch.Tensor | None = None
    router_grad: torch.Tensor | None = None
    pre_expert_grads: dict[int, dict[str, torch.Tensor | None]] = field(default_factory=dict)
    expert_grads: dict[int, dict[str, torch.Tensor | None]] = field(default_factory=dict)
    moe_ops: list[tuple[str, tuple[int, ...] | None]] = field(default_factory=list)
    sync_records: list[tuple[str, int, tuple[int, ...] | None]] = field(default_factory=list)
    router_bytes: int = 0
    expert_bytes: int = 0
    output: torch.Tensor | None = None


def run_2d() -> Run2D:
    """The layer on the ep group of a 2 x 2 layout; each rank's loss is the mean over its own
    tokens; then ``sync_moe_gradients``."""
    ep_mod = ep_module()
    case = CASE_2D
    layout = ExpertLayout.build(ep=LAYOUT_EP, dp=LAYOUT_DP)
    rank = dist.get_rank()
    layer = ep_mod.MoELayer(case_model(case), layout.ep_group)
    run = Run2D(layout.ep_ranks, layout.dp_ranks, tuple(layer.experts.global_ids))
    x = case_tokens(case, rank)
    with SplitsLedger(), CommCounter() as counter:
        output, aux = layer(x)
        loss = (output * case_probe(case, rank)).sum() / x.shape[0] + AUX_COEF * aux
        loss.backward()
    run.output = output.detach().clone()
    run.moe_ops = _ops(counter)
    grad = layer.router.weight.grad
    run.pre_router_grad = None if grad is None else grad.clone()
    run.pre_expert_grads = _grads(layer)
    if grad is None or any(g is None for p in run.pre_expert_grads.values() for g in p.values()):
        dist.barrier()
        return run  # the grader names the missing gradients; syncing them would only crash
    run.router_bytes = sum(p.numel() * p.element_size() for p in layer.router.parameters())
    run.expert_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    with CommCounter() as counter:
        ep_mod.sync_moe_gradients(layer, layout)
    run.sync_records = [(r.op, r.nbytes, r.group_ranks) for r in counter.records]
    grad = layer.router.weight.grad
    run.router_grad = None if grad is None else grad.clone()
    run.expert_grads = _grads(layer)
    dist.barrier()
    return run


# ----------------------------------------------------------------------------- the references


@dataclass
class Reference:
    """One case on one process: per rank, what the router and the layer give, and the gradients."""

    ranks: list[ReferenceRank]
    x_grads: list[torch.Tensor]
    router_grads: list[torch.Tensor]  # per rank: the gradient of that rank's loss alone
    router_aux_grads: list[torch.Tensor]  # per rank: of that rank's aux term alone
    expert_grads: dict[int, dict[str, torch.Tensor]]  # of the sum of every rank's loss
    capacity: int


def reference(case: Case) -> Reference:
    dense = case_model(case)
    xs = [case_tokens(case, r).requires_grad_() for r in range(case.ep)]
    ranks = reference_group(dense, xs)
    losses = [
        (rank.output * case_probe(case, r)).sum() + AUX_COEF * rank.aux_loss
        for r, rank in enumerate(ranks)
    ]
    router_grads = [
        torch.autograd.grad(loss, dense.router.weight, retain_graph=True)[0] for loss in losses
    ]
    router_aux_grads = [
        torch.autograd.grad(AUX_COEF * rank.aux_loss, dense.router.weight, retain_graph=True)[0]
        for rank in ranks
    ]
    torch.stack(losses).sum().backward()
    return Reference(
        ranks,
        [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs],
        router_grads,
        router_aux_grads,
        _dense_expert_grads(dense),
        capacity_of(dense, case.tokens),
    )


def _dense_expert_grads(dense: DenseMoE) -> dict[int, dict[str, torch.Tensor]]:
    return {
        e: {
            name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for name, p in expert.named_parameters()
        }
        for e, expert in enumerate(dense.experts)
    }


def reference_2d() -> tuple[torch.Tensor, dict[int, dict[str, torch.Tensor]], list[torch.Tensor]]:
    """The router's and every expert's gradient of the mean of the 4 ranks' losses, and each
    rank's output: replica d is ranks (2d, 2d+1), each replica its own capacity."""
    case = CASE_2D
    dense = case_model(case)
    world = LAYOUT_EP * LAYOUT_DP
    losses, outputs = [], []
    for d in range(LAYOUT_DP):
        members = [d * LAYOUT_EP + j for j in range(LAYOUT_EP)]
        xs = [case_tokens(case, r) for r in members]
        for r, result in zip(members, reference_group(dense, xs), strict=True):
            loss = (result.output * case_probe(case, r)).sum() / case.tokens[r]
            losses.append(loss + AUX_COEF * result.aux_loss)
            outputs.append(result.output.detach())
    (torch.stack(losses).sum() / world).backward()
    assert dense.router.weight.grad is not None
    return dense.router.weight.grad.clone(), _dense_expert_grads(dense), outputs


# ----------------------------------------------------------------------------- comparisons


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def sends_between(case: Case, ref: Reference, kept_only: bool = True) -> list[list[int]]:
    """rows[r][d]: the token choices group rank r sends to group rank d's experts."""
    per = case.num_experts // case.ep
    rows = [[0] * case.ep for _ in range(case.ep)]
    for r, rank in enumerate(ref.ranks):
        for experts, flags in zip(rank.experts, rank.keep, strict=True):
            for e, kept in zip(experts, flags, strict=True):
                if kept or not kept_only:
                    rows[r][e // per] += 1
    return rows


def expert_param_names(case: Case) -> Sequence[str]:
    return [name for name, _ in build_moe(case.config).experts[0].named_parameters()]


def owner(case: Case, expert: int) -> int:
    per = case.num_experts // case.ep
    held = experts_of_rank(case.num_experts, case.ep, expert // per)
    assert expert in held
    return expert // per
