"""Real English text without a download: the Python documentation every installation ships.

Given (not an exercise). ``pydoc_data.topics`` is the text ``help("assert")`` and friends print:
the language reference's chapters on statements, expressions, the data model and more, about
460 KB of English prose and code. Byte-level language models (exercise 4.7) read it as UTF-8
bytes. The topics are joined in sorted order and cut once: the first 90% trains, the last 10% is
held out (a contiguous piece, so no held-out sentence was seen in training).

Batches are random windows of ``seq_len + 1`` bytes from the training text, drawn from a
``torch.Generator`` the caller seeds: ``tokens`` are the first ``seq_len`` bytes, ``targets``
the ``seq_len`` bytes after each (the next byte to predict). The held-out text is read in
consecutive windows; its loss in nats per byte divided by ``ln 2`` is *bits per byte*, the usual
measure of a byte-level model (8 for a uniform guess; gzip reaches about 2.5 on English).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

HELD_OUT_SHARE = 0.1


def corpus_bytes() -> bytes:
    """The whole text, UTF-8 encoded: the topics of ``pydoc_data.topics`` in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


@dataclass(frozen=True)
class Corpus:
    """The training and held-out bytes, as int64 tensors of byte values."""

    train: torch.Tensor
    held_out: torch.Tensor

    @classmethod
    def load(cls, held_out_share: float = HELD_OUT_SHARE) -> Corpus:
        if not 0 < held_out_share < 1:
            raise ValueError(f"held_out_share={held_out_share}: a share between 0 and 1")
        data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
        cut = int(len(data) * (1 - held_out_share))
        return cls(data[:cut], data[cut:])


def random_windows(
    data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``data``: ``(tokens, targets)``, each [batch, seq_len]."""
    if len(data) < seq_len + 1:
        raise ValueError(f"{len(data)} bytes cannot hold a window of {seq_len + 1}")
    starts = torch.randint(0, len(data) - seq_len, (batch,), generator=generator)
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def consecutive_windows(
    data: torch.Tensor, batch: int, seq_len: int, limit: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The text cut into consecutive windows (the last partial one dropped), in batches of
    ``batch`` (the last batch padded by repeating windows is avoided: it may be smaller), at
    most ``limit`` batches."""
    count = (len(data) - 1) // seq_len
    rows = [data[i * seq_len : i * seq_len + seq_len + 1] for i in range(count)]
    batches = []
    for start in range(0, count, batch):
        chunk = torch.stack(rows[start : start + batch])
        batches.append((chunk[:, :-1], chunk[:, 1:]))
        if limit is not None and len(batches) >= limit:
            break
    return batches


def bits_per_byte(nats_per_byte: float) -> float:
    """A mean cross-entropy in nats per byte, in bits per byte."""
    return nats_per_byte / math.log(2)
