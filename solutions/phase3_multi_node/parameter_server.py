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
from solutions.phase3_multi_node.ps_protocol import check_header


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
        # Hint 2: How many clocks have been applied when clock k has? Which clock must be applied
        #   before clock c may be computed, with staleness s? What staleness does each mode allow?
        #   Does your comparison serve clock 0 at once when s is 0?
        # Hint 3: "Clock k applied" is "more than k clocks applied": self.clock greater than k, that
        #   is at least k + 1.
        # Hint 4: The staleness: the configured one in ssp, 0 in sync (the launcher passes one in
        #   every mode). With 3 clocks applied and s = 2, clock 5 is served (it lacks clocks 3 and
        #   4) and clock 6 is not; in sync clock 3 is served and clock 4 is not.
        # Hint 5: async: yes. Otherwise serve when self.clock is at least the clock asked for minus
        #   s, s the ssp staleness or 0 in sync.
        # See guidelines.md#37-parameter-server
        # >>> solution
        if self.config.mode == "async":
            return True
        # sync ignores the staleness setting (the launcher passes one in every mode)
        staleness = self.config.staleness if self.config.mode == "ssp" else 0
        # clock c - s - 1 applied <=> more than c - s - 1 clocks applied <=> clock >= c - s
        return self.clock >= clock - staleness
        # <<< solution

    def apply_push(self, worker: int, key: int, grad: torch.Tensor, clock: int) -> None:
        """A gradient of ``key`` from ``worker``'s ``clock`` arrived whole and checked."""
        # TODO 3.7: apply a push now (async) or keep it for its clock (sync, ssp).
        # Invariant: async moves this key at once, one optimizer step on it alone, so that a round
        #   of W pushes of one gradient moves it as far as one sync step would. sync and ssp change
        #   no parameter here: the gradient waits in self.pending until its clock is applied, and a
        #   push for a clock already applied is refused with a ProtocolError naming both clocks.
        # Hint 1: self.step_with moves only the keys of the dict it is given; self.pending is nested
        #   three deep, and its inner dicts do not exist until a first push creates them.
        # Hint 2: In async, what does one sync step apply, and what must each of W pushes apply so
        #   that W of them make one such step? In sync and ssp, which clocks are applied already (in
        #   terms of self.clock), and where does a gradient for an open one wait?
        # Hint 3: async: one step_with of a one-key dict holding the gradient divided by the number
        #   of workers W (config.num_workers), and return.
        # Hint 4: A clock is applied already when it is below self.clock: such a push is a
        #   ProtocolError (a worker dropped from a re-formed clock pushes late).
        # Hint 5: Otherwise store the gradient under its clock, its worker and its key in
        #   self.pending, creating each inner dict when missing (setdefault).
        # See guidelines.md#37-parameter-server
        # >>> solution
        if self.config.mode == "async":
            self.step_with({key: grad / self.config.num_workers})
            return
        if clock < self.clock:
            raise ProtocolError(
                f"worker {worker} pushed for clock {clock}, but the server already applied "
                f"clocks up to {self.clock - 1}: a stale push (dropped from a re-formed clock?)"
            )
        self.pending.setdefault(clock, {}).setdefault(worker, {})[key] = grad
        # <<< solution

    def finish_clock(self, worker: int, clock: int) -> None:
        """``worker`` completed ``clock`` (self.completed is already updated), or a member left
        (BYE, or died in ssp) while clock ``clock`` was open."""
        # TODO 3.7: apply every open clock that is complete, oldest first, each exactly once.
        # Invariant: clocks are applied in order, each exactly once, as soon as every worker the
        #   clock waits for completed it, with the gradients of every worker that completed it (a
        #   member that said BYE after pushing counts). async does nothing here.
        # Hint 1: the oldest open clock is self.clock; the base keeps who an open clock waits for,
        #   and how many clocks each worker completed.
        # Hint 2: Whom does a clock wait for once a worker has died or left: all W workers, or whom?
        #   When one clock is applied, may the next one be complete already? Which given helper
        #   lists the workers that completed the oldest open clock?
        # Hint 3: The clock waits for self.members (the given code drops a dead or departed worker
        #   from it), never for all W: a dead worker's clock count never moves.
        # Hint 4: In ssp a later clock may be complete when an older one is applied (the fast
        #   workers ran ahead): repeat, not once, while something is pending and every member's
        #   completed count is above self.clock.
        # Hint 5: Unless async: while pending is not empty and every member has completed more than
        #   self.clock clocks, call close_clock with clock_pushers's list.
        # See guidelines.md#37-parameter-server
        # >>> solution
        if self.config.mode == "async":
            return
        while self.pending and all(self.completed[m] > self.clock for m in self.members):
            self.close_clock(self.clock_pushers())
        # <<< solution

    def close_clock(self, pushers: Sequence[int]) -> None:
        """Apply the average of ``pushers``' gradients for the oldest open clock as one step."""
        # TODO 3.7: average the gradients of `pushers` for the oldest open clock, step once.
        # Invariant: one optimizer step per clock, with the average over `pushers` only, summed in
        #   worker order so that every run gives the same bits; afterwards self.clock is one more
        #   and that clock is gone from self.pending, also when nobody pushed (then no step is
        #   taken).
        # Hint 1: exercise 1.2's gradient averaging, done by the server: per key, a sum in a fixed
        #   order, divided once.
        # Hint 2: Where are the oldest open clock's gradients, and must they stay there? What
        #   divides the sum when the clock was re-formed without a dead worker: W, or what? May you
        #   add into a gradient that self.pending stored? What happens to self.clock when nobody
        #   pushed?
        # Hint 3: The gradients: pop self.clock's entry from self.pending (an empty dict when it is
        #   absent), so that the clock leaves pending.
        # Hint 4: The divisor: the number of pushers, not W: a clock re-formed with 2 survivors of 3
        #   workers averages 2 gradients.
        # Hint 5: If anyone pushed: per key, a clone of the first pusher's gradient with the others
        #   added in pusher order, divided by their number; one step_with of the whole dict. In
        #   every case, self.clock goes up by one.
        # See guidelines.md#37-parameter-server
        # >>> solution
        grads = self.pending.pop(self.clock, {})
        if pushers:
            averaged = {}
            for key in self.params:
                total = grads[pushers[0]][key].clone()  # clone: never add into a stored grad
                for worker in pushers[1:]:
                    total += grads[worker][key]
                averaged[key] = total / len(pushers)
            self.step_with(averaged)
        self.clock += 1
        # <<< solution


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
        # Hint 2: If server 0 holds its answer until a clock is applied, what does waiting for it
        #   before asking server 1 cost? What does each answer frame carry, and where does its
        #   tensor go? Which frames are allowed back, and must autograd record the copy?
        # Hint 3: Two passes over the servers: first send each its PULL (encode_control with
        #   MsgType.PULL, this worker and the clock); then read each one's answer.
        # Hint 4: Per server, self.receive gives (header, payload) until an END; anything but a
        #   PARAM of one of that server's keys is a ProtocolError; payload_tensor of the two is
        #   copied in place (copy_) into the key's parameter under torch.no_grad.
        # Hint 5: Send every server its PULL first, then, server by server, copy each PARAM into its
        #   key's parameter until END, refusing any other frame.
        # See guidelines.md#37-parameter-server
        # >>> solution
        for server in range(len(self.keys)):
            self.send(server, encode_control(MsgType.PULL, worker=self.worker_id, clock=clock))
        for server, keys in enumerate(self.keys):
            while True:
                header, payload = self.receive(server)
                if header.type == MsgType.END:
                    break
                if header.type != MsgType.PARAM or header.key not in keys:
                    raise ProtocolError(
                        f"server {server} sent type {header.type} for key {header.key}"
                    )
                with torch.no_grad():
                    self.params[header.key].copy_(payload_tensor(header, payload))
        # <<< solution

    def push(self, clock: int) -> None:
        """Send every gradient to the server holding it, then close the clock there."""
        # TODO 3.7: push this clock's gradients to their servers and close the clock.
        # Invariant: each server gets exactly one PUSH per key it holds, stamped with this clock and
        #   this worker, then one CLOCK frame for the same clock.
        # Hint 1: the server refuses a frame stamped with a clock it does not expect, and a CLOCK
        #   frame before every one of its keys was pushed.
        # Hint 2: Which keys does each server hold (self.keys)? What must each PUSH frame carry for
        #   the server to accept it? What closes the clock on a server, and when may it be sent? How
        #   many sends does one server need?
        # Hint 3: A PUSH frame: encode_tensor with MsgType.PUSH, the key's gradient (self.gradient
        #   says clearly when backward did not reach one), the key, this worker and this clock.
        # Hint 4: The CLOCK frame comes after all of that server's PUSH frames, stamped with the
        #   same worker and clock; the frames can be joined into one send.
        # Hint 5: Per server: one PUSH per key it holds, then its CLOCK, all stamped with this
        #   worker and this clock, joined into one send.
        # See guidelines.md#37-parameter-server
        # >>> solution
        for server, keys in enumerate(self.keys):
            frames = [
                encode_tensor(
                    MsgType.PUSH, self.gradient(key), key=key, worker=self.worker_id, clock=clock
                )
                for key in keys
            ]
            frames.append(encode_control(MsgType.CLOCK, worker=self.worker_id, clock=clock))
            self.send(server, b"".join(frames))
        # <<< solution


if __name__ == "__main__":
    from course.cli import run_main
    from phase3_multi_node.ps_launcher import main

    run_main(main)
