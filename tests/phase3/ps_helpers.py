"""Shared pieces of exercise 3.7's grader (tests/phase3/grade_3_7_parameter_server.py).

Runs of the parameter server go through :func:`run_job`: servers and workers are processes of the
launcher (phase3_multi_node/ps_launcher.py) built from the implementation chosen by
``--impl``; every process is checked gone afterwards. A child that stopped at an unwritten TODO is
reported as that TODO (the scoreboard's "not written yet"), any other failure as one short
teacher's remark that includes the servers' logged reasons for closing connections.

The in-process helpers (:func:`local_server`, :func:`raw_client`) drive one ParameterServer on
127.0.0.1 from the test process itself, for the byte-level checks of malformed input. The frame
format and the server's machinery are given (phase3_multi_node/ps_wire.py, ps_server_base.py);
only the exercise modules come from ``--impl``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest
import torch
from grading import impl, load
from torch import nn

from course.world import Frame, RankFailed
from phase3_multi_node import ps_wire
from phase3_multi_node.ps_launcher import ClusterError, Job, RunResult, train
from phase3_multi_node.ps_server_base import ServerConfig

PHASE = "phase3_multi_node"
TOLERANCE = 1e-12
TIME_LIMIT = 40.0  # seconds one run may take (2 cores, other tests beside)


def ps_module() -> ModuleType:
    return load(PHASE, "parameter_server")


def protocol_module() -> ModuleType:
    return load(PHASE, "ps_protocol")


def sharding_module() -> ModuleType:
    return load(PHASE, "ps_sharding")


def fail(message: str) -> NoReturn:
    """A teacher's remark, without the grader's traceback."""
    pytest.fail(message, pytrace=False)


# ----------------------------------------------------------------------------- models and data


def double_mlp() -> nn.Module:
    """Small float64 MLP: 4 parameters of different sizes (sync must match DP to 1e-12)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 5)).double()


def double_batch(worker: int, num_workers: int, clock: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s batch at ``clock``: a different fixed batch per (worker, clock)."""
    g = torch.Generator().manual_seed(1000 * clock + worker)
    return torch.randn(8, 10, generator=g, dtype=torch.float64), torch.randint(5, (8,), generator=g)


def data_parallel_sgd(workers: int, steps: int, lr: float, momentum: float) -> list[torch.Tensor]:
    """The reference: one process, gradients averaged over the W workers' batches in worker
    order, one SGD step per clock (exercise 1.2's data parallel step)."""
    return replay_sync([list(range(workers))] * steps, workers, lr, momentum)


def replay_sync(
    pushers: list[list[int]], workers: int, lr: float, momentum: float = 0.0
) -> list[torch.Tensor]:
    """Data-parallel SGD where clock c averages the gradients of the workers ``pushers[c]``."""
    model = double_mlp()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
    for clock, members in enumerate(pushers):
        grads = []
        for worker in members:
            model.zero_grad()
            inputs, targets = double_batch(worker, workers, clock)
            nn.functional.cross_entropy(model(inputs), targets).backward()
            grads.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        for i, param in enumerate(params):
            total = grads[0][i].clone()
            for other in grads[1:]:
                total += other[i]
            param.grad = total / len(members)
        optimizer.step()
    return [p.detach().clone() for p in params]


# ----------------------------------------------------------------------------- runs


def make_job(
    *,
    mode: str,
    servers: int = 2,
    workers: int = 3,
    steps: int = 5,
    staleness: int = 0,
    lr: float = 0.1,
    momentum: float = 0.0,
    model_fn: Any = double_mlp,
    batch_fn: Any = double_batch,
    **extra: Any,
) -> Job:
    server_options = {
        key: extra.pop(key)
        for key in ("sync_timeout", "pull_timeout", "read_timeout", "handshake_timeout")
        if key in extra
    }
    config = ServerConfig(
        mode=mode,
        staleness=staleness,
        num_workers=workers,
        lr=lr,
        momentum=momentum,
        pull_timeout=server_options.pop("pull_timeout", 10.0),
        start_timeout=20.0,
        **server_options,
    )
    return Job(
        model_fn=model_fn,
        batch_fn=batch_fn,
        server_config=config,
        num_servers=servers,
        steps=steps,
        impl=impl(),
        worker_timeout=20.0,
        **extra,
    )


def pattern_batches(batch_size: int = 32, samples: int = 2048) -> Any:
    from phase3_multi_node.ps_launcher import pattern_batch

    return functools.partial(pattern_batch, batch_size=batch_size, samples=samples)


def run_job(job: Job, what: str, *, restart_killed: bool = False) -> RunResult:
    """Run ``job``; a TODO fails as that TODO, anything else as one remark; all processes gone."""
    try:
        result = train(
            job, time_limit=TIME_LIMIT, restart_killed=restart_killed, on_servers=lambda _: None
        )
    except ClusterError as err:
        error = err
    else:
        assert_all_gone(result.pids, what)
        return result
    failure = error.failure  # handled outside the except block: no chained traceback shown
    if failure is not None and failure.exc_type == "NotImplementedError":
        path, _, rest = failure.where.partition(":")
        line, _, function = rest.partition(" in ")
        frames = [Frame(path, int(line), function)] if line.isdigit() else []
        raise RankFailed(failure.index, failure.exc_type, failure.message, frames)
    fail(f"3.7 {what}: {error}")


def assert_all_gone(pids: list[int], what: str) -> None:
    alive = [pid for pid in pids if _alive(pid)]
    if alive:
        fail(f"3.7 {what}: processes {alive} outlived the run (the launcher must reap them all)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    return False


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------- in-process server


def shard_params() -> dict[int, torch.Tensor]:
    model = double_mlp()
    return {key: p.detach().clone() for key, p in enumerate(model.parameters())}


@contextlib.contextmanager
def local_server(**options: Any) -> Iterator[Any]:
    """One ParameterServer of the implementation under test holding every key of double_mlp,
    on 127.0.0.1 in this process (threads), stopped at the end."""
    ps = ps_module()
    defaults: dict[str, Any] = {
        "mode": "async",
        "num_workers": 1,
        "read_timeout": 1.0,
        "pull_timeout": 5.0,
        "start_timeout": 5.0,
    }
    server = ps.ParameterServer(0, shard_params(), ServerConfig(**{**defaults, **options}))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def raw_client(server: Any) -> socket.socket:
    sock = socket.create_connection(server.address, timeout=5.0)
    return sock


def trusting_check(header: ps_wire.Header, max_payload: int) -> None:
    """The test client's own header check when it reads the server under test: bounded, and
    independent of the learner's ``check_header`` (which the server itself uses)."""
    if header.magic != ps_wire.MAGIC or header.length > max(max_payload, 1 << 20):
        raise ps_wire.ProtocolError(f"unexpected frame from the server: {header}")


def read_answer(sock: socket.socket, timeout: float = 5.0) -> tuple[ps_wire.Header, bytes]:
    """One frame the server sent to a raw test client."""
    return ps_wire.read_frame(sock, 1 << 20, trusting_check, ps_wire.deadline_in(timeout))


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True when the server closed ``sock`` (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def raise_internal_errors(server: Any) -> None:
    """An exception inside the server's exercise code: a TODO shows as that TODO."""
    for exc_type, message, _where in server.get_report().errors:
        if exc_type == "NotImplementedError":
            raise NotImplementedError(message)
        fail(f"3.7: the server raised {exc_type}: {message}")
