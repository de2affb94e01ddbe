"""Bad settings of phase 4's programs are refused before anything starts, by name, in one line.

For every program (the resilient trainer, the capstone, the monitoring demo, the checkpoint,
compression and ImageNet benchmarks) a table of bad flags or keys: each must end the program with
status 2 and one line on stderr that names the flag or key and the value (and no traceback),
before any process group exists. Under torchrun every rank validates; rank 0 speaks (the others
only as a backstop, so that torchrun cannot swallow the line). These are programs, not
exercises: the tests grade no learner code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phase4_production.checkpoint_files import SettingsMismatch

pytestmark = pytest.mark.reference
Main = Callable[[Sequence[str] | None], int]


def refused(
    main: Main, argv: list[str], capsys: pytest.CaptureFixture[str], expected: Sequence[str]
) -> str:
    """Run ``main(argv)``: it must exit 2 with one line naming ``expected``, no process group."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse and parse_config exit
        code = stop.code  # type: ignore[assignment]
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if not line.startswith("usage:")]
    assert code == 2, f"{argv}: exit {code}, expected 2 (refused); stderr:\n{err}"
    assert not dist.is_initialized(), f"{argv}: a process group started before the refusal"
    assert "Traceback" not in err and len(lines) == 1, f"{argv}: expected one line, got:\n{err}"
    missing = [text for text in expected if text not in lines[0]]
    assert not missing, f"{argv}: the refusal should mention {missing}: {lines[0]}"
    return lines[0]


@pytest.fixture
def world_of_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torchrun exports to rank 0 of 2 (validation reads it before any group exists)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


# ----------------------------------------------------------------------------- resilient trainer

TRAINER_CASES = [
    (["--epochs", "0"], ["--epochs 0", ">= 1"]),
    (["--micro-batch", "0"], ["--micro-batch 0", ">= 1"]),
    (["--lr", "-1"], ["--lr -1.0", "> 0", "positive"]),
    (["--lr", "inf"], ["--lr inf", "finite"]),
    (["--lr", "nan"], ["--lr nan", "finite"]),
    (["--global-batch", "0"], ["--global-batch 0"]),
    (["--train-samples", "16"], ["--train-samples 16", "--global-batch 32", "no step"]),
    (["--train-samples", "500"], ["--train-samples 500", "not a multiple"]),
    (["--global-batch", "33", "--train-samples", "528"], ["--global-batch 33", "world size 2"]),
    (["--elastic", "--micro-batch", "5"], ["--global-batch 32", "--micro-batch 5", "= 10"]),
    (["--keep", "0"], ["--keep 0"]),
    (["--checkpoint-every", "0"], ["--checkpoint-every 0"]),
    (["--collective-timeout", "0"], ["--collective-timeout 0.0"]),
    (["--step-sleep", "-1"], ["--step-sleep -1.0"]),
    (["--leave-after", "-5"], ["--leave-after -5"]),
    (["--seed", "-1"], ["--seed -1"]),
    (["--fail", "explode:rank=0:step=1"], ["--fail", "explode"]),
    (["--compare", "--elastic"], ["--compare", "--elastic"]),
]


@pytest.mark.parametrize(("argv", "expected"), TRAINER_CASES)
def test_the_resilient_trainer_refuses_bad_flags_before_starting(
    argv: list[str],
    expected: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    world_of_2: None,
) -> None:
    from solutions.phase4_production.resilience import trainer as resilient_trainer

    refused(resilient_trainer.main, [*argv, "--checkpoint-dir", str(tmp_path)], capsys, expected)


def test_the_resilient_trainer_refuses_a_checkpoint_folder_below_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], world_of_2: None
) -> None:
    from solutions.phase4_production.resilience import trainer as resilient_trainer

    below = str(a_file(tmp_path) / "ckpt")
    refused(
        resilient_trainer.main,
        ["--checkpoint-dir", below],
        capsys,
        ["--checkpoint-dir", below, "is a file, not a folder"],
    )


def test_a_checkpoint_of_other_settings_is_refused_by_name_before_anything_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], world_of_2: None
) -> None:
    from solutions.phase4_production import checkpoint
    from solutions.phase4_production.resilience import trainer as resilient_trainer

    made = resilient_trainer.ResilientConfig(checkpoint_dir=str(tmp_path))
    settings = resilient_trainer.checkpoint_settings(made, 2)
    manager = checkpoint.CheckpointManager(tmp_path, settings=settings)
    manager.save(5, {"train_state.pt": {"w": torch.zeros(2)}})
    refused(
        resilient_trainer.main,
        ["--checkpoint-dir", str(tmp_path), "--train-samples", "480"],
        capsys,
        ["checkpoint step_00000005 was made with --train-samples 512, this run has 480"],
    )
    again = checkpoint.CheckpointManager(tmp_path, settings={**settings, "world size": 1})
    with pytest.raises(SettingsMismatch, match="world size 2, this run has 1"):
        again.load(tmp_path / "step_00000005", "train_state.pt")


