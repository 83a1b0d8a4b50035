"""Cost of the thread-safety patches, patched vs plain torch side by side, in fresh interpreters.

Prints four ratios (goals from the patch-engine issue):

- calls/s of a small compiled function, 1 thread, patched / plain   (goal >= 0.98)
- the same with 4 threads calling it at once                         (goal >= 0.98: the
  compile_wrapper lock is off the hot path)
- added start-up time of ``python -c pass`` with the hook            (goal <= 5 ms)
- ``import torch`` time, patched / plain                             (goal <= 1.03)

Plain and patched runs alternate (``--rounds`` each); each ratio is the median of the
per-round ratios, so drift in machine load cancels within a round, with a
distribution-free 95% interval (order statistics of the median; 6 rounds or more). The
call-loop runs are pinned to one CPU (the last this process may use; ``--no-pin`` turns
that off): cores of a VM differ in speed by up to 10%, which otherwise lands on one side
at random.

Each call-loop child first allocates a random amount of padding (seeded per round,
the same for plain and patched), so torch and the compiled function land at a different
heap layout every round (the layout bias of Mytkowicz et al., "Producing wrong data
without doing anything obviously wrong", ASPLOS 2009). Without it, what a process
allocates before importing torch shifts its call rate by ~2% either way: plain
torch after importing only the hook's modules ran 1.7% *faster* on a 2-core VM like CI's,
a bias as large as the effect measured. ``--fixed-layout`` turns the padding off.
An A/A run (plain vs plain, each side with its own layouts) prints the resolution of
the 1-thread ratio.

    python benchmarks/patch_overhead.py [--rounds 7] [--seconds 1] [--backend eager] [--no-pin]
                                        [--fixed-layout] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from importlib.metadata import version

CALLS_CHILD = r"""
import random, sys, threading, time
threads, seconds, backend, layout_seed = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
if layout_seed >= 0:
    rng = random.Random(layout_seed)
    padding = ([bytearray(rng.randrange(16, 1024)) for _ in range(rng.randrange(20000))],
               [object() for _ in range(rng.randrange(20000))])
import torch
fn = torch.compile(lambda x: x * 2 + 1, backend=backend)
x = torch.ones(8)
for _ in range(200):
    fn(x)
counts = [0] * threads
barrier = threading.Barrier(threads + 1)
def loop(i):
    barrier.wait()
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        fn(x); fn(x); fn(x); fn(x)
        n += 4
    counts[i] = n
workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
[w.start() for w in workers]
barrier.wait()
[w.join() for w in workers]
print(sum(counts) / seconds)
"""

IMPORT_CHILD = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"


def _run(code: str, args: list[str], patched: bool, cpu: int | None = None) -> float:
    env = {**os.environ, "DFLASH_PATCHES": "1" if patched else "0"}
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, check=True, capture_output=True, text=True, preexec_fn=pin
    )
    return float(out.stdout.split()[-1])


def _alternate(rounds: int, first, second) -> tuple[list[float], list[float]]:
    """``first(round)`` and ``second(round)`` for each round, alternating."""
    a, b = [], []
    for round_ in range(rounds):
        a.append(first(round_))
        b.append(second(round_))
    return a, b


def _plain_vs_patched(rounds: int, measure) -> tuple[list[float], list[float]]:
    """``_alternate`` of ``measure(patched, round)`` with patched False, then True."""
    return _alternate(rounds, lambda r: measure(False, r), lambda r: measure(True, r))


def _median_interval(values: list[float]) -> list[float] | None:
    """Distribution-free 95% interval of the median: order statistics k and n+1-k, with the
    largest k whose binomial(n, 1/2) tail leaves coverage >= 95% (None: too few values)."""
    ordered, k, below = sorted(values), 0, 0.0
    n = len(ordered)
    while k < n and (below := below + math.comb(n, k) / 2**n) <= 0.025:
        k += 1
    return None if k == 0 else [ordered[k - 1], ordered[n - k]]


def _compare(a: list[float], b: list[float], b_name: str = "patched", *, difference: bool = False) -> dict:
    """Both sides' medians and the median of the per-round ``b / a`` (or ``b - a``), with its
    95% interval: each round's two runs ran back to back, so drift cancels within a pair."""
    per_round = [y - x if difference else y / x for x, y in zip(a, b)]
    key = "difference" if difference else "ratio"
    return {
        "plain": statistics.median(a),
        b_name: statistics.median(b),
        key: statistics.median(per_round),
        f"{key}_ci95": _median_interval(per_round),
        "runs": {"plain": a, b_name: b},
    }


