"""What the 2.7 grader (grade_2_7_context_parallel.py) computes on its own, independently of the
code under test: the layouts, the one-process reference, each rank's share of dK/dV, the blocks a
rank must compute at each step, and the order of passes and blocks a ring should follow.

Everything here is written from the definitions (positions, the causal mask, softmax), not from
the solution, so a mistake shared by the solution and the grader cannot hide.
"""

from __future__ import annotations

import itertools
import math
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from course.world import Frame, RankFailed

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64


# ---------------------------------------------------------------------------- layouts


def expected_chunks(rank: int, cp: int, zigzag: bool) -> tuple[int, ...]:
    """Chunks of rank ``rank``: (rank,) contiguous; zig-zag: one from the front, one from the back,
    as torch's head-tail load balancer lays them out."""
    return (rank, 2 * cp - 1 - rank) if zigzag else (rank,)


def positions(rank: int, cp: int, zigzag: bool, seq_len: int) -> list[int]:
    """The sequence positions rank ``rank`` holds, in its local order."""
    count = 2 * cp if zigzag else cp
    width = seq_len // count
    return [p for c in expected_chunks(rank, cp, zigzag) for p in range(c * width, (c + 1) * width)]


def shard(x: torch.Tensor, rank: int, cp: int, zigzag: bool, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s local piece of ``x`` along ``dim`` (the grader's own slicing)."""
    index = torch.tensor(positions(rank, cp, zigzag, x.shape[dim]), device=x.device)
    return x.index_select(dim, index)


def block_needed(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """ "full", "diagonal" or "skip", from the causal mask on equal, aligned chunks."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else "skip"


def step_blocks(rank: int, cp: int, zigzag: bool, causal: bool) -> list[tuple[int, int]]:
    """(full, diagonal) blocks rank ``rank`` computes at each ring step (the block of the rank s
    places behind it visits at step s)."""
    counts = []
    for step in range(cp):
        source = (rank - step) % cp
        kinds = [
            block_needed(a, b, causal)
            for a in expected_chunks(rank, cp, zigzag)
            for b in expected_chunks(source, cp, zigzag)
        ]
        counts.append((kinds.count("full"), kinds.count("diagonal")))
    return counts


def order_problem(events: str, cp: int) -> str | None:
    """Why a forward's events (P: pass posted, W: pass waited for, C: block computed) are not a
    ring that hides its transfers (None when they are): cp - 1 passes, each posted before this
    rank computes on the block it sends, and waited for only after those computations. So,
    leaving the computations out, the events read P W P W ...; no block is computed before the
    first post, nor between a wait and the next post (the block just received must be passed on
    before it is used). How many blocks each step computes is another test's business."""
    if cp < 2:
        return None
    passes = events.replace("C", "")
    if passes != "PW" * (cp - 1):
        return (
            f"it posted {passes.count('P')} ring passes and waited for {passes.count('W')} "
            f"({describe_order(passes)}); a ring of {cp} needs {cp - 1} of each, every wait "
            "after its post (start_ring_pass, then .wait()), none after the last step"
        )
    first_post = events.index("P")
    late = [i for i in range(len(events)) if events[i] == "C" and _between_wait_and_post(events, i)]
    if first_post > 0:
        return (
            "it computed on its own block before passing that block on: post the pass first, "
            "then compute, so the transfer runs while this rank computes"
        )
    if events[first_post + 1] == "W":  # a rank's own block always has work (its diagonal)
        return (
            "it waited for the next block right after posting the pass, before computing on "
            "the block it already held: compute between posting the pass and waiting for it, "
            "or the transfer cannot hide behind the computation"
        )
    if late:
        return (
            "after receiving a block it computed on it before passing it on: post the pass of "
            "the block first, then compute on it"
        )
    return None


def _between_wait_and_post(events: str, index: int) -> bool:
    """True when the event at ``index`` comes after a wait and before the next post."""
    before = events[:index].replace("C", "")
    after = events[index + 1 :].replace("C", "")
    return before.endswith("W") and after.startswith("P")


def describe_order(events: str) -> str:
    """ "post, 2 computes, wait, ..." from an event string."""
    names = {"P": "post", "W": "wait", "C": "compute"}
    words, i = [], 0
    while i < len(events):
        j = i
        while j < len(events) and events[j] == events[i]:
            j += 1
        run = j - i
        name = names.get(events[i], events[i])
        words.append(name if run == 1 else f"{run} {name}s")
        i = j
    return ", ".join(words) or "nothing"


# ---------------------------------------------------------------------------- the reference


@dataclass
class Reference:
    """The one-process attention of the whole sequence and its gradients (float64)."""

    out: torch.Tensor
    lse: torch.Tensor  # log-sum-exp of every query's scores, [B, H, S]
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    probs: torch.Tensor  # softmax, [B, H, S, S]
    dscores: torch.Tensor  # dL/dscores (before the scale), [B, H, S, S]


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, causal: bool
) -> Reference:
    """``scaled_dot_product_attention`` and its autograd gradients, plus the softmax pieces the
    diagnosis of dK/dV needs (computed from the definition)."""
    wq, wk, wv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(wq, wk, wv, is_causal=causal)
    out.backward(grad)
    assert wq.grad is not None and wk.grad is not None and wv.grad is not None
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        length = q.shape[2]
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1)
    dprobs = grad @ v.transpose(-2, -1)
    delta = (grad * (probs @ v)).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta)
    lse = torch.logsumexp(scores, dim=-1)
    return Reference(out.detach(), lse, wq.grad, wk.grad, wv.grad, probs, dscores)


