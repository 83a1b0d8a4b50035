"""Sequence packing: several tokenized conversations per fixed-shape training row.

Chat conversations are mostly far shorter than a training row (``--seq-len``), so one conversation
per right-padded row spends most of the target's and the drafter's compute on padding. Packing puts
whole conversations back to back in a row, each a *document* (:class:`dflash.data.batches.Batch` carries
``document_ids`` and ``position_ids`` restarting at 0 per document), and every consumer keeps the
documents apart as if each ran alone: the target attends causally within a document
(:func:`dflash.masks.document_causal_mask`), anchors are drawn per document with the row's
``--max-anchors`` budget shared fairly, labels stop at the document's end and each draft block sees
only its own document's context (:mod:`dflash.masks`). Rows keep one shape, so nothing recompiles.

Packing (:func:`pack_rows`): windowed best-fit decreasing. The epoch's permutation of conversations
is cut into windows of ``window`` conversations; within a window conversations are placed longest
first, each into the open row with the least room that still fits it (a new row when none does).
The rows of the whole epoch are then shuffled with the epoch's generator. Best-fit decreasing has the
worst-case bound of first-fit decreasing (at most 11/9 of the optimal row count plus 6/9; Johnson
1973, Dosa 2007) and costs O(n log n) per window with a sorted list of free room. The window trades
fill for randomness: rows mix only conversations of one window, and a new permutation each epoch
gives new rows. Speculators' DFlash trainer packs with multipack (first-fit decreasing over a
distributed batch) to the same end.

Conversations longer than ``seq_len`` never reach the packer: ``dflash.data.tokenize.build_examples`` applies
``--overflow`` (truncate or drop) first.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from dflash.data.tokenize import Example

#: Conversations per packing window (the default of :func:`pack_rows`).
DEFAULT_WINDOW = 4096


def pack_rows(
    lengths: Sequence[int],
    order: Sequence[int],
    generator: torch.Generator | None = None,
    *,
    seq_len: int,
    window: int = DEFAULT_WINDOW,
) -> list[list[int]]:
    """Group example indices into rows of at most ``seq_len`` tokens (module docstring).

    Args:
        lengths (Sequence[int]): tokens of each example, indexed by example index.
        order (Sequence[int]): the example indices to pack, in the epoch's order (a permutation).
        generator (torch.Generator, optional): shuffles the rows; None keeps them in window order
            (longest-led rows first within each window).
        seq_len (int): tokens per row.
        window (int): conversations packed together (consecutive slices of ``order``).

    Returns:
        list[list[int]]: rows of example indices; every index of ``order`` is in exactly one row and
        each row's lengths sum to at most ``seq_len``. Deterministic given the inputs and the
        generator state.

    Raises:
        ValueError: ``window < 1``, ``seq_len < 1``, or an example longer than ``seq_len``.
    """
    if window < 1 or seq_len < 1:
        raise ValueError(f"window and seq_len must be >= 1, got window={window}, seq_len={seq_len}")
    rows: list[list[int]] = []
    for begin in range(0, len(order), window):
        rows += _best_fit_decreasing(lengths, order[begin : begin + window], seq_len)
    if generator is not None:
        rows = [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]
    return rows


def _best_fit_decreasing(lengths: Sequence[int], items: Sequence[int], seq_len: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted: bisect finds the best fit
    for item in sorted(items, key=lambda i: -lengths[i]):  # stable: ties keep the epoch's order
        size = lengths[item]
        if size > seq_len:
            raise ValueError(
                f"example {item} has {size} tokens, more than seq_len={seq_len}; apply --overflow "
                "(dflash.data.tokenize.build_examples) before packing"
            )
        best = bisect.bisect_left(free, (size, -1))
        if best == len(free):
            rows.append([item])
            room, row = seq_len - size, len(rows) - 1
        else:
            room, row = free.pop(best)
            rows[row].append(item)
            room -= size
        if room > 0:
            bisect.insort(free, (room, row))
    return rows


def row_packer(
    examples: Sequence[Example], *, seq_len: int, window: int = DEFAULT_WINDOW
) -> Callable[[list[int], torch.Generator | None], list[list[int]]]:
    """The ``packer`` of :class:`dflash.data.batches.ShardedSampler` for these examples: packs each epoch's
    permutation with :func:`pack_rows`.

    Raises:
        ValueError: an example longer than ``seq_len`` (checked here, before any epoch is packed),
            or ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    lengths = [len(example.input_ids) for example in examples]
    too_long = [i for i, n in enumerate(lengths) if n > seq_len]
    if too_long:
        raise ValueError(
            f"{len(too_long)} examples are longer than seq_len={seq_len} (e.g. example {too_long[0]}, "
            f"{lengths[too_long[0]]} tokens); build them with the same --seq-len and --overflow"
        )
    return lambda order, generator: pack_rows(lengths, order, generator, seq_len=seq_len, window=window)
