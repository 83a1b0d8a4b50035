"""The threaded engine: target threads -> bounded prefetch buffers -> drafter threads, in one
process per host (``dflash train --target-devices ... --drafter-devices ...``; torchrun across hosts).

One thread per target device, each with its own frozen target replica, and one thread per
drafter device, each with its own :class:`~dflash.train.replica.DrafterReplica`. Data flow::

    JobSource (lock; data loader, anchor RNG)       jobs in a fixed order j = 0, 1, 2, ...
      -> target threads (any free one takes the next job; target forward, copy to the drafter's
         device)
      -> Inbox of drafter j % W (ordered, bounded to --prefetch-depth jobs ahead: backpressure)
      -> drafter thread (forward + backward into its flat gradient buffer)
      -> main thread: optimizer_step (sum over replicas and processes, divide, clip, step all)

Each drafter thread compiles its own copy of the step function, so a thread recompiling never
invalidates another's code; with plain torch that is exactly the race (bug class A) the
project's patches close. An exception in any thread stops all threads and is re-raised in the
main thread as :class:`PipelineError` naming the thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass

import torch

from dflash.compile_watch import raise_recompile_limit
from dflash.distributed import ProcessInfo, gather_objects
from dflash.target_model.model import Target
from dflash.train.drafter_rows import DrafterRows, restore_rows, saved_rows
from dflash.train.engine import StepStats, read_step_stats
from dflash.train.flops import drafter_step_flops
from dflash.train.jobs import Job, JobSource
from dflash.train.loss_settings import LossSettings
from dflash.train.replica import DrafterReplica, load_replica_state, optimizer_step
from dflash.train.step import StatsLayout, TargetBatch, drafter_step, produce_target_states

logger = logging.getLogger(__name__)

_POLL_S = 0.05


class PipelineError(RuntimeError):
    """A pipeline thread failed; the message names the thread, ``__cause__`` is its exception."""


class PipelineStopped(Exception):
    """Raised inside a blocked thread when the pipeline shuts down."""


class Control:
    """The stop flag shared by all threads plus the first failure (thread name, exception)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.failed: tuple[str, BaseException] | None = None
        self._on_stop = []

    def on_stop(self, callback) -> None:
        self._on_stop.append(callback)

    def fail(self, thread: str, exc: BaseException) -> None:
        with self._lock:
            if self.failed is None:
                self.failed = (thread, exc)
        self.shutdown()

    def shutdown(self) -> None:
        self.stop.set()
        for callback in self._on_stop:
            callback()

    def check(self) -> None:
        """Raise :class:`PipelineError` for a failed thread, :class:`PipelineStopped` when stopping."""
        if self.failed is not None:
            name, exc = self.failed
            raise PipelineError(f"pipeline thread {name!r} failed: {type(exc).__name__}: {exc}") from exc
        if self.stop.is_set():
            raise PipelineStopped()


class Inbox:
    """Ordered, bounded buffer between the target threads and one drafter thread.

    Items carry their slot number (the drafter's job order) and may arrive out of order;
    :meth:`get` returns them in order. :meth:`put` of slot s waits while ``s >= next + depth``:
    at most ``depth`` jobs are buffered ahead, and the job the drafter needs next always fits,
    so target threads working on later jobs cannot starve it (no deadlock).
    """

    def __init__(self, depth: int, control: Control) -> None:
        self.depth, self.control = depth, control
        self._items: dict[int, object] = {}
        self._next = 0
        self._cond = threading.Condition()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, slot: int, item) -> None:
        with self._cond:
            while slot >= self._next + self.depth:
                self.control.check()
                self._cond.wait(_POLL_S)
            self._items[slot] = item
            self._cond.notify_all()

    def get(self):
        with self._cond:
            while self._next not in self._items:
                self.control.check()
                self._cond.wait(_POLL_S)
            item = self._items.pop(self._next)
            self._next += 1
            self._cond.notify_all()
            return item