def _interval_text(result: dict, key: str = "ratio", scale: float = 1, digits: int = 3) -> str:
    interval = result[f"{key}_ci95"]
    ci = (
        "too few rounds for a 95% CI"
        if interval is None
        else f"95% CI {interval[0] * scale:.{digits}f} to {interval[1] * scale:.{digits}f}"
    )
    return f"{result[key] * scale:.{digits}f} ({ci})"


def _startup_seconds(patched: bool, round_: int) -> float:
    env = {**os.environ, "DFLASH_PATCHES": "1" if patched else "0"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - start


def _hook_import_ms() -> float:
    """Cumulative import time of the hook's modules at interpreter start (python -X importtime)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"],
        capture_output=True,
        text=True,
        env={**os.environ, "DFLASH_PATCHES": "1"},
    ).stderr
    total = 0
    for line in out.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s+(\S+)$", line.replace(" ", " "))
        if match and match.group(2).strip() in ("dflash.patching.startup", "dflash.patching.importhook"):
            total += int(match.group(1))
    return total / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="alternating plain/patched runs per measure")
    parser.add_argument("--seconds", type=float, default=1.0, help="call-loop duration per run")
    parser.add_argument("--backend", default="eager", help="torch.compile backend of the small function")
    parser.add_argument("--no-pin", action="store_true", help="let the call-loop runs float across CPUs")
    parser.add_argument("--fixed-layout", action="store_true", help="no random heap padding in the call-loop runs")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    cpu = None if args.no_pin else max(os.sched_getaffinity(0))

    _run(IMPORT_CHILD, [], True)  # fill the patch cache once, as any earlier run would have

    def calls(threads: int, seed_offset: int = 0):
        def measure(patched: bool, round_: int) -> float:
            seed = -1 if args.fixed_layout else round_ + seed_offset
            return _run(CALLS_CHILD, [str(threads), str(args.seconds), args.backend, str(seed)], patched, cpu)

        return measure

    pinned = "unpinned" if cpu is None else f"call loops pinned to CPU {cpu}"
    layout = "fixed heap layout" if args.fixed_layout else "heap layout randomised per round"
    # Each line is printed as soon as it is measured, so a run cut short still reports.
    print(
        f"torch {version('torch')}, backend={args.backend}, {args.rounds} alternating rounds, medians of "
        f"per-round ratios, {pinned}, {layout}",
        flush=True,
    )
    results = {"torch": version("torch"), "backend": args.backend, "rounds": args.rounds, "seconds": args.seconds}
    for threads in (1, 4):
        r = results[f"calls_per_s_{threads}_threads"] = _compare(*_plain_vs_patched(args.rounds, calls(threads)))
        print(
            f"compiled calls/s, {threads} thread(s): plain {r['plain']:,.0f}  patched {r['patched']:,.0f}  "
            f"ratio {_interval_text(r)}  (goal >= 0.98)",
            flush=True,
        )
    # The A/A sides get different layouts, so it bounds layout spread as well as drift over time.
    r = results["calls_per_s_1_thread_a_a"] = _compare(
        *_alternate(args.rounds, lambda i: calls(1)(False, i), lambda i: calls(1, seed_offset=args.rounds)(False, i)),
        "plain_again",
    )
    print(
        f"A/A control, 1 thread, plain vs plain: {r['plain']:,.0f} vs {r['plain_again']:,.0f}  "
        f"ratio {_interval_text(r)}  (the resolution of the ratios above)",
        flush=True,
    )
    r = results["python_c_pass_s"] = _compare(*_plain_vs_patched(args.rounds * 2, _startup_seconds), difference=True)
    results["hook_import_ms"] = _hook_import_ms()
    print(
        f"python -c pass: hook off {r['plain'] * 1000:.1f} ms  hook on {r['patched'] * 1000:.1f} ms  "
        f"added {_interval_text(r, 'difference', 1000, 1)} ms; hook modules' import time "
        f"{results['hook_import_ms']:.2f} ms  (goal <= 5 ms)",
        flush=True,
    )
    r = results["import_torch_s"] = _compare(*_plain_vs_patched(args.rounds, lambda p, _: _run(IMPORT_CHILD, [], p)))
    print(
        f"import torch: plain {r['plain']:.3f} s  patched {r['patched']:.3f} s  ratio {_interval_text(r)}  "
        "(goal <= 1.03)",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
