"""Host synchronisations per training step on CUDA, counted by torch itself.

    python benchmarks/host_syncs.py            # the embedded default target, local engine, 6 steps

Builds the real trainer (``dflash train --device cuda`` on the embedded default) and runs its
engine's steps under ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every CUDA call
that makes the host wait for the device (``.item()``, ``.tolist()``, a blocking copy to the host).
The first step compiles and is not counted. Prints the synchronising calls per step and where each
came from (the innermost frame of the project's code). The design aims at one per step: the step's
statistics and grad norm, read together.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import traceback
import warnings

import torch

from dflash.config import TrainConfig
from dflash.run.settle import settle
from dflash.train.trainer import Trainer


def _origin() -> str:
    frames = [f for f in traceback.extract_stack() if "/dflash/" in f.filename and "host_syncs" not in f.filename]
    return f"{frames[-1].filename.split('/dflash/')[-1]}:{frames[-1].lineno}" if frames else "torch"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(settle(TrainConfig(device="cuda", out=out, steps=args.steps + 1, progress=False)))
        trainer.engine.run(1, lr=1e-4)  # compiles
        torch.cuda.synchronize()
        origins = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None):
            origins[_origin()] += 1

        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            for step in range(2, args.steps + 2):
                trainer.engine.run(step, lr=1e-4)
        torch.cuda.set_sync_debug_mode("default")
        trainer.engine.close()
    total = sum(origins.values())
    print(f"host synchronisations: {total} in {args.steps} steps, {total / args.steps:.2f} per step")
    for origin, count in origins.most_common():
        print(f"  {count / args.steps:6.2f} per step  {origin}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
