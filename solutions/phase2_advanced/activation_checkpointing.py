"""Exercise 2.3: activation checkpointing by hand, memory traded for recomputation.

Backward needs activations from forward: a plain n-layer network keeps all n of them until
backward reaches them. Checkpointing keeps only the *input* of a segment, runs the segment's
forward without recording a graph, and in backward runs that forward again, this time recording,
to get the activations just before they are needed (Chen et al., "Training Deep Nets with
Sublinear Memory Cost", 2016). With n layers cut into k segments the peak is about
k boundary activations + n/k activations of the segment being recomputed, smallest near
k = sqrt(n): O(sqrt n) memory for one extra forward.

Two details make recomputation *exact*:

* RNG state. Dropout draws a new mask every call. The recomputed forward must draw the same
  mask, so the RNG state is saved before the first forward and restored (inside
  ``torch.random.fork_rng``, so the outer stream is untouched) before recomputing.
* Autocast state. A forward under autocast must be recomputed under the same autocast.

This mirrors PyTorch's reentrant ``torch.utils.checkpoint.checkpoint`` (torch/utils/checkpoint.py,
``CheckpointFunction``) and its ``checkpoint_sequential``, with one difference: an extra
zero-size tensor that requires grad is passed in, so the output requires grad even when no real
input does (the reentrant version silently drops the parameters' gradients in that case).
PyTorch now recommends its non-reentrant variant, built on ``saved_tensors_hooks``.

Checkpointing has no communication of its own: a checkpointed model trains under DDP unchanged.
The demo (memory measured, then data-parallel training) is demos/checkpointing.py:

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.demos.checkpointing
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def _autocast_states() -> list[tuple[str, bool, torch.dtype]]:
    """(device type, enabled, dtype) of autocast for CPU and, when present, CUDA."""
    device_types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [
        (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in device_types
    ]


def _cuda_devices(tensors: Sequence[Any]) -> list[int]:
    return sorted({t.device.index for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})


class CheckpointFunction(torch.autograd.Function):
    """Runs ``run_function(*args)`` without saving activations; recomputes them in backward.

    ``forward(ctx, run_function, preserve_rng_state, anchor, *args)``: ``anchor`` is a zero-size
    tensor with ``requires_grad=True`` that makes the output require grad whatever ``args`` are.
    """

    @staticmethod
    def forward(
        ctx: Any,
        run_function: Callable[..., Any],
        preserve_rng_state: bool,
        anchor: torch.Tensor,
        *args: Any,
    ) -> Any:
        ctx.run_function = run_function
        ctx.preserve_rng_state = preserve_rng_state
        ctx.autocast_states = _autocast_states()
        # TODO 2.3: remember what the recomputation needs, then run the forward without a graph.
        # Invariant: nothing inside run_function is saved for backward (only the inputs are);
        #   the RNG state saved is the one the forward below starts from.
        # Hint 1: backward will run the same forward again and must draw the same random
        #   numbers, so it needs the inputs and the RNG state as they are now (CPU, and each
        #   CUDA device among the inputs); running the forward without recording a graph is
        #   what saves the memory.
        # Hint 2: on ctx, only when preserve_rng_state: the CPU RNG state, the CUDA devices of
        #   the inputs (_cuda_devices) and their RNG states. Always: the positions of the tensor
        #   arguments and a copy of args with those positions blanked out, and the tensors
        #   themselves through the way autograd Functions save tensors for backward. Then the
        #   call itself, without grad, returned as it is.
        # Hint 3: torch.get_rng_state for the CPU and torch.cuda.get_rng_state for each CUDA
        #   device, kept as attributes of ctx; ctx.save_for_backward with the tensor arguments
        #   unpacked; the call of run_function on every argument inside a torch.no_grad block,
        #   its result returned from inside it.
        # See guidelines.md#23-activation-checkpointing
        # >>> solution
        if preserve_rng_state:
            ctx.cpu_rng = torch.get_rng_state()
            ctx.cuda_devices = _cuda_devices(args)
            ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.non_tensor_args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        with torch.no_grad():
            return run_function(*args)
        # <<< solution

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        # TODO 2.3: recompute the forward with a graph, then backpropagate through it.
        # Invariant: the recomputed forward sees the same inputs, RNG state and autocast state
        #   as the first one, so its outputs (dropout masks included) are bitwise the same; the
        #   caller's RNG stream is left as it was.
        # Hint 1: rebuild the inputs as fresh leaves (so their .grad is what you return),
        #   recompute with a graph under the forward's RNG and autocast state, without
        #   disturbing the caller's RNG stream, then backpropagate the incoming gradients
        #   through the recomputed outputs.
        # Hint 2: the arguments rebuilt with each saved tensor detached and asking for a
        #   gradient exactly when the original did; a forked RNG into which the saved states are
        #   restored; grad enabled and autocast re-entered (_reentered_autocast); the call; a
        #   backward of the outputs that require grad with their grad_outputs. Return one entry
        #   per forward input: three Nones (run_function, preserve_rng_state, anchor), then
        #   for each of args the .grad of its rebuilt copy (tensors) or None.
        # Hint 3: each saved tensor detached, then requires_grad_ set to the saved one's flag;
        #   torch.random.fork_rng over the saved CUDA devices, enabled by preserve_rng_state,
        #   inside which torch.set_rng_state and torch.cuda.set_rng_state put the saved states
        #   back; one `with` holding torch.enable_grad and _reentered_autocast of the saved
        #   autocast states around the call; torch.autograd.backward on the (output, gradient)
        #   pairs whose output requires grad.
        # See guidelines.md#23-activation-checkpointing
        # >>> solution
        args = list(ctx.non_tensor_args)
        for position, saved in zip(ctx.tensor_positions, ctx.saved_tensors, strict=True):
            args[position] = saved.detach().requires_grad_(saved.requires_grad)
        rng_devices = ctx.cuda_devices if ctx.preserve_rng_state else []
        with torch.random.fork_rng(devices=rng_devices, enabled=ctx.preserve_rng_state):
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_rng)
                for device, state in zip(ctx.cuda_devices, ctx.cuda_rng, strict=True):
                    torch.cuda.set_rng_state(state, device)
            with torch.enable_grad(), _reentered_autocast(ctx.autocast_states):
                outputs = ctx.run_function(*args)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs, strict=False)
            if isinstance(out, torch.Tensor) and out.requires_grad
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        grads = tuple(
            arg.grad if isinstance(arg, torch.Tensor) and i in ctx.tensor_positions else None
            for i, arg in enumerate(args)
        )
        return (None, None, None, *grads)
        # <<< solution


class _reentered_autocast:
    """Enter ``torch.autocast`` for each recorded (device type, enabled, dtype)."""

    def __init__(self, states: list[tuple[str, bool, torch.dtype]]) -> None:
        self.contexts = [torch.autocast(dt, enabled=on, dtype=dtype) for dt, on, dtype in states]

    def __enter__(self) -> None:
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc: object) -> None:
        for context in reversed(self.contexts):
            context.__exit__(None, None, None)


def checkpoint(function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
    """``function(*args)``, keeping only ``args`` for backward and recomputing the rest."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    anchor = torch.empty(0, device=device, requires_grad=True)
    return CheckpointFunction.apply(function, preserve_rng_state, anchor, *args)


