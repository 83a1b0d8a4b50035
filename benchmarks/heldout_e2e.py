"""Held-out acceptance during a run, then ``dflash eval`` of its drafter, at a public model's shape.

    python benchmarks/heldout_e2e.py --shape qwen3-8b                            # dense, one GPU
    python benchmarks/heldout_e2e.py --shape qwen3-8b --sliding-window 1024      # half its layers sliding
    python benchmarks/heldout_e2e.py --shape qwen3.6-27b --batch-size 2 --no-save   # the user's hybrid
    python benchmarks/heldout_e2e.py --tiny                                      # CPU smoke test

Flags it does not know pass through to ``dflash train`` (``--draft-intermediate-size 2048``, say).

The real path, in fresh interpreters: ``python -m dflash train --pack --eval-data ... --eval-every
N`` (held-out acceptance measured before step 1, every N steps and at the end, by the trainer on
the loaded target) and then, unless ``--no-save``, ``python -m dflash eval --json`` of the run's
last checkpoint (the target loaded again, its random weights drawn again: the acceptance of that
second measurement fits no model). The target is a random-weight model of a named public
shape, written by ``packing_e2e.write_target`` (``--sliding-window W`` turns on the shape's sliding
window for its second half of layers, Qwen3's ``max_window_layers`` rule); training and held-out
chats are synthetic (``packing_e2e.write_synthetic_chats``, other seeds).

Prints one row per held-out measurement (step, tau per prompt as z-lab counts it, tau per step,
outputs that differed from the target's greedy output, seconds, share of the run's time), the
run's steady-state throughput line, and ``dflash eval``'s figures. On a GPU the target runs in
bf16, where a differing output is an argmax tie (``dflash eval`` checks exactness in float32 on
the CPU). A random-weight target is near-uniform, so tau stays near 1 at any step: the run checks
the path at the shape (memory, time, no error), not a drafter's quality.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from packing_e2e import parse_summary, write_synthetic_chats, write_target
from runs import run_logged
from shapes import SHAPES

_HELDOUT = re.compile(r"held-out acceptance (.+?): tau .* \(([0-9.]+) s, ([0-9]+)% of the run's time so far\)")


def train_command(args, target: Path, data: Path, heldout: Path, out: Path, extra: list[str]) -> list[str]:
    flags = {
        "target": target,
        "data": data,
        "out": out,
        "device": args.device,
        "responses": "data",
        "seq-len": args.seq_len,
        "batch-size": args.batch_size,
        "max-anchors": args.max_anchors,
        "num-draft-layers": args.draft_layers,
        "steps": args.steps,
        "warmup-steps": 0,
        "log-every": 1,
        "save-every": 0,
        "eval-data": heldout,
        "eval-every": args.eval_every,
        "eval-prompts": args.prompts,
        "eval-max-new-tokens": args.max_new_tokens,
        "seed": args.seed,
    }
    if args.compile:
        flags["compile"] = args.compile
    if args.cpu_threads:
        flags["cpu-threads"] = args.cpu_threads
    argv = [item for name, value in flags.items() for item in (f"--{name}", str(value))]
    save = "--save" if args.save else "--no-save"
    # --random-target-weights: the target's files hold only its final norm (write_target).
    fixed = ["--pack", "--no-progress", "--random-target-weights", save]
    return [sys.executable, "-m", "dflash", "train", *argv, *fixed, *extra]


def eval_command(args, heldout: Path, out: Path) -> list[str]:
    flags = ["--drafter", str(out), "--data", str(heldout), "--device", args.device, "--json"]
    flags += ["--max-new-tokens", str(args.max_new_tokens), "--random-target-weights"]
    if args.cpu_threads:
        flags += ["--cpu-threads", str(args.cpu_threads)]
    return [sys.executable, "-m", "dflash", "eval", *flags]


def heldout_rows(out: Path, log: str) -> list[dict]:
    """The run's held-out measurements: ``heldout/*`` rows of its ``metrics.jsonl`` with the log's
    "when" and share of the run's time."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "heldout/tau_per_prompt" in row]
    logged = _HELDOUT.findall(log)
    if len(logged) != len(rows):
        raise SystemExit(f"{len(rows)} held-out rows in metrics.jsonl but {len(logged)} log lines")
    return [{**row, "when": when, "share_pct": float(share)} for row, (when, _, share) in zip(rows, logged)]


