"""Exercise 3.2 (second part), the alpha-beta model: each algorithm's counts (messages, bytes sent, bytes
reduced) against the table of guidelines.md, and the least-squares fit of alpha and beta, which
must recover the model's values from times the model made, stay close under noise, keep both
non-negative, and refuse what cannot be fitted. No processes: these are pure functions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest
from grading import exercise
from phase3_helpers import close, fail, module

S = 2.0**20


def ab() -> Any:
    return module("alpha_beta")


Counts = tuple[float, float, float]  # (messages, bytes sent, bytes reduced)
COUNT_NAMES = ("messages", "bytes sent", "bytes reduced")
COST_WORLDS = tuple(range(1, 9))  # powers of two and not, 1 included: the graded cases


def expected_ring(n: int) -> Counts:
    return 2 * (n - 1), 2 * (n - 1) / n * S, (n - 1) / n * S


def expected_halving_doubling(n: int) -> Counts:
    p = 1 << (n.bit_length() - 1)
    rounds, sent, reduced = 2 * math.log2(p), 2 * (p - 1) / p * S, (p - 1) / p * S
    if n != p:
        rounds, sent, reduced = rounds + 2, sent + 2 * S, reduced + S
    return rounds, sent, reduced


EXPECTED_COUNTS = {"ring": expected_ring, "halving_doubling": expected_halving_doubling}


def _core(p: float) -> Counts:
    return 2 * math.log2(p), 2 * (p - 1) / p * S, (p - 1) / p * S


def _plus(a: Counts, b: Counts) -> Counts:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


# The realistic mistakes each count function can make, as the counts they give on n ranks, with
# the words a message uses when exactly one of them fits every graded n (tests/phase3/
# mistakes_ex3_2.py plants each and its neighbours).
COST_MISTAKES: dict[str, dict[str, tuple[str, Callable[[int], Counts]]]] = {
    "ring": {
        "n steps": (
            "n steps per half where the ring takes n-1 (2n messages, 2S sent, S reduced)",
            lambda n: (2 * n, 2 * S, S),
        ),
        "one half": (
            "only one half counted (n-1 messages, (n-1)/n·S sent): the reduce-scatter and the "
            "all-gather both send",
            lambda n: (n - 1, (n - 1) / n * S, (n - 1) / n * S),
        ),
        "whole tensor per step": (
            "every step sends the whole tensor (2(n-1)·S), where it sends one chunk of S/n",
            lambda n: (2 * (n - 1), 2 * (n - 1) * S, (n - 1) * S),
        ),
        "reduced as sent": (
            "bytes reduced counted like bytes sent: only the reduce-scatter reduces, (n-1)/n·S",
            lambda n: (2 * (n - 1), 2 * (n - 1) / n * S, 2 * (n - 1) / n * S),
        ),
    },
    "halving_doubling": {
        "no fold-in": (
            "the fold-in is missing: n is not a power of two, so add its 2 messages, 2S sent "
            "and S reduced to the core of p = 2^floor(log2 n) ranks",
            lambda n: _core(1 << (n.bit_length() - 1)),
        ),
        "log2 of n": (
            "the core is counted on all n ranks (log2(n), (n-1)/n), where it runs on the p = "
            "2^floor(log2 n) ranks left after the fold-in",
            lambda n: (
                _core(n) if n == 1 << (n.bit_length() - 1) else _plus(_core(n), (2, 2 * S, S))
            ),
        ),
        "fold-in one way": (
            "the fold-in counted one way only (1 message, S sent): the folded rank sends its "
            "tensor in and gets the result back, 2 messages and 2S",
            lambda n: (
                _core(n)
                if n == 1 << (n.bit_length() - 1)
                else _plus(_core(1 << (n.bit_length() - 1)), (1, S, S))
            ),
        ),
        "p rounded up": (
            "p rounded up to the next power of two: the core runs on 2^floor(log2 n) ranks, "
            "the others fold in",
            lambda n: (
                _core(n)
                if n == 1 << (n.bit_length() - 1)
                else _plus(_core(1 << n.bit_length()), (2, 2 * S, S))
            ),
        ),
    },
}


def _same_counts(a: Counts, b: Counts) -> bool:
    return all(close(x, y) for x, y in zip(a, b, strict=True))


def _count(index: int, value: float) -> str:
    """Messages as a number, bytes as a multiple of S (1 MiB)."""
    return f"{value:g}" if index == 0 else f"{value / S:.4g}·S"


def cost_verdict(algorithm: str, got: dict[int, Counts]) -> str | None:
    """The failure of ``{algorithm}_cost`` given its counts on every graded n (None: all right).

    It names a mistake only when exactly one of COST_MISTAKES gives the same counts on every n;
    otherwise it says what differs: which counts, at which n, by what ratio."""
    formula = EXPECTED_COUNTS[algorithm]
    wrong = [n for n in sorted(got) if not _same_counts(got[n], formula(n))]
    if not wrong:
        return None
    n = wrong[0]
    want = formula(n)
    details = [
        f"{name} {_count(i, a)} (expected {_count(i, b)}{f', x{a / b:.4g}' if b else ''})"
        for i, (name, a, b) in enumerate(zip(COUNT_NAMES, got[n], want, strict=True))
        if not close(a, b)
    ]
    fits = [
        key
        for key, (_, mistake) in COST_MISTAKES[algorithm].items()
        if all(_same_counts(got[m], mistake(m)) for m in got)
    ]
    where = f"wrong at n = {wrong}" + (
        f", right at n = {[m for m in sorted(got) if m not in wrong]}"
        if len(wrong) < len(got)
        else ""
    )
    if len(fits) == 1:
        cause = f" Every n fits one mistake: {COST_MISTAKES[algorithm][fits[0]][0]}."
    elif fits:
        cause = f" The counts fit more than one mistake: {', or '.join(fits)}."
    else:
        cause = f" ({where}: compare each count with the table of guidelines.md, n by n)"
    return f"3.2 {algorithm}_cost(S = 1 MiB, n = {n}): {', '.join(details)}.{cause}"


def cost_counts(cost_fn: Callable[[float, int], Any]) -> dict[int, Counts]:
    """What the grader measures: (messages, bytes sent, bytes reduced) for every graded n."""
    counts = {}
    for n in COST_WORLDS:
        cost = cost_fn(S, n)
        counts[n] = (cost.rounds, cost.bytes_sent, cost.bytes_reduced)
    return counts


@exercise("3.2")
@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
def test_cost_counts_follow_the_table(algorithm: str) -> None:
    problem = cost_verdict(algorithm, cost_counts(getattr(ab(), f"{algorithm}_cost")))
    if problem:
        fail(problem)


def synthetic(
    alpha: float, beta: float, n: int, noise: float = 0.0, ring_cost: Any = None
) -> tuple[list[Any], list[float]]:
    rng = random.Random(5)
    sizes = [2.0**k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
    costs = [(ring_cost or ab().ring_cost)(s, n) for s in sizes]
    times = [c.time(alpha, beta) * (1 + noise * rng.uniform(-1, 1)) for c in costs]
    return costs, times


TRUE_ALPHA, TRUE_BETA = 50e-6, 1 / 1e9  # 50 us per message, 1 GB/s
FIT_WORLDS = (2, 4)
NOISE = 0.05
Fit = tuple[float, float]  # (alpha, beta)
FitData = tuple[list[Any], list[float]]  # (costs, seconds)


def weighted_fit(data: FitData, power: int = 1, volume: str = "bytes_sent") -> Fit:
    """Least squares of ``(alpha·m + beta·v - t) / t**power``, alpha then beta clamped at 0 as
    the contract asks: power 1 is the fit relative to each time, 0 the plain one."""
    costs, seconds = data
    rows = [
        (c.rounds / t**power, getattr(c, volume) / t**power, t ** (1 - power))
        for c, t in zip(costs, seconds, strict=True)
    ]
    saa = sum(a * a for a, _, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    say = sum(a * y for a, _, y in rows)
    sby = sum(b * y for _, b, y in rows)
    det = saa * sbb - sab * sab
    alpha, beta = (say * sbb - sby * sab) / det, (saa * sby - sab * say) / det
    if alpha < 0:
        return 0.0, sby / sbb
    if beta < 0:
        return say / saa, 0.0
    return alpha, beta


# The realistic mistakes of fit_alpha_beta that the fit test catches, as what each returns from
# the same data (exact times, then noisy ones), with the words a failure uses when exactly one
# gives the learner's fits on every n (tests/phase3/mistakes_ex3_2.py plants each).
FIT_MISTAKES: dict[str, tuple[str, Any]] = {
    "bytes reduced fitted": (
        "alpha is right and beta exactly twice the true one: the bytes fitted are "
        "cost.bytes_reduced, where the model's beta multiplies cost.bytes_sent",
        lambda data: weighted_fit(data, 1, "bytes_reduced"),
    ),
    "alpha and beta swapped": (
        "these are the true values swapped: AlphaBeta takes alpha (seconds per message) first, "
        "then beta (seconds per byte)",
        lambda data: weighted_fit(data)[::-1],
    ),
    "unweighted": (
        "these are exactly the plain least-squares fit, without weights: weigh each equation "
        "by 1/t, or the large sizes drown alpha",
        lambda data: weighted_fit(data, 0),
    ),
}


def _same_fit(a: Fit, b: Fit) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-300) for x, y in zip(a, b, strict=True))


def fit_verdict(
    fits: dict[int, tuple[Fit, Fit]], data: dict[int, tuple[FitData, FitData]]
) -> str | None:
    """The failure of the fit test (None: it passes), given per n the learner's fit of exact
    and of noisy times and the data they came from. A mistake is named only when exactly one
    of FIT_MISTAKES returns the learner's fits on every n and both kinds of times."""
    named = [
        key
        for key, (_, mistake) in FIT_MISTAKES.items()
        if all(
            _same_fit(fits[n][0], mistake(data[n][0]))
            and _same_fit(fits[n][1], mistake(data[n][1]))
            for n in fits
        )
    ]
    if len(named) == 1:
        cause = f": {FIT_MISTAKES[named[0]][0]}"
    elif named:
        cause = f": the fits fit more than one mistake: {', or '.join(named)}"
    else:
        cause = ""
    for n, ((alpha, beta), _) in fits.items():
        if not (
            math.isclose(alpha, TRUE_ALPHA, rel_tol=1e-6)
            and math.isclose(beta, TRUE_BETA, rel_tol=1e-6)
        ):
            return (
                f"3.2 fit_alpha_beta on exact ring times (n = {n}, alpha = 50 us, beta = 1 "
                f"ns/byte) returned alpha = {alpha:.4g} s, beta = {beta:.4g} s/byte (x"
                f"{alpha / TRUE_ALPHA:.4g} and x{beta / TRUE_BETA:.4g} the true values)"
                + (
                    cause
                    or ": on times the model made, the least-squares solution is the model "
                    "itself, so the system solved is not the model's: after dividing equation i "
                    "by t_i its coefficients are m_i/t_i and v_i/t_i and its right-hand side is "
                    "1 (m_i = cost.rounds, v_i = cost.bytes_sent)"
                )
            )
    for n, (_, (alpha, beta)) in fits.items():
        if not (abs(alpha / TRUE_ALPHA - 1) < 0.3 and abs(beta / TRUE_BETA - 1) < 0.1):
            return (
                f"3.2 fit_alpha_beta with ±5% noise (n = {n}): alpha = {alpha:.3g} s (true "
                f"5e-05), beta = {beta:.3g} s/byte (true 1e-09)"
                + (
                    cause
                    or f" (x{alpha / TRUE_ALPHA:.3g} and x{beta / TRUE_BETA:.3g} the true values): "
                    "a fit relative to each time stays within 30% of alpha and 10% of beta here"
                )
            )
    return None


