"""The language-model framework's command line: every bad setting refused by name, once, where it
cannot be lost; a record of every step; the run says what it is doing (issues 38 and 41).

* refusals: an empty config file, a key given twice, ``--world`` < 1 or odd or ignored, a
  checkpoint folder or metrics file that cannot be written: ``lm.framework.main`` returns 2
  with one line naming the key or flag, before any process group; under real torchrun the line
  appears even when rank 0 is too slow to say it before another rank exits (it used to be lost);
* a :class:`course.cli.Refusal` raised inside a program is one line and its exit status, no
  traceback; a measurement that runs past its deadline says the machine was too busy, with the
  load, instead of a hang diagnosis;
* ``--metrics``: one JSON line per optimizer step whose losses are the run's exactly, kept up to
  the checkpoint and continued by a resumed run (here with ``checkpoint.every: 0``, which resumes
  and saves none);
* progress: the phases on rank 0's stderr, a line every few seconds when stderr is no terminal.

Not an exercise: these grade the reference programs, not learner code.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from course import cli
from course.config_files import ConfigError
from course.language_model import LMConfig
from course.topology import Topology
from course.world import RankFailed, WorldHung, run_world
from phase4_production.lm_layout import ParallelSettings
from solutions.phase4_production.lm import config as lm_config_cli
from solutions.phase4_production.lm import framework as lm_framework
from solutions.phase4_production.lm import progress as lm_progress
from solutions.phase4_production.lm import rates as lm_rates
from solutions.phase4_production.lm import trainer as lm_trainer

pytestmark = pytest.mark.harness

TINY_OVERRIDES = ["parallel.tp=1", "parallel.sequence_parallel=false", "model.width=16",
                  "model.heads=2", "model.layers=2", "model.ffn=32", "model.seq_len=8"]  # fmt: skip
HEADS_REFUSAL = "tp=2 does not divide heads=3"
SLOW_RANK0_ENV = "DTFS_TEST_SLOW_RANK0"  # seconds rank 0 sleeps before main (the __main__ below)


class Launched(AssertionError):
    pass


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A setting these tests expect refused must not start a process group (nor, accepted by
    mistake, train for minutes in the test process)."""

    def launched() -> None:
        raise Launched("a process group was about to start: the setting was accepted")

    monkeypatch.setattr(lm_framework, "distributed_session", launched)
    monkeypatch.setattr(lm_trainer, "distributed_session", launched)


def refusal(
    argv: list[str], capsys: pytest.CaptureFixture[str], code: int = 2, phases: int = 0
) -> str:
    """Run ``lm.framework.main(argv)``: it must return ``code`` with one ``error:`` line on
    stderr (after ``phases`` lines saying what it started), no traceback, no process group."""
    got = lm_framework.main(argv)
    err = capsys.readouterr().err.strip()
    assert got == code, f"{argv}: exit {got}, expected {code}; stderr:\n{err}"
    assert not dist.is_initialized(), f"{argv}: a process group started before the refusal"
    lines = err.splitlines()
    assert "Traceback" not in err and len(lines) == phases + 1, (
        f"{argv}: expected one 'error: ...' line, got:\n{err}"
    )
    assert lines[-1].startswith("error: "), lines[-1]
    return lines[-1]


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


# ----------------------------------------------------------------------------- refusals


def test_an_empty_config_file_and_a_key_given_twice_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# only a comment\n")
    line = refusal(["--config", str(empty)], capsys)
    assert str(empty) in line and "holds no settings" in line, line
    twice = tmp_path / "twice.yaml"
    twice.write_text("model:\n  width: 16\ntrain:\n  lr: 0.1\n  batch: 8\n  lr: 0.2\n")
    line = refusal(["--config", str(twice)], capsys)
    assert "train.lr is given twice (lines 4 and 6)" in line, line
    # the capstone reads its files through the same course/config_files.read_yaml
    from solutions.phase4_production.imagenet import config as imagenet_config

    with pytest.raises(ConfigError, match=r"train\.lr is given twice"):
        imagenet_config.load_config(str(twice))


