"""Time to the first training step: compile scope, drafter threads, cold and warm inductor caches,
and a resume on another host with and without the run's compile artifacts, side by side in one run.

    # CPU: the embedded default target with a 5-layer drafter and 32 loss chunks per micro-batch
    python benchmarks/first_step.py -- --num-draft-layers 5 --max-anchors 64 --seq-len 512
    # one H200 per drafter thread after a target GPU, at the user's shape
    python benchmarks/first_step.py --target-devices cuda:0 --layouts cuda:1 cuda:1-3 -- \\
        --target /models/Qwen3.6-27B --random-target-weights ...

Every run is a fresh ``dflash train --compile on`` interpreter with the threaded layout
(``--target-devices``, and one ``--drafter-devices`` per ``--layouts`` entry). For each
``--compile-scope`` (:mod:`dflash.train.regions`) and layout:

- **cold**: an empty inductor and Triton cache of its own;
- **warm**: a new run on the cache the cold run filled (the same host, the next day).

Then a resume on another host: the last cold run (it saves, with ``compile_cache.bin`` and
``triton_autotune.json``, :mod:`dflash.run.compile_cache`) resumed in a fresh process on a new
empty cache, once with the files and once from a copy without them.

The figure is the trainer's own: seconds from its ``drafter:`` log line to its first ``step N/M``
line (the step's compiles plus one step; model and data loading excluded), and the mean drafter
tok/s of its later steps (the compiled step's speed: few steps, so a coarse figure). Prints a
table and the ratios: step / regional per layout (cold and warm first step; later steps' speed),
N threads / 1 thread per scope, and the resume without / with the artifacts. Flags after ``--``
pass through to ``dflash train``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from runs import run_logged

from dflash.run.layout import AUTOTUNE_NAME, COMPILE_CACHE_NAME

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def first_step_seconds(log: str) -> float:
    """Seconds from the ``drafter:`` line to the first ``step N/M`` line of a trainer log.

    Raises:
        ValueError: either line is missing (the message quotes the log's tail).
    """

    def when(pattern: str) -> datetime:
        for line in log.splitlines():
            if re.search(pattern, line) and (m := _STAMP.match(line)):
                return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
        raise ValueError(f"no line matching {pattern!r} in the trainer's log; its tail:\n{log[-3000:]}")

    return (when(r"\bstep \d+/\d+ ") - when(r"\bdrafter: ")).total_seconds()


def later_steps_tok_s(log: str) -> float:
    """Mean ``drafter tok/s`` of the trainer's step lines after the first (the compiled step's speed).

    Raises:
        ValueError: the log has fewer than two step lines.
    """
    rates = [float(m.group(1)) for m in re.finditer(r"\bstep \d+/\d+ .* drafter tok/s (\d+)", log)]
    if len(rates) < 2:
        raise ValueError(f"fewer than two step lines in the trainer's log; its tail:\n{log[-3000:]}")
    return sum(rates[1:]) / len(rates[1:])


def threads_of(devices: str) -> int:
    """Drafter threads of a ``--drafter-devices`` value (``cuda:1-3`` -> 3, ``cpu:0,cpu:1`` -> 2)."""
    count = 0
    for part in devices.split(","):
        span = re.fullmatch(r"\w+:(\d+)-(\d+)", part.strip())
        count += int(span.group(2)) - int(span.group(1)) + 1 if span else 1
    return count


def train(argv: list[str], cache_dir: Path, log_path: Path) -> tuple[float, float]:
    """(seconds to the first step, drafter tok/s of the later steps) of one ``dflash train`` run."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TRITON_CACHE_DIR=str(cache_dir / "triton"))
    command = [sys.executable, "-m", "dflash", "train", *argv]
    text = run_logged(command, log_path, env=env).checked("dflash train").log
    seconds, rate = first_step_seconds(text), later_steps_tok_s(text)
    print(f"  first step after {seconds:.1f} s; later steps {rate:.0f} drafter tok/s", flush=True)
    return seconds, rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-devices", default="cpu:0")
    parser.add_argument("--layouts", nargs="+", default=["cpu:0", "cpu:0-1"], help="--drafter-devices values")
    parser.add_argument("--scopes", nargs="+", default=["step", "regional"], help="--compile-scope values")
    parser.add_argument("--steps", type=int, default=3, help="steps of each run (the resumes run as many more)")
    parser.add_argument("--no-resume", action="store_true", help="skip the resume on another host")
    parser.add_argument("--workdir", type=Path, default=None)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    base = ["--compile", "on", "--target-devices", args.target_devices, "--no-progress", "--log-every", "1", *extra]
    rows = {}
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="first_step_") as tmp:
        work = Path(tmp)
        for scope in args.scopes:
            for n, layout in enumerate(args.layouts):
                name = f"{scope}-{n}"
                run = [*base, "--compile-scope", scope, "--drafter-devices", layout, "--steps", str(args.steps)]
                cache = work / f"cache-{name}"
                cold, rate = train([*run, "--out", str(work / f"run-{name}")], cache, work / f"{name}-cold.log")
                warm_run = [*run, "--out", str(work / f"run-{name}-warm"), "--no-save"]
                warm, _ = train(warm_run, cache, work / f"{name}-warm.log")
                rows[scope, layout] = (cold, warm, rate)
        if not args.no_resume:  # the last cold run, which saved its compile artifacts
            run = work / f"run-{args.scopes[-1]}-{len(args.layouts) - 1}"
            bare = work / "run-without-artifacts"
            shutil.copytree(run, bare)
            for name in (COMPILE_CACHE_NAME, AUTOTUNE_NAME):
                (bare / name).unlink(missing_ok=True)
            resume = ["--resume", "--steps", str(2 * args.steps)]
            with_file, _ = train([*base, *resume, "--out", str(run)], work / "cache-host-2", work / "resume.log")
            without, _ = train([*base, *resume, "--out", str(bare)], work / "cache-host-3", work / "resume-bare.log")

    print("\nfirst step (compiles + one step), seconds")
    print(f"{'scope':<10} {'drafter devices':<16} {'threads':>7} {'cold':>8} {'warm':>8}  later steps, drafter tok/s")
    for (scope, layout), (cold, warm, rate) in rows.items():
        print(f"{scope:<10} {layout:<16} {threads_of(layout):>7} {cold:>8.1f} {warm:>8.1f}  {rate:,.0f}")
    if {"step", "regional"} <= set(args.scopes):
        for layout in args.layouts:
            (sc, sw, sr), (rc, rw, rr) = rows["step", layout], rows["regional", layout]
            print(
                f"step / regional, {layout}: first step cold {sc / rc:.2f}x, warm {sw / rw:.2f}x; later steps' speed "
                f"regional / step {rr / sr:.2f}x"
            )
    first, *others = args.layouts
    for scope in args.scopes:
        for layout in others:
            ratio = rows[scope, layout][0] / rows[scope, first][0]
            print(f"{scope}: {threads_of(layout)} threads / {threads_of(first)}, cold: {ratio:.2f}x")
    if not args.no_resume:
        print(
            f"resume of {args.scopes[-1]} on {args.layouts[-1]} on an empty cache: with the run's compile artifacts "
            f"{with_file:.1f} s, without {without:.1f} s: {without / with_file:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
