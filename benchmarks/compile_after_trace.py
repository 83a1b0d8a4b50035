"""What one earlier FX trace costs later compiles and eager module calls, patched / plain, side by side.

Patch 0003 (fx-patcher-thread-isolation) lets only the tracing thread see FX's patches of
``torch.nn.Module.__call__``/``__getattr__``, through dispatchers installed in their place while a
trace runs. Dynamo keeps the original methods (``torch/_dynamo/utils.py``) and takes its fast paths
only when a module's methods are those; an eager module call through a dispatcher runs one more
Python frame. So after a trace (any ``symbolic_trace``, ``make_fx``, ``aot_eager``/inductor
compile) this measures:

- **dynamo instructions**: the bytecode instructions dynamo executes symbolically
  (``InstructionTranslatorBase.step`` calls) to compile a ``--blocks``-block ``nn.Sequential`` of
  ``Linear``+``ReLU`` blocks, backend ``eager``. Deterministic;
- **compile wall time**: the first compile of that module (``--wall-blocks`` blocks), seconds;
- **eager instructions**: the Python bytecode instructions (``sys.settrace`` opcode events) of one
  eager forward of a ``--modules``-module ``nn.Sequential``. Deterministic;
- **eager wall time**: that forward, best of ``--repeats`` timings of ``--calls`` forwards.

Each sample is a fresh interpreter (``DFLASH_PATCHES=1`` or ``0``) that runs one
``torch.fx.symbolic_trace`` of a small module first. Plain and patched interpreters alternate for
``--rounds`` pairs, order flipped every round; each measure's ratio is patched / plain within a
round, and the median over rounds is printed with its range (1.0 = no cost; the target is
<= 1.02). Also printed: whether ``Module.__call__`` is the original after the trace, and the number
of graphs each side compiled (they must match).

    python benchmarks/compile_after_trace.py --rounds 5
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
from torch._dynamo.symbolic_convert import InstructionTranslatorBase
from torch._dynamo.utils import unpatched_nn_module_call

blocks, wall_blocks, modules, calls, repeats = map(int, sys.argv[1:6])
torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)))  # the one earlier trace


def deep(n):
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(n)])


x = torch.randn(2, 8)
graphs = []


def counting_backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward


start = time.perf_counter()
torch.compile(deep(wall_blocks), backend=counting_backend)(x)
compile_s = time.perf_counter() - start

steps = [0]
step = InstructionTranslatorBase.step


def counted_step(self):
    steps[0] += 1
    return step(self)


InstructionTranslatorBase.step = counted_step
torch._dynamo.reset()
torch.compile(deep(blocks), backend=counting_backend)(x)
InstructionTranslatorBase.step = step

model = torch.nn.Sequential(*[torch.nn.ReLU() if i % 2 else torch.nn.Linear(8, 8) for i in range(modules)]).eval()
with torch.no_grad():
    for _ in range(calls // 10 + 1):
        model(x)
    opcodes = [0]

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            opcodes[0] += 1
        return tracer

    sys.settrace(tracer)
    model(x)
    sys.settrace(None)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            model(x)
        best = min(best, time.perf_counter() - start)
print(json.dumps({
    "dynamo_instructions": steps[0], "compile_s": compile_s, "eager_instructions": opcodes[0],
    "eager_us": best / calls * 1e6, "graphs": len(graphs),
    "call_is_original": torch.nn.Module.__call__ is unpatched_nn_module_call,
}))
"""

MEASURES = {
    "dynamo_instructions": "dynamo instructions to compile the deep module",
    "compile_s": "first compile of the deep module, wall time",
    "eager_instructions": "eager forward of the many-module model, Python instructions",
    "eager_us": "eager forward of the many-module model, wall time",
}


def sample(patched: bool, args: argparse.Namespace) -> dict:
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0")
    numbers = [args.blocks, args.wall_blocks, args.modules, args.calls, args.repeats]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, numbers)], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child (DFLASH_PATCHES={env['DFLASH_PATCHES']}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="plain/patched interpreter pairs (default %(default)s)")
    parser.add_argument("--blocks", type=int, default=30, help="blocks of the module whose compile is counted")
    parser.add_argument("--wall-blocks", type=int, default=150, help="blocks of the module whose compile is timed")
    parser.add_argument("--modules", type=int, default=20, help="modules of the eager model (default %(default)s)")
    parser.add_argument("--calls", type=int, default=300, help="eager forwards per timing (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="eager timings per interpreter, best kept")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    if min(args.rounds, args.blocks, args.wall_blocks, args.modules, args.calls, args.repeats) < 1:
        parser.error("--rounds, --blocks, --wall-blocks, --modules, --calls and --repeats must be >= 1")
    ratios: dict[str, list[float]] = {m: [] for m in MEASURES}
    samples = []
    for round_index in range(args.rounds):
        order = (False, True) if round_index % 2 == 0 else (True, False)
        got = {p: sample(p, args) for p in order}
        if got[True]["graphs"] != got[False]["graphs"]:
            raise RuntimeError(f"plain and patched compiled different graph counts: {got}")
        samples.append(got)
        for measure in MEASURES:
            ratios[measure].append(got[True][measure] / got[False][measure])
        print(
            f"round {round_index + 1}: "
            + "  ".join(f"{m} {got[False][m]:.4g} -> {got[True][m]:.4g}" for m in MEASURES),
            flush=True,
        )
    result = {
        measure: {
            "ratio_median": statistics.median(values),
            "ratio_min": min(values),
            "ratio_max": max(values),
            "plain_median": statistics.median(s[False][measure] for s in samples),
            "patched_median": statistics.median(s[True][measure] for s in samples),
        }
        for measure, values in ratios.items()
    }
    result["module_call_is_original_after_trace"] = {
        "plain": samples[-1][False]["call_is_original"],
        "patched": samples[-1][True]["call_is_original"],
    }
    result["graphs"] = samples[-1][True]["graphs"]
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"after one earlier trace, patched / plain, median of {args.rounds} rounds (target <= 1.02):")
    for measure, text in MEASURES.items():
        r = result[measure]
        print(
            f"  {text}: {r['ratio_median']:.3f} (range {r['ratio_min']:.3f}-{r['ratio_max']:.3f}; "
            f"plain {r['plain_median']:.4g}, patched {r['patched_median']:.4g})"
        )
    print(f"nn.Module.__call__ is the original after the trace: {result['module_call_is_original_after_trace']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
