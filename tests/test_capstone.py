"""The capstone ImageNet trainer (solutions/phase4_production/imagenet_*.py), checked end to end.

It is a program, not an exercise: these tests grade no learner code (marked ``reference``) and
always run the reference solutions. What they check:

* the configuration: every shipped YAML is valid; overrides work; a bad key, value or type is
  refused before any process group, naming the key, the value and what is allowed;
* the data: a malformed ImageFolder is refused with the expected layout; augmentation depends on
  (seed, epoch, index) only (workers, resume position); the GPU-decode path, run on CPU, gives
  the worker path's batches; the main process's random stream is never touched by loading;
* the recipe: no weight decay on norms, biases and ViT embeddings; linear LR scaling, warmup and
  cosine; label smoothing;
* evaluation reduced over 2 ranks equals one process scoring every image with rank 0's weights;
* training on a generated ImageFolder of real JPEGs: resumed in a fresh world mid-epoch, and
  under real ``torchrun --max-restarts=1`` after a SIGKILL of rank 1 mid-epoch, the final weights
  are ``torch.equal`` to an uninterrupted run's (CPU), with a DataLoader worker per rank in the
  killed run and none in the reference.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
from capstone_helpers import (
    CLASSES,
    MODULE,
    VAL_PER_CLASS,
    config,
    eval_worker,
    final_checkpoint,
    make_imagefolder,
    overrides,
    slow_machine_limit,
    train_worker,
)
from grading import assert_bitwise_equal, world

from course.torchrun_runner import alive, run_torchrun
from solutions.phase4_production.imagenet import config as cfgmod
from solutions.phase4_production.imagenet import data as data
from solutions.phase4_production.imagenet import recipe as recipe
from solutions.phase4_production.imagenet.eval import correct_at_k

pytestmark = pytest.mark.reference
_CACHE: dict[str, Any] = {}


def fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("imagenet"))


def reference_run(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run (forked world of 2, no workers), computed once per session."""
    if "reference" not in _CACHE:
        directory = tmp_path_factory.mktemp("uninterrupted")
        out = world(train_worker, 2, config(folder, directory))
        _CACHE["reference"] = {"weights": out[0]["weights"], "dir": directory, "out": out}
    return _CACHE["reference"]


def compare_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert_bitwise_equal(
        got, want, what,
        "a resume must restore model, optimizer, LR schedule, scaler, sample position and every "
        "rank's RNG, and augmentations must depend on (seed, epoch, index) only",
    )  # fmt: skip


# ----------------------------------------------------------------------------- configuration


def refusal(*assignments: str, world_size: int = 2) -> str:
    """The message the config refuses ``assignments`` with (fails if it is accepted)."""
    try:
        cfg = cfgmod.load_config("cpu-smoke", list(assignments))
        cfgmod.check_world(cfg, world_size, 0)
    except cfgmod.ConfigError as err:
        return str(err)
    fail(f"capstone config: {assignments} was accepted; expected a refusal")


def test_every_shipped_config_is_valid_and_round_trips() -> None:
    names = cfgmod.available_configs()
    assert {"cpu-smoke", "resnet50-8gpu", "resnet50-2node-16gpu", "vit_b_16"} <= set(names)
    for name in names:
        cfg = cfgmod.load_config(name)
        again = cfgmod.build_config(__import__("yaml").safe_load(cfgmod.dump(cfg)))
        assert again == cfg, f"{name}: dump() then load gave a different config"
    r50 = cfgmod.load_config("resnet50-2node-16gpu")
    assert r50.global_batch(16) == 4096 and r50.train.precision == "bf16"
    assert r50.model.channels_last and r50.optim.nesterov
    assert cfgmod.load_config().name == "cpu-smoke"  # the default


def test_overrides_are_read_as_yaml_values() -> None:
    cfg = cfgmod.load_config(
        "cpu-smoke",
        ["optim.base_lr=0.2", "train.grad_clip_norm=null", "model.compile=true", "data.workers=0"],
    )
    assert cfg.optim.base_lr == 0.2 and cfg.train.grad_clip_norm is None
    assert cfg.model.compile is True and cfg.data.workers == 0
    assert cfgmod.load_config("cpu-smoke", ["optim.weight_decay=1e-4"]).optim.weight_decay == 1e-4


