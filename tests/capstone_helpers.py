"""Shared pieces of tests/test_capstone.py: a small ImageFolder of real JPEGs, the capstone's
config for tests, and the functions its forked worlds run (module level: ranks unpickle them).

The folder: 3 classes, 16 training and 5 validation JPEGs each, 40x36 px, written with PIL. With
``batch_per_gpu=4`` on 2 ranks an epoch is 6 steps of 8 images (48 / 8), so the tests' runs of 2
epochs take 12 steps, a checkpoint at step 8 (mid-epoch 1) and at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from PIL import Image

from course.world import DEFAULT_WORLD_TIMEOUT, world_timeout
from solutions.phase4_production.imagenet.config import CapstoneConfig, load_config
from solutions.phase4_production.imagenet.data import check_imagefolder

CLASSES = ("n01440764", "n01443537", "n01484850")
TRAIN_PER_CLASS, VAL_PER_CLASS = 16, 5
MODULE = "solutions.phase4_production.imagenet.trainer"


def slow_machine_limit(seconds: float) -> float:
    """A scenario's time bound, stretched as ``DTFS_WORLD_TIMEOUT`` stretches the worlds' (a
    loaded machine is slower, not hung): x1 at the default 20 s, x3 at 60 s."""
    return seconds * max(1.0, world_timeout() / DEFAULT_WORLD_TIMEOUT)


def write_jpeg(path: Path, label: int, index: int, size: tuple[int, int] = (40, 36)) -> None:
    """A small JPEG whose colour and stripes depend on the class (learnable), noise on the index."""
    g = torch.Generator().manual_seed(index * 31 + label)
    w, h = size
    base = torch.tensor([[200, 40, 40], [40, 200, 40], [40, 40, 200]][label], dtype=torch.float32)
    stripes = (torch.arange(w) // (2 + label) % 2).float() * 50
    pixels = base[None, None, :] + stripes[None, :, None] + torch.rand(h, w, 3, generator=g) * 60
    array = pixels.clamp(0, 255).to(torch.uint8).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format="JPEG", quality=90)


def make_imagefolder(root: Path) -> Path:
    """``root/train/<class>/*.JPEG`` and ``root/val/<class>/*.JPEG``."""
    for label, name in enumerate(CLASSES):
        for i in range(TRAIN_PER_CLASS):
            write_jpeg(root / "train" / name / f"{name}_{i}.JPEG", label, i)
        for i in range(VAL_PER_CLASS):
            write_jpeg(root / "val" / name / f"ILSVRC2012_val_{label}_{i}.JPEG", label, 1000 + i)
    return root


def overrides(data_root: Path, checkpoint_dir: Path, **extra: Any) -> list[str]:
    """The test run as ``key=value`` overrides of cpu-smoke (for the config and for torchrun)."""
    settings: dict[str, Any] = {
        "impl": "solutions",
        "data.source": "imagefolder",
        "data.root": str(data_root),
        "data.image_size": 32,
        "data.val_resize": 36,
        "data.batch_per_gpu": 4,
        "data.workers": 0,
        "eval.batch_per_gpu": 4,
        "train.epochs": 2,
        "checkpoint.dir": str(checkpoint_dir),
        "checkpoint.every_steps": 8,
        "checkpoint.keep": 10,
        "monitoring.progress_bar": "off",
        **extra,
    }
    return [f"{key}={value}" for key, value in settings.items()]


def config(data_root: Path, checkpoint_dir: Path, **extra: Any) -> CapstoneConfig:
    return load_config("cpu-smoke", overrides(data_root, checkpoint_dir, **extra))


def _trainer(cfg: CapstoneConfig) -> Any:
    from solutions.phase4_production.imagenet.trainer import CapstoneTrainer

    root = cfg.data.root
    folders = check_imagefolder(root) if root and cfg.data.source == "imagefolder" else None
    return CapstoneTrainer(cfg, folders)


def train_worker(cfg: CapstoneConfig) -> dict[str, Any]:
    """Run the capstone on this rank; rank 0's final weights and the summary."""
    trainer = _trainer(cfg)
    summary = trainer.run()
    dist.barrier()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    scaler = trainer.scaler.state_dict() if trainer.scaler is not None else None
    return {"weights": weights, "summary": summary, "scaler": scaler}


def eval_worker(cfg: CapstoneConfig) -> dict[str, Any]:
    """Resume the finished run (no steps left), make rank 1's BatchNorm statistics differ from
    rank 0's (as they do after training under DDP), evaluate with every rank."""
    trainer = _trainer(cfg)
    trainer.fault.resume(trainer.manager, trainer.state)
    if dist.get_rank() == 1:
        for name, buffer in trainer.model.named_buffers():
            if name.endswith("running_mean"):
                buffer.add_(0.5)
    result = trainer.evaluate()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"result": result, "weights": weights}


def final_checkpoint(checkpoint_dir: Path) -> dict[str, Any]:
    newest = sorted(Path(checkpoint_dir).glob("step_*"))[-1]
    return torch.load(newest / "train_state.pt", weights_only=True)
