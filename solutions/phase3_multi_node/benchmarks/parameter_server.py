"""The parameter server measured: consistency models under stragglers, and a server under attack.

    uv run python -m solutions.phase3_multi_node.benchmarks.parameter_server
    uv run python -m solutions.phase3_multi_node.benchmarks.parameter_server --impl templates
    uv run python -m solutions.phase3_multi_node.benchmarks.parameter_server --scenario hardening

``--scenario modes`` (the default): each run is S servers and W workers (processes, 127.0.0.1);
each worker trains for the same wall time (``--time-budget``) on its shard of the built-in
dataset. ``--step-delay`` stands for the compute time of a clock (the MLP itself takes about a
millisecond, so without it the table would measure Python and sockets only). Stragglers: none;
worker 1 always 3x slower (a persistent straggler); or on each clock a random 1/W of the
workers 3x slower (transient stragglers, the case SSP was designed for). Throughput is the
samples of all workers over the wall time from the first clock's start to the last one's end;
accuracy is measured on the held-out split with the servers' final parameters; medians over
``--repeats`` runs. The claim to check (Ho et al. 2013): with stragglers, sync runs at the
slowest worker's pace, async never waits but computes on stale parameters, and ssp with a small
staleness keeps most of async's throughput with sync-like accuracy. The table reports what was
measured, whichever way it comes out.

``--scenario hardening``: one server process with its default deadlines, one worker (in this
process) running sync clocks of the built-in MLP for ``--seconds``, while a separate process
(phase3_multi_node/ps_probes.py) keeps 64 idle sockets open, or 16 clients that send one byte
every 0.5 s, or both, replacing each socket the server closes. Reported: whether the worker
connected and trained, its clock latency (pull + compute + push) against the quiet server, and
what the server did with the unwelcome sockets (how many it closed, the longest one it held).

``--record PATH`` writes the table and the values the guide quotes (course/results.py).
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from course.cli import parse_config, run_main
from course.impl import IMPLS, load_impl
from course.results import Table, write_results
from phase3_multi_node.ps_launcher import (
    Cluster,
    ClusterError,
    Job,
    PSConfig,
    make_model,
    pattern_batch,
    run,
)
from phase3_multi_node.ps_server_base import ServerConfig
from phase3_multi_node.ps_wire import ProtocolError

STRAGGLERS = ("none", "worker 1", "random")
WARMUP = 5  # hardening: clocks run before the timed ones
SCENARIOS = ("modes", "hardening")
# name -> (idle sockets, slow-drip clients): the hardening scenario's loads
LOADS = {
    "none (quiet)": (0, 0),
    "64 idle sockets": (64, 0),
    "16 slow-drip clients": (0, 16),
    "64 idle + 16 slow-drip": (64, 16),
}


@dataclass
class BenchConfig:
    scenario: str = field(default="modes", metadata={"choices": SCENARIOS})
    servers: int = field(default=2, metadata={"ge": 1, "fix": "1 or more servers"})
    workers: int = field(default=3, metadata={"ge": 2, "fix": "2 or more (worker 1 straggles)"})
    time_budget: float = field(
        default=3.0,
        metadata={"help": "seconds each worker trains", "gt": 0, "fix": "e.g. --time-budget 3"},
    )
    staleness: int = field(default=2, metadata={"ge": 0, "fix": "0 (sync) or more"})
    step_delay: float = field(
        default=0.01,
        metadata={"help": "simulated compute s per clock", "ge": 0, "fix": "e.g. 0.01"},
    )
    slow_factor: float = field(default=3.0, metadata={"ge": 1, "fix": "1 or more, e.g. 3"})
    repeats: int = field(default=3, metadata={"ge": 1, "fix": "1 or more runs per cell"})
    lr: float = field(default=0.05, metadata={"gt": 0, "fix": "a positive learning rate"})
    seconds: float = field(
        default=8.0,
        metadata={
            "help": "hardening: seconds the worker trains under each load",
            "gt": 0,
            "fix": "e.g. --seconds 8 (more than the 5 s handshake deadline shows it at work)",
        },
    )
    out: str = field(default="", metadata={"help": "also write the markdown table here"})
    record: str = field(
        default="", metadata={"help": "write a results file (course/results.py) here"}
    )
    impl: str = field(default="solutions", metadata={"choices": IMPLS})


# ----------------------------------------------------------------------------- modes


@dataclass(frozen=True)
class Row:
    mode: str
    straggler: str
    throughput: float  # samples/s, median
    accuracy: float  # median
    clocks: tuple[int, int]  # fewest and most clocks a worker ran (of the median-throughput run)


def measure(config: BenchConfig, mode: str, straggler: str) -> Row:
    base = PSConfig(
        servers=config.servers,
        workers=config.workers,
        mode=mode,
        staleness=config.staleness,
        steps=1_000_000,
        time_budget=config.time_budget,
        lr=config.lr,
        step_delay=config.step_delay,
        slow_worker=1 if straggler == "worker 1" else -1,
        random_straggler=straggler == "random",
        slow_factor=config.slow_factor,
        impl=config.impl,
    )
    runs = []
    for _ in range(config.repeats):
        result, accuracy = run(replace(base), verbose=False)
        counts = [sum(len(r.clocks) for r in result.workers[w]) for w in sorted(result.workers)]
        runs.append((sum(counts) * base.batch_size / result.wall, accuracy, counts))
    runs.sort(key=lambda item: item[0])
    throughput, _, counts = runs[len(runs) // 2]
    accuracy = statistics.median(item[1] for item in runs)
    return Row(mode, straggler, throughput, accuracy, (min(counts), max(counts)))


def modes_table(config: BenchConfig, rows: list[Row]) -> Table:
    by = {(r.mode, r.straggler): r for r in rows}
    table = Table(
        [
            "straggler",
            "mode",
            "throughput (samples/s)",
            "vs async, same straggler",
            "clocks per worker (min-max)",
            "test accuracy",
        ],
        note=(
            f"S={config.servers} servers, W={config.workers} workers, each trains for "
            f"{config.time_budget:g} s; batch 32 per worker; {config.step_delay * 1000:g} ms "
            f"simulated compute per clock; a slow clock takes {config.slow_factor:g}x as long; "
            f"ssp s={config.staleness}; median of {config.repeats} runs."
        ),
    )
    for row in rows:
        mode = f"ssp (s={config.staleness})" if row.mode == "ssp" else row.mode
        who = {
            "none": "none",
            "worker 1": f"worker 1 always {config.slow_factor:g}x",
            "random": f"each clock 1/W of workers {config.slow_factor:g}x",
        }[row.straggler]
        ratio = row.throughput / by[("async", row.straggler)].throughput
        table.add(
            who,
            mode,
            f"{row.throughput:.0f}",
            f"{ratio:.2f}",
            f"{row.clocks[0]}-{row.clocks[1]}",
            f"{row.accuracy:.3f}",
        )
    return table


def modes_values(rows: list[Row]) -> dict[str, str]:
    """The comparisons the guide states, computed here so a re-run cannot contradict them."""
    by = {(r.mode, r.straggler): r for r in rows}
    values: dict[str, str] = {}
    for straggler, name in (("none", "none"), ("worker 1", "persistent"), ("random", "random")):
        fastest = max(("sync", "async", "ssp"), key=lambda m: by[(m, straggler)].throughput)
        values[f"fastest_{name}"] = fastest
        for mode in ("sync", "ssp"):
            ratio = by[(mode, straggler)].throughput / by[("async", straggler)].throughput
            values[f"{mode}_vs_async_{name}"] = f"{ratio:.2f}"
    return values


def run_modes(config: BenchConfig) -> tuple[Table, dict[str, str]]:
    rows = []
    for straggler in STRAGGLERS:
        for mode in ("sync", "async", "ssp"):
            rows.append(measure(config, mode, straggler))
            print(f"measured {mode}, straggler: {straggler}", flush=True)
    return modes_table(config, rows), modes_values(rows)


# ----------------------------------------------------------------------------- hardening


@dataclass
class Load:
    name: str
    connect_s: float
    clocks: int
    latencies: list[float]  # seconds per clock: pull + compute + push
    flood: dict[str, Any]  # ps_probes.FloodReport as a dict (empty for no load)
    counts: dict[str, int]  # the server's ServerReport.counts


def _flood(address: tuple[str, int], idle: int, drips: int, seconds: float) -> subprocess.Popen:
    """Start ps_probes in its own process (its threads take no CPU from this one's worker)."""
    host, port = address
    command = [sys.executable, "-m", "phase3_multi_node.ps_probes", host, str(port)]
    command += ["--idle", str(idle), "--drips", str(drips), "--seconds", f"{seconds:g}", "--reopen"]
    probe = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert probe.stdout is not None
    json.loads(probe.stdout.readline())  # {"ready": n}: its sockets are open
    return probe


def measure_load(config: BenchConfig, name: str, idle: int, drips: int) -> Load:
    ps = load_impl("phase3_multi_node", "parameter_server", config.impl)
    job = Job(
        model_fn=functools.partial(make_model, "mlp"),
        batch_fn=functools.partial(pattern_batch, batch_size=32, samples=4096),
        server_config=ServerConfig(mode="sync", num_workers=1, lr=config.lr),
        num_servers=1,
        steps=1,
        impl=config.impl,
    )
    with Cluster(job, time_limit=config.seconds + 60) as cluster:
        (address,) = cluster.start_servers()
        probe = _flood(address, idle, drips, config.seconds + 1) if idle or drips else None
        model = make_model("mlp")
        keys = len(list(model.parameters()))
        worker = ps.Worker(0, model, [address], [0] * keys, timeout=30.0)
        began = connected = time.monotonic()
        latencies: list[float] = []
        try:
            clock = worker.connect()
            connected = time.monotonic()
            while time.monotonic() - connected < config.seconds:
                t = time.perf_counter()
                worker.pull(clock)
                worker.compute(*pattern_batch(0, 1, clock, batch_size=32, samples=4096))
                worker.push(clock)
                if clock >= WARMUP:  # the first clocks allocate and fill caches
                    latencies.append(time.perf_counter() - t)
                clock += 1
        except ProtocolError as exc:  # recorded as what happened: the worker was not served
            print(f"{name}: the worker failed after {len(latencies)} clocks: {exc}", flush=True)
        worker.close()
        flood: dict[str, Any] = {}
        if probe is not None:
            out, _ = probe.communicate(timeout=30)
            flood = json.loads(out.strip().splitlines()[-1])
        cluster.drain()
        counts = cluster.server_reports()[0].counts
    return Load(name, connected - began, len(latencies), latencies, flood, counts)


def _ms(values: Sequence[float], q: float) -> float:
    """The q-quantile of ``values`` in milliseconds (nan when there are none)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def hardening_table(config: BenchConfig, loads: list[Load]) -> tuple[Table, dict[str, str]]:
    defaults = ServerConfig()
    table = Table(
        [
            "load on the server",
            "worker clocks",
            "clock p50 (ms)",
            "clock p90 (ms)",
            "worker connect (ms)",
            "unwelcome sockets opened",
            "closed by the server",
            "longest held (s)",
        ],
        note=(
            f"One server (sync, 1 worker, the built-in MLP, batch 32) with its default deadlines "
            f"(handshake {defaults.handshake_timeout:g} s, whole frame "
            f"{defaults.frame_timeout:g} s, at most {defaults.max_unauthenticated} connections "
            f"in their handshake); the worker trains for {config.seconds:g} s under each load; "
            "a slow-drip client sends one byte every 0.5 s; the flood replaces every socket the "
            "server closes."
        ),
    )
    quiet = statistics.median(loads[0].latencies)  # the quiet run always has clocks
    for load in loads:
        flood = load.flood
        table.add(
            load.name,
            str(load.clocks),
            f"{_ms(load.latencies, 0.5):.2f}",
            f"{_ms(load.latencies, 0.9):.2f}",
            f"{1000 * load.connect_s:.1f}",
            str(flood.get("opened", 0)),
            str(flood.get("closed_by_server", 0)),
            f"{flood['longest_held']:.1f}" if flood else "-",
        )
    loaded = loads[1:]
    served = sum(1 for load in loads if load.clocks > 0)
    longest = max(load.flood["longest_held"] for load in loaded)
    worst = max(
        (statistics.median(load.latencies) / quiet for load in loaded if load.latencies),
        default=float("nan"),
    )
    values = {
        "served": f"{served} of {len(loads)}",
        "longest_held": f"{longest:.1f} s",
        "handshake_timeout": f"{defaults.handshake_timeout:g} s",
        "worst_p50_ratio": f"{worst:.2f}x",
        "closed": str(sum(load.flood["closed_by_server"] for load in loaded)),
        "opened": str(sum(load.flood["opened"] for load in loaded)),
    }
    return table, values


def run_hardening(config: BenchConfig) -> tuple[Table, dict[str, str]]:
    torch.set_num_threads(1)  # as every server and worker process of the launcher
    loads = []
    for name, (idle, drips) in LOADS.items():
        loads.append(measure_load(config, name, idle, drips))
        print(f"measured: {name}", flush=True)
    return hardening_table(config, loads)


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(BenchConfig, argv, __doc__)
    try:
        if config.scenario == "hardening":
            table, values = run_hardening(config)
        else:
            table, values = run_modes(config)
    except ClusterError as err:
        failure = err.failure
        if failure is not None and failure.exc_type == "NotImplementedError":  # a learner's TODO
            todo, _, rest = failure.message.partition(":")
            print(f"{todo} not written:{rest}\n  at {failure.where}", file=sys.stderr)
        else:
            print(f"error: {err}", file=sys.stderr)
        return 1
    text = table.to_markdown()
    print(table.note + "\n\n" + text)
    for key, value in values.items():
        print(f"{key}: {value}")
    if config.out:
        with open(config.out, "w") as handle:
            handle.write(table.note + "\n\n" + text + "\n")
    if config.record:
        written = write_results(config.record, tables={config.scenario: table}, values=values)
        print(f"recorded {written}")
    return 0


if __name__ == "__main__":
    run_main(main)
