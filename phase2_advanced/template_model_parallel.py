# Exercise template generated from solutions/phase2_advanced/model_parallel.py.
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
"""Exercise 2.4: naive model parallelism, one model cut into consecutive stages, one per rank.

When a model does not fit on one device, the simplest cut is by depth: rank 0 holds the first
layers, rank 1 the next ones, and so on. A batch flows forward through the ranks (each sends its
output activation to the next rank), the last rank computes the loss, and the gradient flows back
(each rank sends the gradient of its input to the previous rank). Parameters never move; only
activations and their gradients cross rank boundaries::

    rank 0: layers 0-2 --activation--> rank 1: layers 3-5 --activation--> rank 2: ... -> loss
            layers 0-2 <---gradient--- rank 1: layers 3-5 <---gradient--- rank 2: ... <- backward

Because every rank runs exactly the single-device model's operations on the single-device
model's values, the loss and every gradient equal the single-device model's (bitwise, on CPU).
The price is that only one rank computes at a time: with n ranks each is idle (n-1)/n of the
step. Pipeline parallelism (exercise 2.5; Huang et al., "GPipe", 2019) splits the batch into
micro-batches to fill that idle time.

Run it (instructor command; at most as many processes as the model has layers):

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.model_parallel
    uv run torchrun --standalone --nproc_per_node=4 -m solutions.phase2_advanced.model_parallel \
        --model cnn --dtype float64
"""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from solutions.common.cli import parse_config, refuse_before_start
from solutions.common.comm_counter import CommCounter
from solutions.common.datasets import PatternSpec, make_pattern_dataset
from solutions.common.distributed import (
    current_info,
    distributed_session,
)
from solutions.common.models import MLP, BabyCNN
from solutions.common.rank_logging import log0
from solutions.common.seeding import seed_everything

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The header that precedes every activation: [dtype code, ndim, size_0, ..., size_{ndim-1}, -1...].
# Its length is fixed, so a receiver can always post the matching recv before knowing anything.
HEADER_SLOTS = 8
MAX_DIMS = HEADER_SLOTS - 2
WIRE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)


# ----------------------------------------------------------------------------- the split


def check_split(num_layers: int, world_size: int) -> None:
    """Refuse a split that leaves a rank without a layer, with a message that says the fix."""
    if world_size < 1:
        raise ValueError(f"world size {world_size}: need at least one process")
    if num_layers < world_size:
        raise ValueError(
            f"cannot split {num_layers} layers over {world_size} ranks: naive model parallelism "
            f"gives every rank at least one whole layer; run at most {num_layers} processes "
            f"(--nproc_per_node={num_layers}) or use a model with at least {world_size} layers"
        )


def split_sizes(num_layers: int, world_size: int) -> list[int]:
    """How many consecutive layers each rank holds, as evenly as possible by layer count.

    Sizes differ by at most one; the first ``num_layers % world_size`` ranks take one more.
    Counting layers (not parameters or FLOPs) is the naive choice: exercise 2.5 balances stages
    by measured cost instead.
    """
    check_split(num_layers, world_size)
    # TODO 2.4: split num_layers into world_size consecutive counts that differ by at most one.
    # Invariant: len(result) == world_size, sum(result) == num_layers, every count >= 1 and
    #   max(result) - min(result) <= 1 (earlier ranks take the extra layers).
    # Hint 1: divmod gives the base count and how many ranks need one layer more.
    # Hint 2: base, extra = divmod(num_layers, world_size);
    #   return [base + (1 if rank < extra else 0) for rank in range(world_size)]
    # See guidelines.md#24-naive-model-parallelism
    raise NotImplementedError(
        "TODO 2.4: split num_layers into world_size consecutive counts that differ by at most one "
        "(see phase2_advanced/guidelines.md#24-naive-model-parallelism)"
    )


