"""Grader of exercise 3.7, the parameter server: ``uv run pytest tests/test_phase3.py -m ex3_7``.

* Sharding: the largest-first assignment within Graham's bound of the ideal bytes per server, and
  better than round-robin by tensor on a model with very unequal layer sizes.
* The protocol: ``check_header`` refuses, from the 64 header bytes alone, every field a stranger
  could set wrong (a length of 2^62 first of all).
* Training, with servers and workers as processes on 127.0.0.1 (the launcher): ``sync`` equals
  data-parallel SGD with momentum (float64, 1e-12) with one optimizer step per clock, and serves
  no pull early although the run sets a staleness of 2 (as the launcher does in every mode) and
  slows one worker; ``ssp`` with s = 0 equals it too; ``ssp`` with s = 2 and one worker 3x slower
  never serves a pull more than s clocks ahead of the slowest live worker (from the server's
  records), uses the whole bound, and applies every clock once; ``async`` moves a key by exactly
  lr/W per push of a gradient of ones, and converges on the built-in dataset.
* Faults: a worker SIGKILLed mid-clock does not stop the servers; sync re-forms the clock with the
  survivors after its timeout and says so in the log; in ssp the others go on; a restarted worker
  rejoins at the current clock with the current parameters.
* Bad input and security: random bytes, a truncated frame, a wrong dtype or shape for a key, an
  unknown key, a length header of 2^62 and a silent client each get the connection closed with a
  logged reason, and the parameters stay the same bit for bit; with a shared secret nothing but a
  correct HMAC answer is read first.

Every process a run starts is checked gone at its end. Failures lead with the server's own reason
when a server closed a worker's connection (the worker itself only sees the connection close).
The server's defences against slow and idle clients are given code, tested in
tests/test_ps_hardening.py.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time
from typing import Any

import pytest
import torch
from grading import defined_at, exercise, learner_line
from ps_helpers import (
    TOLERANCE,
    closed_by_server,
    data_parallel_sgd,
    double_mlp,
    fail,
    local_server,
    make_job,
    pattern_batches,
    protocol_module,
    ps_module,
    raise_internal_errors,
    raw_client,
    read_answer,
    replay_sync,
    run_job,
    sharding_module,
    worst,
)

from phase3_multi_node import ps_wire
from phase3_multi_node.ps_server_base import ServerConfig, check_server_config

# ----------------------------------------------------------------------------- sharding


@exercise("3.7")
@pytest.mark.parametrize("servers", [2, 3, 4])
def test_balanced_sharding(servers: int) -> None:
    sharding = sharding_module()
    rng = random.Random(servers)
    cases = {
        "a model with very unequal layer sizes": sharding.tensor_bytes(sharding.unequal_model()),
        "random sizes": [rng.choice([4, 64, 4096, 65536, 300000]) for _ in range(17)],
        "equal sizes": [1024] * 7,
    }
    for name, sizes in cases.items():
        assignment = list(sharding.balanced_assignment(sizes, servers))
        if len(assignment) != len(sizes) or any(not 0 <= s < servers for s in assignment):
            fail(
                f"3.7 balanced_assignment({name}, {servers} servers) returned {assignment}: "
                f"expected one server in 0..{servers - 1} for each of the {len(sizes)} keys"
            )
        if assignment != list(sharding.balanced_assignment(list(sizes), servers)):
            fail(
                f"3.7 balanced_assignment is not deterministic on {name}: every process must "
                "compute the same assignment from the same sizes"
            )
        loads = sharding.server_loads(sizes, assignment, servers)
        bound = sharding.lpt_bound(sizes, servers)
        if max(loads) > bound + 1e-6:
            fail(
                f"3.7 balanced_assignment on {name} with {servers} servers: bytes per server "
                f"{loads}, the largest is {max(loads)}; a balanced assignment stays within "
                f"{bound:.0f} (total/S + (1 - 1/S) x the (S+1)-th largest tensor). Place the "
                "largest tensors "
                "first, each on the least-loaded server"
            )
    sizes = cases["a model with very unequal layer sizes"]
    balanced = max(
        sharding.server_loads(sizes, sharding.balanced_assignment(sizes, servers), servers)
    )
    round_robin = max(
        sharding.server_loads(sizes, sharding.round_robin_assignment(sizes, servers), servers)
    )
    if not balanced < round_robin:
        fail(
            f"3.7 on a model with very unequal layer sizes ({sizes} bytes), {servers} servers: "
            f"the most loaded server holds {balanced} bytes, round-robin by tensor gives "
            f"{round_robin}: a balanced assignment must do better than round-robin here"
        )


# ----------------------------------------------------------------------------- protocol


def _header(**fields: Any) -> bytes:
    """A raw header with any field forged (ps_wire.HEADER's layout)."""
    values: dict[str, Any] = {
        "magic": ps_wire.MAGIC,
        "type": int(ps_wire.MsgType.PUSH),
        "dtype": 2,
        "ndim": 1,
        "reserved": 0,
        "key": 0,
        "worker": 0,
        "clock": 0,
        "dims": (4, 0, 0, 0),
        "length": 32,
    }
    values.update(fields)
    return ps_wire.HEADER.pack(
        values["magic"],
        values["type"],
        values["dtype"],
        values["ndim"],
        values["reserved"],
        values["key"],
        values["worker"],
        values["clock"],
        *values["dims"],
        values["length"],
    )


BAD_HEADERS: dict[str, dict[str, Any]] = {
    "a length header of 2^62 for a [4] float64 tensor": {"length": 2**62},
    "a length of 31 for a [4] float64 tensor (32 bytes)": {"length": 31},
    "dtype code 250": {"dtype": 250},
    "ndim 9": {"ndim": 9, "dims": (4, 0, 0, 0)},
    "a negative dimension": {"dims": (-4, 0, 0, 0), "length": 0},
    "a size in an unused dimension": {"dims": (4, 7, 0, 0)},
    "a CLOCK frame with 32 payload bytes": {"type": 7, "dtype": 0, "ndim": 0, "dims": (0, 0, 0, 0)},
    "an AUTH frame of 31 bytes": {"type": 9, "dtype": 0, "dims": (31, 0, 0, 0), "length": 31},
    "a [1024] float64 tensor over max_payload (4096 bytes)": {
        "dims": (1024, 0, 0, 0),
        "length": 8192,
    },
}


@exercise("3.7")
def test_check_header_refuses_from_the_header() -> None:
    proto = protocol_module()
    good = {
        "a PUSH of a [4] float64 tensor": _header(),
        "a PUSH of a [2, 3, 1, 2] float32 tensor": _header(
            dtype=1, ndim=4, dims=(2, 3, 1, 2), length=48
        ),
        "a CLOCK frame": _header(type=7, dtype=0, ndim=0, dims=(0, 0, 0, 0), length=0),
        "an AUTH frame of 32 bytes": _header(type=9, dtype=0, dims=(32, 0, 0, 0), length=32),
    }
    for name, raw in good.items():
        try:
            proto.check_header(ps_wire.unpack_header(raw), 4096)
        except ps_wire.ProtocolError as err:
            fail(f"3.7 check_header refused {name}, a valid frame: {err}")
    for name, fields in BAD_HEADERS.items():
        header = ps_wire.unpack_header(_header(**fields))
        problem = (
            f"3.7 check_header accepted {name}: the header must be refused before any payload "
            "is read or allocated (raise ProtocolError); a length is a number a stranger wrote"
        )
        try:
            proto.check_header(header, 4096)
        except ps_wire.ProtocolError:
            continue
        except NotImplementedError:
            raise
        except Exception as exc:
            problem = (
                f"3.7 check_header raised {type(exc).__name__} ({exc}){learner_line(exc)} on "
                f"{name}, not "
                "ProtocolError: a field a stranger wrote must be checked before it is used "
                "(an index into WIRE_DTYPES, a size), and every refusal is a ProtocolError"
            )
        fail(problem)


# ----------------------------------------------------------------------------- training


def gate_lead(mode: str, staleness: int, applied: int = 2, workers: int = 3) -> int | None:
    """How many clocks past the applied ones ``ready_to_serve`` lets a pull run ahead, asked
    directly of a server (no socket) whose ``applied`` clocks every worker completed: 0 for
    sync, s for ssp; None when it serves no pull at all, or refuses one it served a smaller
    clock (not a threshold)."""
    server = ps_module().ParameterServer(
        0, {0: torch.zeros(2)}, ServerConfig(mode=mode, staleness=staleness, num_workers=workers)
    )
    with server.lock:
        server.clock = applied
        server.completed = dict.fromkeys(range(workers), applied)
        server.live = server.members = set(range(workers))
        served = [server.ready_to_serve(0, clock) for clock in range(applied + 6)]
    lead = sum(served) - applied - 1
    if not served[0] or served != sorted(served, reverse=True):
        return None
    return lead


def gate_mistake(mode: str, staleness: int) -> str:
    """The mistake ``ready_to_serve`` makes in ``mode``, asked directly (see :func:`gate_lead`);
    "" when its answers are right."""
    try:
        lead = gate_lead(mode, staleness)
    except Exception as exc:
        return f"ready_to_serve raised {type(exc).__name__}: {exc}{learner_line(exc)}"
    said = gate_words(mode, staleness, lead)
    return said + defined_at(ps_module().ParameterServer.ready_to_serve) if said else ""


# the (mode, staleness) a run asks ready_to_serve about, in the order the tests below run: the
# staleness of 2 makes "sync honoured it" (a lead of 2) differ from an off-by-one (a lead of 1)
GATE_CASES = (("sync", 2), ("ssp", 0), ("ssp", 2))


def gate_words(mode: str, staleness: int, lead: int | None) -> str:
    """What a lead of ``lead`` clocks (None: not one threshold) says about ``ready_to_serve`` in
    ``mode`` with ``staleness`` set; "" when it is the right lead."""
    want = staleness if mode == "ssp" else 0
    if lead == want:
        return ""
    if lead is None:
        return "ready_to_serve's answers for clocks 0, 1, 2, ... are not one threshold"
    told = (
        f"with 2 clocks applied, ready_to_serve(worker, c) is True up to c = {2 + lead}, a lead "
        f"of {lead} clock(s); {mode} allows {want}"
    )
    if mode == "sync" and lead == staleness:
        return f"{told}: sync honoured the staleness setting, which only ssp may use"
    if mode == "ssp" and lead == 0 and staleness > 0:
        return f"{told}: ssp ignored its staleness setting (a lead of 0, as in sync)"
    if lead == want + 1:
        return f"{told}: the comparison is off by one"
    if lead == want - 1:
        return f"{told}: the gate is one clock too strict (off by one)"
    return told


PARAM_NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")  # double_mlp's keys 0..3


def initial_params() -> list[torch.Tensor]:
    return [p.detach().clone() for p in double_mlp().parameters()]


def params_words(
    got: list[torch.Tensor], want: list[torch.Tensor], initial: list[torch.Tensor]
) -> str:
    """What differs between the served parameters and the reference's: which keys, how many
    elements, the largest difference and where, and how the change from the initial
    parameters compares with the expected change (a best-fit ratio, and the ratio key by key).
    It names no cause: one wrong clock, a sum for an average or a push applied twice all move
    the parameters, and these numbers alone do not tell which function did it."""
    parts = []
    for key, (mine, ref, start) in enumerate(zip(got, want, initial, strict=True)):
        diff = (mine - ref).abs()
        wrong = int((diff > TOLERANCE).sum())
        if not wrong:
            continue
        at = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        moved, expected_move = (mine - start).flatten(), (ref - start).flatten()
        ratio = float(moved @ expected_move) / max(float(expected_move @ expected_move), 1e-300)
        name = PARAM_NAMES[key] if key < len(PARAM_NAMES) else str(key)
        parts.append(
            f"key {key} ({name}, shape {tuple(ref.shape)}): {wrong} of {ref.numel()} elements "
            f"differ, the largest by {float(diff.max()):.3g} at {at} (got "
            f"{float(mine[at]):.6g}, expected {float(ref[at]):.6g}); its change from the "
            f"initial value is {ratio:.4g} times the expected change"
        )
    moved = torch.cat([(m - s).flatten() for m, s in zip(got, initial, strict=True)])
    expected_move = torch.cat([(r - s).flatten() for r, s in zip(want, initial, strict=True)])
    ratio = float(moved @ expected_move) / max(float(expected_move @ expected_move), 1e-300)
    still = " (the parameters never moved)" if not bool(moved.any()) else ""
    return (
        f"{len(parts)} of {len(want)} keys differ (allowed {TOLERANCE:g}); over all keys the "
        f"change is {ratio:.4g} times the expected one{still}. " + "; ".join(parts)
    )


@exercise("3.7")
def test_sync_equals_data_parallel_sgd() -> None:
    # staleness=2 as the launcher passes it in every mode (sync must ignore it); worker 1 is
    # slowed so that a gate letting the others run ahead would show in the server's records
    steps, workers, lr, momentum, staleness = 4, 3, 0.1, 0.9, 2
    job = make_job(
        mode="sync",
        staleness=staleness,
        servers=2,
        workers=workers,
        steps=steps,
        lr=lr,
        momentum=momentum,
        slow_worker=1,
        slow_factor=3.0,
        step_delay=0.02,
    )
    result = run_job(job, f"sync (staleness={staleness} set), 2 servers, 3 workers")
    expected = data_parallel_sgd(workers, steps, lr, momentum)
    for worker in range(workers):
        clocks = [c for run in result.workers.get(worker, []) for c in run.clocks]
        if clocks != list(range(steps)):
            fail(f"3.7 sync: worker {worker} ran clocks {clocks}, expected 0..{steps - 1}")
    for report in result.servers:
        early = [g for g in report.grants if g.clock > g.slowest]
        if early:
            g = early[0]
            lead = max(e.clock - e.slowest for e in early)
            asked = gate_mistake("sync", staleness)
            why = (
                f"early; asked directly, {asked}"
                if asked
                else "one clock too early: the comparison in ready_to_serve is off by one (with "
                "no staleness, a pull for clock c needs clock c-1 applied)"
                if lead == 1
                else f"as if the staleness setting counted (this run sets staleness={staleness}, "
                "as the launcher does in every mode; only ssp may use it)"
            )
            fail(
                f"3.7 sync: server {report.server_id} served worker {g.worker}'s pull for clock "
                f"{g.clock} while a live worker had completed only {g.slowest} clocks (leads up "
                f"to {lead}): in sync a pull for clock c waits until clock c-1 was applied; "
                f"this server served {why}"
            )
        if report.optimizer_steps != steps:
            fail(
                f"3.7 sync: server {report.server_id} took {report.optimizer_steps} optimizer "
                f"steps in {steps} clocks of {workers} workers: expected one step per clock with "
                "the average of all W gradients (a push must not be applied on arrival in sync)"
            )
    diff = worst(result.params, expected)
    if diff > TOLERANCE:
        fail(
            f"3.7 sync: after {steps} clocks the parameters differ from data-parallel SGD "
            f"(momentum {momentum}, the W gradients averaged each step, applied once per "
            f"clock): {params_words(result.params, expected, initial_params())}"
        )


@exercise("3.7")
def test_ssp_with_zero_staleness_equals_sync() -> None:
    steps, workers, lr, momentum = 4, 3, 0.1, 0.9
    job = make_job(
        mode="ssp", staleness=0, servers=2, workers=workers, steps=steps, lr=lr, momentum=momentum
    )
    result = run_job(job, "ssp with staleness 0")
    for report in result.servers:
        gaps = sorted({g.clock - g.slowest for g in report.grants})
        if gaps != [0]:
            fail(
                f"3.7 ssp, s=0: server {report.server_id} served pulls at clock gaps {gaps} "
                "ahead of the slowest live worker: with s=0 every pull of clock c must wait "
                "until every live worker completed c clocks, like sync"
                + (f"; asked directly, {asked}" if (asked := gate_mistake("ssp", 0)) else "")
            )
    for report in result.servers:
        if report.optimizer_steps != steps:
            fail(
                f"3.7 ssp, s=0: server {report.server_id} took {report.optimizer_steps} "
                f"optimizer steps in {steps} clocks: ssp applies each clock once, as the average "
                "of its gradients, like sync"
            )
    expected = data_parallel_sgd(workers, steps, lr, momentum)
    if worst(result.params, expected) > TOLERANCE:
        fail(
            f"3.7 ssp, s=0: the parameters differ from data-parallel SGD (momentum {momentum}; "
            f"with s=0 ssp must equal sync): "
            f"{params_words(result.params, expected, initial_params())}"
        )


@exercise("3.7")
def test_ssp_bounds_the_fastest_worker() -> None:
    staleness, steps = 2, 12
    job = make_job(
        mode="ssp",
        staleness=staleness,
        servers=2,
        workers=3,
        steps=steps,
        slow_worker=1,
        slow_factor=3.0,
        step_delay=0.02,
    )
    result = run_job(job, f"ssp, s={staleness}, worker 1 slowed 3x")
    widest = 0
    for report in result.servers:
        for grant in report.grants:
            gap = grant.clock - grant.slowest
            widest = max(widest, gap)
            if gap > staleness:
                fail(
                    f"3.7 ssp, s={staleness}: server {report.server_id} let worker "
                    f"{grant.worker} pull for clock {grant.clock} while the slowest live worker "
                    f"had completed only {grant.slowest} clocks: a lead of {gap} > s. A pull for "
                    "clock c waits until every live worker completed at least c - s clocks"
                    + (
                        f"; asked directly, {asked}"
                        if (asked := gate_mistake("ssp", staleness))
                        else ""
                    )
                )
    if widest < staleness:
        fail(
            f"3.7 ssp, s={staleness}, one worker 3x slower: no pull was served more than "
            f"{widest} clock(s) ahead of the slowest worker: the gate is stricter than ssp "
            f"(a lead of exactly s={staleness} is allowed)"
            + (f"; asked directly, {asked}" if (asked := gate_mistake("ssp", staleness)) else "")
        )
    for worker in range(3):
        clocks = [c for run in result.workers.get(worker, []) for c in run.clocks]
        if clocks != list(range(steps)):
            fail(f"3.7 ssp: worker {worker} ran clocks {clocks}, expected 0..{steps - 1}")
    for report in result.servers:
        if report.clock != steps or report.optimizer_steps != steps:
            fail(
                f"3.7 ssp: server {report.server_id} applied {report.clock} clocks with "
                f"{report.optimizer_steps} optimizer steps after all 3 workers completed {steps}: "
                "every clock is applied once, in order, as soon as every member completed it "
                "(and a later clock may already be complete when an older one is applied)"
            )


@exercise("3.7")
def test_async_converges() -> None:
    from phase3_multi_node.ps_launcher import make_model, test_accuracy

    steps = 80
    job = make_job(
        mode="async",
        servers=2,
        workers=3,
        steps=steps,
        lr=0.1,
        model_fn=_mlp,
        batch_fn=pattern_batches(),
    )
    result = run_job(job, "async on the built-in dataset")
    model = make_model("mlp")
    with torch.no_grad():
        for param, value in zip(model.parameters(), result.params, strict=True):
            param.copy_(value)
    accuracy = test_accuracy(model, 1024)
    keys = len(list(model.parameters()))
    steps_taken = sum(r.optimizer_steps for r in result.servers)
    if steps_taken != 3 * steps * keys:
        fail(
            f"3.7 async: the servers took {steps_taken} optimizer steps for {3 * steps} pushes "
            f"of {keys} keys: expected one step per pushed key ({3 * steps * keys}), applied at once"
        )
    if accuracy < 0.3:
        losses = [round(x, 2) for x in result.workers[0][0].losses[::20]]
        fail(
            f"3.7 async: test accuracy {accuracy:.3f} after {steps} clocks of 3 workers "
            f"(chance 0.1, expected > 0.3); worker 0's losses {losses}"
        )


def _mlp() -> torch.nn.Module:
    from phase3_multi_node.ps_launcher import make_model

    return make_model("mlp")


# ----------------------------------------------------------------------------- faults


def _check_restarted(result: Any, worker: int, kill_at: int, steps: int, what: str) -> None:
    if worker not in result.killed:
        fail(f"3.7 {what}: worker {worker} was meant to die by SIGKILL but did not")
    runs = result.workers.get(worker, [])
    if len(runs) != 1:
        fail(f"3.7 {what}: the restarted worker {worker} did not finish (runs: {len(runs)})")
    rejoined = runs[0]
    if not kill_at - 1 <= rejoined.join_clock < steps:
        fail(
            f"3.7 {what}: the restarted worker {worker} joined at clock {rejoined.join_clock}; "
            f"expected the current clock (about {kill_at}, where it died, or later)"
        )
    initial = list(double_mlp().parameters())
    if worst(rejoined.first_params, [p.detach() for p in initial]) == 0:
        fail(f"3.7 {what}: the restarted worker pulled the initial parameters, not the current")
    if rejoined.clocks and rejoined.clocks[-1] != steps - 1:
        fail(f"3.7 {what}: the restarted worker stopped at clock {rejoined.clocks[-1]}")


@exercise("3.7")
def test_sync_reforms_after_a_killed_worker() -> None:
    steps, kill_at = 30, 3
    job = make_job(
        mode="sync",
        servers=2,
        workers=3,
        steps=steps,
        sync_timeout=1.0,
        step_delay=0.05,
        kill_worker=2,
        kill_at=kill_at,
    )
    result = run_job(job, "sync with worker 2 killed", restart_killed=True)
    for report in result.servers:
        if not any("re-formed" in line for line in report.events):
            fail(
                f"3.7 sync: server {report.server_id} never logged a re-formed clock after "
                f"worker 2 died; its log: {report.events}"
            )
        if report.clock != steps:
            fail(
                f"3.7 sync: server {report.server_id} closed {report.clock} clocks, "
                f"expected {steps}"
            )
    for worker in (0, 1):
        clocks = [c for run in result.workers.get(worker, []) for c in run.clocks]
        if clocks != list(range(steps)):
            fail(f"3.7 sync: survivor {worker} ran clocks {clocks}, expected 0..{steps - 1}")
    _check_restarted(result, 2, kill_at, steps, "sync with worker 2 killed")
    # replay: clock c averaged exactly the workers that completed it on the server
    pushers = [
        sorted(w for _, w, c in result.servers[0].clocks_done if c == clock)
        for clock in range(steps)
    ]
    if 2 in pushers[kill_at]:
        fail(f"3.7 sync: worker 2 died in clock {kill_at} but is recorded as completing it")
    diff = worst(result.params, replay_sync(pushers, 3, 0.1))
    if diff > TOLERANCE:
        fail(
            f"3.7 sync with worker 2 killed in clock {kill_at}: the parameters differ by "
            f"{diff:.3g} from data-parallel SGD over the workers that pushed each clock "
            f"({pushers[kill_at]} in clock {kill_at}): a re-formed clock averages the survivors' "
            "gradients, dividing by how many pushed, not by W"
        )


@exercise("3.7")
def test_ssp_goes_on_without_a_killed_worker() -> None:
    steps, kill_at = 30, 3
    job = make_job(
        mode="ssp",
        staleness=1,
        servers=2,
        workers=3,
        steps=steps,
        step_delay=0.05,
        kill_worker=1,
        kill_at=kill_at,
    )
    result = run_job(job, "ssp, s=1, with worker 1 killed", restart_killed=True)
    for worker in (0, 2):
        clocks = [c for run in result.workers.get(worker, []) for c in run.clocks]
        if clocks != list(range(steps)):
            fail(f"3.7 ssp: survivor {worker} ran clocks {clocks}, expected 0..{steps - 1}")
    _check_restarted(result, 1, kill_at, steps, "ssp with worker 1 killed")


# ----------------------------------------------------------------------------- bad input


def _server_said(server: Any, since: int) -> str:
    """The server's own reason for its latest refusal (its log, from event ``since`` on)."""
    events = server.get_report().events[since:]
    said = [e for e in events if "closing the connection" in e or "internal error" in e]
    return (said or events or ["(nothing logged)"])[-1]


def _hello(sock: socket.socket, server: Any, worker: int = 0) -> None:
    logged = len(server.get_report().events)
    sock.sendall(ps_wire.encode_control(ps_wire.MsgType.HELLO, worker=worker))
    try:
        header, _ = read_answer(sock)
    except Exception as exc:
        seen = f"{type(exc).__name__}: {exc}"
    else:
        seen = ""
    if seen:
        raise_internal_errors(server)
        fail(
            f"3.7: the server refused a valid HELLO: {_server_said(server, logged)} (the "
            f"client then saw {seen})"
        )
    if header.type != ps_wire.MsgType.WELCOME:
        fail(f"3.7: the server answered HELLO with message type {header.type}, not WELCOME")


def _malformed_cases() -> dict[str, tuple[bool, bytes]]:
    """name -> (say HELLO first, the bytes to send). Key 0 is [24, 10] float64 (1920 bytes)."""
    push = ps_wire.MsgType.PUSH
    grad = torch.ones(24, 10, dtype=torch.float64)
    whole = ps_wire.encode_tensor(push, grad, key=0, clock=0)
    rng = random.Random(8)
    return {
        "random bytes": (False, bytes(rng.randrange(256) for _ in range(300))),
        "random bytes after HELLO": (True, bytes(rng.randrange(256) for _ in range(300))),
        "a truncated frame (header and half the payload, then the client closes)": (
            True,
            whole[: len(whole) - 960],
        ),
        "a float32 gradient for the float64 key 0": (
            True,
            ps_wire.encode_tensor(push, grad.float(), key=0, clock=0),
        ),
        "a [10, 24] gradient for the [24, 10] key 0": (
            True,
            ps_wire.encode_tensor(push, grad.reshape(10, 24), key=0, clock=0),
        ),
        "a gradient for the unknown key 99": (
            True,
            ps_wire.encode_tensor(push, grad, key=99, clock=0),
        ),
        "a length header of 2^62 for key 0": (
            True,
            ps_wire.pack_header(push, key=0, dtype=torch.float64, shape=(24, 10), length=2**62),
        ),
        "dtype code 250": (
            True,
            struct.pack(
                "!4sBBBBIiq4qQ", ps_wire.MAGIC, int(push), 250, 2, 0, 0, 0, 0, 24, 10, 0, 0, 1920
            ),
        ),
    }


@exercise("3.7")
def test_malformed_input_closes_the_connection_and_changes_nothing() -> None:
    with local_server(read_timeout=1.5) as server:
        before = server.snapshot()
        for name, (hello, data) in _malformed_cases().items():
            logged = len(server.get_report().events)
            with raw_client(server) as sock:
                if hello:
                    _hello(sock, server)
                sock.sendall(data)
                if name.startswith("a truncated"):
                    sock.shutdown(socket.SHUT_WR)
                closed = closed_by_server(sock, within=4.0)
            raise_internal_errors(server)
            if not closed:
                fail(f"3.7 malformed input: after {name} the server kept the connection open")
            new = server.get_report().events[logged:]
            after = server.snapshot()
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            if changed:
                fail(
                    f"3.7 malformed input: {name} changed the parameters of keys {changed}: "
                    "a frame must be read whole and checked before anything is applied"
                )
            if not new:
                fail(f"3.7 malformed input: {name}: the connection closed without a logged reason")
            if any("timed out" in line for line in new):
                fail(
                    f"3.7 malformed input: {name} was refused only when the read timed out "
                    f"({new[-1]}): the header alone shows it is wrong; check it (dtype, shape, "
                    "length against the key) before reading the payload"
                )
        # a silent client: closed by the read timeout, with a reason
        logged = len(server.get_report().events)
        with raw_client(server) as sock:
            _hello(sock, server)
            closed = closed_by_server(sock, within=5.0)
        new = server.get_report().events[logged:]
        if not closed or not any("timed out" in line for line in new):
            fail(
                f"3.7: a client that says HELLO and then nothing must be closed after the read "
                f"timeout (1.5 s here) with a logged reason; closed: {closed}, log: {new}"
            )
        # the server still serves, and a valid push does change the parameters (async)
        with raw_client(server) as sock:
            _hello(sock, server)
            logged = len(server.get_report().events)
            for key, value in before.items():
                sock.sendall(
                    ps_wire.encode_tensor(ps_wire.MsgType.PUSH, torch.ones_like(value), key=key)
                )
            sock.sendall(ps_wire.encode_control(ps_wire.MsgType.CLOCK, clock=0))
            sock.sendall(ps_wire.encode_control(ps_wire.MsgType.PULL, clock=1))
            try:
                read_answer(sock)  # the first PARAM: the pull was served
            except Exception as exc:
                seen = f"{type(exc).__name__}: {exc}"
            else:
                seen = ""
            if seen:
                raise_internal_errors(server)
                fail(
                    "3.7: after the bad frames, the server refused a valid PUSH, CLOCK and "
                    f"PULL: {_server_said(server, logged)} (the client then saw {seen})"
                )
        raise_internal_errors(server)
        after = server.snapshot()
        if all(torch.equal(before[k], after[k]) for k in before):
            fail(
                "3.7: after all the bad frames, a valid async push of ones changed nothing: "
                "apply_push must take an optimizer step on that key"
            )


@exercise("3.7")
@pytest.mark.parametrize("workers", [1, 4])
def test_async_applies_each_push_at_once_scaled_by_one_over_w(workers: int) -> None:
    """Async: one push of ones for each key moves each parameter by exactly lr / W (plain SGD),
    before any other worker pushed (a server with W workers, of which one connects)."""
    lr = 0.5
    with local_server(mode="async", num_workers=workers, lr=lr) as server:
        before = server.snapshot()
        with raw_client(server) as sock:
            _hello(sock, server)
            logged = len(server.get_report().events)
            for key, value in before.items():
                sock.sendall(
                    ps_wire.encode_tensor(ps_wire.MsgType.PUSH, torch.ones_like(value), key=key)
                )
                deadline = time.monotonic() + 5.0
                while server.optimizer_steps < key + 1 and time.monotonic() < deadline:
                    raise_internal_errors(server)
                    if any("closing" in e for e in server.get_report().events[logged:]):
                        fail(
                            f"3.7 async: the server refused a valid PUSH of key {key}: "
                            f"{_server_said(server, logged)}"
                        )
                    time.sleep(0.01)
                moved = server.snapshot()
                steps = server.optimizer_steps
                if steps != key + 1:
                    fail(
                        f"3.7 async: after the push of key {key} (W={workers}) the server took "
                        f"{steps} optimizer steps in all, expected {key + 1}: async applies "
                        "each push when it arrives, one step per pushed key"
                    )
                shift = float((before[key] - moved[key]).mean())
                if abs(shift - lr / workers) > 1e-12:
                    scale = shift / lr
                    fail(
                        f"3.7 async with W={workers} workers, lr={lr}: a push of a gradient of "
                        f"ones moved key {key} by {shift:.6g} = lr x {scale:.4g}; expected lr / "
                        f"W = {lr / workers:g}: each push counts 1/W, so that a round of W "
                        "pushes moves the parameters as far as one sync step"
                        + (" (the raw gradient was applied)" if abs(scale - 1) < 1e-9 else "")
                    )
        raise_internal_errors(server)


def _push_clock(sock: socket.socket, worker: int, clock: int, value: float, keys: Any) -> None:
    """One clock of a raw client: a PUSH of ``value`` everywhere for each key, then CLOCK."""
    for key, like in keys.items():
        grad = torch.full_like(like, value)
        sock.sendall(
            ps_wire.encode_tensor(ps_wire.MsgType.PUSH, grad, key=key, worker=worker, clock=clock)
        )
    sock.sendall(ps_wire.encode_control(ps_wire.MsgType.CLOCK, worker=worker, clock=clock))


def _wait_for(server: Any, done: Any, what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not done() and time.monotonic() < deadline:
        raise_internal_errors(server)
        time.sleep(0.02)
    raise_internal_errors(server)
    if not done():
        fail(
            f"3.7: {what} did not happen within {within:g} s; the server's log: "
            f"{server.get_report().events[-3:]}"
        )


@exercise("3.7")
def test_ssp_applies_every_completed_clock_when_a_member_leaves() -> None:
    """ssp, s=2, W=2: worker 0 completes clocks 0-2, worker 1 completes clock 0 and says BYE.
    Clock 0 averages both; clocks 1 and 2, complete for every remaining member, are applied at
    the BYE too (one finish_clock call must apply all of them, in order)."""
    lr = 0.1
    with local_server(mode="ssp", staleness=2, num_workers=2, lr=lr) as server:
        before = server.snapshot()
        with raw_client(server) as first, raw_client(server) as second:
            _hello(first, server, worker=0)
            _hello(second, server, worker=1)
            for clock in range(3):
                _push_clock(first, 0, clock, 1.0, before)
            _wait_for(
                server,
                lambda: len(server.get_report().clocks_done) == 3,
                "worker 0's three CLOCK frames being handled",
            )
            _push_clock(second, 1, 0, 3.0, before)
            second.sendall(ps_wire.encode_control(ps_wire.MsgType.BYE, worker=1))
            _wait_for(server, lambda: 1 not in server.live, "worker 1's BYE being handled")
            time.sleep(0.1)
            report = server.get_report()
            after = server.snapshot()
    if report.clock != 3 or report.optimizer_steps != 3:
        fail(
            f"3.7 ssp: worker 0 completed clocks 0-2, worker 1 completed clock 0 and left; the "
            f"server then applied {report.clock} clocks with {report.optimizer_steps} optimizer "
            "steps, expected 3 and 3: when a member leaves, every open clock that the remaining "
            "members completed is applied, oldest first (keep going after the first one)"
        )
    expected = {k: v - lr * (2.0 + 1.0 + 1.0) for k, v in before.items()}
    diff = max(float((after[k] - expected[k]).abs().max()) for k in after)
    if diff > TOLERANCE:
        fail(
            f"3.7 ssp: after clock 0 (gradients 1 and 3 from workers 0 and 1) and clocks 1 and 2 "
            f"(gradient 1 from worker 0 alone) the parameters differ by {diff:.3g} from SGD on the "
            "averages 2, 1, 1: each clock averages the workers that completed it"
        )


@exercise("3.7")
def test_sync_refuses_a_push_for_a_clock_already_applied() -> None:
    """sync, W=2, sync_timeout 0.5 s: worker 1 pushes one key of clock 0 and stalls; the clock is
    re-formed without it and applied; its late push for clock 0 must be refused, not kept."""
    with local_server(mode="sync", num_workers=2, sync_timeout=0.5) as server:
        before = server.snapshot()
        keys = list(before)
        with raw_client(server) as first, raw_client(server) as second:
            _hello(first, server, worker=0)
            _hello(second, server, worker=1)
            late = torch.full_like(before[keys[0]], 5.0)
            second.sendall(
                ps_wire.encode_tensor(ps_wire.MsgType.PUSH, late, key=keys[0], worker=1, clock=0)
            )
            _push_clock(first, 0, 0, 1.0, before)
            _wait_for(server, lambda: server.get_report().clock == 1, "the re-formed clock 0")
            logged = len(server.get_report().events)
            late = torch.full_like(before[keys[1]], 5.0)
            second.sendall(
                ps_wire.encode_tensor(ps_wire.MsgType.PUSH, late, key=keys[1], worker=1, clock=0)
            )
            closed = closed_by_server(second, within=4.0)
            raise_internal_errors(server)
            pending = sorted(server.pending)
            said = _server_said(server, logged)
    if pending:
        fail(
            "3.7 sync: after clock 0 was re-formed without worker 1 and applied, worker 1 pushed "
            f"for clock 0, and the server kept that gradient (pending clocks now {pending}): "
            "apply_push must refuse (ProtocolError) a push for a clock already applied, or the "
            "gradient lingers in self.pending where no clock will ever take it"
        )
    if not closed:
        fail(
            "3.7 sync: after clock 0 was re-formed without worker 1 and applied, worker 1 pushed "
            "for clock 0, and the server neither refused it nor closed the connection (its "
            f"log: {said}): apply_push must refuse a push for a clock already applied"
        )


@exercise("3.7")
def test_shared_secret() -> None:
    ps = ps_module()
    with pytest.raises(ValueError, match="secret"):
        check_server_config(ServerConfig(host="0.0.0.0"))
    secret = os.urandom(16)
    with local_server(secret=secret) as server:
        before = server.snapshot()
        # wrong secret
        with raw_client(server) as sock:
            header, nonce = read_answer(sock)
            if header.type != ps_wire.MsgType.CHALLENGE:
                fail(
                    "3.7: a server with a shared secret must open every connection with a "
                    f"CHALLENGE frame (the nonce the client signs); it sent {header.type!r} "
                    "first (the given server code does this: was it changed?)"
                )
            sock.sendall(
                ps_wire.encode_control(
                    ps_wire.MsgType.AUTH, payload=ps_wire.auth_digest(b"x", nonce)
                )
            )
            if not closed_by_server(sock, 3.0):
                fail("3.7: a client with the wrong secret was not disconnected")
        # no AUTH at all: a tensor straight away
        with raw_client(server) as sock:
            read_answer(sock)
            sock.sendall(
                ps_wire.encode_tensor(ps_wire.MsgType.PUSH, torch.ones(24, 10).double(), key=0)
            )
            if not closed_by_server(sock, 3.0):
                fail("3.7: a client that skipped the HMAC answer was not disconnected")
        raise_internal_errors(server)
        after = server.snapshot()
        if any(not torch.equal(before[k], after[k]) for k in before):
            fail("3.7: an unauthenticated client changed the parameters")
        events = server.get_report().events
        if not any("authentication failed" in e for e in events):
            fail(f"3.7: the wrong secret should be logged as an authentication failure: {events}")
        # the right secret: a Worker connects and pulls the server's parameters
        model = double_mlp()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        worker = ps.Worker(0, model, [server.address], [0] * 4, secret=secret, timeout=5.0)
        worker.connect()
        worker.pull(0)
        raise_internal_errors(server)
        pulled = [p.detach() for p in model.parameters()]
        if worst(pulled, [before[k] for k in sorted(before)]) != 0:
            fail("3.7 Worker.pull: the model does not hold the server's parameters after a pull")
        worker.close()


@exercise("3.7")
@pytest.mark.reference
def test_instructor_command(capsys: pytest.CaptureFixture[str]) -> None:
    from grading import impl

    from phase3_multi_node.ps_launcher import main

    argv = ["--servers", "2", "--workers", "3", "--mode", "ssp", "--staleness", "2"]
    code = main([*argv, "--slow-worker", "1", "--steps", "15", "--impl", impl()])
    out = capsys.readouterr()
    if code != 0:
        if "not written" in out.err:
            raise NotImplementedError(out.err.strip().splitlines()[0].replace(" not written", ""))
        fail(f"3.7: the instructor command exited with {code}: {out.err.strip()[-600:]}")
    for needed in (
        "listening on 127.0.0.1:",
        "worker 1 (slow)",
        "histogram",
        "throughput:",
        "test accuracy:",
    ):
        if needed not in out.out:
            fail(f"3.7: the instructor command's output lacks {needed!r}:\n{out.out}")
