"""Run the bug-class checks in fresh interpreters, plain vs patched, and the command line for one.

A fresh interpreter per check: on plain torch a check may leave a process-global flag set. Plain
means ``DFLASH_PATCHES=0`` in the child's environment (the import hook stays off), patched
``DFLASH_PATCHES=1``. What each child runs::

    python -m dflash.patchtools.verify.runner B --seconds 1 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import functools
import json
import os
import signal
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from dflash.patchtools.verify.catalogue import BUG_CLASSES, CHECK_SECONDS, require_class
from dflash.patchtools.verify.checks import JOIN_TIMEOUT_S, CheckResult, run_check
from dflash.patchtools.verify.cold_start import CHILD_TIMEOUT_S, MIN_RACES
from dflash.patchtools.verify.workloads import install_fake_cuda_device_guard
from dflash.watchdog import run_watched


def run_check_subprocess(bug_class: str, *, patched: bool, seconds: float) -> CheckResult:
    """Run ``run_check(bug_class, seconds=seconds)`` in a fresh interpreter, under a watchdog.

    ``patched`` sets ``DFLASH_PATCHES=1`` (the dflash patch series applied at import, verified or
    not) or ``0`` (plain torch) in the child's environment.

    A plain-torch child killed by a signal (torch crashing under the race, as the 2.6 CUDA wheel
    did on a CPU host) counts as one failure of the class, naming the signal: the race shows.

    Raises:
        dflash.watchdog.Hang: the child made no progress (every thread's stack in the message).
        RuntimeError: a patched child crashed, or a child printed no result (its output in the message).
    """
    require_class(bug_class)
    # Verifying is how a variant gets its record, so the patched run applies unverified variants too.
    env = dict(os.environ, DFLASH_PATCHES="1" if patched else "0", DFLASH_PATCHES_ALLOW_UNVERIFIED="1")
    cmd = [sys.executable, "-m", "dflash.patchtools.verify.runner", bug_class, "--seconds", str(seconds), "--json"]
    # Longest a check may take: the joins of its threads after the race, or class K's fresh interpreters.
    limit = seconds + 3 * JOIN_TIMEOUT_S + MIN_RACES * CHILD_TIMEOUT_S
    proc = run_watched(cmd, seconds=limit, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode < 0 and not patched:
        crash = f"plain torch crashed: {signal.Signals(-proc.returncode).name}"
        return CheckResult(1, 1, f"{crash}\n{proc.stderr[-2000:]}", {crash: 1})
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"`{' '.join(cmd)}` (DFLASH_PATCHES={env['DFLASH_PATCHES']}) exited with {proc.returncode}:\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    fields = json.loads(lines[-1])
    return CheckResult(**fields)


#: Seconds per check in the regression tests and the stress table: long enough that every class
#: present fails hundreds of times on plain torch 2.13 (2 cores); one value, so one run serves both.
TEST_SECONDS = 0.5


@functools.cache
def all_checks_subprocess(*, seconds: float = TEST_SECONDS) -> dict[tuple[str, bool], CheckResult]:
    """Every class, plain and patched (``run_checks_subprocess``), once per process: the
    regression tests and the stress suite's table share one run when pytest collects both."""
    return run_checks_subprocess([(c, p) for c in BUG_CLASSES for p in (False, True)], seconds=seconds)


def all_checks_shared(directory: Path, *, seconds: float = TEST_SECONDS) -> dict[tuple[str, bool], CheckResult]:
    """:func:`all_checks_subprocess` once for every process passing ``directory`` (pytest-xdist's
    workers: their base temp directory's parent, one per session): the first to come runs them and
    writes the results there, under an exclusive ``flock`` the others wait on, then read. Each
    worker ran all 24 checks of its own (about 160 CPU-seconds) when the tests were split over two."""
    path = directory / f"bug-class-checks-{seconds}s.json"
    with open(directory / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.is_file():
            saved = json.loads(path.read_text())
            return {(c, patched == "patched"): CheckResult(**r) for c, patched, r in saved}
        results = all_checks_subprocess(seconds=seconds)
        saved = [(c, "patched" if p else "plain", dataclasses.asdict(r)) for (c, p), r in results.items()]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(saved))
        tmp.replace(path)
        return results


T = TypeVar("T")


def rerun_while_passing(first: T, rerun: Callable[[int], T], failed: Callable[[T], bool], *, attempts: int) -> T:
    """``first`` if ``failed(first)``, else ``rerun(2)``, ``rerun(4)``, ... until one fails,
    ``attempts`` reruns at most; ``rerun(scale)`` gives the race ``scale`` times the chances
    (time, schedules) of the first run.

    Races are probabilistic and a loaded machine (CI) runs fewer interleavings per second; a
    result that never failed is returned as is, for the caller to fail on.
    """
    result = first
    for attempt in range(attempts):
        if failed(result):
            break
        result = rerun(2 ** (attempt + 1))
    return result


def reproduce_on_plain_torch(bug_class: str, first: CheckResult, *, seconds: float, attempts: int = 3) -> CheckResult:
    """``first`` (a plain-torch result) if it shows failures, else reruns on plain torch with twice
    the time each attempt until the race shows (:func:`rerun_while_passing`)."""
    return rerun_while_passing(
        first,
        lambda scale: run_check_subprocess(bug_class, patched=False, seconds=seconds * scale),
        lambda result: result.failures > 0,
        attempts=attempts,
    )


def run_checks_subprocess(
    runs: Iterable[tuple[str, bool]], *, seconds: float, jobs: int | None = None
) -> dict[tuple[str, bool], CheckResult]:
    """Run ``run_check_subprocess`` for each (bug_class, patched) pair of ``runs``, ``jobs`` at a time.

    ``jobs`` defaults to the number of CPUs. Returns the results keyed by the pairs.
    """
    runs = list(runs)
    for bug_class, _ in runs:
        require_class(bug_class)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        futures = {run: pool.submit(run_check_subprocess, run[0], patched=run[1], seconds=seconds) for run in runs}
        return {run: future.result() for run, future in futures.items()}


def series_states() -> dict[str, str]:
    """Each concern's state (and variant) in this interpreter, every planned module imported first."""
    import importlib

    from dflash.patching import importhook

    finder = importhook.active_finder()
    if finder is None or finder.plan is None:
        return {}
    for module in list(finder.plan.module_patches):
        importlib.import_module(module)
    return {o.name: f"{o.state} {o.patch_file or ''}".strip() for o in finder.plan.outcomes.values()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash.patchtools.verify.runner", description="Run one two-thread bug-class check."
    )
    parser.add_argument("bug_class", choices=list(BUG_CLASSES))
    parser.add_argument("--seconds", type=float, default=CHECK_SECONDS, help="race duration (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)
    install_fake_cuda_device_guard()
    result = dataclasses.replace(run_check(args.bug_class, seconds=args.seconds), series=series_states())
    if args.json:
        print(json.dumps(dataclasses.asdict(result)))
    else:
        print(f"class {args.bug_class}: {result.failures} / {result.calls} failed")
        for kind, count in sorted(result.failure_kinds.items(), key=lambda item: -item[1]):
            print(f"  {count:8d}  {kind}")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is out; a CUDA wheel on a host without a GPU can abort in the interpreter's teardown
    # ("terminate called without an active exception", 2 of 22 patched A/B children on 2.10 and 2.11,
    # 2026-12-05), which is not what the check measures.
    os._exit(code)
