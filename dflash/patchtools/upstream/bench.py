"""Numbers for the PR descriptions: instruction counts per commit, and the project's overhead benchmark.

Instruction counts follow PyTorch's ``benchmarks/dynamo/pr_time_benchmarks`` method: prepare once
(compile and warm up), then run the work a few times, counting the instructions of each run, and
report the minimum (garbage collection off while counting, a fixed hash seed). PyTorch counts with
``perf_event_open``, which virtual machines often lack; here the count comes from callgrind
(``valgrind --tool=callgrind``), with instrumentation switched on once every setup is done and
collection only around each run (``torch._C._valgrind_toggle``), so imports, compiles and warm-up
are not counted. Each state of the stack (the tree, then each commit) is measured in its own process
on the same laid-out tree as the test runs, so the difference between two states is the cost of one
commit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from dflash.patchtools.upstream.runs import PLAIN_ENV
from dflash.patchtools.upstream.tree import UpstreamKitError

ITERATIONS = 5

# name -> (setup, prepare, work): the hot paths the stack touches, and compile time after a trace as
# pr_time_benchmarks measures it (prepare: reset dynamo, uncounted; work: compile and first call). The
# work runs ITERATIONS times, each after its prepare.
WORKLOADS = {
    "compiled_call": (
        "fn = torch.compile(lambda a: a + 1, backend='eager', fullgraph=True)\n"
        "x = torch.ones(2)\n"
        "for _ in range(10): fn(x)",
        "",
        "fn(x)",
    ),
    "compile_after_trace": (
        "torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)))\n"
        "net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(4)])\n"
        "x = torch.randn(2, 8)\n"
        "torch.compile(net, backend='eager')(x)",
        "torch._dynamo.reset()",
        "torch.compile(net, backend='eager')(x)",
    ),
    "eager_module_call_after_trace": (
        "net = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(20)])\n"
        "torch.fx.symbolic_trace(net)\n"
        "x = torch.ones(2)\n"
        "for _ in range(10): net(x)",
        "",
        "net(x)",
    ),
    "is_exporting": ("f = torch.compiler.is_exporting\nf()", "", "for _ in range(100): f()"),
    "dynamo_config_read": (
        "c = torch._dynamo.config\nc.recompile_limit",
        "",
        "for _ in range(100): c.recompile_limit",
    ),
}

# Runs every workload in one process: all setups first, uninstrumented (importing torch and compiling
# under instrumentation would take many minutes), then, once the parent has switched instrumentation on,
# ITERATIONS counted runs of each work, each dumped to its own file.
CHILD = r"""
import gc, json, sys, torch
workloads, n = json.loads(sys.argv[1]), int(sys.argv[2])
scopes = []
for setup, prepare, work in workloads:
    scope = {"torch": torch}
    exec(setup, scope)
    scopes.append((scope, compile(prepare, "prepare", "exec"), compile(work, "work", "exec")))
print("ready", flush=True)
sys.stdin.readline()
for scope, prepare, code in scopes:
    exec(prepare, scope)
    exec(code, scope)  # once instrumented, before counting
    for _ in range(n):
        exec(prepare, scope)
        gc.collect()
        gc.disable()
        torch._C._valgrind_toggle()
        exec(code, scope)
        torch._C._valgrind_toggle_and_dump_stats()
        gc.enable()
"""


def callgrind_available() -> bool:
    return shutil.which("valgrind") is not None


def _dump_totals(folder: Path) -> list[int]:
    """Instruction totals of the per-run dumps (``callgrind.out.<pid>.<n>``, n >= 1), in order."""
    dumps = sorted(
        (p for p in folder.glob("callgrind.out.*") if re.fullmatch(r"callgrind\.out\.\d+\.\d+", p.name)),
        key=lambda p: int(p.name.rsplit(".", 1)[1]),
    )
    totals = []
    for dump in dumps:
        match = re.search(r"^(?:summary|totals):\s*(\d+)", dump.read_text(errors="replace"), re.M)
        if match:
            totals.append(int(match.group(1)))
    return totals


def count_instructions(python: str, root: Path) -> dict[str, int]:
    """Per workload of :data:`WORKLOADS`, the minimum instruction count of its work, with ``import torch``
    from ``root``; one callgrind process.

    Raises:
        UpstreamKitError: valgrind is missing or the run failed.
    """
    if not callgrind_available():
        raise UpstreamKitError("valgrind is not installed (apt-get install valgrind); needed for instruction counts")
    # A fixed hash seed: dict and set layouts (and so instruction counts) otherwise differ per process.
    env = {**os.environ, **PLAIN_ENV, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--collect-atstart=no",
            f"--callgrind-out-file={tmp}/callgrind.out.%p",
            python,
            "-c",
            CHILD,
            json.dumps(list(WORKLOADS.values())),
            str(ITERATIONS),
        ]
        proc = subprocess.Popen(
            command, cwd=tmp, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        if proc.stdout.readline().strip() == "ready":
            subprocess.run(["callgrind_control", "--instr=on", str(proc.pid)], capture_output=True, check=False)
            proc.stdin.write("go\n")
            proc.stdin.flush()
        _, stderr = proc.communicate()
        totals = _dump_totals(Path(tmp))
    expected = ITERATIONS * len(WORKLOADS)
    if proc.returncode != 0 or len(totals) < expected:
        raise UpstreamKitError(f"callgrind run failed (exit {proc.returncode}): {stderr.strip()[-800:]}")
    totals = totals[-expected:]
    return {name: min(totals[i * ITERATIONS : (i + 1) * ITERATIONS]) for i, name in enumerate(WORKLOADS)}


def overhead_rows(benchmark_json: Path) -> tuple[dict, list[tuple[int, dict]]]:
    """(the JSON, ``[(threads, result)]``) of ``benchmarks/patch_overhead.py --json`` output.

    Raises:
        UpstreamKitError: unreadable, or no ``calls_per_s_<N>_threads`` entries.
    """
    try:
        data = json.loads(benchmark_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UpstreamKitError(f"cannot read the benchmark JSON {benchmark_json}: {error}") from None
    rows = sorted((int(m.group(1)), v) for k, v in data.items() if (m := re.fullmatch(r"calls_per_s_(\d+)_threads", k)))
    if not rows:
        raise UpstreamKitError(
            f"{benchmark_json} has no calls_per_s_<N>_threads entries: write it with "
            "`python benchmarks/patch_overhead.py --json PATH`"
        )
    return data, rows


def ratio_cell(result: dict) -> str:
    # JSON from too few rounds has no interval.
    if not result.get("ratio_ci95"):
        return f"{result['ratio']:.3f}"
    low, high = result["ratio_ci95"]
    return f"{result['ratio']:.3f} (95% CI {low:.3f} to {high:.3f})"
