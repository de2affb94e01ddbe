"""Bad settings of the parameter-server programs are refused before any process starts (issue 19).

Each program (the launcher, ``python -m solutions.phase3_multi_node.parameter_server`` being the
same ``main``; the benchmark; the probe) gets a table of bad flags. For each one: exit status 2,
one line naming the flag and the value, no traceback, and no server, worker or probe process
started (the test makes starting one an error).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from phase3_multi_node import ps_launcher, ps_probes
from solutions.phase3_multi_node.benchmarks import parameter_server as benchmark_parameter_server

pytestmark = pytest.mark.harness
ROOT = Path(__file__).resolve().parents[1]

# (argv, the flag the message must name, the value it must show)
LAUNCHER: list[tuple[list[str], str, str]] = [
    (["--batch-size", "0"], "--batch-size", "0"),
    (["--lr", "-1"], "--lr", "-1"),
    (["--lr", "0"], "--lr", "0"),
    (["--lr", "nan"], "--lr", "nan"),
    (["--lr", "inf"], "--lr", "inf"),
    (["--momentum", "1.5"], "--momentum", "1.5"),
    (["--momentum", "-0.1"], "--momentum", "-0.1"),
    (["--servers", "0"], "--servers", "0"),
    (["--workers", "0"], "--workers", "0"),
    (["--steps", "0"], "--steps", "0"),
    (["--staleness", "-1"], "--staleness", "-1"),
    (["--train-samples", "0"], "--train-samples", "0"),
    (["--test-samples", "0"], "--test-samples", "0"),
    (["--slow-worker", "3"], "--slow-worker", "3"),
    (["--slow-worker", "-2"], "--slow-worker", "-2"),
    (["--slow-factor", "0.5"], "--slow-factor", "0.5"),
    (["--slow-factor", "inf"], "--slow-factor", "inf"),
    (["--time-budget", "-1"], "--time-budget", "-1"),
    (["--step-delay", "-0.1"], "--step-delay", "-0.1"),
    (["--kill-worker", "3"], "--kill-worker", "3"),
    (["--kill-worker", "1", "--kill-at", "150"], "--kill-at", "150"),
    (["--kill-worker", "1", "--kill-at", "-1"], "--kill-at", "-1"),
    (["--restart-killed"], "--restart-killed", "--kill-worker"),
    (["--sync-timeout", "0"], "--sync-timeout", "0"),
    (["--sync-timeout", "nan"], "--sync-timeout", "nan"),
    (["--time-limit", "-5"], "--time-limit", "-5"),
    (["--batch-size", "2000"], "--batch-size", "2000"),
    (["--workers", "8", "--train-samples", "4"], "--train-samples", "4"),
    (["--host", "0.0.0.0"], "--host", "0.0.0.0"),
]
BENCHMARK: list[tuple[list[str], str, str]] = [
    (["--repeats", "0"], "--repeats", "0"),
    (["--time-budget", "0"], "--time-budget", "0"),
    (["--workers", "1"], "--workers", "1"),
    (["--servers", "0"], "--servers", "0"),
    (["--lr", "-1"], "--lr", "-1"),
    (["--step-delay", "-1"], "--step-delay", "-1"),
    (["--slow-factor", "0.5"], "--slow-factor", "0.5"),
    (["--staleness", "-2"], "--staleness", "-2"),
    (["--scenario", "hardening", "--seconds", "0"], "--seconds", "0"),
    (["--scenario", "hardening", "--seconds", "inf"], "--seconds", "inf"),
]
PROBE: list[tuple[list[str], str, str]] = [
    (["127.0.0.1", "0"], "port", "0"),
    (["127.0.0.1", "5000", "--idle", "-1"], "--idle", "-1"),
    (["127.0.0.1", "5000", "--drips", "-3"], "--drips", "-3"),
    (["127.0.0.1", "5000", "--interval", "0"], "--interval", "0"),
    (["127.0.0.1", "5000", "--seconds", "nan"], "--seconds", "nan"),
]


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a server, a worker or a probe process fails the test."""

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("a process was started before the settings were checked")

    monkeypatch.setattr(ps_launcher.Cluster, "_start", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.delenv("DTFS_PS_SECRET", raising=False)


def _refused(
    main: Callable[[Sequence[str] | None], int],
    argv: list[str],
    flag: str,
    value: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, f"{argv}: exit status {code}, expected 2; stderr: {err}"
    assert "Traceback" not in err, f"{argv}: a traceback instead of one line:\n{err}"
    lines = [line for line in err.splitlines() if flag in line and value in line]
    assert lines, f"{argv}: no line names both {flag} and {value}:\n{err}"


@pytest.mark.parametrize(
    ("argv", "flag", "value"), LAUNCHER, ids=[" ".join(a) for a, _, _ in LAUNCHER]
)
def test_launcher_refuses(
    argv: list[str], flag: str, value: str, no_processes: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(ps_launcher.main, argv, flag, value, capsys)


@pytest.mark.parametrize(
    ("argv", "flag", "value"), BENCHMARK, ids=[" ".join(a) for a, _, _ in BENCHMARK]
)
def test_benchmark_refuses(
    argv: list[str], flag: str, value: str, no_processes: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(benchmark_parameter_server.main, argv, flag, value, capsys)


@pytest.mark.parametrize(("argv", "flag", "value"), PROBE, ids=[" ".join(a) for a, _, _ in PROBE])
def test_probe_refuses(
    argv: list[str], flag: str, value: str, no_processes: None, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(ps_probes.main, argv, flag, value, capsys)


def test_the_instructor_command_refuses_a_negative_learning_rate_in_one_line() -> None:
    """The real command, in its own process: one line, status 2, the flag named (it used to fail
    late with torch's "Invalid learning rate: -1.0" traceback, after the processes started)."""
    result = subprocess.run(
        [sys.executable, "-m", "solutions.phase3_multi_node.parameter_server", "--lr", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "--lr -1" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == "", "nothing may start (no server listening line)"
