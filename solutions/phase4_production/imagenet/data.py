"""The capstone's data: an ImageFolder or synthetic images, v2 transforms, loaders that feed a GPU.

Three ideas, each the answer to a problem a real ImageNet run hits:

* **The layout is checked before training** (:func:`check_imagefolder`). ``root/train/<class>/``
  and ``root/val/<class>/`` with the same class folders; anything else (no ``val/``, the raw
  ILSVRC validation set as one flat folder, an empty class) is refused before any process group
  starts, with the expected layout in the message.
* **Augmentation is a function of (seed, epoch, sample index)** (:class:`EpochSampler`,
  :func:`sample_seed`). The sampler hands the dataset ``(epoch, index)`` pairs and the dataset
  seeds torch's generator from them before the random crop and flip. The same image then gets the
  same crop whatever the number of DataLoader workers, ranks or restarts; without it a run resumed
  mid-epoch draws different crops (workers' seeds come from the loader's generator, drawn again for
  every new iterator), and the resume is not bitwise.
* **The GPU receives uint8** (:class:`DeviceLoader`). Workers decode and crop on the CPU and
  stack uint8 images; the batch is copied to the device (from pinned memory, ``non_blocking``),
  converted to float, normalised and put in channels_last there: 4x fewer bytes over PCIe than
  float32 and no normalisation work on the CPU cores, as NVIDIA's DALI pipelines do.

Decoders (``data.decoder``): ``pil`` (PIL in the workers, torchvision's ImageFolder default),
``torchvision`` (``torchvision.io.decode_image`` in the workers: libjpeg-turbo on uint8 tensors;
deprecated in torchvision 0.29 in favour of TorchCodec) and ``cuda`` (workers only read the
files; nvJPEG decodes the whole batch on the GPU, ``decode_jpeg(device="cuda")``). The transforms
follow torchvision/references/classification/presets.py.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader
from torchvision.transforms import v2

from solutions.phase4_production.imagenet.config import CapstoneConfig, ConfigError

MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics (torchvision's references)
STD = (0.229, 0.224, 0.225)
SEED_MIX = 0x9E3779B97F4A7C15  # the golden-ratio constant: spreads neighbouring seeds apart

LAYOUT = """expected an ImageFolder layout:
  {root}/
    train/
      n01440764/   xxx.JPEG, yyy.JPEG, ...   (one folder per class)
      n01443537/
      ...
    val/
      n01440764/   (the same class folders as train/)
      n01443537/
      ...
The ILSVRC2012 validation archive unpacks to ONE flat folder of 50,000 JPEGs: sort it into class
folders first (ILSVRC2012_devkit_t12's ground truth, or the valprep.sh script used by most
ImageNet recipes)."""


class LayoutError(ConfigError):
    """The data folder is not an ImageFolder with train/ and val/."""


def _refuse(root: Path, problem: str) -> LayoutError:
    return LayoutError(f"data.root={root}: {problem}\n{LAYOUT.format(root=root)}")


# ----------------------------------------------------------------------------- the folder


@dataclass(frozen=True)
class FolderSplits:
    """The two ImageFolders, scanned once (the scan of 1.3M files takes seconds)."""

    train: ImageFolder
    val: ImageFolder

    @property
    def classes(self) -> list[str]:
        return list(self.train.classes)


def _class_dirs(split: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(split) if entry.is_dir())


def check_imagefolder(root: str | Path) -> FolderSplits:
    """Scan ``root/train`` and ``root/val``; refuse anything but the ImageFolder layout."""
    root = Path(root)
    if not root.is_dir():
        raise _refuse(root, "no such folder")
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise _refuse(root, f"there is no {split}/ folder")
    train_classes = _class_dirs(root / "train")
    if not train_classes:
        raise _refuse(root, "train/ has no class folders (images must be in train/<class>/)")
    val_classes = _class_dirs(root / "val")
    if not val_classes:
        loose = sum(1 for p in (root / "val").iterdir() if p.suffix.lower() in IMG_EXTENSIONS)
        raise _refuse(
            root,
            f"val/ has no class folders ({loose} images lie directly in val/: the flat "
            "ILSVRC validation layout)",
        )
    if val_classes != train_classes:
        only_train = sorted(set(train_classes) - set(val_classes))[:5]
        only_val = sorted(set(val_classes) - set(train_classes))[:5]
        raise _refuse(
            root,
            f"train/ has {len(train_classes)} class folders and val/ has {len(val_classes)}, "
            f"and they differ (only in train/: {only_train}; only in val/: {only_val}); the "
            "label of a class is its index in the sorted list, so both must hold the same set",
        )
    splits = []
    for split in ("train", "val"):
        try:
            splits.append(ImageFolder(str(root / split), loader=_path_only))
        except FileNotFoundError as err:  # a class folder without a single image
            raise _refuse(root, f"{split}/: {err}") from None
    return FolderSplits(splits[0], splits[1])


def _path_only(path: str) -> str:
    return path


# ----------------------------------------------------------------------------- seeds, sampler


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation: a function of (seed, epoch, index) only."""
    mixed = (seed * SEED_MIX + epoch) * SEED_MIX + index
    return mixed % (2**63 - 1)


