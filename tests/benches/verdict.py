"""The last line of every ``tests.bench`` run: the goal, what was measured, met or not, by how much."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from course.impl import IMPLS


@dataclass(frozen=True)
class Goal:
    """A goal a guide states: ``what`` compared with ``target`` (at least, or at most)."""

    what: str  # e.g. "ring busbw / dist.all_reduce busbw at 16 and 64 MiB"
    target: float
    at_least: bool = True  # True: measured >= target meets it; False: measured <= target
    unit: str = "x"

    def met(self, measured: float) -> bool:
        return measured >= self.target if self.at_least else measured <= self.target

    def verdict(self, measured: float) -> str:
        """``goal met: ... 1.02x (goal >= 0.95x), by 0.07x`` or ``goal not met: ... short by``."""
        sign = ">=" if self.at_least else "<="
        margin = abs(measured - self.target)
        shown = f"{measured:.3g}{self.unit} (goal {sign} {self.target:.3g}{self.unit})"
        if self.met(measured):
            return f"goal met: {self.what} = {shown}, by {margin:.3g}{self.unit}"
        return f"goal not met: {self.what} = {shown}, short by {margin:.3g}{self.unit}"


def parser(description: str) -> argparse.ArgumentParser:
    """The flags every bench takes: whose code (default: yours) and a quicker, noisier run."""
    p = argparse.ArgumentParser(prog="python -m tests.bench", description=description)
    p.add_argument("--impl", choices=IMPLS, default="templates", help="whose code (default: yours)")
    p.add_argument("--quick", action="store_true", help="fewer repeats: faster, noisier")
    return p
