"""Threaded multi-device DFlash training in one process per host: target threads -> bounded
prefetch buffers -> drafter threads (``dflash train --target-devices ... --drafter-devices ...``).

Layout (``dflash.devices``): one thread per target device, each with its own frozen target
replica, and one thread per drafter device, each with its own drafter replica, optimizer and
compiled step. Data flow of one process::

    JobSource (lock; data loader, anchor RNG)      jobs in a fixed order j = 0, 1, 2, ...
      -> target threads (any free one takes the next job; produce_target_states, copy to the
         drafter's device)
      -> Inbox of drafter j % W (ordered, bounded to --prefetch-depth jobs ahead: backpressure)
      -> drafter thread (drafter_step: forward + backward into flat gradient buffers)
      -> main thread: sum gradients + step statistics over replicas and processes
         (``dflash.distributed``), divide by the step's total position weight, clip, then every
         replica steps its own optimizer on the identical summed gradients.

Why this shape: every replica takes the same step from the same summed gradients, so replicas
stay bit-identical without a weight broadcast (checked by ``tests/test_pipeline.py``); anchors are
sampled on the host in job order from one generator, so results do not depend on which target
thread ran which job, and on CPU a W-thread run reproduces the single-device trainer on the
same global batch (``grad_accum`` x W micro-batches). Data is sharded across processes by the
sampler (rank/world_size) and across drafter threads by job number. The loss of a step is
normalised by the position weights summed over all threads and processes
(``dflash_reference.md``, Training).

Compiles: each drafter thread compiles its own copy of the step function (its own code object,
so its own dynamo cache and recompile limit) through :class:`CountingBackend`, which counts, per
thread, compiles and runs of compiled graphs. A step whose compiled graph did not run fell back
to eager: that is logged as a warning with dynamo's reason (from its log records of that thread)
and counted, never hidden. ``--vary-seq-len N`` truncates batches to N staggered lengths so
threads recompile while others run compiled steps: the race window of
``../shared/torch_races.md`` class A that the project's torch patches close.

Errors: an exception in any thread stops all threads and is re-raised in the main thread as
:class:`PipelineError` naming the thread.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash import checkpoint
from dflash.config import TrainConfig
from dflash.data import Batch, BatchLoader, ShardedSampler, read_conversations
from dflash.devices import DeviceLayout, Slot, parse_layout
from dflash.distributed import (
    FlatGradients,
    ProcessInfo,
    barrier,
    destroy_process_group,
    gather_objects,
    init_process_group,
    sum_replicas,
)
from dflash.loss import acceptance_length_estimate, per_position_accuracy, position_weights
from dflash.masks import sample_anchors
from dflash.target import Target, TargetStates, load_target
from dflash.trainer import (
    REGENERATED_NAME,
    TargetBatch,
    Trainer,
    _check_resume_config,
    drafter_forward_loss,
    drafter_step,
    drafter_step_flops,
    produce_target_states,
)

logger = logging.getLogger(__name__)

#: Padded lengths of --vary-seq-len are multiples of this (keeps shapes tensor-core friendly).
SEQ_ALIGN = 8
_POLL_S = 0.05


class PipelineError(RuntimeError):
    """A pipeline thread failed; the message names the thread, ``__cause__`` is its exception."""


class PipelineStopped(Exception):
    """Raised inside a blocked thread when the pipeline shuts down."""


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


# ---------------------------------------------------------------------------------------
# Shutdown and error propagation
# ---------------------------------------------------------------------------------------


class _Control:
    """The stop flag shared by all threads plus the first failure (thread name, exception)."""

    def __init__(self):
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


class _Worker(threading.Thread):
    """A pipeline thread: any exception is recorded and stops every thread."""

    def __init__(self, name: str, control: _Control):
        super().__init__(name=name, daemon=True)
        self.control = control
        self.seconds = {"busy_s": 0.0, "wait_s": 0.0, "blocked_s": 0.0}
        self._current: tuple[str | None, float] = (None, 0.0)
        self.tokens = self.jobs = 0

    def _enter(self, phase: str | None) -> None:
        """Switch the thread's time accounting to ``phase`` (a key of ``seconds``; None = idle)."""
        now = time.perf_counter()
        current, since = self._current
        if current is not None:
            self.seconds[current] += now - since
        self._current = (phase, now)

    def counters(self) -> dict[str, float]:
        """Seconds per phase including the running one (so interval deltas are exact), tokens, jobs."""
        current, since = self._current
        seconds = dict(self.seconds)
        if current is not None:
            seconds[current] += time.perf_counter() - since
        return {**seconds, "tokens": self.tokens, "jobs": self.jobs}

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


# ---------------------------------------------------------------------------------------
# Jobs: what a target thread computes for a drafter thread
# ---------------------------------------------------------------------------------------