def fit_data(ring_cost: Any = None) -> dict[int, tuple[FitData, FitData]]:
    """The graded cases: per n, exact ring times and the same with ±5% noise."""
    return {
        n: (
            synthetic(TRUE_ALPHA, TRUE_BETA, n, ring_cost=ring_cost),
            synthetic(TRUE_ALPHA, TRUE_BETA, n, noise=NOISE, ring_cost=ring_cost),
        )
        for n in FIT_WORLDS
    }


@exercise("3.2")
def test_fit_recovers_alpha_and_beta() -> None:
    data = fit_data()
    fits = {}
    for n, (exact, noisy) in data.items():
        first, second = ab().fit_alpha_beta(*exact), ab().fit_alpha_beta(*noisy)
        fits[n] = ((first.alpha, first.beta), (second.alpha, second.beta))
    problem = fit_verdict(fits, data)
    if problem:
        fail(problem)


@exercise("3.2")
def test_fit_keeps_alpha_and_beta_non_negative() -> None:
    costs = [ab().ring_cost(s, 2) for s in (1e3, 1e6, 1e7)]
    # times that fall faster than a line through the origin would need a negative alpha
    fit = ab().fit_alpha_beta(costs, [1e-7, 1.2e-3, 1.3e-2])
    if fit.alpha < 0 or fit.beta < 0:
        fail(
            f"3.2 fit_alpha_beta returned alpha = {fit.alpha:.3g}, beta = {fit.beta:.3g}: a "
            "negative latency or bandwidth has no meaning; set it to 0 and refit the other"
        )


