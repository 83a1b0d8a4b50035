"""A resume's first step with and without the run's compile artifacts (``compile_cache.bin``,
:mod:`dflash.run.compile_cache`), side by side in one run.

    python benchmarks/compile_cache.py                      # CPU: the embedded default, compiled
    python benchmarks/compile_cache.py --device cuda --steps 3 -- --target /models/Qwen3.6-27B ...

1. ``dflash train --compile on`` for ``--steps`` steps (cold: its own empty inductor cache);
2. ``--resume`` to twice as many steps in a fresh process whose inductor cache directory is new and
   empty (as on another host), with the run's ``compile_cache.bin``;
3. the same resume of a copy of the run without the file.

Prints each run's time from the drafter being built to its first step's log line (the step's
compile plus one step), and the ratio of 3 to 2. Flags after ``--`` pass through to ``dflash train``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

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


def train(argv: list[str], cache_dir: Path, log_path: Path) -> float:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TRITON_CACHE_DIR=str(cache_dir / "triton"))
    command = [sys.executable, "-m", "dflash", "train", *argv]
    print("$", " ".join(command), flush=True)
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    text = log_path.read_text()
    if done.returncode:
        raise SystemExit(f"dflash train failed, rc {done.returncode}:\n{text[-4000:]}")
    return first_step_seconds(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3, help="steps of the first run (the resumes double them)")
    parser.add_argument("--workdir", type=Path, default=None)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    base = ["--compile", "on", "--device", args.device, "--no-progress", "--log-every", "1", *extra]
    if args.device == "cpu" and "--cpu-threads" not in extra:
        base += ["--cpu-threads", "1"]
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="compile_cache_") as tmp:
        work = Path(tmp)
        run = work / "run"
        cold = train([*base, "--out", str(run), "--steps", str(args.steps)], work / "cache-cold", work / "cold.log")
        bare = work / "run-without-artifacts"
        shutil.copytree(run, bare)
        (bare / "compile_cache.bin").unlink()
        resume = ["--resume", "--steps", str(2 * args.steps)]
        warm = train([*base, *resume, "--out", str(run)], work / "cache-new-host-1", work / "warm.log")
        again = train([*base, *resume, "--out", str(bare)], work / "cache-new-host-2", work / "again.log")
    print(f"first step (compile + step), seconds: new run {cold:.1f}; resume on an empty inductor cache with the")
    print(f"run's compile artifacts {warm:.1f}, without them {again:.1f}: {again / warm:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