@dataclass
class Job:
    """One micro-batch of one drafter thread.

    Args:
        index (int): position in this process's job order (0-based since the pipeline started).
        step (int): the optimizer step it belongs to (1-based, global).
        drafter (int): drafter thread ``index % W``.
        slot (int): its position in that drafter's order (``index // W``).
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

    Job j is the next batch of ``loader``, truncated to the length of its drafter's schedule
    (``--vary-seq-len``: drafter d at step k uses ``seq_lens[(k + d) % len(seq_lens)]``, so
    threads meet new shapes at different steps), with anchors drawn from ``generator`` in job
    order. :meth:`take` returns None once the jobs up to ``last_step`` are drawn.
    """

    def __init__(
        self,
        loader: BatchLoader,
        *,
        num_drafters: int,
        grad_accum: int,
        first_step: int,
        last_step: int,
        max_anchors: int,
        generator: torch.Generator,
        seq_lens: list[int],
        pin: bool,
    ):
        self.loader, self.num_drafters, self.grad_accum = loader, num_drafters, grad_accum
        self.first_step, self.max_anchors, self.generator = first_step, max_anchors, generator
        self.seq_lens, self.pin = seq_lens, pin
        self.total = max(0, last_step - first_step + 1) * num_drafters * grad_accum
        self._next = 0
        self._lock = threading.Lock()

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
                batch = Batch(
                    batch.input_ids[:, :length].contiguous(),
                    batch.loss_mask[:, :length].contiguous(),
                    batch.lengths.clamp(max=length),
                )
            anchors, valid = sample_anchors(batch.loss_mask, self.max_anchors, generator=self.generator)
            state = {"data": self.loader.state_dict(), "anchor_rng": self.generator.get_state()}
        if self.pin:
            batch = Batch(batch.input_ids.pin_memory(), batch.loss_mask.pin_memory(), batch.lengths)
            anchors, valid = anchors.pin_memory(), valid.pin_memory()
        return Job(index, step, drafter, slot, batch, anchors, valid, state)


@dataclass
class Prefetched:
    """A job's target states on its drafter's device, ready for :func:`drafter_step`."""

    job: Job
    batch: TargetBatch
    anchors: torch.Tensor
    valid: torch.Tensor


class Inbox:
    """Ordered, bounded buffer between the target threads and one drafter thread.

    Items carry their slot number (the drafter's job order) and may arrive out of order;
    :meth:`get` returns them in order. :meth:`put` of slot s waits while ``s >= next + depth``:
    at most ``depth`` jobs are buffered ahead, and the job the drafter needs next always fits,
    so target threads working on later jobs cannot starve it (no deadlock).
    """

    def __init__(self, depth: int, control: _Control):
        self.depth, self.control = depth, control
        self._items: dict[int, Prefetched] = {}
        self._next = 0
        self._cond = threading.Condition()
        self.max_depth = 0

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, slot: int, item: Prefetched) -> None:
        with self._cond:
            while slot >= self._next + self.depth:
                self.control.check()
                self._cond.wait(_POLL_S)
            self._items[slot] = item
            self.max_depth = max(self.max_depth, len(self._items))
            self._cond.notify_all()

    def get(self) -> Prefetched:
        with self._cond:
            while self._next not in self._items:
                self.control.check()
                self._cond.wait(_POLL_S)
            item = self._items.pop(self._next)
            self._next += 1
            self._cond.notify_all()
            return item


# ---------------------------------------------------------------------------------------
# Per-thread compile accounting
# ---------------------------------------------------------------------------------------

_compile_tls = threading.local()


def thread_compile_counts() -> tuple[int, int]:
    """``(compiles, compiled-graph runs)`` of :class:`CountingBackend` graphs in this thread."""
    return getattr(_compile_tls, "compiles", 0), getattr(_compile_tls, "graph_runs", 0)


class CountingBackend:
    """A dynamo backend wrapping another (default inductor) that counts, per thread, how often
    it compiled and how often its compiled graphs ran, so a call that ran eagerly shows as a
    call with no graph run."""

    def __init__(self, backend: str = "inductor"):
        from torch._dynamo.backends.registry import lookup_backend

        self.name = backend
        self.inner = lookup_backend(backend)

    def __call__(self, gm, example_inputs):
        _compile_tls.compiles = getattr(_compile_tls, "compiles", 0) + 1
        compiled = self.inner(gm, example_inputs)

        def run(*args):
            _compile_tls.graph_runs = getattr(_compile_tls, "graph_runs", 0) + 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # dynamo passes boxed args through
        return run


