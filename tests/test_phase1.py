"""Phase 1 grader: data parallelism on one node.

Every exercise is checked against what PyTorch ships (DistributedSampler, dist.all_reduce,
DistributedDataParallel) or against one process doing the same work, in real worlds of 2-4
processes. Run one exercise with ``uv run pytest tests/test_phase1.py -m ex1_1``.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import exercise, load, module_name, world
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from solutions.common.comm_counter import CommCounter

PHASE = "phase1_data_parallel"
ROOT = Path(__file__).resolve().parents[1]


def sampler_module():
    return load(PHASE, "data_loader")


def trainer_module():
    return load(PHASE, "trainer")


def all_reduce_module():
    return load(PHASE, "all_reduce")


# ============================================================================ 1.1 sampler

DATASET_SIZES = [0, 1, 2, 3, 5, 7, 10, 17, 32]


@exercise("1.1")
def test_sampler_yields_what_pytorch_yields() -> None:
    Sampler = sampler_module().DistributedShardSampler
    checked = 0
    for n in DATASET_SIZES:
        data: Any = range(n)  # any Sized works; DistributedSampler's hints say Dataset
        for world_size in (1, 2, 3, 4):
            for rank in range(world_size):
                for shuffle in (True, False):
                    for drop_last in (False, True):
                        for seed in (0, 7):
                            ours = Sampler(data, world_size, rank, shuffle, seed, drop_last)
                            ref: DistributedSampler[int] = DistributedSampler(
                                data,
                                world_size,
                                rank,
                                shuffle=shuffle,
                                seed=seed,
                                drop_last=drop_last,
                            )
                            for epoch in (0, 1, 5):
                                ours.set_epoch(epoch)
                                ref.set_epoch(epoch)
                                got, want = list(ours), list(ref)
                                assert got == want and len(ours) == len(ref), (
                                    f"1.1: n={n}, world={world_size}, rank={rank}, "
                                    f"shuffle={shuffle}, drop_last={drop_last}, seed={seed}, "
                                    f"epoch={epoch}: expected {want} (len {len(ref)}), "
                                    f"got {got} (len {len(ours)})"
                                )
                                checked += 1
    assert checked > 1000


@exercise("1.1")
def test_sampler_shards_partition_each_epoch() -> None:
    Sampler = sampler_module().DistributedShardSampler
    n, world_size = 23, 4
    for epoch in range(3):
        shards = []
        for rank in range(world_size):
            sampler = Sampler(range(n), world_size, rank, shuffle=True, seed=3)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        lengths = {len(shard) for shard in shards}
        assert lengths == {6}, f"1.1: every rank must get 6 of 23 samples (padded); got {lengths}"
        union = {i for shard in shards for i in shard}
        assert union == set(range(n)), f"1.1: epoch {epoch} misses {set(range(n)) - union}"


@exercise("1.1")
def test_set_epoch_reshuffles_and_is_reproducible() -> None:
    Sampler = sampler_module().DistributedShardSampler
    sampler = Sampler(range(100), 2, 0, shuffle=True, seed=11)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    sampler.set_epoch(0)
    again = list(sampler)
    assert epoch0 != epoch1, (
        "1.1: set_epoch(1) gave epoch 0's order: seed the shuffle with seed + epoch"
    )
    assert epoch0 == again, "1.1: the same epoch must give the same order every time"


@exercise("1.1")
def test_resuming_part_way_and_refusing_bad_arguments() -> None:
    Sampler = sampler_module().DistributedShardSampler
    full = Sampler(range(50), 3, 2, shuffle=True, seed=5)
    full.set_epoch(4)
    shard = list(full)
    for start in (0, 1, 7, len(shard)):
        resumed = Sampler(range(50), 3, 2, shuffle=True, seed=5)
        resumed.set_epoch(4, start_index=start)
        assert list(resumed) == shard[start:], (
            f"1.1: set_epoch(4, start_index={start}) must yield the shard without its first "
            f"{start} samples: expected {shard[start:]}, got {list(resumed)}"
        )
        assert len(resumed) == len(shard) - start, (
            f"1.1: len() after start_index={start} should be {len(shard) - start}, "
            f"got {len(resumed)}"
        )
    with pytest.raises(ValueError, match=str(len(shard) + 1)):
        resumed.set_epoch(0, start_index=len(shard) + 1)
    with pytest.raises(ValueError, match="rank=3"):
        Sampler(range(10), num_replicas=3, rank=3)
    with pytest.raises(ValueError, match="num_replicas=0"):
        Sampler(range(10), num_replicas=0, rank=0)


def sampler_defaults_worker(n: int) -> tuple[list[int], list[int]]:
    Sampler = sampler_module().DistributedShardSampler
    data: Any = range(n)
    ours = Sampler(data, seed=2)
    ref: DistributedSampler[int] = DistributedSampler(data, seed=2)
    ours.set_epoch(3)
    ref.set_epoch(3)
    return list(ours), list(ref)


@exercise("1.1")
@pytest.mark.parametrize("world_size", [2, 3])
def test_sampler_reads_rank_and_world_from_the_process_group(world_size: int) -> None:
    for rank, (ours, ref) in enumerate(world(sampler_defaults_worker, world_size, 19)):
        assert ours == ref, f"1.1: rank {rank} of {world_size}: expected {ref}, got {ours}"


# ============================================================================ 1.2 DP step


class ToyNet(nn.Module):
    """A float64 MLP with a frozen layer, a parameter no forward uses, and a buffer."""

    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 8)  # requires grad, never receives one
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.embed(x))
        hidden = torch.tanh(self.frozen(hidden)) * self.scale
        return self.head(hidden)


def make_toy(seed: int) -> ToyNet:
    torch.manual_seed(seed)
    return ToyNet().double()


def global_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [
        (
            torch.randn(batch, 6, generator=g, dtype=torch.float64),
            torch.randint(3, (batch,), generator=g),
        )
        for _ in range(steps)
    ]


def broadcast_worker() -> dict[str, torch.Tensor]:
    trainer = trainer_module()
    model = make_toy(seed=100 + dist.get_rank())  # deliberately different on each rank
    model.scale.fill_(float(dist.get_rank() + 2))
    params_before = [p for p in model.parameters()]
    trainer.broadcast_parameters(model, src=1)
    assert all(a is b for a, b in zip(params_before, model.parameters(), strict=True)), (
        "1.2: broadcast_parameters must update the parameters in place, not replace them"
    )
    return {k: v.clone() for k, v in model.state_dict().items()}


@exercise("1.2")
def test_broadcast_parameters_copies_parameters_and_buffers_from_src() -> None:
    states = world(broadcast_worker, 3)
    expected = make_toy(seed=101).state_dict()
    expected["scale"] = torch.full((8,), 3.0, dtype=torch.float64)
    for rank, state in enumerate(states):
        for name, value in expected.items():
            assert torch.equal(state[name], value), (
                f"1.2: after broadcast_parameters(src=1), rank {rank}'s {name} differs from "
                "rank 1's (parameters and buffers must both be broadcast)"
            )


def average_worker() -> tuple[dict[str, torch.Tensor | None], int]:
    trainer = trainer_module()
    rank = dist.get_rank()
    model = make_toy(seed=0)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, float(rank + 1))
    model.unused.weight.grad = None
    model.unused.bias.grad = None
    nbytes = trainer.average_gradients(model)
    return {
        n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()
    }, nbytes


@exercise("1.2")
@pytest.mark.parametrize("world_size", [2, 4])
def test_average_gradients_is_the_mean_over_ranks(world_size: int) -> None:
    mean = (world_size + 1) / 2  # mean of 1..world_size
    reduced_params = ["embed.weight", "embed.bias", "head.weight", "head.bias"]
    expected_bytes = sum(make_toy(0).get_parameter(n).numel() for n in reduced_params) * 8
    for rank, (grads, nbytes) in enumerate(world(average_worker, world_size)):
        for name in reduced_params:
            grad = grads[name]
            assert grad is not None and torch.allclose(grad, torch.full_like(grad, mean)), (
                f"1.2: rank {rank}: {name}.grad should be the mean {mean} over ranks, got "
                f"{None if grad is None else grad.flatten()[:3]} (sum instead of mean?)"
            )
        for name in ("frozen.weight", "unused.weight"):
            assert grads[name] is None, f"1.2: {name} had no gradient and must keep none"
        assert nbytes == expected_bytes, (
            f"1.2: average_gradients should report {expected_bytes} bytes reduced "
            f"(the gradients that exist, float64), got {nbytes}"
        )


STEPS, GLOBAL_BATCH = 4, 12


def dp_step_worker(compare_ddp: bool) -> dict[str, object]:
    trainer = trainer_module()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world_size
    model = make_toy(seed=5 + rank)  # rank 0's weights reach everyone through the broadcast
    trainer.broadcast_parameters(model, src=0)
    ddp_model = DistributedDataParallel(make_toy(seed=5), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    losses, ddp_losses = [], []
    for inputs, targets in global_batches(STEPS, GLOBAL_BATCH):
        shard = slice(rank * per_rank, (rank + 1) * per_rank)
        stats = trainer.data_parallel_step(model, optimizer, loss_fn, inputs[shard], targets[shard])
        losses.append(stats.loss)
        assert stats.compute_seconds >= 0 and stats.communication_seconds >= 0
        if compare_ddp:
            ddp_optimizer.zero_grad(set_to_none=True)
            ddp_loss = loss_fn(ddp_model(inputs[shard]), targets[shard])
            ddp_loss.backward()
            ddp_optimizer.step()
            ddp_losses.append(ddp_loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "ddp_params": {n: p.detach().clone() for n, p in ddp_model.module.named_parameters()},
        "ddp_losses": ddp_losses,
    }


def single_process_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_toy(seed=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for inputs, targets in global_batches(STEPS, GLOBAL_BATCH):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@exercise("1.2")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dp_step_equals_one_process_on_the_whole_batch(world_size: int) -> None:
    ref_losses, ref_params = single_process_reference()
    results = world(dp_step_worker, world_size, False)
    for step in range(STEPS):
        mean_loss = sum(r["losses"][step] for r in results) / world_size
        assert mean_loss == pytest.approx(ref_losses[step], rel=1e-12), (
            f"1.2: step {step}: the mean of the ranks' losses should equal one process's loss "
            f"on the whole batch, {ref_losses[step]:.12f}; got {mean_loss:.12f}"
        )
    for rank, result in enumerate(results):
        for name, ref in ref_params.items():
            got = result["params"][name]
            assert torch.allclose(got, ref, rtol=0, atol=1e-12), (
                f"1.2: after {STEPS} steps on {world_size} ranks, rank {rank}'s {name} differs "
                f"from one process on the whole batch by {(got - ref).abs().max():.3e}"
            )


@exercise("1.2")
def test_dp_step_equals_distributed_data_parallel() -> None:
    for rank, result in enumerate(world(dp_step_worker, 2, True)):
        for name, ddp_param in result["ddp_params"].items():
            got = result["params"][name]
            assert torch.allclose(got, ddp_param, rtol=0, atol=1e-12), (
                f"1.2: rank {rank}: {name} after {STEPS} steps differs from "
                f"DistributedDataParallel's by {(got - ddp_param).abs().max():.3e}"
            )
        assert result["losses"] == pytest.approx(result["ddp_losses"], rel=1e-12)


# ============================================================================ 1.3 all-reduce

STRATEGIES = ["reduce_broadcast_all_reduce", "direct_exchange_all_reduce"]


def sizes_for(world_size: int) -> list[int]:
    """1, smaller than the world, not divisible by it, and large."""
    return sorted({1, max(1, world_size - 1), 3 * world_size + 1, 2**16 + 3})


def all_reduce_worker(strategy: str) -> list[str]:
    fn = getattr(all_reduce_module(), strategy)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    problems = []
    g = torch.Generator().manual_seed(1000 + rank)
    for size in sizes_for(world_size):
        for dtype in (torch.float32, torch.float64, torch.int64):
            # integer-valued inputs: every summation order gives the same bits
            data = torch.randint(-1000, 1000, (size,), generator=g).to(dtype)
            mine, ref = data.clone(), data.clone()
            out = fn(mine)
            dist.all_reduce(ref)
            if not torch.equal(mine, ref):
                problems.append(
                    f"rank {rank}: size {size} {dtype}: differs from dist.all_reduce at "
                    f"{(mine != ref).nonzero().flatten()[:5].tolist()} (first bad indices)"
                )
            if out is not None and out.data_ptr() != mine.data_ptr():
                problems.append(f"rank {rank}: must work in place (return the input tensor)")
    real = torch.randn(1001, generator=g, dtype=torch.float64)
    mine, ref = real.clone(), real.clone()
    fn(mine)
    dist.all_reduce(ref)
    if not torch.allclose(mine, ref, rtol=1e-12, atol=1e-12):
        problems.append(f"rank {rank}: random float64 sum is off by {(mine - ref).abs().max():.2e}")
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    if not all(torch.equal(everyone[0], other) for other in everyone):
        problems.append("ranks ended with different bits: reduce in the same order on every rank")
    for op_name in ("MAX", "MIN", "PRODUCT"):
        op = getattr(dist.ReduceOp, op_name)
        data = torch.randint(1, 4, (9,), generator=g).double()
        mine, ref = data.clone(), data.clone()
        fn(mine, op=op)
        dist.all_reduce(ref, op=op)
        if not torch.equal(mine, ref):
            problems.append(
                f"rank {rank}: op={op_name} gives {mine.tolist()}, expected {ref.tolist()}"
            )
    try:
        fn(torch.ones(4, 4).t())
        problems.append("a non-contiguous tensor must be refused with a ValueError")
    except ValueError as err:
        if "contiguous" not in str(err):
            problems.append(f"the ValueError for a non-contiguous tensor should say so: {err}")
    return problems


@exercise("1.3")
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_reduce_equals_dist_all_reduce(strategy: str, world_size: int) -> None:
    problems = [
        p for rank_problems in world(all_reduce_worker, world_size, strategy) for p in rank_problems
    ]
    assert not problems, f"1.3 {strategy} on {world_size} ranks:\n  " + "\n  ".join(problems[:8])


def bytes_worker(strategy: str, numel: int) -> tuple[int, int]:
    fn = getattr(all_reduce_module(), strategy)
    tensor = torch.ones(numel, dtype=torch.float32)
    with CommCounter() as comm:
        fn(tensor)
    return comm.bytes_sent, comm.bytes_received


@exercise("1.3")
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_rank_sends_the_bytes_the_strategy_predicts(strategy: str, world_size: int) -> None:
    numel = 1000
    size = numel * 4
    n = world_size
    for rank, (sent, received) in enumerate(world(bytes_worker, world_size, strategy, numel)):
        if strategy == "reduce_broadcast_all_reduce":
            expected = (n - 1) * size if rank == 0 else size
            rule = "the root sends (n-1)·S, every other rank S"
        else:
            expected = (n - 1) * size
            rule = "every rank sends its S bytes to each of the n-1 others"
        assert sent == expected, (
            f"1.3 {strategy}, {n} ranks, S={size} bytes: rank {rank} sent {sent} bytes, expected "
            f"{expected} ({rule}). Use dist.send/isend (module attribute) so sends are counted."
        )
        assert received == expected, (
            f"1.3 {strategy}: rank {rank} received {received}, expected {expected}"
        )


# ============================================================================ 1.4 trainer


def train_worker(strategy: str) -> dict[str, object]:
    trainer = trainer_module()
    config = trainer.TrainConfig(
        epochs=3,
        global_batch_size=32,
        train_samples=768,
        test_samples=512,
        all_reduce=strategy,
        model="mlp",
        lr=0.05,
    )
    result = trainer.train(config)
    return {
        "epochs": [vars(e) | {"share": e.communication_share} for e in result.epochs],
        "params": {n: p.detach().clone() for n, p in result.model.named_parameters()},
        "num_params": sum(p.numel() for p in result.model.parameters()),
    }


@exercise("1.4")
def test_trainer_learns_and_every_all_reduce_gives_the_same_model() -> None:
    world_size = 2
    results = {
        s: world(train_worker, world_size, s)[0]
        for s in ("torch", "reduce_broadcast", "direct_exchange")
    }
    base = results["torch"]
    epochs = base["epochs"]
    assert epochs[-1]["loss"] < epochs[0]["loss"], (
        f"1.4: loss did not fall: {[e['loss'] for e in epochs]}"
    )
    assert epochs[-1]["test_accuracy"] > 0.4, (
        f"1.4: test accuracy {epochs[-1]['test_accuracy']:.2f} after 3 epochs; chance is 0.10"
    )
    size = base["num_params"] * 4
    for strategy, result in results.items():
        for e in result["epochs"]:
            assert 0.0 < e["share"] < 1.0, (
                f"1.4 {strategy}: communication share {e['share']} not in (0, 1)"
            )
            assert e["bytes_reduced_per_step"] == size, (
                f"1.4 {strategy}: payload per step should be the gradient size, {size} bytes; "
                f"got {e['bytes_reduced_per_step']}"
            )
        for name, ref in base["params"].items():
            got = result["params"][name]
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), (
                f"1.4: training with --all-reduce {strategy} ends with a different {name} than "
                f"with torch (max diff {(got - ref).abs().max():.2e})"
            )
    sent = {
        s: results[s]["epochs"][0]["bytes_sent_per_step"]
        for s in ("reduce_broadcast", "direct_exchange")
    }
    # averaged over ranks: reduce_broadcast 2(n-1)/n·S, direct exchange (n-1)·S
    assert sent["reduce_broadcast"] == pytest.approx(2 * (world_size - 1) / world_size * size)
    assert sent["direct_exchange"] == pytest.approx((world_size - 1) * size)


@exercise("1.4")
@pytest.mark.parametrize(
    ("argv", "world_size", "expected"),
    [
        (["--global-batch-size", "63"], "2", ["63", "multiple of 2"]),
        (["--all-reduce", "ring"], "2", ["'ring'", "reduce_broadcast"]),
        (["--model", "resnet"], "1", ["'resnet'", "cnn"]),
    ],
)
def test_bad_arguments_fail_before_training(
    argv: list[str], world_size: str, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = trainer_module()
    monkeypatch.setenv("WORLD_SIZE", world_size)
    monkeypatch.setenv("RANK", "0")
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        code = trainer.main(argv)
    assert code == 2, f"1.4: main({argv}) should return 2 before training, returned {code}"
    assert not dist.is_initialized(), "1.4: the error must come before init_process_group"
    for word in expected:
        assert word in stderr.getvalue(), (
            f"1.4: the error should mention {word}: {stderr.getvalue()!r}"
        )


@exercise("1.4")
def test_trainer_runs_under_torchrun() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        module_name(PHASE, "trainer"),
        "--epochs",
        "1",
        "--train-samples",
        "512",
        "--model",
        "mlp",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise_rank_error(done.stdout + done.stderr, done.returncode)
    assert "epoch 1/1" in done.stdout and "test acc" in done.stdout, (
        f"1.4: torchrun succeeded but printed no epoch line:\n{done.stdout[-1500:]}"
    )


EXCEPTION_LINE = re.compile(r"^(?P<type>[A-Za-z_.]*(?:Error|Exception)): (?P<message>.*)$")


def raise_rank_error(output: str, returncode: int) -> None:
    """Turn a failed torchrun's wall of text into the first rank error it contains."""
    for line in output.splitlines():
        match = EXCEPTION_LINE.match(line.strip())
        if not match or "ChildFailedError" in match["type"]:
            continue
        if match["type"] == "NotImplementedError":
            raise NotImplementedError(match["message"])
        pytest.fail(
            f"1.4: torchrun exited with {returncode}; a rank raised {line.strip()}", pytrace=False
        )
    pytest.fail(f"1.4: torchrun exited with {returncode}:\n{output[-1500:]}", pytrace=False)
