"""Exercise 3.2 (second part), the alpha-beta model: each algorithm's counts (messages, bytes sent, bytes
reduced) against the table of guidelines.md, and the least-squares fit of alpha and beta, which
must recover the model's values from times the model made, stay close under noise, keep both
non-negative, and refuse what cannot be fitted. No processes: these are pure functions.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from grading import exercise
from phase3_helpers import close, fail, module

S = 2.0**20


def ab() -> Any:
    return module("alpha_beta")


def expected_ring(n: int) -> tuple[float, float, float]:
    return 2 * (n - 1), 2 * (n - 1) / n * S, (n - 1) / n * S


def expected_halving_doubling(n: int) -> tuple[float, float, float]:
    p = 1 << (n.bit_length() - 1)
    rounds, sent, reduced = 2 * math.log2(p), 2 * (p - 1) / p * S, (p - 1) / p * S
    if n != p:
        rounds, sent, reduced = rounds + 2, sent + 2 * S, reduced + S
    return rounds, sent, reduced


@exercise("3.2")
@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
def test_cost_counts_follow_the_table(algorithm: str) -> None:
    cost_fn = getattr(ab(), f"{algorithm}_cost")
    formula = expected_ring if algorithm == "ring" else expected_halving_doubling
    for n in range(1, 9):
        cost = cost_fn(S, n)
        got = (cost.rounds, cost.bytes_sent, cost.bytes_reduced)
        want = formula(n)
        if not all(close(a, b) for a, b in zip(got, want, strict=True)):
            names = ("messages", "bytes sent", "bytes reduced")
            wrong = [
                f"{name} {a:g} (expected {b:g})"
                for name, a, b in zip(names, got, want, strict=True)
                if not close(a, b)
            ]
            hint = ""
            if algorithm == "halving_doubling" and n & (n - 1):
                hint = (
                    " (n is not a power of two: add the fold-in's 2 messages, 2S sent, S reduced)"
                )
            fail(f"3.2 {algorithm}_cost(S = 1 MiB, n = {n}): {', '.join(wrong)}{hint}")


def synthetic(
    alpha: float, beta: float, n: int, noise: float = 0.0
) -> tuple[list[Any], list[float]]:
    rng = random.Random(5)
    sizes = [2.0**k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
    costs = [ab().ring_cost(s, n) for s in sizes]
    times = [c.time(alpha, beta) * (1 + noise * rng.uniform(-1, 1)) for c in costs]
    return costs, times


@exercise("3.2")
def test_fit_recovers_alpha_and_beta() -> None:
    alpha, beta = 50e-6, 1 / 1e9  # 50 us per message, 1 GB/s
    for n in (2, 4):
        fit = ab().fit_alpha_beta(*synthetic(alpha, beta, n))
        if not (
            math.isclose(fit.alpha, alpha, rel_tol=1e-6)
            and math.isclose(fit.beta, beta, rel_tol=1e-6)
        ):
            fail(
                f"3.2 fit_alpha_beta on exact ring times (n = {n}, alpha = 50 us, beta = 1 ns/byte) "
                f"returned alpha = {fit.alpha:.4g} s, beta = {fit.beta:.4g} s/byte: on times the "
                "model made, the least-squares solution is the model itself, so the system "
                "solved is not the model's: after dividing equation i by t_i its coefficients "
                "are m_i/t_i and v_i/t_i and its right-hand side is 1 (m_i = cost.rounds, v_i = "
                "cost.bytes_sent)"
            )
        noisy = ab().fit_alpha_beta(*synthetic(alpha, beta, n, noise=0.05))
        if not (abs(noisy.alpha / alpha - 1) < 0.3 and abs(noisy.beta / beta - 1) < 0.1):
            fail(
                f"3.2 fit_alpha_beta with ±5% noise (n = {n}): alpha = {noisy.alpha:.3g} s (true "
                f"5e-05), beta = {noisy.beta:.3g} s/byte (true 1e-09): weigh each equation by 1/t, "
                "or the large sizes drown alpha"
            )


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
