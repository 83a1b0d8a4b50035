"""One training step under ``torch.profiler`` (``dflash train --profile-step N``): where the GPU
time of a step goes, by kernel kind, for the whole step and for the two stages the trainer marks,
the target's forward (:data:`TARGET_RANGE`) and the drafter's forward, loss and backward
(:data:`DRAFTER_RANGE`).

CUPTI sees the kernels of every thread, so in the threaded layout the step's window also holds the
target thread's forward of a batch ahead; ops are recorded in every thread too
(``profile_all_threads``, where torch has it). A kernel belongs to the innermost op that launched
it; a stage table sums the kernels of the ops inside the stage's range, and those of the backward
the autograd engine runs in its own CUDA thread while the range waits in ``backward()``. Writes a
Chrome trace (Perfetto) beside the tables for the kernel-by-kernel view.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: The range around :func:`dflash.train.step.produce_target_states`'s forward.
TARGET_RANGE = "dflash.target_forward"
#: The range around :func:`dflash.train.step.drafter_step` (forward, loss and backward).
DRAFTER_RANGE = "dflash.drafter_step"
_STAGES = (TARGET_RANGE, DRAFTER_RANGE)
#: The table of backward kernels outside any marked range (:func:`step_tables`).
BACKWARD = "backward outside a marked step"
#: The root op of every node the autograd engine runs.
_ENGINE_ROOT = "autograd::engine::evaluate_function"

#: Kernel kinds by CUDA kernel names (CPU: op names), first match wins: inductor's kernels by
#: their prefixes (``triton_tem`` templates hold flex_attention, and GEMMs under max-autotune),
#: then SDPA's kernels before the cutlass GEMMs some of them are built from.
KERNEL_KINDS = (
    ("flex_attention", ("flex_attention",)),
    ("compiled fused (inductor)", ("triton_poi", "triton_red", "triton_per")),
    ("matmul", ("triton_tem_fused_mm", "triton_tem_fused_addmm", "triton_tem_fused_bmm")),
    ("attention (SDPA)", ("fmha", "sdpa", "flash_fwd", "flash_bwd", "efficient_attention", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "scaled_mm", "aten::mm", "aten::addmm", "aten::bmm")),
    ("Gated DeltaNet (fla)", ("chunk_", "recompute_w_u", "solve_tril", "l2norm_fwd", "_inverse_kernel", "kkt")),
)
OTHER_KIND = "other (eager elementwise, norms, copies)"


def kernel_kind(name: str) -> str:
    """The :data:`KERNEL_KINDS` entry (or :data:`OTHER_KIND`) of a kernel's name."""
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in lowered for k in keys)), OTHER_KIND)


def marked(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named ``name`` (``torch.profiler.record_function``); about 10 us when no
    profiler runs."""
    return torch.profiler.record_function(name)


@contextlib.contextmanager
def profiled_step(step: int, out: Path, devices: Iterable[torch.device]) -> Iterator[None]:
    """Profile the block (one training step) on ``devices``; then write ``profile_step{step}.json.gz``
    (gzipped Chrome trace) into ``out`` and log the GPU time by kernel kind, summed over the
    devices (CPU time of ops on a CPU run), and each stage's slowest eager ops (:func:`eager_ops`)."""
    from torch.profiler import ProfilerActivity, profile

    cuda_devices = sorted({d for d in devices if d.type == "cuda"}, key=str)
    cuda = bool(cuda_devices)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities, experimental_config=_all_threads()) as prof:
        yield
        for device in cuda_devices:  # kernels still running when the profiler stops are dropped
            torch.cuda.synchronize(device)
    trace = out / f"profile_step{step}.json.gz"
    unit = f"GPU kernel time on {', '.join(map(str, cuda_devices))}" if cuda else "CPU time of ops (no GPU)"
    try:
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))  # gzipped: a 27B step's trace is hundreds of MB as text
        tables = format_tables(step_tables(prof, cuda)) + format_ops(eager_ops(prof, cuda))
        logger.info("step %d profile (%s): %s; trace %s", step, unit, tables, trace)
    except Exception:  # a diagnostic must not end the training run
        logger.exception("step %d profile: reading the profiler's results failed; training goes on", step)


