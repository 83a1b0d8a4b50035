"""Class K: the first ``torch.compile`` and ``torch.export.export`` calls of a process, started together.

Those first calls import much of torch lazily (torch._dynamo, torch._inductor, torch._export) and
those modules import each other in cycles; in two threads at once, Python's per-module import
locks hand a thread a half-imported module (``ImportError: cannot import name 'IndentedBuffer'
from partially initialized module 'torch._inductor.utils'``) or raise ``_DeadlockError``. Each race
needs a fresh interpreter, so :func:`race_in_fresh_interpreter` runs this module as a child (the
child imports torch, and none of what those calls import, before the race)::

    python -m dflash.patchtools.verify.cold_start export compile:aot_eager compile:eager
"""

from __future__ import annotations

import json
import sys
import threading

import torch

from dflash.compile_watch import fresh_function
from dflash.patchtools.verify.workloads import install_fake_cuda_device_guard, sin_plus_one
from dflash.watchdog import Hang, run_watched

#: What the racing threads do first, released together. One export: two exports at once fail on
#: export's own process-wide state (out of scope). An export racing a compile's trace on the
#: pre-dispatch mode stack is class L (0012 makes it per thread): counted here like any failure. Two
#: compiles: with one, the import failures showed
#: in about half of the fresh processes on plain torch 2.13, with two in 3 of 4.
FIRST_CALLS = ("export", "compile:aot_eager", "compile:aot_eager")
#: Fresh processes per check at least, whatever its seconds: one takes about 13 s on 2 loaded cores.
#: On plain 2.11-2.13 about 2 in 3 of them show the import failures under load.
MIN_RACES = 3
#: Seconds one child may take (about 13 on 2 loaded cores); within the runner's limit for a check.
CHILD_TIMEOUT_S = 120.0


def race_in_fresh_interpreter(first_calls: tuple[str, ...] = FIRST_CALLS) -> list[str | None]:
    """Run ``first_calls`` (``export`` or ``compile:<backend>``, one thread each) in a fresh
    interpreter with this one's environment (so ``DFLASH_PATCHES`` as here); one entry per
    thread: None, or what went wrong there."""
    cmd = [sys.executable, "-m", __name__, *first_calls]
    try:
        proc = run_watched(cmd, seconds=CHILD_TIMEOUT_S)
    except Hang as hang:  # an import deadlock fails the race, with every thread's stack
        return [str(hang)]
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return [f"the fresh interpreter exited with {proc.returncode}: {proc.stderr.strip()[-500:]}"]
    return json.loads(lines[-1])


def _describe(exc: BaseException) -> str:
    # The whole chain: an error raised while another unwinds (the mode stack's pop at the exit of
    # an export whose trace failed on an import) must not hide the first one.
    parts: list[str] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}".strip())
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return " <- ".join(parts)


def _first_call(what: str, index: int) -> str | None:
    x = torch.randn(8)
    if what == "export":

        class Exported(torch.nn.Module):
            def forward(self, x):
                return torch.sin(x) + 1

        out = torch.export.export(Exported(), (x,)).module()(x)
    else:
        backend = what.removeprefix("compile:")
        out = torch.compile(fresh_function(sin_plus_one, index), backend=backend)(x)
    return None if torch.allclose(out, sin_plus_one(x)) else f"the first {what} computed a wrong value"


def main(argv: list[str] | None = None) -> int:
    first_calls = tuple(sys.argv[1:] if argv is None else argv) or FIRST_CALLS
    install_fake_cuda_device_guard()
    barrier = threading.Barrier(len(first_calls))
    results: list[str | None] = [None] * len(first_calls)

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = _first_call(first_calls[index], index)
        except Exception as exc:  # every exception is a failure
            results[index] = f"first {first_calls[index]}: {_describe(exc)}"[:1000]

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(first_calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CHILD_TIMEOUT_S)
    for index, thread in enumerate(threads):
        if thread.is_alive():
            results[index] = f"first {first_calls[index]}: did not finish within {CHILD_TIMEOUT_S:.0f} s"
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