class DynamoWarnings(logging.Handler):
    """Keeps the last ``torch._dynamo`` warning per thread (e.g. the recompile-limit message
    that precedes an eager fallback), to report with that thread's fallback."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.last: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.last[record.threadName] = record.getMessage().strip().splitlines()[0][:300]

    def __enter__(self) -> DynamoWarnings:
        logging.getLogger("torch._dynamo").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("torch._dynamo").removeHandler(self)


def compiled_step_fn(index: int, backend: str = "inductor"):
    """Thread ``index``'s compiled :func:`dflash.trainer.drafter_forward_loss`: a copy with its
    own code object (dynamo caches per code object, so each thread has its own cache and
    recompile limit) compiled with ``dynamic=False`` through :class:`CountingBackend`."""
    from dflash.compile_watch import fresh_function

    return torch.compile(fresh_function(drafter_forward_loss, index), backend=CountingBackend(backend), dynamic=False)


# Below this share of wall time spent waiting, neither side is said to hold the other up.
BOTTLENECK_WAIT_SHARE = 0.05


def _bottleneck(side: dict[str, float]) -> str:
    """Which side holds the pipeline up, from the mean wait shares (0-1) of :meth:`_side_means`."""
    if max(side["drafter_wait"], side["target_blocked"]) < BOTTLENECK_WAIT_SHARE:
        return f"none (both sides wait under {BOTTLENECK_WAIT_SHARE:.0%} of the time)"
    if side["drafter_wait"] > side["target_blocked"]:
        return "target side (drafters wait for data)"
    return "drafter side (targets wait for room in the prefetch buffers)"


def _warn_if_unpatched(compiled: bool, drafter_threads: int) -> None:
    """Compiling from several threads of one process is what plain torch gets wrong (torch_races.md)."""
    from dflash.patching.importhook import active_finder

    if compiled and drafter_threads > 1 and active_finder() is None:
        logger.warning(
            "the torch thread-safety patches are not active (DFLASH_PATCHES=0, or torch was imported "
            "before the hook): %d drafter threads compiling in this process can crash or fall back to "
            "eager; `dflash patches status` says why",
            drafter_threads,
        )


def raise_recompile_limit(limit: int) -> None:
    """Set dynamo's recompile limit to at least ``limit`` *in the calling thread*: on torch 2.12+
    a plain assignment on the main thread is not seen by worker threads (torch_races.md class F)
    unless the project's patches are active, so every drafter thread sets it itself."""
    import torch._dynamo.config as dynamo_config

    if getattr(dynamo_config, _recompile_limit_name()) < limit:
        _set_recompile_limit(limit)


def _recompile_limit_name() -> str:
    import torch._dynamo.config as dynamo_config

    return "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # torch < 2.6


def _set_recompile_limit(limit: int) -> None:
    import torch._dynamo.config as dynamo_config

    setattr(dynamo_config, _recompile_limit_name(), limit)


# ---------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------


@dataclass
class Heads:
    """The target's frozen embedding and LM head on a drafter's device (what
    :func:`dflash.trainer.drafter_step` reads from its ``target`` argument)."""

    embed_tokens: torch.nn.Module
    lm_head: torch.nn.Module


@dataclass
class DrafterReplica:
    """One drafter thread's model, frozen heads, optimizer, schedule and gradient buffer."""

    slot: Slot
    model: torch.nn.Module
    heads: Heads
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    flat: FlatGradients
    position_weight: torch.Tensor
    step_fn: object


def _to_device(batch: TargetBatch, device: torch.device, *, keep_last_hidden: bool) -> TargetBatch:
    move = lambda t: t.to(device, non_blocking=True)
    states = TargetStates(move(batch.states.context), move(batch.states.last_hidden) if keep_last_hidden else None)
    return TargetBatch(move(batch.input_ids), move(batch.loss_mask), states, batch.num_tokens)


class TargetWorker(_Worker):
    """Takes jobs from the :class:`JobSource`, runs its target replica, delivers the states to
    the job's drafter inbox. ``busy`` = target forward + copy; ``wait`` = drawing the job;
    ``blocked`` = waiting for room in a full inbox (the drafters are the bottleneck)."""

    def __init__(
        self,
        slot: Slot,
        target: Target,
        source: JobSource,
        inboxes: list[Inbox],
        drafter_devices: list[torch.device],
        control: _Control,
        *,
        keep_last_hidden: bool,
    ):
        super().__init__(f"target {slot.name}", control)
        self.slot, self.target, self.source, self.inboxes = slot, target, source, inboxes
        self.drafter_devices, self.keep_last_hidden = drafter_devices, keep_last_hidden

    def loop(self) -> None:
        cuda = self.slot.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.slot.device)
        while True:
            self.control.check()
            self._enter("wait_s")
            job = self.source.take()
            if job is None:
                self._enter(None)
                return
            self._enter("busy_s")
            device = self.drafter_devices[job.drafter]
            states = _to_device(
                produce_target_states(self.target, job.batch), device, keep_last_hidden=self.keep_last_hidden
            )
            item = Prefetched(
                job, states, job.anchors.to(device, non_blocking=True), job.valid.to(device, non_blocking=True)
            )
            if cuda:  # the copies are done and the busy time is GPU time, not launch time
                torch.cuda.current_stream(self.slot.device).synchronize()
            self.tokens += states.num_tokens
            self.jobs += 1
            self._enter("blocked_s")
            self.inboxes[job.drafter].put(job.slot, item)


