"""What the 3.6 clipping grader runs: one process's ``clip_grad_norm_``, each rank's pieces of the
same gradients as a sharded model holds them, and the classic mistakes simulated.

The model is 3.6's stack of 4 Megatron MLP blocks (8 -> 16 -> 8, float64). One process computes
its gradients on a batch and clips them with ``torch.nn.utils.clip_grad_norm_``. For a layout,
each rank receives exactly the gradients a sharded model would hold there:

* **3D** (dp, tp, pp): its stage's blocks (pp), each block's tp piece (fc1 rows and bias, fc2
  columns) and fc2's bias whole (replicated on tp), the same on every dp rank (replicated on dp);
* **ZeRO-2/3** (dp, 1, pp): its stage's layers (fc1, fc2 of each block: one unit each, weight
  and bias flat), padded to a multiple of dp, this dp rank's slice (nothing replicated).

:func:`simulate` computes what a norm gets when some rules are broken (copies counted by every
rank; groups left out of the reduction; the inf-norm summed), so the grader can name a mistake
from the values it sees.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from grading import load
from parallel_3d_helpers import BLOCKS, FFN, HIDDEN, dense_model

PHASE = "phase3_multi_node"
NORMS = (2.0, math.inf)
CLIP_FRACTION = 0.5  # max_norm = half the true norm: clipping is active
TOLERANCE = 1e-12  # relative, float64


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: bool = False

    @property
    def label(self) -> str:
        kind = "ZeRO-2/3 gradient slices" if self.zero else "3D"
        return f"{kind}, (dp, tp, pp) = ({self.dp}, {self.tp}, {self.pp})"

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a global rank, in the course's order (tp fastest)."""
        stage, rest = divmod(rank, self.dp * self.tp)
        replica, shard = divmod(rest, self.tp)
        return stage, replica, shard


LAYOUTS = (
    Layout(2, 2, 1),
    Layout(1, 2, 2),
    Layout(2, 1, 2),
    Layout(4, 1, 1, zero=True),
    Layout(2, 1, 2, zero=True),
)