def _run_layers(functions: nn.Sequential, start: int, end: int) -> Callable[[Any], Any]:
    def forward(x: Any) -> Any:
        for index in range(start, end + 1):
            x = functions[index](x)
        return x

    return forward


def checkpoint_sequential(
    functions: nn.Sequential, segments: int, input: torch.Tensor, preserve_rng_state: bool = True
) -> torch.Tensor:
    """Run ``functions`` in ``segments`` pieces; every piece but the last is checkpointed.

    Pieces are ``len(functions) // segments`` layers long and the last piece takes the rest,
    as in ``torch.utils.checkpoint.checkpoint_sequential``.
    """
    n = len(functions)
    if not 1 <= segments <= n:
        raise ValueError(
            f"segments={segments} for {n} layers: use between 1 and {n} segments (about the "
            "square root of the number of layers that save activations minimises memory)"
        )
    # TODO 2.3: checkpoint every segment but the last, which runs normally.
    # Invariant: same result as functions(input); only segment inputs are kept for backward,
    #   plus the activations of the last segment (its backward comes first, so recomputing it
    #   would buy nothing).
    # Hint 1: every piece has the same number of layers except the last, which takes what is
    #   left (the docstring above); _run_layers(functions, a, b) makes a function that runs
    #   layers a..b inclusive.
    # Hint 2: a loop over the first segments - 1 pieces, each replacing the running input by
    #   checkpoint() of that piece's layers; after the loop, the last piece's layers called
    #   directly on the running input. Every layer runs exactly once here.
    # Hint 3: size = n // segments; pieces start at 0, size, 2 * size, ...; the last runs
    #   from size * (segments - 1) to n - 1.
    # See guidelines.md#23-activation-checkpointing
    # >>> solution
    size = n // segments
    for start in range(0, size * (segments - 1), size):
        segment = _run_layers(functions, start, start + size - 1)
        input = checkpoint(segment, input, preserve_rng_state=preserve_rng_state)
    return _run_layers(functions, size * (segments - 1), n - 1)(input)
    # <<< solution


class CheckpointedSequential(nn.Module):
    """An ``nn.Sequential`` whose forward runs through :func:`checkpoint_sequential`.

    Wrapping it in DistributedDataParallel works: every parameter is still used once per
    forward, and its gradient arrives once, during the recomputing backward.
    """

    def __init__(self, layers: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.layers = layers
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return self.layers(x)
        return checkpoint_sequential(self.layers, self.segments, x)
