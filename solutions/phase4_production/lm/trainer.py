"""Train the byte-level language model on real text, on every axis at once (exercise 4.7).

The text is the Python documentation every installation ships (``pydoc_data.topics``, about
460 KB of English; course/text_corpus.py): the first 90% trains, the last 10% is held out. Each
step takes a global batch of random windows (the same on every rank), each epoch ends with the
held-out text's loss in bits per byte, and rank 0 samples a few lines from the trained model at
the end (the whole model assembled from every rank's pieces). The layout comes from the flags;
``--impl templates`` runs your own 4.7 (on your 2.5-3.8 templates)::

    uv run torchrun --standalone --nproc_per_node=8 \\
        -m solutions.phase4_production.lm.trainer --dp 2 --tp 2 --pp 2
    uv run torchrun --standalone --nproc_per_node=4 \\
        -m solutions.phase4_production.lm.trainer --cp 2 --tp 2 --sequence-parallel --tied
    uv run torchrun --standalone --nproc_per_node=4 \\
        -m solutions.phase4_production.lm.trainer --dp 2 --pp 2 --zero 2 --impl templates

Every setting is checked before the process group exists (degrees that do not fill the world,
heads or widths tp does not divide, a sequence that does not cut into 2 x cp chunks, experts
that ep does not divide, more stages than layers), each refused by name with its fix.
``lm/record.py`` records two layouts' curves side by side.

While it runs, rank 0 says each phase on stderr as it starts (building the model, loading the
corpus) and then shows the steps (``lm.progress.StepProgress``: a bar on a terminal, a line every
10 s elsewhere); ``--metrics FILE`` writes one JSON line per optimizer step
(``lm.metrics.step_record``), so that two runs can be compared exactly.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from course.cli import parse_config, refuse_before_start, run_main
from course.distributed import distributed_session
from course.failure_injection import maybe_fail
from course.impl import IMPLS, load_impl
from course.language_model import LanguageModel, LMConfig, build_language_model, generate
from course.rank_logging import log0
from course.text_corpus import Corpus, bits_per_byte, consecutive_windows, random_windows
from course.topology import Topology
from phase4_production.lm_layout import COMMUNICATION, SCHEDULES, ParallelSettings
from solutions.phase4_production.lm import checkpoint as lm_checkpoint
from solutions.phase4_production.lm.checkpoint import CheckpointPlan
from solutions.phase4_production.lm.metrics import metrics_problem, open_metrics, step_record
from solutions.phase4_production.lm.progress import StepProgress

PHASE = "phase4_production"
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class TrainConfig:
    """Flags of the trainer; every rank must be given the same values."""

    dp: int = field(
        default=-1,
        metadata={
            "help": "data-parallel degree; -1: what the others leave",
            "ge": -1,
            "le": 4096,
            "fix": "-1 or a degree >= 1",
        },
    )
    cp: int = field(
        default=1,
        metadata={
            "help": "context-parallel degree (ring attention)",
            "ge": 1,
            "le": 1024,
            "fix": "e.g. --cp 2",
        },
    )
    tp: int = field(
        default=1,
        metadata={"help": "tensor-parallel degree", "ge": 1, "le": 1024, "fix": "e.g. --tp 2"},
    )
    pp: int = field(
        default=1, metadata={"help": "pipeline stages", "ge": 1, "le": 1024, "fix": "e.g. --pp 2"}
    )
    ep: int = field(
        default=1,
        metadata={
            "help": "expert-parallel degree, over dp x cp",
            "ge": 1,
            "le": 1024,
            "fix": "e.g. --ep 2",
        },
    )
    sequence_parallel: bool = field(default=False, metadata={"help": "Megatron-SP with tp"})
    schedule: str = field(default="1f1b", metadata={"choices": SCHEDULES})
    microbatches: int = field(default=2, metadata={"ge": 1, "le": 4096, "fix": "e.g. 2"})
    chunks: int = field(
        default=2,
        metadata={"help": "chunks per rank (interleaved)", "ge": 1, "le": 64, "fix": "e.g. 2"},
    )
    zero: str = field(
        default="0",
        metadata={"choices": ("0", "1", "2", "3", "fsdp"), "help": "data-parallel sharding"},
    )
    communication: str = field(
        default="library",
        metadata={"choices": COMMUNICATION,
                  "help": "the data-parallel all-reduce: torch's, 3.1's ring or 3.2's tree"},
    )  # fmt: skip
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "each chunk recomputes its forward in backward (2.3)"}
    )
    max_norm: float = field(
        default=1.0,
        metadata={"help": "gradient clipping; 0: none", "ge": 0, "fix": "a bound > 0, or 0"},
    )
    lr: float = field(default=3e-3, metadata={"gt": 0, "le": 10, "fix": "e.g. 3e-3"})
    width: int = field(default=64, metadata={"ge": 2, "le": 8192, "fix": "e.g. 64"})
    heads: int = field(default=4, metadata={"ge": 1, "le": 256, "fix": "e.g. 4"})
    layers: int = field(default=4, metadata={"ge": 1, "le": 256, "fix": "e.g. 4"})
    ffn: int = field(default=128, metadata={"ge": 1, "le": 65536, "fix": "e.g. 128"})
    seq_len: int = field(default=128, metadata={"ge": 2, "le": 65536, "fix": "e.g. 128"})
    tied: bool = field(
        default=False, metadata={"help": "share the head's weight with the embedding"}
    )
    moe_layers: str = field(default="", metadata={"help": "MoE on these layers, e.g. 1,3"})
    num_experts: int = field(default=4, metadata={"ge": 1, "le": 1024, "fix": "e.g. 4"})
    top_k: int = field(default=2, metadata={"ge": 1, "le": 64, "fix": "e.g. 2"})
    batch: int = field(
        default=16,
        metadata={
            "help": "sequences per step, all replicas",
            "ge": 1,
            "le": 1 << 16,
            "fix": "e.g. 16",
        },
    )
    epochs: int = field(default=4, metadata={"ge": 1, "le": 10000, "fix": "e.g. 4"})
    steps_per_epoch: int = field(default=100, metadata={"ge": 1, "le": 1 << 20, "fix": "e.g. 100"})
    eval_batches: int = field(
        default=4,
        metadata={"help": "held-out batches per evaluation", "ge": 1, "le": 10000, "fix": "e.g. 4"},
    )
    dtype: str = field(default="float32", metadata={"choices": tuple(DTYPES)})
    seed: int = field(default=0, metadata={"ge": 0, "fix": "a seed >= 0"})
    sample_bytes: int = field(
        default=240,
        metadata={
            "help": "bytes sampled at the end; 0: none",
            "ge": 0,
            "le": 100000,
            "fix": "e.g. 240",
        },
    )
    impl: str = field(
        default="solutions", metadata={"choices": IMPLS, "help": "the reference or your templates"}
    )
    metrics: str = field(
        default="", metadata={"help": "write one JSON line per optimizer step to this file"}
    )
    progress: bool = field(
        default=True,
        metadata={"help": "a progress bar on a terminal, else a line every 10 s (rank 0, stderr)"},
    )

    def model(self) -> LMConfig:
        layers = tuple(int(x) for x in self.moe_layers.split(",") if x.strip())
        return LMConfig(
            width=self.width, heads=self.heads, layers=self.layers, ffn=self.ffn,
            seq_len=self.seq_len, tied=self.tied, moe_layers=layers,
            num_experts=self.num_experts, top_k=self.top_k, expert_ffn=self.ffn // 2 or 1,
        )  # fmt: skip

    def options(self) -> RunOptions:
        return RunOptions(
            self.batch, self.epochs, self.steps_per_epoch, self.eval_batches, self.dtype,
            self.seed, self.sample_bytes, self.impl, metrics=self.metrics or None,
            progress=self.progress,
        )  # fmt: skip

    def settings(self, world_size: int) -> ParallelSettings:
        dp = self.dp
        if dp == -1:
            others = self.cp * self.tp * self.pp
            dp = world_size // others if world_size % others == 0 else 0
        return ParallelSettings(
            dp=dp, cp=self.cp, tp=self.tp, pp=self.pp, ep=self.ep,
            sequence_parallel=self.sequence_parallel, schedule=self.schedule,
            microbatches=self.microbatches, chunks=self.chunks,
            zero=self.zero if self.zero == "fsdp" else int(self.zero),
            max_norm=self.max_norm or None, lr=self.lr, communication=self.communication,
            activation_checkpointing=self.activation_checkpointing,
        )  # fmt: skip


def validate(config: TrainConfig, world_size: int) -> None:
    """Every bad flag at once, before the process group exists."""
    problems = []
    try:
        model = config.model()
    except ValueError:
        raise ValueError(
            f"--moe-layers {config.moe_layers!r}: layer numbers separated by commas, e.g. 1,3"
        ) from None
    settings = config.settings(world_size)
    if settings.dp < 1:
        problems.append(
            f"--dp -1: cp x tp x pp = {config.cp * config.tp * config.pp} does not divide the "
            f"world of {world_size} ranks; choose degrees whose product divides it"
        )
    else:
        problems += settings.problems(model, config.batch)
        if not problems and settings.world_size != world_size:
            problems.append(
                f"{settings.label()} = {settings.world_size} ranks, but the world has "
                f"{world_size}: run torchrun with --nproc_per_node={settings.world_size}"
            )
    if config.metrics and (problem := metrics_problem(config.metrics, "--metrics")):
        problems.append(problem)
    if problems:
        raise ValueError("; ".join(problems))


@dataclass
class History:
    """What a run measured: per epoch the training loss (its last step), the held-out bits per
    byte, tokens per second; the losses of every step; the sample."""

    epochs: list[dict[str, float]] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    sample: str = ""
    parameters: int = 0


@dataclass(frozen=True)
class RunOptions:
    """What a run does besides its model and layout (``TrainConfig.options()``, or the
    framework's config)."""

    batch: int
    epochs: int
    steps_per_epoch: int
    eval_batches: int
    dtype: str
    seed: int
    sample_bytes: int
    impl: str = "solutions"
    metrics: str | None = None  # a JSONL file: one line per optimizer step (:func:`step_record`)
    progress: bool = True  # rank 0 shows the steps on stderr (:class:`StepProgress`)


def say(line: str) -> None:
    """What the run is doing now, on rank 0's stderr (a phase that may take seconds: the user
    sees it start, instead of silence)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def evaluate(model: Any, corpus: Corpus, options: RunOptions, seq_len: int) -> float:
    """Held-out bits per byte: the mean cross-entropy over the first ``eval_batches`` batches of
    consecutive windows (the same windows every epoch and every layout)."""
    total, count = 0.0, 0
    for tokens, targets in consecutive_windows(corpus.held_out, options.batch, seq_len,
                                               limit=options.eval_batches):  # fmt: skip
        if tokens.shape[0] != options.batch:
            break
        report = model.evaluate(tokens, targets)
        total += report.cross_entropy * report.valid_tokens
        count += report.valid_tokens
    return bits_per_byte(total / count)


def train(config: TrainConfig, topology: Topology) -> History:
    """The flags' run on this rank, inside an initialised process group."""
    return run(config.model(), config.settings(topology.world_size), config.options(), topology)


def run(
    model_config: LMConfig,
    settings: ParallelSettings,
    options: RunOptions,
    topology: Topology,
    checkpoint: CheckpointPlan | None = None,
) -> History:
    """The whole run on this rank, inside an initialised process group. With ``checkpoint``
    it first resumes from the newest checkpoint in its folder, whatever layout saved it
    (lm/checkpoint.py), and saves every ``checkpoint.every`` steps and at the end (none when
    ``every`` is 0). Rank 0 says each phase as it starts and shows the steps on stderr
    (:class:`StepProgress`), and with ``options.metrics`` writes one line per step."""
    looking = f", looking for a checkpoint in {checkpoint.directory}" if checkpoint else ""
    ranks = f" on {topology.world_size} ranks" if topology.world_size > 1 else ""
    say(f"building the model at {settings.label()}{ranks}{looking}")
    lm = load_impl(PHASE, "lm_parallel", options.impl)
    dtype = DTYPES[options.dtype]
    generator = torch.Generator().manual_seed(options.seed)
    dense = build_language_model(model_config, options.seed, dtype)
    history = History(parameters=sum(p.numel() for p in dense.parameters()))

    def make_runtime(weights: torch.nn.Module) -> Any:
        return lm.ParallelLanguageModel(weights, topology, settings)

    folder = lm_checkpoint.resume_folder(checkpoint, model_config) if checkpoint else None
    start = 0
    if checkpoint and checkpoint.resume and folder is not None:
        restored = lm_checkpoint.load(folder, model_config, dtype, progress_of(generator, 0))
        model = lm_checkpoint.resumed_runtime(restored, model_config, dtype, make_runtime)
        generator.set_state(restored.progress["generator"])
        start = int(restored.progress["global_step"])
        log0(f"resumed from {folder} (saved at {restored.layout}, step {start}); running at "
             f"{settings.label()}")  # fmt: skip
    else:
        model = make_runtime(dense)
    if checkpoint and not checkpoint.every and start:
        log0("checkpoint.every is 0: this run continues from that checkpoint and saves none")
    say("loading the corpus (the Python documentation, pydoc_data.topics)")
    corpus = Corpus.load()
    seq_len = model_config.seq_len
    log0(
        f"language model ({options.impl}): {history.parameters:,} parameters, width "
        f"{model_config.width}, {model_config.layers} layers, {model_config.heads} heads, "
        f"seq {seq_len}, {options.dtype}; {settings.label()}; batch {options.batch} "
        f"sequences; AdamW lr {settings.lr}\n{topology.grid.describe()}"
    )
    log0("\n| epoch | train loss (nats) | held-out bits/byte | tokens/s |\n|---:|---:|---:|---:|")
    total = options.epochs * options.steps_per_epoch
    tokens_per_step = options.batch * seq_len
    rank0 = topology.rank == 0
    say(f"training: {total - start} steps of {tokens_per_step:,} tokens")
    progress = StepProgress(total, start, tokens_per_step, enabled=options.progress and rank0)
    record = open_metrics(options.metrics, start) if options.metrics and rank0 else None
    try:
        for epoch in range(start // options.steps_per_epoch, options.epochs):
            started, loss = time.perf_counter(), math.nan
            first = max(0, start - epoch * options.steps_per_epoch)  # resumed mid-epoch
            for step in range(first, options.steps_per_epoch):
                tokens, targets = random_windows(corpus.train, options.batch, seq_len, generator)
                began = time.perf_counter()
                report = model.train_step(tokens.contiguous(), targets.contiguous())
                step_seconds = time.perf_counter() - began
                loss = report.loss
                history.step_losses.append(loss)
                done = epoch * options.steps_per_epoch + step + 1
                if record is not None:
                    line = step_record(done, epoch + 1, report, tokens_per_step, settings,
                                       step_seconds)  # fmt: skip
                    record.write(json.dumps(line) + "\n")
                progress.step(loss, step_seconds)
                maybe_fail(done)  # DTFS_FAIL=kill:rank=1:step=3 (course/failure_injection.py)
                if checkpoint and checkpoint.every and (done % checkpoint.every == 0
                                                        or done == total):  # fmt: skip
                    lm_checkpoint.save(checkpoint, model, progress_of(generator, done),
                                       model_config, settings)  # fmt: skip
            seconds = time.perf_counter() - started
            tokens_per_second = (options.steps_per_epoch - first) * tokens_per_step / seconds
            bpb = evaluate(model, corpus, options, seq_len)
            history.epochs.append({"epoch": epoch + 1, "train_loss": loss, "bits_per_byte": bpb,
                                   "tokens_per_second": tokens_per_second})  # fmt: skip
            with progress.paused():
                log0(f"| {epoch + 1} | {loss:.4f} | {bpb:.4f} | {tokens_per_second:,.0f} |")
    finally:
        progress.close()
        if record is not None:
            record.close()
    if options.sample_bytes:
        state = model.full_state()
        if topology.rank == 0:
            history.sample = sample_text(state, model_config, dtype, options)
            log0(f"\nsampled after the prompt 'The ' (temperature 0.8):\n{history.sample}")
    return history


def progress_of(generator: torch.Generator, global_step: int) -> dict[str, torch.Tensor]:
    """The data position a checkpoint keeps: the batches' generator and the steps done."""
    return {"generator": generator.get_state(), "global_step": torch.tensor(global_step)}


def sample_text(
    state: dict[str, torch.Tensor], config: LMConfig, dtype: torch.dtype, options: RunOptions
) -> str:
    """Bytes from the trained model (loaded from the assembled state into one process)."""
    model = LanguageModel(config).to(dtype)
    model.load_state_dict(state)
    model.eval()
    text = generate(model, b"The ", options.sample_bytes, seed=options.seed)
    return text.decode("utf-8", errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(TrainConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate(config, world))) is not None:
        return code
    with distributed_session():
        import torch.distributed as dist

        settings = config.settings(dist.get_world_size())
        topology = Topology.build(settings.dp, settings.tp, settings.pp, cp=settings.cp,
                                  ep=settings.ep)  # fmt: skip
        train(config, topology)
    return 0


if __name__ == "__main__":
    run_main(main)