class _Worker(threading.Thread):
    """A pipeline thread with time accounting per phase; any exception stops every thread."""

    PHASES = ("busy_s", "wait_s", "blocked_s")

    def __init__(self, name: str, control: Control) -> None:
        super().__init__(name=name, daemon=True)
        self.control = control
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self._current: tuple[str | None, float] = (None, 0.0)
        self.tokens = 0
        self.row_tokens = 0
        self.draft_tokens = 0
        self.supervised = 0
        self.flops = 0.0

    def _enter(self, phase: str | None) -> None:
        """Switch the thread's time accounting to ``phase`` (a key of ``seconds``; None = idle)."""
        now = time.perf_counter()
        current, since = self._current
        if current is not None:
            self.seconds[current] += now - since
        self._current = (phase, now)

    def counters(self) -> dict[str, float]:
        """Seconds per phase including the running one (so interval deltas are exact), tokens, row
        tokens (padding included; targets only), draft tokens, supervised draft positions, flops."""
        current, since = self._current
        seconds = dict(self.seconds)
        if current is not None:
            seconds[current] += time.perf_counter() - since
        counts = {
            "tokens": self.tokens,
            "row_tokens": self.row_tokens,
            "draft_tokens": self.draft_tokens,
            "supervised": self.supervised,
        }
        return {**seconds, **counts, "flops": self.flops}

    def run(self) -> None:
        try:
            self.loop()
        except (PipelineStopped, PipelineError):  # stopped, or another thread failed first
            pass
        except BaseException as e:
            logger.error("pipeline thread %s failed: %s: %s", self.name, type(e).__name__, e)
            self.control.fail(self.name, e)

    def loop(self) -> None:
        raise NotImplementedError


@dataclass
class Prefetched:
    """A job's target states, anchors and valid mask on its drafter's device."""

    job: Job
    batch: TargetBatch
    anchors: torch.Tensor
    valid: torch.Tensor


class TargetWorker(_Worker):
    """Takes jobs from the :class:`JobSource`, runs its target replica, delivers the states to
    the job's drafter inbox. ``busy`` = target forward + copy; ``wait`` = drawing the job;
    ``blocked`` = waiting for room in a full inbox (the drafters are the bottleneck)."""

    def __init__(self, name: str, target: Target, source: JobSource, inboxes, devices, control, *, last_hidden: bool):
        super().__init__(name, control)
        self.target, self.source, self.inboxes, self.devices = target, source, inboxes, devices
        self.last_hidden = last_hidden

    def loop(self) -> None:
        cuda = self.target.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.target.device)
        while True:
            self.control.check()
            self._enter("wait_s")
            job = self.source.take()
            if job is None:
                self._enter(None)
                return
            self._enter("busy_s")
            device = self.devices[job.drafter]
            states = produce_target_states(self.target, job.batch, last_hidden=self.last_hidden).to(device)
            item = Prefetched(
                job, states, job.anchors.to(device, non_blocking=True), job.valid.to(device, non_blocking=True)
            )
            if cuda:  # the copies are done and the busy time is GPU time, not launch time
                torch.cuda.current_stream(self.target.device).synchronize()
            self.tokens += states.num_tokens
            self.row_tokens += job.batch.input_ids.numel()
            self._enter("blocked_s")
            self.inboxes[job.drafter].put(job.slot, item)


@dataclass
class StepReport:
    """What a drafter thread hands the main thread after its micro-batches of a step."""

    last_job: Job
    tokens: int
    row_tokens: int