class EpochSampler(Sampler[tuple[int, int]]):
    """Wraps the course's sampler: yields ``(epoch, index)``, so the dataset can seed each sample.

    ``set_epoch(epoch, start_index)`` is passed on (phase 1's DistributedShardSampler skips the
    first ``start_index`` samples of this rank's shard when a run resumes mid-epoch).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.epoch = 0

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        self.epoch = epoch
        if start_index:
            self.inner.set_epoch(epoch, start_index=start_index)
        else:
            self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return ((epoch, int(index)) for index in self.inner)

    def __len__(self) -> int:
        return len(self.inner)


class ShardSampler(Sampler[tuple[int, int]]):
    """Evaluation: rank r of W takes samples r, r + W, ... with no padding, so every sample is
    scored exactly once (a padded training sampler would count some twice)."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, size, world_size)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((0, index) for index in self.indices)

    def __len__(self) -> int:
        return len(self.indices)


# ----------------------------------------------------------------------------- transforms


def train_transform(image_size: int) -> v2.Compose:
    """RandomResizedCrop + horizontal flip, to a uint8 CHW tensor (normalised on the device)."""
    return v2.Compose(
        [
            v2.RandomResizedCrop(image_size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.PILToTensor(),  # a PIL image to uint8 CHW; a tensor passes through
        ]
    )


def eval_transform(image_size: int, resize: int) -> v2.Compose:
    """Resize the short side to ``resize``, center-crop ``image_size`` (256 -> 224 on ImageNet)."""
    return v2.Compose(
        [
            v2.Resize(resize, antialias=True),
            v2.CenterCrop(image_size),
            v2.PILToTensor(),
        ]
    )


def seeded(transform: Callable[[Any], Any], seed: int, epoch: int, index: int) -> Any:
    """Apply a random transform with torch's generator seeded for this sample; the caller's
    generator state is untouched (the main process's dropout stream must not move)."""

    def run(image: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(seed, epoch, index))
            return transform(image)

    return run


# ----------------------------------------------------------------------------- datasets


def decode_file(path: str, decoder: str) -> Any:
    """A file to an image: PIL for ``pil``, a uint8 CHW tensor for ``torchvision``."""
    if decoder == "pil":
        return default_loader(path)
    from torchvision.io import ImageReadMode, decode_image

    data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
    with warnings.catch_warnings():  # deprecated in 0.29 in favour of TorchCodec
        warnings.simplefilter("ignore")
        return decode_image(data, mode=ImageReadMode.RGB)


def read_bytes(path: str) -> torch.Tensor:
    """The raw file, for decoding on the GPU (``data.decoder=cuda``)."""
    return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)


class FolderDataset(Dataset[tuple[Any, int]]):
    """An ImageFolder's (path, label) list, decoded and transformed per ``(epoch, index)``.

    With ``decoder="cuda"`` a sample is the file's bytes; :class:`DeviceLoader` decodes and
    transforms the batch on the GPU.
    """

    def __init__(
        self, folder: ImageFolder, transform: v2.Transform, seed: int, decoder: str = "pil"
    ) -> None:
        self.samples = list(folder.samples)
        self.transform, self.seed, self.decoder = transform, seed, decoder

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]) -> tuple[Any, int]:
        epoch, index = key
        path, label = self.samples[index]
        if self.decoder == "cuda":
            return (read_bytes(path), epoch, index), label
        image = decode_file(path, self.decoder)
        return seeded(self.transform, self.seed, epoch, index)(image), label


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """Deterministic images that can be learned: class c is a tinted pattern plus noise.

    No files; sample i of split s is drawn from a generator seeded by (s, i), so every rank,
    worker and restart sees the same image for the same index. The images go through the same
    crop and flip as real ones (on uint8 tensors).
    """

    def __init__(
        self,
        size: int,
        num_classes: int,
        source_size: int,
        transform: v2.Transform,
        seed: int,
        split: int,
    ) -> None:
        self.size, self.num_classes, self.source_size = size, num_classes, source_size
        self.transform, self.seed, self.split = transform, seed, split
        g = torch.Generator().manual_seed(1234)
        self.tints = torch.rand(num_classes, 3, 1, 1, generator=g)
        self.freqs = torch.randint(1, 5, (num_classes, 2), generator=g).float()

    def __len__(self) -> int:
        return self.size

    def image(self, index: int) -> tuple[torch.Tensor, int]:
        label = index % self.num_classes
        g = torch.Generator().manual_seed(self.split * 1_000_003 + index)
        axis = torch.linspace(0, 2 * torch.pi, self.source_size)
        fy, fx = self.freqs[label]
        wave = torch.sin(fy * axis)[:, None] * torch.cos(fx * axis)[None, :]
        noise = torch.rand(3, self.source_size, self.source_size, generator=g)
        pixels = 0.5 * self.tints[label] + 0.25 * (wave + 1) + 0.25 * noise
        return (pixels.clamp(0, 1) * 255).to(torch.uint8), label

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key
        image, label = self.image(index)
        return seeded(self.transform, self.seed, epoch, index)(image), label


