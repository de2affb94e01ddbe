"""The capstone's throughput: images/s, step breakdown and MFU beside torchvision's reference step.

    uv run python -m solutions.phase4_production.imagenet.benchmark              # a GPU: ResNet-50
    uv run python -m solutions.phase4_production.imagenet.benchmark --cpu-smoke  # tiny, on CPU

On a GPU the default is the issue's configuration: ResNet-50 at 224 px, per-GPU batch 256, bf16
autocast, channels_last, ``--steps`` timed steps after ``--warmup`` untimed ones (and after
compilation with ``--compile``). Without CUDA it runs a tiny configuration (``--cpu-smoke``:
ResNet-18 at 32 px, batch 8, fp32, NCHW) and prints the same columns. One process, one device,
no DDP: this measures what one GPU of the 8-GPU job does between two all-reduces.

Rows, all measured in the same run on the same device:

* **torchvision reference**: the step of torchvision/references/classification/train.py
  (``train_one_epoch``): NCHW, ``--amp`` (fp16 autocast + GradScaler) on CUDA, fp32 on CPU,
  SGD with one parameter group, then ``loss.item()`` and the top-1/top-5 of the batch read back
  to the host, as its MetricLogger does every step. Data already on the device.
* **capstone, synthetic**: the capstone's step (``TrainingLoop.train_step``: channels_last
  unless ``--no-channels-last``, ``--precision`` autocast, SGD + Nesterov on two groups, label
  smoothing) on a uint8 batch
  already on the device, normalised there by the capstone's DeviceLoader.
* **capstone, JPEG decode**: the same step fed by the capstone's DataLoader from ``--workers``
  worker processes that decode generated JPEGs (500x375, like ImageNet's average) with PIL and
  crop them: the whole input pipeline, bounded by the CPU cores when they cannot keep up.
* **capstone, nvJPEG decode**: ``data.decoder=cuda``'s pipeline: the workers only read the
  files' bytes; the main process decodes the whole batch on the GPU in one
  ``torchvision.io.decode_jpeg(device="cuda")`` call and crops each image there with its own
  seed (``imagenet.data.gpu_decoder``), so its "data ms" is the decode on the GPU. Without CUDA
  the same code decodes on the CPU in the main process (the row checks the path, not a rate).

A second table measures decoding + augmentation alone, in one process (one core), for each
decoder: images/s per core, and how many cores one GPU needs at the measured rate. The goal of
the issue, on one H100: >= 1.3 x 2,470 images/s (NVIDIA DeepLearningExamples, ResNet-50 v1.5,
one A100 80GB, AMP, batch 256) = 3,211 images/s.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from course.cli import parse_config, run_main
from course.impl import IMPLS
from course.results import Table, write_results
from course.training import AutocastPrecision, Precision, TrainingLoop
from phase4_production.device_peaks import peak_flops_per_second
from solutions.phase4_production.imagenet.config import CapstoneConfig
from solutions.phase4_production.imagenet.data import (
    DeviceLoader,
    EpochSampler,
    FolderDataset,
    collate_bytes,
    decode_file,
    gpu_decoder,
    sample_seed,
    train_transform,
)
from solutions.phase4_production.imagenet.model import build_model
from solutions.phase4_production.imagenet.recipe import build_loss, build_optimizer

A100_REFERENCE = 2470.0  # images/s, DeepLearningExamples ResNet-50 v1.5, A100 80GB, AMP, bs 256
GOAL = 1.3 * A100_REFERENCE
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class BenchConfig:
    model: str = field(default="resnet50", metadata={"choices": ("resnet18", "resnet50")})
    image_size: int = field(default=224, metadata={"ge": 16, "help": "crop size, px"})
    batch: int = field(default=256, metadata={"ge": 1, "help": "per-GPU batch"})
    precision: str = field(default="bf16", metadata={"choices": tuple(DTYPES)})
    steps: int = field(default=30, metadata={"ge": 1, "help": "timed steps per row"})
    warmup: int = field(
        default=5, metadata={"ge": 0, "help": "untimed steps first (and compilation)"}
    )
    compile: bool = field(default=False, metadata={"help": "add a torch.compile row"})
    channels_last: bool = field(default=True, metadata={"help": "the capstone's memory format"})
    workers: int = field(
        default=0, metadata={"ge": 0, "help": "DataLoader workers (0: every core)"}
    )
    jpegs: int = field(default=512, metadata={"ge": 1, "help": "distinct JPEGs generated"})
    decode_images: int = field(default=200, metadata={"ge": 1, "help": "images per decoder row"})
    cpu_smoke: bool = field(default=False, metadata={"help": "tiny config (default w/o CUDA)"})
    impl: str = field(default="solutions", metadata={"choices": IMPLS})
    record: str = field(
        default="", metadata={"help": "write the tables to this results file (course/results.py)"}
    )


# ResNet-18 at 32 px in fp32 and NCHW: on CPUs without AMX bf16 autocast is slower than fp32,
# and oneDNN's NCHW convolutions were faster than its channels_last ones here
SMOKE = {
    "model": "resnet18",
    "channels_last": False,
    "image_size": 32,
    "batch": 8,
    "precision": "fp32",
    "steps": 3,
    "warmup": 1,
    "jpegs": 16,
    "decode_images": 40,
}
DECODE_CROP = 224  # the decode table always crops as the ImageNet recipe does


@dataclass
class Row:
    name: str
    step_seconds: list[float]
    batch: int
    sections: dict[str, float] = field(default_factory=dict)  # median seconds per section

    @property
    def median(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def images_per_second(self) -> float:
        return self.batch / self.median


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capstone_config(config: BenchConfig) -> CapstoneConfig:
    return CapstoneConfig.model_validate(
        {
            "model": {"name": config.model, "channels_last": config.channels_last},
            "data": {"image_size": config.image_size, "batch_per_gpu": config.batch},
            "train": {"precision": config.precision},
        }
    )


# ----------------------------------------------------------------------------- the two steps


def accuracy(output: torch.Tensor, target: torch.Tensor, topk: Sequence[int]) -> list[torch.Tensor]:
    """torchvision/references/classification/utils.py ``accuracy``."""
    with torch.inference_mode():
        maxk = max(topk)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target[None])
        return [
            correct[:k].flatten().sum(dtype=torch.float32) * (100.0 / len(target)) for k in topk
        ]


def reference_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, criterion: nn.Module
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """train.py's ``train_one_epoch`` body (without its logging of time and lr)."""

    def step(image: torch.Tensor, target: torch.Tensor) -> None:
        with torch.autocast(image.device.type, dtype=torch.float16, enabled=scaler is not None):
            output = model(image)
            loss = criterion(output, target)
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        loss.item(), acc1.item(), acc5.item()  # the MetricLogger's reads

    return step