@pytest.mark.parametrize(
    ("assignments", "expected"),
    [
        (("optim.bse_lr=0.2",), ["optim.bse_lr", "unknown key", "base_lr"]),
        (("trian.epochs=3",), ["trian", "unknown key", "train"]),
        (("model.name=resnet34",), ["model.name='resnet34'", "resnet18", "vit_b_16"]),
        (("train.precision=fp8",), ["train.precision='fp8'", "bf16", "fp16"]),
        (("data.batch_per_gpu=many",), ["data.batch_per_gpu='many'", "integer"]),
        (("optim.base_lr=-1",), ["optim.base_lr=-1", "greater than 0"]),
        (("parallel.strategy=fsdp",), ["parallel.strategy", "'fsdp' is not supported", "'ddp'"]),
        (("communication.compression=int8",), ["communication.compression='int8'", "powersgd"]),
        (("model.name=vit_b_16", "data.image_size=40"), ["data.image_size=40", "multiple of 16"]),
        (("data.source=imagefolder",), ["data.root is not set"]),
        (("data.train_samples=16",), ["data.train_samples=16", "global batch 32"]),
        (("data.decoder=cuda",), ["data.decoder=cuda", "no CUDA device"]),
        (("optim.base_lr",), ["KEY=VALUE", "optim.base_lr"]),
        (("model.name.depth=50",), ["model.name is a value, not a section"]),
    ],
)
def test_a_bad_config_is_refused_naming_key_value_and_choices(
    assignments: tuple[str, ...], expected: list[str]
) -> None:
    message = refusal(*assignments)
    missing = [text for text in expected if text not in message]
    if missing:
        fail(
            f"capstone config {assignments}: the refusal should mention {missing}; got:\n{message}"
        )


def test_an_unknown_config_name_lists_the_shipped_ones() -> None:
    with pytest.raises(cfgmod.ConfigError, match="resnet50-8gpu"):
        cfgmod.load_config("resnet101-64gpu")


