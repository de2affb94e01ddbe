"""What the 3.6 clipping grader runs: one process's ``clip_grad_norm_``, each rank's pieces of the
same gradients as a sharded model holds them, and the classic mistakes simulated.

The model is 3.6's stack of 4 Megatron MLP blocks (8 -> 16 -> 8, float64). One process computes
its gradients on a batch and clips them with ``torch.nn.utils.clip_grad_norm_``, for every norm
type of :data:`NORMS`. For a layout, each rank receives exactly the gradients a sharded model
would hold there:

* **3D** (dp, cp, tp, pp): its stage's blocks (pp), each block's tp piece (fc1 rows and bias, fc2
  columns) and fc2's bias whole (replicated on tp), the same on every dp and cp rank (replicated
  on ``"dp"``, or with context parallelism on ``"dp_cp"`` as 4.7 places them, or ``"dp"`` and
  ``"cp"`` spelled apart);
* **ZeRO-2/3** (dp, cp, 1, pp): its stage's layers (fc1, fc2 of each block: one unit each, weight
  and bias flat), padded to a multiple of dp x cp, this (dp, cp) rank's slice (nothing
  replicated: every rank of dp x cp holds another slice, as Megatron's distributed optimizer
  shards over data x context ranks).

:func:`named_mistakes` simulates what a norm gets when some rules are broken (copies counted by
every rank of a group; groups left out of the reduction; the power, the root or the reduction
of the norm itself wrong) and says which mistakes give the values the ranks returned: one by
name when only one does, the candidates when several do.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from grading import load
from parallel_3d_helpers import BLOCKS, FFN, HIDDEN, dense_model

PHASE = "phase3_multi_node"
# every kind of norm the API takes (a positive number or inf): 2 and inf first (the common
# ones: an error there is reported as raised), then an odd one, 1, and two fractional ones
NORMS = (2.0, math.inf, 3.0, 1.0, 1.5, 0.5)
FIRST_NORMS = (2.0, math.inf)
# what torch.nn.utils.clip_grad_norm_ takes but the API refuses (ValueError): torch gives 0 the
# number of tensors with a non-zero gradient, -inf the smallest |g|, negative p a harmonic-like
# mean, nan a nan
REFUSED = (0.0, -1.0, -math.inf, math.nan)
CLIP_FRACTION = 0.5  # max_norm = half the true norm: clipping is active
TOLERANCE = 1e-12  # relative, float64
AXES = ("pp", "dp", "cp", "tp")  # the course's rank order, slowest to fastest
GROUP_AXES = {"dp": ("dp",), "cp": ("cp",), "tp": ("tp",), "dp_cp": ("dp", "cp")}


def norm_name(norm_type: float) -> str:
    if math.isnan(norm_type):
        return "nan"
    if math.isinf(norm_type):
        return "inf-norm" if norm_type > 0 else "-inf-norm"
    return f"{norm_type:g}-norm"


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: bool = False
    cp: int = 1
    copies: tuple[str, ...] = ("dp",)  # the groups a 3D stage's weights are replicated on

    @property
    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def label(self) -> str:
        if self.cp == 1:
            kind = "ZeRO-2/3 gradient slices" if self.zero else "3D"
            return f"{kind}, (dp, tp, pp) = ({self.dp}, {self.tp}, {self.pp})"
        if self.zero:
            kind = "ZeRO-2/3 gradient slices over dp x cp"
        else:
            kind = "3D, weights replicated on " + " and ".join(f'"{g}"' for g in self.copies)
        return f"{kind}, (dp, cp, tp, pp) = ({self.dp}, {self.cp}, {self.tp}, {self.pp})"

    def coords(self, rank: int) -> dict[str, int]:
        """pp, dp, cp, tp of a global rank, in the course's order (tp fastest)."""
        out = {}
        for axis in reversed(AXES):
            rank, out[axis] = divmod(rank, self.sizes[axis])
        return out