def capstone_loop(config: BenchConfig, device: torch.device) -> tuple[nn.Module, TrainingLoop]:
    """The capstone's model, optimizer, loss and precision in the course's TrainingLoop."""
    cfg = capstone_config(config)
    model = build_model(cfg, 1000, device)
    optimizer = build_optimizer(model, cfg.optim, config.batch)
    precision: Precision = Precision()
    if config.precision != "fp32":
        scaler = None
        if config.precision == "fp16":
            scaler = torch.amp.GradScaler(device.type)
        precision = AutocastPrecision(device.type, DTYPES[config.precision], scaler)
    loop = TrainingLoop(
        model, optimizer, [], device=device, loss_fn=build_loss(0.1), precision=precision
    )
    return model, loop


def time_steps(
    step: Callable[[torch.Tensor, torch.Tensor], Any],
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    config: BenchConfig,
    device: torch.device,
) -> tuple[list[float], float]:
    """Per-step seconds (a device sync after each) and the median time waiting for a batch."""
    times, waits = [], []
    for i in range(config.warmup + config.steps):
        sync(device)
        t0 = time.perf_counter()
        images, targets = next(batches)
        t1 = time.perf_counter()
        step(images, targets)
        sync(device)
        if i >= config.warmup:
            times.append(time.perf_counter() - t0)
            waits.append(t1 - t0)
    return times, statistics.median(waits)