def own_queries_share(
    ref: Reference, q: torch.Tensor, grad: torch.Tensor, rank: int, cp: int, zigzag: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The part of rank ``rank``'s dK and dV that its own queries contribute (no other rank's)."""
    mine = torch.tensor(positions(rank, cp, zigzag, q.shape[2]))
    scale = 1.0 / math.sqrt(q.shape[-1])
    dscores = ref.dscores.index_select(2, mine).index_select(3, mine)
    probs = ref.probs.index_select(2, mine).index_select(3, mine)
    dk = dscores.transpose(-2, -1) @ q.index_select(2, mine) * scale
    dv = probs.transpose(-2, -1) @ grad.index_select(2, mine)
    return dk, dv


def dq_block_shares(
    ref: Reference, k: torch.Tensor, rank: int, cp: int, zigzag: bool, causal: bool
) -> list[tuple[int, list[tuple[int, int, torch.Tensor]]]]:
    """For each query chunk of rank ``rank`` (in its local order): the chunk and the dQ share of
    every block the ring computes for it, in the order the ring meets them, as
    ``(step, key chunk, share)``; the shares sum to the chunk's rows of dQ."""
    seq = k.shape[2]
    width = seq // (2 * cp if zigzag else cp)
    scale = 1.0 / math.sqrt(k.shape[-1])
    found = []
    for q_chunk in expected_chunks(rank, cp, zigzag):
        rows = torch.arange(q_chunk * width, (q_chunk + 1) * width)
        shares = []
        for step in range(cp):
            for k_chunk in expected_chunks((rank - step) % cp, cp, zigzag):
                if block_needed(q_chunk, k_chunk, causal) == "skip":
                    continue
                cols = torch.arange(k_chunk * width, (k_chunk + 1) * width)
                dscores = ref.dscores.index_select(2, rows).index_select(3, cols)
                shares.append((step, k_chunk, dscores @ k.index_select(2, cols) * scale))
        found.append((q_chunk, shares))
    return found


def dq_share_problem(
    got: torch.Tensor, chunks: list[tuple[int, list[tuple[int, int, torch.Tensor]]]], atol: float
) -> str | None:
    """What a wrong local dQ holds, named from the blocks' shares (None: no known pattern)."""
    width = got.shape[2] // len(chunks)
    for index, (q_chunk, shares) in enumerate(chunks):
        rows = got[:, :, index * width : (index + 1) * width]
        parts = [share for _, _, share in shares]
        if close(rows, sum(parts, torch.zeros_like(parts[0])), atol):
            continue
        names = [f"step {step} (key chunk {k_chunk})" for step, k_chunk, _ in shares]
        where = f"the rows of query chunk {q_chunk}"
        if len(parts) > 1 and close(rows, parts[-1], atol):
            return (
                f"{where} hold the share of the last block computed for them alone, "
                f"{names[-1]}: each block's dQ share must be added to dQ (accumulate into it), "
                "not replace what the earlier blocks put there"
            )
        for size in range(1, len(parts)):
            for subset in itertools.combinations(range(len(parts)), size):
                if close(rows, sum((parts[i] for i in subset), torch.zeros_like(parts[0])), atol):
                    missing = [names[i] for i in range(len(parts)) if i not in subset]
                    return (
                        f"{where} hold the shares of {', '.join(names[i] for i in subset)} but "
                        f"not of {', '.join(missing)}: every block computed for a query chunk "
                        "adds its share to that chunk's dQ"
                    )
        if close(rows, 2 * sum(parts, torch.zeros_like(parts[0])), atol):
            return f"{where} are twice the right ones: each block's share is added once"
        return None
    return None


def close(got: torch.Tensor | None, want: torch.Tensor, atol: float) -> bool:
    return (
        got is not None
        and got.shape == want.shape
        and bool(torch.isfinite(got).all())
        and float((got.to(want.dtype) - want).abs().max()) <= atol
    )


def difference(got: torch.Tensor | None, want: torch.Tensor) -> str:
    if got is None:
        return "got nothing"
    if got.shape != want.shape:
        return f"got shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not bool(torch.isfinite(got).all()):
        return "got non-finite values (inf or nan)"
    return f"max difference {float((got.to(want.dtype) - want).abs().max()):.2e}"


# ---------------------------------------------------------------------------- unwritten TODOs


def _project(filename: str) -> bool:
    path = Path(filename).resolve()
    return ROOT in path.parents and ".venv" not in path.parts and "tests" not in path.parts


def todo_record(exc: NotImplementedError) -> tuple[str, list[tuple[str, int, str, str]]]:
    """An unwritten TODO caught on a rank, as (message, frames) that pickle."""
    frames = [
        (f.filename, f.lineno or 0, f.name, f.line or "")
        for f in traceback.extract_tb(exc.__traceback__)
        if _project(f.filename)
    ]
    return str(exc), frames


def raise_todo(rank: int, record: tuple[str, list[tuple[str, int, str, str]]]) -> None:
    """Re-raise a rank's unwritten TODO here, as the harness reports a rank's failure."""
    message, frames = record
    raise RankFailed(rank, "NotImplementedError", message, [Frame(*frame) for frame in frames])
