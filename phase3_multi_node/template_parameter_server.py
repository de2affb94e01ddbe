# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.7: a parameter server (Li et al., "Scaling Distributed Machine Learning with the
Parameter Server", OSDI 2014) with synchronous, asynchronous and bounded-staleness training.

Servers hold the parameters, each a shard of them (ps_sharding.py); workers hold data. One
*clock* of a worker is: pull every parameter from every server, compute a gradient on its own
batch, push the gradient back, then tell each server "clock c done". What a server does with the
pushes, and when it lets a worker pull, is the consistency model:

* ``sync``: the server keeps the W gradients of clock c and applies their average once, in
  worker order, as one optimizer step; nobody computes clock c+1 before that. This is
  data-parallel SGD (exercise 1.2) with a server in the middle, so it equals it to rounding.
* ``async``: every push moves the parameters at once (a round of W pushes moves them as far as
  one sync step); pulls are never held. Hogwild-style (Recht et al.,
  2011): no waiting, but gradients are computed on parameters other workers have since moved.
* ``ssp`` with staleness s (Ho et al., "More Effective Distributed ML via a Stale Synchronous
  Parallel Parameter Server", NIPS 2013): clocks are applied as in sync, one averaged step per
  clock in clock order, but the fastest worker may run up to s clocks ahead of the slowest on
  parameters that lack the slowest's latest clocks. s = 0 is sync, exactly. Ho et al.'s server
  may also show a reader updates newer than the bound (its own, say); this one shows exactly
  the applied clocks, so runs are reproducible and s = 0 equals sync.

Given (phase3_multi_node/ps_server_base.py, ps_worker_base.py, ps_wire.py): sockets, threads,
deadlines, authentication, the framing, the checks every frame passes before it reaches the
methods below, the bookkeeping of worker clocks, and the sync watchdog that re-forms a clock
whose missing workers died. Yours: when a pull may be served, what a push does, applying a
clock, and a worker's pull and push.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from phase3_multi_node.ps_server_base import ServerBase, ServerConfig
from phase3_multi_node.ps_wire import (
    MsgType,
    ProtocolError,
    encode_control,
    encode_tensor,
    payload_tensor,
)
from phase3_multi_node.ps_worker_base import WorkerBase
from phase3_multi_node.template_ps_protocol import check_header


class ParameterServer(ServerBase):
    """Serves one shard of the parameters over TCP and applies the workers' gradients.

    The given base runs the connections and calls the four methods below with ``self.lock``
    held, once the frame that triggers them passed every check. The state they share:

    * ``self.config``: ``mode``, ``staleness``, ``num_workers`` (W) of the ServerConfig;
    * ``self.params``: key -> parameter of this shard; ``self.step_with(grads)`` takes one
      optimizer step moving only the keys of the dict ``grads`` (key -> gradient);
    * ``self.clock``: how many clocks were applied so far (sync, ssp); clocks are 0, 1, 2, ...;
    * ``self.completed[w]``: how many clocks worker w completed on this server;
    * ``self.members``: the workers an open clock waits for (sync, ssp; the given code drops a
      worker that left or died);
    * ``self.pending``: clock -> worker -> key -> gradient, for every clock not yet applied;
    * ``self.clock_pushers()``: the workers that completed the oldest open clock, in order.
    """

    def __init__(
        self, server_id: int, params: dict[int, torch.Tensor], config: ServerConfig
    ) -> None:
        super().__init__(server_id, params, config, check_header)

    def ready_to_serve(self, worker: int, clock: int) -> bool:
        """May ``worker``, about to compute ``clock``, pull the parameters now?"""
        # TODO 3.7: decide when a pull for `clock` may be served, per mode.
        # Invariant: async serves every pull at once. Otherwise a worker about to compute clock c
        #   must see every clock up to c - s - 1 applied, s the staleness in ssp; sync allows no
        #   staleness, whatever the setting says; so ssp with s = 0 is sync.
        # Hint 1: clocks are applied in order and self.clock counts them.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: decide when a pull for `clock` may be served, per mode "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )

    def apply_push(self, worker: int, key: int, grad: torch.Tensor, clock: int) -> None:
        """A gradient of ``key`` from ``worker``'s ``clock`` arrived whole and checked."""
        # TODO 3.7: apply a push now (async) or keep it for its clock (sync, ssp).
        # Invariant: async moves this key at once, one optimizer step on it alone, so that a round
        #   of W pushes of one gradient moves it as far as one sync step would. sync and ssp change
        #   no parameter here: the gradient waits in self.pending until its clock is applied, and a
        #   push for a clock already applied is refused with a ProtocolError naming both clocks.
        # Hint 1: self.step_with moves only the keys of the dict it is given; self.pending is nested
        #   three deep, and its inner dicts do not exist until a first push creates them.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: apply a push now (async) or keep it for its clock (sync, ssp) "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )

    def finish_clock(self, worker: int, clock: int) -> None:
        """``worker`` completed ``clock`` (self.completed is already updated), or a member left
        (BYE, or died in ssp) while clock ``clock`` was open."""
        # TODO 3.7: apply every open clock that is complete, oldest first, each exactly once.
        # Invariant: clocks are applied in order, each exactly once, as soon as every worker the
        #   clock waits for completed it, with the gradients of every worker that completed it (a
        #   member that said BYE after pushing counts). async does nothing here.
        # Hint 1: the oldest open clock is self.clock; the base keeps who an open clock waits for,
        #   and how many clocks each worker completed.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: apply every open clock that is complete, oldest first, each exactly once "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )

    def close_clock(self, pushers: Sequence[int]) -> None:
        """Apply the average of ``pushers``' gradients for the oldest open clock as one step."""
        # TODO 3.7: average the gradients of `pushers` for the oldest open clock, step once.
        # Invariant: one optimizer step per clock, with the average over `pushers` only, summed in
        #   worker order so that every run gives the same bits; afterwards self.clock is one more
        #   and that clock is gone from self.pending, also when nobody pushed (then no step is
        #   taken).
        # Hint 1: exercise 1.2's gradient averaging, done by the server: per key, a sum in a fixed
        #   order, divided once.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: average the gradients of `pushers` for the oldest open clock, step once "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )


class Worker(WorkerBase):
    """Pulls the parameters, computes a gradient on its own data, pushes it: once per clock.

    ``addresses[s]`` is server s's (host, port); ``assignment[key]`` the server holding each
    parameter (ps_sharding.py). ``connect()`` returns the clock to start at (0, or the current
    clock for a restarted worker); then for each clock: ``pull``, ``compute``, ``push``. The
    given base provides ``self.worker_id``, ``self.params`` (by key), ``self.keys[s]`` (the
    keys server s holds), ``self.send``, ``self.receive`` and ``self.gradient``.
    """

    def __init__(
        self,
        worker_id: int,
        model: nn.Module,
        addresses: Sequence[tuple[str, int]],
        assignment: Sequence[int],
        *,
        secret: bytes | None = None,
        timeout: float = 60.0,
    ) -> None:
        super().__init__(
            worker_id,
            model,
            addresses,
            assignment,
            check_header=check_header,
            secret=secret,
            timeout=timeout,
        )

    def pull(self, clock: int) -> None:
        """Ask every server for its parameters for ``clock``; copy them into the model."""
        # TODO 3.7: pull the current parameters from every server into the model.
        # Invariant: afterwards every model parameter holds the bits its server sent for this clock.
        #   A server may hold its answer back (sync, ssp), so every server is asked before any
        #   answer is awaited; a frame that is neither END nor a PARAM of a key that server holds is
        #   refused with ProtocolError.
        # Hint 1: a pull is one PULL frame out, stamped with this worker and this clock, then PARAM
        #   frames back until an END frame; a frame's header names its key.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: pull the current parameters from every server into the model "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )

    def push(self, clock: int) -> None:
        """Send every gradient to the server holding it, then close the clock there."""
        # TODO 3.7: push this clock's gradients to their servers and close the clock.
        # Invariant: each server gets exactly one PUSH per key it holds, stamped with this clock and
        #   this worker, then one CLOCK frame for the same clock.
        # Hint 1: the server refuses a frame stamped with a clock it does not expect, and a CLOCK
        #   frame before every one of its keys was pushed.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: push this clock's gradients to their servers and close the clock "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )


if __name__ == "__main__":
    from course.cli import run_main
    from phase3_multi_node.ps_launcher import main

    run_main(main)
