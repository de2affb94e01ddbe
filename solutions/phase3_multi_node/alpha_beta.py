"""Exercise 3.2 (second part): what each all-reduce costs in the alpha-beta(-gamma) model, and
alpha and beta fitted from measured times.

The model (Hockney 1994; Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 19(1), 2005, section 2): one message of b bytes costs
``alpha + beta·b``; reducing b bytes costs ``gamma·b``. A collective's time is then

    t = alpha·(messages on the critical path) + beta·(bytes through the busiest link)
        + gamma·(bytes reduced by the busiest rank)

and its :class:`Cost` holds those three counts. For an all-reduce of S bytes over n ranks
(Patarasuk & Yuan, JPDC 69(2), 2009, for the ring's optimality):

| algorithm | messages | bytes sent | bytes reduced |
| --- | --- | --- | --- |
| ring | 2(n-1) | 2(n-1)/n·S | (n-1)/n·S |
| halving-doubling, n = p = 2^k | 2·log2(p) | 2(p-1)/p·S | (p-1)/p·S |
| halving-doubling, n = p + e | 2·log2(p) + 2 | 2(p-1)/p·S + 2S | (p-1)/p·S + S |
| hierarchical, N nodes of k | ring(k) inside + ring(N) on S/k across + ring(k) inside | | |

Fitting: for one algorithm and one world the counts are ``rounds`` (a constant) and
``v·S`` (linear in S), so the measured times lie on ``t = alpha·rounds + beta·v·S``, a line in S.
:func:`fit_alpha_beta` finds alpha and beta by least squares *relative* to each time (small
messages take microseconds, large ones tenths of a second: plain least squares would ignore the
small ones, and alpha with them). gamma is not separable from beta this way (both multiply S):
the fitted beta absorbs it, which is what "effective bandwidth" means on a real machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """Counts of one collective call: messages on the critical path, bytes sent over the busiest
    link, bytes reduced by the busiest rank."""

    rounds: float
    bytes_sent: float
    bytes_reduced: float = 0.0

    def time(self, alpha: float, beta: float, gamma: float = 0.0) -> float:
        """Seconds in the model: ``alpha·rounds + beta·bytes_sent + gamma·bytes_reduced``."""
        return alpha * self.rounds + beta * self.bytes_sent + gamma * self.bytes_reduced

    def __add__(self, other: Cost) -> Cost:
        """Two phases run one after the other."""
        return Cost(
            self.rounds + other.rounds,
            self.bytes_sent + other.bytes_sent,
            self.bytes_reduced + other.bytes_reduced,
        )


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted link: alpha seconds per message, beta seconds per byte (1/beta: bytes/s)."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second, 1/beta (inf when beta is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta


def _check(nbytes: float, n: int) -> None:
    if n < 1:
        raise ValueError(f"n={n}: a collective needs at least one rank")
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")


def ring_cost(nbytes: float, n: int) -> Cost:
    """The ring all-reduce of ``nbytes`` over ``n`` ranks: reduce-scatter + all-gather."""
    _check(nbytes, n)
    # TODO 3.2: the ring's counts: messages, bytes sent and bytes reduced per rank.
    # Invariant: the ring's row of the cost table, for any n >= 1 (a world of one costs
    #   nothing).
    # Hint 1: guidelines.md#the-cost-table has the formulas; Cost(rounds, bytes_sent,
    #   bytes_reduced).
    # Hint 2: How many steps does each half of the ring take, and how big is each step's
    #   message for a tensor of S bytes? Which of the two halves adds numbers, and which only
    #   copies them? What do the counts become at n = 1?
    # Hint 3: each half takes n - 1 steps of one chunk, S/n bytes: the rounds are twice n - 1.
    # Hint 4: only the reduce-scatter reduces: bytes reduced are (n - 1)/n of S, bytes sent
    #   twice that. At n = 1 every term is zero by itself: no special case is needed.
    # Hint 5: one Cost of 2(n - 1) rounds, 2(n - 1)/n of S sent and (n - 1)/n of S reduced.
    # See guidelines.md#the-alpha-beta-model
    # >>> solution
    return Cost(2 * (n - 1), 2 * (n - 1) / n * nbytes, (n - 1) / n * nbytes)
    # <<< solution


def halving_doubling_cost(nbytes: float, n: int) -> Cost:
    """Rabenseifner's halving-doubling over ``n`` ranks, with the fold-in when n is not 2^k."""
    _check(nbytes, n)
    # TODO 3.2: halving-doubling's counts, fold-in included.
    # Invariant: the halving-doubling rows of the cost table, for any n >= 1 (the fold-in's
    #   messages, bytes and reduction added when n is not a power of two).
    # Hint 1: p is the largest power of two <= n (int.bit_length tells how many bits n has);
    #   math.log2 is exact on a power of two. Cost objects add up (Cost.__add__).
    # Hint 2: Which p ranks run the halving and doubling, and how many steps does each phase
    #   take among them? How much does each step send as the pieces halve? What do the ranks
    #   beyond p do before and after, and what does that add to rounds, bytes sent and bytes
    #   reduced?
    # Hint 3: on 6 ranks p is 4: the core takes log2 of 4 = 2 steps each way, 4 rounds, not
    #   log2 of 6.
    # Hint 4: the core's bytes are the ring's fractions at p ranks: 2(p - 1)/p of S sent and
    #   (p - 1)/p of S reduced; the fold adds 2 rounds, 2·S sent and S reduced.
    # Hint 5: p is 1 shifted left by the bit length of n minus 1; return the core's Cost of
    #   twice log2 of p rounds and the fractions above, plus the fold's Cost when n differs from p.
    # See guidelines.md#the-alpha-beta-model
    # >>> solution
    p = 1 << (n.bit_length() - 1)
    core = Cost(2 * math.log2(p), 2 * (p - 1) / p * nbytes, (p - 1) / p * nbytes)
    if n == p:
        return core
    return core + Cost(2, 2 * nbytes, nbytes)
    # <<< solution


