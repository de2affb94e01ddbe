"""The device's peak FLOP/s and a rank's peak memory, for 4.5's MFU (given, not an exercise).

MFU divides the model's achieved FLOP/s by the device's *dense* peak (no 2:4 sparsity): for a
known GPU the vendor's datasheet number (:data:`PEAK_TFLOPS`), for a CPU or an unknown GPU a
measurement (:func:`measure_matmul_flops`: the best of a few square matmuls, an achievable peak,
not a datasheet's; on a shared machine it moves with the load, so compare MFUs measured against
it only within one run). :func:`peak_memory_bytes` is what the monitor reports as memory:
``torch.cuda.max_memory_allocated`` on a GPU, the process's peak resident set on a CPU.
"""

from __future__ import annotations

import time

import torch

# Dense peak TFLOP/s per device (no 2:4 sparsity), from the vendors' datasheets: (name fragment,
# lower case, most specific first) -> {precision: TFLOP/s}. tf32 is what fp32 matmuls use when
# torch.backends.cuda.matmul.allow_tf32 is on.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h100 pcie", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("h100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM (HBM3)
    ("h200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("a100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("v100", {"fp16": 125.0, "fp32": 15.7}),
    ("l4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("mi300x", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
)
_MEASURED: dict[tuple[str, torch.dtype], float] = {}


def precision_name(dtype: torch.dtype) -> str:
    """bf16, fp16, tf32 (fp32 matmuls on tensor cores, when allowed) or fp32."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype = torch.float32, size: int = 512, repeats: int = 5
) -> float:
    """FLOP/s of the best of ``repeats`` square matmuls: an achievable peak, not a datasheet's."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    return 2.0 * size**3 / best


def peak_flops_per_second(
    device: torch.device | str, dtype: torch.dtype = torch.float32, *, override: float | None = None
) -> tuple[float, str]:
    """The peak FLOP/s MFU divides by, and where it came from (for the log).

    ``override`` (FLOP/s, e.g. from a ``--peak-tflops`` flag x 1e12) wins; a GPU found in
    :data:`PEAK_TFLOPS` uses its datasheet's dense peak for ``dtype``; anything else (a CPU, an
    unknown GPU) is measured once with :func:`measure_matmul_flops`.
    """
    device = torch.device(device)
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOP/s {override}: must be positive")
        return override, "given"
    precision = precision_name(dtype)
    if device.type != "cuda" and precision == "tf32":
        precision = "fp32"  # tf32 is a GPU tensor-core mode
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peaks in PEAK_TFLOPS:
            if fragment in name.lower() and precision in peaks:
                return peaks[precision] * 1e12, f"datasheet: {name} {precision} dense"
    key = (str(device), dtype)
    if key not in _MEASURED:
        _MEASURED[key] = measure_matmul_flops(device, dtype)
    return _MEASURED[key], f"measured: {precision} 512x512 matmul on {device}"


def peak_memory_bytes(device: torch.device | str) -> int:
    """The most memory this rank has held: ``torch.cuda.max_memory_allocated`` on a GPU (tensors
    only, the number that runs out first); on a CPU the process's peak resident set size
    (``resource.getrusage``: KiB on Linux, bytes on macOS), everything the process touched."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