# ----------------------------------------------------------------------------- loaders


def collate_bytes(batch: Sequence[tuple[Any, int]]) -> tuple[list[Any], torch.Tensor]:
    """``decoder=cuda``: keep the variable-length byte tensors as a list."""
    return [item for item, _ in batch], torch.tensor([label for _, label in batch])


class DeviceLoader:
    """Batches on the device: uint8 -> float, normalised, channels_last; nvJPEG when asked.

    ``non_blocking`` copies from pinned memory return at once on CUDA, so the host goes on
    queuing the step's kernels while the copy runs.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        device: torch.device,
        *,
        channels_last: bool,
        gpu_decode: Callable[[list[Any]], torch.Tensor] | None = None,
    ) -> None:
        self.loader, self.device = loader, device
        self.channels_last, self.gpu_decode = channels_last, gpu_decode
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def prepare(self, images: Any) -> torch.Tensor:
        if self.gpu_decode is not None:
            images = self.gpu_decode(images)
        x = images.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in self.loader:
            yield self.prepare(images), labels.to(self.device, non_blocking=True)


def gpu_decoder(
    transform: v2.Compose, seed: int, device: torch.device
) -> Callable[[list[Any]], torch.Tensor]:
    """nvJPEG: decode a batch of files on ``device`` in one call, then crop each image there
    with its own (seed, epoch, index) seed; on CPU the same code decodes in the main process."""
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(items: list[Any]) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            images = decode_jpeg(
                [data for data, _, _ in items], mode=ImageReadMode.RGB, device=device
            )
        return torch.stack(
            [
                seeded(transform, seed, epoch, index)(image)
                for image, (_, epoch, index) in zip(images, items, strict=True)
            ]
        )

    return decode


@dataclass
class Loaders:
    train: DeviceLoader
    val: DeviceLoader
    train_sampler: EpochSampler
    num_classes: int
    train_size: int
    val_size: int


def build_datasets(
    config: CapstoneConfig, folders: FolderSplits | None
) -> tuple[Dataset[Any], Dataset[Any], int]:
    """(train, val, number of classes) for ``data.source``."""
    data, seed = config.data, config.train.seed
    train_tf = train_transform(data.image_size)
    val_tf = eval_transform(data.image_size, data.resize)
    if data.source == "synthetic":
        source = data.resize
        train: Dataset[Any] = SyntheticImages(
            data.train_samples, data.num_classes, source, train_tf, seed, 0
        )
        val: Dataset[Any] = SyntheticImages(
            data.val_samples, data.num_classes, source, val_tf, seed, 1
        )
        return train, val, data.num_classes
    assert folders is not None
    train = FolderDataset(folders.train, train_tf, seed, data.decoder)
    val = FolderDataset(folders.val, val_tf, seed, data.decoder)
    return train, val, len(folders.classes)


def build_loaders(
    config: CapstoneConfig,
    folders: FolderSplits | None,
    make_sampler: Callable[[Dataset[Any]], Any],
    rank: int,
    world_size: int,
    device: torch.device,
) -> Loaders:
    """The train loader over ``make_sampler(train_set)`` (the course's sampler, sharded over the
    ranks) and the val loader.

    Every loader gets a generator of its own: without one, a DataLoader draws its workers' base
    seed from torch's global generator, and the training's random stream would move with it.
    """
    data = config.data
    train_set, val_set, num_classes = build_datasets(config, folders)
    cuda = device.type == "cuda"
    workers = data.workers
    common: dict[str, Any] = {
        "num_workers": workers,
        "pin_memory": cuda,
        "persistent_workers": workers > 0,
        "prefetch_factor": data.prefetch_factor if workers > 0 else None,
        "collate_fn": collate_bytes if data.decoder == "cuda" else None,
    }
    epoch_sampler = EpochSampler(make_sampler(train_set))
    train = DataLoader(
        train_set,
        batch_size=config.rank_batch(),
        sampler=epoch_sampler,
        drop_last=True,  # every rank runs the same number of full steps
        generator=torch.Generator().manual_seed(config.train.seed),
        **common,
    )
    val = DataLoader(
        val_set,
        batch_size=config.eval.batch_per_gpu,
        sampler=ShardSampler(len(val_set), rank, world_size),  # type: ignore[arg-type]
        generator=torch.Generator().manual_seed(config.train.seed + 1),
        **common,
    )
    decode_train = decode_val = None
    if data.decoder == "cuda":
        train_tf = train_transform(data.image_size)
        val_tf = eval_transform(data.image_size, data.resize)
        decode_train = gpu_decoder(train_tf, config.train.seed, device)
        decode_val = gpu_decoder(val_tf, config.train.seed, device)
    channels_last = config.model.channels_last
    return Loaders(
        DeviceLoader(train, device, channels_last=channels_last, gpu_decode=decode_train),
        DeviceLoader(val, device, channels_last=channels_last, gpu_decode=decode_val),
        epoch_sampler,
        num_classes,
        len(train_set),  # type: ignore[arg-type]
        len(val_set),  # type: ignore[arg-type]
    )
