"""Exercise 2.7, part 1: which positions each rank holds, and which blocks causal attention needs.

Context parallelism cuts the sequence into equal *chunks*, numbered 0, 1, 2, ... in sequence
order, and gives each rank of the context-parallel group some of them. A rank's *local* q, k and
v are its chunks concatenated, in the order :func:`chunk_ids` lists them.

* **Contiguous layout**: cp chunks, rank r holds chunk r. Simple, but under a causal mask the
  last rank's queries see every key and the first rank's only their own: the work per rank grows
  with the rank, and the ring waits for the slowest.
* **Zig-zag layout** (load-balanced, as in Megatron-LM's context parallelism and
  ``torch.distributed.tensor.experimental``'s head-tail load balancer): 2·cp chunks, and each
  rank holds two of them, one from early in the sequence and one from late, chosen so that every
  rank does the same causal work. The guide's pictures show which two for cp = 2 and cp = 4; the
  rule for any cp is yours to find (:func:`zigzag_chunk_ids`).

Under a causal mask, query position i may use key position j only when j <= i. For a block made
of one query chunk and one key chunk (equal lengths, so chunk boundaries line up), that decides
everything about the block at once: :func:`block_kind` says whether it is needed whole, needs the
causal mask inside it, or is not needed at all (and then not computed: that is where causal
attention saves half its work, and where the layouts differ).

Sequence lengths that do not cut into equal chunks are refused, not padded (see
``check_sequence_split`` in ring_attention_blocks.py for the message and the fixes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phase2_advanced.ring_attention_blocks import BlockKind, check_sequence_split, chunk_count


def zigzag_chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks rank ``rank`` of ``cp`` holds in the zig-zag layout of 2·cp chunks.

    In the order its local piece lays them out: the earlier chunk first (the order
    ``torch.distributed.tensor.experimental``'s head-tail load balancer uses, so a sequence
    sharded by either lines up).
    """
    # TODO 2.7: the two chunks this rank holds in the zig-zag layout, the earlier one first
    # Invariant: over the ranks 0..cp-1, every chunk 0..2·cp-1 is held exactly once; every
    #   rank's chunks need the same causal work (count, for each of its query chunks, the
    #   key chunks at or before it); the earlier chunk comes first.
    # Hint 1: work the cp = 2 and cp = 4 pictures of the guide into a table (rank, first
    #   chunk, second chunk), then read the rule off it. An early chunk has little to attend
    #   to, a late one a lot.
    # Hint 2: How many blocks of causal work does chunk c need? If a rank holds chunks a and b,
    #   what must be the same on every rank for the work to be equal? Which two chunks does
    #   rank 0 hold in both pictures, and which does rank 1?
    # Hint 3: Chunk c needs c whole blocks and one diagonal (half a block), so two chunks are
    #   worth as much as two others exactly when their numbers add up to the same sum: every
    #   rank's pair must add up to that of the first and the last chunk, 2·cp − 1.
    # Hint 4: Rank r holds chunk r, counted from the start of the sequence, and chunk
    #   2·cp − 1 − r, counted back from its end, in that order.
    # See guidelines.md#27-context-parallelism
    # >>> solution
    # rank r: chunk r from the front, chunk 2cp-1-r from the back. Causal work of chunk c is
    # c full blocks + 1 diagonal, so r + (2cp-1-r) = 2cp-1 full + 2 diagonals on every rank.
    return rank, 2 * cp - 1 - rank
    # <<< solution


def chunk_ids(rank: int, cp: int, *, zigzag: bool) -> tuple[int, ...]:
    """The chunks rank ``rank`` of ``cp`` holds, in local order: one (contiguous) or two."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in a context-parallel group of {cp}")
    if not zigzag:
        return (rank,)
    return tuple(zigzag_chunk_ids(rank, cp))


def shard_sequence(
    x: torch.Tensor, rank: int, cp: int, *, zigzag: bool, dim: int = 2
) -> torch.Tensor:
    """Rank ``rank``'s local piece of the whole sequence ``x`` (its chunks along ``dim``,
    concatenated in :func:`chunk_ids` order). Refuses lengths that do not cut evenly."""
    check_sequence_split(x.shape[dim], cp, zigzag)
    chunks = x.chunk(chunk_count(cp, zigzag), dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, cp, zigzag=zigzag)], dim=dim)


def unshard_sequence(pieces: list[torch.Tensor], *, zigzag: bool, dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's local piece (``pieces[r]`` is rank r's), in order."""
    cp = len(pieces)
    held = [chunk_ids(rank, cp, zigzag=zigzag) for rank in range(cp)]
    by_chunk: dict[int, torch.Tensor] = {}
    for rank, piece in enumerate(pieces):
        for chunk_id, chunk in zip(held[rank], piece.chunk(len(held[rank]), dim=dim), strict=True):
            by_chunk[chunk_id] = chunk
    return torch.cat([by_chunk[c] for c in range(chunk_count(cp, zigzag))], dim=dim)


def gather_sequence(
    local: torch.Tensor, group: dist.ProcessGroup | None = None, *, zigzag: bool, dim: int = 2
) -> torch.Tensor:
    """The whole sequence on every rank of ``group``, from each rank's local piece (an
    all-gather, then :func:`unshard_sequence`)."""
    local = local.contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    return unshard_sequence(pieces, zigzag=zigzag, dim=dim)


def block_kind(q_chunk: int, k_chunk: int, *, causal: bool) -> BlockKind:
    """What attention needs of the block (queries of chunk ``q_chunk``, keys of ``k_chunk``).

    ``BlockKind.FULL``: every query uses every key; ``BlockKind.DIAGONAL``: the causal mask is
    needed inside the block; ``BlockKind.SKIP``: no query uses any key of it.
    """
    # TODO 2.7: which part of a (query chunk, key chunk) block the attention needs
    # Invariant: query position i uses key position j exactly when there is no causal mask, or
    #   j <= i; chunks are equal, contiguous ranges of positions numbered in sequence order, so
    #   one comparison of the chunk numbers decides the whole block.
    # Hint 1: three outcomes under a causal mask; without one, only one of them happens.
    # Hint 2: Without a causal mask, is any key of any block ever left out? With one: when does
    #   every key of the block come before every query, when after every query, and when do the two
    #   chunks share positions? Which comparison of the chunk numbers tells them apart?
    # Hint 3: Without the mask every query sees every key: the whole block is needed (FULL),
    #   whatever the chunk numbers.
    # Hint 4: With the mask, compare the chunk numbers: a key chunk before the query chunk is
    #   used whole (FULL), the same chunk needs the mask inside it (DIAGONAL), a key chunk after
    #   it is never used (SKIP).
    # See guidelines.md#27-context-parallelism
    # >>> solution
    if not causal or k_chunk < q_chunk:
        return BlockKind.FULL
    if k_chunk == q_chunk:
        return BlockKind.DIAGONAL
    return BlockKind.SKIP
    # <<< solution