def breakdown(
    model: nn.Module, loop: TrainingLoop, images: torch.Tensor, targets: torch.Tensor, steps: int
) -> dict[str, float]:
    """Median seconds of forward, backward and optimizer over ``steps`` instrumented steps
    (a sync between the parts: the parts add up to a little more than an unsynced step)."""
    device = images.device
    parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(steps):
        loop.optimizer.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        with loop.precision.autocast():
            loss = loop.loss_fn(model(images), targets)
        sync(device)
        t1 = time.perf_counter()
        loop.precision.backward(loss)
        sync(device)
        t2 = time.perf_counter()
        loop.precision.unscale(loop.optimizer)
        loop.precision.step(loop.optimizer)
        sync(device)
        t3 = time.perf_counter()
        for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            parts[name].append(seconds)
    return {name: statistics.median(values) for name, values in parts.items()}


def forever(
    batch: tuple[torch.Tensor, torch.Tensor],
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield batch


# ----------------------------------------------------------------------------- JPEGs


def write_jpegs(root: Path, count: int, size: tuple[int, int] = (500, 375)) -> Path:
    """``count`` photo-like JPEGs (smooth colour fields + grain, quality 90) in one class folder
    of ``root/train``; ImageNet's average image is about 400x350, 110 KB."""
    from PIL import Image

    w, h = size
    folder = root / "train" / "n00000000"
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        coarse = torch.rand(1, 3, 6, 8, generator=g) * 255
        field_ = nn.functional.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)
        grain = torch.randn(1, 3, h, w, generator=g) * 12
        pixels = (field_ + grain).clamp(0, 255)[0].permute(1, 2, 0).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / f"img_{i:05d}.JPEG", quality=90)
    return root


class Cycle(torch.utils.data.Sampler[int]):
    """0, 1, ..., n-1, 0, 1, ... for ``length`` samples (with set_epoch, as the course's)."""

    def __init__(self, n: int, length: int) -> None:
        self.n, self.length = n, length

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        pass

    def __iter__(self) -> Iterator[int]:
        return (i % self.n for i in range(self.length))

    def __len__(self) -> int:
        return self.length


