"""One training step under ``torch.profiler`` (``dflash train --profile-step N``): where the GPU
time of a step goes, by kernel kind, for the whole step and for the two stages the trainer marks,
the target's forward (:data:`TARGET_RANGE`) and the drafter's forward, loss and backward
(:data:`DRAFTER_RANGE`).

CUPTI sees the kernels of every thread, so in the threaded layout the step's window also holds the
target thread's forwards of batches ahead; ops are recorded in every thread too
(``profile_all_threads``, where torch has it). A kernel belongs to the innermost op that launched
it; a stage table sums the kernels of the ops inside the stage's range, and those of the backward
the autograd engine runs in its own CUDA thread while the range waits in ``backward()``. What no
range holds is a table of its own (:data:`OUTSIDE`: the optimizer, and in the threaded layout the
part of a target forward whose range opened before the profiler started, which the profiler does
not record), so the tables add up to the step. Writes a Chrome trace (Perfetto) beside the tables
for the kernel-by-kernel view.

The tables are read from that trace, where each kernel names its launching op by ``External id``:
torch 2.11's ``FunctionEvent.kernels`` gave some ops kernels that were not theirs.
At the user's shape on an H200 its stage tables summed to 2,278 ms of kernels in a step of
1,636 ms; the trace gives the target's forward 785 ms where they gave 1,188 ms
(``docs/results.md``).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: The range around :func:`dflash.train.step.produce_target_states`'s forward.
TARGET_RANGE = "dflash.target_forward"
#: The range around :func:`dflash.train.step.drafter_step` (forward, loss and backward).
DRAFTER_RANGE = "dflash.drafter_step"
_STAGES = (TARGET_RANGE, DRAFTER_RANGE)
#: The table of backward kernels outside any marked range (:func:`trace_tables`).
BACKWARD = "backward outside a marked step"
#: The table of the rest: ops in no marked range and no backward (the optimizer's, say).
OUTSIDE = "outside the marked ranges"
#: The root op of every node the autograd engine runs.
_ENGINE_ROOT = "autograd::engine::evaluate_function"
#: Trace categories of work on the GPU.
_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")

#: Kernel kinds by CUDA kernel names (CPU: op names), first match wins: inductor's kernels by
#: their prefixes (``triton_tem`` templates hold flex_attention, and GEMMs under max-autotune),
#: then SDPA's kernels before the cutlass GEMMs some of them are built from.
KERNEL_KINDS = (
    ("communication (NCCL)", ("nccl",)),
    ("flex_attention", ("flex_attention",)),
    ("compiled fused (inductor)", ("triton_poi", "triton_red", "triton_per")),
    ("matmul", ("triton_tem_fused_mm", "triton_tem_fused_addmm", "triton_tem_fused_bmm")),
    ("attention (SDPA)", ("fmha", "sdpa", "flash_fwd", "flash_bwd", "efficient_attention", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "scaled_mm", "aten::mm", "aten::addmm", "aten::bmm")),
    (
        "Gated DeltaNet (fla)",
        ("chunk_", "recompute_w_u", "solve_tril", "l2norm_fwd", "_inverse_kernel", "kkt", "causal_conv1d"),
    ),
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
    devices (CPU time of ops on a CPU run), and each stage's slowest eager ops (:func:`trace_tables`)."""
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
        prof.export_chrome_trace(str(trace))  # gzipped: a 27B step's trace is tens of MB as text
        with gzip.open(trace, "rt") as f:
            tables, ops = trace_tables(json.load(f)["traceEvents"], cuda)
        logger.info("step %d profile (%s): %s; trace %s", step, unit, format_tables(tables) + format_ops(ops), trace)
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


