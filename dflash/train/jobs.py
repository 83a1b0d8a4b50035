"""The order of work: which batch and which anchors each drafter replica trains on, and when.

Both engines draw their micro-batches from one :class:`JobSource` per process, in a fixed job
order: job j is the next batch of the data loader, for drafter replica ``j % W`` (W replicas),
with anchors drawn on the host from one generator in job order. So results do not depend on
which thread ran which job, and one device with ``grad_accum = k * W`` sees exactly the batches
and anchors that W replicas with ``grad_accum = k`` see (``tests`` check the two engines agree).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from dflash.data.batches import Batch, BatchLoader
from dflash.masks import sample_anchors

#: Padded lengths of --vary-seq-len are multiples of this (keeps shapes tensor-core friendly).
SEQ_ALIGN = 8


def seq_len_schedule(seq_len: int, count: int) -> list[int]:
    """``count`` distinct padded lengths from ``seq_len`` down to about ``seq_len / 2``
    (multiples of :data:`SEQ_ALIGN`, the first is ``seq_len``) for ``--vary-seq-len``.

    Raises:
        ValueError: ``seq_len`` too short for ``count`` distinct aligned lengths.
    """
    if count <= 1:
        return [seq_len]
    stride = max(SEQ_ALIGN, (seq_len // 2 // (count - 1)) // SEQ_ALIGN * SEQ_ALIGN)
    lengths = [seq_len - i * stride for i in range(count)]
    if lengths[-1] < 2 * SEQ_ALIGN:
        raise ValueError(
            f"vary_seq_len={count}: --seq-len {seq_len} is too short for {count} lengths "
            f"{SEQ_ALIGN} apart; lower --vary-seq-len or raise --seq-len"
        )
    return lengths


@dataclass
class Job:
    """One micro-batch of one drafter replica.

    Args:
        index (int): position in this process's job order (0-based since the source started).
        step (int): the optimizer step it belongs to (1-based, global).
        drafter (int): replica ``index % W``.
        slot (int): its position in that replica's order (``index // W``).
        batch (Batch): ``[B, L]`` on the host (pinned for CUDA), L = this job's length.
        anchors (Tensor): int64 ``[B, N]``, valid (Tensor): bool ``[B, N]`` (host).
        resume_state (dict): data-loader and anchor-RNG state right after this job was drawn:
            a checkpoint after its step resumes from here.
    """

    index: int
    step: int
    drafter: int
    slot: int
    batch: Batch
    anchors: torch.Tensor
    valid: torch.Tensor
    resume_state: dict


class JobSource:
    """Draws this process's jobs in order under a lock (thread-safe, deterministic).

    Job j is the next batch of ``loader``, truncated to the length of its replica's schedule
    (``--vary-seq-len``: replica d at step k uses ``seq_lens[(k + d) % len(seq_lens)]``, so
    threads meet new shapes at different steps), with anchors drawn from ``generator`` in job
    order. :meth:`take` returns None once the jobs up to ``last_step`` are drawn.
    """

    def __init__(
        self,
        loader: BatchLoader,
        generator: torch.Generator,
        *,
        num_drafters: int,
        grad_accum: int,
        max_anchors: int,
        seq_lens: list[int],
        pin: bool,
    ) -> None:
        self.loader, self.generator = loader, generator
        self.num_drafters, self.grad_accum, self.max_anchors = num_drafters, grad_accum, max_anchors
        self.seq_lens, self.pin = seq_lens, pin
        self._lock = threading.Lock()
        self.restart(first_step=1, last_step=0)

    def restart(self, *, first_step: int, last_step: int) -> None:
        """Draw the jobs of steps ``first_step..last_step`` from the loader's current position."""
        with self._lock:
            self.first_step = first_step
            self.total = max(0, last_step - first_step + 1) * self.num_drafters * self.grad_accum
            self._next = 0

    def resume_state(self) -> dict:
        """Loader and anchor-RNG state as of now (nothing drawn ahead)."""
        return {"data": self.loader.state_dict(), "anchor_rng": self.generator.get_state()}

    def take(self) -> Job | None:
        with self._lock:
            index = self._next
            if index >= self.total:
                return None
            self._next += 1
            drafter, slot = index % self.num_drafters, index // self.num_drafters
            step = self.first_step + slot // self.grad_accum
            batch = next(self.loader)
            length = self.seq_lens[(step + drafter) % len(self.seq_lens)]
            if length < batch.input_ids.shape[1]:
                batch = batch.truncated(length)
            anchors, valid = sample_anchors(
                batch.loss_mask, self.max_anchors, document_ids=batch.document_ids, generator=self.generator
            )
            state = self.resume_state()
        if self.pin:
            batch = batch.pinned()
            anchors, valid = anchors.pin_memory(), valid.pin_memory()
        return Job(index, step, drafter, slot, batch, anchors, valid, state)
