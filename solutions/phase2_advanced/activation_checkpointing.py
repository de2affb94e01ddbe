"""Exercise 2.3: activation checkpointing by hand, memory traded for recomputation.

Backward needs activations from forward: a plain n-layer network keeps all n of them until
backward reaches them. Checkpointing drops the activations inside a segment of layers during the
forward and gets them back in backward by running that segment's forward a second time, just
before they are needed (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016).
With n layers cut into k segments the peak is about k + n/k activations, smallest near
k = sqrt(n): O(sqrt n) memory for one extra forward.

The second forward must be the *same* computation as the first:

* Dropout draws a new mask every call: the recomputed forward must draw the same masks, and
  the caller's random stream must carry on afterwards as if nothing had been replayed.
* A forward under autocast must be recomputed under the same autocast (recorded for you).

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
    """Runs ``run_function(*args)`` without keeping its activations for backward; backward
    gets them back by running it again.

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
        # TODO 2.3: keep what backward needs to run this forward again, then run it.
        # Invariant: returns what run_function(*args) returns; nothing computed inside
        #   run_function is kept for backward (the bytes saved equal torch.utils.checkpoint's);
        #   backward can replay the very random numbers this call draws.
        # Hint 1: backward will call run_function a second time and must get bitwise the same
        #   result, dropout included.
        # Hint 2: What does a second call of run_function need: which tensors, which other
        #   arguments, and which state outside the arguments (think of dropout)? Must that state
        #   be read before or after the call? What does ctx.save_for_backward give a tensor that
        #   an attribute of ctx does not?
        # Hint 3: The state is the random number generators': the CPU's and, for each CUDA
        #   device among the inputs (_cuda_devices), that device's; read before the call, when
        #   preserve_rng_state is set.
        # Hint 4: The only tensors kept are the arguments themselves, through
        #   ctx.save_for_backward; the non-tensor arguments and the positions of the tensor ones
        #   go on ctx as plain attributes. Nothing the call computes is kept.
        # Hint 5: When preserve_rng_state: torch.get_rng_state, the CUDA devices of the inputs
        #   and torch.cuda.get_rng_state of each, as attributes of ctx. Always: the positions of
        #   the tensor arguments, a copy of the arguments with those positions blanked, and the
        #   tensor arguments saved with ctx.save_for_backward. Then return the call of
        #   run_function on every argument, inside torch.no_grad (a Function's forward runs
        #   without grad anyway; the block says so).
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
        # TODO 2.3: run the forward again, recording this time, and backpropagate through it.
        # Invariant: one entry per argument of forward (the gradient of each tensor argument
        #   that requires one, None for everything else), bitwise equal to the plain function's
        #   gradients, dropout included; afterwards the caller's random stream is where it was
        #   before this backward began.
        # Hint 1: the saved tensors come back without a graph, and the second run must draw the
        #   same random numbers under the same autocast as the first.
        # Hint 2: What must be true of a tensor for autograd to fill its .grad, and how do you get
        #   such a tensor from a saved one without touching the caller's tensor? How do you put
        #   the saved random state back for the second run and still leave the caller's stream
        #   as it was? Through which outputs, starting from which gradients, does the backward
        #   go?
        # Hint 3: Recompute from fresh leaves: each saved tensor detached, then asking for a
        #   gradient exactly when the original did; their .grad after the backward is what you
        #   return.
        # Hint 4: Put the saved states back inside a torch.random.fork_rng block (over the saved
        #   CUDA devices, enabled by preserve_rng_state): the block undoes every change to the
        #   generators when it ends, so the caller's stream is untouched.
        # Hint 5: The backward starts from the recomputed outputs that require grad, each with
        #   the grad_output autograd handed you for it (torch.autograd.backward takes both lists).
        # Hint 6: Rebuild the arguments with the fresh leaves in the tensor positions; inside the
        #   fork_rng block restore the CPU and CUDA states saved in forward, then call
        #   run_function under torch.enable_grad and _reentered_autocast of the saved autocast
        #   states; backpropagate the (output, gradient) pairs whose output requires grad;
        #   return three Nones (run_function, preserve_rng_state, anchor), then, per argument,
        #   the .grad of its leaf or None.
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
    """``functions(input)``, run in ``segments`` pieces and checkpointed as
    ``torch.utils.checkpoint.checkpoint_sequential`` does.

    Pieces are ``len(functions) // segments`` layers long and the last piece takes the rest,
    as in ``torch.utils.checkpoint.checkpoint_sequential``.
    """
    n = len(functions)
    if not 1 <= segments <= n:
        raise ValueError(
            f"segments={segments} for {n} layers: use between 1 and {n} segments (about the "
            "square root of the number of layers that save activations minimises memory)"
        )
    # TODO 2.3: run the layers segment by segment, checkpointing where it pays.
    # Invariant: returns functions(input); the bytes kept for backward and the number of
    #   forward calls of every layer are those of torch.utils.checkpoint.checkpoint_sequential
    #   with the same segment count.
    # Hint 1: _run_layers(functions, a, b) makes a function that runs layers a..b inclusive;
    #   the docstring says how long each segment is.
    # Hint 2: Which segment's backward runs first, right after the forward ends? What would
    #   checkpointing that segment save, and what would it cost? How does the output of one
    #   segment reach the next?
    # Hint 3: Every segment but the last goes through checkpoint; the last runs plainly: its
    #   activations are needed as soon as the forward ends, so recomputing them saves nothing
    #   and adds a forward.
    # Hint 4: With size the integer quotient of n by segments, the segments start at 0, size,
    #   2·size, ...: each but the last replaces the running input by checkpoint of the function
    #   _run_layers makes for its layers; the layers from size·(segments − 1) to n − 1 then run
    #   directly on the running input, and their output is returned.
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
