"""A run's metrics: each step's figures from the step engine's statistics, written by rank 0 to
TensorBoard (``tensorboard/``), ``metrics.jsonl`` and the console log, with the threads' busy and wait
shares of a threaded run, and the compile and steady-state summaries at the end. Benchmarks parse the
console lines (``benchmarks/packing_e2e.py``): keep their shapes."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.devices import DeviceLayout
from dflash.run.layout import METRICS_NAME, TENSORBOARD_DIR
from dflash.train.engine import StepStats

logger = logging.getLogger(__name__)

#: Below this share of wall time spent waiting, neither side is said to hold the other up.
BOTTLENECK_WAIT_SHARE = 0.05


def progress_postfix(metrics: dict[str, float]) -> dict[str, str]:
    """The figures the progress bar shows beside the step count."""
    return {
        "loss": f"{metrics['loss']:.3f}",
        "tau_hat": f"{metrics['tau_hat']:.2f}",
        "tok/s": f"{metrics['tokens_per_s']:.0f}",
    }


@dataclass
class Throughput:
    """Sums over the steps after this process's first (compile / warm-up) step."""

    steps: int = 0
    totals: dict = field(
        default_factory=lambda: dict.fromkeys(
            (
                "tokens",
                "row_tokens",
                "draft_tokens",
                "supervised",
                "step_s",
                "drafter_s",
                "target_s",
                "target_row_tokens",
                "flops",
            ),
            0.0,
        )
    )

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        for key in self.totals:
            self.totals[key] += getattr(stats, key)