def jpeg_batches(
    root: Path, decoder: str, workers: int, config: BenchConfig, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The capstone's input pipeline over the JPEGs in ``root/train``, as ``imagenet.data``
    builds it for ``data.decoder`` (``pil``: workers decode and crop; ``cuda``: workers read
    bytes, the main process decodes the batch on ``device``), endless for the timed steps."""
    folder = torchvision.datasets.ImageFolder(str(root / "train"), loader=str)
    transform = train_transform(config.image_size)
    dataset = FolderDataset(folder, transform, seed=0, decoder=decoder)
    total = (config.warmup + config.steps + 1) * config.batch
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=config.batch, sampler=EpochSampler(Cycle(len(dataset), total)),
        num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=True,
        prefetch_factor=4, generator=torch.Generator().manual_seed(0),
        collate_fn=collate_bytes if decoder == "cuda" else None,
    )  # fmt: skip
    decode = gpu_decoder(transform, 0, device) if decoder == "cuda" else None
    return iter(DeviceLoader(loader, device, channels_last=config.channels_last, gpu_decode=decode))


def decode_rate(root: Path, decoder: str, image_size: int, images: int) -> float:
    """Images/s of decode + RandomResizedCrop + flip in this process (one core)."""
    paths = sorted(str(p) for p in (root / "train").glob("*/*.JPEG"))
    transform = train_transform(image_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        began = time.perf_counter()
        for i in range(images):
            image = decode_file(paths[i % len(paths)], decoder)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(sample_seed(0, 0, i))
                transform(image)
        return images / (time.perf_counter() - began)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- the run


def flops_per_image(model: nn.Module, config: BenchConfig, device: torch.device) -> float:
    """Training FLOPs (forward + backward) of one image, by torch's FlopCounterMode."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    scratch = copy.deepcopy(model)
    x = torch.randn(2, 3, config.image_size, config.image_size, device=device)
    with FlopCounterMode(display=False) as counter:
        scratch(x).sum().backward()
    return counter.get_total_flops() / 2


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The device's peak: 4.5's datasheet table, or measured (phase4_production/device_peaks.py)."""
    return peak_flops_per_second(device, dtype)


def run(config: BenchConfig, device: torch.device) -> tuple[list[Row], dict[str, Any]]:
    """Every row of the training table, and the facts printed above it."""
    torch.manual_seed(0)
    size = config.image_size
    labels = torch.randint(0, 1000, (config.batch,), device=device)
    uint8 = torch.randint(0, 256, (config.batch, 3, size, size), dtype=torch.uint8, device=device)
    rows: list[Row] = []

    ref_model = torchvision.models.get_model(config.model, weights=None).to(device)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" else None
    float_batch = (uint8.float() / 255 - 0.45) / 0.225
    ref = reference_step(ref_model, ref_opt, scaler, nn.CrossEntropyLoss(label_smoothing=0.1))
    times, _ = time_steps(ref, forever((float_batch, labels)), config, device)
    rows.append(Row("torchvision reference (train.py step)", times, config.batch))
    del ref_model, ref_opt, float_batch

    model, loop = capstone_loop(config, device)
    layout = "channels_last" if config.channels_last else "NCHW"
    feeder = DeviceLoader([], device, channels_last=config.channels_last)  # type: ignore[arg-type]
    prepare = feeder.prepare

    def capstone_step(images: torch.Tensor, targets: torch.Tensor) -> None:
        loop.train_step(prepare(images), targets)

    times, _ = time_steps(capstone_step, forever((uint8, labels)), config, device)
    parts = breakdown(model, loop, prepare(uint8), labels, max(config.steps // 2, 1))
    rows.append(
        Row(f"capstone, synthetic ({config.precision}, {layout})", times, config.batch, parts)
    )

    if config.compile:
        model.compile()
        times, _ = time_steps(capstone_step, forever((uint8, labels)), config, device)
        rows.append(Row("capstone + torch.compile, synthetic", times, config.batch))

    root = Path(tempfile.mkdtemp(prefix="dtfs-jpegs-"))
    try:
        write_jpegs(root, config.jpegs)
        workers = config.workers or len(os.sched_getaffinity(0))
        plural = "s" * (workers != 1)
        for decoder, name in (
            ("pil", f"capstone, JPEG decode ({workers} worker{plural})"),
            ("cuda", f"capstone, nvJPEG decode ({workers} worker{plural} read files)"
             if device.type == "cuda" else "capstone, decoder=cuda path on the CPU"),
        ):  # fmt: skip
            batches = jpeg_batches(root, decoder, workers, config, device)
            times, wait = time_steps(loop.train_step, batches, config, device)
            rows.append(Row(name, times, config.batch, {"data": wait}))
            del batches
        decode = {
            name: decode_rate(root, name, DECODE_CROP, config.decode_images)
            for name in ("pil", "torchvision")
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    peak, source = peak_flops(device, DTYPES[config.precision])
    facts = {
        "flops_per_image": flops_per_image(model, config, device),
        "peak": peak,
        "peak_source": source,
        "decode": decode,
    }
    return rows, facts


P5_CORES = 96  # an AWS p5.48xlarge: 96 physical cores (192 vCPUs) for 8 H100s


def run_table(rows: list[Row], facts: dict[str, Any]) -> Table:
    reference = rows[0].images_per_second
    flops = facts["flops_per_image"]
    table = Table(["run", "images/s", "vs reference", "step ms", "data ms", "forward ms",
                   "backward ms", "optimizer ms", "MFU"])  # fmt: skip
    for row in rows:
        ms = {k: f"{v * 1e3:.1f}" for k, v in row.sections.items()}
        mfu = row.images_per_second * flops / facts["peak"]
        table.add(
            row.name, f"{row.images_per_second:,.1f}", f"{row.images_per_second / reference:.2f}x",
            f"{row.median * 1e3:.1f}", ms.get("data", "-"), ms.get("forward", "-"),
            ms.get("backward", "-"), ms.get("optimizer", "-"), f"{100 * mfu:.1f}%",
        )  # fmt: skip
    return table


def decode_table(rows: list[Row], facts: dict[str, Any]) -> Table:
    best = rows[1].images_per_second  # the capstone, synthetic
    table = Table(["decoder (decode + RandomResizedCrop + flip, 1 core)", "images/s/core",
                   "cores per GPU at the synthetic rate", "cores per GPU at the H100 goal",
                   "cores for 8 H100s"])  # fmt: skip
    for name, rate in facts["decode"].items():
        table.add(
            f"{name} ({DECODE_CROP} px crops of 500x375 JPEGs)", f"{rate:,.1f}",
            f"{best / rate:.2f}", f"{GOAL / rate:.1f}", f"{8 * GOAL / rate:.0f}",
        )  # fmt: skip
    return table


def summary_values(rows: list[Row], facts: dict[str, Any]) -> dict[str, str]:
    """The run's conclusions, computed: the capstone's step against the reference's, each
    decoder's cores per GPU at the goal and whether 8 GPUs' worth fits in a p5's cores."""
    values = {
        "capstone_vs_reference": f"{rows[1].images_per_second / rows[0].images_per_second:.2f}x",
        "gflop_per_image": f"{facts['flops_per_image'] / 1e9:.2f}",
    }
    for name, rate in facts["decode"].items():
        cores = 8 * GOAL / rate
        values[f"{name}_per_core"] = f"{rate:,.0f} images/s"
        values[f"{name}_cores_per_gpu"] = f"{GOAL / rate:.1f}"
        left = P5_CORES - cores  # the 8 training processes need cores of their own
        if left < 0:
            fits = f"exceeds a p5's {P5_CORES}"
        elif left < 8:
            fits = f"{left:.0f} of a p5's {P5_CORES} left, too few for its 8 training processes"
        else:
            fits = f"fits in a p5's {P5_CORES}, {left:.0f} left for its 8 training processes"
        values[f"{name}_p5"] = f"{cores:.0f} cores for 8 GPUs: {fits}"
    return values


def format_tables(rows: list[Row], facts: dict[str, Any], config: BenchConfig) -> str:
    return f"{run_table(rows, facts).to_markdown()}\n\n{decode_table(rows, facts).to_markdown()}"


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(BenchConfig, argv, __doc__)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if config.cpu_smoke or device.type == "cpu":
        for key, value in SMOKE.items():
            if getattr(config, key) == getattr(BenchConfig(), key):
                setattr(config, key, value)
        config.cpu_smoke = True
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({os.cpu_count()} cores)"
    )
    rows, facts = run(config, device)
    print(
        f"{config.model} at {config.image_size} px, batch {config.batch}, {config.precision}, "
        f"on {name}; {config.steps} timed steps after {config.warmup} warm-up; "
        f"{facts['flops_per_image'] / 1e9:.2f} GFLOP per image (forward + backward), peak "
        f"{facts['peak'] / 1e12:.2f} TFLOP/s ({facts['peak_source']})\n"
    )
    print(format_tables(rows, facts, config))
    if config.record:
        setup = (
            f"{config.model} at {config.image_size} px, batch {config.batch}, {config.precision}, "
            f"on {name}; {config.steps} timed steps after {config.warmup} warm-up"
        )
        run_rows, decode_rows = run_table(rows, facts), decode_table(rows, facts)
        run_rows.note = setup
        path = write_results(
            config.record,
            tables={"run": run_rows, "decode": decode_rows},
            values=summary_values(rows, facts),
        )
        print(f"recorded: {path}")
    synthetic = rows[1].images_per_second
    if device.type == "cuda":
        verdict = "met" if synthetic >= GOAL else "NOT met"
        print(f"\ngoal >= {GOAL:,.0f} images/s (1.3 x {A100_REFERENCE:,.0f}): {verdict}")
    else:
        print(
            f"\n(cpu-smoke: the goal, >= {GOAL:,.0f} images/s on one H100 at 224 px, needs a GPU)"
        )
    return 0


if __name__ == "__main__":
    run_main(main)