@dataclass
class StepReport:
    """What a drafter thread hands the main thread after its micro-batches of a step."""

    last_job: Job
    tokens: int
    flops: float


class DrafterWorker(_Worker):
    """Runs ``grad_accum`` drafter micro-batches per step command; writes gradients into its
    flat buffer and the step statistics into ``flat.stats`` = ``[loss_sum, weight_sum,
    correct[Bs], total[Bs]]``. ``wait`` = waiting on its inbox (the targets are the bottleneck)."""

    def __init__(
        self,
        replica: DrafterReplica,
        inbox: Inbox,
        control: _Control,
        *,
        grad_accum: int,
        compiled: bool,
        recompile_limit: int,
        warnings: DynamoWarnings,
        loss_kwargs: dict,
        max_anchors: int,
    ):
        super().__init__(f"drafter {replica.slot.name}", control)
        self.replica, self.inbox, self.grad_accum, self.compiled = replica, inbox, grad_accum, compiled
        self.recompile_limit, self.warnings, self.loss_kwargs = recompile_limit, warnings, loss_kwargs
        self.max_anchors = max_anchors
        self.commands: list[int] = []
        self._cond = threading.Condition()
        self.reports: list[StepReport] = []
        self.flops = 0.0
        self.compiles = self.unexpected_recompiles = self.eager_fallbacks = 0
        self.compiled_lengths: set[int] = set()

    def counters(self) -> dict[str, float]:
        return {**super().counters(), "flops": self.flops}

    def command(self, step: int) -> None:
        with self._cond:
            self.commands.append(step)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def report(self, timeout: float = _POLL_S) -> StepReport | None:
        with self._cond:
            if not self.reports:
                self._cond.wait(timeout)
            return self.reports.pop(0) if self.reports else None

    def _next_command(self) -> int:
        with self._cond:
            while not self.commands:
                self.control.check()
                self._cond.wait(_POLL_S)
            return self.commands.pop(0)

    def loop(self) -> None:
        r = self.replica
        if r.slot.device.type == "cuda":
            torch.cuda.set_device(r.slot.device)
        raise_recompile_limit(self.recompile_limit)
        while True:
            step = self._next_command()
            r.flat.zero_()
            loss_sum = weight_sum = 0.0
            correct = total = blocks = pairs = 0
            tokens = context_tokens = 0
            for _ in range(self.grad_accum):
                self._enter("wait_s")
                item = self.inbox.get()
                self._enter("busy_s")
                before = thread_compile_counts()
                out = drafter_step(
                    r.step_fn,
                    r.model,
                    r.heads,
                    item.batch,
                    max_anchors=self.max_anchors,
                    generator=None,
                    position_weight=r.position_weight,
                    autocast=r.slot.device.type == "cuda",
                    anchors=(item.anchors, item.valid),
                    **self.loss_kwargs,
                )
                self._check_compiled(step, item.batch.input_ids.shape[1], before)
                loss_sum, weight_sum = loss_sum + out.loss.loss_sum, weight_sum + out.loss.weight_sum
                correct, total = correct + out.loss.correct, total + out.loss.total
                blocks, pairs = blocks + out.valid_blocks, pairs + out.attention_pairs  # no host sync yet
                context_tokens += item.batch.input_ids.numel()
                tokens += item.batch.num_tokens
            r.flat.stats.copy_(torch.cat([torch.stack([loss_sum, weight_sum]).float(), correct.float(), total.float()]))
            if r.slot.device.type == "cuda":
                torch.cuda.synchronize(r.slot.device)  # busy time is GPU time
            self._enter(None)
            # FLOPs are linear in the three counts, so the step's sums give the step's FLOPs.
            flops = drafter_step_flops(
                r.model,
                draft_tokens=float(blocks) * r.model.config.block_size,
                context_tokens=context_tokens,
                visible_pairs=float(pairs),
            )
            self.tokens += tokens
            self.flops += flops
            self.jobs += self.grad_accum
            with self._cond:
                self.reports.append(StepReport(item.job, tokens, flops))
                self._cond.notify_all()

    def _check_compiled(self, step: int, seq_len: int, before: tuple[int, int]) -> None:
        """Count this thread's compiles and eager fallbacks of the step just run; log each."""
        if not self.compiled:
            return
        compiles, runs = (now - then for now, then in zip(thread_compile_counts(), before))
        self.compiles += compiles
        if compiles and seq_len in self.compiled_lengths:
            self.unexpected_recompiles += compiles
            logger.warning(
                "%s step %d: RECOMPILED the drafter step for seq len %d, which it had compiled "
                "before (guard failure; last dynamo warning: %s)",
                self.name,
                step,
                seq_len,
                self.warnings.last.get(self.name, "none"),
            )
        elif compiles:
            logger.info(
                "%s step %d: compiled the drafter step for seq len %d (%d graph(s))", self.name, step, seq_len, compiles
            )
        self.compiled_lengths.add(seq_len)
        if not runs:
            self.eager_fallbacks += 1
            logger.warning(
                "%s step %d: the compiled drafter step ran EAGERLY (no compiled graph ran); "
                "dynamo's last warning in this thread: %s",
                self.name,
                step,
                self.warnings.last.get(self.name, "none"),
            )


