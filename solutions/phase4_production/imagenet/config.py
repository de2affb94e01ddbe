"""The capstone's configuration: YAML files, ``key=value`` overrides, validated before launch.

A run is described by one YAML file (``solutions/phase4_production/imagenet/configs/*.yaml``;
the default is ``cpu-smoke``) plus command-line overrides::

    uv run torchrun --standalone --nproc_per_node=8 \
        -m solutions.phase4_production.imagenet.trainer \
        --config resnet50-8gpu --set optim.base_lr=0.2 data.root=/data/imagenet

Everything is checked by pydantic models with ``extra="forbid"`` *before* any process group
starts (:func:`load_config`, then :func:`check_world` once WORLD_SIZE is known): a typo in a key, a
value outside the allowed set or a batch that cannot be split is one message naming the key, the
bad value and what is allowed, printed once by rank 0, instead of a crash inside a collective on
every rank. The same idea as torchvision's reference scripts' argparse choices, but for a nested
file, as in Hydra/OmegaConf structured configs (without their dependency).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from course import config_files
from course.config_files import ConfigError, Section

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = "cpu-smoke"
MODELS = ("resnet18", "resnet50", "vit_b_16")
UNSUPPORTED_STRATEGIES = {
    "fsdp": "torch's fully_shard (FSDP2) shards parameters; the capstone's checkpoints and "
    "evaluation assume every rank holds the whole model",
    "zero": "phase 3.5's zero_wrap works on the course's small models, not wired in here",
    "tp": "tensor parallelism (phase 2.6) pays off for transformers wider than one GPU, not "
    "for ResNet-50 or ViT-B/16",
    "pp": "pipeline parallelism (phase 2.5) is for models deeper than one GPU's memory",
    "3d": "3D parallelism (phase 3.6) is for models that need all three",
}


class ModelConfig(Section):
    name: Literal["resnet18", "resnet50", "vit_b_16"] = "resnet18"
    channels_last: bool = True
    compile: bool = False
    zero_init_residual: bool = True  # Goyal et al. 2017: the last BN of each block starts at 0
    sync_batchnorm: bool = False


class DataConfig(Section):
    source: Literal["synthetic", "imagefolder"] = "synthetic"
    root: str | None = None  # imagefolder: a folder with train/ and val/
    image_size: int = Field(default=224, ge=16)  # training crop and evaluation crop
    val_resize: int | None = Field(default=None, ge=16)  # default: image_size * 256 / 224
    batch_per_gpu: int = Field(default=256, ge=1)  # one micro-batch on one rank
    workers: int = Field(default=8, ge=0)  # DataLoader worker processes per rank
    prefetch_factor: int = Field(default=2, ge=1)
    decoder: Literal["pil", "torchvision", "cuda"] = "pil"
    num_classes: int = Field(default=1000, ge=2)  # synthetic only (a folder has its own)
    train_samples: int = Field(default=1_281_167, ge=1)  # synthetic only
    val_samples: int = Field(default=50_000, ge=1)  # synthetic only

    @property
    def resize(self) -> int:
        """The evaluation resize before the center crop (256 for a 224 crop)."""
        return self.val_resize or math.ceil(self.image_size * 256 / 224)


class TrainConfig(Section):
    epochs: int = Field(default=90, ge=1)
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    accumulation_steps: int = Field(default=1, ge=1)
    grad_clip_norm: float | None = Field(default=None, gt=0)
    seed: int = 0


class OptimConfig(Section):
    name: Literal["sgd", "adamw"] = "sgd"
    base_lr: float = Field(default=0.1, gt=0)  # for a global batch of 256: lr = base_lr * B / 256
    reference_batch: int = Field(default=256, ge=1)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    nesterov: bool = True
    weight_decay: float = Field(default=1e-4, ge=0)
    norm_weight_decay: float = Field(default=0.0, ge=0)  # norms, biases, ViT embeddings
    label_smoothing: float = Field(default=0.1, ge=0, lt=1)
    warmup_epochs: float = Field(default=5.0, ge=0)
    warmup_start_factor: float = Field(default=0.1, gt=0, le=1)
    min_lr_factor: float = Field(default=0.0, ge=0, le=1)  # the cosine ends at base lr x this


class ParallelConfig(Section):
    strategy: Literal["ddp"] = "ddp"
    bucket_cap_mb: float = Field(default=25.0, gt=0)
    gradient_as_bucket_view: bool = True
    static_graph: bool = False

    @field_validator("strategy", mode="before")
    @classmethod
    def _explain_unsupported(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in UNSUPPORTED_STRATEGIES:
            raise ValueError(
                f"{value!r} is not supported by the capstone ({UNSUPPORTED_STRATEGIES[value]}); "
                "use 'ddp'"
            )
        return value


class CommunicationConfig(Section):
    compression: Literal["none", "fp16", "bf16", "topk", "powersgd"] = "none"
    powersgd_rank: int = Field(default=2, ge=1)
    topk_ratio: float = Field(default=0.01, gt=0, le=1)


class CheckpointConfig(Section):
    dir: str = "checkpoints/imagenet"
    every_steps: int = Field(default=500, ge=1)
    keep: int = Field(default=3, ge=1)
    resume: bool = True


class EvalConfig(Section):
    every_epochs: int = Field(default=1, ge=0)  # 0: only at the end
    batch_per_gpu: int = Field(default=256, ge=1)


class MonitoringConfig(Section):
    enabled: bool = False  # the TrainingMonitor of 4.5 (monitoring.py), when it exists
    log_dir: str = "runs/imagenet"
    tensorboard: bool = True
    jsonl: bool = True
    profile: bool = False
    log_every_steps: int = Field(default=50, ge=1)
    progress_bar: Literal["auto", "on", "off"] = "auto"  # auto: on when stderr is a terminal

    @field_validator("progress_bar", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: Any) -> Any:
        # YAML 1.1 (PyYAML) reads a bare on/off as true/false
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class CapstoneConfig(Section):
    name: str = "imagenet"
    impl: Literal["solutions", "templates"] = "solutions"  # whose checkpoint/sampler code runs
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    communication: CommunicationConfig = CommunicationConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    monitoring: MonitoringConfig = MonitoringConfig()

    @model_validator(mode="after")
    def _consistent(self) -> CapstoneConfig:
        data = self.data
        if self.model.name == "vit_b_16" and data.image_size % 16:
            raise ValueError(
                f"data.image_size={data.image_size}: vit_b_16 cuts the image into 16x16 patches, "
                f"so it must be a multiple of 16 (e.g. {max(16, data.image_size // 16 * 16)})"
            )
        if data.source == "imagefolder" and not data.root:
            raise ValueError(
                "data.root is not set: data.source=imagefolder needs a folder with train/ and "
                "val/ (or use data.source=synthetic)"
            )
        if data.resize < data.image_size:
            raise ValueError(
                f"data.val_resize={data.resize} is smaller than data.image_size="
                f"{data.image_size}: the center crop must fit inside the resized image"
            )
        if data.workers == 0 and data.decoder == "cuda":
            raise ValueError("data.decoder=cuda reads files in workers: set data.workers >= 1")
        return self

    @property
    def micro_batch(self) -> int:
        return self.data.batch_per_gpu

    def rank_batch(self) -> int:
        """Samples per rank per optimizer step (micro-batch x accumulation steps)."""
        return self.data.batch_per_gpu * self.train.accumulation_steps

    def global_batch(self, world_size: int) -> int:
        return self.rank_batch() * world_size


# ----------------------------------------------------------------------------- loading


def config_path(name_or_path: str) -> Path:
    """``resnet50-8gpu`` -> configs/resnet50-8gpu.yaml; any other value is a path."""
    return config_files.config_path(name_or_path, CONFIG_DIR)


def available_configs() -> list[str]:
    """The capstone's shipped configs (the language model's ``lm-*`` ones are lm_config's)."""
    return [
        name for name in config_files.available_configs(CONFIG_DIR) if not name.startswith("lm-")
    ]