def test_under_torchrun_another_rank_speaks_only_as_a_backstop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 prints the same line, but only after course.cli.BACKSTOP_SECONDS: normally rank 0
    has printed and exited by then and torchrun has ended rank 1, so the line appears once; when
    rank 0 is slow, torchrun can no longer end it before anyone spoke (issue 38)."""
    from course import cli
    from solutions.phase4_production.resilience import trainer as resilient_trainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    waited: list[float] = []
    monkeypatch.setattr(cli.time, "sleep", waited.append)
    argv = ["--train-samples", "16", "--checkpoint-dir", str(tmp_path)]
    assert resilient_trainer.main(argv) == 2
    assert "--train-samples 16" in capsys.readouterr().err and not dist.is_initialized()
    assert waited == [cli.BACKSTOP_SECONDS]


# ----------------------------------------------------------------------------- the capstone

CAPSTONE_CASES = [
    (["optim.base_lr=.inf"], ["optim.base_lr=inf", "finite"]),
    (["optim.base_lr=.nan"], ["optim.base_lr=nan", "finite"]),
    (["optim.base_lr=-1"], ["optim.base_lr=-1", "greater than 0"]),
    (["data.val_samples=1"], ["data.val_samples=1", "2 ranks"]),
    (["data.train_samples=16"], ["data.train_samples=16", "global batch 32"]),
    (["train.epochs=0"], ["train.epochs=0", "greater than or equal to 1"]),
    (["checkpoint.keep=0"], ["checkpoint.keep=0"]),
    (["train.grad_clip_norm=.inf"], ["train.grad_clip_norm=inf", "finite"]),
]


@pytest.mark.parametrize(("overrides", "expected"), CAPSTONE_CASES)
def test_the_capstone_refuses_bad_keys_before_starting(
    overrides: list[str],
    expected: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    world_of_2: None,
) -> None:
    from solutions.phase4_production.imagenet import trainer as imagenet_trainer

    argv = [*overrides, f"checkpoint.dir={tmp_path}"]
    try:
        code = imagenet_trainer.main(argv)
    except SystemExit as stop:
        code = stop.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not dist.is_initialized(), (code, err)
    missing = [text for text in expected if text not in err]
    assert not missing, f"{overrides}: the refusal should mention {missing}:\n{err}"


def test_the_capstone_refuses_a_checkpoint_dir_below_a_file_and_other_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], world_of_2: None
) -> None:
    from solutions.phase4_production import checkpoint
    from solutions.phase4_production.imagenet import trainer as imagenet_trainer
    from solutions.phase4_production.imagenet.config import checkpoint_settings, load_config

    below = a_file(tmp_path) / "ckpt"
    refused(
        imagenet_trainer.main,
        [f"checkpoint.dir={below}"],
        capsys,
        ["checkpoint.dir", str(below), "is a file, not a folder"],
    )
    folder = tmp_path / "ckpt"
    config = load_config("cpu-smoke", [f"checkpoint.dir={folder}"])
    settings = checkpoint_settings(config, 1, config.data.train_samples)
    checkpoint.CheckpointManager(folder, settings=settings).save(4, {"train_state.pt": {}})
    refused(
        imagenet_trainer.main,
        [f"checkpoint.dir={folder}"],
        capsys,
        ["checkpoint step_00000004 was made with world size 1, this run has 2"],
    )


# ----------------------------------------------------------------------------- demos, benchmarks

DEMO_CASES = [
    (["--lr", "-1"], ["--lr -1.0", "> 0"]),
    (["--epochs", "0"], ["--epochs 0"]),
    (["--slow-ms", "-3"], ["--slow-ms -3.0"]),
    (["--threshold", "1"], ["--threshold 1.0", "> 1"]),
    (["--peak-tflops", "inf"], ["--peak-tflops inf", "finite"]),
    (["--slow-rank", "2"], ["--slow-rank 2", "world of 2"]),
]


@pytest.mark.parametrize(("argv", "expected"), DEMO_CASES)
def test_the_monitoring_demo_refuses_bad_flags(
    argv: list[str],
    expected: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    world_of_2: None,
) -> None:
    from solutions.phase4_production.demos import monitoring as monitoring_demo

    refused(monitoring_demo.main, [*argv, "--output-dir", str(tmp_path)], capsys, expected)


def test_the_monitoring_demo_refuses_an_output_dir_below_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], world_of_2: None
) -> None:
    from solutions.phase4_production.demos import monitoring as monitoring_demo

    below = str(a_file(tmp_path) / "runs")
    refused(monitoring_demo.main, ["--output-dir", below], capsys, ["--output-dir", "a file"])


BENCHMARK_CASES = [
    ("benchmarks.checkpoint", ["--saves", "0"], ["--saves 0"]),
    ("benchmarks.checkpoint", ["--width", "0"], ["--width 0"]),
    ("benchmarks.checkpoint", ["--directory", "{file}/x"], ["--directory", "a file"]),
    ("benchmarks.compression", ["--lr", "-1"], ["--lr -1.0"]),
    ("benchmarks.compression", ["--momentum", "1.5"], ["--momentum 1.5"]),
    ("benchmarks.compression", ["--epochs", "0"], ["--epochs 0"]),
    ("benchmarks.compression", ["--world", "1"], ["--world 1"]),
    ("imagenet.benchmark", ["--steps", "0"], ["--steps 0"]),
    ("imagenet.benchmark", ["--batch", "0"], ["--batch 0"]),
    ("imagenet.benchmark", ["--workers", "-1"], ["--workers -1"]),
]


@pytest.mark.parametrize(("program", "argv", "expected"), BENCHMARK_CASES)
def test_the_benchmarks_refuse_bad_flags(
    program: str,
    argv: list[str],
    expected: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    world_of_2: None,
) -> None:
    import importlib

    module = importlib.import_module(f"solutions.phase4_production.{program}")
    argv = [arg.replace("{file}", str(a_file(tmp_path))) for arg in argv]
    refused(module.main, argv, capsys, expected)
