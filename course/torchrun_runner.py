"""Run real ``torchrun`` agents as subprocesses within a hard time bound, leaving no process behind.

:func:`course.world.run_world` forks ranks directly and is fast; some behaviour only
exists with torchrun's elastic agent: restarts under ``--max-restarts``, several agents meeting at
a c10d rendezvous as "nodes", membership changes under ``--nnodes 1:2``. :func:`run_torchrun`
starts one agent (``--standalone``) or several on 127.0.0.1 (``--rdzv-backend c10d``; with c10d
the first agent to arrive becomes group 0, ``--node-rank`` is ignored), and returns every agent's
exit status and output and every worker's output, per restart attempt.

Where the output comes from: ``--log-dir DIR --redirects 3`` makes each agent write each worker's
streams to ``DIR/<run_id>_*/attempt_<n>/<local_rank>/{stdout,stderr}.log``
(torch/distributed/elastic/multiprocessing/api.py, ``DefaultLogsSpecs.reify``). Unlike the
console (``--tee``), these files keep the streams of every attempt apart and never interleave
ranks, so they are what :class:`RankLog` reads.

How workers start: by default as torchrun starts them for ``torchrun -m module``, each a fresh
``python -u -m module`` (which imports torch again: about 2.5 s of CPU per worker, per restart).
``fork_workers=True`` asks torchrun for ``--start-method=fork --run-path <module's file>``
(torch/distributed/run.py, ``run_script_path``): each worker is a fork of its agent, which has
imported torch already, and runs the module's file as ``__main__``. Such agents start as
``python -m course.forked_workers_agent``: torchrun's own ``main`` after importing
``torch._dynamo``, which every worker that builds an optimizer would import again (2.8 s of CPU
per worker and attempt on 2 cores). The agent, the rendezvous, restarts, the environment the
workers see and their logs are the same; what the worker does not do is import torch itself.
Scenarios that restart workers many times use it; the plain path stays tested
(tests/test_torchrun.py, the phase 1 trainer).

How agents start: forked from the fork server :mod:`course.world` starts its ranks from (it has
imported torch and torch._dynamo), not as fresh interpreters: a fresh agent imports torch and
torchrun's modules again (3.5-6.5 s of CPU on 2 cores per agent, several per scenario), and a
scenario's agents are torchrun's own ``main`` either way (:func:`_agent_main`: the same argv, a
session of its own, stdin from /dev/null, stdout and stderr into its log, the scenario's
environment and working directory). ``fresh_agents=True`` starts ``python -m
torch.distributed.run`` (or ``course.forked_workers_agent``) instead; the phase 1 trainer's test
runs the ``torchrun`` command itself, as the README gives it.

No orphans: each agent starts in its own session, but torchrun starts each worker in a session of
its own too (``start_new_session=True`` in
torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py), so killing
the agent's process group is not enough. While the scenario runs, every descendant of every agent
is found through /proc and remembered (with its start time, so a reused pid is never killed); on
the way out, whatever is left of them is killed. Processes that had to be killed after their
agents ended are reported as ``orphans``.

GPUs: scenarios with forked workers or with several agents run on the CPU (``CUDA_VISIBLE_DEVICES``
is emptied for them). A forked worker cannot use CUDA once its parent has touched it (torch raises
"Cannot re-initialize CUDA in forked subprocess"; torchrun's agent does touch it), and agents that
stand for nodes on one host would each give their local rank 0 the same GPU, which NCCL refuses.
One agent starting fresh interpreters keeps the GPUs it sees.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
_POLL = 0.2


@dataclass(frozen=True)
class RankLog:
    """What one worker wrote, on one agent, in one restart attempt."""

    agent: int
    attempt: int
    local_rank: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class AgentRun:
    """One torchrun agent: its exit status (None: killed at the time bound) and its own output."""

    index: int
    returncode: int | None
    output: str


@dataclass
class TorchrunRun:
    """The outcome of :func:`run_torchrun`."""

    agents: list[AgentRun]
    ranks: list[RankLog]
    timed_out: bool
    elapsed: float
    pids: set[int] = field(default_factory=set)  # every process the scenario started
    orphans: list[int] = field(default_factory=list)  # alive after their agents ended

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(agent.returncode == 0 for agent in self.agents)

    def attempts(self, agent: int = 0) -> list[int]:
        return sorted({log.attempt for log in self.ranks if log.agent == agent})

    def last_attempt(self, agent: int = 0) -> list[RankLog]:
        """The workers of the agent's last restart attempt, by local rank."""
        tried = self.attempts(agent)
        if not tried:
            return []
        logs = [log for log in self.ranks if log.agent == agent and log.attempt == tried[-1]]
        return sorted(logs, key=lambda log: log.local_rank)

    def describe(self, tail: int = 3000) -> str:
        """Every agent's and worker's output, shortened: for assertion messages."""
        lines = [f"timed_out={self.timed_out}, elapsed={self.elapsed:.1f} s"]
        for agent in self.agents:
            lines.append(f"--- agent {agent.index}: exit {agent.returncode}")
            lines.append(agent.output[-tail:])
        for log in self.ranks:
            lines.append(f"--- agent {log.agent} attempt {log.attempt} local rank {log.local_rank}")
            lines.append((log.stdout + log.stderr)[-tail:])
        return "\n".join(lines)


