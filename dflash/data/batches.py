"""Training batches: fixed-shape rows of tokenized conversations, and a resumable, rank-sharded
sampler that decides which conversations go into which row of which batch.

Batches are right-padded to a fixed ``seq_len`` so compiled code sees one shape. A row holds
one conversation, or with packing (:mod:`dflash.data.packing`) several, each a *document* with its
own ``document_ids`` and ``position_ids`` restarting at 0, so that the target, the anchors, the
labels and the DFlash mask treat each as if it were alone (:mod:`dflash.masks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dflash.data.packing import row_packer
from dflash.data.tokenize import Example


@dataclass
class Batch:
    """A fixed-shape training batch of right-padded rows; a row holds one conversation or, packed
    (:mod:`dflash.data.packing`), several, each a document.

    Args:
        input_ids (torch.Tensor): ``[B, S]`` int64, padding = ``pad_token_id``.
        loss_mask (torch.Tensor): ``[B, S]`` bool, True on supervised (assistant) tokens.
        lengths (torch.Tensor): ``[B]`` int64, number of real (non-padding) tokens per row.
        position_ids (torch.Tensor, optional): ``[B, S]`` int64, each token's position within its
            conversation, as the target sees it alone: 0, 1, ... restarting in each document; the
            padding continues the count of the row's last document. None: ``0..S-1`` in every row
            (one conversation per row).
        document_ids (torch.Tensor, optional): ``[B, S]`` int64, ``0, 1, ...`` for the documents of
            a row in order, -1 on padding. None: 0 on the first ``lengths[b]`` tokens, -1 after.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        batch, seq_len = self.input_ids.shape
        columns = torch.arange(seq_len, device=self.input_ids.device)
        if self.position_ids is None:
            self.position_ids = columns.repeat(batch, 1)
        if self.document_ids is None:
            real = columns < self.lengths.to(columns.device)[:, None]
            self.document_ids = torch.where(real, 0, -1)

    def to(self, device: torch.device | str) -> Batch:
        move = lambda t: t.to(device, non_blocking=True)
        return Batch(
            input_ids=move(self.input_ids),
            loss_mask=move(self.loss_mask),
            lengths=move(self.lengths),
            position_ids=move(self.position_ids),
            document_ids=move(self.document_ids),
        )

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the batch."""
        return int(self.lengths.sum())

    def truncated(self, length: int) -> Batch:
        """The first ``length`` positions of every row (``--vary-seq-len``)."""
        cut = lambda t: t[:, :length].contiguous()
        document_ids = cut(self.document_ids)
        lengths = (document_ids >= 0).sum(1)
        return Batch(cut(self.input_ids), cut(self.loss_mask), lengths, cut(self.position_ids), document_ids)

    def pinned(self) -> Batch:
        """A copy in page-locked host memory, so copies to a GPU run asynchronously."""
        fields = (self.input_ids, self.loss_mask, self.lengths, self.position_ids, self.document_ids)
        return Batch(*(t.pin_memory() for t in fields))


def collate(rows: Sequence[Sequence[Example]], *, seq_len: int, pad_token_id: int) -> Batch:
    """Lay out rows of examples as a right-padded ``[len(rows), seq_len]`` batch.

    The examples of a row follow each other as documents ``0, 1, ...`` with positions restarting
    at 0; padding has loss mask 0 and document id -1 (see :class:`Batch`). One example per row is
    the unpacked layout.

    Raises:
        ValueError: a row's examples hold more than ``seq_len`` tokens together.
    """
    ids = torch.full((len(rows), seq_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), seq_len), dtype=torch.bool)
    positions = torch.empty((len(rows), seq_len), dtype=torch.long)
    documents = torch.full((len(rows), seq_len), -1, dtype=torch.long)
    lengths = torch.empty(len(rows), dtype=torch.long)
    for row, examples in enumerate(rows):
        sizes = [len(example.input_ids) for example in examples]
        n = sum(sizes)
        if n > seq_len:
            raise ValueError(
                f"row {row} holds {len(sizes)} examples of {sizes} tokens, {n} > seq_len={seq_len}; "
                "pack rows with dflash.data.packing.pack_rows (or truncate examples to seq_len)"
            )
        ids[row, :n] = torch.tensor([t for example in examples for t in example.input_ids], dtype=torch.long)
        mask[row, :n] = torch.tensor([m for example in examples for m in example.loss_mask], dtype=torch.bool)
        documents[row, :n] = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.long))
        # Positions restart in each document; the padding continues the last document's count.
        last = sizes[-1] if sizes else 0
        positions[row] = torch.cat([torch.arange(size) for size in sizes[:-1]] + [torch.arange(seq_len - n + last)])
        lengths[row] = n
    return Batch(ids, mask, lengths, positions, documents)


class ShardedSampler:
    """Deterministic, resumable sampler of row batches, sharded across ranks.

    Each epoch draws a permutation of ``range(num_examples)`` from ``seed + epoch`` (identical on
    every rank) and groups it into rows: one example per row, or with ``packer`` (e.g.
    :func:`dflash.data.packing.row_packer`) several examples per row. The rows are trimmed to a multiple
    of ``world_size * batch_size`` and rank ``r`` gets the batches ``r, r + world_size, ...``, so
    ranks never share an example and all ranks run the same number of steps. Each example appears
    at most once per epoch (the trimmed tail, fewer rows than one global batch, waits for the next
    epoch's permutation). The state is ``{"epoch", "position"}`` (position = batches already
    yielded in the epoch); restoring it continues exactly.

    Args:
        num_examples (int): examples to draw from.
        batch_size (int): rows per batch.
        seed (int): seed of the permutations.
        shuffle (bool): False keeps ``0..num_examples-1`` in order (and the packer's row order).
        rank (int), world_size (int): this process's shard.
        packer (Callable, optional): ``packer(order, generator) -> rows``, example indices grouped
            into rows (each index exactly once); ``generator`` is the epoch's RNG, None without
            shuffling. None: one example per row.

    Raises:
        ValueError: bad rank/world_size/batch_size, or fewer rows than one global batch.
    """

    def __init__(
        self,
        num_examples: int,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        packer: Callable[[list[int], torch.Generator | None], list[list[int]]] | None = None,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.num_examples, self.batch_size, self.seed = num_examples, batch_size, seed
        self.shuffle, self.rank, self.world_size, self.packer = shuffle, rank, world_size, packer
        self.epoch, self.position = 0, 0
        self._cached: tuple[int, list[list[int]]] | None = None
        rows = len(self._epoch_rows(0))
        if rows < batch_size * world_size:
            are = f"pack into {rows} rows, which are" if packer is not None else "are"
            raise ValueError(
                f"{num_examples} examples {are} fewer than one global batch "
                f"(batch_size={batch_size} x world_size={world_size}); add data or "
                "lower --batch-size"
            )

    @property
    def batches_per_epoch(self) -> int:
        """Batches per rank in the current epoch (with packing the row count varies a little by epoch)."""
        return len(self._epoch_rows(self.epoch)) // (self.batch_size * self.world_size)

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        # Packing a large corpus takes seconds: keep the current epoch's rows.
        if self._cached is None or self._cached[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch) if self.shuffle else None
            if generator is not None:
                order = torch.randperm(self.num_examples, generator=generator).tolist()
            else:
                order = list(range(self.num_examples))
            rows = self.packer(order, generator) if self.packer is not None else [[i] for i in order]
            self._cached = (epoch, rows)
        return self._cached[1]

    def _epoch_batches(self, epoch: int) -> list[list[list[int]]]:
        rows = self._epoch_rows(epoch)
        b = self.batch_size
        n = len(rows) // (b * self.world_size) * self.world_size
        batches = [rows[i * b : (i + 1) * b] for i in range(n)]
        return batches[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[list[list[int]]]:
        """Yield batches of rows (lists of example indices) forever, epoch after epoch, from the
        current state."""
        while True:
            batches = self._epoch_batches(self.epoch)
            while self.position < len(batches):
                self.position += 1
                yield batches[self.position - 1]
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class BatchLoader:
    """Fixed-shape batches of tokenized examples in sampler order (an infinite iterator).

    ``state_dict()`` is the sampler state after the last batch returned, so a checkpoint
    taken between steps resumes with the next unseen batch.
    """

    def __init__(self, examples: Sequence[Example], sampler: ShardedSampler, *, seq_len: int, pad_token_id: int):
        self.examples, self.sampler = examples, sampler
        self.seq_len, self.pad_token_id = seq_len, pad_token_id
        self._indices = None

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Batch:
        if self._indices is None:
            self._indices = iter(self.sampler)
        rows = [[self.examples[i] for i in row] for row in next(self._indices)]
        return collate(rows, seq_len=self.seq_len, pad_token_id=self.pad_token_id)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
        self._indices = None  # restart the generator from the restored position


def build_loader(
    examples: Sequence[Example],
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    pack: bool,
    pad_token_id: int,
    rank: int = 0,
    world_size: int = 1,
) -> BatchLoader:
    """The training batches of ``examples``: rows of ``seq_len`` tokens (several conversations each with
    ``pack``, :func:`dflash.data.packing.row_packer`), ``batch_size`` rows a batch, in the order drawn from
    ``seed``, this process's shard of ``world_size``. Within a process the step engine deals the batches
    out to the drafter replicas in turn.

    Raises:
        ValueError: fewer rows than one global batch (see :class:`ShardedSampler`).
    """
    sampler = ShardedSampler(
        len(examples),
        batch_size=batch_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        packer=row_packer(examples, seq_len=seq_len) if pack else None,
    )
    return BatchLoader(examples, sampler, seq_len=seq_len, pad_token_id=pad_token_id)