def test_the_trainer_refuses_before_any_process_group(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from solutions.phase4_production.imagenet import trainer as imagenet_trainer

    assert imagenet_trainer.main(["--set", "optim.momentum=1.5"]) == 2
    err = capsys.readouterr().err
    assert "optim.momentum=1.5" in err and "less than 1" in err, err
    assert imagenet_trainer.main(["data.source=imagefolder", f"data.root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "there is no train/ folder" in err and "n01440764/" in err, err
    assert not dist.is_initialized(), "a refused config must not start a process group"
    assert imagenet_trainer.main(["--print-config", "train.epochs=7"]) == 0
    assert "epochs: 7" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the data folder


def _copy(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("missing", "no such folder"),
        ("no_val", "there is no val/ folder"),
        ("flat_val", "15 images lie directly in val/"),
        ("class_mismatch", "only in train/: ['n01484850']"),
        ("empty_class", "Found no valid file"),
        ("no_classes", "train/ has no class folders"),
    ],
)
def test_a_malformed_folder_is_refused_with_the_expected_layout(
    folder: Path, tmp_path: Path, breakage: str, expected: str
) -> None:
    root = _copy(folder, tmp_path)
    if breakage == "missing":
        root = tmp_path / "nowhere"
    elif breakage == "no_val":
        shutil.rmtree(root / "val")
    elif breakage == "flat_val":
        for image in list((root / "val").glob("*/*.JPEG")):
            image.rename(root / "val" / image.name)
        for name in CLASSES:
            (root / "val" / name).rmdir()
    elif breakage == "class_mismatch":
        shutil.rmtree(root / "val" / CLASSES[2])
    elif breakage == "empty_class":
        for image in (root / "val" / CLASSES[1]).iterdir():
            image.unlink()
    elif breakage == "no_classes":
        shutil.rmtree(root / "train")
        (root / "train").mkdir()
    with pytest.raises(data.LayoutError) as info:
        data.check_imagefolder(root)
    message = str(info.value)
    for text in (expected, "expected an ImageFolder layout", "train/", "n01440764/", "val/"):
        if text not in message:
            fail(f"malformed folder ({breakage}): the refusal should contain {text!r}:\n{message}")


def test_a_good_folder_is_scanned_once_with_its_classes(folder: Path) -> None:
    splits = data.check_imagefolder(folder)
    assert splits.classes == list(CLASSES)
    assert len(splits.train) == 48 and len(splits.val) == 3 * VAL_PER_CLASS


# ----------------------------------------------------------------------------- augmentation


class _Shard:
    """A stand-in for the course's sampler: a fixed order, with set_epoch(epoch, start_index)."""

    def __init__(self, order: list[int]) -> None:
        self.order, self.start = order, 0

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        self.start = start_index

    def __iter__(self) -> Any:
        return iter(self.order[self.start :])

    def __len__(self) -> int:
        return len(self.order) - self.start


def _batches(dataset: Any, workers: int, epoch: int, start: int = 0) -> list[torch.Tensor]:
    sampler = data.EpochSampler(_Shard([5, 17, 2, 30, 44, 8, 11, 23]))
    sampler.set_epoch(epoch, start_index=start)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=2, sampler=sampler, num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    return [images for images, _ in loader]


def test_augmentation_depends_on_seed_epoch_and_index_only(folder: Path) -> None:
    splits = data.check_imagefolder(folder)
    dataset = data.FolderDataset(splits.train, data.train_transform(32), seed=0)
    before = torch.get_rng_state()
    plain = _batches(dataset, workers=0, epoch=3)
    if not torch.equal(torch.get_rng_state(), before):
        fail("capstone data: loading moved the main process's torch RNG (dropout would differ)")
    workers = _batches(dataset, workers=2, epoch=3)
    resumed = _batches(dataset, workers=2, epoch=3, start=4)
    for a, b in zip(plain, workers, strict=True):
        if not torch.equal(a, b):
            fail("capstone data: 0 and 2 workers cropped the same samples differently")
    for a, b in zip(plain[2:], resumed, strict=True):
        if not torch.equal(a, b):
            fail("capstone data: a loader resumed at sample 4 cropped samples 4.. differently")
    if torch.equal(plain[0], _batches(dataset, workers=0, epoch=4)[0]):
        fail("capstone data: epoch 4 repeated epoch 3's crops")
    assert plain[0].dtype == torch.uint8 and plain[0].shape == (2, 3, 32, 32)


def test_the_gpu_decode_path_run_on_cpu_equals_decoding_in_workers(folder: Path) -> None:
    splits = data.check_imagefolder(folder)
    transform = data.train_transform(32)
    in_workers = data.FolderDataset(splits.train, transform, seed=0, decoder="torchvision")
    raw = data.FolderDataset(splits.train, transform, seed=0, decoder="cuda")
    decode = data.gpu_decoder(transform, 0, torch.device("cpu"))
    keys = [(1, 3), (1, 40), (2, 3)]
    want = torch.stack([in_workers[key][0] for key in keys])
    got = decode(data.collate_bytes([raw[key] for key in keys])[0])
    if not torch.equal(got, want):
        fail("capstone data: decoding the files' bytes in the main process (the data.decoder=cuda "
             "path) gave other images than decoding in workers")  # fmt: skip


def test_the_device_loader_normalises_uint8_on_the_device_in_channels_last() -> None:
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    loader = data.DeviceLoader(
        [(images, torch.tensor([0, 1]))],  # type: ignore[arg-type]
        torch.device("cpu"),
        channels_last=True,
    )
    x, y = next(iter(loader))
    mean = torch.tensor(data.MEAN).view(1, 3, 1, 1)
    std = torch.tensor(data.STD).view(1, 3, 1, 1)
    torch.testing.assert_close(x, (images.float() / 255 - mean) / std, rtol=1e-5, atol=1e-5)
    assert x.is_contiguous(memory_format=torch.channels_last) and y.tolist() == [0, 1]


# ----------------------------------------------------------------------------- recipe


def test_no_weight_decay_on_norms_biases_and_vit_embeddings() -> None:
    import torchvision

    model = torchvision.models.resnet18(num_classes=3)
    decay, skip = recipe.param_groups(model, 1e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = sorted(names[id(p)] for p in skip["params"])
    decayed = sorted(names[id(p)] for p in decay["params"])
    assert len(no_decay) + len(decayed) == len(list(model.parameters()))
    norm_or_bias = set()
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False, prefix=module_name):
            if isinstance(module, torch.nn.BatchNorm2d) or name.endswith("bias"):
                norm_or_bias.add(name)
    wrongly_decayed = sorted(set(decayed) & norm_or_bias)
    wrongly_skipped = sorted(set(no_decay) - norm_or_bias)
    if wrongly_decayed or wrongly_skipped:
        fail(
            "capstone recipe: weight decay applies to conv and linear weights only; decayed "
            f"norms/biases: {wrongly_decayed}; undecayed weights: {wrongly_skipped}"
        )
    assert decay["weight_decay"] == 1e-4 and skip["weight_decay"] == 0.0
    vit = torchvision.models.vit_b_16(image_size=32, num_classes=3)
    _, vit_skip = recipe.param_groups(vit, 0.3)
    vit_names = {id(p): n for n, p in vit.named_parameters()}
    skipped = {vit_names[id(p)] for p in vit_skip["params"]}
    assert {"class_token", "encoder.pos_embedding", "encoder.ln.weight"} <= skipped
    assert "conv_proj.weight" not in skipped


def test_linear_scaling_warmup_and_cosine() -> None:
    assert recipe.scaled_lr(0.1, 4096) == pytest.approx(1.6)
    factors = [recipe.lr_factor(s, 10, 110, 0.1, 0.0) for s in range(111)]
    assert factors[0] == pytest.approx(0.1) and factors[10] == pytest.approx(1.0)
    assert all(factors[i] < factors[i + 1] for i in range(10)), "warmup ramps"
    assert factors[60] == pytest.approx(0.5) and factors[110] == pytest.approx(0.0, abs=1e-12)
    model = torch.nn.Linear(2, 2)
    optim_cfg = cfgmod.OptimConfig(base_lr=0.1, warmup_epochs=1.0)
    optimizer = recipe.build_optimizer(model, optim_cfg, 512)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["nesterov"]
    scheduler = recipe.build_scheduler(optimizer, optim_cfg, steps_per_epoch=4, epochs=3)
    lrs = []
    for _ in range(12):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.2 * 0.1) and lrs[4] == pytest.approx(0.2)
    saved = scheduler.state_dict()
    path = Path(__import__("tempfile").mkdtemp()) / "s.pt"
    torch.save(saved, path)
    assert torch.load(path, weights_only=True)["lr_lambdas"][0]["warmup_steps"] == 4


def test_label_smoothing_spreads_eps_over_the_classes() -> None:
    logits, target = torch.randn(4, 5), torch.tensor([0, 3, 1, 4])
    got = recipe.build_loss(0.1)(logits, target)
    logp = logits.log_softmax(dim=1)
    want = -(0.9 * logp.gather(1, target[:, None]).squeeze(1) + 0.1 / 5 * logp.sum(dim=1)).mean()
    torch.testing.assert_close(got, want)


def test_top_k_counts_cap_k_at_the_number_of_classes() -> None:
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.05, 0.15], [0.2, 0.3, 0.5]])
    assert correct_at_k(logits, torch.tensor([1, 2, 0]), (1, 2, 5)).tolist() == [1, 2, 3]