def read_yaml(path: Path) -> dict[str, Any]:
    return config_files.read_yaml(path, available_configs())


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply ``section.key=value`` to the raw dict (``course/config_files.py``)."""
    config_files.apply_override(data, assignment, "optim.base_lr=0.2 or data.root=/data/imagenet")


def describe(err: ValidationError) -> str:
    """One line per problem: the dotted key, the bad value, what is allowed."""
    return config_files.describe(err, CapstoneConfig)


def build_config(data: dict[str, Any], source: str = "config") -> CapstoneConfig:
    try:
        return CapstoneConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}:\n  {describe(err)}") from None


def load_config(name_or_path: str | None = None, overrides: Sequence[str] = ()) -> CapstoneConfig:
    """The YAML config (default ``cpu-smoke``) with ``key=value`` overrides applied, validated."""
    path = config_path(name_or_path or DEFAULT_CONFIG)
    data = read_yaml(path)
    for assignment in overrides:
        apply_override(data, assignment)
    source = f"--config {path.name}" + (" with overrides" if overrides else "")
    return build_config(data, source)


def check_world(config: CapstoneConfig, world_size: int, cuda_devices: int) -> None:
    """What depends on the world torchrun started: the batch, the data size, the GPUs."""
    global_batch = config.global_batch(world_size)
    if config.data.source == "synthetic" and config.data.train_samples < global_batch:
        raise ConfigError(
            f"data.train_samples={config.data.train_samples} is smaller than the global batch "
            f"{global_batch} (data.batch_per_gpu={config.data.batch_per_gpu} x "
            f"train.accumulation_steps={config.train.accumulation_steps} x {world_size} ranks): "
            "an epoch would have no step; raise train_samples or lower the batch"
        )
    if config.data.source == "synthetic" and config.data.val_samples < world_size:
        raise ConfigError(
            f"data.val_samples={config.data.val_samples} is smaller than the world "
            f"({world_size} ranks): a rank would evaluate no image (fix: data.val_samples >= "
            f"{world_size})"
        )
    if config.data.decoder == "cuda" and cuda_devices == 0:
        raise ConfigError(
            "data.decoder=cuda: no CUDA device here; use data.decoder=pil or torchvision"
        )


def steps_per_epoch(train_size: int, world_size: int, rank_batch: int) -> int:
    """Optimizer steps per epoch: the sampler pads the epoch to a multiple of the world, the
    loader drops each rank's last partial batch."""
    return math.ceil(train_size / world_size) // rank_batch


def checkpoint_settings(
    config: CapstoneConfig, world_size: int, train_size: int
) -> dict[str, str | int | float | bool | None]:
    """The settings that shape a checkpoint's state (recorded in its manifest): a run whose
    settings differ is refused by name before anything is loaded. The global batch (so the LR
    schedule) and each rank's shard depend on the world, the saved position counts samples of
    an epoch of so many steps."""
    return {
        "model.name": config.model.name,
        "world size": world_size,
        "global batch": config.global_batch(world_size),
        "steps per epoch": steps_per_epoch(train_size, world_size, config.rank_batch()),
        "train.seed": config.train.seed,
        "train.precision": config.train.precision,
        "optim.name": config.optim.name,
    }


def dump(config: CapstoneConfig) -> str:
    """The resolved config as YAML (logged at start, stored in every checkpoint)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
