"""Every bad setting of phase 3's programs (3.1-3.6: demos and benchmarks) is refused before any
process group or rank starts, with exit status 2 and one line naming the flag and the value.

Each case runs the program's ``main`` in this process with a bad flag. Starting a process group
(``dist.init_process_group``) or a world of ranks (``run_world``) fails the test: a setting must
be refused before either. Under torchrun every rank validates before ``init_process_group``; the
world size the program would see is set through ``WORLD_SIZE``.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.harness

PACKAGE = "solutions.phase3_multi_node"

# (program, argv, WORLD_SIZE, words the message must contain: the flag and the value)
CASES: list[tuple[str, list[str], int, tuple[str, ...]]] = [
    ("demos.hierarchical", ["--numel", "0"], 4, ("--numel", "0")),
    ("demos.hierarchical", ["--numel", "-5"], 4, ("--numel", "-5")),
    ("demos.ddp", ["--epochs", "0"], 2, ("--epochs", "0")),
    ("demos.ddp", ["--lr", "-1"], 2, ("--lr", "-1")),
    ("demos.ddp", ["--lr", "inf"], 2, ("--lr", "inf")),
    ("demos.ddp", ["--bucket-cap-mb", "-1"], 2, ("--bucket-cap-mb", "-1")),
    ("demos.ddp", ["--train-samples", "0"], 2, ("--train-samples", "0")),
    ("demos.ddp", ["--global-batch-size", "7"], 2, ("--global-batch-size", "7")),
    ("demos.ddp", ["--train-samples", "64"], 2, ("--train-samples", "64")),
    ("demos.zero", ["--steps", "0"], 2, ("--steps", "0")),
    ("demos.zero", ["--lr", "-1"], 2, ("--lr", "-1")),
    ("demos.zero", ["--lr", "nan"], 2, ("--lr", "nan")),
    ("demos.zero", ["--hidden", "0"], 2, ("--hidden", "0")),
    ("demos.zero", ["--global-batch-size", "3"], 2, ("--global-batch-size", "3")),
    ("demos.parallel_3d", ["--tp", "0"], 4, ("--tp", "0")),
    ("demos.parallel_3d", ["--pp", "0"], 4, ("--pp", "0")),
    ("demos.parallel_3d", ["--dp", "0"], 4, ("--dp", "0")),
    ("demos.parallel_3d", ["--dp", "-2"], 4, ("--dp", "-2")),
    ("demos.parallel_3d", ["--lr", "0"], 4, ("--lr", "0")),
    ("demos.parallel_3d", ["--microbatches", "0"], 4, ("--microbatches", "0")),
    ("demos.parallel_3d", ["--steps", "0"], 4, ("--steps", "0")),
    ("demos.parallel_3d", ["--seed", "-1"], 4, ("--seed", "-1")),
    ("demos.parallel_3d", ["--dp", "2", "--tp", "2", "--pp", "2"], 4, ("dp=2", "world size 4")),
    ("demos.parallel_3d", ["--tp", "3", "--dp", "1", "--pp", "1"], 3, ("tp=3", "ffn_hidden=64")),
    ("benchmarks.collectives", ["--world", "3"], 1, ("--world", "3")),
    ("benchmarks.collectives", ["--world", "1"], 1, ("--world", "1")),
    ("benchmarks.collectives", ["--world", "two"], 1, ("--world", "two")),
    ("benchmarks.collectives", ["--min-kib", "0"], 1, ("--min-kib", "0")),
    ("benchmarks.collectives", ["--max-mib", "inf"], 1, ("--max-mib", "inf")),
    ("benchmarks.collectives", ["--segment-kib", "0"], 1, ("--segment-kib", "0")),
    ("benchmarks.collectives", ["--repeat-scale", "0"], 1, ("--repeat-scale", "0")),
    ("benchmarks.collectives", ["--nodes", "0"], 1, ("--nodes", "0")),
    ("benchmarks.collectives", ["--algorithms", "ring,magic"], 1, ("--algorithms", "magic")),
    ("benchmarks.collectives", ["--min-kib", "4096", "--max-mib", "1"], 1, ("--min-kib", "4096")),
    ("benchmarks.ddp", ["--world", "1"], 1, ("--world", "1")),
    ("benchmarks.ddp", ["--steps", "0"], 1, ("--steps", "0")),
    ("benchmarks.ddp", ["--width", "0"], 1, ("--width", "0")),
    ("benchmarks.ddp", ["--batch", "0"], 1, ("--batch", "0")),
    ("benchmarks.ddp", ["--caps=-2"], 1, ("--caps", "-2")),
    ("benchmarks.zero_memory", ["--worlds", "0"], 1, ("--worlds", "0")),
    ("benchmarks.zero_memory", ["--worlds", "two"], 1, ("--worlds", "two")),
    ("benchmarks.zero_memory", ["--hidden", "0"], 1, ("--hidden", "0")),
    ("benchmarks.zero_memory", ["--steps", "0"], 1, ("--steps", "0")),
    ("benchmarks.strategies", ["--world", "1"], 1, ("--world", "1")),
    ("benchmarks.strategies", ["--layers", "3"], 1, ("--layers", "3")),
    ("benchmarks.strategies", ["--microbatches", "0"], 1, ("--microbatches", "0")),
    ("benchmarks.strategies", ["--lr", "-1"], 1, ("--lr", "-1")),
    ("benchmarks.strategies", ["--steps", "0"], 1, ("--steps", "0")),
    ("benchmarks.strategies", ["--global-batch", "63"], 1, ("--global-batch", "63")),
]


def _started(*_: Any, **__: Any) -> None:
    raise AssertionError("a process group or a world of ranks was started before the refusal")


@pytest.mark.parametrize(
    ("program", "argv", "world", "words"),
    CASES,
    ids=[f"{program}{' '.join(['', *argv])}" for program, argv, _, _ in CASES],
)
def test_a_bad_setting_is_refused_by_name_before_anything_starts(
    program: str,
    argv: list[str],
    world: int,
    words: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = importlib.import_module(f"{PACKAGE}.{program}")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "init_process_group", _started)
    if hasattr(module, "run_world"):
        monkeypatch.setattr(module, "run_world", _started)
    try:
        code = module.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    said = (out.err + out.out).strip()
    assert code == 2, f"{program} {' '.join(argv)}: exit status {code}, expected 2\n{said}"
    lines = said.splitlines()
    assert len(lines) == 1, f"{program} {' '.join(argv)}: expected one line, got:\n{said}"
    missing = [word for word in words if word not in lines[0]]
    assert not missing, f"{program} {' '.join(argv)}: the refusal lacks {missing}: {lines[0]}"