LAYOUTS = (
    Layout(2, 2, 1),
    Layout(1, 2, 2),
    Layout(2, 1, 2),
    Layout(4, 1, 1, zero=True),
    Layout(2, 1, 2, zero=True),
    Layout(1, 2, 1, cp=2, copies=("dp_cp",)),  # 4.7's cp2 x tp2
    Layout(1, 1, 2, cp=2, copies=("dp", "cp")),
    Layout(2, 1, 1, zero=True, cp=2),
)


def dense_grads() -> dict[str, torch.Tensor]:
    model = dense_model()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, HIDDEN, generator=g, dtype=torch.float64)
    y = torch.randn(16, HIDDEN, generator=g, dtype=torch.float64)
    F.mse_loss(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


_TORCH_CLIP: dict[float, tuple[float, float, dict[str, torch.Tensor]]] = {}


def torch_clip(norm_type: float) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One process: (norm, max_norm, clipped gradients) by torch.nn.utils.clip_grad_norm_."""
    if norm_type not in _TORCH_CLIP:
        grads = dense_grads()
        model = dense_model()
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf, norm_type))
        max_norm = CLIP_FRACTION * norm
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))
        clipped = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        _TORCH_CLIP[norm_type] = (total, max_norm, clipped)
    return _TORCH_CLIP[norm_type]


@dataclass(frozen=True)
class Piece:
    """One tensor a rank holds: its name, values, and the groups it is replicated on."""

    name: str
    values: torch.Tensor
    replicated_on: frozenset[str]

    @property
    def copy_axes(self) -> frozenset[str]:
        return frozenset(a for g in self.replicated_on for a in GROUP_AXES[g])


def pieces(layout: Layout, rank: int, grads: dict[str, torch.Tensor]) -> list[Piece]:
    """The gradients ``rank`` holds under ``layout``, cut from one process's ``grads``."""
    here = layout.coords(rank)
    per = BLOCKS // layout.pp
    out = []
    for local in range(per):
        block = here["pp"] * per + local
        if layout.zero:
            ranks = layout.dp * layout.cp
            index = here["dp"] * layout.cp + here["cp"]
            for layer in ("fc1", "fc2"):
                flat = torch.cat(
                    [grads[f"{block}.{layer}.weight"].reshape(-1), grads[f"{block}.{layer}.bias"]]
                )
                padded = -(-flat.numel() // ranks) * ranks
                flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
                size = padded // ranks
                piece = flat[index * size : (index + 1) * size]
                out.append(Piece(f"{local}.{layer} slice {index}", piece, frozenset()))
            continue
        w = FFN // layout.tp
        rows = slice(here["tp"] * w, (here["tp"] + 1) * w)
        parts = {
            "fc1.weight": grads[f"{block}.fc1.weight"][rows],
            "fc1.bias": grads[f"{block}.fc1.bias"][rows],
            "fc2.weight": grads[f"{block}.fc2.weight"][:, rows],
            "fc2.bias": grads[f"{block}.fc2.bias"],
        }
        for name, values in parts.items():
            groups = set(layout.copies) | ({"tp"} if name == "fc2.bias" else set())
            out.append(Piece(f"{local}.{name}", values.contiguous(), frozenset(groups)))
    return out


# ----------------------------------------------------------------------------- inside the ranks


def raised_where(exc: BaseException, module: Any) -> str:
    """``TypeError: ... (phase3_multi_node/template_grad_clipping.py:80 in global_grad_norm)``:
    an error and the last line of the code under test it passed through."""
    root = Path(__file__).resolve().parents[2]
    target = Path(getattr(module, "__file__", "") or "").resolve()
    where = ""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if Path(code.co_filename).resolve() == target:
            try:
                shown = target.relative_to(root)
            except ValueError:
                shown = target
            where = f" ({shown}:{tb.tb_lineno} in {code.co_name})"
        tb = tb.tb_next
    return f"{type(exc).__name__}: {exc}{where}"


def clip_worker() -> list[dict[str, Any]]:
    """Every layout and norm on this rank of a world of 4: the norm the code under test returned
    and the gradients it left (or the error it raised, for a norm type other than 2 and inf),
    then what it does with the norm types the API refuses."""
    import torch.distributed as dist

    from course.topology import Topology

    clipping = load(PHASE, "grad_clipping")
    placement = load_placement()
    # after an error a rank waits here for the others (a group the code under test never sees):
    # an error on some ranks only then hangs, and is reported, instead of pairing collectives
    fence = dist.new_group(list(range(dist.get_world_size())))
    assert isinstance(fence, dist.ProcessGroup)
    rank = dist.get_rank()
    grads = dense_grads()

    def shards_of(layout: Layout) -> list[Any]:
        return [
            placement.GradShard(p.name, p.values.clone(), p.replicated_on)
            for p in pieces(layout, rank, grads)
        ]

    out: list[dict[str, Any]] = []
    topology = None
    for layout in LAYOUTS:
        topology = Topology.build(layout.dp, layout.tp, layout.pp, cp=layout.cp)
        for norm_type in NORMS:
            _, max_norm, _ = torch_clip(norm_type)
            shards = shards_of(layout)
            result: dict[str, Any] = {"layout": layout, "norm_type": norm_type}
            try:
                total = clipping.clip_grad_norm_(shards, max_norm, norm_type, topology)
            except NotImplementedError:
                raise
            except Exception as exc:
                if norm_type in FIRST_NORMS:
                    raise
                result["raised"] = raised_where(exc, clipping)
                dist.barrier(group=fence)
            else:
                result["norm"] = float(total)
                result["grads"] = {s.name: s.grad.detach().clone() for s in shards}
            out.append(result)
    for index, norm_type in enumerate(REFUSED):  # on the last layout
        refusal: dict[str, Any] = {"refused_case": index, "norm_type": norm_type}
        try:
            value = clipping.clip_grad_norm_(shards_of(LAYOUTS[-1]), 1.0, norm_type, topology)
        except NotImplementedError:
            raise
        except ValueError:
            refusal["outcome"] = None
            dist.barrier(group=fence)
        except Exception as exc:
            refusal["outcome"] = "raised " + raised_where(exc, clipping)
            dist.barrier(group=fence)
        else:
            refusal["outcome"] = f"returned {float(value):.6g}"
        out.append(refusal)
    return out


def load_placement() -> Any:
    import importlib

    return importlib.import_module("phase3_multi_node.clip_placement")


# ----------------------------------------------------------------------------- the mistakes

# how the norm itself is computed: the term each element adds, how the ranks' parts combine
# (sum or max), what each rank does to its part before the reduction and what every rank does
# after it. "right" is torch's formula.
FINITE_WAYS = ("right", "two", "pow2", "root2", "noroot", "rootfirst", "combine2", "noabs")
INF_WAYS = ("right", "sum", "signed", "signed_sum", "powpath", "powroot")


@dataclass(frozen=True)
class Rules:
    """How a norm is computed: along which axes a copy is counted once (``skip``: the other
    ranks of the axis skip it), which axes are reduced, and the way the norm is taken."""

    skip: frozenset[str]
    reduce: frozenset[str]
    way: str = "right"


def _fpow(x: float, e: float) -> float:
    """``x ** e`` as a float64 tensor computes it (nan for a negative x and a fractional e)."""
    if math.isnan(x):
        return x
    if x < 0 and e != int(e):
        return math.nan
    try:
        return float(x**e)
    except (OverflowError, ZeroDivisionError):
        return math.inf


@dataclass(frozen=True)
class _Held:
    """One piece of one rank, reduced to the numbers a norm of it needs."""

    copy_axes: frozenset[str]
    terms: dict[str, float]


def _held(layout: Layout, norm_type: float, grads: dict[str, torch.Tensor]) -> list[list[_Held]]:
    out = []
    for rank in range(layout.world):
        mine = []
        for piece in pieces(layout, rank, grads):
            g = piece.values
            if math.isinf(norm_type):
                terms = {
                    "max_abs": float(g.abs().max()) if g.numel() else 0.0,
                    "max_signed": float(g.max()) if g.numel() else 0.0,
                    "abs_inf": float(g.abs().pow(math.inf).sum()),
                }
            else:
                terms = {
                    "abs_p": float(g.abs().pow(norm_type).sum()),
                    "abs_2": float(g.pow(2).sum()),
                    "signed_p": float(g.pow(norm_type).sum()),
                }
            mine.append(_Held(piece.copy_axes, terms))
        out.append(mine)
    return out


def _term(way: str, inf: bool) -> str:
    if inf:
        if way in ("powpath", "powroot"):
            return "abs_inf"
        return "max_abs" if way in ("right", "sum") else "max_signed"
    return {"two": "abs_2", "pow2": "abs_2", "noabs": "signed_p"}.get(way, "abs_p")


def simulate(
    layout: Layout, norm_type: float, rules: Rules, held: list[list[_Held]]
) -> list[float]:
    """The value every rank gets under ``rules``."""
    inf = math.isinf(norm_type)
    term = _term(rules.way, inf)
    local_max = inf and rules.way not in ("powpath", "powroot")  # a rank's largest term
    use_max = inf and rules.way in ("right", "signed")  # and the largest over the ranks
    partial = []
    for rank in range(layout.world):
        here = layout.coords(rank)
        total = 0.0
        for h in held[rank]:
            if not all(here[a] == 0 for a in h.copy_axes & rules.skip):
                continue  # another rank of this set of copies counts it
            value = h.terms[term]
            total = max(total, value) if local_max else total + value
        if not inf and rules.way == "rootfirst":
            total = _fpow(total, 1 / norm_type)
        elif not inf and rules.way == "combine2":
            total = _fpow(total, 2 / norm_type)
        partial.append(total)
    out = []
    for rank in range(layout.world):
        here = layout.coords(rank)
        members = [
            partial[other]
            for other in range(layout.world)
            if all(layout.coords(other)[a] == here[a] or a in rules.reduce for a in AXES)
        ]
        value = max(members) if use_max else sum(members)
        if inf:
            out.append(_fpow(value, 0.0) if rules.way == "powroot" else value)
        elif rules.way in ("two", "root2", "combine2"):
            out.append(_fpow(value, 0.5))
        elif rules.way in ("noroot", "rootfirst"):
            out.append(value)
        else:
            out.append(_fpow(value, 1 / norm_type))
    return out


def close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= TOLERANCE * max(abs(b), 1e-300)


def _way_words(way: str, norm_type: float) -> list[str]:
    """What is wrong with ``way`` for this norm type (nothing where it gives the same norm)."""
    p = norm_type
    if math.isinf(p):
        inf_words = {
            "sum": ["the inf-norm was summed: the largest |g| anywhere is a MAX over the ranks, "
                    "not a SUM of each rank's largest (ReduceOp.MAX)"],
            "signed": ["the largest g was taken, not the largest |g|: the inf-norm is the max of "
                       "ABSOLUTE values"],
            "signed_sum": ["the largest g was taken, not the largest |g|, and the ranks' maxima "
                           "were summed (the inf-norm is a MAX of absolute values)"],
            "powpath": ["norm_type inf went through the finite-p path: |g|^inf is 0 (|g| < 1) or "
                        "inf, and the power 1/inf of anything is 1; the inf-norm is the largest "
                        "|g|, reduced with ReduceOp.MAX"],
        }  # fmt: skip
        return inf_words.get("powpath" if way == "powroot" else way, [])
    if way in ("two", "pow2", "root2", "combine2") and p == 2:
        return []
    if way in ("noroot", "rootfirst") and p == 1:
        return []
    if way == "noabs" and p == int(p) and int(p) % 2 == 0:
        return []
    finite_words = {
        "two": [f"the 2-norm was computed, not the {p:g}-norm: norm_type must be the power of "
                f"|g| and of the root, (sum |g|^{p:g})^(1/{p:g}), not 2"],
        "pow2": [f"|g| was squared, not raised to the power norm_type = {p:g} (the root, the "
                 f"power 1/{p:g}, is right)"],
        "root2": [f"a square root ended it, not the power 1/{p:g} (the sum of |g|^{p:g} is "
                  "right)"],
        "noroot": [f"the root is missing: every rank returned the sum of |g|^{p:g}, the norm to "
                   f"the power {p:g}; raise it to the power 1/{p:g} once, after the "
                   "reductions"],
        "rootfirst": [f"the root (the power 1/{p:g}) was taken on each rank before the sum over "
                      f"the groups: norms do not add, the sums of |g|^{p:g} do; reduce those, "
                      "then take the root once"],
        "combine2": [f"each rank's {p:g}-norm was combined with the others' as a 2-norm "
                     f"(squares summed, then a square root): it is the sums of |g|^{p:g} that "
                     "add over the groups"],
        "noabs": [f"the absolute value is missing: g^{p:g} of a negative g is "
                  + ("NaN" if p != int(p) else "negative (a sum that comes out negative has a "
                     "NaN root)") + "; raise |g| to the power p"],
    }  # fmt: skip
    return finite_words.get(way, [])


@dataclass(frozen=True)
class Named:
    """What the mistake-namer concluded: one cause (``causes`` of one), several that fit, or
    none; ``function`` is the function of the code under test to point at."""

    causes: tuple[tuple[str, ...], ...]
    function: str

    def text(self) -> str:
        if len(self.causes) == 1:
            return "; ".join(self.causes[0])
        listed = "; ".join(
            f"({chr(ord('a') + i)}) {' and '.join(words)}" for i, words in enumerate(self.causes)
        )
        return f"these values fit {len(self.causes)} mistakes, most likely first: {listed}"


def named_mistakes(
    layout: Layout,
    norm_type: float,
    got: Sequence[float],
    grads: dict[str, torch.Tensor],
    elsewhere: Sequence[tuple[Layout, Sequence[float]]] = (),
) -> Named | None:
    """The smallest sets of broken rules that give ``got`` on every rank, in words: one when
    only one fits, all of the fewest-broken ones when several do; None when none does.
    ``elsewhere``: what the ranks returned on the other graded layouts for this norm type;
    a set of rules that also gives those is preferred (the evidence of every layout), and only
    when none does are the rules that fit this layout alone reported."""
    inf = math.isinf(norm_type)
    sizes = layout.sizes
    held = _held(layout, norm_type, grads)
    axes_used = [a for a in AXES if sizes[a] > 1]  # a group of one rank costs nothing
    copy_axes = [  # axes along which some piece is a copy
        a for a in ("dp", "cp", "tp")
        if sizes[a] > 1 and any(a in h.copy_axes for mine in held for h in mine)
    ]  # fmt: skip
    slice_axes = {a for a in ("dp", "cp") if layout.zero and sizes[a] > 1}

    def broken(rules: Rules) -> tuple[list[str], list[str]]:
        """(words, functions at fault) of a set of rules on this layout and norm type."""
        words = _way_words(rules.way, norm_type)
        functions = ["global_grad_norm"] if words else []
        if not rules.reduce:
            words.append("local norm only: no rank added the other ranks' parts (an all-reduce "
                         "of the partial result over the groups of every axis is missing)")  # fmt: skip
            return words, [*functions, "global_grad_norm"]
        for axis in axes_used:
            if axis in rules.reduce:
                continue
            if axis == "pp":
                said = ("the pipeline stages were not reduced: each stage holds other blocks, so "
                        "the partial result must be added over the pp group")  # fmt: skip
            elif axis == "tp":
                said = ("the tp pieces were not reduced over the tp group (each tp rank holds "
                        "other rows and columns)")  # fmt: skip
            elif axis in slice_axes:
                said = (f"the {axis} slices were not reduced: under ZeRO/FSDP every rank of "
                        f"dp x cp holds another slice of each gradient, so the {axis} group adds "
                        "its parts too")  # fmt: skip
            elif axis in rules.skip:
                said = (f"the {axis} group was not reduced: only {axis} rank 0 counts the "
                        f"gradients replicated along {axis}, so the other {axis} ranks end with a "
                        f"part of the norm (0 here); add the parts over the {axis} group too")  # fmt: skip
            else:  # every rank counts its own copy and nobody adds them: right for this axis
                continue
            words.append(said)
            functions.append("global_grad_norm")
        if not inf:  # copies cannot change a max, and a summed inf-norm is one mistake
            for axis in copy_axes:
                if axis in rules.skip or axis not in rules.reduce:
                    continue
                if axis == "tp":
                    said = (f"the tp-replicated fc2.bias was counted {sizes['tp']} times (tp "
                            "times): it is whole on every tp rank, so only one of them may "
                            "count it")  # fmt: skip
                elif axis == "dp":
                    said = (f"the dp replicas were counted {sizes['dp']} times (dp times): after "
                            "the average every dp rank holds the same gradients, so only one of "
                            "each set of copies may count them")  # fmt: skip
                else:
                    said = (f"the copies along cp were counted {sizes['cp']} times (cp times): "
                            "the cp ranks hold the same weights (replicated_on names \"cp\" or "
                            "\"dp_cp\"), so only one of them may count them: counted_here must "
                            "read every group of replicated_on")  # fmt: skip
                words.append(said)
                functions.append("counted_here")
        return words, functions

    ways = INF_WAYS if inf else FINITE_WAYS
    found: dict[tuple[str, ...], tuple[tuple[int, int], list[str]]] = {}
    everywhere: dict[tuple[str, ...], tuple[tuple[int, int], list[str]]] = {}
    held_elsewhere: dict[Layout, list[list[_Held]]] = {}

    def fits_elsewhere(rules: Rules) -> bool:
        """Whether ``rules``, right for every group this layout cannot judge (a group of one
        rank, copies it does not hold), also give what the other layouts returned."""
        unjudged_copies = {"dp", "cp", "tp"} - set(copy_axes)
        unjudged = {a for a in AXES if sizes[a] == 1}
        reduce = rules.reduce | unjudged if rules.reduce else rules.reduce  # local: none at all
        rules = Rules(rules.skip | unjudged_copies, reduce, rules.way)
        for other, values in elsewhere:
            if other not in held_elsewhere:
                held_elsewhere[other] = _held(other, norm_type, grads)
            simulated = simulate(other, norm_type, rules, held_elsewhere[other])
            if not all(close(a, b) for a, b in zip(values, simulated, strict=True)):
                return False
        return bool(elsewhere)

    skips = [
        frozenset(s)
        for n in range(len(copy_axes) + 1)
        for s in itertools.combinations(copy_axes, n)
    ]
    for way in ways:
        for skip in skips:
            for n in range(len(axes_used) + 1):
                for reduce in itertools.combinations(axes_used, n):
                    rules = Rules(skip, frozenset(reduce), way)
                    words, functions = broken(rules)
                    if not words:
                        continue
                    values = simulate(layout, norm_type, rules, held)
                    if all(close(a, b) for a, b in zip(got, values, strict=True)):
                        # the fewest broken rules, then the most groups reduced
                        rank = (len(words), -len(reduce))
                        key = tuple(words)
                        into = everywhere if fits_elsewhere(rules) else found
                        if key not in into or rank < into[key][0]:
                            into[key] = (rank, functions)
    found = everywhere or found
    if not found:
        return None
    fewest = min(rank[0] for rank, _ in found.values())
    best = sorted(
        (item for item in found.items() if item[1][0][0] == fewest), key=lambda item: item[1][0]
    )
    blamed = {f for _, (_, fs) in best for f in fs}
    function = "counted_here" if blamed == {"counted_here"} else "global_grad_norm"
    return Named(tuple(words for words, _ in best), function)


def evidence(values: Sequence[float]) -> str:
    """``every rank returned 3.2`` or ``ranks 0, 1 returned 3.2, ranks 2, 3 returned 0``."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(f"{value:.6g}", []).append(rank)
    if len(groups) == 1:
        return f"every rank returned {next(iter(groups))}"
    return ", ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} returned {v}"
        for v, r in groups.items()
    )
