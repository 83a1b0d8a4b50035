"""Rows per drafter forward (``--drafter-rows``), and the first step retried with fewer when the
drafter runs out of GPU memory (issue 43, "Fits by default").

The drafter's activations grow with rows x anchors, while the target's forward of a micro-batch
is small (at the user's shape, a Qwen3.6-27B target cut to 16 layers and a 5-layer drafter at width
5120 with 512 anchors x block 16 per 2,048-token row, 4 rows ran out of memory in the drafter's step
on an 80 GB H100, issue 43). So the drafter may run a micro-batch's rows in groups
(:func:`dflash.train.step.drafter_step`), its gradients accumulating: the loss, its normaliser and
every statistic of a step are sums over rows (:mod:`dflash.train.loss`), so the step is the one
without groups up to float summation order. The target's forward, the prefetch queues and the
micro-batch stay whole.

Automatic: a replica's first step that runs out of GPU memory in the drafter's forward/backward
(:func:`dflash.run.out_of_memory.out_of_memory_error`), before any optimizer update, is retried on
the same micro-batches with half the rows per forward (the largest divisor of ``--batch-size`` at
most half, down to 1), after the failed attempt's tensors and gradients are let go; one warning
line says so and names the ``--drafter-rows`` that starts there. Later steps are not retried: the
first step sets a run's memory (AdamW's moments are allocated before it,
:mod:`dflash.train.replica`; its compiles run in it), so a later step that runs out meets something
the first did not (another ``--vary-seq-len`` length, fragmentation), which the run's message
should report rather than a retry hide. An out-of-memory error that is not retried ends the run as
:class:`~dflash.run.out_of_memory.DrafterOutOfMemory`, whose rows the message reads.

Kept across ``--resume``: each replica's rows per forward are saved in the engine's state
(:func:`saved_rows`) and a resumed run starts at them (:func:`restore_rows`), so it neither runs out
again nor sums in another order than the run it continues; a ``--drafter-rows`` given on resume
that differs from the saved run's flag wins.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from dflash.run.out_of_memory import DrafterOutOfMemory, out_of_memory_error, rows_text, what_failed

logger = logging.getLogger(__name__)

T = TypeVar("T")


def fewer_rows(batch_size: int, rows: int) -> int:
    """The rows per forward after ``rows`` ran out of memory: the largest divisor of ``batch_size``
    at most ``rows // 2`` (equal groups: one compiled shape).

    Raises:
        ValueError: ``rows`` < 2 (nothing fewer than one row).
    """
    if rows < 2:
        raise ValueError(f"fewer_rows: {rows_text(rows)} per forward has nothing fewer to try")
    return max(n for n in range(1, rows // 2 + 1) if batch_size % n == 0)


def row_counts(batch_size: int, rows: int) -> list[int]:
    """Every rows per forward a replica starting at ``rows`` may run, ``rows`` first, down to 1."""
    counts = [rows]
    while counts[-1] > 1:
        counts.append(fewer_rows(batch_size, counts[-1]))
    return counts


class DrafterRows:
    """One replica's rows per drafter forward, and the retry of its first step (module docstring).

    Args:
        batch_size (int): rows of a micro-batch (``--batch-size``).
        rows (int | None): ``--drafter-rows`` (None or 0: the whole micro-batch); divides ``batch_size``.
        name (str): the replica's name in the warning (``drafter0 (cuda:1)``).
    """

    def __init__(self, batch_size: int, rows: int | None, name: str) -> None:
        self.batch_size, self.name = batch_size, name
        self.per_forward = rows or batch_size
        self.first_step_pending = True  # until the replica's first step is done (:meth:`run`): it may retry

    def run(self, step: int, flat, micro_batches: Callable[[], T]) -> T:
        """``micro_batches()``, the drafter's micro-batches of ``step`` at :attr:`per_forward` rows per forward
        into the replica's zeroed gradients ``flat`` (:class:`dflash.distributed.FlatGradients`), and
        its result; during the replica's first step, again with fewer rows after each out-of-memory
        error (module docstring), from gradients zeroed again and memory released.

        Raises:
            DrafterOutOfMemory: from an out-of-memory error that is not retried.
            Exception: any other error of ``micro_batches``, as it was raised.
        """
        while True:
            flat.zero_()
            try:
                result = micro_batches()
                break
            except Exception as error:
                self._retry_or_raise(error, step)
            release_memory(flat.buffer.device)  # the failed attempt's tensors went with its error
        self.first_step_pending = False
        return result

    def _retry_or_raise(self, error: Exception, step: int) -> None:
        """Return when the step is to be run again, with :attr:`per_forward` lowered and the warning logged;
        raise otherwise."""
        oom = out_of_memory_error(error)
        if oom is None:
            raise error
        fewer = fewer_rows(self.batch_size, self.per_forward) if self.per_forward > 1 else None
        if not self.first_step_pending or fewer is None:
            raise DrafterOutOfMemory(self.per_forward, fewer) from error
        rows, self.per_forward = self.per_forward, fewer
        logger.warning(
            "%s step %d: out of GPU memory in the drafter's forward/backward at %s per forward (%s); retrying the "
            "step on the same micro-batches at %s per forward, the same training (--drafter-rows %d starts there)",
            self.name,
            step,
            rows_text(rows),
            what_failed(oom),
            rows_text(self.per_forward),
            self.per_forward,
        )


def saved_rows(rows: list[DrafterRows]) -> list[int]:
    """This process's replicas' rows per forward, for the engine's state (``drafter_rows``)."""
    return [r.per_forward for r in rows]


def restore_rows(rows: list[DrafterRows], saved: list[int] | None) -> None:
    """Start each replica at the rows per forward of the run it resumes, ``saved`` (:func:`saved_rows`
    of this process; None: a run saved before they were kept). Another replica count (an elastic
    resume, :mod:`dflash.run.resume`) starts every replica at the fewest saved."""
    if not saved:
        return
    per_replica = saved if len(saved) == len(rows) else [min(saved)] * len(rows)
    for replica, count in zip(rows, per_replica, strict=True):
        if count != replica.per_forward:
            logger.info(
                "%s: resuming at %s per drafter forward, as the saved run's first step settled on",
                replica.name,
                rows_text(count),
            )
        replica.per_forward = count


def release_memory(device: torch.device) -> None:
    """Free what a failed attempt held once its error is gone: reference cycles (autograd nodes,
    frames) collected and, on CUDA, the cached blocks returned, so the next attempt's allocations are
    not split around the failed one's free blocks; the device's peak restarts from what is held
    now, so the run's peak memory (the steady-state line) is that of the rows it trains with.
    ``torch.cuda.empty_cache`` returns the unused cached blocks of every device, not only this
    one's: other drafter threads' next allocations come from the driver again (slower, once)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
