"""The language model's record of every step: one JSON line per optimizer step (``--metrics``).

Two runs compare exactly from their files (``json`` writes the shortest text that reads back as
the same float); a resumed run continues the file from its checkpoint's step
(:func:`open_metrics`), so the file holds each step of the run's history once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

from phase4_production.lm_layout import ParallelSettings


def metrics_problem(path: str, what: str) -> str | None:
    """Why the metrics file cannot be written at ``path`` (one line naming ``what``, the flag,
    and the fix), or None: checked before any process group, not after the first step."""
    file = Path(path)
    fix = "(fix: a file in a folder you can write, e.g. runs/metrics.jsonl)"
    if file.is_dir():
        return f"{what} {path}: a folder, not a file {fix}"
    if file.exists() and not os.access(file, os.W_OK):
        return f"{what} {path}: the file is not writable {fix}"
    for ancestor in file.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                return f"{what} {path}: {ancestor} is a file, not a folder {fix}"
            if not os.access(ancestor, os.W_OK | os.X_OK):
                return f"{what} {path}: {ancestor} is not writable {fix}"
            return None
    return None


def open_metrics(path: str, start: int) -> TextIO:
    """Rank 0's metrics file, opened to append one line per step after ``start`` steps.

    The file keeps the lines of steps 1..``start`` and drops the rest: a run that starts afresh
    (``start`` 0) begins the file anew; a run resumed from a checkpoint of step ``start`` keeps the
    record up to it and drops what the interrupted run did after it (which is done again, and
    a line cut short by a kill), so the file holds each step of the run's history once. Lines
    are written whole and flushed as they are finished (line buffering).
    """
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    kept = []
    if start and file.exists():
        for line in file.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and step <= start:
                kept.append(line + "\n")
    file.write_text("".join(kept))
    return file.open("a", buffering=1)


def step_record(
    step: int, epoch: int, report: Any, tokens: int, settings: ParallelSettings, seconds: float
) -> dict[str, Any]:
    """One optimizer step as the metrics file records it (a JSON object, one line).

    ``step`` counts optimizer steps from 1 over the whole run (a resumed run continues the
    count), ``epoch`` from 1; ``loss`` (what the step minimized), ``cross_entropy`` and
    ``balance`` (MoE's load-balancing term, 0 without experts) are the global batch's, the same
    on every rank, as Python floats (``json`` writes the shortest text that reads back as the
    same float: two runs compare exactly); ``tokens`` the global batch's inputs,
    ``valid_tokens`` the targets the loss counts; ``grad_norm`` before clipping (null without
    clipping); ``lr`` AdamW's learning rate (constant: the runtime has no schedule);
    ``seconds`` the step's wall time on rank 0; ``layout`` the settings' label (a run resumed at
    another layout says so on its lines).
    """
    grad_norm = None if report.grad_norm is None else float(report.grad_norm)
    return {"step": step, "epoch": epoch, "loss": float(report.loss),
            "cross_entropy": float(report.cross_entropy), "balance": float(report.balance),
            "tokens": tokens, "valid_tokens": int(report.valid_tokens), "grad_norm": grad_norm,
            "lr": settings.lr, "seconds": seconds, "layout": settings.label()}  # fmt: skip