def stage_bounds(num_layers: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)``: the layer indices ``start <= i < stop`` that ``rank`` holds."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, {world_size - 1}]")
    sizes = split_sizes(num_layers, world_size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


# ----------------------------------------------------------------------------- the messages


def encode_header(tensor: torch.Tensor) -> torch.Tensor:
    """The fixed-size int64 header describing ``tensor``: dtype code, ndim, sizes, -1 padding."""
    if tensor.dtype not in WIRE_DTYPES:
        raise ValueError(f"cannot send {tensor.dtype}: supported dtypes are {WIRE_DTYPES}")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(
            f"cannot send a {tensor.dim()}-d tensor: the header holds at most {MAX_DIMS} sizes "
            "(raise HEADER_SLOTS)"
        )
    header = torch.full((HEADER_SLOTS,), -1, dtype=torch.int64)
    header[0] = WIRE_DTYPES.index(tensor.dtype)
    header[1] = tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header.to(tensor.device)


def decode_header(header: torch.Tensor) -> tuple[torch.dtype, list[int]]:
    """``(dtype, shape)`` from a header made by :func:`encode_header`."""
    values = header.tolist()
    ndim = values[1]
    return WIRE_DTYPES[values[0]], values[2 : 2 + ndim]


def send_activation(tensor: torch.Tensor, dst: int) -> None:
    """Send a tensor whose shape and dtype the receiver does not know yet.

    Two messages: the fixed-size header (:func:`encode_header`), then the data. A receiver must
    post a buffer of exactly the right size, and the activation's shape depends on the batch
    (the last batch of an epoch is often smaller), so it cannot be hard-coded.
    """
    # TODO 2.4: send the header describing `tensor`, then the tensor itself, to rank dst.
    # Invariant: the receiver learns dtype and shape from the first message and can allocate
    #   the buffer for the second; the data is sent from contiguous memory.
    # Hint 1: encode_header(tensor) builds the first message; dist.send sends one tensor.
    # Hint 2: dist.send(encode_header(tensor), dst=dst);
    #   dist.send(tensor.detach().contiguous(), dst=dst)
    # See guidelines.md#24-naive-model-parallelism
    raise NotImplementedError(
        "TODO 2.4: send the header describing `tensor`, then the tensor itself, to rank dst "
        "(see phase2_advanced/guidelines.md#24-naive-model-parallelism)"
    )


def recv_activation(src: int, device: torch.device) -> torch.Tensor:
    """Receive a tensor sent by :func:`send_activation` on rank ``src``, onto ``device``."""
    # TODO 2.4: receive the header from rank src, allocate the buffer it describes, receive.
    # Invariant: returns a new tensor with the sender's dtype, shape and values, on `device`.
    # Hint 1: the header is HEADER_SLOTS int64 values; decode_header turns it into
    #   (dtype, shape).
    # Hint 2: header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=device);
    #   dist.recv(header, src=src); dtype, shape = decode_header(header);
    #   buf = torch.empty(shape, dtype=dtype, device=device); dist.recv(buf, src=src); return buf
    # See guidelines.md#24-naive-model-parallelism
    raise NotImplementedError(
        "TODO 2.4: receive the header from rank src, allocate the buffer it describes, receive "
        "(see phase2_advanced/guidelines.md#24-naive-model-parallelism)"
    )


# ----------------------------------------------------------------------------- the stage


class ModelParallelStage(nn.Module):
    """This rank's consecutive slice of an ``nn.Sequential``, linked to its neighbour ranks.

    Every rank builds the whole (small) model from the same seed and keeps only its layers, so
    the stage's weights are the single-device model's; a real run would build only its own
    layers. Parameter names keep the full model's layer indices (``3.weight``), so gradients can
    be compared with the single-device model's by name.

    One step is ``forward`` (first rank: given the batch; others: receive it) and ``backward``
    (last rank: given the loss; others: receive the gradient of their output).
    """

    def __init__(
        self,
        model: nn.Sequential,
        rank: int | None = None,
        world_size: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.start, self.stop = stage_bounds(len(model), self.world_size, self.rank)
        children = list(model.named_children())[self.start : self.stop]
        self.layers = nn.Sequential(OrderedDict(children))
        self.device = device if device is not None else current_info().device
        # Saved by forward for backward: the stage's input (a leaf that requires grad on every
        # rank but the first, so its .grad is what goes back) and its output.
        self.stage_input: torch.Tensor | None = None
        self.stage_output: torch.Tensor | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def named_parameters_in_model(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This stage's parameters under their names in the full model (``"3.weight"``)."""
        return self.layers.named_parameters()

    def forward(self, inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run this rank's layers on one batch; the last rank returns the model's output.

        The first rank computes on ``inputs``; every other rank receives its input from the rank
        before (``inputs`` is ignored there). Every rank but the last sends its output to the
        next rank and returns ``None``.
        """
        if self.is_first and inputs is None:
            raise ValueError("rank 0 holds the first layers: call forward(inputs) with the batch")
        # TODO 2.4: get this stage's input, run self.layers, pass the output on (or return it).
        # Invariant: afterwards self.stage_input and self.stage_output hold what backward
        #   needs; on every rank but the first, self.stage_input is a leaf that requires grad,
        #   so backward fills its .grad; only the last rank returns a tensor.
        # Hint 1: a received tensor is a fresh leaf with requires_grad=False: autograd would
        #   not compute its gradient, and there would be nothing to send back. Call
        #   .requires_grad_() on it. Send the detached output on with send_activation.
        # Hint 2: x = inputs if first else recv_activation(rank - 1, self.device)
        #   .requires_grad_(); out = self.layers(x); save both; if last: return out;
        #   send_activation(out, rank + 1); return None
        # See guidelines.md#24-naive-model-parallelism
        raise NotImplementedError(
            "TODO 2.4: get this stage's input, run self.layers, pass the output on (or return it) "
            "(see phase2_advanced/guidelines.md#24-naive-model-parallelism)"
        )

    def backward(self, loss: torch.Tensor | None = None) -> None:
        """Backpropagate through this rank's layers after :meth:`forward`.

        The last rank starts from ``loss``; every other rank first receives the gradient of its
        output from the next rank. Every rank but the first then sends the gradient of its input
        to the rank before. Gradients accumulate into this stage's parameters' ``.grad``.
        """
        if self.stage_output is None:
            raise RuntimeError("backward() without forward(): run forward first on every rank")
        if self.is_last and loss is None:
            raise ValueError(f"rank {self.rank} is the last stage: call backward(loss)")
        # TODO 2.4: backpropagate through this stage and send the input's gradient back.
        # Invariant: every rank receives exactly one gradient (except the last) and sends
        #   exactly one (except the first), in the reverse order of forward, so no rank waits
        #   for a message that never comes; the saved tensors are dropped afterwards.
        # Hint 1: the gradient of the output has the output's shape, which this rank already
        #   knows: no header is needed on the way back. A first stage without parameters
        #   (e.g. only Flatten) has an output that does not require grad: receive the gradient
        #   anyway (the next rank sends it) but skip backward.
        # Hint 2: last: loss.backward(); else: grad = torch.empty_like(out);
        #   dist.recv(grad, src=rank + 1); if out.requires_grad: out.backward(grad).
        #   If not first: dist.send(self.stage_input.grad, dst=rank - 1). Reset both to None.
        # See guidelines.md#24-naive-model-parallelism
        raise NotImplementedError(
            "TODO 2.4: backpropagate through this stage and send the input's gradient back "
            "(see phase2_advanced/guidelines.md#24-naive-model-parallelism)"
        )


def forward_backward(
    stage: ModelParallelStage,
    inputs: torch.Tensor | None,
    targets: torch.Tensor | None,
    loss_fn: LossFn,
) -> torch.Tensor | None:
    """One model-parallel forward and backward; returns the loss on the last rank, else None.

    ``inputs`` is needed on the first rank and ``targets`` on the last; other ranks may pass
    ``None`` (or the same tensors: they are ignored).
    """
    if stage.is_last and targets is None:
        raise ValueError(f"rank {stage.rank} is the last stage and computes the loss: pass targets")
    output = stage(inputs)
    loss = None
    if stage.is_last:
        assert output is not None and targets is not None
        loss = loss_fn(output, targets.to(stage.device))
    stage.backward(loss)
    return None if loss is None else loss.detach()


# ----------------------------------------------------------------------------- the demo

MODELS = ("mlp", "cnn")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class DemoConfig:
    """The demo run; every rank must be given the same values."""

    model: str = "mlp"
    steps: int = 3
    batch_size: int = 32
    lr: float = 0.05
    dtype: str = "float32"
    seed: int = 0


def build_model(name: str, spec: PatternSpec) -> nn.Sequential:
    if name == "cnn":
        return BabyCNN(in_channels=1, num_classes=spec.num_classes)
    return MLP(spec.image_size * spec.image_size, hidden=64, num_classes=spec.num_classes)


def validate_config(config: DemoConfig, world_size: int) -> None:
    """Refuse a demo that cannot run, before any process group exists."""
    if config.model not in MODELS:
        raise ValueError(f"--model {config.model!r} is unknown: choose one of {', '.join(MODELS)}")
    if config.dtype not in DTYPES:
        raise ValueError(f"--dtype {config.dtype!r} is unknown: choose one of {', '.join(DTYPES)}")
    if config.steps < 1 or config.batch_size < 1:
        raise ValueError("--steps and --batch-size must be at least 1")
    check_split(len(build_model(config.model, PatternSpec())), world_size)


def _max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


@dataclass
class StepReport:
    """One demo step: the model-parallel loss beside the single-device one, and the traffic."""

    loss: float
    reference_loss: float
    max_grad_diff: float  # over every parameter of every rank
    bytes_sent_per_rank: list[int]


def run_demo(config: DemoConfig) -> list[StepReport]:
    """Train a few steps model-parallel and, beside it, the same model on one device.

    Every rank also runs the single-device model (it is small), so each can compare its own
    stage's gradients with the matching ones by name. Every rank returns the same reports.
    """
    info = current_info()
    validate_config(config, info.world_size)
    spec = PatternSpec()
    dtype = DTYPES[config.dtype]
    seed_everything(config.seed)
    model = build_model(config.model, spec).to(device=info.device, dtype=dtype)
    reference = copy.deepcopy(model)
    stage = ModelParallelStage(model)
    sizes = split_sizes(len(model), info.world_size)
    layout = ", ".join(
        f"rank {r}: layers {sum(sizes[:r])}-{sum(sizes[: r + 1]) - 1}" for r in range(len(sizes))
    )
    log0(
        f"naive model parallel: world {info.world_size}, backend {info.backend}, model "
        f"{config.model} ({len(model)} layers), {config.dtype}; {layout}"
    )
    parameters = list(stage.parameters())  # a stage of ReLU/pooling layers has none
    optimizer = torch.optim.SGD(parameters, lr=config.lr) if parameters else None
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=config.lr)
    loss_fn = nn.CrossEntropyLoss()
    data = make_pattern_dataset(config.steps * config.batch_size, spec, split_seed=0)
    images, labels = data.tensors
    last = info.world_size - 1
    reports = []
    for step in range(config.steps):
        batch = slice(step * config.batch_size, (step + 1) * config.batch_size)
        inputs = images[batch].to(device=info.device, dtype=dtype)
        targets = labels[batch].to(info.device)
        stage.zero_grad(set_to_none=True)
        with CommCounter() as comm:
            loss = forward_backward(stage, inputs, targets, loss_fn)
        loss_value = torch.zeros((), dtype=dtype, device=info.device) if loss is None else loss
        dist.broadcast(loss_value, src=last)
        ref_optimizer.zero_grad(set_to_none=True)
        ref_loss = loss_fn(reference(inputs), targets)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
        grad_diffs = [
            float((param.grad - ref_grads[name]).abs().max())
            for name, param in stage.named_parameters_in_model()
            if param.grad is not None
        ]
        grad_diff = _max_over_ranks(max(grad_diffs, default=0.0), info.device)
        sent = torch.tensor([comm.bytes_sent], dtype=torch.float64, device=info.device)
        per_rank = [torch.zeros_like(sent) for _ in range(info.world_size)]
        dist.all_gather(per_rank, sent)
        report = StepReport(
            loss_value.item(), ref_loss.item(), grad_diff, [int(t.item()) for t in per_rank]
        )
        log0(
            f"step {step + 1}/{config.steps}  loss {report.loss:.6f}  single device "
            f"{report.reference_loss:.6f}  |loss diff| "
            f"{abs(report.loss - report.reference_loss):.1e}  max |grad diff| "
            f"{report.max_grad_diff:.1e}  bytes sent per rank {report.bytes_sent_per_rank} "
            "(activations forward, gradients backward)"
        )
        if optimizer is not None:
            optimizer.step()
        ref_optimizer.step()
        reports.append(report)
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DemoConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate_config(config, world))) is not None:
        return code
    with distributed_session():
        run_demo(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