class DrafterWorker(_Worker):
    """Runs ``grad_accum`` drafter micro-batches per step command, ``rows.per_forward`` rows per
    forward (the engine's :class:`DrafterRows`, which its state saves); gradients and the step
    statistics go into its replica's flat buffer. A first step that runs out of memory in the
    drafter runs again, with fewer rows per forward, on the micro-batches it took
    (:mod:`dflash.train.drafter_rows`): in the replica's own buffer on its own device, before the
    main thread's optimizer step; the other threads go on, though releasing the failed attempt's
    memory empties every device's allocator cache (:func:`~dflash.train.drafter_rows.release_memory`).
    ``wait`` = waiting on its inbox (the targets are the bottleneck)."""

    def __init__(
        self,
        replica: DrafterReplica,
        inbox: Inbox,
        control: Control,
        settings: LossSettings,
        *,
        grad_accum,
        recompile_limit,
        rows: DrafterRows,
    ):
        super().__init__(replica.name, control)
        self.replica, self.inbox, self.settings = replica, inbox, settings
        self.grad_accum, self.recompile_limit = grad_accum, recompile_limit
        self.rows = rows
        self.layout = StatsLayout(settings.block_size)
        self._commands: list[int] = []
        self._reports: list[StepReport] = []
        self._cond = threading.Condition()

    def command(self, step: int) -> None:
        with self._cond:
            self._commands.append(step)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def report(self) -> StepReport | None:
        with self._cond:
            if not self._reports:
                self._cond.wait(_POLL_S)
            return self._reports.pop(0) if self._reports else None

    def _next_command(self) -> int:
        with self._cond:
            while not self._commands:
                self.control.check()
                self._cond.wait(_POLL_S)
            return self._commands.pop(0)

    def loop(self) -> None:
        r = self.replica
        if r.device.type == "cuda":
            torch.cuda.set_device(r.device)
        raise_recompile_limit(self.recompile_limit)
        while True:
            step = self._next_command()
            kept: list[Prefetched] = []  # the step's micro-batches, while an out-of-memory error retries it
            report = self.rows.run(step, r.flat, functools.partial(self._micro_batches, step, kept))
            # Busy time is GPU time; after this sync the counts below cost no extra wait.
            blocks, pairs, supervised = self._counts(r.flat.stats)
            self._enter(None)
            self.draft_tokens += int(blocks) * self.settings.block_size
            self.supervised += int(supervised)
            self.flops += drafter_step_flops(
                r.model,
                draft_tokens=blocks * self.settings.block_size,
                context_tokens=report.row_tokens,
                visible_pairs=pairs,
            )
            self.tokens += report.tokens
            with self._cond:
                self._reports.append(report)
                self._cond.notify_all()

    def _counts(self, stats: torch.Tensor) -> list[float]:
        """This replica's step so far, before the replicas' sum: valid blocks, attention pairs and
        supervised draft positions, in one device-to-host transfer."""
        values = stats.tolist()
        return [values[StatsLayout.BLOCKS], values[StatsLayout.PAIRS], self.layout.supervised(values)]

    def _micro_batches(self, step: int, kept: list[Prefetched]) -> StepReport:
        """The drafter on the step's ``grad_accum`` micro-batches, those in ``kept`` first, then its
        inbox's (kept too while the step may be retried: :class:`DrafterRows`); gradients and
        statistics into the flat buffer."""
        r = self.replica
        tokens = row_tokens = 0
        for index in range(self.grad_accum):
            if index < len(kept):
                item = kept[index]
            else:
                self._enter("wait_s")
                item = self.inbox.get()
                if self.rows.first_step_pending:
                    kept.append(item)
            self._enter("busy_s")
            with r.watch.watching(step, (self.rows.per_forward, item.batch.input_ids.shape[1])):
                r.flat.stats.add_(
                    drafter_step(
                        r.step_fn,
                        r.model,
                        r.heads,
                        item.batch,
                        item.anchors,
                        item.valid,
                        settings=self.settings,
                        position_weight=r.position_weight,
                        rows=self.rows.per_forward,
                    )
                )
            tokens += item.batch.num_tokens
            row_tokens += item.batch.input_ids.numel()
        return StepReport(item.job, tokens, row_tokens)