@exercise("3.2")
def test_fit_refuses_what_cannot_be_fitted() -> None:
    ring = ab().ring_cost
    cases = [
        ("one measurement", [ring(1e6, 2)], [1e-3]),
        ("two costs and one time", [ring(1e6, 2), ring(2e6, 2)], [1e-3]),
        ("a time of zero", [ring(1e6, 2), ring(2e6, 2)], [1e-3, 0.0]),
        ("the same size twice", [ring(1e6, 2), ring(1e6, 2)], [1e-3, 1.1e-3]),
    ]
    for what, costs, times in cases:
        try:
            fit = ab().fit_alpha_beta(costs, times)
        except ValueError:
            continue
        except ArithmeticError as err:
            fail(
                f"3.2 fit_alpha_beta given {what} raised {type(err).__name__}: {err}. Such "
                "measurements cannot tell alpha from beta (every row of the 2x2 system is a "
                "multiple of the others, so its determinant is 0, or nearly): check for it and "
                "raise a ValueError saying why"
            )
        singular = (
            " (the same size twice: the two rows of the 2x2 system are proportional, its "
            "determinant is 0 up to rounding, and any alpha, beta on one line fit equally)"
            if what == "the same size twice"
            else ""
        )
        fail(
            f"3.2 fit_alpha_beta given {what} returned {fit} instead of raising a ValueError "
            f"saying why{singular}"
        )


