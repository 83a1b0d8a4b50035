"""The local engine: the target and one drafter replica on one device, run on the calling thread.

A step takes ``grad_accum`` jobs from the :class:`~dflash.train.jobs.JobSource`, runs the
target on each, then the drafter on each (gradients accumulate into the flat buffer), then the
optimizer step; a first step that runs out of memory in the drafter runs the drafter again on the
same target states with fewer rows per forward (:mod:`dflash.train.drafter_rows`). The step's
statistics reach the host in one transfer after the optimizer step; on CUDA the target/drafter
time split comes from CUDA events read after that transfer, so timing adds no synchronisation.
"""

from __future__ import annotations

import functools
import time

import torch

from dflash.compile_watch import raise_recompile_limit
from dflash.target_model.model import Target
from dflash.train.drafter_rows import DrafterRows, restore_rows, saved_rows
from dflash.train.engine import StepStats, read_step_stats
from dflash.train.flops import drafter_step_flops
from dflash.train.jobs import JobSource
from dflash.train.loss_settings import LossSettings
from dflash.train.replica import DrafterReplica, load_replica_state, optimizer_step
from dflash.train.step import StatsLayout, drafter_step, produce_target_states


class _Clock:
    """Marks on the device's timeline: CUDA events, or host time on CPU (work there is synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        """Elapsed time between two marks; on CUDA only after the work up to ``end`` is done."""
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class LocalEngine:
    """:class:`dflash.train.engine.StepEngine` on one device.

    Args:
        target (Target): the frozen target, on the replica's device.
        replica (DrafterReplica)
        source (JobSource): with ``num_drafters=1``.
        settings (LossSettings)
        grad_accum (int): micro-batches per optimizer step.
        batch_size (int): rows per micro-batch.
        drafter_rows (int | None): rows per drafter forward (``--drafter-rows``; None: all).
        grad_clip (float): global grad-norm clip (0 = off).
        last_step (int): the run's last step (jobs are drawn up to it).
        recompile_limit (int): dynamo's recompile limit is raised to this on the first step.
    """

    def __init__(
        self,
        target: Target,
        replica: DrafterReplica,
        source: JobSource,
        settings: LossSettings,
        *,
        grad_accum: int,
        batch_size: int,
        drafter_rows: int | None,
        grad_clip: float,
        last_step: int,
        recompile_limit: int,
    ) -> None:
        self.target, self.replica, self.source, self.settings = target, replica, source, settings
        self.recompile_limit = recompile_limit
        self.grad_accum, self.grad_clip, self.last_step = grad_accum, grad_clip, last_step
        self.layout = StatsLayout(settings.block_size)
        self.clock = _Clock(replica.device)
        self.rows = DrafterRows(batch_size, drafter_rows, replica.name)
        self._started = False
        self._resume_state = source.resume_state()

    @property
    def drafter(self) -> torch.nn.Module:
        return self.replica.model

    def run(self, step: int, *, lr: float, stop: bool = False) -> StepStats:
        if not self._started:
            self.source.restart(first_step=step, last_step=self.last_step)
            raise_recompile_limit(self.recompile_limit)
            self._started = True
        r = self.replica
        start = time.perf_counter()
        jobs = [self.source.take() for _ in range(self.grad_accum)]
        data_s = time.perf_counter() - start
        target_start = self.clock.mark()
        last_hidden = self.settings.needs_last_hidden
        batches = [produce_target_states(self.target, job.batch, last_hidden=last_hidden) for job in jobs]
        drafter_start = self.clock.mark()
        self.rows.run(step, r.flat, functools.partial(self._drafter_micro_batches, step, jobs, batches))
        if stop:
            r.flat.stats[StatsLayout.STOP].fill_(1.0)
        grad_norm = optimizer_step([r], lr=lr, grad_clip=self.grad_clip)
        end = self.clock.mark()
        host = read_step_stats(r.flat.stats, grad_norm, self.layout)  # the step's one host sync
        step_s = time.perf_counter() - start
        self._resume_state = jobs[-1].resume_state
        row_tokens = sum(job.batch.input_ids.numel() for job in jobs)
        target_s, drafter_s = self.clock.seconds(target_start, drafter_start), self.clock.seconds(drafter_start, end)
        flops = drafter_step_flops(
            r.model,
            draft_tokens=host["blocks"] * self.settings.block_size,
            context_tokens=row_tokens,
            visible_pairs=host["pairs"],
        )
        return StepStats(
            loss=host["loss"],
            acc=host["acc"],
            grad_norm=host["grad_norm"],
            tokens=sum(b.num_tokens for b in batches),
            row_tokens=row_tokens,
            draft_tokens=int(host["blocks"]) * self.settings.block_size,
            supervised=int(host["supervised"]),
            step_s=step_s,
            drafter_s=drafter_s,
            target_s=target_s,
            target_row_tokens=row_tokens,
            data_wait_frac=data_s / step_s,
            flops=flops,
            stop=host["stop"],
            selector_loss=host["selector_loss"] if hasattr(r.model, "candidate_selector") else None,
        )

    def _drafter_micro_batches(self, step: int, jobs, batches) -> None:
        for job, batch in zip(jobs, batches, strict=True):
            self._drafter_micro_batch(step, job, batch)

    def _drafter_micro_batch(self, step: int, job, batch) -> None:
        """The drafter's forward + backward on one micro-batch, ``rows.per_forward`` rows at a time: gradients
        and statistics into the flat buffer."""
        r = self.replica
        anchors, valid = job.anchors.to(r.device, non_blocking=True), job.valid.to(r.device, non_blocking=True)
        with r.watch.watching(step, (self.rows.per_forward, batch.input_ids.shape[1])):
            r.flat.stats.add_(
                drafter_step(
                    r.step_fn,
                    r.model,
                    r.heads,
                    batch,
                    anchors,
                    valid,
                    settings=self.settings,
                    position_weight=r.position_weight,
                    rows=self.rows.per_forward,
                )
            )

    def state_dict(self) -> dict:
        return {
            "optimizer": self.replica.optimizer.state_dict(),
            "data": self._resume_state["data"],
            "anchor_rng": [self._resume_state["anchor_rng"]],
            "drafter_rows": [saved_rows([self.rows])],
        }

    def load_state_dict(self, state: dict, weights: dict) -> None:
        load_replica_state([self.replica], weights, state["optimizer"])
        self.source.loader.load_state_dict(state["data"])
        self.source.generator.set_state(state["anchor_rng"][0])
        saved = state.get("drafter_rows")  # absent from runs saved before the rows were kept
        restore_rows([self.rows], saved[0] if saved else None)
        self._resume_state = self.source.resume_state()

    def interval_report(self) -> dict[str, dict[str, float]]:
        return {}  # target and drafter run inline on the calling thread: no threads to report

    def compile_summary(self) -> dict[str, dict[str, int]]:
        return {self.replica.name: self.replica.watch.summary()} if self.replica.watch.enabled else {}

    def close(self) -> None:
        pass
