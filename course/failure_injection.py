"""Failures on purpose, chosen from the environment: ``DTFS_FAIL=kill:rank=1:step=3``.

Recovery code (restarts under ``torchrun --max-restarts``, resuming from a checkpoint, elastic
membership) is only tested if something fails at a known place. A training loop calls
:func:`maybe_fail` once per step; the environment decides whether, where and how it fails, so the
same program runs clean or broken without a code change. torch's own elastic tests do the same
with environment-driven workers (test/distributed/elastic/agent/server/test/
local_elastic_agent_test.py).

The spec is ``ACTION:rank=R:step=S`` with ACTION one of

* ``kill``: the process sends itself SIGKILL (a crash: no Python cleanup, no exit handlers);
* ``raise``: raises :class:`InjectedFailure` (a Python error torchrun reports with a traceback);
* ``hang``: sleeps forever (a stuck rank, for time bounds and watchdogs);

``rank`` is the global RANK, ``step`` the step number passed to :func:`maybe_fail`. By default it
fails only on restart attempt 0 (TORCHELASTIC_RESTART_COUNT), so the attempt after a restart can
succeed; ``DTFS_FAIL_ATTEMPT=1`` fails on attempt 1 instead, ``DTFS_FAIL_ATTEMPT=any`` on every
attempt.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

FAIL_ENV = "DTFS_FAIL"
ATTEMPT_ENV = "DTFS_FAIL_ATTEMPT"
ACTIONS = ("kill", "raise", "hang")
ACCEPTED = (
    "ACTION:rank=R:step=S with ACTION one of kill, raise, hang and R, S non-negative integers, "
    "e.g. DTFS_FAIL=kill:rank=1:step=3"
)


class InjectedFailure(RuntimeError):
    """Raised by the ``raise`` action: a failure the test asked for, not a bug."""


@dataclass(frozen=True)
class FailureSpec:
    """Where and how to fail; ``attempt`` None means on every restart attempt."""

    action: str
    rank: int
    step: int
    attempt: int | None = 0

    def applies(self, rank: int, step: int, attempt: int) -> bool:
        return (
            rank == self.rank
            and step == self.step
            and (self.attempt is None or attempt == self.attempt)
        )


def parse_failure(spec: str, attempt: str = "0") -> FailureSpec:
    """``"kill:rank=1:step=3"`` -> FailureSpec; ``attempt``: ``"0"``, ``"1"``, ... or ``"any"``."""
    parts = spec.strip().split(":")
    fields: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if not sep or key in fields:
            fields = {}
            break
        fields[key.strip()] = value.strip()
    if (
        len(parts) != 3
        or parts[0] not in ACTIONS
        or set(fields) != {"rank", "step"}
        or not all(value.isdigit() for value in fields.values())
    ):
        raise ValueError(f"{FAIL_ENV}={spec!r} is not a failure spec: expected {ACCEPTED}")
    if attempt.strip() == "any":
        when: int | None = None
    elif attempt.strip().isdigit():
        when = int(attempt)
    else:
        raise ValueError(
            f"{ATTEMPT_ENV}={attempt!r}: expected a restart attempt number (0, 1, ...) or 'any'"
        )
    return FailureSpec(parts[0], int(fields["rank"]), int(fields["step"]), when)


def failure_from_env(env: Mapping[str, str] | None = None) -> FailureSpec | None:
    """The failure DTFS_FAIL (and DTFS_FAIL_ATTEMPT) ask for; None when DTFS_FAIL is unset."""
    env = os.environ if env is None else env
    spec = env.get(FAIL_ENV, "").strip()
    if not spec:
        return None
    return parse_failure(spec, env.get(ATTEMPT_ENV, "0"))


def maybe_fail(step: int) -> None:
    """Fail here if DTFS_FAIL names this rank (RANK), this step and this restart attempt."""
    spec = failure_from_env()
    if spec is None:
        return
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not spec.applies(rank, step, attempt):
        return
    print(
        f"[rank {rank}] injected failure: {spec.action} at step {step} (attempt {attempt})",
        file=sys.stderr,
        flush=True,
    )
    if spec.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif spec.action == "raise":
        raise InjectedFailure(f"injected failure at rank {rank}, step {step}, attempt {attempt}")
    else:
        while True:
            time.sleep(3600)