def run_drafters(workers: list[DrafterWorker], control: Control, step: int) -> list[StepReport]:
    """Command every drafter thread to run ``step`` and wait for all their reports.

    Raises:
        PipelineError: a thread failed meanwhile.
    """
    for worker in workers:
        worker.command(step)
    reports = []
    for worker in workers:
        report = None
        while report is None:
            control.check()
            report = worker.report()
        reports.append(report)
    return reports


class ThreadedEngine:
    """:class:`dflash.train.engine.StepEngine` over target and drafter threads (module docstring).

    Args:
        targets (list[Target]): one frozen target per target device.
        replicas (list[DrafterReplica]): one per drafter device.
        source (JobSource): with ``num_drafters=len(replicas)``.
        settings (LossSettings)
        process (ProcessInfo): this process's torchrun rank.
        grad_accum (int): micro-batches per replica per optimizer step.
        batch_size (int): rows per micro-batch.
        drafter_rows (int | None): rows per drafter forward (``--drafter-rows``; None: all).
        grad_clip (float): global grad-norm clip (0 = off).
        prefetch_depth (int): jobs buffered ahead per drafter thread.
        last_step (int): the run's last step (target threads draw jobs up to it).
        recompile_limit (int): each drafter thread raises dynamo's recompile limit to this.
    """

    def __init__(
        self,
        targets: list[Target],
        replicas: list[DrafterReplica],
        source: JobSource,
        settings: LossSettings,
        *,
        process: ProcessInfo,
        grad_accum: int,
        batch_size: int,
        drafter_rows: int | None,
        grad_clip: float,
        prefetch_depth: int,
        last_step: int,
        recompile_limit: int,
    ) -> None:
        self.targets, self.replicas, self.source, self.settings = targets, replicas, source, settings
        self.process = process
        self.grad_accum, self.grad_clip, self.prefetch_depth = grad_accum, grad_clip, prefetch_depth
        self.rows = [DrafterRows(batch_size, drafter_rows, r.name) for r in replicas]
        self.last_step, self.recompile_limit = last_step, recompile_limit
        self.layout = StatsLayout(settings.block_size)
        self.control: Control | None = None
        self._resume_state = source.resume_state()

    @property
    def drafter(self) -> torch.nn.Module:
        return self.replicas[0].model

    @property
    def threads(self) -> list[_Worker]:
        return self.target_workers + self.drafter_workers if self.control else []

    def _start(self, first_step: int) -> None:
        self.control = control = Control()
        self.source.restart(first_step=first_step, last_step=self.last_step)
        self.inboxes = [Inbox(self.prefetch_depth, control) for _ in self.replicas]
        devices = [r.device for r in self.replicas]
        self.target_workers = [
            TargetWorker(
                f"target{i} ({t.device})",
                t,
                self.source,
                self.inboxes,
                devices,
                control,
                last_hidden=self.settings.needs_last_hidden,
            )
            for i, t in enumerate(self.targets)
        ]
        self.drafter_workers = [
            DrafterWorker(
                r,
                inbox,
                control,
                self.settings,
                grad_accum=self.grad_accum,
                recompile_limit=self.recompile_limit,
                rows=rows,
            )
            for r, inbox, rows in zip(self.replicas, self.inboxes, self.rows)
        ]
        for waker in [*self.inboxes, *self.drafter_workers]:
            control.on_stop(waker.wake)
        self._step_counters = self._counters()
        self._report_counters, self._report_time = dict(self._step_counters), time.perf_counter()
        for worker in self.threads:
            worker.start()

    def _counters(self) -> dict[str, dict[str, float]]:
        return {w.name: w.counters() for w in self.threads}

    def run(self, step: int, *, lr: float, stop: bool = False) -> StepStats:
        if self.control is None:
            self._start(step)
        start = time.perf_counter()
        reports = run_drafters(self.drafter_workers, self.control, step)
        if stop:
            self.replicas[0].flat.stats[StatsLayout.STOP].fill_(1.0)
        grad_norm = optimizer_step(self.replicas, lr=lr, grad_clip=self.grad_clip)
        host = read_step_stats(self.replicas[0].flat.stats, grad_norm, self.layout)  # the main thread's one sync
        step_s = time.perf_counter() - start
        self._resume_state = max(reports, key=lambda rep: rep.last_job.index).last_job.resume_state
        now, last = self._counters(), self._step_counters
        self._step_counters = now
        delta = lambda workers, key: [now[w.name][key] - last[w.name][key] for w in workers]
        waits = delta(self.drafter_workers, "wait_s")
        return StepStats(
            loss=host["loss"],
            acc=host["acc"],
            grad_norm=host["grad_norm"],
            tokens=sum(rep.tokens for rep in reports),
            row_tokens=sum(rep.row_tokens for rep in reports),
            draft_tokens=sum(delta(self.drafter_workers, "draft_tokens")),
            supervised=sum(delta(self.drafter_workers, "supervised")),
            step_s=step_s,
            drafter_s=sum(delta(self.drafter_workers, "busy_s")),
            target_s=sum(delta(self.target_workers, "busy_s")),
            target_row_tokens=sum(delta(self.target_workers, "row_tokens")),
            data_wait_frac=sum(waits) / len(waits) / max(step_s, 1e-9),
            flops=sum(delta(self.drafter_workers, "flops")),
            stop=host["stop"],
            selector_loss=host["selector_loss"] if hasattr(self.drafter, "candidate_selector") else None,
        )

    def interval_report(self) -> dict[str, dict[str, float]]:
        """Per thread since the last call: busy/wait/blocked shares of wall time, tokens/s, and
        for drafters the inbox depth and MFU inputs (flops)."""
        now_t = time.perf_counter()
        interval = max(now_t - self._report_time, 1e-9)
        now = self._counters()
        stats = {}
        for w in self.threads:
            d = {k: now[w.name][k] - self._report_counters[w.name][k] for k in now[w.name]}
            entry = {key.removesuffix("_s"): d[key] / interval for key in _Worker.PHASES}
            entry["tokens_per_s"] = d["tokens"] / interval
            if isinstance(w, DrafterWorker):
                entry["queue"] = float(len(w.inbox))
                entry["flops_per_busy_s"] = d["flops"] / d["busy_s"] if d["busy_s"] else 0.0
            stats[w.name] = entry
        self._report_counters, self._report_time = now, now_t
        return stats

    def state_dict(self) -> dict:
        # The loader and anchor RNG run ahead (prefetch): save their state as of the last job of
        # the last step. Anchor RNG states differ per process: every rank's is gathered.
        return {
            "optimizer": self.replicas[0].optimizer.state_dict(),
            "data": self._resume_state["data"],
            "anchor_rng": gather_objects(self._resume_state["anchor_rng"]),
            "drafter_rows": gather_objects(saved_rows(self.rows)),
        }

    def load_state_dict(self, state: dict, weights: dict) -> None:
        load_replica_state(self.replicas, weights, state["optimizer"])
        self.source.loader.load_state_dict(state["data"])
        self.source.generator.set_state(state["anchor_rng"][self.process.rank])
        saved = state.get("drafter_rows")  # absent from runs saved before the rows were kept
        restore_rows(self.rows, saved[self.process.rank] if saved else None)
        self._resume_state = self.source.resume_state()

    def compile_summary(self) -> dict[str, dict[str, int]]:
        return {r.name: r.watch.summary() for r in self.replicas if r.watch.enabled}

    def close(self) -> None:
        if self.control is None:
            return
        self.control.shutdown()
        for worker in self.threads:
            worker.join(timeout=600)  # a thread inside a compile finishes it first
        stuck = [w.name for w in self.threads if w.is_alive()]
        if stuck:
            logger.error("pipeline threads still running after shutdown: %s", stuck)