def _all_threads():
    """The profiler setting that records ops in threads that did not start it (the threaded
    engine's workers), None where this torch lacks it."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


def step_tables(prof, cuda: bool) -> dict[str, dict[str, float]]:
    """Milliseconds by kernel kind (on a CPU run: the ops' own CPU time by op name):

    - ``"step"``: every kernel in the window, whichever thread launched it;
    - one table per marked stage (:data:`TARGET_RANGE`, :data:`DRAFTER_RANGE`): the kernels of the
      ops run inside its range, and of the backward nodes run meanwhile in the autograd engine's
      threads (the drafter's backward on CUDA);
    - :data:`BACKWARD`: backward nodes no marked range waited on.
    """
    events = prof.events()
    tables: dict[str, dict[str, float]] = {"step": defaultdict(float)}
    for event in events:
        if cuda and event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation:
            tables["step"][kernel_kind(event.name)] += event.device_time_total / 1e3
        elif not cuda and event.device_type == torch.autograd.DeviceType.CPU and event.name not in _STAGES:
            tables["step"][kernel_kind(event.name)] += event.self_cpu_time_total / 1e3
    ranges = [e for e in events if e.name in _STAGES and e.device_type == torch.autograd.DeviceType.CPU]
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        stage = _stage_of(event, ranges)
        if stage is None:
            continue
        table = tables.setdefault(stage, defaultdict(float))
        if cuda:
            for kernel in event.kernels:
                table[kernel_kind(kernel.name)] += kernel.duration / 1e3
        elif event.name not in _STAGES:
            table[kernel_kind(event.name)] += event.self_cpu_time_total / 1e3
    return {name: dict(table) for name, table in tables.items()}


def eager_ops(prof, cuda: bool, top: int = 6) -> dict[str, list[tuple[str, float]]]:
    """Per marked stage, the ops whose kernels :data:`OTHER_KIND` holds (eager elementwise work:
    what a fusion would remove), by the op that launched them, the ``top`` slowest with their
    milliseconds. A CPU run has no kernels: empty."""
    if not cuda:
        return {}
    events = prof.events()
    ranges = [e for e in events if e.name in _STAGES and e.device_type == torch.autograd.DeviceType.CPU]
    by_stage: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or not event.kernels:
            continue
        stage = _stage_of(event, ranges)
        for kernel in event.kernels if stage is not None else ():
            if kernel_kind(kernel.name) == OTHER_KIND:
                by_stage[stage][event.name] += kernel.duration / 1e3
    return {stage: sorted(ops.items(), key=lambda kv: -kv[1])[:top] for stage, ops in by_stage.items()}


def format_ops(ops: dict[str, list[tuple[str, float]]]) -> str:
    """One line per stage of :func:`eager_ops`."""
    return "".join(
        f"\n  {stage}, eager ops: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in slowest)
        for stage, slowest in ops.items()
    )


def _stage_of(event, ranges: list) -> str | None:
    """The marked range ``event`` ran inside; for an op of a backward node the autograd engine ran
    in another thread, the drafter range that waited on it (:data:`BACKWARD` if none did)."""
    root = event
    while root.name not in _STAGES and root.cpu_parent is not None:
        root = root.cpu_parent
    if root.name in _STAGES:
        return root.name
    if not root.name.startswith(_ENGINE_ROOT):
        return None
    start, end = root.time_range.start, root.time_range.end
    waiting = (r for r in ranges if r.name == DRAFTER_RANGE and r.time_range.start <= start and end <= r.time_range.end)
    return DRAFTER_RANGE if next(waiting, None) is not None else BACKWARD


def format_tables(tables: dict[str, dict[str, float]]) -> str:
    """One line per table: its total and each kind's milliseconds and share, largest first."""
    lines = []
    for name, table in tables.items():
        total = sum(table.values())
        kinds = ", ".join(
            f"{kind} {ms:.1f} ms ({100 * ms / total:.0f}%)" for kind, ms in sorted(table.items(), key=lambda kv: -kv[1])
        )
        lines.append(f"\n  {name}: {total:.1f} ms: {kinds if total > 0 else 'nothing recorded'}")
    return "".join(lines)