# ----------------------------------------------------------------------------- train, evaluate


def single_process_eval(weights: dict[str, torch.Tensor], folder: Path) -> tuple[float, float, int]:
    """torchvision's reference way: every val image through the model in one process."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=len(CLASSES))
    model.load_state_dict(weights)
    model.eval()
    splits = data.check_imagefolder(folder)
    dataset = data.FolderDataset(splits.val, data.eval_transform(32, 36), seed=0)
    loader = data.DeviceLoader(
        torch.utils.data.DataLoader(dataset, batch_size=5, sampler=data.ShardSampler(len(dataset), 0, 1)),
        torch.device("cpu"), channels_last=False,
    )  # fmt: skip
    correct1 = correct5 = total = 0
    with torch.no_grad():
        for images, targets in loader:
            top = model(images).topk(3, dim=1).indices
            correct1 += int((top[:, 0] == targets).sum())
            correct5 += int((top == targets[:, None]).any(dim=1).sum())
            total += len(targets)
    return 100 * correct1 / total, 100 * correct5 / total, total


def test_evaluation_over_two_ranks_equals_one_process(
    folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref = reference_run(folder, tmp_path_factory)
    out = world(eval_worker, 2, config(folder, ref["dir"]))
    result = out[0]["result"]
    if out[1]["result"] != result:
        fail(f"capstone eval: ranks disagree: {out[0]['result']} vs {out[1]['result']}")
    top1, top5, total = single_process_eval(out[0]["weights"], folder)
    if (result.top1, result.top5, result.samples) != (top1, top5, total):
        fail(
            f"capstone eval over 2 ranks: top-1 {result.top1:.2f}%, top-5 {result.top5:.2f}% on "
            f"{result.samples} images; one process with rank 0's weights: {top1:.2f}%, "
            f"{top5:.2f}% on {total}: shards must not overlap or pad, and rank 0's BatchNorm "
            "statistics must be broadcast first"
        )
    summary = ref["out"][0]["summary"]
    assert summary["global_step"] == 12 and not math.isnan(summary["top1"])
    if summary["top1"] < 60:
        fail(f"capstone: after 12 steps on 3 easy classes top-1 is {summary['top1']:.1f}%")


def test_a_fresh_world_resumed_mid_epoch_ends_bitwise_equal(
    folder: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    want = reference_run(folder, tmp_path_factory)["weights"]
    directory = tmp_path / "ckpt"
    shutil.copytree(reference_run(folder, tmp_path_factory)["dir"], directory)
    for path in directory.glob("step_*"):
        if int(path.name[5:]) > 8:  # step 8 is mid-epoch 1 (6 steps per epoch)
            shutil.rmtree(path)
    out = world(train_worker, 2, config(folder, directory))
    compare_weights(out[0]["weights"], want, "capstone resumed from step 8 in a fresh world")
    saved = final_checkpoint(directory)
    assert saved["progress"] == {"epoch": 2, "position": 0, "global_step": 12}


def test_fp16_scaler_clipping_accumulation_compression_hook_and_monitor(
    folder: Path, tmp_path: Path
) -> None:
    cfg = config(
        folder, tmp_path / "ckpt", **{
            "data.source": "synthetic", "data.train_samples": 16, "data.val_samples": 8,
            "data.image_size": 16, "data.val_resize": 18, "model.channels_last": True,
            "train.precision": "fp16", "train.grad_clip_norm": 1.0,
            "train.accumulation_steps": 2, "data.batch_per_gpu": 2,
            "communication.compression": "fp16", "train.epochs": 1,
            "monitoring.enabled": True, "monitoring.log_dir": str(tmp_path / "runs"),
            "monitoring.log_every_steps": 1, "monitoring.tensorboard": False,
        },
    )  # fmt: skip
    out = world(train_worker, 2, cfg)
    assert out[0]["summary"]["global_step"] == 2
    saved = final_checkpoint(tmp_path / "ckpt")
    if saved["scaler"] is None or "scale" not in saved["scaler"]:
        fail("capstone fp16: the loss scaler's state must be in the checkpoint")
    assert all(torch.isfinite(v.float()).all() for v in out[0]["weights"].values())
    # 4.5's monitor, wired in through imagenet/monitoring.py
    lines = (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted((r["step"], r["rank"]) for r in records) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["mfu"] is not None and r["mfu"] > 0 for r in records)


def test_the_benchmark_prints_its_tables(capsys: pytest.CaptureFixture[str]) -> None:
    from solutions.phase4_production.imagenet import benchmark as bench

    # the last row is nvJPEG's where CUDA is visible (the GPU batch runs this suite there)
    cuda_row = ("| capstone, nvJPEG decode (1 worker read files)" if torch.cuda.is_available()
                else "| capstone, decoder=cuda path on the CPU")  # fmt: skip

    argv = ["--steps", "1", "--warmup", "0", "--batch", "2", "--jpegs", "2", "--cpu-smoke"]
    assert bench.main([*argv, "--decode-images", "2", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    header = "| run | images/s | vs reference | step ms | data ms | forward ms | backward ms "
    assert header in out, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x |" in line]
    names = [row.split(" | ")[0] for row in rows]
    assert names == [
        "| torchvision reference (train.py step)",
        "| capstone, synthetic (fp32, NCHW)",
        "| capstone, JPEG decode (1 worker)",
        cuda_row,
    ], out
    assert rows[0].split(" | ")[2] == "1.00x" and all(row.endswith("% |") for row in rows)
    assert "| pil (224 px crops" in out and "| torchvision (224 px crops" in out
    assert "resnet18 at 32 px, batch 2, fp32" in out and "GFLOP per image" in out
    with pytest.raises(SystemExit) as refused:  # parse_config: one line, before anything runs
        bench.main(["--steps", "0"])
    assert refused.value.code == 2
    assert "--steps 0: must be >= 1" in capsys.readouterr().err


@pytest.mark.torchrun
def test_sigkill_under_torchrun_resumes_bitwise_equal(
    folder: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    want = reference_run(folder, tmp_path_factory)["weights"]
    directory = tmp_path / "ckpt"
    args = overrides(folder, directory, **{"data.workers": 1})
    run = run_torchrun(
        MODULE, args, nproc_per_node=2, max_restarts=1, time_limit=slow_machine_limit(90),
        env={"DTFS_FAIL": "kill:rank=1:step=10"}, fork_workers=True,
    )  # fmt: skip
    what = "capstone under torchrun --max-restarts=1, rank 1 SIGKILLed after step 10"
    text = "\n".join(log.stdout + log.stderr for log in run.ranks if log.attempt == 1)
    if not run.ok or run.attempts() != [0, 1]:
        fail(f"{what}: expected 2 attempts and exit 0, got {run.attempts()}\n{run.describe(600)}")
    if "resumed from step_00000008 (epoch 1, sample 16, step 8)" not in text:
        fail(f"{what}: the restart should resume from step 8, mid-epoch 1\n{run.describe(600)}")
    compare_weights(final_checkpoint(directory)["model"], want, what)
    survivors = sorted(pid for pid in run.pids if alive(pid))
    assert not survivors, f"{what}: processes outlived the run: {survivors}"
