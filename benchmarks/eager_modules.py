"""Eager forward of a many-module model after one FX trace, patched vs plain torch, side by side.

Patch 0003 (fx-patcher-thread-isolation) replaces ``torch.nn.Module.__call__`` and
``__getattr__`` with thread-dispatching functions the first time any thread traces, and keeps them
installed for the life of the process (a dynamo compile in another thread may guard on the value
it read there). Every eager module call afterwards goes through one more Python frame. This
measures what that costs where it is felt most: eager forwards of models made of many small
modules (a target model's eager forward in training, step-by-step decoding in ``dflash eval``).

Method: each sample is a fresh interpreter (``DFLASH_PATCHES=1`` or ``0``) that builds the model,
runs one ``torch.fx.symbolic_trace`` of a small module (which installs the dispatchers when
patched), warms up, then times ``--calls`` forwards (``time.perf_counter``, best of ``--repeats``).
Plain and patched interpreters alternate, ``--rounds`` pairs, order flipped every round; each
round gives a ratio plain time / patched time (1.0 = no cost; the goal is >= 0.98), and the median
of the rounds is printed with the range. On a loaded machine interpreters differ by more than the
effect, so each patched interpreter also times, in alternating blocks, the original
``Module.__call__``/``__getattr__`` against the installed dispatchers (in-process A/B: same heap,
same moment). Also printed: whether ``Module.__call__`` is still the original after the trace.

    python benchmarks/eager_modules.py --rounds 8 --modules 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch

original_call = torch.nn.Module.__call__
original_getattr = torch.nn.Module.__getattr__
modules, calls, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
layers = []
for _ in range(modules // 2):
    layers += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers).eval()
x = torch.randn(1, 8)
torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8)))  # one trace, as any compile does
with torch.no_grad():
    for _ in range(calls // 10 + 1):
        model(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            model(x)
        best = min(best, time.perf_counter() - start)
    # In-process A/B: the installed functions vs the originals, alternating blocks of forwards in this
    # one interpreter (single-threaded, so swapping them back and forth here is safe).
    installed = (torch.nn.Module.__call__, torch.nn.Module.__getattr__)
    times = {True: [], False: []}
    for block in range(4 * repeats):
        use_original = block % 2 == 0
        pair = (original_call, original_getattr) if use_original else installed
        torch.nn.Module.__call__, torch.nn.Module.__getattr__ = pair
        start = time.perf_counter()
        for _ in range(calls // 4 + 1):
            model(x)
        times[use_original].append(time.perf_counter() - start)
    torch.nn.Module.__call__, torch.nn.Module.__getattr__ = installed
in_process = min(times[True]) / min(times[False])
print(json.dumps({"us_per_forward": best / calls * 1e6, "call_is_original": installed[0] is original_call,
                  "in_process_ratio": in_process}))
"""


def sample(patched: bool, modules: int, calls: int, repeats: int) -> dict:
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0", DFLASH_PATCHES_ALLOW_UNVERIFIED="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(modules), str(calls), str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child (DFLASH_PATCHES={env['DFLASH_PATCHES']}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="plain/patched interpreter pairs (default 8)")
    parser.add_argument("--modules", type=int, default=100, help="module calls per forward (default 100)")
    parser.add_argument("--calls", type=int, default=300, help="forwards per timing (default 300)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per interpreter, best kept (default 5)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    if min(args.rounds, args.modules, args.calls, args.repeats) < 1:
        parser.error("--rounds, --modules, --calls and --repeats must be >= 1")
    ratios, plain_us, patched_us, in_process, identity = [], [], [], [], {}
    for round_index in range(args.rounds):
        order = (False, True) if round_index % 2 == 0 else (True, False)
        got = {p: sample(p, args.modules, args.calls, args.repeats) for p in order}
        plain_us.append(got[False]["us_per_forward"])
        patched_us.append(got[True]["us_per_forward"])
        ratios.append(plain_us[-1] / patched_us[-1])
        in_process.append(got[True]["in_process_ratio"])
        identity = {"plain": got[False]["call_is_original"], "patched": got[True]["call_is_original"]}
        print(
            f"round {round_index + 1}: plain {plain_us[-1]:8.1f} us  patched {patched_us[-1]:8.1f} us  "
            f"ratio {ratios[-1]:.3f}  in-process original/installed {in_process[-1]:.3f}",
            flush=True,
        )
    result = {
        "modules": args.modules,
        "plain_us_median": statistics.median(plain_us),
        "patched_us_median": statistics.median(patched_us),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "in_process_ratio_median": statistics.median(in_process),
        "in_process_ratio_min": min(in_process),
        "in_process_ratio_max": max(in_process),
        "module_call_is_original_after_trace": identity,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"eager forward of {args.modules} module calls after one trace: plain {result['plain_us_median']:.1f} us, "
            f"patched {result['patched_us_median']:.1f} us; speed ratio plain/patched median "
            f"{result['ratio_median']:.3f} (range {result['ratio_min']:.3f}-{result['ratio_max']:.3f}, "
            f"{args.rounds} rounds; goal >= 0.98)"
        )
        print(
            f"in-process A/B in the patched interpreters (the originals vs the installed dispatchers, alternating "
            f"blocks): speed ratio median {result['in_process_ratio_median']:.3f} "
            f"(range {result['in_process_ratio_min']:.3f}-{result['in_process_ratio_max']:.3f})"
        )
        print(f"nn.Module.__call__ is the original after the trace: {identity}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
