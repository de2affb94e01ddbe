"""What the language model's run shows while it runs: the steps on rank 0's stderr.

A bar on a terminal; a line every :data:`PROGRESS_SECONDS` elsewhere (a CI log, torchrun's
``--redirects``), so that slow never looks hung and a log stays short.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

PROGRESS_SECONDS = 10.0  # when stderr is not a terminal: a progress line at most this often


class StepProgress:
    """Rank 0's view of the steps while they run, on stderr.

    On a terminal, a tqdm bar over the run's steps with the last step's loss and the tokens per
    second of the steps so far (training steps only: evaluation and checkpoints excluded).
    Elsewhere (a CI log, a file, torchrun's ``--redirects``) a bar would write a line of
    carriage returns per step, so instead one plain line after the first step and then at most
    every :data:`PROGRESS_SECONDS`, and after the last: slow never looks hung, and a log stays
    short. Disabled, it shows nothing.
    """

    def __init__(
        self,
        total: int,
        done: int,
        tokens_per_step: int,
        enabled: bool = True,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.done, self.tokens_per_step = total, done, tokens_per_step
        self.stream = sys.stderr if stream is None else stream
        self.clock = clock
        self.enabled = enabled
        self.steps = 0  # steps timed by this run (a resumed run starts at ``done``)
        self.step_seconds = 0.0
        self.last_line: float | None = None
        self.bar: Any = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc="training", unit="step",
                            file=self.stream, dynamic_ncols=True, leave=False)  # fmt: skip

    def tokens_per_second(self) -> float:
        return self.steps * self.tokens_per_step / self.step_seconds if self.step_seconds else 0.0

    def step(self, loss: float, seconds: float) -> None:
        """One more step done, whose loss was ``loss`` and which took ``seconds``."""
        self.done += 1
        self.steps += 1
        self.step_seconds += seconds
        if not self.enabled:
            return
        rate = f"{self.tokens_per_second():,.0f}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {rate} tokens/s", refresh=False)
            self.bar.update(1)
            return
        now = self.clock()
        due = self.last_line is None or now - self.last_line >= PROGRESS_SECONDS
        if due or self.done == self.total:
            self.last_line = now
            print(f"step {self.done}/{self.total}: loss {loss:.4f}, {rate} tokens/s",
                  file=self.stream, flush=True)  # fmt: skip

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Print other lines (the epoch's table row) without the bar drawn through them."""
        if self.bar is not None:
            self.bar.clear()
        try:
            yield
        finally:
            if self.bar is not None:
                self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
