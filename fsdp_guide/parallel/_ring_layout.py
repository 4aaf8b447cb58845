"""How a sequence is cut over the ranks of a ring, and what each rank computes (private).

``"naive"`` cuts the sequence into ``c`` consecutive chunks, one per rank; ``"zigzag"`` into
``2c`` and gives rank ``r`` chunks ``r`` and ``2c - 1 - r``. Under a causal mask a query
chunk needs only the key chunks at or before it: :func:`block_work` says which chunk pairs a
rank computes against each K/V block, :func:`ring_schedule` how much of a block that is at
each step of the ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Layout = Literal["naive", "zigzag"]
LAYOUTS: tuple[Layout, ...] = ("naive", "zigzag")


def chunk_ids(rank: int, ranks: int, layout: Layout = "naive") -> tuple[int, ...]:
    """The chunks of the sequence rank ``rank`` of ``ranks`` holds, in order.

    ``"naive"`` cuts the sequence in ``ranks`` chunks, one each; ``"zigzag"`` cuts it in
    ``2 * ranks`` and gives rank ``r`` chunks ``r`` and ``2 * ranks - 1 - r``.

    Raises:
        ValueError: For an unknown layout or a rank outside ``range(ranks)``.

    Examples:
        >>> chunk_ids(0, 4), chunk_ids(0, 4, "zigzag"), chunk_ids(3, 4, "zigzag")
        ((0,), (0, 7), (3, 4))
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of {ranks} ranks")
    return (rank,) if layout == "naive" else (rank, 2 * ranks - 1 - rank)


def shard_sequence(
    x: Tensor, rank: int, ranks: int, layout: Layout = "naive", dim: int = 1
) -> Tensor:
    """The tokens of ``x`` (cut along ``dim``) that rank ``rank`` of ``ranks`` holds, a copy.

    ``shard_sequence(torch.arange(seq_len), ...)`` gives the rank's positions.

    Raises:
        ValueError: When the sequence does not divide into the layout's chunks.

    Examples:
        >>> shard_sequence(torch.arange(8), 1, 2, "zigzag", dim=0)
        tensor([2, 3, 4, 5])
    """
    pieces = len(chunk_ids(0, ranks, layout)) * ranks
    if x.shape[dim] % pieces:
        raise ValueError(
            f"a sequence of {x.shape[dim]} tokens does not cut into {pieces} equal chunks "
            f"({layout!r} over {ranks} ranks); choose a length divisible by {pieces}"
        )
    chunks = x.chunk(pieces, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, ranks, layout)], dim=dim)


def unshard_sequence(shards: list[Tensor], layout: Layout = "naive", dim: int = 1) -> Tensor:
    """The whole sequence back from every rank's :func:`shard_sequence`, in rank order.

    Examples:
        >>> x = torch.arange(8)
        >>> shards = [shard_sequence(x, r, 2, "zigzag", dim=0) for r in range(2)]
        >>> torch.equal(unshard_sequence(shards, "zigzag", dim=0), x)
        True
    """
    ranks = len(shards)
    placed: dict[int, Tensor] = {}
    for rank, shard in enumerate(shards):
        ids = chunk_ids(rank, ranks, layout)
        for chunk_id, piece in zip(ids, shard.chunk(len(ids), dim=dim), strict=True):
            placed[chunk_id] = piece
    return torch.cat([placed[i] for i in sorted(placed)], dim=dim)


@dataclass(frozen=True)
class BlockWork:
    """What one rank computes against one K/V block: the query and key chunks it pairs.

    Attributes:
        rows: The local query chunks used (indices into the rank's chunks).
        cols: The block's key chunks used.
        diagonal: Whether a query chunk meets its own key chunk (a causal mask inside).
    """

    rows: tuple[int, ...]
    cols: tuple[int, ...]
    diagonal: bool

    @property
    def empty(self) -> bool:
        """Whether nothing is computed (every key comes after every query)."""
        return not self.rows

    def fraction(self, chunks: int) -> float:
        """The share of a full block (``chunks`` x ``chunks`` chunk pairs) this computes."""
        return len(self.rows) * len(self.cols) / chunks**2


def block_work(rank: int, source: int, ranks: int, layout: Layout, causal: bool) -> BlockWork:
    """The chunk pairs rank ``rank`` computes against the K/V block of rank ``source``.

    Without a causal mask every pair is needed. With one, a query chunk needs a key chunk
    that comes before it, or itself (masked inside); the rows and columns kept are those of
    the pairs needed, so a block only partly seen is cut to the part that is.

    Examples:
        >>> block_work(0, 1, 2, "naive", causal=True).empty  # rank 0 sees nothing of rank 1
        True
        >>> block_work(0, 1, 2, "zigzag", causal=True)  # its tail chunk sees all of rank 1
        BlockWork(rows=(1,), cols=(0, 1), diagonal=False)
    """
    mine, theirs = chunk_ids(rank, ranks, layout), chunk_ids(source, ranks, layout)
    pairs = [
        (i, j) for i, q in enumerate(mine) for j, k in enumerate(theirs) if not causal or k <= q
    ]
    rows = tuple(sorted({i for i, _ in pairs}))
    cols = tuple(sorted({j for _, j in pairs}))
    diagonal = causal and any(mine[i] == theirs[j] for i, j in pairs)
    return BlockWork(rows=rows, cols=cols, diagonal=diagonal)


def ring_schedule(ranks: int, layout: Layout = "naive", causal: bool = True) -> list[list[float]]:
    """The share of a full block each rank computes at each ring step, ``[rank][step]``.

    A block is ``(seq_len / c)²`` query-key pairs; a pair is computed when its query sees
    its key, and the masked pairs of a chunk against itself cost as much as the others (a
    matrix multiply computes them all). A step lasts as long as its busiest rank: the others
    wait. The sum over the steps of their maximum is the time the ring takes, in blocks.

    Examples:
        >>> ring_schedule(2, "naive")
        [[1.0, 0.0], [1.0, 1.0]]
        >>> ring_schedule(2, "zigzag")
        [[1.0, 0.5], [1.0, 0.5]]
    """
    chunks = len(chunk_ids(0, ranks, layout))
    return [
        [
            share_of(block_work(rank, (rank - step) % ranks, ranks, layout, causal), chunks)
            for step in range(ranks)
        ]
        for rank in range(ranks)
    ]


def share_of(work: BlockWork, chunks: int) -> float:
    """The share of a full block computed: a masked pair costs as much as a seen one."""
    return 0.0 if work.empty else work.fraction(chunks)