def test_help_answers_before_torch_loads_and_says_what_every_option_is() -> None:
    """``--help`` of the framework: no torch import (it took 4.8 s of CPU, 24 s on a busy
    machine), and a sentence for every option, --config and --set included."""
    import subprocess

    probe = (
        "import sys, contextlib, io\n"
        "from solutions.phase4_production.lm import framework\n"
        "out = io.StringIO()\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):\n"
        "    framework.parse_args(['--help'])\n"
        "print('torch loaded' if 'torch' in sys.modules else 'no torch')\n"
        "print(out.getvalue())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], check=True)  # fmt: skip
    first, _, text = done.stdout.partition("\n")
    assert first == "no torch", f"--help imported torch:\n{done.stdout}{done.stderr}"
    squashed = " ".join(text.split())
    for option, says in (("--config", "the YAML config"), ("--set", "override config keys"),
                         ("--plan-only", "planner's ranked"), ("--world", "plan for this many"),
                         ("--metrics", "JSON line per"), ("--impl", "whose 4.7 composition")):  # fmt: skip
        assert option in squashed and says in squashed, f"{option}: {says!r} not in\n{text}"
    assert "lm-cpu-smoke" in squashed and "README.md" in squashed, text


def test_every_set_flag_applies_when_given_more_than_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--set a=1 --set b=2`` is ``--set a=1 b=2``: a second flag used to replace the first,
    and a run asked for bf16 trained in float32 without a word."""
    from solutions.phase4_production.lm.config import load_config

    given = ["--set", "precision=bf16-mixed", "--set", "train.lr=0.01", "zero=2"]
    args = lm_framework.parse_args(given)
    assert args.set == ["precision=bf16-mixed", "train.lr=0.01", "zero=2"], args.set
    config = load_config(lm_framework.DEFAULT_CONFIG, args.set)
    assert (config.precision, config.train.lr, config.zero) == ("bf16-mixed", 0.01, 2)
    assert config.settings(4).bf16_autocast
    assert lm_config_cli.main(given) == 0  # the config printer reads its flags alike
    printed = capsys.readouterr().out
    assert "precision: bf16-mixed" in printed and "zero: 2" in printed, printed


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--plan-only", "--world", "0"], ["--world 0", "--plan-only --world 2"]),
        (["--plan-only", "--world", "-4"], ["--world -4", "even number of ranks"]),
        (["--plan-only", "--world", "3"], ["--world 3", "--plan-only --world 4"]),
        (["--world", "4"], ["--world 4", "only --plan-only reads it"]),
    ],
)
def test_a_world_that_is_no_world_or_would_be_ignored_is_refused_naming_world(
    argv: list[str], expected: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    line = refusal(argv, capsys)
    missing = [text for text in expected if text not in line]
    assert not missing, f"{argv}: the refusal should mention {missing}: {line}"


def test_folders_that_cannot_be_written_are_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    below = a_file(tmp_path) / "ckpt"
    saving = ["--set", *TINY_OVERRIDES, f"checkpoint.dir={below}", "checkpoint.every=2"]
    line = refusal(saving, capsys)
    assert f"checkpoint.dir {below}" in line and "is a file, not a folder" in line, line
    metrics = a_file(tmp_path) / "metrics.jsonl"
    line = refusal(["--set", *TINY_OVERRIDES, "--metrics", str(metrics)], capsys)
    assert f"--metrics {metrics}" in line and "is a file, not a folder" in line, line
    line = refusal(["--set", *TINY_OVERRIDES, "--metrics", str(tmp_path)], capsys)
    assert "a folder, not a file" in line, line
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        line = refusal(["--set", *TINY_OVERRIDES, f"checkpoint.dir={locked / 'c'}",
                        "checkpoint.every=1"], capsys)  # fmt: skip
        assert "is not writable" in line, line
    # lm_trainer's own flag, the same check
    line = refusal_of_trainer(["--metrics", str(metrics)], capsys)
    assert f"--metrics {metrics}" in line, line


def refusal_of_trainer(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert lm_trainer.main(argv) == 2
    return capsys.readouterr().err.strip()


def test_a_refusal_inside_a_program_is_one_line_with_its_exit_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class FolderRefused(cli.Refusal):
        pass

    def refusing(argv: Any) -> int:
        raise FolderRefused("checkpoint.dir /x: no checkpoint there verifies")

    with pytest.raises(SystemExit) as stop:
        cli.run_main(refusing, [])
    err = capsys.readouterr().err
    assert stop.value.code == 2, stop.value.code
    assert err == "error: checkpoint.dir /x: no checkpoint there verifies\n", err
    # a rank other than 0 says it too, after rank 0's head start (torchrun may have ended rank 0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cli, "BACKSTOP_SECONDS", 0.01)
    with pytest.raises(SystemExit) as stop:
        cli.run_main(refusing, [])
    assert stop.value.code == 2 and "no checkpoint there verifies" in capsys.readouterr().err

    def too_busy(argv: Any) -> int:
        raise lm_rates.MachineTooBusy("the links of 4 ranks", 120.0)

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop:
        cli.run_main(too_busy, [])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "too busy to measure the links of 4 ranks within 120 s" in err
    assert isinstance(ConfigError("x"), cli.Refusal), "config errors inside a group: one line too"


# ----------------------------------------------------------------------------- deadlines


def _links_with_deadline(deadline: float) -> dict[str, list[float]]:
    return lm_rates.link_times(1, None, deadline)


def test_measuring_past_its_deadline_says_the_machine_is_busy_not_hung(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deadline of 0 s stands for a machine too busy to measure: the compute (one process),
    the links in a world of their own (--plan-only) and inside a running world (torchrun's)."""
    busy = r"too busy to measure .* within 0(\.0+1)? s: load [\d.]+ on \d+ cores \(fix: "
    with pytest.raises(lm_rates.MachineTooBusy, match=busy):
        lm_rates.measure_compute(LMConfig(width=8, heads=2, layers=1, ffn=8, seq_len=4),
                                 lm_framework.DTYPES["fp32"], repeats=1, deadline=0.0)  # fmt: skip
    deadlines = []

    def past_deadline(*args: Any, timeout: float, **kwargs: Any) -> list[Any]:
        deadlines.append(timeout)
        raise WorldHung(timeout, {0: []}, [1], deadlocked_after=None if timeout < 1 else 0.5)

    monkeypatch.setattr(lm_rates, "run_world", past_deadline)
    with pytest.raises(lm_rates.MachineTooBusy, match=r"the links of 2 ranks within 0\.5 s"):
        lm_rates.measure_links(2, repeats=1, deadline=0.5)
    with pytest.raises(WorldHung):  # a deadlock the harness saw stays a deadlock
        lm_rates.measure_links(2, repeats=1, deadline=5.0)
    assert deadlines == [0.5, 5.0], f"the links' world ran under {deadlines}, not the deadline"
    monkeypatch.undo()
    with pytest.raises(RankFailed, match="MachineTooBusy: the machine was too busy to measure"):
        run_world(_links_with_deadline, 2, (0.0,))
    monkeypatch.setenv(lm_rates.RATES_TIMEOUT_ENV, "0.000001")
    line = refusal(["--plan-only", "--world", "2", "--set", *TINY_OVERRIDES], capsys, code=1,
                   phases=1)  # fmt: skip
    assert "too busy to measure one layer's compute within 1e-06 s" in line, line
    assert "allow longer with DTFS_RATES_TIMEOUT=120)" in line, line
    monkeypatch.setenv(lm_rates.RATES_TIMEOUT_ENV, "soon")
    with pytest.raises(cli.Refusal, match="DTFS_RATES_TIMEOUT='soon': not a positive number"):
        lm_rates.rates_timeout()


# ----------------------------------------------------------------------------- the record

MODEL = LMConfig(width=16, heads=2, layers=2, ffn=32, seq_len=8)


def recorded_run(metrics: str, epochs: int, directory: str, every: int) -> tuple[list[float], str]:
    """lm_trainer.run at dp2 (2 steps per epoch, float64) writing ``metrics``, with checkpoints
    in ``directory`` every ``every`` steps (0: resumes, saves none); its step losses and what
    rank 0 wrote on stderr."""
    from solutions.phase4_production.lm.checkpoint import CheckpointPlan

    settings = ParallelSettings(dp=2, lr=1e-2, max_norm=1.0)
    topology = Topology.build(2, 1, 1)
    options = lm_trainer.RunOptions(batch=4, epochs=epochs, steps_per_epoch=2, eval_batches=1,
                                    dtype="float64", seed=3, sample_bytes=0,
                                    metrics=metrics)  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        plan = CheckpointPlan(directory, every)
        history = lm_trainer.run(MODEL, settings, options, topology, plan)
    return history.step_losses, err.getvalue()


def test_metrics_record_every_step_exactly_and_a_resumed_run_continues_them(
    tmp_path: Path,
) -> None:
    """dp2 for 2 steps saving a checkpoint; a step 3 the interrupted run wrote after it and a
    line cut by a kill; then a run of 4 steps with ``checkpoint.every: 0`` resumes at step 2 (it
    runs 2 steps, saves none) and the file holds steps 1-4 once, each loss the run's own."""
    metrics, directory = tmp_path / "run" / "metrics.jsonl", tmp_path / "ckpt"
    first, err = run_world(recorded_run, 2, (str(metrics), 1, str(directory), 2))[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2], records
    assert [r["loss"] for r in records] == first, "the record's losses are not the run's, exactly"
    fields = {"step", "epoch", "loss", "cross_entropy", "balance", "tokens", "valid_tokens",
              "grad_norm", "lr", "seconds", "layout"}  # fmt: skip
    assert set(records[0]) == fields, sorted(records[0])
    assert records[0]["layout"] == "dp2" and records[0]["tokens"] == 4 * MODEL.seq_len
    assert records[0]["lr"] == 1e-2 and records[0]["grad_norm"] > 0 and records[0]["seconds"] > 0
    for phase in ("building the model at dp2 on 2 ranks", "loading the corpus", "training: 2 "):
        assert phase in err, f"rank 0's stderr does not say {phase!r}:\n{err}"
    assert "step 1/2: loss" in err and "step 2/2: loss" in err, err

    with metrics.open("a") as file:  # what a run killed during step 4 leaves behind
        file.write(json.dumps({**records[-1], "step": 3, "loss": 9.0}) + '\n{"step": 4, "lo')
    resumed, _ = run_world(recorded_run, 2, (str(metrics), 2, str(directory), 0))[0]
    assert len(resumed) == 2, f"with checkpoint.every 0 the run did not resume: {resumed}"
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000002"], "every 0 saved"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4], records
    assert [r["loss"] for r in records] == first + resumed


def test_the_framework_resumes_with_every_0_and_passes_metrics_on() -> None:
    config = lm_framework.load_config("lm-cpu-smoke", ["checkpoint.every=0"])
    plan = lm_framework.checkpoint_plan(config)
    assert plan.every == 0 and plan.resume and plan.directory == config.checkpoint.dir
    assert lm_framework.options_of(config, "solutions", "m.jsonl").metrics == "m.jsonl"
    assert lm_trainer.TrainConfig(metrics="m.jsonl").options().metrics == "m.jsonl"
    assert lm_trainer.TrainConfig().options().metrics is None


# ----------------------------------------------------------------------------- progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_a_line_every_few_seconds_elsewhere() -> None:
    now = [0.0]
    log = io.StringIO()
    progress = lm_progress.StepProgress(100, 0, 512, stream=log, clock=lambda: now[0])
    for _ in range(99):  # a step every 0.5 s: the first, then one line per PROGRESS_SECONDS
        now[0] += 0.5
        progress.step(2.5, 0.25)
    progress.step(2.25, 0.25)  # and the last
    lines = log.getvalue().splitlines()
    assert lines[0] == "step 1/100: loss 2.5000, 2,048 tokens/s", lines[0]
    assert lines[-1] == "step 100/100: loss 2.2500, 2,048 tokens/s", lines[-1]
    assert len(lines) == 2 + 49 // lm_progress.PROGRESS_SECONDS, lines
    assert "\r" not in log.getvalue()
    terminal = Terminal()
    bar = lm_progress.StepProgress(10, 4, 512, stream=terminal)  # resumed after 4 steps
    bar.step(2.5, 0.25)
    shown = str(bar.bar)  # what tqdm draws (at most every 0.1 s on the terminal)
    bar.close()
    assert "5/10" in shown and "loss 2.5000, 2,048 tokens/s" in shown, shown
    assert terminal.getvalue().startswith("\rtraining:"), terminal.getvalue()
    quiet = io.StringIO()
    lm_progress.StepProgress(10, 0, 512, enabled=False, stream=quiet).step(2.5, 0.25)
    assert quiet.getvalue() == ""


# ----------------------------------------------------------------------------- under torchrun


@pytest.mark.torchrun
def test_a_refusal_under_torchrun_is_never_lost() -> None:
    """Two real torchrun runs of a refused layout (tp=2 on 3 heads), 2 ranks each: as it runs,
    and with rank 0 held back 4 s before it starts (as on a busy machine): rank 1 refuses, and
    when it used to exit without a word torchrun then ended rank 0 before it spoke (issue 38,
    1 run in 3). Every run must show the line."""
    from course.torchrun_runner import run_torchrun

    args = ["--set", "model.heads=3", "model.width=48"]
    for slow in (0, 4):
        run = run_torchrun("tests.test_lm_framework_cli", args, nproc_per_node=2, time_limit=60,
                           env={SLOW_RANK0_ENV: str(slow)}, fork_workers=True)  # fmt: skip
        said = [log.local_rank for log in run.ranks if f"error: {HEADS_REFUSAL}" in log.stderr]
        what = f"torchrun, 2 ranks, rank 0 held back {slow} s"
        assert said, f"{what}: no rank printed the refusal:\n{run.describe(1500)}"
        assert not run.timed_out and run.agents[0].returncode != 0, run.describe(1500)
        if slow:
            assert said == [1], f"{what}: the refusal came from ranks {said}, expected rank 1"


if __name__ == "__main__":  # the worker of the torchrun test: lm_framework, rank 0 held back
    import time

    if os.environ.get("RANK") == "0":
        time.sleep(float(os.environ.get(SLOW_RANK0_ENV, "0")))
    cli.run_main(lm_framework.main, sys.argv[1:])
