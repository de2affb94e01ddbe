"""The library way for sharded state: ``torch.distributed.checkpoint`` (DCP) with FSDP2.

When parameters and optimizer state are sharded (ZeRO-3, FSDP2 ``fully_shard``), no rank holds
the whole model, and gathering it onto rank 0 to ``torch.save`` it costs the memory sharding
saved. DCP instead has every rank write its own shards in parallel, plus a ``.metadata`` file
that records which slice of which tensor lives where (torch/distributed/checkpoint/
state_dict_saver.py, filesystem.py; the metadata is written last, after a rename, like the
manifest of exercise 4.1). On load, each rank reads exactly the slices its *current* sharding
needs, from whichever files hold them: a checkpoint saved by 2 ranks loads on 1 or 4
(resharding), with no conversion step.

``dcp.async_save`` returns once the state is staged (copied to CPU memory); the writing happens
in a background thread while training goes on (torch/distributed/checkpoint/state_dict_saver.py,
``async_save``). The caller must ``.result()`` the previous future before the next save.

``get_model_state_dict``/``get_optimizer_state_dict`` (torch/distributed/checkpoint/state_dict.py)
give state dicts keyed by parameter name (not optimizer index), with DTensor shards as values.

**A DCP folder is code-trusted input.** ``dcp.load`` unpickles the folder's ``.metadata`` with the
full pickle module (torch/distributed/checkpoint/filesystem.py, ``read_metadata``): loading a
crafted folder runs its code, ``weights_only`` or not. :func:`save` therefore writes 4.1's
``manifest.json`` (every file's size and sha256) once the shards are written, and :func:`load`
checks the folder against it *before* ``dcp.load``: a changed, truncated, missing or unlisted
file is refused (:class:`CheckpointRejected`) and nothing is unpickled. That stops damage and a
tamperer who did not also rewrite the manifest; ``manifest_sha256=`` (the digest :func:`save`
returns) pins the manifest itself, for a folder that passed through hands you do not trust.
Not an exercise: graded as the reference beside 4.1 (tests/phase4/grade_4_1_checkpoint.py).
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from phase4_production.checkpoint_files import (
    MANIFEST,
    ManifestError,
    manifest_digest,
    read_manifest,
    unlisted_files,
)
from solutions.phase4_production.checkpoint import verify_checkpoint, write_manifest


class CheckpointRejected(ValueError):
    """A DCP folder that does not match its manifest: refused before ``dcp.load`` unpickles it."""


def build_sharded(
    seed: int = 0, widths: tuple[int, ...] = (16, 32, 32, 8)
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP sharded with FSDP2 over every rank (a CPU mesh under gloo), and its AdamW."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    model = nn.Sequential(*layers[:-1]).to(device)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` AdamW steps on a fixed batch that every rank shares (so any world size takes
    the same step: the averaged gradient of identical batches is the batch's gradient)."""
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, first.in_features, generator=g).to(first.weight.device)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }


def save(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: str, use_async: bool = False
) -> str:
    """Every rank writes its shards to ``path``; ``use_async`` goes through ``async_save``.

    Then rank 0 writes ``manifest.json`` over every file of the folder (step 0: a DCP folder is
    not one of 4.1's step folders). Returns the manifest's sha256, on every rank: keep it to pin
    the folder (:func:`load`'s ``manifest_sha256``).
    """
    if use_async:
        save_async(model, optimizer, path).result()
    else:
        dcp.save(state(model, optimizer), checkpoint_id=path)
    return write_folder_manifest(path)


def write_folder_manifest(path: str) -> str:
    """Collective: rank 0 lists every file DCP wrote in ``path`` in a manifest; its digest."""
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        folder = Path(path)
        names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
        write_manifest(folder, 0, names)
    dist.barrier()
    return manifest_digest(Path(path))


def check_folder(path: str, manifest_sha256: str | None = None) -> None:
    """Raise :class:`CheckpointRejected` unless ``path`` is exactly what its manifest lists (and
    the manifest is the pinned one, when ``manifest_sha256`` is given). Reads no pickle."""
    folder = Path(path)
    reason = verify_checkpoint(folder)
    if reason is None:
        try:
            extra = unlisted_files(folder, read_manifest(folder))
        except ManifestError as err:
            extra, reason = [], str(err)
        if extra:
            reason = f"{extra[0]} is not in the manifest"
    if (
        reason is None
        and manifest_sha256 is not None
        and manifest_digest(folder) != manifest_sha256
    ):
        reason = f"{MANIFEST} is not the pinned one (its sha256 differs)"
    if reason is not None:
        raise CheckpointRejected(
            f"refusing to dcp.load {path}: {reason}. dcp.load unpickles the folder's .metadata "
            "(it can run code): load only folders that match the manifest written with them"
        )


_WRITER_GROUP: list[dist.ProcessGroup] = []


def writer_group() -> dist.ProcessGroup:
    """A gloo group for the background writes (collective: every rank calls it, the first time).

    The writer thread runs DCP's planning collectives while training runs its own; on one group
    the two streams of collectives would interleave differently on different ranks and deadlock.
    """
    if not _WRITER_GROUP:
        group = dist.new_group(backend="gloo")
        assert isinstance(group, dist.ProcessGroup)
        _WRITER_GROUP.append(group)
    return _WRITER_GROUP[0]


def save_async(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> Future[Any]:
    """Stage the shards and return at once; the future completes when the files are written."""
    future = dcp.async_save(
        state(model, optimizer), checkpoint_id=path, process_group=writer_group()
    )
    return future  # type: ignore[return-value]


def load(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str,
    *,
    verify: bool = True,
    manifest_sha256: str | None = None,
) -> None:
    """Read the slices this world's sharding needs, whatever world size saved them.

    ``verify`` (the default) checks the folder against its manifest first (:func:`check_folder`);
    turn it off only for a folder you wrote yourself without one.
    """
    if verify:
        check_folder(path, manifest_sha256)
    loaded = state(model, optimizer)
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(model, loaded["model"])
    set_optimizer_state_dict(model, optimizer, loaded["optim"])


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (collective), as plain CPU tensors."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().cpu().clone()
    return out