def dense_grads() -> dict[str, torch.Tensor]:
    model = dense_model()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, HIDDEN, generator=g, dtype=torch.float64)
    y = torch.randn(16, HIDDEN, generator=g, dtype=torch.float64)
    F.mse_loss(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def torch_clip(norm_type: float) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One process: (norm, max_norm, clipped gradients) by torch.nn.utils.clip_grad_norm_."""
    grads = dense_grads()
    model = dense_model()
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf, norm_type))
    max_norm = CLIP_FRACTION * norm
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))
    clipped = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, max_norm, clipped


@dataclass(frozen=True)
class Piece:
    """One tensor a rank holds: its name, values, and the axes it is replicated on."""

    name: str
    values: torch.Tensor
    replicated_on: frozenset[str]


def pieces(layout: Layout, rank: int, grads: dict[str, torch.Tensor]) -> list[Piece]:
    """The gradients ``rank`` holds under ``layout``, cut from one process's ``grads``."""
    stage, replica, shard = layout.coords(rank)
    per = BLOCKS // layout.pp
    out = []
    for local in range(per):
        block = stage * per + local
        if layout.zero:
            for layer in ("fc1", "fc2"):
                flat = torch.cat(
                    [grads[f"{block}.{layer}.weight"].reshape(-1), grads[f"{block}.{layer}.bias"]]
                )
                padded = -(-flat.numel() // layout.dp) * layout.dp
                flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
                size = padded // layout.dp
                piece = flat[replica * size : (replica + 1) * size]
                out.append(Piece(f"{local}.{layer} slice {replica}", piece, frozenset()))
            continue
        w = FFN // layout.tp
        rows = slice(shard * w, (shard + 1) * w)
        parts = {
            "fc1.weight": grads[f"{block}.fc1.weight"][rows],
            "fc1.bias": grads[f"{block}.fc1.bias"][rows],
            "fc2.weight": grads[f"{block}.fc2.weight"][:, rows],
            "fc2.bias": grads[f"{block}.fc2.bias"],
        }
        for name, values in parts.items():
            axes = {"dp", "tp"} if name == "fc2.bias" else {"dp"}
            out.append(Piece(f"{local}.{name}", values.contiguous(), frozenset(axes)))
    return out


# ----------------------------------------------------------------------------- inside the ranks


def clip_worker() -> list[dict[str, Any]]:
    """Every layout and norm on this rank of a world of 4: the norm the code under test returned
    and the gradients it left."""
    from course.topology import Topology

    clipping = load(PHASE, "grad_clipping")
    placement = load_placement()
    import torch.distributed as dist

    rank = dist.get_rank()
    grads = dense_grads()
    out = []
    for layout in LAYOUTS:
        topology = Topology.build(layout.dp, layout.tp, layout.pp)
        for norm_type in NORMS:
            _, max_norm, _ = torch_clip(norm_type)
            mine = pieces(layout, rank, grads)
            shards = [
                placement.GradShard(p.name, p.values.clone(), p.replicated_on) for p in mine
            ]
            total = clipping.clip_grad_norm_(shards, max_norm, norm_type, topology)
            out.append(
                {
                    "layout": layout,
                    "norm_type": norm_type,
                    "norm": float(total),
                    "grads": {s.name: s.grad.detach().clone() for s in shards},
                }
            )
    return out


def load_placement() -> Any:
    import importlib

    return importlib.import_module("phase3_multi_node.clip_placement")


# ----------------------------------------------------------------------------- the mistakes


@dataclass(frozen=True)
class Rules:
    """How a norm is computed: which copies are skipped, which groups reduce, the inf op."""

    skip_tp_copies: bool = True
    skip_dp_copies: bool = True
    reduce: frozenset[str] = frozenset({"dp", "tp", "pp"})
    inf_sum: bool = False


def simulate(layout: Layout, norm_type: float, rules: Rules,
             grads: dict[str, torch.Tensor]) -> list[float]:  # fmt: skip
    """The value every rank gets under ``rules``."""
    world = layout.dp * layout.tp * layout.pp
    partial = []
    for rank in range(world):
        _, replica, shard = layout.coords(rank)
        total = 0.0
        for piece in pieces(layout, rank, grads):
            skipped = (
                rules.skip_tp_copies and "tp" in piece.replicated_on and shard != 0
            ) or (rules.skip_dp_copies and "dp" in piece.replicated_on and replica != 0)
            values = piece.values.abs()
            if math.isinf(norm_type):
                if not rules.inf_sum or not skipped:
                    local = float(values.max()) if values.numel() else 0.0
                    total = max(total, local)
            elif not skipped:
                total += float(values.pow(norm_type).sum())
        partial.append(total)
    combine = sum if (not math.isinf(norm_type) or rules.inf_sum) else max
    out = []
    for rank in range(world):
        here = layout.coords(rank)
        members = [
            other
            for other in range(world)
            if all(
                a == b or axis in rules.reduce
                for axis, a, b in zip(("pp", "dp", "tp"), layout.coords(other), here, strict=True)
            )
        ]
        value = combine(partial[m] for m in members)
        out.append(value if math.isinf(norm_type) else value ** (1 / norm_type))
    return out


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(b), 1e-300)


def named_mistakes(layout: Layout, norm_type: float, got: list[float],
                   grads: dict[str, torch.Tensor]) -> str | None:  # fmt: skip
    """The smallest set of broken rules that gives ``got`` on every rank, said in words."""
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    axes_used = [axis for axis in ("dp", "tp", "pp") if sizes[axis] > 1]  # others cost nothing
    options = []
    for skip_tp, skip_dp, inf_sum in itertools.product((True, False), (True, False), (False, True)):
        if inf_sum and not math.isinf(norm_type):
            continue
        for size in range(len(axes_used) + 1):
            for axes in itertools.combinations(axes_used, size):
                options.append(Rules(skip_tp, skip_dp, frozenset(axes), inf_sum))
    correct = Rules(reduce=frozenset(axes_used))

    def broken(rules: Rules) -> list[str]:
        words = []
        if rules.inf_sum:  # with a MAX, copies change nothing: the sum is the one mistake
            return ["the inf-norm was summed: the largest |g| anywhere is a MAX over the ranks, "
                    "not a SUM of each rank's largest (ReduceOp.MAX)"]  # fmt: skip
        if not rules.reduce:
            return ["local norm only: no rank added the other ranks' parts (an all-reduce of "
                    "the partial result over the tp, pp and dp groups is missing)"]  # fmt: skip
        if "pp" not in rules.reduce and layout.pp > 1:
            words.append("the pipeline stages were not reduced: each stage holds other blocks, "
                         "so the partial result must be added over the pp group")  # fmt: skip
        if "tp" not in rules.reduce and layout.tp > 1:
            words.append("the tp pieces were not reduced over the tp group (each tp rank holds "
                         "other rows and columns)")  # fmt: skip
        if "dp" not in rules.reduce and layout.zero and layout.dp > 1:
            words.append("the dp slices were not reduced: under ZeRO/FSDP every dp rank holds "
                         "another slice of each gradient, so the dp group adds its parts too")  # fmt: skip
        elif "dp" not in rules.reduce and layout.dp > 1 and rules.skip_dp_copies:
            words.append("the dp group was not reduced: only dp rank 0 counts the replicated "
                         "gradients, so the other dp ranks end with a part of the norm (0 "
                         "here); add the parts over the dp group too")  # fmt: skip
        if not rules.skip_tp_copies and layout.tp > 1 and "tp" in rules.reduce:
            words.append(f"the tp-replicated fc2.bias was counted {layout.tp} times (tp times): "
                         "it is whole on every tp rank, so only one of them may count it")  # fmt: skip
        if not rules.skip_dp_copies and layout.dp > 1 and not layout.zero and "dp" in rules.reduce:
            words.append(f"the dp replicas were counted {layout.dp} times (dp times): after the "
                         "average every dp rank holds the same gradients, so only one of each "
                         "set of copies may count them")  # fmt: skip
        return words

    if not math.isinf(norm_type):
        want = simulate(layout, norm_type, correct, grads)
        if all(close(a, b**norm_type) for a, b in zip(got, want, strict=True)):
            return (f"every rank returned the norm to the power {norm_type:g}: the sum of "
                    f"|g|^{norm_type:g} is the p-th power of the norm; take its p-th root")  # fmt: skip
    matching = [
        r for r in options
        if all(close(a, b) for a, b in zip(got, simulate(layout, norm_type, r, grads), strict=True))
    ]  # fmt: skip
    # the fewest broken rules, then the most groups reduced: the explanation closest to right
    explained = [
        (len(broken(r)), -len(r.reduce), r.inf_sum, broken(r))
        for r in matching
        if broken(r) and r != correct
    ]
    if not explained:
        return None
    return "; ".join(min(explained)[3])
