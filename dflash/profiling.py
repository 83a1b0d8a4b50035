"""One training step under ``torch.profiler`` (``dflash train --profile-step N``): where the GPU
time of a step goes, by kernel kind, for the whole step and for the two stages the trainer marks,
the target's forward (:data:`TARGET_RANGE`) and the drafter's forward and backward
(:data:`DRAFTER_RANGE`).

The profiler is process-wide: it records the kernels of every thread, so in the threaded layout the
step's window also holds the target thread's forward of a batch ahead. The stage tables sum the
kernels launched inside each marked range, in whichever thread ran it. Writes a Chrome trace
(``chrome://tracing`` or Perfetto) beside the tables for the kernel-by-kernel view.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: The range around :func:`dflash.train.step.produce_target_states`'s forward.
TARGET_RANGE = "dflash.target_forward"
#: The range around :func:`dflash.train.step.drafter_step` (forward, loss and backward).
DRAFTER_RANGE = "dflash.drafter_step"

#: Kernel kinds by substrings of CUDA kernel names, first match wins (flex_attention's inductor
#: templates before other attention kernels; fla's Gated DeltaNet kernels by their op names).
KERNEL_KINDS = (
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "scaled_mm", "aten::mm", "aten::addmm", "aten::bmm")),
    ("flex_attention", ("flex_attention", "triton_tem")),
    ("attention (SDPA)", ("flash", "fmha", "attention", "efficient")),
    ("Gated DeltaNet (fla)", ("chunk_", "recompute_w_u", "solve_tril", "l2norm_fwd", "_inverse_kernel", "kkt")),
    ("compiled fused (inductor)", ("triton_poi", "triton_red", "triton_per")),
)
OTHER_KIND = "other (eager elementwise, norms, copies)"


def kernel_kind(name: str) -> str:
    """The :data:`KERNEL_KINDS` entry (or :data:`OTHER_KIND`) of a kernel's name."""
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in lowered for k in keys)), OTHER_KIND)


def marked(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named ``name`` (``torch.profiler.record_function``); a few microseconds
    when no profiler runs."""
    return torch.profiler.record_function(name)


@contextlib.contextmanager
def profiled_step(step: int, out: Path, device: torch.device) -> Iterator[None]:
    """Profile the block (one training step); then write ``profile_step{step}.json`` (Chrome
    trace) into ``out`` and log the GPU time by kernel kind (CPU time of ops on a CPU run)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize(device)
    trace = out / f"profile_step{step}.json"
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    logger.info("step %d profile (%s): %s; trace %s", step, _unit(cuda), format_tables(step_tables(prof, cuda)), trace)


def _unit(cuda: bool) -> str:
    return "GPU kernel time" if cuda else "CPU time of ops (no GPU)"


def step_tables(prof, cuda: bool) -> dict[str, dict[str, float]]:
    """Milliseconds by kernel kind (on a CPU run: the ops' own CPU time by op name's kind):

    - ``"step"``: every kernel in the window, whichever thread launched it (CUPTI sees them all);
    - one table per marked stage (:data:`TARGET_RANGE`, :data:`DRAFTER_RANGE`): the kernels of the
      ops run inside it;
    - :data:`BACKWARD`: the kernels of ops the autograd engine ran in its own threads (a CUDA
      backward; only the drafter has one).

    ``torch.profiler`` records ops only in the thread that started it and the threads it hands work
    to, so the stage tables cover the trainer's main thread (the single-device engine), not the
    threaded engine's worker threads, whose kernels are in ``"step"`` only.
    """
    events = prof.events()
    tables: dict[str, dict[str, float]] = {"step": defaultdict(float)}
    for event in events:
        if cuda and event.device_type == torch.autograd.DeviceType.CUDA:
            tables["step"][kernel_kind(event.name)] += event.device_time_total / 1e3
        elif not cuda and event.device_type == torch.autograd.DeviceType.CPU and event.name not in _STAGES:
            tables["step"][kernel_kind(event.name)] += event.self_cpu_time_total / 1e3
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.name in _STAGES:
            continue
        stage = _stage_of(event)
        if stage is None:
            continue
        table = tables.setdefault(stage, defaultdict(float))
        if cuda:
            for kernel in event.kernels:
                table[kernel_kind(kernel.name)] += kernel.duration / 1e3
        else:
            table[kernel_kind(event.name)] += event.self_cpu_time_total / 1e3
    return {name: dict(table) for name, table in tables.items()}


#: The table of kernels launched by the autograd engine's threads (:func:`step_tables`).
BACKWARD = "backward in autograd threads"
_STAGES = (TARGET_RANGE, DRAFTER_RANGE)


def _stage_of(event) -> str | None:
    """The marked range ``event`` ran inside, :data:`BACKWARD` for an op of an autograd engine
    thread (its forward ran in another thread), else None."""
    op = event
    while op is not None:
        if op.name in _STAGES:
            return op.name
        op = op.cpu_parent
    if event.fwd_thread and event.fwd_thread != event.thread:
        return BACKWARD
    return None


def format_tables(tables: dict[str, dict[str, float]]) -> str:
    """One line per table: its total and each kind's milliseconds and share, largest first."""
    lines = []
    for name, table in tables.items():
        total = sum(table.values())
        kinds = ", ".join(
            f"{kind} {ms:.1f} ms ({100 * ms / total:.0f}%)" for kind, ms in sorted(table.items(), key=lambda kv: -kv[1])
        )
        lines.append(f"\n  {name}: {total:.1f} ms: {kinds or 'nothing recorded'}")
    return "".join(lines)