def print_heldout(rows: list[dict]) -> None:
    print(f"{'held-out':<22}{'step':>6}{'tau/prompt':>12}{'tau/step':>10}{'differ':>8}{'seconds':>9}{'run %':>7}")
    for row in rows:
        print(
            f"{row['when']:<22}{row['step']:>6}{row['heldout/tau_per_prompt']:>12.3f}"
            f"{row['heldout/tau_per_step']:>10.3f}{row['heldout/mismatches']:>8.0f}"
            f"{row['heldout/seconds']:>9.1f}{row['share_pct']:>7.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="target shape")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers of the shape")
    parser.add_argument(
        "--sliding-window", type=int, default=None, help="a dense shape's sliding window, on for its second half"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shape, short rows, few steps")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--conversations", type=int, default=400, help="synthetic training conversations")
    parser.add_argument("--median-tokens", type=int, default=800, help="median tokens of a synthetic chat")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-anchors", type=int, default=512)
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts per measurement")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--compile", choices=("auto", "on", "off"), default=None)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True, help="then dflash eval")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    parser.add_argument("--workdir", type=Path, default=None, help="where the target, data and run go")
    parser.add_argument("--log-dir", type=Path, default=None, help="where the logs are written as they run")
    args, extra = parser.parse_known_args(argv)
    if args.tiny:
        args.shape = args.shape if args.shape.startswith("tiny") else "tiny"
        args.device, args.compile, args.cpu_threads = "cpu", "off", args.cpu_threads or 1
        args.seq_len, args.batch_size, args.max_anchors, args.draft_layers = 256, 2, 16, 1
        args.steps, args.eval_every, args.conversations, args.median_tokens = 4, 2, 60, 60
        args.prompts, args.max_new_tokens = 2, 8

    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="heldout_e2e_") as tmp:
        work = Path(tmp)
        target = write_target(work / "target", args.shape, layers=args.layers, sliding_window=args.sliding_window)
        chats = dict(median_tokens=args.median_tokens, sigma=0.9)
        data = write_synthetic_chats(work / "train.jsonl", count=args.conversations, seed=args.seed, **chats)
        heldout = write_synthetic_chats(work / "heldout.jsonl", count=args.prompts, seed=args.seed + 1, **chats)
        out, logs = work / "run", args.log_dir or work
        logs.mkdir(parents=True, exist_ok=True)
        train = train_command(args, target, data, heldout, out, extra)
        run = run_logged(train, logs / "train.log", timeout=args.timeout).checked("dflash train")
        log = run.log
        print(f"dflash train: {run.seconds:.0f} s")
        print_heldout(heldout_rows(out, log))
        summary = next(line for line in log.splitlines()[::-1] if "steady state over" in line)
        print(summary[summary.index("steady state over") :])
        print(json.dumps({k: v for k, v in parse_summary(log).items() if k != "steps"}))
        if not args.save:
            return 0
        run = run_logged(eval_command(args, heldout, out), logs / "eval.log", timeout=args.timeout)
        run.checked("dflash eval", ok=(0, 1))  # 1: a float32 mismatch, which the report shows
        figures = json.loads(run.stdout)
        keep = ("tau_per_prompt", "tau_per_step", "mismatches", "num_prompts", "dtype", "speedup")
        print(f"dflash eval ({run.seconds:.0f} s, rc {run.returncode}):", json.dumps({k: figures.get(k) for k in keep}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