def hierarchical_cost(nbytes: float, nodes: int, per_node: int) -> tuple[Cost, Cost]:
    """(inside nodes, across nodes) counts of the hierarchical all-reduce: a reduce-scatter and
    an all-gather over k = ``per_node`` ranks (together a ring all-reduce's counts), and a ring
    all-reduce of S/k over ``nodes`` ranks. Cost the two parts with their own alpha and beta."""
    _check(nbytes, nodes)
    _check(nbytes, per_node)
    return ring_cost(nbytes, per_node), ring_cost(nbytes / per_node, nodes)


def cross_node_bytes(nbytes: float, nodes: int, per_node: int) -> tuple[float, float]:
    """Bytes that cross node boundaries, summed over all ranks: (hierarchical, flat ring).

    Hierarchical: every rank sends 2(N-1)/N·S/k across. Flat ring over n = N·k ranks in rank
    order: the N ranks at the end of a node each send 2(n-1)/n·S to the next node.
    """
    _check(nbytes, nodes)
    _check(nbytes, per_node)
    n = nodes * per_node
    hierarchical = n * 2 * (nodes - 1) / nodes * nbytes / per_node
    flat = (nodes if nodes > 1 else 0) * 2 * (n - 1) / n * nbytes
    return hierarchical, flat


def fit_alpha_beta(costs: Sequence[Cost], seconds: Sequence[float]) -> AlphaBeta:
    """alpha and beta that best explain ``seconds[i] ≈ alpha·costs[i].rounds +
    beta·costs[i].bytes_sent``, in least squares relative to each time, both kept >= 0."""
    if len(costs) != len(seconds):
        raise ValueError(f"{len(costs)} costs but {len(seconds)} times: give one time per cost")
    if len(costs) < 2:
        raise ValueError(
            f"{len(costs)} measurement(s): fitting two unknowns needs at least 2 sizes"
        )
    if any(not (t > 0 and math.isfinite(t)) for t in seconds):
        raise ValueError(f"times must be positive and finite, got {list(seconds)}")
    # TODO 3.2: the alpha and beta that fit the times best, relative to each time, both >= 0
    # Invariant: on times made exactly from the model, the fit returns the model's alpha and
    #   beta; a fit whose unconstrained alpha (beta) is negative returns 0 for it and the best
    #   fit of the other alone; measurements that cannot tell alpha from beta are refused.
    # Hint 1: the relative error of measurement i is the model's time minus t_i, divided by
    #   t_i: a linear expression in alpha and beta.
    # Hint 2: Written as a linear system in alpha and beta, what are row i's two coefficients
    #   and its right-hand side? How many sums over the rows do the 2x2 normal equations need?
    #   When the solution has a negative alpha, which one-unknown problem gives beta? What
    #   does the 2x2 system look like when every measurement has the same size?
    # Hint 3: divided by t_i, row i reads alpha times (m_i over t_i) plus beta times (v_i over
    #   t_i) equals 1: coefficients a_i and c_i, right-hand side 1. Every row weighs the same.
    # Hint 4: the normal equations are alpha·Σa² + beta·Σac = Σa and alpha·Σac + beta·Σc² =
    #   Σc; their determinant Σa²·Σc² - (Σac)² is 0 (up to rounding) when the rows are
    #   proportional, as with one size repeated: refuse it with a ValueError.
    # Hint 5: solve the two equations by Cramer's rule; if alpha is negative, alpha is 0 and
    #   beta is Σc divided by Σc²; if beta is negative, beta is 0 and alpha is Σa divided by
    #   Σa². Return an AlphaBeta of the two.
    # See guidelines.md#the-alpha-beta-model
    # >>> solution
    rows = [(c.rounds / t, c.bytes_sent / t) for c, t in zip(costs, seconds, strict=True)]
    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    sa = sum(a for a, _ in rows)
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    if det <= 1e-12 * max(saa * sbb, 1e-300):
        raise ValueError(
            "the measurements cannot separate alpha from beta: use sizes that differ (both small "
            "and large messages)"
        )
    alpha = (sa * sbb - sb * sab) / det
    beta = (saa * sb - sab * sa) / det
    if alpha < 0:
        alpha, beta = 0.0, sb / sbb
    elif beta < 0:
        alpha, beta = sa / saa, 0.0
    return AlphaBeta(alpha, beta)
    # <<< solution


def crossover_bytes(
    time_a: Callable[[float], float], time_b: Callable[[float], float]
) -> float | None:
    """The message size where two models that are linear in S take the same time, or None.

    ``time_a(S)`` and ``time_b(S)`` are seconds for S bytes (e.g. ``lambda s:
    ring_cost(s, 4).time(fit.alpha, fit.beta)``). Below the crossover the one with the smaller
    latency term wins, above it the one with the smaller per-byte term.
    """
    scale = 2.0**20
    intercept = time_a(0.0) - time_b(0.0)
    slope = (time_a(scale) - time_b(scale)) / scale - intercept / scale
    if slope == 0 or -intercept / slope <= 0:
        return None
    return -intercept / slope