def run_step(workers: list[DrafterWorker], control: _Control, step: int) -> list[StepReport]:
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


def step_replicas(replicas: list[DrafterReplica], grad_clip: float) -> torch.Tensor:
    """Sum gradients and step statistics over all replicas and processes, divide the gradients
    by the step's total position weight, clip (0 = off), and step every replica's optimizer and
    schedule on the identical result. Returns the grad norm before clipping (0-d tensor, zero
    when clipping is off)."""
    sum_replicas([r.flat.buffer for r in replicas])
    grad_norm = torch.zeros(())
    for r in replicas:
        r.flat.check_views()
        torch._foreach_div_(r.flat.grads, r.flat.stats[1].clamp(min=1e-8))
        if grad_clip:
            grad_norm = torch.nn.utils.clip_grad_norm_(r.flat.params, grad_clip)
        r.optimizer.step()
        r.scheduler.step()
    return grad_norm


# ---------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------


class PipelineTrainer(Trainer):
    """:class:`dflash.trainer.Trainer` on a threaded device layout (module docstring).

    The single-device trainer's constructor builds target replica 0 (on the first target
    device), tokenizer, data and the initial drafter; this class adds the other target
    replicas, one drafter replica per drafter device (copies of the same initial weights),
    the job source and the threads, and joins the ``torchrun`` process group.

    Raises:
        ValueError (DeviceSpecError, CheckpointError, ...): bad flags or inputs, named.
        PipelineError: a pipeline thread failed (names the thread; ``__cause__`` is its error).
    """

    def __init__(self, config: TrainConfig):
        self.process = ProcessInfo.from_env()
        self.layout: DeviceLayout = parse_layout(config.target_devices, config.drafter_devices).shifted(
            self.process.local_rank
        )
        init_process_group(self.process, self.layout.drafters[0].device)
        self._replicas_ready = False
        first = self.layout.targets[0].device
        super().__init__(
            dataclasses.replace(config, device=str(first), progress=config.progress and self.process.is_main)
        )
        self.config = config
        self.seq_lens = seq_len_schedule(config.seq_len, config.vary_seq_len)
        target_dir = Path(config.target) if config.target else None
        self.targets = [self.target] + [
            self._load_target_replica(target_dir, s.device) for s in self.layout.targets[1:]
        ]
        self.replicas = [self._make_replica(i, slot) for i, slot in enumerate(self.layout.drafters)]
        self.drafter, self.optimizer, self.scheduler = (
            self.replicas[0].model,
            self.replicas[0].optimizer,
            self.replicas[0].scheduler,
        )
        # Anchors are drawn on the host in job order (one stream per process; rank 0's equals the
        # single-device trainer's CPU stream).
        self.anchor_generator = torch.Generator().manual_seed(config.seed + self.process.rank)
        self._resume_state = {"data": self.loader.state_dict(), "anchor_rng": self.anchor_generator.get_state()}
        self.workers: dict[str, dict[str, float]] = {}
        self._replicas_ready = True
        if config.resume:
            self.load_checkpoint()
        _warn_if_unpatched(self.compiled, len(self.layout.drafters))
        logger.info(
            "threaded layout (process %d/%d): target threads %s, drafter threads %s, prefetch depth %d%s",
            self.process.rank,
            self.process.world_size,
            [s.name for s in self.layout.targets],
            [s.name for s in self.layout.drafters],
            config.prefetch_depth,
            f", seq lens {self.seq_lens}" if len(self.seq_lens) > 1 else "",
        )

    # ---- construction -------------------------------------------------------------------------

    def _load_target_replica(self, target_dir: Path | None, device: torch.device) -> Target:
        from dflash.assets import default_target_dir

        return load_target(target_dir or default_target_dir(), layer_ids=self.target.layer_ids, device=device)

    def _make_replica(self, index: int, slot: Slot) -> DrafterReplica:
        model = self.drafter if index == 0 else copy.deepcopy(self.drafter)
        model = model.to(slot.device)
        source = next((t for t in self.targets if t.device == slot.device), self.target)
        heads = (
            Heads(source.embed_tokens, source.lm_head)
            if source.device == slot.device
            else Heads(
                copy.deepcopy(source.embed_tokens).to(slot.device), copy.deepcopy(source.lm_head).to(slot.device)
            )
        )
        flat = FlatGradients(model, extra=2 + 2 * self.config.block_size)
        # The base trainer's optimizer settings, minus internal defaults its __init__ does not take.
        accepted = inspect.signature(type(self.optimizer)).parameters
        optimizer = type(self.optimizer)(
            model.parameters(), **{k: v for k, v in self.optimizer.defaults.items() if k in accepted}
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.scheduler.lr_lambdas[0])
        step_fn = compiled_step_fn(index) if self.compiled else drafter_forward_loss
        return DrafterReplica(
            slot,
            model,
            heads,
            optimizer,
            scheduler,
            flat,
            position_weights(self.config.block_size, self.config.gamma, device=slot.device),
            step_fn,
        )

    def _build_loader(self, data_path: Path, *, regenerate: bool) -> BatchLoader:
        loader = super()._build_loader(data_path, regenerate=regenerate)
        # Shard by process; within a process jobs go round-robin to the drafter threads.
        loader.sampler = ShardedSampler(
            len(loader.examples),
            batch_size=self.config.batch_size,
            seed=self.config.seed,
            rank=self.process.rank,
            world_size=self.process.world_size,
        )
        return loader

    def _regenerated(self, conversations):
        # Rank 0 regenerates (and writes the cache in --out); the others read what it wrote.
        if self.process.is_main:
            conversations = super()._regenerated(conversations)
        barrier()
        return conversations if self.process.is_main else read_conversations(self.out / REGENERATED_NAME)

    def _total_steps(self) -> int:
        if self.config.steps is not None:
            return self.config.steps
        per_epoch = self.loader.sampler.batches_per_epoch / (self.config.grad_accum * len(self.layout.drafters))
        return max(1, math.ceil(self.config.epochs * per_epoch))

    # ---- the loop -----------------------------------------------------------------------------

    # ---- the loop (Trainer.train) runs with these hooks ------------------------------------------

    @property
    def is_main(self) -> bool:
        return self.process.is_main

    @contextlib.contextmanager
    def _running(self):
        """Threads run for the loop; a failed thread stops all of them and raises ``PipelineError``."""
        self._start_threads()
        try:
            with self._warnings:
                yield
        finally:
            self._stop_threads()

    def _report(self, bar, metrics: dict[str, float]) -> None:
        if not self._log_due():
            return
        stats = self._interval_stats()
        bar.set_postfix(self._postfix(metrics, stats))
        if self.is_main:
            self._log(metrics)
            self._log_threads(stats)

    def _start_threads(self) -> None:
        cfg = self.config
        self._control = control = _Control()
        self._warnings = DynamoWarnings()
        self.inboxes = [Inbox(cfg.prefetch_depth, control) for _ in self.replicas]
        source = JobSource(
            self.loader,
            num_drafters=len(self.replicas),
            grad_accum=cfg.grad_accum,
            first_step=self.step + 1,
            last_step=self.total_steps,
            max_anchors=cfg.max_anchors,
            generator=self.anchor_generator,
            seq_lens=self.seq_lens,
            pin=self.layout.device_type == "cuda",
        )
        loss_kwargs = dict(
            mask_token_id=self.drafter.config.mask_token_id,
            soft_label_weight=cfg.soft_label_weight,
            position_weighting="dpace" if cfg.dpace else "decay",
        )
        devices = [r.slot.device for r in self.replicas]
        self.target_workers = [
            TargetWorker(s, t, source, self.inboxes, devices, control, keep_last_hidden=cfg.soft_label_weight > 0)
            for s, t in zip(self.layout.targets, self.targets)
        ]
        self.drafter_workers = [
            DrafterWorker(
                r,
                inbox,
                control,
                grad_accum=cfg.grad_accum,
                compiled=self.compiled,
                recompile_limit=len(self.seq_lens) + 8,
                warnings=self._warnings,
                loss_kwargs=loss_kwargs,
                max_anchors=cfg.max_anchors,
            )
            for r, inbox in zip(self.replicas, self.inboxes)
        ]
        for inbox in self.inboxes:
            control.on_stop(inbox.wake)
        for worker in self.drafter_workers:
            control.on_stop(worker.wake)
        self._last_counters = {w.name: w.counters() for w in self._threads}
        self._step_counters = dict(self._last_counters)
        self._last_time = self._step_time = time.perf_counter()
        for worker in self._threads:
            worker.start()

    @property
    def _threads(self) -> list[_Worker]:
        return self.target_workers + self.drafter_workers

    def _stop_threads(self) -> None:
        self._control.shutdown()
        for worker in self._threads:
            worker.join(timeout=600)  # a thread inside a compile finishes it first
        stuck = [w.name for w in self._threads if w.is_alive()]
        if stuck:
            logger.error("pipeline threads still running after shutdown: %s", stuck)

    def train_step(self) -> dict[str, float]:
        """One optimizer step: every drafter thread runs ``grad_accum`` micro-batches, then
        gradients and statistics are summed over threads and processes, normalised by the
        step's total position weight, clipped, and every replica steps."""
        cfg = self.config
        start = time.perf_counter()
        reports = run_step(self.drafter_workers, self._control, self.step)
        grad_norm = step_replicas(self.replicas, cfg.grad_clip)
        self.monitor.check(self.step, warmup=not self._warmed_up)
        self._warmed_up = True
        stats = self.replicas[0].flat.stats.cpu()  # one host sync per step, for logging
        bs = cfg.block_size
        acc = per_position_accuracy(stats[2 : 2 + bs].long(), stats[2 + bs :].long())
        self._resume_state = max(reports, key=lambda rep: rep.last_job.index).last_job.resume_state
        elapsed = time.perf_counter() - start
        tokens = sum(rep.tokens for rep in reports)
        fractions = self._step_fractions()
        drafter_s = fractions.pop("drafter_s")
        flops = sum(rep.flops for rep in reports)
        metrics = {
            "loss": float(stats[0] / stats[1].clamp(min=1e-8)),
            "tau_hat": acceptance_length_estimate(acc),
            "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
            "tokens_per_s": tokens / elapsed,
            "step_s": elapsed,
            **{f"acc/{k + 1}": float(a) for k, a in enumerate(acc)},
            "tokens": tokens,
            "drafter_s": drafter_s,
            "drafter_flops": flops,
            "drafter_tokens_per_s": tokens / max(drafter_s, 1e-9),
        }
        if self.peak_flops:
            metrics["drafter_mfu"] = flops / max(drafter_s, 1e-9) / self.peak_flops
        metrics.update(fractions)
        return metrics

    def _step_fractions(self) -> dict[str, float]:
        """Since the previous step's end: data_wait_frac (mean drafter inbox wait), target_frac
        (mean target busy) and drafter_s (drafter busy seconds summed over threads). Work is
        counted when it ends, so a window can show a little over 100%."""
        now = {w.name: w.counters() for w in self._threads}
        last, self._step_counters = self._step_counters, now
        now_t = time.perf_counter()
        elapsed, self._step_time = max(now_t - self._step_time, 1e-9), now_t
        delta = lambda w, key: now[w.name][key] - last[w.name][key]
        waits = [delta(w, "wait_s") for w in self.drafter_workers]
        busy = [delta(w, "busy_s") for w in self.target_workers]
        return {
            "data_wait_frac": sum(waits) / len(waits) / elapsed,
            "target_frac": sum(busy) / len(busy) / elapsed,
            "drafter_s": sum(delta(w, "busy_s") for w in self.drafter_workers),
        }

    # ---- observability ------------------------------------------------------------------------

    def _interval_stats(self) -> dict[str, dict[str, float]]:
        """Per thread since the last call: busy/wait/blocked fractions of wall time, tokens/s,
        inbox depth (drafters)."""
        now_t = time.perf_counter()
        interval = max(now_t - self._last_time, 1e-9)
        stats = {}
        for w in self._threads:
            now, last = w.counters(), self._last_counters[w.name]
            d = {k: now[k] - last[k] for k in now}
            entry = {
                "busy": d["busy_s"] / interval,
                "wait": d["wait_s"] / interval,
                "blocked": d["blocked_s"] / interval,
                "tokens_per_s": d["tokens"] / interval,
            }
            if isinstance(w, DrafterWorker):
                entry["queue"] = float(len(w.inbox))
                if self.peak_flops and d["busy_s"]:
                    entry["mfu"] = d["flops"] / d["busy_s"] / self.peak_flops
            stats[w.name] = entry
            self._last_counters[w.name] = now
        self._last_time = now_t
        return stats

    @staticmethod
    def _side_means(stats) -> dict[str, float]:
        target = [v for k, v in stats.items() if k.startswith("target")]
        drafter = [v for k, v in stats.items() if k.startswith("drafter")]
        mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
        return {
            "target_busy": mean(target, "busy"),
            "target_blocked": mean(target, "blocked"),
            "drafter_busy": mean(drafter, "busy"),
            "drafter_wait": mean(drafter, "wait"),
            "queue": mean(drafter, "queue"),
        }

    def _postfix(self, metrics, stats) -> dict[str, str]:
        side = self._side_means(stats)
        return {
            "loss": f"{metrics['loss']:.3f}",
            "tau": f"{metrics['tau_hat']:.2f}",
            "tok_s": f"{metrics['tokens_per_s']:.0f}",
            "tgt": f"{100 * side['target_busy']:.0f}%",
            "dft": f"{100 * side['drafter_busy']:.0f}%",
            "wait": f"{100 * side['drafter_wait']:.0f}%",
            "q": f"{side['queue']:.1f}",
        }

    def _log_threads(self, stats) -> None:
        side = self._side_means(stats)
        verdict = _bottleneck(side)
        rows = "; ".join(
            f"{name}: busy {100 * s['busy']:.0f}% wait {100 * s['wait']:.0f}%"
            + (
                f" blocked {100 * s['blocked']:.0f}%"
                if name.startswith("target")
                else f" queue {s['queue']:.0f}" + (f" mfu {100 * s['mfu']:.1f}%" if "mfu" in s else "")
            )
            + f" {s['tokens_per_s']:.0f} tok/s"
            for name, s in stats.items()
        )
        logger.info("step %d threads: %s; bottleneck: %s", self.step, rows, verdict)
        for name, s in stats.items():
            for key, value in s.items():
                self.writer.add_scalar(f"pipeline/{name.replace(' ', '_').replace(':', '')}/{key}", value, self.step)
        for key, value in side.items():
            self.writer.add_scalar(f"pipeline/{key}", value, self.step)
        self.writer.flush()

    def compile_report(self) -> dict[str, dict[str, int]]:
        """Per drafter thread: compiles, unexpected recompiles, eager fallbacks (after train())."""
        return {
            w.name: {
                "compiles": w.compiles,
                "unexpected_recompiles": w.unexpected_recompiles,
                "eager_fallbacks": w.eager_fallbacks,
            }
            for w in self.drafter_workers
        }

    def _log_compile_summary(self) -> None:
        if not self.compiled:
            return
        for name, counts in self.compile_report().items():
            log = logger.warning if counts["eager_fallbacks"] or counts["unexpected_recompiles"] else logger.info
            log(
                "%s: %d compile(s), %d unexpected recompile(s), %d eager fallback step(s)",
                name,
                counts["compiles"],
                counts["unexpected_recompiles"],
                counts["eager_fallbacks"],
            )
        logger.info(
            "process-wide: %d recompile(s), %d graph break(s), %d eager fallback frame(s) after warm-up",
            self.monitor.recompiles,
            self.monitor.graph_breaks,
            self.monitor.failed,
        )

    # ---- checkpoints --------------------------------------------------------------------------

    def training_state(self) -> dict:
        state = super().training_state()
        # The loader and anchor RNG run ahead (prefetch): save their state as of the last job
        # of this step. Anchor RNG states differ per process: rank 0 saves all of them.
        state["data"] = self._resume_state["data"]
        state["anchor_rng"] = gather_objects(self._resume_state["anchor_rng"])
        return state

    def save_checkpoint(self) -> Path | None:
        state = self.training_state()  # a collective: every rank calls it
        if not self.process.is_main:
            return None
        return checkpoint.save_checkpoint(
            self.out,
            self.step,
            weights=self.drafter.state_dict(),
            drafter_config=self.drafter.config.to_diff_dict(),
            training_state=state,
            keep_last=self.config.keep_last,
        )

    def load_checkpoint(self) -> None:
        """Restore every replica, optimizer, schedule, the data position and this rank's
        anchor RNG from the latest checkpoint in ``out`` (exact continuation).

        Raises:
            CheckpointError: no/corrupt checkpoint, a different config, or a different number
                of processes.
        """
        if not self._replicas_ready:  # the base constructor calls this before the replicas exist
            return
        from safetensors.torch import load_file

        step_dir = checkpoint.find_checkpoint(self.out)
        state = checkpoint.load_training_state(step_dir)
        _check_resume_config(state["config"], self.config, step_dir)
        rngs = state["anchor_rng"]
        if not isinstance(rngs, list) or len(rngs) != self.process.world_size:
            saved = len(rngs) if isinstance(rngs, list) else "a single-device run"
            raise checkpoint.CheckpointError(
                f"{step_dir} was saved by {saved} process(es), this run has "
                f"{self.process.world_size}; resume with the same torchrun layout"
            )
        weights = load_file(str(step_dir / checkpoint.WEIGHTS_NAME))
        for r in self.replicas:
            r.model.load_state_dict(weights)
            # A copy each: load_state_dict keeps same-device state tensors as they are, so
            # replicas would share (and triple-update) one set of Adam moments.
            r.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
            r.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["data"])
        self.anchor_generator.set_state(rngs[self.process.rank])
        self._resume_state = {"data": state["data"], "anchor_rng": rngs[self.process.rank]}
        checkpoint.set_rng_state(state["rng"])
        self.step = state["step"]
        logger.info("resumed from %s at step %d (epoch %d)", step_dir, self.step, self.loader.epoch)

    def close(self) -> None:
        """Leave the torchrun process group (call once, after :meth:`train`)."""
        barrier()
        destroy_process_group()
