"""Every numeric flag of every phase 1-2 program is refused before anything starts, by name.

A bad setting (a negative learning rate, zero epochs, a batch that the data or the world cannot
hold, a non-finite float) must stop the program with exit status 2 and one line on stderr that
names the flag, the value and the fix, before any process group exists and without a traceback
(issue 19). Each row below runs a program's ``main`` in this process, as rank 0 of a torchrun
world of 2 (``WORLD_SIZE=2``, ``RANK=0``): the refusal must come from parsing the flags or from
the program's validate function, never from inside the process group. The last test runs the
phase 1 trainer as a real subprocess, the way a learner would, with the flag issue 19 named.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
P1, P2 = "solutions.phase1_data_parallel", "solutions.phase2_advanced"

pytestmark = pytest.mark.harness

# (program module, argv, words the one line must contain: the flag and the value)
CASES: list[tuple[str, list[str], list[str]]] = [
    (f"{P1}.trainer", ["--lr", "-1"], ["--lr", "-1"]),
    (f"{P1}.trainer", ["--lr", "nan"], ["--lr", "nan"]),
    (f"{P1}.trainer", ["--lr", "inf"], ["--lr", "inf"]),
    (f"{P1}.trainer", ["--momentum", "1.5"], ["--momentum", "1.5"]),
    (f"{P1}.trainer", ["--epochs", "0"], ["--epochs", "0"]),
    (f"{P1}.trainer", ["--global-batch-size", "0"], ["--global-batch-size", "0"]),
    (f"{P1}.trainer", ["--global-batch-size", "63"], ["--global-batch-size", "63"]),
    (f"{P1}.trainer", ["--train-samples", "16"], ["--train-samples", "16"]),
    (f"{P1}.trainer", ["--test-samples", "0"], ["--test-samples", "0"]),
    (f"{P1}.trainer", ["--seed", "-3"], ["--seed", "-3"]),
    (f"{P1}.benchmarks.all_reduce", ["--max-mib", "0"], ["--max-mib", "0"]),
    (f"{P1}.benchmarks.all_reduce", ["--max-mib", "inf"], ["--max-mib", "inf"]),
    (f"{P1}.benchmarks.all_reduce", ["--worlds", "1"], ["--worlds", "1"]),
    (f"{P1}.benchmarks.all_reduce", ["--worlds", "2,64"], ["--worlds", "64"]),
    (f"{P2}.demos.accumulation", ["--lr", "0"], ["--lr", "0"]),
    (f"{P2}.demos.accumulation", ["--micro-batch-size", "0"], ["--micro-batch-size", "0"]),
    (f"{P2}.demos.accumulation", ["--epochs", "-2"], ["--epochs", "-2"]),
    (f"{P2}.demos.accumulation", ["--train-samples", "100"], ["--train-samples", "100"]),
    (f"{P2}.demos.accumulation", ["--global-batch-size", "255"], ["--global-batch-size", "255"]),
    (f"{P2}.demos.mixed_precision", ["--max-grad-norm", "-1"], ["--max-grad-norm", "-1"]),
    (f"{P2}.demos.mixed_precision", ["--max-grad-norm", "inf"], ["--max-grad-norm", "inf"]),
    (f"{P2}.demos.mixed_precision", ["--growth-interval", "0"], ["--growth-interval", "0"]),
    (f"{P2}.demos.mixed_precision", ["--train-samples", "64"], ["--train-samples", "64"]),
    (f"{P2}.demos.checkpointing", ["--segments", "-1"], ["--segments", "-1"]),
    (f"{P2}.demos.checkpointing", ["--segments", "100"], ["--segments", "100"]),
    (f"{P2}.demos.checkpointing", ["--width", "0"], ["--width", "0"]),
    (f"{P2}.demos.checkpointing", ["--depth", "0"], ["--depth", "0"]),
    (f"{P2}.demos.model_parallel", ["--lr", "-0.5"], ["--lr", "-0.5"]),
    (f"{P2}.demos.model_parallel", ["--steps", "0"], ["--steps", "0"]),
    (f"{P2}.demos.model_parallel", ["--batch-size", "0"], ["--batch-size", "0"]),
    (f"{P2}.demos.tensor_parallel", ["--heads", "0"], ["--heads", "0"]),
    (f"{P2}.demos.tensor_parallel", ["--tp-size", "-1"], ["--tp-size", "-1"]),
    (f"{P2}.demos.tensor_parallel", ["--seq-len", "0"], ["--seq-len", "0"]),
    (f"{P2}.demos.tensor_parallel", ["--hidden", "60"], ["--hidden", "60"]),
    (f"{P2}.demos.pipeline", ["--microbatches", "0"], ["--microbatches", "0"]),
    (f"{P2}.demos.pipeline", ["--lr", "-1"], ["--lr", "-1"]),
    (f"{P2}.demos.pipeline", ["--chunks", "0"], ["--chunks", "0"]),
    (f"{P2}.demos.pipeline", ["--width", "0"], ["--width", "0"]),
    (
        f"{P2}.demos.pipeline",
        ["--schedule", "interleaved", "--microbatches", "3"],
        ["--microbatches", "3"],
    ),
    (f"{P2}.pipeline_study.experiments", ["--steps", "1"], ["--steps", "1"]),
    (f"{P2}.pipeline_study.experiments", ["--microbatch-size", "0"], ["--microbatch-size", "0"]),
    (f"{P2}.benchmarks.memory", ["--depth", "1"], ["--depth", "1"]),
    (f"{P2}.benchmarks.memory", ["--repeats", "0"], ["--repeats", "0"]),
    (f"{P2}.benchmarks.memory", ["--batch", "2"], ["--batch", "2"]),
]


def run_main(module: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``main(argv)``'s exit status (returned, or raised by argparse) and its stderr."""
    program = importlib.import_module(module)
    try:
        code = program.main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("module", "argv", "words"), CASES, ids=[f"{m.split('.')[-1]} {' '.join(a)}" for m, a, _ in CASES]
)
def test_a_bad_setting_is_refused_by_name_before_anything_starts(
    module: str,
    argv: list[str],
    words: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, err = run_main(module, argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{module} {argv}: exit status {code}, expected 2; stderr: {err!r}"
    assert not dist.is_initialized(), f"{module} {argv}: refused only after the process group"
    assert "Traceback" not in err, f"{module} {argv} printed a traceback:\n{err}"
    assert lines, f"{module} {argv}: exit 2 but nothing on stderr"
    last = lines[-1]
    for word in words:
        assert word in last, f"{module} {argv}: the refusal should name {word!r}: {last!r}"
    assert "fix" in last or "use " in last or "choose" in last or "try " in last, (
        f"{module} {argv}: the refusal should say how to fix it: {last!r}"
    )


def test_the_trainer_refuses_a_negative_learning_rate_as_a_program() -> None:
    """Issue 19's case: ``--lr -1`` was accepted and failed inside the process group."""
    done = subprocess.run(
        [sys.executable, "-m", f"{P1}.trainer", "--lr", "-1"],
        cwd=ROOT,
        env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "--lr -1" in lines[0] and "fix" in lines[0], done.stderr