def free_port() -> int:
    """A port the OS just had free on 127.0.0.1 (the agent binds it moments later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# ----------------------------------------------------------------------------- process tree


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) from /proc/<pid>/stat, or None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may hold spaces
    if fields[0] == "Z":
        return None  # a zombie: dead, waiting for its parent to reap it
    return int(fields[1]), int(fields[19])


def _descendants(roots: Sequence[int]) -> dict[int, int]:
    """{pid: start time} of every live descendant of ``roots``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry.name))
                starts[int(entry.name)] = stat[1]
    found: dict[int, int] = {}
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = starts[child]
                todo.append(child)
    return found


def alive(pid: int, start: int | None = None) -> bool:
    """True while ``pid`` runs (and, given ``start``, is still the same process)."""
    stat = _stat(pid)
    return stat is not None and (start is None or stat[1] == start)


def _kill_all(known: Mapping[int, int]) -> list[int]:
    """SIGKILL each known process that is still the same process; the pids it killed."""
    killed = []
    for pid, start in known.items():
        if alive(pid, start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


# ----------------------------------------------------------------------------- the runner


def module_file(module: str) -> Path:
    """The file of a project module (``"tests.workers.node_worker"`` -> its ``.py`` path)."""
    base = PROJECT_ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return path
    raise ValueError(
        f"module {module!r}: no {base.relative_to(PROJECT_ROOT)}.py or __main__.py in the "
        "project; fork_workers runs a project module's file, name one by its dotted path"
    )


def _torchrun_argv(
    module: str,
    args: Sequence[str],
    nproc_per_node: int,
    agents: int,
    nnodes: str | None,
    port: int,
    run_id: str,
    max_restarts: int,
    log_dir: Path,
    torchrun_args: Sequence[str],
    fork_workers: bool = False,
) -> list[str]:
    """torchrun's flags and the workers' program: what follows ``torchrun`` on a command line."""
    cmd: list[str] = []
    if agents == 1 and nnodes is None:
        cmd += ["--standalone"]
    else:
        cmd += [
            f"--nnodes={nnodes or agents}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            "--local-addr=127.0.0.1",
        ]
    cmd += [
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
        f"--log-dir={log_dir}",
        "--redirects=3",
        *torchrun_args,
    ]
    if fork_workers:
        cmd += ["--start-method=fork", "--run-path", str(module_file(module))]
    else:
        cmd += ["-m", module]
    return cmd + list(args)


def fresh_agent_command(argv: Sequence[str], fork_workers: bool) -> list[str]:
    """The command of an agent started as a fresh interpreter (``fresh_agents=True``)."""
    # forked workers inherit their agent's imports: that agent imports torch._dynamo first
    agent = "course.forked_workers_agent" if fork_workers else "torch.distributed.run"
    return [sys.executable, "-m", agent, *argv]


def _agent_main(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """One torchrun agent, in a process forked from the warm fork server: what ``python -m
    torch.distributed.run <argv>`` would do, started the way :func:`run_torchrun` starts it."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    sink = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["torchrun", *argv]
    from torch.distributed.run import main

    try:
        main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class _ForkedAgent:
    """The part of ``subprocess.Popen`` the runner uses, for an agent forked by the fork server
    (its exit status comes back through the server, as a world's ranks' do)."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        code: int | None = self.process.exitcode
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout or 0.0)
        return int(self.process.exitcode)


def _ready() -> None:
    """Nothing: forked once before a scenario's clock starts, so that the fork server's own
    start (it imports torch, once per process) is not counted against the scenario."""


def _warm_up() -> None:
    from course.world import warm_context

    process = warm_context().Process(target=_ready, daemon=False)
    process.start()
    process.join()


def _start_agent(
    argv: list[str], env: dict[str, str], log: Path, fresh: bool, fork_workers: bool
) -> subprocess.Popen[bytes] | _ForkedAgent:
    if fresh:
        with open(log, "wb") as sink:
            return subprocess.Popen(
                fresh_agent_command(argv, fork_workers),
                cwd=PROJECT_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    from course.world import warm_context

    process = warm_context().Process(
        target=_agent_main, args=(argv, env, str(PROJECT_ROOT), str(log)), daemon=False
    )
    process.start()
    return _ForkedAgent(process)


def _read_rank_logs(agent: int, log_dir: Path) -> list[RankLog]:
    logs = []
    for attempt_dir in sorted(log_dir.glob("*/attempt_*")):
        attempt = int(attempt_dir.name.removeprefix("attempt_"))
        for rank_dir in sorted(p for p in attempt_dir.iterdir() if p.name.isdigit()):
            out, err = rank_dir / "stdout.log", rank_dir / "stderr.log"
            logs.append(
                RankLog(
                    agent,
                    attempt,
                    int(rank_dir.name),
                    out.read_text(errors="replace") if out.exists() else "",
                    err.read_text(errors="replace") if err.exists() else "",
                )
            )
    return logs


def run_torchrun(
    module: str,
    args: Sequence[str] = (),
    *,
    nproc_per_node: int = 1,
    agents: int = 1,
    nnodes: str | None = None,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    time_limit: float = 60.0,
    torchrun_args: Sequence[str] = (),
    stagger: float = 0.0,
    fork_workers: bool = False,
    fresh_agents: bool = False,
    agent_args: Sequence[Sequence[str]] = (),
) -> TorchrunRun:
    """Run ``python -m module *args`` under ``agents`` torchrun agents on 127.0.0.1.

    ``agents=1`` uses ``--standalone``; more agents meet at a c10d rendezvous on a free port,
    ``--nnodes`` defaulting to ``agents`` (``nnodes="1:2"`` makes the run elastic; add
    ``torchrun_args=["--rdzv-conf=last_call_timeout=2,join_timeout=60"]`` to settle quickly).
    ``env`` is added to the agents' environment, which torchrun passes on to its workers (failure
    injection: ``{"DTFS_FAIL": "kill:rank=1:step=2"}``). ``stagger`` seconds pass between agent
    starts. After ``time_limit`` seconds every process of the scenario is killed and the result
    says ``timed_out``; no process outlives this call either way. ``fork_workers`` forks each
    worker from its agent instead of starting a fresh interpreter; it and ``agents > 1`` run on
    the CPU (see the module docstring). ``fresh_agents`` starts each agent as a fresh
    interpreter instead of forking it from the warm fork server. ``agent_args[i]`` is appended to
    agent ``i``'s program arguments: what one node does and another does not (``--leave-after``)
    must follow the agent, because torchrun's ranks do not (rendezvous sorts agents by process id,
    which wraps, so the agent started second can hold rank 0).
    """
    if len(agent_args) > agents:
        raise ValueError(
            f"agent_args has {len(agent_args)} entries for agents={agents}: give at most one "
            "list of arguments per agent"
        )
    if agents < 1 or nproc_per_node < 1:
        raise ValueError(
            f"agents={agents}, nproc_per_node={nproc_per_node}: both must be at least 1"
        )
    if time_limit <= 0:
        raise ValueError(f"time_limit={time_limit}: give the scenario a positive number of seconds")
    if fork_workers:
        module_file(module)  # a module that is not a project file is refused before any start
    root = Path(tempfile.mkdtemp(prefix="dtfs-torchrun-"))
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **({"CUDA_VISIBLE_DEVICES": ""} if fork_workers or agents > 1 else {}),
        **(env or {}),
    }
    if not fresh_agents:
        _warm_up()
    start = time.monotonic()
    deadline = start + time_limit
    procs: list[subprocess.Popen[bytes] | _ForkedAgent] = []
    outputs: list[Path] = []
    known: dict[int, int] = {}
    timed_out = False
    orphans: list[int] = []
    try:
        for index in range(agents):
            log_dir = root / f"agent{index}"
            log_dir.mkdir()
            own = list(agent_args[index]) if index < len(agent_args) else []
            argv = _torchrun_argv(
                module, [*args, *own], nproc_per_node, agents, nnodes, port, run_id, max_restarts,
                log_dir / "logs", torchrun_args, fork_workers,
            )  # fmt: skip
            outputs.append(log_dir / "agent.log")
            procs.append(_start_agent(argv, full_env, outputs[-1], fresh_agents, fork_workers))
            stat = _stat(procs[-1].pid)
            if stat is not None:
                known[procs[-1].pid] = stat[1]
            if stagger and index + 1 < agents:
                time.sleep(stagger)
        while any(proc.poll() is None for proc in procs):
            known.update(_descendants([proc.pid for proc in procs]))
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(_POLL)
    finally:
        known.update(_descendants([proc.pid for proc in procs]))
        killed = _kill_all(known)
        if not timed_out:
            orphans = killed
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)
        _reap(known)
    result = TorchrunRun(
        agents=[
            AgentRun(i, None if timed_out else proc.returncode, _text(outputs[i]))
            for i, proc in enumerate(procs)
        ],
        ranks=[
            log
            for i in range(len(procs))
            for log in _read_rank_logs(i, root / f"agent{i}" / "logs")
        ],
        timed_out=timed_out,
        elapsed=time.monotonic() - start,
        pids=set(known),
        orphans=orphans,
    )
    _remove(root)
    return result


def _reap(known: Mapping[int, int], wait: float = 5.0) -> None:
    """Wait until the killed processes are gone (they are not our children: poll /proc)."""
    end = time.monotonic() + wait
    while time.monotonic() < end and any(alive(pid, start) for pid, start in known.items()):
        time.sleep(0.05)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _remove(root: Path) -> None:
    import shutil

    shutil.rmtree(root, ignore_errors=True)