def trace_tables(events: list[dict], cuda: bool, top: int = 6) -> tuple[dict[str, dict[str, float]], dict[str, list]]:
    """A step's time from its Chrome trace's ``traceEvents`` (the profiler's export): on CUDA each
    kernel, memcpy and memset by the op that launched it (its ``External id``); on a CPU run, which
    has no kernels, each op's own CPU time.

    Returns:
        tuple: (tables, eager ops).

        - tables: milliseconds by :func:`kernel_kind` for ``"step"`` (everything in the window,
          whichever thread ran it); for each marked stage (what the ops inside its range ran, and
          the backward nodes the autograd engine ran in its own thread while a
          :data:`DRAFTER_RANGE` was open); for :data:`BACKWARD` (backward nodes no range waited
          on); and for :data:`OUTSIDE` (the rest), so the tables add up to ``"step"``.
        - eager ops (CUDA only): per stage, the ``top`` ops whose kernels are :data:`OTHER_KIND`
          (eager elementwise work: what a fusion would remove), with their milliseconds, slowest
          first.
    """
    ops = _ops_in_stages(events)
    if cuda:
        work = [
            (kernel_kind(e["name"]), e.get("dur", 0) / 1e3, ops.get(e.get("args", {}).get("External id")))
            for e in events
            if e.get("cat") in _DEVICE_WORK
        ]
    else:
        work = [(kernel_kind(op.name), op.self_ms, op) for op in ops.values() if op.name not in _STAGES]
    tables: dict[str, dict[str, float]] = {"step": defaultdict(float)}
    eager: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for kind, ms, op in work:
        tables["step"][kind] += ms
        stage = (op.stage if op is not None else None) or OUTSIDE
        tables.setdefault(stage, defaultdict(float))[kind] += ms
        if cuda and kind == OTHER_KIND and stage != OUTSIDE:
            eager[stage][op.name] += ms
    slowest = {stage: sorted(by_op.items(), key=lambda kv: -kv[1])[:top] for stage, by_op in eager.items()}
    return {name: dict(table) for name, table in tables.items()}, slowest


@dataclass(frozen=True)
class _Op:
    """An op of the trace: its name, the stage it ran in (None: none), its own time (ms, its
    children's left out)."""

    name: str
    stage: str | None
    self_ms: float


def _ops_in_stages(events: list[dict]) -> dict[int, _Op]:
    """Each op by its ``External id``, with the innermost marked range around it in its thread; for
    an op under an autograd engine node, the drafter range open meanwhile in any thread
    (:data:`BACKWARD` if none was)."""
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    drafter_spans = [(e["ts"], e["ts"] + e["dur"]) for e in ops if e["name"] == DRAFTER_RANGE]
    found: dict[int, tuple[str, str | None, float]] = {}  # op id -> (name, stage, duration in us)
    children_us: dict[int, float] = defaultdict(float)
    for thread in {e["tid"] for e in ops}:
        enclosing: list[tuple[float, str | None, int]] = []  # (end, stage, op id) of the ops open here, outermost first
        for op in sorted((e for e in ops if e["tid"] == thread), key=lambda e: (e["ts"], -e["dur"])):
            start, end, op_id = op["ts"], op["ts"] + op["dur"], op.get("args", {}).get("External id")
            while enclosing and enclosing[-1][0] <= start:
                enclosing.pop()
            stage = enclosing[-1][1] if enclosing else None
            if enclosing:
                children_us[enclosing[-1][2]] += op["dur"]
            if op["name"] in _STAGES:
                stage = op["name"]
            elif stage is None and op["name"].startswith(_ENGINE_ROOT):
                stage = DRAFTER_RANGE if any(s <= start and end <= e for s, e in drafter_spans) else BACKWARD
            enclosing.append((end, stage, op_id))
            if op_id is not None:
                found[op_id] = (op["name"], stage, op["dur"])
    return {op_id: _Op(name, stage, (us - children_us[op_id]) / 1e3) for op_id, (name, stage, us) in found.items()}


def format_ops(ops: dict[str, list[tuple[str, float]]]) -> str:
    """One line per stage of :func:`trace_tables`' eager ops."""
    return "".join(
        f"\n  {stage}, eager ops: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in slowest)
        for stage, slowest in ops.items()
    )


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
