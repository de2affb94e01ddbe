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
    # Hint 2: Which one integer operation gives both the common count and the number of layers left
    #   over? How many ranks get one more layer, and which ones?
    # Hint 3: The common count and the remainder come from one integer division: 7 layers over 3
    #   ranks give 2 each, with 1 left over.
    # Hint 4: The remainder's layers go one each to the first ranks: with 1 left over, rank 0 gets 3
    #   and ranks 1 and 2 get 2.
    # Hint 5: divmod of num_layers by world_size gives the base and the extra; rank r gets base + 1
    #   layers when r is below extra, base otherwise, in a list over the ranks.
    # See guidelines.md#24-naive-model-parallelism
    # >>> solution
    base, extra = divmod(num_layers, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]
    # <<< solution


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
    # Hint 2: How many messages does the receiver need, and which must come first? Which message has
    #   a size the receiver always knows? Which argument of dist.send names the peer as a rank
    #   within the group? What does torch require of the memory of a tensor it sends, and what of
    #   its autograd graph?
    # Hint 3: Two messages to the same peer: first encode_header of the tensor (its size is fixed),
    #   then the data.
    # Hint 4: The peer goes in as group_dst together with the group (dst would be a global rank);
    #   the data is the tensor detached and made contiguous (a transposed or sliced activation is
    #   not, and torch refuses to send it).
    # Hint 5: dist.send of encode_header of the tensor, then dist.send of the tensor detached and
    #   contiguous, both with the group and group_dst set to dst.
    # See guidelines.md#24-naive-model-parallelism
    # >>> solution
    dist.send(encode_header(tensor), group=group, group_dst=dst)
    dist.send(tensor.detach().contiguous(), group=group, group_dst=dst)
    # <<< solution


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
    # Hint 2: What do you receive first, into which buffer? How do you turn what it says into a
    #   buffer of the right dtype and shape? Which argument of dist.recv names the peer as a rank
    #   within the group? What does torch.empty allocate when no dtype is given?
    # Hint 3: First the header, into empty_header on `device`; decode_header of it says the dtype
    #   and the shape.
    # Hint 4: The TensorMeta that decode_header returns allocates the data buffer itself (its empty,
    #   on `device`): torch.empty of the shape alone would be float32 whatever the header said.
    # Hint 5: dist.recv into empty_header of the device, with the group and group_src set to src;
    #   decode_header of it, and its empty on the device; a second dist.recv the same way into that
    #   buffer; return it.
    # See guidelines.md#24-naive-model-parallelism
    # >>> solution
    header = empty_header(device)
    dist.recv(header, group=group, group_src=src)
    buffer = decode_header(header).empty(device)
    dist.recv(buffer, group=group, group_src=src)
    return buffer
    # <<< solution


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
        # Hint 2: Which rank computes on the batch it is given, and which receive their input, from
        #   which rank? What must a received tensor be made into so that backward fills its .grad?
        #   What does backward need saved on self? Which rank returns the output, and what do the
        #   others do with theirs?
        # Hint 3: The first rank computes on the given batch (moved to self.device); every other
        #   rank receives from rank − 1 of the group (recv_activation on self.group) and marks what
        #   arrived as requiring grad.
        # Hint 4: Every rank runs self.layers on its input and saves input and output on self; the
        #   last rank returns its output, the others send it to rank + 1 (send_activation on
        #   self.group) and return None.
        # Hint 5: Input: the batch on self.device on the first rank, else recv_activation from rank
        #   − 1 onto self.device on self.group with requires_grad_ on it; output: self.layers of the
        #   input; both saved; returned on the last rank, else send_activation to rank + 1 on
        #   self.group and None.
        # See guidelines.md#24-naive-model-parallelism
        # >>> solution
        if self.is_first:
            assert inputs is not None
            stage_input = inputs.to(self.device)
        else:
            stage_input = recv_activation(
                self.rank - 1, self.device, group=self.group
            ).requires_grad_()
        stage_output = self.layers(stage_input)
        self.stage_input, self.stage_output = stage_input, stage_output
        if self.is_last:
            return stage_output
        send_activation(stage_output, self.rank + 1, group=self.group)
        return None
        # <<< solution

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
        # Hint 2: Which rank starts from the loss, and which from a message, sent by which rank?
        #   Into what buffer does that message arrive, and does it need a header? Which rank sends
        #   nothing back? What does a first stage without parameters (only Flatten) still have to
        #   receive, and can it call backward? What is left on self afterwards?
        # Hint 3: The last rank backpropagates the loss; the others receive their output's gradient
        #   from rank + 1 into a buffer like their saved output (torch.empty_like), no header
        #   needed.
        # Hint 4: Backward of the saved output with that gradient, only when the output requires
        #   grad (a lone Flatten's does not: it receives and stops there); then every rank but the
        #   first sends its saved input's .grad to rank − 1.
        # Hint 5: Receive with dist.recv on self.group with group_src rank + 1; backward of the
        #   saved output with it; dist.send of the saved input's grad on self.group with group_dst
        #   rank − 1; then both saved tensors set to None.
        # See guidelines.md#24-naive-model-parallelism
        # >>> solution
        if self.is_last:
            assert loss is not None
            loss.backward()
        else:
            output_grad = torch.empty_like(self.stage_output)
            dist.recv(output_grad, group=self.group, group_src=self.rank + 1)
            if self.stage_output.requires_grad:
                self.stage_output.backward(output_grad)
        if not self.is_first:
            assert self.stage_input is not None and self.stage_input.grad is not None
            dist.send(self.stage_input.grad, group=self.group, group_dst=self.rank - 1)
        self.stage_input = self.stage_output = None
        # <<< solution


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
