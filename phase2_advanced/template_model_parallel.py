# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
"""Exercise 2.4: naive model parallelism, one model cut into consecutive stages, one per rank.

When a model does not fit on one device, the simplest cut is by depth: rank 0 holds the first
layers, rank 1 the next ones, and so on. Parameters never move; only activations cross rank
boundaries forward, and their gradients backward.

Because every rank runs exactly the single-device model's operations on the single-device
model's values, the loss and every gradient equal the single-device model's (bitwise, on CPU).
The price is that only one rank computes at a time: with n ranks each is idle (n-1)/n of the
step. Pipeline parallelism (exercise 2.5; Huang et al., "GPipe", 2019) splits the batch into
micro-batches to fill that idle time.

Everything here runs on a process group, the default one unless ``group=`` names another (a
pipeline group of a 3D layout, say): "rank" means the rank *within* that group, and the stages
are laid out over the group's ranks 0, 1, ... The demo that trains with it, beside the
single-device model, is ``demos/model_parallel.py``:

    uv run torchrun --standalone --nproc_per_node=2 \\
        -m solutions.phase2_advanced.demos.model_parallel
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from course.distributed import current_info
from course.tensor_header import decode_header, empty_header, encode_header

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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

    Sizes differ by at most one, and the earlier ranks take the extra layers (7 layers over 3
    ranks: [3, 2, 2]).
    Counting layers (not parameters or FLOPs) is the naive choice: exercise 2.5 balances stages
    by measured cost instead.
    """
    check_split(num_layers, world_size)
    # TODO 2.4: split num_layers into world_size consecutive counts, as even as possible.
    # Invariant: len(result) == world_size, sum(result) == num_layers, every count >= 1 and
    #   max(result) - min(result) <= 1; the EARLIER ranks take the extra layers (7 layers over 3
    #   ranks is [3, 2, 2], not [2, 2, 3]).
    # Hint 1: if the layers divided evenly, what would every rank get? What is left over otherwise?
    # More hints: uv run python -m tests.hint 2.4
    # See guidelines.md#24-naive-model-parallelism
    raise NotImplementedError(
        "TODO 2.4: split num_layers into world_size consecutive counts, as even as possible "
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
# The header format (dtype code, ndim, sizes) is course/tensor_header.py, shared with
# the pipeline executor of exercise 2.5: encode_header(tensor) makes one, empty_header(device) is
# a buffer to receive one into, decode_header(header) gives back a TensorMeta (.shape, .dtype)
# whose .empty(device) allocates the buffer the data lands in.


def send_activation(
    tensor: torch.Tensor, dst: int, *, group: dist.ProcessGroup | None = None
) -> None:
    """Send a tensor whose shape and dtype the receiver does not know yet, to rank ``dst`` of
    ``group`` (the default group when None).

    A receiver must post a buffer of exactly the right size, and the activation's shape depends
    on the batch (the last batch of an epoch is often smaller), so it cannot be hard-coded.
    """
    # TODO 2.4: send `tensor` to rank dst, so that a receiver who knows nothing of it can take it.
    # Invariant: the receiver learns the dtype and the shape before the data arrives and can
    #   allocate exactly the buffer for it; the data travels without its autograd graph; `dst` is a
    #   rank within `group`, never mistaken for a global rank; nothing but the data and a header is
    #   sent.
    # Hint 1: dist.recv fills a buffer its caller allocated. What must the receiver know before it
    #   can allocate one, and what in course/tensor_header.py can tell it?
    # More hints: uv run python -m tests.hint 2.4
    # See guidelines.md#24-naive-model-parallelism
    raise NotImplementedError(
        "TODO 2.4: send `tensor` to rank dst, so that a receiver who knows nothing of it can take "
        "it "
        "(see phase2_advanced/guidelines.md#24-naive-model-parallelism)"
    )


def recv_activation(
    src: int, device: torch.device, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Receive a tensor sent by :func:`send_activation` from rank ``src`` of ``group``, onto
    ``device``."""
    # TODO 2.4: receive what send_activation sent from rank src, onto `device`.
    # Invariant: returns a new tensor with the sender's dtype, shape and values, on `device`. The
    #   buffer has exactly the message's size (dtype AND shape): gloo aborts the process when a
    #   message does not fit the buffer posted for it.
    # Hint 1: which of the sender's two messages can you post a buffer for without knowing anything,
    #   and what does it tell you about the other?
    # More hints: uv run python -m tests.hint 2.4
    # See guidelines.md#24-naive-model-parallelism
    raise NotImplementedError(
        "TODO 2.4: receive what send_activation sent from rank src, onto `device` "
        "(see phase2_advanced/guidelines.md#24-naive-model-parallelism)"
    )


# ----------------------------------------------------------------------------- the stage


class ModelParallelStage(nn.Module):
    """This rank's consecutive slice of an ``nn.Sequential``, linked to its neighbour ranks.

    Every rank builds the whole (small) model from the same seed and keeps only its layers, so
    the stage's weights are the single-device model's; a real run would build only its own
    layers. Parameter names keep the full model's layer indices (``3.weight``), so gradients can
    be compared with the single-device model's by name.

    The stages are laid out over the ranks of ``group`` (the default group when None): ``rank``
    and ``world_size`` are this process's rank in it and its size, read from the group unless
    given. One step is ``forward`` (the first rank is given the batch) and ``backward`` (the last
    rank is given the loss).
    """

    def __init__(
        self,
        model: nn.Sequential,
        rank: int | None = None,
        world_size: int | None = None,
        device: torch.device | None = None,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else rank
        self.world_size = dist.get_world_size(group) if world_size is None else world_size
        self.start, self.stop = stage_bounds(len(model), self.world_size, self.rank)
        children = list(model.named_children())[self.start : self.stop]
        self.layers = nn.Sequential(OrderedDict(children))
        self.device = device if device is not None else current_info().device
        # Saved by forward for backward: the stage's input and its output (the guide's contract
        # says what they hold, and when).
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

        The first rank is given the batch as ``inputs`` (ignored on the other ranks). Only the
        last rank returns a tensor; the others return ``None``.
        """
        if self.is_first and inputs is None:
            raise ValueError("rank 0 holds the first layers: call forward(inputs) with the batch")
        # TODO 2.4: this rank's part of the forward: its input, its layers, its output.
        # Invariant: afterwards self.stage_input and self.stage_output hold this rank's input and
        #   output of the step; on every rank but the first, self.stage_input is a leaf that
        #   requires grad; only the last rank returns a tensor. Peers are ranks within self.group.
        # Hint 1: a received tensor is a fresh leaf that asks for no gradient. Where does each
        #   rank's input come from, and where does its output go?
        # More hints: uv run python -m tests.hint 2.4
        # See guidelines.md#24-naive-model-parallelism
        raise NotImplementedError(
            "TODO 2.4: this rank's part of the forward: its input, its layers, its output "
            "(see phase2_advanced/guidelines.md#24-naive-model-parallelism)"
        )

    def backward(self, loss: torch.Tensor | None = None) -> None:
        """Backpropagate through this rank's layers after :meth:`forward`.

        The last rank is given the ``loss`` (``None`` on the others). Gradients accumulate into
        this stage's parameters' ``.grad``, as in the single-device model.
        """
        if self.stage_output is None:
            raise RuntimeError("backward() without forward(): run forward first on every rank")
        if self.is_last and loss is None:
            raise ValueError(f"rank {self.rank} is the last stage: call backward(loss)")
        # TODO 2.4: backpropagate through this stage and pass the input's gradient back.
        # Invariant: afterwards this stage's parameters hold their single-device gradients; each
        #   boundary carries one gradient back, matched by one receive, so no rank waits for a
        #   message that never comes; self.stage_input and self.stage_output are None, so the step's
        #   activations (and the graph they hold) are freed.
        # Hint 1: the gradient of this rank's output has the output's shape and dtype, which this
        #   rank already knows. What starts this rank's backward, and what does the rank before need
        #   from it?
        # More hints: uv run python -m tests.hint 2.4
        # See guidelines.md#24-naive-model-parallelism
        raise NotImplementedError(
            "TODO 2.4: backpropagate through this stage and pass the input's gradient back "
            "(see phase2_advanced/guidelines.md#24-naive-model-parallelism)"
        )


def forward_backward(
    stage: ModelParallelStage,
    inputs: torch.Tensor | None,
    targets: torch.Tensor | None,
    loss_fn: LossFn,
) -> torch.Tensor | None:
    """One model-parallel forward and backward; returns the loss on the last rank, else None.

    ``inputs`` are needed on the first rank and ``targets`` on the last; other ranks may pass
    ``None`` (or the same tensors: they are ignored). The stage carries its process group.
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
