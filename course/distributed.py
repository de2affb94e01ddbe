"""Process-group setup from torchrun's environment, and the backend/device choice.

torchrun (``torch.distributed.run``) exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT to every process it starts; ``init_process_group`` with the default
``env://`` method reads them. See torch/distributed/run.py and
https://pytorch.org/docs/stable/elastic/run.html.

Under torchrun every restart attempt joins through its own store prefix (see
:func:`_attempt_store`), so ``--max-restarts`` recovers instead of reconnecting to a dead rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from course.torchrun_env import env_int

DEFAULT_TIMEOUT_SECONDS = float(os.environ.get("DTFS_PG_TIMEOUT", "300"))
DEVICE_INDEX_ENV = "DTFS_DEVICE_INDEX"  # set by run_world when simulated nodes share one host


@dataclass(frozen=True)
class DistInfo:
    """Who this process is in the world, and where its tensors live."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_backend(local_world_size: int) -> str:
    """NCCL when CUDA is present and every local rank gets its own GPU, else gloo on CPU.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so with fewer GPUs than local
    ranks we fall back to gloo on CPU rather than fail. ROCm builds expose the same torch.cuda
    API and call their RCCL backend "nccl" too.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, the CPU under gloo."""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def device_index(local_rank: int) -> int:
    """The GPU index a rank owns: LOCAL_RANK, unless :func:`run_world` simulates several nodes on
    one host and exported ``DTFS_DEVICE_INDEX`` (the global rank) so two "nodes" never share one.
    """
    return env_int(DEVICE_INDEX_ENV, local_rank)


def world_from_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as torchrun exported them."""
    world_size = env_int("WORLD_SIZE")
    rank = env_int("RANK")
    local_rank = env_int("LOCAL_RANK", rank)
    local_world_size = env_int("LOCAL_WORLD_SIZE", world_size)
    return rank, world_size, local_rank, local_world_size


def _become_world_of_one() -> None:
    """Started with plain ``python -m`` rather than torchrun: run as a world of one process."""
    import socket

    with socket.socket() as probe:  # a free port for the rendezvous store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    print(
        "note: WORLD_SIZE is not set, so this runs as a world of one process; use torchrun "
        "(uv run torchrun --standalone --nproc_per_node=2 -m ...) for more",
        flush=True,
    )


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun, a store private to this restart attempt; None elsewhere (use ``env://``).

    torchrun's agent hosts the rendezvous TCPStore and shares it with its workers
    (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, ``TORCH_DISABLE_SHARE_RDZV_TCP_
    STORE``). After a restart the new workers meet in that same store, where the previous
    attempt's keys are still set: gloo then reads the dead rank's old address and tries to
    connect to it (on torch 2.15, 3 restarts of 3 failed so). A ``PrefixStore`` named after
    TORCHELASTIC_RESTART_COUNT gives every attempt fresh keys, so learners' scripts recover
    under ``--max-restarts`` without knowing any of this.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], env_int("MASTER_PORT"), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"attempt{attempt}", base)


def setup_distributed(
    backend: str | None = None, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
) -> DistInfo:
    """Join the process group described by torchrun's environment variables.

    Pins the CUDA device before the first collective (NCCL needs to know which GPU this rank
    owns) and keeps CPU ranks to one thread each, so N ranks on N cores do not oversubscribe.
    """
    if "WORLD_SIZE" not in os.environ:
        _become_world_of_one()
    rank, world_size, local_rank, local_world_size = world_from_env()
    backend = backend or choose_backend(local_world_size)
    device = device_for(backend, device_index(local_rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_seconds)
        store = _attempt_store(timeout)
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            store=store,
            rank=rank if store is not None else -1,
            world_size=world_size if store is not None else -1,
        )
    return DistInfo(rank, world_size, local_rank, local_world_size, backend, device)


def current_info() -> DistInfo:
    """The DistInfo of an already initialised process group (used inside test worlds)."""
    if not dist.is_initialized():
        raise RuntimeError("no process group: call setup_distributed() or run inside run_world()")
    backend = str(dist.get_backend())
    local_rank = env_int("LOCAL_RANK", dist.get_rank())
    local_world_size = env_int("LOCAL_WORLD_SIZE", dist.get_world_size())
    return DistInfo(
        dist.get_rank(),
        dist.get_world_size(),
        local_rank,
        local_world_size,
        backend,
        device_for(backend, device_index(local_rank)),
    )


@contextmanager
def distributed_session(backend: str | None = None) -> Iterator[DistInfo]:
    """``with distributed_session() as info:`` joins the group, and leaves it together.

    On success every rank meets at a barrier before tearing the group down, so no rank closes
    its connections while a peer is still sending to it (gloo can abort the process then). On
    an exception it leaves at once: a barrier would wait forever for the rank that failed.
    """
    info = setup_distributed(backend)
    try:
        yield info
        dist.barrier()
    finally:
        cleanup_distributed()


def cleanup_distributed() -> None:
    """Leave the process group if we joined one (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()
