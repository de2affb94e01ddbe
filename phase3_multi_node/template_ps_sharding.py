# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.7, sharding: which server holds which parameter, balanced by bytes.

Every worker pushes and pulls every parameter once per clock, so a server's traffic and its
optimizer work are proportional to the bytes it holds: the most loaded server sets the pace of
the whole system. Assigning tensors round-robin by index ignores sizes: in a model whose first
layer holds most of the bytes (an embedding table, a wide first Linear) the server that gets it
carries nearly everything.

Balancing sizes over S bins is multiprocessor scheduling (NP-hard); a simple greedy rule does
well enough (Graham, "Bounds on multiprocessing timing anomalies", 1969: within 4/3 - 1/(3S) of
the optimum). :func:`lpt_bound` states a guarantee that needs no optimum: at most total/S plus
(1 - 1/S) times the (S+1)-th largest tensor, which the grader holds the assignment to. Li et
al.'s parameter server (OSDI 2014) shards by key ranges with consistent hashing, for
elasticity; here the parameter set is fixed, so a balanced static assignment is enough.

Keys are positions in ``list(model.parameters())``; an assignment is a list, ``assignment[key]``
is the server holding that key. Every worker and server computes it from the same sizes, so it
is never sent over the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def tensor_bytes(model: nn.Module) -> list[int]:
    """Bytes of each parameter, in ``model.parameters()`` order (the keys)."""
    return [p.numel() * p.element_size() for p in model.parameters()]


def check_sizes(sizes: Sequence[int], num_servers: int) -> None:
    if num_servers < 1:
        raise ValueError(f"num_servers={num_servers}: need at least one server")
    if any(size < 0 for size in sizes):
        raise ValueError(f"sizes {list(sizes)} contain a negative number of bytes")


def round_robin_assignment(sizes: Sequence[int], num_servers: int) -> list[int]:
    """Key k on server k mod S: the baseline that ignores sizes."""
    check_sizes(sizes, num_servers)
    return [key % num_servers for key in range(len(sizes))]


def balanced_assignment(sizes: Sequence[int], num_servers: int) -> list[int]:
    """``assignment[key]`` = the server for each key, balancing bytes per server.

    Deterministic: every process computes the same assignment from the same sizes.
    """
    check_sizes(sizes, num_servers)
    # TODO 3.7: spread the keys over the servers so the largest load is near total / S.
    # Invariant: every key gets exactly one server in 0..S-1; the same sizes always give the same
    #   assignment; the largest load is within lpt_bound of the sizes and S.
    # Hint 1: a big tensor placed late may find no server light enough to take it.
    # More hints: uv run python -m tests.hint 3.7
    # See guidelines.md#37-parameter-server
    raise NotImplementedError(
        "TODO 3.7: spread the keys over the servers so the largest load is near total / S "
        "(see phase3_multi_node/guidelines.md#37-parameter-server)"
    )


def server_loads(sizes: Sequence[int], assignment: Sequence[int], num_servers: int) -> list[int]:
    """Bytes each server holds under ``assignment``."""
    loads = [0] * num_servers
    for key, server in enumerate(assignment):
        loads[server] += sizes[key]
    return loads


def lpt_bound(sizes: Sequence[int], num_servers: int) -> float:
    """The most bytes a balanced server may hold: total/S + (1 - 1/S) * p, p the (S+1)-th
    largest size, or the largest size if that is more (Graham, 1969). Round-robin has no such
    bound."""
    if not sizes:
        return 0.0
    ordered = sorted(sizes, reverse=True)
    after = ordered[num_servers] if len(ordered) > num_servers else 0
    return max(ordered[0], sum(sizes) / num_servers + (1 - 1 / num_servers) * after)


def keys_of(assignment: Sequence[int], server: int) -> list[int]:
    """The keys ``server`` holds, in key order."""
    return [key for key, owner in enumerate(assignment) if owner == server]


def unequal_model() -> nn.Module:
    """A model with very unequal layer sizes (a wide first layer, tiny later ones).

    Round-robin puts the two big tensors on the same server when S = 2; a balanced assignment
    does not.
    """
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 512),  # 131072 weights + 512
        nn.ReLU(),
        nn.Linear(512, 16),  # 8192 + 16
        nn.ReLU(),
        nn.Linear(16, 300),  # 4800 + 300
        nn.ReLU(),
        nn.Linear(300, 256),  # 76800 + 256
    )