class MetricsLog:
    """Where a run's metrics go. Rank 0 writes (``main``); on the other ranks only :meth:`metrics` does
    anything.

    Opening it keeps the rows of ``metrics.jsonl`` up to ``start_step`` (a resume continues the log of the
    checkpoint it starts from, a new run starts an empty one; a killed run may have logged steps after its
    last checkpoint), and TensorBoard hides what an earlier run of this ``out`` logged from the next step on.

    Args:
        out (Path): the run's ``--out``.
        layout (DeviceLayout): the process's target and drafter threads.
        total_steps (int): the run's length, for the log lines.
        peak_flops (float): the device's dense bf16 peak in FLOP/s for the MFU figures; 0: unknown.
        start_step (int): the last step already done (0 for a new run).
        main (bool): this process writes (rank 0).
    """

    def __init__(
        self, out: Path, *, layout: DeviceLayout, total_steps: int, peak_flops: float, start_step: int, main: bool
    ) -> None:
        self.out, self.layout, self.total_steps, self.peak_flops, self.main = out, layout, total_steps, peak_flops, main
        self._writer = None
        if main:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: seconds, rank 0 only

            self._trim(start_step)
            self._writer = SummaryWriter(str(out / TENSORBOARD_DIR), purge_step=start_step + 1)

    def metrics(self, stats: StepStats, *, lr: float) -> dict[str, float]:
        """The figures of one step, by name (what :meth:`log_step` writes)."""
        metrics = {
            "loss": stats.loss,
            "tau_hat": stats.tau_hat,
            "grad_norm": stats.grad_norm,
            "lr": lr,
            "tokens_per_s": stats.tokens / stats.step_s,
            "drafter_tokens_per_s": stats.tokens / max(stats.drafter_s, 1e-9),
            "data_wait_frac": stats.data_wait_frac,
            "target_frac": stats.target_s / len(self.layout.targets) / stats.step_s,
            "row_fill": stats.tokens / max(stats.row_tokens, 1),
            **{f"acc/{k + 1}": a for k, a in enumerate(stats.acc)},
        }
        if stats.selector_loss is not None:
            metrics["selector_loss"] = stats.selector_loss
        if self.peak_flops:
            metrics["drafter_mfu"] = stats.flops / max(stats.drafter_s, 1e-9) / self.peak_flops
        return metrics

    def record(self, step: int, figures: dict[str, float]) -> None:
        """``figures`` of ``step`` into TensorBoard and ``metrics.jsonl``."""
        if not self.main:
            return
        for name, value in figures.items():
            self._writer.add_scalar(name, value, step)
        with open(self.out / METRICS_NAME, "a") as f:
            f.write(json.dumps({"step": step, **figures}) + "\n")

    def log_step(self, step: int, metrics: dict[str, float], threads: dict[str, dict[str, float]]) -> None:
        """A logged step: its :meth:`metrics` recorded and in one console line, and the threads' shares
        since the last logged step (``threads``: the engine's ``interval_report``; empty for one device)."""
        if not self.main:
            return
        self.record(step, metrics)
        mfu = f" mfu {100 * metrics['drafter_mfu']:.1f}%" if "drafter_mfu" in metrics else ""
        selector = f" selector loss {metrics['selector_loss']:.4f}" if "selector_loss" in metrics else ""
        logger.info(
            "step %d/%d loss %.4f%s tau_hat %.3f acc1 %.3f lr %.2e tok/s %.0f drafter tok/s %.0f data-wait %.1f%% "
            "target %.1f%% row fill %.0f%%%s",
            step,
            self.total_steps,
            metrics["loss"],
            selector,
            metrics["tau_hat"],
            metrics.get("acc/1", 0.0),
            metrics["lr"],
            metrics["tokens_per_s"],
            metrics["drafter_tokens_per_s"],
            100 * metrics["data_wait_frac"],
            100 * metrics["target_frac"],
            100 * metrics["row_fill"],
            mfu,
        )
        if threads:
            self._log_threads(step, threads)
        self._writer.flush()

    def _log_threads(self, step: int, threads: dict[str, dict[str, float]]) -> None:
        """Per-thread busy/wait shares since the last log line, and which side is the bottleneck."""
        mean = lambda prefix, key: (
            sum(s[key] for n, s in threads.items() if n.startswith(prefix)) / sum(n.startswith(prefix) for n in threads)
        )
        side = {
            "target_busy": mean("target", "busy"),
            "target_blocked": mean("target", "blocked"),
            "drafter_busy": mean("drafter", "busy"),
            "drafter_wait": mean("drafter", "wait"),
        }
        rows = []
        for name, s in threads.items():
            row = f"{name}: busy {100 * s['busy']:.0f}% wait {100 * s['wait']:.0f}%"
            if name.startswith("target"):
                row += f" blocked {100 * s['blocked']:.0f}%"
            else:
                row += f" queue {s['queue']:.0f}"
                if self.peak_flops:
                    row += f" mfu {100 * s['flops_per_busy_s'] / self.peak_flops:.1f}%"
            rows.append(row + f" {s['tokens_per_s']:.0f} tok/s")
        logger.info("step %d threads: %s; bottleneck: %s", step, "; ".join(rows), bottleneck(side))
        for name, s in threads.items():
            for key, value in s.items():
                self._writer.add_scalar(f"threads/{name.split(' ')[0]}/{key}", value, step)
        for key, value in side.items():
            self._writer.add_scalar(f"threads/{key}", value, step)

    def log_compile_summary(self, summary: dict[str, dict[str, int]]) -> None:
        """Per drafter replica (the engine's ``compile_summary``): compiles, unexpected recompiles, eager
        fallback steps and graph breaks, a warning when any but the first is not zero."""
        if not self.main:
            return
        for name, counts in summary.items():
            healthy = not (counts["eager_fallbacks"] or counts["unexpected_recompiles"] or counts["graph_breaks"])
            (logger.info if healthy else logger.warning)(
                "%s: %d compile(s), %d unexpected recompile(s), %d eager fallback step(s), %d graph break(s)",
                name,
                counts["compiles"],
                counts["unexpected_recompiles"],
                counts["eager_fallbacks"],
                counts["graph_breaks"],
            )

    def log_throughput(self, throughput: Throughput) -> None:
        """The steady-state summary line (benchmarks parse it: keep its shape). Rates are of this
        process: real tokens and draft tokens (real blocks x block size) per wall second, and the
        target's rate over its busy time per target device (:func:`target_forward`), and supervised
        draft positions per wall second and per second of drafter busy time per drafter device (the
        drafter alone, as a trainer fed preloaded target states runs; with one device the busy time
        holds the optimizer step, in the threaded layout not)."""
        if not self.main or not throughput.steps:
            return
        t = throughput.totals
        parts = [
            f"steady state over {throughput.steps} steps: {t['tokens'] / t['step_s']:.0f} tok/s end to end",
            # Comparable across recipes: draft tokens depend on anchors x block size, the target's on row length.
            f"{t['draft_tokens'] / t['step_s']:.0f} draft tok/s",
            target_forward(t, throughput.steps),
            f"drafter step {t['tokens'] / t['drafter_s']:.0f} tok/s",
            f"{t['flops'] / t['drafter_s'] / 1e12:.3g} TFLOP/s",
            (
                f"drafter MFU {100 * t['flops'] / t['drafter_s'] / self.peak_flops:.1f}% of "
                f"{self.peak_flops / 1e12:.3g} TFLOP/s"
                if self.peak_flops
                else "drafter MFU n/a (pass --peak-tflops)"
            ),
            f"row fill {100 * t['tokens'] / max(t['row_tokens'], 1):.1f}%",
            (
                f"target share {100 * t['target_s'] / len(self.layout.targets) / t['step_s']:.1f}%"
                if t["target_row_tokens"]
                else "target share not measured"
            ),
            f"supervised draft positions {t['supervised'] / t['step_s']:.0f}/s end to end, "
            f"{t['supervised'] / max(t['drafter_s'], 1e-9):.0f}/s per drafter busy second",
        ]
        if self.layout.device_type == "cuda":
            devices = dict.fromkeys(s.device for s in self.layout.targets + self.layout.drafters)
            peaks = ", ".join(f"{d} {torch.cuda.max_memory_allocated(d) / 2**30:.1f} GiB" for d in devices)
            parts.append(f"peak memory {peaks}")
        logger.info(", ".join(parts))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def _trim(self, start_step: int) -> None:
        path = self.out / METRICS_NAME
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= start_step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):  # a row cut short by a kill
                continue
        path.write_text("".join(kept))


def target_forward(totals: dict, steps: int) -> str:
    """The summary's target rate: the rows (padding included) the target forwarded in the measured
    steps over its busy time (a target thread's busy time also holds the copy of the states to its
    drafter's device). Not measured when no forward finished in those steps: target threads run ahead
    of the drafters, so a short run's rows can all come out of the first step's prefetch."""
    if not totals["target_row_tokens"]:
        return (
            f"target forward not measured (no target forward finished in the {steps} measured step(s): "
            "the first step prefetched their rows; train more steps)"
        )
    return f"target forward {totals['target_row_tokens'] / totals['target_s']:.0f} tok/s"


def bottleneck(side: dict[str, float]) -> str:
    """Which side holds the pipeline up, from the mean wait shares (0-1) of the two sides."""
    if max(side["drafter_wait"], side["target_blocked"]) < BOTTLENECK_WAIT_SHARE:
        return f"none (both sides wait under {BOTTLENECK_WAIT_SHARE:.0%} of the time)"
    if side["drafter_wait"] > side["target_blocked"]:
        return "target side (drafters wait for data)"
    return "drafter side (targets wait for room in the prefetch buffers)"