@exercise("3.2")
def test_a_clamped_fit_refits_the_other_unknown() -> None:
    costs = [ab().ring_cost(s, 2) for s in (1e3, 1e6, 1e7)]
    seconds = [1e-7, 1.2e-3, 1.3e-2]  # the unconstrained relative least squares: alpha < 0
    fit = ab().fit_alpha_beta(costs, seconds)
    rows = [cost.bytes_sent / t for cost, t in zip(costs, seconds, strict=True)]
    best = sum(rows) / sum(c * c for c in rows)  # min over beta of sum (beta·v_i/t_i - 1)^2
    if fit.alpha == 0.0 and math.isclose(fit.beta, best, rel_tol=1e-9):
        return
    if fit.alpha == 0.0:
        fail(
            f"3.2 fit_alpha_beta on times whose unconstrained fit has a negative alpha: alpha "
            f"= 0 as it should, but beta = {fit.beta:.6g}, not {best:.6g}, the beta that fits "
            "best once alpha is fixed at 0 (the same relative least squares with one unknown). "
            "A beta solved together with a negative alpha no longer fits the data once alpha "
            "is set to 0: refit it alone"
        )
    fail(
        f"3.2 fit_alpha_beta returned alpha = {fit.alpha:.6g}, beta = {fit.beta:.6g} on times "
        "whose least squares relative to each time wants a negative alpha: the contract "
        f"returns alpha = 0 and the best beta alone, {best:.6g}"
    )


@exercise("3.2")
def test_crossover_of_two_fitted_models() -> None:
    mod = ab()
    # halving-doubling: fewer messages, same bytes at n = 4; a model with a slower link for it
    ring = lambda s: mod.ring_cost(s, 4).time(50e-6, 1e-9)  # noqa: E731
    tree = lambda s: mod.halving_doubling_cost(s, 4).time(50e-6, 1.5e-9)  # noqa: E731
    at = mod.crossover_bytes(ring, tree)
    if at is None or not math.isclose(ring(at), tree(at), rel_tol=1e-9):
        fail(f"3.2 crossover_bytes returned {at}: the two times must be equal there")
